package main

/*
#include <stdlib.h>
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/valkey"
)

// The secrets' environment variables are the host's: read with the C
// library's getenv, which sees what the host set after loading the
// library (the Go runtime's copy of the environment does not).
func init() { valkey.LookupEnv = cLookupEnv }

func cLookupEnv(name string) (string, bool) {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	v := C.getenv(cs)
	if v == nil {
		return "", false
	}
	return C.GoString(v), true
}

// The shared tier's security fields at the ABI (include/kvplug.h, "Shared
// KV tier", Security), the same in kvp_manager_config (shared_tier_*) and
// kvp_shared_store_config: names of where the secrets are, never the
// secrets.

// sharedSecurityFields are one config's security fields.
type sharedSecurityFields struct {
	username, passwordEnv, passwordFile   *C.char
	caFile, certFile, keyFile, serverName *C.char
	macKeysEnv, macKeysFile               *C.char
	tls, reserved                         C.int32_t
	prefix                                string // the fields' name prefix in messages: "shared_tier_" or ""
	structName                            string
	reservedName                          string // the reserved field's name, past prefix
}

// sharedSecurity is a config's security, translated.
type sharedSecurity struct {
	username string
	password valkey.Secret
	tls      *valkey.TLS
	macKeys  valkey.Secret
}

// any reports whether a field is set.
func (f *sharedSecurityFields) any() bool {
	for _, p := range []*C.char{f.username, f.passwordEnv, f.passwordFile, f.caFile, f.certFile, f.keyFile, f.serverName, f.macKeysEnv, f.macKeysFile} {
		if p != nil {
			return true
		}
	}
	return f.tls != 0 || f.reserved != 0
}

// translate checks the fields' form (each string's length, tls and
// reserved, which fields need which) and copies them; what they name is
// read by valkey.New (and Config.CheckFiles).
func (f *sharedSecurityFields) translate() (sharedSecurity, error) {
	var s sharedSecurity
	name := func(field string) string { return f.structName + "." + f.prefix + field }
	if f.reserved != 0 {
		return s, kverr.Errorf(kverr.InvalidArgument, "%s must be 0: got %d", name(f.reservedName), int32(f.reserved))
	}
	if f.tls != 0 && f.tls != 1 {
		return s, kverr.Errorf(kverr.InvalidArgument, "%s must be 0 or 1: got %d", name("tls"), int32(f.tls))
	}
	str := func(p *C.char, field string) (string, error) {
		if p == nil {
			return "", nil
		}
		v, err := boundedString(p, name(field))
		if err == nil && v == "" {
			err = kverr.Errorf(kverr.InvalidArgument, "%s is empty: leave it NULL", name(field))
		}
		return v, err
	}
	var err error
	var vals [9]string
	for i, x := range []struct {
		p     *C.char
		field string
	}{
		{f.username, "username"}, {f.passwordEnv, "password_env"}, {f.passwordFile, "password_file"},
		{f.caFile, "tls_ca_file"}, {f.certFile, "tls_cert_file"}, {f.keyFile, "tls_key_file"}, {f.serverName, "tls_server_name"},
		{f.macKeysEnv, "mac_keys_env"}, {f.macKeysFile, "mac_keys_file"},
	} {
		if vals[i], err = str(x.p, x.field); err != nil {
			return s, err
		}
	}
	s.username = vals[0]
	s.password = valkey.Secret{Env: vals[1], File: vals[2]}
	s.macKeys = valkey.Secret{Env: vals[7], File: vals[8]}
	if vals[1] != "" && vals[2] != "" {
		return s, kverr.Errorf(kverr.InvalidArgument, "%s and %s: give one", name("password_env"), name("password_file"))
	}
	if vals[7] != "" && vals[8] != "" {
		return s, kverr.Errorf(kverr.InvalidArgument, "%s and %s: give one", name("mac_keys_env"), name("mac_keys_file"))
	}
	if s.username != "" && s.password.IsZero() {
		return s, kverr.Errorf(kverr.InvalidArgument, "%s needs a password (%s or %s)", name("username"), name("password_env"), name("password_file"))
	}
	tlsSet := vals[3] != "" || vals[4] != "" || vals[5] != "" || vals[6] != ""
	if f.tls == 0 {
		if tlsSet {
			// Never a plaintext tier configured as if it were a TLS one.
			return s, kverr.Errorf(kverr.InvalidArgument,
				"%s, %s, %s and %s need %s = 1", name("tls_ca_file"), name("tls_cert_file"), name("tls_key_file"), name("tls_server_name"), name("tls"))
		}
		return s, nil
	}
	if (vals[4] == "") != (vals[5] == "") {
		return s, kverr.Errorf(kverr.InvalidArgument, "%s and %s: both or neither", name("tls_cert_file"), name("tls_key_file"))
	}
	s.tls = &valkey.TLS{CAFile: vals[3], CertFile: vals[4], KeyFile: vals[5], ServerName: vals[6]}
	return s, nil
}

// apply sets cfg's security.
func (s sharedSecurity) apply(cfg *valkey.Config) {
	cfg.Username, cfg.Password, cfg.TLS, cfg.MACKeys = s.username, s.password, s.tls, s.macKeys
}
