package valkey

import (
	"bytes"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"

	"github.com/kvplug/kvplug/internal/kverr"
	"github.com/zeebo/blake3"
)

// Secret says where a secret (a password, the MAC keys) is: an
// environment variable's value, a file's contents (one trailing line
// ending removed), or, for Go programs only, the bytes themselves. At most
// one of the three is set; the zero Secret is none. A Secret prints as
// where it is, never as what it holds, and no error of this package holds
// a secret's value.
type Secret struct {
	Env   string // the name of an environment variable
	File  string // the path of a file
	Value []byte // the secret itself
}

// IsZero reports whether s names no secret.
func (s Secret) IsZero() bool { return s.Env == "" && s.File == "" && s.Value == nil }

// String says where the secret is.
func (s Secret) String() string {
	switch {
	case s.Env != "":
		return "environment variable " + s.Env
	case s.File != "":
		return "file " + s.File
	case s.Value != nil:
		return "a value (not shown)"
	}
	return "none"
}

// GoString is String, so that %#v does not print the value either.
func (s Secret) GoString() string { return "valkey.Secret(" + s.String() + ")" }

// LookupEnv looks environment variables up for Secret.Env. A program
// that embeds the library in a C host (the C ABI) sets it to the C
// library's getenv, so that a variable the host set after the Go runtime
// started (which keeps its own copy of the environment) is seen.
var LookupEnv = os.LookupEnv

// validEnvName reports whether name is a portable environment variable
// name ([A-Za-z_][A-Za-z0-9_]*, at most 255 bytes).
func validEnvName(name string) bool {
	if name == "" || len(name) > 255 {
		return false
	}
	for i, r := range name {
		if !(r == '_' || r >= 'A' && r <= 'Z' || r >= 'a' && r <= 'z' || i > 0 && r >= '0' && r <= '9') {
			return false
		}
	}
	return true
}

// check validates where s is (not what it holds); what names it in errors.
func (s Secret) check(what string) error {
	n := 0
	for _, set := range []bool{s.Env != "", s.File != "", s.Value != nil} {
		if set {
			n++
		}
	}
	if n > 1 {
		return kverr.Errorf(kverr.InvalidArgument, "valkey tier: the %s is given in more than one place (an environment variable, a file, a value): give one", what)
	}
	if s.Env != "" && !validEnvName(s.Env) {
		// The name is not quoted: a caller who put the secret itself
		// where its variable's name goes must not find it in a log.
		return kverr.Errorf(kverr.InvalidArgument,
			"valkey tier: the %s's environment variable name is not one ([A-Za-z_][A-Za-z0-9_]*, at most 255 bytes; the name is not shown)", what)
	}
	return nil
}

// read returns the secret. An empty secret is an error.
func (s Secret) read(what string) ([]byte, error) {
	var v []byte
	switch {
	case s.Env != "":
		e, ok := LookupEnv(s.Env)
		if !ok || e == "" {
			return nil, kverr.Errorf(kverr.InvalidArgument, "valkey tier: the %s's environment variable %s is not set or empty", what, s.Env)
		}
		v = []byte(e)
	case s.File != "":
		b, err := os.ReadFile(s.File)
		if err != nil {
			if pe, ok := err.(*os.PathError); ok {
				err = pe.Err
			}
			return nil, kverr.Errorf(kverr.InvalidArgument, "valkey tier: reading the %s's file %s: %v", what, s.File, err)
		}
		v = b
		if bytes.HasSuffix(v, []byte("\r\n")) {
			v = v[:len(v)-2]
		} else if bytes.HasSuffix(v, []byte("\n")) {
			v = v[:len(v)-1]
		}
	default:
		v = bytes.Clone(s.Value) // the caller's stays as it is: a read's copy is cleared after use
	}
	if len(v) == 0 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "valkey tier: the %s (%v) is empty", what, s)
	}
	return v, nil
}

// TLS configures the tier's TLS: every connection does a TLS handshake
// and verifies the server's certificate, and a connection that fails
// either is closed, counted (Stats.TLSFailures) and never used in
// plaintext.
type TLS struct {
	// CAFile is a PEM file of the certificates of the CAs the server's
	// certificate must chain to; "": the system's roots.
	CAFile string
	// CertFile and KeyFile are the client's certificate (chain) and key,
	// PEM, for a server that asks for one (tls-auth-clients); both or
	// neither.
	CertFile, KeyFile string
	// ServerName is the name (or IP address) the server's certificate
	// must be for; "": the host of Config.Addr.
	ServerName string
}

// config returns the crypto/tls configuration of t for a server at addr,
// reading its files (read once, here).
func (t *TLS) config(addr string) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: t.ServerName}
	if c.ServerName == "" {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, kverr.Errorf(kverr.InvalidArgument, "valkey tier: TLS needs an address of host:port to take the server name from (or a server name): %v", err)
		}
		c.ServerName = host
	}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		if err != nil {
			return nil, kverr.Errorf(kverr.InvalidArgument, "valkey tier: reading the TLS CA file: %v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, kverr.Errorf(kverr.InvalidArgument, "valkey tier: the TLS CA file %s holds no PEM certificate", t.CAFile)
		}
		c.RootCAs = pool
	}
	if (t.CertFile == "") != (t.KeyFile == "") {
		return nil, kverr.Errorf(kverr.InvalidArgument, "valkey tier: a TLS client certificate needs both its certificate and its key file")
	}
	if t.CertFile != "" {
		kp, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			// crypto/tls's errors name the files' problem, never a key's bytes.
			return nil, kverr.Errorf(kverr.InvalidArgument, "valkey tier: loading the TLS client certificate %s and its key %s: %v", t.CertFile, t.KeyFile, err)
		}
		c.Certificates = []tls.Certificate{kp}
	}
	return c, nil
}

// The MAC (Config.MACKeys) is keyed BLAKE3 (github.com/zeebo/blake3,
// by the author of the xxh3 package this one already uses, with AVX2 and
// AVX-512 code), not HMAC-SHA-256 from the standard library: on 64 KiB
// values it runs at about twice HMAC-SHA-256's speed on x86-64 with the
// SHA extensions (3.6 against 1.7 GB/s on the development VM) and several
// times its speed without them, and every block read or written pays it.
// BLAKE3's keyed mode is a MAC by design (a PRF under its key, no HMAC
// construction needed).

// Value format with a MAC: flags bit 0 set, and after the 48-byte header
//
//	48  8   the key's id (macKeyIDContext, derived from the key: it
//	        names the key without telling anything about it)
//	56  32  keyed BLAKE3 of the payload, the value's first 56 bytes,
//	        and the namespace followed by its length in one byte (the
//	        payload first, so that it is hashed from a chunk boundary,
//	        at full SIMD speed; the header holds its length, so the
//	        input parses one way only)
//	88      payload
const (
	FlagMAC  = 1
	MACBytes = 8 + 32
)

const (
	macKeyContext   = "kvplug 2026-01-01 shared tier value MAC v1"
	macKeyIDContext = "kvplug 2026-01-01 shared tier value MAC key id v1"
	minMACKeyBytes  = 16
	maxMACKeyBytes  = 128
)

// macKey is one key: its id and its BLAKE3 key, with a pool of keyed
// hashers (a Hasher is not safe for concurrent use).
type macKey struct {
	id   [8]byte
	pool sync.Pool
}

func newMACKey(material []byte) *macKey {
	var k [32]byte
	blake3.DeriveKey(macKeyContext, material, k[:])
	m := &macKey{}
	blake3.DeriveKey(macKeyIDContext, material, m.id[:])
	m.pool.New = func() any {
		h, err := blake3.NewKeyed(k[:])
		if err != nil {
			panic(err) // unreachable: k is 32 bytes
		}
		return h
	}
	return m
}

// parseMACKeys reads one or two keys, each hex digits (16 to 128 bytes),
// separated by white space or commas: the first signs new values, both
// verify.
func parseMACKeys(text []byte) ([]*macKey, error) {
	fields := strings.FieldsFunc(string(text), func(r rune) bool { return r == ',' || r == ' ' || r == '\t' || r == '\n' || r == '\r' })
	if len(fields) < 1 || len(fields) > 2 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "valkey tier: the MAC keys must be one or two keys (hex, separated by white space or a comma): got %d", len(fields))
	}
	keys := make([]*macKey, len(fields))
	for i, f := range fields {
		b, err := hex.DecodeString(f)
		if err != nil || len(b) < minMACKeyBytes || len(b) > maxMACKeyBytes {
			return nil, kverr.Errorf(kverr.InvalidArgument,
				"valkey tier: MAC key %d must be %d to %d bytes in hex digits (the key is not shown)", i+1, minMACKeyBytes, maxMACKeyBytes)
		}
		keys[i] = newMACKey(b)
		clear(b)
	}
	if len(keys) == 2 && keys[0].id == keys[1].id {
		return nil, kverr.Errorf(kverr.InvalidArgument, "valkey tier: the two MAC keys are the same key")
	}
	return keys, nil
}

// appendMAC appends the key id and the tag of a value whose first
// HeaderBytes bytes end v, and whose payload is p, to v.
func (t *Tier) appendMAC(v []byte, p []byte) []byte {
	k := t.mac[0]
	v = append(v, k.id[:]...)
	return k.sum(v, t.cfg.Namespace, v[len(v)-HeaderBytes-8:], p)
}

// sum appends the tag of (payload, head, namespace) to dst.
func (k *macKey) sum(dst []byte, ns string, head, p []byte) []byte {
	h := k.pool.Get().(*blake3.Hasher)
	h.Reset()
	_, _ = h.Write(p)
	_, _ = h.Write(head)
	_, _ = h.WriteString(ns)
	_, _ = h.Write([]byte{byte(len(ns))})
	dst = h.Sum(dst)
	k.pool.Put(h)
	return dst
}

// macKeyOf returns the tier's key of id, or nil.
func (t *Tier) macKeyOf(id []byte) *macKey {
	for _, k := range t.mac {
		if string(k.id[:]) == string(id) {
			return k
		}
	}
	return nil
}

// finish appends to dst the tag of a value whose payload h (one of k's
// hashers) has taken, its first HeaderBytes+8 bytes head (sum's order).
func (k *macKey) finish(h *blake3.Hasher, dst []byte, ns string, head []byte) []byte {
	_, _ = h.Write(head)
	_, _ = h.WriteString(ns)
	_, _ = h.Write([]byte{byte(len(ns))})
	return h.Sum(dst)
}

// verifyMAC checks a keyed value v (HeaderBytes+MACBytes+payload, its
// header checked): its key id must be one of the tier's keys and its tag
// that key's.
func (t *Tier) verifyMAC(v []byte) bool {
	id := v[HeaderBytes : HeaderBytes+8]
	for _, k := range t.mac {
		if string(k.id[:]) != string(id) {
			continue
		}
		var tag [32]byte
		got := k.sum(tag[:0], t.cfg.Namespace, v[:HeaderBytes+8], v[HeaderBytes+MACBytes:])
		return subtle.ConstantTimeCompare(got, v[HeaderBytes+8:HeaderBytes+MACBytes]) == 1
	}
	return false
}

// EncodeMAC returns the value a tier whose first MAC key is keys (the
// Config.MACKeys text) stores for a block: header, key id, tag, payload.
func EncodeMAC(namespace string, hash Hash, fingerprint uint64, keys []byte, payload []byte) ([]byte, error) {
	mk, err := parseMACKeys(keys)
	if err != nil {
		return nil, err
	}
	t := &Tier{cfg: Config{Namespace: namespace}, mac: mk}
	v := appendHeader(make([]byte, 0, HeaderBytes+MACBytes+len(payload)), hash, fingerprint, FlagMAC, payload)
	return append(t.appendMAC(v, payload), payload...), nil
}

func (s Stats) securityString() string {
	return fmt.Sprintf("auth failures %d tls failures %d mac failures %d cluster %v primaries %d redirects %d map reads %d",
		s.AuthFailures, s.TLSFailures, s.MACFailures, s.Cluster, s.Primaries, s.Redirects, s.MapReads)
}
