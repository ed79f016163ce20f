package valkey

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/kvplug/kvplug/internal/resp"
)

// The large-batch benchmarks: blocks of 2 MiB (a Llama-3-8B block of 16
// tokens), 128 a batch by default (256 MiB), as a session's history
// moves between instances. The server:
//
//   - KVPLUG_BENCH_REDIS=host:port: a server already running (its keys of
//     namespace "bench" are overwritten, and deleted at the end);
//   - else one started for the benchmark, on loopback, with --io-threads
//     KVPLUG_BENCH_IO_THREADS (default: the CPUs, 8 at most): the binary
//     KVPLUG_BENCH_REDIS_SERVER names, else valkey-server or redis-server
//     from PATH.
//
// KVPLUG_BENCH_BLOCKS sets the batch's blocks (640: a 10k-token history,
// 1.25 GiB; the operation timeout is a minute). BenchmarkConns* report
// GB/s for 1, 2, 4, 8 and 16 connections (Config.Conns; or the list in
// KVPLUG_BENCH_CONNS, "1,2,4,8") in one run; a batch gives each
// connection 32 MiB at least (16 connections need 480 blocks). Redis 6
// and 7 use their io-threads only while at least twice as many clients
// wait for replies (io-threads 8: 16 connections). As a compiled test
// binary, on another machine:
//
//	go test -c -o valkey.test ./core/kvtier/valkey
//	KVPLUG_BENCH_REDIS_SERVER=/usr/bin/redis-server KVPLUG_BENCH_IO_THREADS=8 KVPLUG_BENCH_BLOCKS=640 \
//	  ./valkey.test -test.run '^$' -test.bench 'Conns' -test.benchtime 20x
func benchServer(b *testing.B) string {
	if addr := os.Getenv("KVPLUG_BENCH_REDIS"); addr != "" {
		return addr
	}
	bin := os.Getenv("KVPLUG_BENCH_REDIS_SERVER")
	if bin == "" {
		bin = redistest.Find(b)
	}
	threads := min(8, runtime.NumCPU())
	if v := os.Getenv("KVPLUG_BENCH_IO_THREADS"); v != "" {
		var err error
		if threads, err = strconv.Atoi(v); err != nil || threads < 1 {
			b.Fatalf("KVPLUG_BENCH_IO_THREADS=%q", v)
		}
	}
	return redistest.Start(b, bin, 0, "--io-threads", fmt.Sprint(threads)).Addr()
}

func benchBlocks(b *testing.B) int {
	n := 128
	if v := os.Getenv("KVPLUG_BENCH_BLOCKS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			b.Fatalf("KVPLUG_BENCH_BLOCKS=%q", v)
		}
	}
	return n
}

// benchLarge reads (GetInto, or with "direct" ReadInto: without the
// scratch buffer's copy) the batch into the same destinations each time
// (the host slots), or stores it (Put) from them, with conns connections
// (Config.Conns; 0: the default).
func benchLarge(b *testing.B, addr string, n int, get bool, mode string, conns int) {
	const bs = 2 << 20
	cfg := Config{Addr: addr, Namespace: "bench", BlockBytes: bs, OpTimeout: time.Minute, Conns: conns}
	if strings.Contains(mode, "mac") {
		cfg.MACKeys = Secret{Value: []byte(keyA)}
	}
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
	if os.Getenv("KVPLUG_BENCH_REDIS") != "" {
		b.Cleanup(func() {
			c := resp.NewClient(addr, time.Minute)
			defer c.Close()
			cmds := make([][][]byte, n)
			for i, h := range keys {
				cmds[i] = [][]byte{[]byte("DEL"), []byte(tr.Key(h))}
			}
			_, _ = c.Do(cmds)
		})
	}
	b.SetBytes(int64(n) * bs)
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
	b.ReportMetric(float64(b.N)*float64(n*bs)/b.Elapsed().Seconds()/1e9, "GB/s")
}

// benchConns runs benchLarge for each number of connections on one server.
func benchConns(b *testing.B, get bool, mode string) {
	addr, n := benchServer(b), benchBlocks(b)
	ks := []int{1, 2, 4, 8, 16}
	if v := os.Getenv("KVPLUG_BENCH_CONNS"); v != "" {
		ks = nil
		for _, f := range strings.Split(v, ",") {
			k, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || k < 1 || k > MaxConns {
				b.Fatalf("KVPLUG_BENCH_CONNS=%q", v)
			}
			ks = append(ks, k)
		}
	}
	for _, k := range ks {
		b.Run(fmt.Sprintf("conns=%d", k), func(b *testing.B) { benchLarge(b, addr, n, get, mode, k) })
	}
}

func large(b *testing.B, get bool, mode string) {
	benchLarge(b, benchServer(b), benchBlocks(b), get, mode, 0)
}

func BenchmarkGet128x2MiB(b *testing.B)         { large(b, true, "") }
func BenchmarkReadInto128x2MiB(b *testing.B)    { large(b, true, "direct") }
func BenchmarkPut128x2MiB(b *testing.B)         { large(b, false, "") }
func BenchmarkGet128x2MiBMAC(b *testing.B)      { large(b, true, "mac") }
func BenchmarkReadInto128x2MiBMAC(b *testing.B) { large(b, true, "direct+mac") }
func BenchmarkPut128x2MiBMAC(b *testing.B)      { large(b, false, "mac") }

func BenchmarkConnsReadInto(b *testing.B)    { benchConns(b, true, "direct") }
func BenchmarkConnsReadIntoMAC(b *testing.B) { benchConns(b, true, "direct+mac") }
func BenchmarkConnsPut(b *testing.B)         { benchConns(b, false, "") }
