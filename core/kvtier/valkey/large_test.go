package valkey

import (
	"fmt"
	"os"
	"strconv"
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

// One instance's fetch of a session's history (640 blocks of 2 MiB, 1.25
// GiB: 10k tokens of Llama-3-8B; KVPLUG_BENCH_BLOCKS overrides) in one
// ReadInto, from a cluster of 1, 2, 4 or 8 primaries on loopback (the
// client reads the nodes' shares concurrently, a pipeline each). One
// server's main thread bounds the read at a few GB/s; a cluster spreads
// it over its primaries. Slow: it starts a cluster per sub-benchmark.
func BenchmarkClusterReadInto2MiB(b *testing.B) {
	const bs = 2 << 20
	n := 640
	if v, err := strconv.Atoi(os.Getenv("KVPLUG_BENCH_BLOCKS")); err == nil && v > 0 {
		n = v
	}
	bin := redistest.Find(b)
	for _, primaries := range []int{1, 2, 4, 8} {
		b.Run(fmt.Sprintf("primaries=%d", primaries), func(b *testing.B) {
			cl := redistest.StartCluster(b, bin, primaries, 0, "--maxmemory", fmt.Sprint(2*n*bs/primaries+(256<<20)))
			tr := newTier(b, Config{Addr: cl.Seed(), BlockBytes: bs, OpTimeout: time.Minute})
			keys := make([]Hash, n)
			dst := make([][]byte, n)
			for i := range keys {
				keys[i], dst[i] = hashOf(uint64(i+1)), payload(uint64(i), bs)
			}
			if tr.Put(keys, dst) != n {
				b.Fatal("put")
			}
			for i := range dst {
				clear(dst[i]) // touched: the host slots are resident
			}
			if st := tr.Stats(); !st.Cluster || st.Primaries != primaries {
				b.Fatalf("stats %+v: want a cluster of %d primaries", st, primaries)
			}
			b.SetBytes(int64(n) * bs)
			for b.Loop() {
				for _, ok := range tr.ReadInto(keys, dst) {
					if !ok {
						b.Fatal("miss")
					}
				}
			}
		})
	}
}
