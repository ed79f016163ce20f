package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/kvplug/kvplug/internal/resp"
)

const (
	abiPassword = "abi pass\x01word"
	abiMACKeys  = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0"
)

// A TLS-only server with an ACL user "kv" (abiPassword), its
// certificates, and files holding the password and the MAC key.
func abiSecuredServer(t *testing.T) (*redistest.Server, *redistest.Certs, string, string) {
	t.Helper()
	certs := redistest.NewCerts(t)
	srv := redistest.StartTLS(t, redistest.Find(t), redistest.TLSServer{Certs: certs})
	tc, err := certs.ClientTLS()
	if err != nil {
		t.Fatal(err)
	}
	c := resp.NewClientOptions(srv.Addr(), resp.Options{DialTimeout: time.Second, OpTimeout: time.Second, TLS: tc})
	defer c.Close()
	r, err := c.Do([][][]byte{{[]byte("ACL"), []byte("SETUSER"), []byte("kv"), []byte("on"), []byte(">" + abiPassword),
		[]byte("~*"), []byte("+@all")}})
	if err != nil || r[0] != "OK" {
		t.Fatalf("ACL SETUSER: %v %v", r, err)
	}
	dir := t.TempDir()
	pw, mac := filepath.Join(dir, "pw"), filepath.Join(dir, "mac")
	if os.WriteFile(pw, []byte(abiPassword+"\n"), 0o600) != nil || os.WriteFile(mac, []byte(abiMACKeys+"\n"), 0o600) != nil {
		t.Fatal("writing the secrets")
	}
	return srv, certs, pw, mac
}

// Two managers share blocks through the ABI over TLS, with AUTH and the
// MAC; a third with a wrong password admits without a hit, its fault in
// the new counters, which a caller of an older struct_size does not get.
func TestSharedTierABISecured(t *testing.T) {
	lockThread(t)
	srv, certs, pwFile, macFile := abiSecuredServer(t)
	addr, ns := srv.Addr(), "abi-secure.bs4"
	t.Setenv("KVPLUG_ABI_MAC_KEYS", abiMACKeys)
	sec := map[string]string{"username": "kv", "password_file": pwFile, "tls_ca_file": certs.CA, "mac_keys_file": macFile}
	cfg := hookTierConfig{numBlocks: 8, blockSize: 4, slots: 16, ahead: 8, blockBytes: tierBytes,
		sharedAddr: &addr, sharedNS: &ns, sharedTimeoutMs: 2000, security: sec, sharedTLS: 1}
	conv := tokenRun(17, 500)
	a, st := hookManagerCreateTier(cfg)
	expect(t, "create A", st, kverr.OK)
	demoteThroughABI(t, a, 1, conv)
	hookManagerDestroy(a)

	// B: the MAC keys from the environment, the server name given.
	bcfg := cfg
	bcfg.security = map[string]string{"username": "kv", "password_file": pwFile, "tls_ca_file": certs.CA,
		"tls_server_name": "localhost", "mac_keys_env": "KVPLUG_ABI_MAC_KEYS"}
	b, st := hookManagerCreateTier(bcfg)
	expect(t, "create B", st, kverr.OK)
	defer hookManagerDestroy(b)
	matched, _, st := hookAdmit(b, []int64{1}, [][]int32{conv}, nil)
	expect(t, "admit B", st, kverr.OK)
	if matched[0] != 16 {
		t.Fatalf("B matched %d tokens", matched[0])
	}
	s, _ := hookSharedStats(b, sizeofTierStats())
	if s["fetched"] != 4 || s["auth_failures"]+s["tls_failures"]+s["mac_failures"]+s["errors"] != 0 {
		t.Fatalf("B's shared stats: %v", s)
	}

	wrong := filepath.Join(t.TempDir(), "wrong")
	if err := os.WriteFile(wrong, []byte("wrong"), 0o600); err != nil {
		t.Fatal(err)
	}
	ccfg := cfg
	ccfg.security = map[string]string{"username": "kv", "password_file": wrong, "tls_ca_file": certs.CA, "mac_keys_file": macFile}
	c, st := hookManagerCreateTier(ccfg)
	expect(t, "create C", st, kverr.OK)
	defer hookManagerDestroy(c)
	matched, _, st = hookAdmit(c, []int64{1}, [][]int32{conv}, nil)
	expect(t, "admit C", st, kverr.OK)
	if matched[0] != 0 {
		t.Fatalf("C matched %d tokens with a wrong password", matched[0])
	}
	s, _ = hookSharedStats(c, sizeofTierStats())
	if s["auth_failures"] != 1 || s["errors"] != 1 || s["available"] != 0 {
		t.Fatalf("C's shared stats: %v", s)
	}
	// A caller whose struct ends before the new counters.
	s, _ = hookSharedStats(c, offsetofTierStatsAuth())
	if s["auth_failures"] != 0 || s["errors"] != 1 {
		t.Fatalf("written past the caller's struct_size: %v", s)
	}
}

// The standalone shared store with AUTH, TLS and the MAC; its counters.
func TestSharedStoreABISecured(t *testing.T) {
	lockThread(t)
	srv, certs, pwFile, macFile := abiSecuredServer(t)
	sec := map[string]string{"username": "kv", "password_file": pwFile, "tls_ca_file": certs.CA, "mac_keys_file": macFile}
	h, st := hookSharedStoreCreateSecured(srv.Addr(), "store", sec, 1, 0)
	expect(t, "create", st, kverr.OK)
	data := [][]byte{bytes.Repeat([]byte{7}, 100)}
	stored, found, back, st := hookSharedStorePutGet(h, []uint64{1}, data)
	expect(t, "put/get", st, kverr.OK)
	if stored != 1 || found[0] != 1 || !bytes.Equal(back[0], data[0]) {
		t.Fatalf("stored %d found %v", stored, found)
	}
	hookSharedStoreDestroy(h)

	// Another MAC key: a miss, counted.
	other := filepath.Join(t.TempDir(), "other")
	if err := os.WriteFile(other, []byte(strings.Repeat("ab", 32)), 0o600); err != nil {
		t.Fatal(err)
	}
	sec["mac_keys_file"] = other
	h, st = hookSharedStoreCreateSecured(srv.Addr(), "store", sec, 1, 0)
	expect(t, "create with another key", st, kverr.OK)
	defer hookSharedStoreDestroy(h)
	_, _, _, _ = hookSharedStorePutGet(h, []uint64{2}, data) // stores key 2 under its own key, reads it back
	v, _ := hookSharedStoreSecurityStats(h, sizeofSharedStoreStats())
	if v != [5]int64{0, 0, 0, 0, 0} {
		t.Fatalf("stats %v", v)
	}
	_, found, _, _ = hookSharedStoreGetOnly(h, []uint64{1}, 100)
	v, _ = hookSharedStoreSecurityStats(h, sizeofSharedStoreStats())
	if found[0] != 0 || v != [5]int64{0, 0, 1, 0, 1} {
		t.Fatalf("another key's value: found %v, stats %v", found, v)
	}
	v, _ = hookSharedStoreSecurityStats(h, firstSizeofSharedStoreStats())
	if v[2] != 0 || v[4] != 1 {
		t.Fatalf("written past the first size: %v", v)
	}

	// TLS refused: wrong CA.
	bad := map[string]string{"username": "kv", "password_file": pwFile, "tls_ca_file": certs.OtherCA}
	w, st := hookSharedStoreCreateSecured(srv.Addr(), "store", bad, 1, 0)
	expect(t, "create with another CA", st, kverr.OK)
	defer hookSharedStoreDestroy(w)
	_, found, _, _ = hookSharedStoreGetOnly(w, []uint64{1}, 100)
	v, _ = hookSharedStoreSecurityStats(w, sizeofSharedStoreStats())
	if found[0] != 0 || v != [5]int64{0, 1, 0, 1, 0} {
		t.Fatalf("wrong CA: found %v, stats %v", found, v)
	}
}

// Bad security fields: INVALID_ARGUMENT with a message that holds no
// secret, and no handle, in both configs.
func TestSharedSecurityABIRefusals(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	secret := "Sup3r-secret-value"
	pw, empty, missing := filepath.Join(dir, "pw"), filepath.Join(dir, "empty"), filepath.Join(dir, "missing")
	if os.WriteFile(pw, []byte(secret), 0o600) != nil || os.WriteFile(empty, nil, 0o600) != nil {
		t.Fatal("writing")
	}
	t.Setenv("KVPLUG_ABI_SECRET", secret)
	t.Setenv("KVPLUG_ABI_EMPTY", "")
	addr, ns := "127.0.0.1:1", "m.bs4"
	type sec struct {
		m         map[string]string
		tls, resv int32
	}
	cases := map[string]sec{
		"username without password": {m: map[string]string{"username": "kv"}},
		"password in two places":    {m: map[string]string{"password_env": "KVPLUG_ABI_SECRET", "password_file": pw}},
		"the secret as a name":      {m: map[string]string{"password_env": secret + " !"}},
		"an unset variable":         {m: map[string]string{"password_env": "KVPLUG_ABI_UNSET"}},
		"an empty variable":         {m: map[string]string{"password_env": "KVPLUG_ABI_EMPTY"}},
		"a missing file":            {m: map[string]string{"password_file": missing}},
		"an empty file":             {m: map[string]string{"password_file": empty}},
		"an empty string":           {m: map[string]string{"password_file": ""}},
		"MAC keys not hex":          {m: map[string]string{"mac_keys_env": "KVPLUG_ABI_SECRET"}},
		"MAC keys in two places":    {m: map[string]string{"mac_keys_env": "KVPLUG_ABI_SECRET", "mac_keys_file": pw}},
		"a CA file without tls":     {m: map[string]string{"tls_ca_file": pw}},
		"a server name without tls": {m: map[string]string{"tls_server_name": "x"}},
		"tls 2":                     {tls: 2},
		"reserved":                  {tls: 1, resv: 1},
		"a CA file that is no PEM":  {m: map[string]string{"tls_ca_file": pw}, tls: 1},
		"a certificate, no key":     {m: map[string]string{"tls_cert_file": pw}, tls: 1},
		"a missing CA file":         {m: map[string]string{"tls_ca_file": missing}, tls: 1},
		"a name too long":           {m: map[string]string{"password_file": strings.Repeat("a", 1025)}},
	}
	live, _ := hookLiveHandles(false)
	for name, c := range cases {
		cfg := hookTierConfig{numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16, sharedAddr: &addr, sharedNS: &ns,
			security: c.m, sharedTLS: c.tls, sharedResv: c.resv}
		h, st := hookManagerCreateTier(cfg)
		expect(t, "manager: "+name, st, kverr.InvalidArgument)
		if msg := lastError(); h != nil || msg == "" || strings.Contains(msg, secret) {
			t.Fatalf("manager: %s: a handle, no message, or the secret in it: %q", name, msg)
		}
		h, st = hookSharedStoreCreateSecured(addr, ns, c.m, c.tls, c.resv)
		expect(t, "store: "+name, st, kverr.InvalidArgument)
		if msg := lastError(); h != nil || msg == "" || strings.Contains(msg, secret) {
			t.Fatalf("store: %s: a handle, no message, or the secret in it: %q", name, msg)
		}
	}
	// Security without a shared tier.
	h, st := hookManagerCreateTier(hookTierConfig{numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16,
		security: map[string]string{"password_file": pw}})
	expect(t, "security without an address", st, kverr.InvalidArgument)
	if h != nil {
		t.Fatal("a handle")
	}
	h, st = hookManagerCreateTier(hookTierConfig{numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16, sharedTLS: 1})
	expect(t, "tls without an address", st, kverr.InvalidArgument)
	if n, _ := hookLiveHandles(false); n != live {
		t.Fatalf("refused creates left %d handles", n-live)
	}
}
