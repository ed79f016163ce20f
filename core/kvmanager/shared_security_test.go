package kvmanager

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/kvtier/valkey"
	"github.com/kvplug/kvplug/internal/logx"
	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/kvplug/kvplug/internal/resp"
)

const (
	testMACKey   = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
	otherMACKey  = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100"
	testPassword = "kv password with spaces \x01\xfe"
)

// A server with TLS only and an ACL user "kv" (password testPassword), its
// certificates, and the password's file.
func securedServer(t *testing.T) (*redistest.Server, *redistest.Certs, string) {
	t.Helper()
	certs := redistest.NewCerts(t)
	srv := redistest.StartTLS(t, redistest.Find(t), redistest.TLSServer{Certs: certs, ClientCerts: true})
	tc, err := certs.ClientTLS()
	must(t, err)
	c := resp.NewClientOptions(srv.Addr(), resp.Options{DialTimeout: time.Second, OpTimeout: time.Second, TLS: tc})
	defer c.Close()
	r, err := c.Do([][][]byte{{[]byte("ACL"), []byte("SETUSER"), []byte("kv"), []byte("on"), []byte(">" + testPassword),
		[]byte("~kvplug:*"), []byte("+get"), []byte("+set"), []byte("+exists")}})
	if err != nil || r[0] != "OK" {
		t.Fatalf("ACL SETUSER: %v %v", r, err)
	}
	pw := filepath.Join(t.TempDir(), "password")
	must(t, os.WriteFile(pw, []byte(testPassword+"\n"), 0o600))
	return srv, certs, pw
}

func secure(certs *redistest.Certs, pwFile, macKeys string) func(*SharedTier) {
	return func(c *SharedTier) {
		c.OpTimeout = 2 * time.Second
		c.Username = "kv"
		c.Password = valkey.Secret{File: pwFile}
		c.TLS = &valkey.TLS{CAFile: certs.CA, CertFile: certs.ClientCert, KeyFile: certs.ClientKey}
		if macKeys != "" {
			c.MACKeys = valkey.Secret{Value: []byte(macKeys)}
		}
	}
}

// Two managers share blocks through a server that wants TLS with client
// certificates and an ACL user, with a MAC on the values; managers with a
// wrong password, a wrong CA or another MAC key admit the same prompt
// without a hit and without an error, each fault counted, and none
// logs the password.
func TestSharedTierSecured(t *testing.T) {
	srv, certs, pwFile := securedServer(t)
	const bs = 4
	conv := seqTokens(rand.New(rand.NewPCG(9, 77)), 4*bs+1)

	var lines []string
	logx.SetSink(func(_ logx.Level, msg string) { lines = append(lines, msg) }, logx.Debug)
	t.Cleanup(func() { logx.SetSink(nil, logx.Off) })

	a, ga := newSharedMgr(t, srv.Addr(), 8, bs, 16, 8, secure(certs, pwFile, testMACKey))
	demoteAll(t, a, ga, 1, conv)
	must(t, a.Close())
	if sh := a.TierStats().Shared; sh.PutsDone != 4 || sh.AuthFailures+sh.TLSFailures+sh.Errors != 0 {
		t.Fatalf("A's stores: %+v", sh)
	}

	// B: rotating, the new key first; A's values verify under the old.
	b, gb := newSharedMgr(t, srv.Addr(), 8, bs, 16, 4, secure(certs, pwFile, otherMACKey+","+testMACKey))
	if got := admit(t, b, 1, conv, nil); got != 4*bs {
		t.Fatalf("B admitted with %d tokens matched", got)
	}
	checkReloaded(t, b, gb, 1, conv, 4)
	if sh := b.TierStats().Shared; sh.Fetched != 4 || sh.BytesRead != 4*(valkey.HeaderBytes+valkey.MACBytes+tierBlockBytes) {
		t.Fatalf("B: %+v", sh)
	}

	wrongPW := filepath.Join(t.TempDir(), "wrong")
	must(t, os.WriteFile(wrongPW, []byte("not the password"), 0o600))
	for _, c := range []struct {
		name  string
		cfg   func(*SharedTier)
		check func(SharedStats) bool
	}{
		{"wrong password", func(c *SharedTier) { secure(certs, wrongPW, testMACKey)(c) },
			func(s SharedStats) bool { return s.AuthFailures == 1 && s.Errors == 1 && s.Hits == 0 && !s.Available }},
		{"wrong CA", func(c *SharedTier) { secure(certs, pwFile, testMACKey)(c); c.TLS.CAFile = certs.OtherCA },
			func(s SharedStats) bool { return s.TLSFailures == 1 && s.Errors == 1 && s.Hits == 0 && !s.Available }},
		{"no client certificate", func(c *SharedTier) {
			secure(certs, pwFile, testMACKey)(c)
			c.TLS.CertFile, c.TLS.KeyFile = "", ""
		}, func(s SharedStats) bool { return s.TLSFailures == 1 && s.Errors == 1 && s.Hits == 0 }},
		{"plaintext", func(c *SharedTier) { secure(certs, pwFile, testMACKey)(c); c.TLS = nil },
			func(s SharedStats) bool { return s.Errors+s.Timeouts == 1 && s.Hits == 0 && !s.Available }},
		{"another MAC key", func(c *SharedTier) { secure(certs, pwFile, otherMACKey)(c) },
			func(s SharedStats) bool {
				return s.Hits == 4 && s.Corrupt == 4 && s.MACFailures == 4 && s.FetchMisses == 4 && s.Fetched == 0 && s.Available
			}},
		{"no MAC", func(c *SharedTier) { secure(certs, pwFile, "")(c) },
			func(s SharedStats) bool { return s.Hits == 4 && s.Corrupt == 4 && s.MACFailures == 0 && s.Fetched == 0 }},
	} {
		t.Run(c.name, func(t *testing.T) {
			m, _ := newSharedMgr(t, srv.Addr(), 8, bs, 16, 4, func(s *SharedTier) { c.cfg(s); s.OpTimeout = 500 * time.Millisecond })
			start := time.Now()
			if got := admit(t, m, 1, conv, nil); got != 0 {
				t.Fatalf("admitted with %d tokens matched", got)
			}
			if d := time.Since(start); d > sharedBound {
				t.Fatalf("admission took %v", d)
			}
			if sh := m.TierStats().Shared; !c.check(sh) {
				t.Fatalf("%+v", sh)
			}
			must(t, m.Close())
		})
	}
	for _, l := range lines {
		if strings.Contains(l, testPassword) || strings.Contains(l, "kv password") {
			t.Fatalf("a log line holds the password: %q", l)
		}
	}
	if text := strings.Join(lines, "\n"); !strings.Contains(text, "authentication failed") || !strings.Contains(text, "TLS failed") ||
		!strings.Contains(text, "MAC") {
		t.Fatalf("the faults are not all logged:\n%s", text)
	}
}

// A missing password, CA file or MAC key is refused by New (and by
// SharedTier.Check, before a host pool is made).
func TestSharedTierSecurityConfigErrors(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	for _, c := range []SharedTier{
		{Password: valkey.Secret{Env: "KVPLUG_TEST_UNSET_PASSWORD"}},
		{Password: valkey.Secret{File: missing}},
		{Username: "kv"},
		{TLS: &valkey.TLS{CAFile: missing}},
		{TLS: &valkey.TLS{CertFile: missing}},
		{MACKeys: valkey.Secret{File: missing}},
		{MACKeys: valkey.Secret{Value: []byte("short")}},
	} {
		c.Addr, c.Namespace = "127.0.0.1:1", sharedNS
		if err := c.Check(); !kverr.Is(err, kverr.InvalidArgument) {
			t.Errorf("Check %+v: %v", c, err)
		}
		p, err := host.New(host.Config{Slots: 4, BlockBytes: tierBlockBytes})
		must(t, err)
		if _, err := New(Config{NumBlocks: 8, BlockSize: 4, EnablePrefixCache: true, HostTier: &HostTier{Pool: p, Shared: &c}}); !kverr.Is(err, kverr.InvalidArgument) {
			t.Errorf("New %+v: %v", c, err)
		}
	}
}
