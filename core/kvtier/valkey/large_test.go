package valkey

import (
	"strings"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/redistest"
)

// A batch of 128 blocks of 2 MiB (256 MiB: a Llama-3-8B block of 16
// tokens is 2 MiB) against a local server, as a session's history moves
// between instances: GetInto into the same destinations each time (the
// host slots; ReadInto: without the scratch buffer's copy), Put from
// them.
func benchLarge(b *testing.B, get bool, mode string) {
	const n, bs = 128, 2 << 20
	cfg := Config{BlockBytes: bs, OpTimeout: time.Minute}
	srv := redistest.Start(b, redistest.Find(b), 0)
	if strings.Contains(mode, "mac") {
		cfg.MACKeys = Secret{Value: []byte(keyA)}
	}
	cfg.Addr = srv.Addr()
	tr := newTier(b, cfg)
	keys := make([]Hash, n)
	ps := make([][]byte, n)
	dst := make([][]byte, n)
	for i := range keys {
		keys[i], ps[i], dst[i] = hashOf(uint64(i+1)), payload(uint64(i), bs), make([]byte, bs)
		clear(dst[i]) // touched: the host slots are resident
	}
	if tr.Put(keys, ps) != n {
		b.Fatal("put")
	}
	b.SetBytes(n * bs)
	for b.Loop() {
		if get {
			found := tr.GetInto
			if strings.Contains(mode, "direct") {
				found = tr.ReadInto
			}
			for _, ok := range found(keys, dst) {
				if !ok {
					b.Fatal("miss")
				}
			}
		} else if tr.Put(keys, ps) != n {
			b.Fatal("put")
		}
	}
}

func BenchmarkGet128x2MiB(b *testing.B)         { benchLarge(b, true, "") }
func BenchmarkReadInto128x2MiB(b *testing.B)    { benchLarge(b, true, "direct") }
func BenchmarkPut128x2MiB(b *testing.B)         { benchLarge(b, false, "") }
func BenchmarkGet128x2MiBMAC(b *testing.B)      { benchLarge(b, true, "mac") }
func BenchmarkReadInto128x2MiBMAC(b *testing.B) { benchLarge(b, true, "direct+mac") }
func BenchmarkPut128x2MiBMAC(b *testing.B)      { benchLarge(b, false, "mac") }
