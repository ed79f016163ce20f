package valkey

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/kverr"
	"github.com/kvplug/kvplug/internal/logx"
	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/kvplug/kvplug/internal/resp"
	"github.com/zeebo/xxh3"
)

// logs collects the library's log lines for the rest of the test.
type logs struct {
	mu    sync.Mutex
	lines []string
}

func captureLogs(t *testing.T) *logs {
	l := &logs{}
	logx.SetSink(func(_ logx.Level, msg string) {
		l.mu.Lock()
		l.lines = append(l.lines, msg)
		l.mu.Unlock()
	}, logx.Debug)
	t.Cleanup(func() { logx.SetSink(nil, logx.Off) })
	return l
}

func (l *logs) text() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

// secretFile writes v to a file of t's and returns its path.
func secretFile(t *testing.T, name string, v []byte) string {
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, v, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// admin sends one command to addr as the default user (with password pw
// when not nil).
func admin(t *testing.T, addr string, pw []byte, args ...[]byte) any {
	t.Helper()
	o := resp.Options{DialTimeout: 2 * time.Second, OpTimeout: 2 * time.Second}
	if pw != nil {
		o.Auth = func() (string, []byte, error) { return "", pw, nil }
	}
	c := resp.NewClientOptions(addr, o)
	defer c.Close()
	r, err := c.Do([][][]byte{args})
	if err != nil {
		t.Fatal(err)
	}
	return r[0]
}

func bs(ss ...string) [][]byte {
	out := make([][]byte, len(ss))
	for i, s := range ss {
		out[i] = []byte(s)
	}
	return out
}

// dbsize is how many keys the server holds.
func dbsize(t *testing.T, addr string, pw []byte) int64 {
	n, _ := admin(t, addr, pw, []byte("DBSIZE")).(int64)
	return n
}

// noSecret fails t when s holds secret (or its printable part).
func noSecret(t *testing.T, what, s string, secret []byte) {
	t.Helper()
	if strings.Contains(s, string(secret)) {
		t.Fatalf("%s holds the secret: %q", what, s)
	}
	if p := strings.TrimFunc(string(secret), func(r rune) bool { return r < ' ' || r > '~' }); len(p) >= 4 && strings.Contains(s, p) {
		t.Fatalf("%s holds the secret's printable part: %q", what, s)
	}
}

// An ACL user whose password has spaces and binary bytes, read from a
// file; the default user's password from an environment variable; a
// password file rotated and read again by the next connection.
func TestAuth(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	pw := []byte("pass word \x01\x7f\xfe tail")
	if r := admin(t, srv.Addr(), nil, []byte("ACL"), []byte("SETUSER"), []byte("kv"), []byte("on"), append([]byte(">"), pw...),
		[]byte("~kvplug:*"), []byte("+get"), []byte("+set"), []byte("+exists")); r != "OK" {
		t.Fatalf("ACL SETUSER: %v", r)
	}
	file := secretFile(t, "pw", append(bytes.Clone(pw), '\n'))
	tr := newTier(t, Config{Addr: srv.Addr(), Fingerprint: 1, OpTimeout: time.Second, Username: "kv", Password: Secret{File: file}})
	p := payload(1, 512)
	if tr.Put(hs(1), [][]byte{p}) != 1 || !bytes.Equal(tr.Get(hs(1))[0], p) || !tr.Exists(hs(1))[0] {
		t.Fatalf("with the right credentials: %v", tr.Stats())
	}
	if st := tr.Stats(); st.AuthFailures != 0 || st.Errors != 0 {
		t.Fatalf("stats %v", st)
	}

	// Rotation: the user's password changes, the file follows, and the
	// next connection reads the new one.
	pw2 := []byte("second \x00 password")
	admin(t, srv.Addr(), nil, bs("ACL", "SETUSER", "kv", "resetpass", ">"+string(pw2))...)
	if err := os.WriteFile(file, pw2, 0o600); err != nil {
		t.Fatal(err)
	}
	tr.c.Reset() // the next call connects anew
	if !bytes.Equal(tr.Get(hs(1))[0], p) {
		t.Fatalf("after the rotation: %v", tr.Stats())
	}

	// The default user's password, from the environment.
	admin(t, srv.Addr(), nil, bs("CONFIG", "SET", "requirepass", "default secret")...)
	adminPW := []byte("default secret")
	t.Setenv("KVPLUG_TEST_PASSWORD", "default secret")
	def := newTier(t, Config{Addr: srv.Addr(), Fingerprint: 1, OpTimeout: time.Second, Password: Secret{Env: "KVPLUG_TEST_PASSWORD"}})
	if !bytes.Equal(def.Get(hs(1))[0], p) {
		t.Fatalf("password only: %v", def.Stats())
	}
	if n := dbsize(t, srv.Addr(), adminPW); n != 1 {
		t.Fatalf("%d keys", n)
	}
}

// Wrong password, unknown user, no credentials on a server that wants
// them, a user without SET: each a counted fault, nothing stored, no
// secret in the logs.
func TestAuthFailures(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	good := []byte("the right one")
	wrong := []byte("wrong \x02 password")
	admin(t, srv.Addr(), nil, bs("ACL", "SETUSER", "kv", "on", ">"+string(good), "~*", "+get", "+set", "+exists")...)
	admin(t, srv.Addr(), nil, bs("ACL", "SETUSER", "reader", "on", ">"+string(good), "~*", "+get", "+exists")...)
	admin(t, srv.Addr(), nil, bs("CONFIG", "SET", "requirepass", string(good))...)
	l := captureLogs(t)
	wrongFile := secretFile(t, "wrong", wrong)
	goodFile := secretFile(t, "good", good)
	for _, c := range []struct {
		name string
		cfg  Config
	}{
		{"wrong password", Config{Username: "kv", Password: Secret{File: wrongFile}}},
		{"wrong default password", Config{Password: Secret{File: wrongFile}}},
		{"unknown user", Config{Username: "nobody", Password: Secret{File: wrongFile}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.cfg.Addr, c.cfg.Fingerprint, c.cfg.OpTimeout, c.cfg.Backoff = srv.Addr(), 1, time.Second, time.Hour
			tr := newTier(t, c.cfg)
			timed(t, "Put with wrong credentials", func() {
				if tr.Put(hs(1), [][]byte{payload(1, 64)}) != 0 {
					t.Fatal("stored")
				}
			})
			// Each path (stores, lookups) fails once, then is skipped.
			if got := tr.Get(hs(1)); got[0] != nil {
				t.Fatal("a hit")
			}
			if tr.Put(hs(1), [][]byte{payload(1, 64)}) != 0 || tr.Exists(hs(1))[0] {
				t.Fatal("a call in the skip window did something")
			}
			st := tr.Stats()
			if st.AuthFailures != 2 || st.Errors != 2 || st.Skipped != 2 || st.Available || st.TLSFailures != 0 {
				t.Fatalf("stats %v", st)
			}
		})
	}
	t.Run("no credentials", func(t *testing.T) {
		tr := newTier(t, Config{Addr: srv.Addr(), Fingerprint: 1, OpTimeout: time.Second})
		if tr.Put(hs(1, 2), [][]byte{payload(1, 64), payload(2, 64)}) != 0 || tr.Get(hs(1))[0] != nil || tr.Exists(hs(1))[0] {
			t.Fatal("a NOAUTH call did something")
		}
		if st := tr.Stats(); st.AuthFailures != 3 || st.Errors != 4 || st.Stores != 0 {
			t.Fatalf("stats %v", st)
		}
	})
	t.Run("a user without SET", func(t *testing.T) {
		tr := newTier(t, Config{Addr: srv.Addr(), Fingerprint: 1, OpTimeout: time.Second, Username: "reader", Password: Secret{File: goodFile}})
		if tr.Put(hs(1, 2), [][]byte{payload(1, 64), payload(2, 64)}) != 0 {
			t.Fatal("stored")
		}
		if st := tr.Stats(); st.AuthFailures != 1 || st.Errors != 2 || st.Stores != 0 || !st.Available {
			t.Fatalf("stats %v", st)
		}
		if tr.Get(hs(1))[0] != nil || tr.Stats().Misses != 1 || tr.Stats().AuthFailures != 1 {
			t.Fatalf("the reader's GET: %v", tr.Stats())
		}
	})
	if n := dbsize(t, srv.Addr(), good); n != 0 {
		t.Fatalf("%d keys stored", n)
	}
	text := l.text()
	if !strings.Contains(text, "authentication failed") || !strings.Contains(text, "NOPERM") {
		t.Fatalf("the failures are not logged:\n%s", text)
	}
	noSecret(t, "the log", text, wrong)
	noSecret(t, "the log", text, good)
}

// Secrets in the wrong place or missing are refused at New, with messages
// that do not hold them.
func TestSecretConfigErrors(t *testing.T) {
	secret := "s3cret-Passw0rd"
	t.Setenv("KVPLUG_EMPTY", "")
	missing := filepath.Join(t.TempDir(), "missing")
	empty := secretFile(t, "empty", []byte("\n"))
	for _, c := range []struct {
		name string
		cfg  Config
	}{
		{"the secret as an env name", Config{Password: Secret{Env: secret + " x"}}},
		{"an unset env", Config{Password: Secret{Env: "KVPLUG_UNSET_VARIABLE"}}},
		{"an empty env", Config{Password: Secret{Env: "KVPLUG_EMPTY"}}},
		{"a missing file", Config{Password: Secret{File: missing}}},
		{"an empty file", Config{Password: Secret{File: empty}}},
		{"two places", Config{Password: Secret{Env: "A", Value: []byte(secret)}}},
		{"a user without a password", Config{Username: "kv"}},
		{"a user with a space", Config{Username: "k v", Password: Secret{Value: []byte(secret)}}},
		{"MAC keys not hex", Config{MACKeys: Secret{Value: []byte(secret + secret + secret)}}},
		{"a short MAC key", Config{MACKeys: Secret{Value: []byte("00112233")}}},
		{"three MAC keys", Config{MACKeys: Secret{Value: []byte(strings.Repeat("ab", 16) + " " + strings.Repeat("cd", 16) + "," + strings.Repeat("ef", 16))}}},
		{"twice the same MAC key", Config{MACKeys: Secret{Value: []byte(strings.Repeat("ab", 16) + "\n" + strings.Repeat("ab", 16))}}},
		{"a TLS certificate without its key", Config{TLS: &TLS{CertFile: "x.pem"}}},
		{"a missing CA file", Config{TLS: &TLS{CAFile: missing}}},
		{"a CA file without certificates", Config{TLS: &TLS{CAFile: empty}}},
	} {
		c.cfg.Addr, c.cfg.Namespace = "127.0.0.1:1", "x"
		_, err := New(c.cfg)
		if !kverr.Is(err, kverr.InvalidArgument) {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		noSecret(t, c.name, err.Error(), []byte(secret))
		noSecret(t, c.name, err.Error(), []byte(strings.Repeat("ab", 16)))
	}
	// A Secret prints where it is, never its value.
	s := Secret{Value: []byte(secret)}
	for _, f := range []string{s.String(), s.GoString()} {
		noSecret(t, "a printed Secret", f, []byte(secret))
	}
	if cfg := (Config{Addr: "a:1", Namespace: "x", Password: s, OpTimeout: -1}); cfg.Check() == nil {
		t.Fatal("a negative timeout accepted")
	} else {
		noSecret(t, "Check's error", cfg.Check().Error(), []byte(secret))
	}
}

func tlsTier(t *testing.T, addr string, tc *TLS) *Tier {
	return newTier(t, Config{Addr: addr, Fingerprint: 1, OpTimeout: 2 * time.Second, Backoff: time.Hour, TLS: tc})
}

// TLS against a server with a certificate of the test's CA, with and
// without a client certificate, and with the server name given.
func TestTLS(t *testing.T) {
	bin := redistest.Find(t)
	certs := redistest.NewCerts(t)
	srv := redistest.StartTLS(t, bin, redistest.TLSServer{Certs: certs})
	p := payload(3, 4096)
	tr := tlsTier(t, srv.Addr(), &TLS{CAFile: certs.CA})
	if tr.Put(hs(3), [][]byte{p}) != 1 || !bytes.Equal(tr.Get(hs(3))[0], p) {
		t.Fatalf("over TLS: %v", tr.Stats())
	}
	if st := tr.Stats(); st.TLSFailures != 0 || st.Errors != 0 {
		t.Fatalf("stats %v", st)
	}
	// localhost is in the certificate too.
	if got := tlsTier(t, srv.Addr(), &TLS{CAFile: certs.CA, ServerName: "localhost"}).Get(hs(3)); !bytes.Equal(got[0], p) {
		t.Fatal("with the server name localhost")
	}

	mutual := redistest.StartTLS(t, bin, redistest.TLSServer{Certs: certs, ClientCerts: true})
	withCert := tlsTier(t, mutual.Addr(), &TLS{CAFile: certs.CA, CertFile: certs.ClientCert, KeyFile: certs.ClientKey})
	if withCert.Put(hs(4), [][]byte{p}) != 1 || !bytes.Equal(withCert.Get(hs(4))[0], p) {
		t.Fatalf("with a client certificate: %v", withCert.Stats())
	}
	noCert := tlsTier(t, mutual.Addr(), &TLS{CAFile: certs.CA})
	if noCert.Put(hs(5), [][]byte{p}) != 0 || noCert.Get(hs(4))[0] != nil {
		t.Fatal("without the client certificate the server wants")
	}
	// The store and the lookup each failed on their own connection.
	if st := noCert.Stats(); st.TLSFailures != 2 || st.Errors != 2 || st.Available {
		t.Fatalf("without a client certificate: %v", st)
	}

	// A server with a certificate for another name: refused, unless the
	// tier names it.
	named := redistest.StartTLS(t, bin, redistest.TLSServer{Certs: certs, Cert: certs.WrongNameCert, Key: certs.WrongNameKey})
	if got := tlsTier(t, named.Addr(), &TLS{CAFile: certs.CA, ServerName: "other.invalid"}).Get(hs(9)); got[0] != nil {
		t.Fatal("a hit on an empty server")
	}
}

// Every way TLS can fail is a counted, logged fault that skips the
// server; nothing is ever sent in plaintext; a plaintext client of a TLS
// server fails too.
func TestTLSFailures(t *testing.T) {
	bin := redistest.Find(t)
	certs := redistest.NewCerts(t)
	l := captureLogs(t)
	good := redistest.StartTLS(t, bin, redistest.TLSServer{Certs: certs})
	expired := redistest.StartTLS(t, bin, redistest.TLSServer{Certs: certs, Cert: certs.ExpiredCert, Key: certs.ExpiredKey})
	named := redistest.StartTLS(t, bin, redistest.TLSServer{Certs: certs, Cert: certs.WrongNameCert, Key: certs.WrongNameKey})
	other := redistest.StartTLS(t, bin, redistest.TLSServer{Certs: certs, Cert: certs.OtherServerCert, Key: certs.OtherSrvKey})
	plain := redistest.Start(t, bin, 0)
	for _, c := range []struct {
		name, addr, want string
		tc               *TLS
	}{
		{"wrong CA", good.Addr(), "unknown authority", &TLS{CAFile: certs.OtherCA}},
		{"the system roots for a private CA", good.Addr(), "unknown authority", &TLS{}},
		{"a server certificate of another CA", other.Addr(), "unknown authority", &TLS{CAFile: certs.CA}},
		{"expired certificate", expired.Addr(), "expired", &TLS{CAFile: certs.CA}},
		{"wrong server name", named.Addr(), "for 127.0.0.1 because", &TLS{CAFile: certs.CA}},
		{"a server name the certificate lacks", good.Addr(), "other.invalid", &TLS{CAFile: certs.CA, ServerName: "other.invalid"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			logged := len(l.lines)
			tr := tlsTier(t, c.addr, c.tc)
			timed(t, "a failing handshake", func() {
				if tr.Put(hs(1), [][]byte{payload(1, 64)}) != 0 {
					t.Fatal("stored")
				}
			})
			// The lookups fail once on their own connection, then both
			// paths are skipped.
			if tr.Get(hs(1))[0] != nil || tr.Exists(hs(1))[0] || tr.Put(hs(1), [][]byte{payload(1, 64)}) != 0 {
				t.Fatal("a hit")
			}
			st := tr.Stats()
			if st.TLSFailures != 2 || st.Errors != 2 || st.Skipped != 2 || st.Available {
				t.Fatalf("stats %v", st)
			}
			l.mu.Lock()
			text := strings.Join(l.lines[logged:], "\n")
			l.mu.Unlock()
			if !strings.Contains(text, "TLS failed") || !strings.Contains(text, c.want) {
				t.Fatalf("the log does not say %q:\n%s", c.want, text)
			}
		})
	}
	// A TLS tier on a plaintext server: the server takes the ClientHello
	// for the start of an inline command and waits for its end, or
	// answers an error that is no TLS record: a timeout or a TLS failure,
	// never a command sent in plaintext.
	tr := newTier(t, Config{Addr: plain.Addr(), Fingerprint: 1, OpTimeout: 300 * time.Millisecond, Backoff: time.Hour, TLS: &TLS{CAFile: certs.CA}})
	timed(t, "TLS on a plaintext port", func() {
		if tr.Put(hs(1), [][]byte{payload(1, 64)}) != 0 || tr.Get(hs(1))[0] != nil {
			t.Fatal("a TLS tier succeeded on a plaintext server")
		}
	})
	timed(t, "the skip windows", func() {
		if tr.Put(hs(1), [][]byte{payload(1, 64)}) != 0 || tr.Get(hs(1))[0] != nil {
			t.Fatal("a TLS tier succeeded on a plaintext server")
		}
	})
	if st := tr.Stats(); st.Timeouts+st.TLSFailures != 2 || st.Skipped != 2 || st.Available {
		t.Fatalf("TLS on plaintext: %v", st)
	}
	if n := dbsize(t, plain.Addr(), nil); n != 0 {
		t.Fatalf("the plaintext server holds %d keys", n)
	}

	// A plaintext tier on a TLS-only server: a fault, counted, skipped.
	tr = newTier(t, Config{Addr: good.Addr(), Fingerprint: 1, OpTimeout: 500 * time.Millisecond, Backoff: time.Hour})
	timed(t, "plaintext on a TLS port", func() {
		if tr.Put(hs(1), [][]byte{payload(1, 64)}) != 0 || tr.Get(hs(1))[0] != nil {
			t.Fatal("a plaintext call succeeded on a TLS port")
		}
	})
	timed(t, "the skip windows", func() {
		if tr.Put(hs(1), [][]byte{payload(1, 64)}) != 0 || tr.Get(hs(1))[0] != nil {
			t.Fatal("a plaintext call succeeded on a TLS port")
		}
	})
	if st := tr.Stats(); st.Errors+st.Timeouts != 2 || st.Skipped != 2 || st.Available {
		t.Fatalf("plaintext on TLS: %v", st)
	}
}

const (
	keyA = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
	keyB = "f0e1d2c3b4a5968778695a4b3c2d1e0f00112233445566778899aabbccddeeff"
)

func macTier(t *testing.T, addr, keys string) *Tier {
	cfg := Config{Addr: addr, Fingerprint: 7, BlockBytes: 256, OpTimeout: time.Second}
	if keys != "" {
		cfg.MACKeys = Secret{Value: []byte(keys)}
	}
	return newTier(t, cfg)
}

// Values with a MAC: written and read by tiers that share a key; a value
// without a MAC, with a key not accepted, altered with its checksum
// fixed, moved to another block or namespace, or truncated is a miss,
// counted; rotation through two keys.
func TestMAC(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	a := macTier(t, srv.Addr(), keyA)
	p := payload(1, 256)
	if a.Put(hs(1), [][]byte{p}) != 1 || !bytes.Equal(a.Get(hs(1))[0], p) {
		t.Fatalf("round trip: %v", a.Stats())
	}
	v, _ := raw(t, srv.Addr(), []byte("GET"), []byte(a.Key(hashOf(1)))).([]byte)
	if len(v) != HeaderBytes+MACBytes+256 || binary.LittleEndian.Uint16(v[6:]) != FlagMAC {
		t.Fatalf("a MAC value of %d bytes, flags %d", len(v), binary.LittleEndian.Uint16(v[6:]))
	}
	want, err := EncodeMAC("test", hashOf(1), 7, []byte(keyA), p)
	if err != nil || !bytes.Equal(v, want) {
		t.Fatalf("EncodeMAC differs from the stored value: %v", err)
	}

	// Rotation: "B,A" reads A's values and writes B's; "A,B" reads those.
	ba := macTier(t, srv.Addr(), keyB+","+keyA)
	if !bytes.Equal(ba.Get(hs(1))[0], p) {
		t.Fatal("the new key's tier misses the old key's value")
	}
	p2 := payload(2, 256)
	if ba.Put(hs(2), [][]byte{p2}) != 1 {
		t.Fatal("put")
	}
	if !bytes.Equal(macTier(t, srv.Addr(), keyA+"\n"+keyB).Get(hs(2))[0], p2) {
		t.Fatal("a tier accepting the new key misses its value")
	}
	// A tier that knows only A refuses B's values, and the reverse.
	if a.Get(hs(2))[0] != nil || macTier(t, srv.Addr(), keyB).Get(hs(1))[0] != nil {
		t.Fatal("a value of a key not accepted was served")
	}
	if st := a.Stats(); st.MACFailures != 1 || st.Corrupt != 1 {
		t.Fatalf("stats %v", st)
	}

	// Forgeries and accidents.
	noMAC := macTier(t, srv.Addr(), "")
	noMAC.Put(hs(3), [][]byte{payload(3, 256)})
	set := func(h uint64, v []byte) { raw(t, srv.Addr(), []byte("SET"), []byte(a.Key(hashOf(h))), v) }
	// Block 1's value under block h's key, with its hash rewritten to h's
	// (and so its checksum, of the payload, still right).
	retarget := func(v []byte, h uint64) []byte {
		x := hashOf(h)
		copy(v[8:24], x[:])
		return v
	}
	tampered := retarget(bytes.Clone(v), 4)
	tampered[HeaderBytes+MACBytes+10] ^= 1
	binary.LittleEndian.PutUint64(tampered[40:], xxh3.Hash(tampered[HeaderBytes+MACBytes:]))
	set(4, tampered)
	set(5, retarget(bytes.Clone(v), 5)) // the MAC covers the hash
	set(6, retarget(bytes.Clone(v[:len(v)-1]), 6))
	forged := retarget(bytes.Clone(v), 7)
	copy(forged[HeaderBytes+8:], bytes.Repeat([]byte{0x55}, 32))
	set(7, forged)
	otherNS, _ := EncodeMAC("other", hashOf(8), 7, []byte(keyA), payload(8, 256))
	set(8, otherNS)
	set(9, v) // block 1's value, unchanged, under block 9's key: its hash check refuses it
	before := a.Stats()
	got := a.Get(hs(3, 4, 5, 6, 7, 8, 9))
	for i, g := range got {
		if g != nil {
			t.Fatalf("value %d served", i)
		}
	}
	st := a.Stats()
	if st.Corrupt-before.Corrupt != 7 || st.MACFailures-before.MACFailures != 5 || st.Hits != before.Hits {
		t.Fatalf("before %v\nafter %v", before, st)
	}
	// A tier without a MAC refuses MAC values too.
	if noMAC.Get(hs(1))[0] != nil {
		t.Fatal("a tier without a MAC served a MAC value")
	}
	if !strings.Contains(a.Stats().String(), "mac failures") {
		t.Fatal(a.Stats().String())
	}
}

// The keys' text: hex, one or two, separated by white space or a comma,
// a trailing newline allowed (a file).
func TestMACKeysParse(t *testing.T) {
	for _, s := range []string{keyA, keyA + "\n", " " + keyA + " , " + keyB + "\r\n", strings.Repeat("ab", 128)} {
		if _, err := parseMACKeys([]byte(s)); err != nil {
			t.Errorf("%q: %v", s, err)
		}
	}
	k, _ := hex.DecodeString(keyA)
	if a, b := newMACKey(k), newMACKey(append(k, 0)); a.id == b.id {
		t.Fatal("two keys with one id")
	}
}

// The cost of the MAC alone: verifying a 64 KiB value (signing costs the
// same).
func BenchmarkMACVerify64KiB(b *testing.B) {
	mk, err := parseMACKeys([]byte(keyA))
	if err != nil {
		b.Fatal(err)
	}
	tr := &Tier{cfg: Config{Namespace: "bench"}, mac: mk, flags: FlagMAC, header: HeaderBytes + MACBytes}
	p := payload(1, 64<<10)
	v := appendHeader(make([]byte, 0, HeaderBytes+MACBytes+len(p)), hashOf(1), 1, FlagMAC, p)
	v = append(tr.appendMAC(v, p), p...)
	b.SetBytes(int64(len(p)))
	for b.Loop() {
		if !tr.verifyMAC(v) {
			b.Fatal("verify")
		}
	}
}

// The reference the MAC's choice is measured against (security.go): the
// standard library's HMAC-SHA-256 over the same 64 KiB payload.
func BenchmarkHMACSHA256_64KiB(b *testing.B) {
	k, _ := hex.DecodeString(keyA)
	h := hmac.New(sha256.New, k)
	p := payload(1, 64<<10)
	var tag [32]byte
	b.SetBytes(int64(len(p)))
	for b.Loop() {
		h.Reset()
		h.Write(p)
		h.Sum(tag[:0])
	}
}

// With a MAC, another layout's fingerprint is logged only from a value
// whose MAC verifies: a header anyone who can write to the server could
// forge says nothing about who shares the namespace.
func TestForeignLayoutWithAMACNeedsAnAuthenticValue(t *testing.T) {
	logs := captureLogs(t)
	srv := redistest.Start(t, redistest.Find(t), 0)
	b := macTier(t, srv.Addr(), keyA) // fingerprint 7
	// A value of block i by a writer of fingerprint 8 and MAC key key,
	// stored under the block's key and read back by b: a miss.
	readForeign := func(i uint64, key string) {
		t.Helper()
		v, err := EncodeMAC("test", hashOf(i), 8, []byte(key), payload(i, 256))
		if err != nil {
			t.Fatal(err)
		}
		raw(t, srv.Addr(), []byte("SET"), []byte(b.Key(hashOf(i))), v)
		if got := b.Get(hs(i)); got[0] != nil {
			t.Fatalf("block %d: a value of another layout read", i)
		}
	}
	readForeign(3, keyB) // a key b does not accept: the header is unverified
	if strings.Contains(logs.text(), "another layout's fingerprint") {
		t.Fatalf("a forged header logged as another layout: %q", logs.text())
	}
	readForeign(4, keyA)
	if n := strings.Count(logs.text(), "another layout's fingerprint"); n != 1 {
		t.Fatalf("%d lines for an authentic value of another layout, want 1: %q", n, logs.text())
	}
}
