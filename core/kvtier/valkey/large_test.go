package valkey

import (
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/redistest"
)

// A batch of 128 blocks of 2 MiB (256 MiB: a Llama-3-8B block of 16
// tokens is 2 MiB) against a local server, as a session's history moves
// between instances (benchBatch).
const mib2 = 2 << 20

func BenchmarkGet128x2MiB(b *testing.B)         { benchBatch(b, 128, mib2, true, "") }
func BenchmarkReadInto128x2MiB(b *testing.B)    { benchBatch(b, 128, mib2, true, "direct") }
func BenchmarkPut128x2MiB(b *testing.B)         { benchBatch(b, 128, mib2, false, "") }
func BenchmarkGet128x2MiBMAC(b *testing.B)      { benchBatch(b, 128, mib2, true, "mac") }
func BenchmarkReadInto128x2MiBMAC(b *testing.B) { benchBatch(b, 128, mib2, true, "direct+mac") }
func BenchmarkPut128x2MiBMAC(b *testing.B)      { benchBatch(b, 128, mib2, false, "mac") }

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
