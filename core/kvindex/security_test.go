package kvindex

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kvtier/valkey"
	"github.com/kvplug/kvplug/internal/redistest"
)

// The Valkey backend over TLS with AUTH, as the shared tier's: the right
// CA and password work; a wrong password, a wrong CA, and plaintext
// against a TLS-only server fail at creation, never with the password in
// the message.
func TestValkeyBackendAuthAndTLS(t *testing.T) {
	bin := redistest.Find(t)
	certs := redistest.NewCerts(t)
	const pw = "index secret"
	srv := redistest.StartTLS(t, bin, redistest.TLSServer{Certs: certs}, "--requirepass", pw)
	dir := t.TempDir()
	good := filepath.Join(dir, "pw")
	wrong := filepath.Join(dir, "wrong")
	if err := os.WriteFile(good, []byte(pw+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(wrong, []byte("not it"), 0o600); err != nil {
		t.Fatal(err)
	}
	sec := ValkeySecurity{Password: valkey.Secret{File: good}, TLS: &valkey.TLS{CAFile: certs.CA}}
	v, err := NewValkeySecure(srv.Addr(), "kvi", 2*time.Second, sec)
	if err != nil {
		t.Fatal(err)
	}
	testBackendMedia(t, v)
	if err := v.Close(); err != nil {
		t.Fatal(err)
	}

	for name, s := range map[string]ValkeySecurity{
		"wrong password": {Password: valkey.Secret{File: wrong}, TLS: &valkey.TLS{CAFile: certs.CA}},
		"wrong CA":       {Password: valkey.Secret{File: good}, TLS: &valkey.TLS{CAFile: certs.OtherCA}},
		"plaintext":      {Password: valkey.Secret{File: good}},
		"user, no pass":  {Username: "kv", TLS: &valkey.TLS{CAFile: certs.CA}},
	} {
		v, err := NewValkeySecure(srv.Addr(), "kvi", time.Second, s)
		if err == nil {
			v.Close()
			t.Fatalf("%s: connected", name)
		}
		if strings.Contains(err.Error(), pw) || strings.Contains(err.Error(), "not it") {
			t.Fatalf("%s: the error holds a password: %v", name, err)
		}
	}
}
