package redistest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/resp"
)

// Certs are the PEM files of a throwaway PKI for TLS tests, in one
// directory: a CA, a server certificate for 127.0.0.1 and localhost and a
// client certificate signed by it, and the wrong ones: another CA (with a
// server certificate of its own), an expired server certificate and one
// for another name, both signed by the CA.
type Certs struct {
	Dir string

	CA, CAKey             string // the CA's certificate (the file clients verify against) and key
	ServerCert, ServerKey string // 127.0.0.1, ::1 and localhost, signed by CA
	ClientCert, ClientKey string // a client certificate signed by CA

	OtherCA                      string // another CA, which did not sign ServerCert
	OtherServerCert, OtherSrvKey string // 127.0.0.1 and localhost, signed by OtherCA
	ExpiredCert, ExpiredKey      string // 127.0.0.1 and localhost, signed by CA, expired
	WrongNameCert, WrongNameKey  string // other.invalid only, signed by CA
}

// WriteCerts generates Certs into dir (ECDSA P-256 keys).
func WriteCerts(dir string) (*Certs, error) {
	c := &Certs{Dir: dir}
	f := func(name string) string { return filepath.Join(dir, name) }
	c.CA, c.CAKey = f("ca.pem"), f("ca-key.pem")
	c.ServerCert, c.ServerKey = f("server.pem"), f("server-key.pem")
	c.ClientCert, c.ClientKey = f("client.pem"), f("client-key.pem")
	c.OtherCA = f("other-ca.pem")
	c.OtherServerCert, c.OtherSrvKey = f("other-server.pem"), f("other-server-key.pem")
	c.ExpiredCert, c.ExpiredKey = f("expired.pem"), f("expired-key.pem")
	c.WrongNameCert, c.WrongNameKey = f("wrong-name.pem"), f("wrong-name-key.pem")

	now := time.Now()
	ca, caKey, err := issue(nil, nil, "kvplug test CA", true, nil, nil, now.Add(-time.Hour), now.Add(24*time.Hour), c.CA, c.CAKey)
	if err != nil {
		return nil, err
	}
	other, otherKey, err := issue(nil, nil, "kvplug other CA", true, nil, nil, now.Add(-time.Hour), now.Add(24*time.Hour), c.OtherCA, f("other-ca-key.pem"))
	if err != nil {
		return nil, err
	}
	local := []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
	names := []string{"localhost"}
	for _, x := range []struct {
		parent            *x509.Certificate
		key               *ecdsa.PrivateKey
		cn                string
		ips               []net.IP
		dns               []string
		from, until       time.Time
		certFile, keyFile string
	}{
		{ca, caKey, "kvplug test server", local, names, now.Add(-time.Hour), now.Add(24 * time.Hour), c.ServerCert, c.ServerKey},
		{ca, caKey, "kvplug test client", nil, nil, now.Add(-time.Hour), now.Add(24 * time.Hour), c.ClientCert, c.ClientKey},
		{other, otherKey, "kvplug other server", local, names, now.Add(-time.Hour), now.Add(24 * time.Hour), c.OtherServerCert, c.OtherSrvKey},
		{ca, caKey, "kvplug expired server", local, names, now.Add(-48 * time.Hour), now.Add(-24 * time.Hour), c.ExpiredCert, c.ExpiredKey},
		{ca, caKey, "kvplug wrong-name server", nil, []string{"other.invalid"}, now.Add(-time.Hour), now.Add(24 * time.Hour), c.WrongNameCert, c.WrongNameKey},
	} {
		if _, _, err := issue(x.parent, x.key, x.cn, false, x.ips, x.dns, x.from, x.until, x.certFile, x.keyFile); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// issue makes a key and a certificate signed by parent (self-signed when
// nil) and writes both as PEM.
func issue(parent *x509.Certificate, parentKey *ecdsa.PrivateKey, cn string, isCA bool, ips []net.IP, dns []string,
	from, until time.Time, certFile, keyFile string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: cn}, NotBefore: from, NotAfter: until,
		IPAddresses: ips, DNSNames: dns, BasicConstraintsValid: true, IsCA: isCA,
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	if isCA {
		tmpl.KeyUsage |= x509.KeyUsageCertSign
		tmpl.ExtKeyUsage = nil
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return nil, nil, err
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		return nil, nil, err
	}
	return cert, key, nil
}

// NewCerts writes Certs into a temporary directory of t's.
func NewCerts(t testing.TB) *Certs {
	t.Helper()
	c, err := WriteCerts(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TLSServer says how StartTLS configures a server's TLS.
type TLSServer struct {
	Certs *Certs
	// Cert and Key are the server's certificate and key; "": Certs's
	// ServerCert and ServerKey.
	Cert, Key string
	// ClientCerts makes the server require a client certificate signed by
	// Certs.CA (tls-auth-clients yes); else it asks for none.
	ClientCerts bool
}

// StartTLS starts bin listening with TLS only (no plaintext port) on a
// free loopback port, with extra arguments, and waits until it answers
// PING over TLS. The process is killed at t's cleanup. Server.Addr is
// its TLS address.
func StartTLS(t testing.TB, bin string, cfg TLSServer, args ...string) *Server {
	t.Helper()
	c := cfg.Certs
	cert, key := cfg.Cert, cfg.Key
	if cert == "" {
		cert, key = c.ServerCert, c.ServerKey
	}
	auth := "no"
	if cfg.ClientCerts {
		auth = "yes"
	}
	// Readiness only: the test's own clients verify the server.
	tc := &tls.Config{InsecureSkipVerify: true}
	if cfg.ClientCerts {
		kp, err := tls.LoadX509KeyPair(c.ClientCert, c.ClientKey)
		if err != nil {
			t.Fatal(err)
		}
		tc.Certificates = []tls.Certificate{kp}
	}
	return launch(t, bin, 0, func(port int) []string {
		return append([]string{"--port", "0", "--tls-port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "",
			"--appendonly", "no", "--dir", t.TempDir(), "--tls-cert-file", cert, "--tls-key-file", key,
			"--tls-ca-cert-file", c.CA, "--tls-auth-clients", auth}, args...)
	}, func(s *Server) error {
		cl := resp.NewClientOptions(s.Addr(), resp.Options{DialTimeout: time.Second, OpTimeout: time.Second, TLS: tc})
		defer cl.Close()
		_, err := cl.Do([][][]byte{{[]byte("PING")}})
		return err
	}, " with TLS (does it support --tls-port?)")
}

// ClientTLS is a client configuration that verifies a server of c.CA for
// 127.0.0.1 and presents c's client certificate.
func (c *Certs) ClientTLS() (*tls.Config, error) {
	pem, err := os.ReadFile(c.CA)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no certificate", c.CA)
	}
	kp, err := tls.LoadX509KeyPair(c.ClientCert, c.ClientKey)
	if err != nil {
		return nil, err
	}
	return &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{kp}, ServerName: "127.0.0.1"}, nil
}
