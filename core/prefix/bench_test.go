package prefix

import (
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvplug/kvplug/internal/testtok"
)

func randTokens(r *rand.Rand, n int) []int32 { return testtok.Rand(r, n, 128000) }

func idRange(from, n int) []int32 { return testtok.Iota(from, n) }

// BenchmarkMatch4096 matches a 4096-token prompt whose first 2048 tokens
// are cached: 2048/bs block hashes and lookups that hit, one that misses.
// "admit" adds what the manager does around it in the index: lock the
// matched blocks (and, here, unlock them again).
func BenchmarkMatch4096(b *testing.B) {
	for _, bs := range []int{16, 64} {
		r := rand.New(rand.NewPCG(1, 2))
		prompt := randTokens(r, 4096)
		x := newIndex(b, bs, 1<<16, false)
		held := cache(b, x, prompt[:2048], nil, idRange(0, 2048/bs)...)
		unlock(b, x, held...)
		dst := make([]int32, 0, 4096/bs)
		for _, mode := range []string{"match", "match+partial", "admit"} {
			b.Run(fmt.Sprintf("bs%d/%s", bs, mode), func(b *testing.B) {
				for b.Loop() {
					res, err := x.Match(dst[:0], prompt, nil, mode == "match+partial")
					if err != nil || res.Tokens != 2048 {
						b.Fatalf("%d tokens, %v", res.Tokens, err)
					}
					if mode == "admit" {
						if err := x.Lock(res.Blocks); err != nil {
							b.Fatal(err)
						}
						if err := x.Unlock(res.Blocks); err != nil {
							b.Fatal(err)
						}
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/4096, "ns/token")
			})
		}
	}
}

// trace is a multi-tenant request stream: 100 system prompts of 1-4k
// tokens chosen with Zipf popularity, each followed by a user turn of
// 50-500 fresh tokens.
type trace struct {
	sys  [][]int32
	pool []int32 // user-turn tokens: windows of a long random run
	reqs []traceReq
}

type traceReq struct{ sys, off, n int }

func newTrace(seed uint64, nreq int) *trace {
	r := rand.New(rand.NewPCG(seed, 7))
	t := &trace{pool: randTokens(r, 1<<20)}
	for range 100 {
		t.sys = append(t.sys, randTokens(r, 1024+r.IntN(3073)))
	}
	z := rand.NewZipf(r, 1.1, 1, 99)
	for range nreq {
		n := 50 + r.IntN(451)
		t.reqs = append(t.reqs, traceReq{sys: int(z.Uint64()), off: r.IntN(len(t.pool) - n), n: n})
	}
	return t
}

func (t *trace) prompt(dst []int32, i int) []int32 {
	q := t.reqs[i%len(t.reqs)]
	return append(append(dst[:0], t.sys[q.sys]...), t.pool[q.off:q.off+q.n]...)
}

// serve runs one request through the index as an engine would: match,
// lock the hit, cache the rest block by block (evicting when the pool is
// out of blocks), retire.
type server struct {
	x    *Index
	free []int32
	dst  []int32
	held []int32
}

func newServer(tb testing.TB, bs, numBlocks int) *server {
	s := &server{x: newIndex(tb, bs, numBlocks, false)}
	for i := numBlocks - 1; i >= 0; i-- {
		s.free = append(s.free, int32(i))
	}
	return s
}

func (s *server) serve(tb testing.TB, prompt []int32) {
	res, err := s.x.Match(s.dst[:0], prompt, nil, false)
	if err != nil {
		tb.Fatal(err)
	}
	s.dst = res.Blocks
	if err := s.x.Lock(res.Blocks); err != nil {
		tb.Fatal(err)
	}
	s.held = append(s.held[:0], res.Blocks...)
	bs := s.x.bs
	parent := res.Last
	for i := len(res.Blocks); (i+1)*bs <= len(prompt); i++ {
		if len(s.free) == 0 {
			s.free = s.x.Evict(s.free, 64)
			if len(s.free) == 0 {
				break
			}
		}
		id := s.free[len(s.free)-1]
		s.free = s.free[:len(s.free)-1]
		ins, err := s.x.Insert(parent, prompt[i*bs:(i+1)*bs], nil, id)
		if err != nil {
			tb.Fatal(err)
		}
		if ins.Dup {
			s.free = append(s.free, id)
		}
		s.held = append(s.held, ins.Block)
		parent = ins.Hash
	}
	if err := s.x.Unlock(s.held); err != nil {
		tb.Fatal(err)
	}
}

// BenchmarkTrace reports prompt tokens per second and the token hit rate
// on the multi-tenant trace, with a pool of 32768 blocks of 16 tokens (the
// system prompts fill about half of it). "serve" runs the whole index side
// of each request; "match" only matches, against a warmed cache.
func BenchmarkTrace(b *testing.B) {
	const bs, numBlocks = 16, 1 << 15
	tr := newTrace(3, 4096)
	var buf []int32
	for _, mode := range []string{"serve", "match"} {
		b.Run(mode, func(b *testing.B) {
			s := newServer(b, bs, numBlocks)
			for i := range 2000 {
				buf = tr.prompt(buf, i)
				s.serve(b, buf)
			}
			s.x.ResetStats()
			dst := make([]int32, 0, 8192/bs)
			i := 0
			for b.Loop() {
				buf = tr.prompt(buf, i)
				i++
				if mode == "serve" {
					s.serve(b, buf)
				} else if _, err := s.x.Match(dst[:0], buf, nil, false); err != nil {
					b.Fatal(err)
				}
			}
			st := s.x.Stats()
			b.ReportMetric(float64(st.QueryTokens)/b.Elapsed().Seconds(), "tokens/s")
			b.ReportMetric(float64(st.HitTokens)/float64(st.QueryTokens), "hit-rate")
			b.ReportMetric(float64(st.QueryTokens)/float64(st.Queries), "tokens/req")
		})
	}
}

// BenchmarkEvict evicts from a full cache of 65536 unlocked blocks (4096
// chains of 16 with distinct last accesses), one block per Evict call and
// 64 per call; ns/op is per block.
func BenchmarkEvict(b *testing.B) {
	const chains, depth, bs = 4096, 16, 4
	r := rand.New(rand.NewPCG(5, 5))
	prompts := make([][]int32, chains)
	for i := range prompts {
		prompts[i] = randTokens(r, depth*bs)
	}
	fill := func(x *Index) {
		for c, p := range prompts {
			held := insertChain(b, x, p, nil, idRange(c*depth, depth)...)
			if err := x.Unlock(held); err != nil {
				b.Fatal(err)
			}
		}
	}
	for _, batch := range []int{1, 64} {
		b.Run(fmt.Sprintf("batch%d", batch), func(b *testing.B) {
			x := newIndex(b, bs, chains*depth, false)
			dst := make([]int32, 0, batch)
			evicted := 0
			b.StopTimer()
			fill(x)
			b.StartTimer()
			for i := 0; i < b.N; i += batch {
				if x.Len() == 0 {
					b.StopTimer()
					fill(x)
					b.StartTimer()
				}
				evicted += len(x.Evict(dst[:0], batch))
			}
			b.ReportMetric(float64(evicted)/b.Elapsed().Seconds(), "evictions/s")
		})
	}
}

// BenchmarkHash hashes the full blocks of a 4096-token prompt with salt,
// adapter and an image: XXH3-128 (the index's hash) against SHA-256 over
// the same bytes, chained the same way, in the same run.
func BenchmarkHash(b *testing.B) {
	r := rand.New(rand.NewPCG(9, 9))
	prompt := randTokens(r, 4096)
	keys := &Keys{Adapter: 7, Salt: []byte("tenant-0001"), MM: []MMItem{{Offset: 100, Length: 576, Hash: Sum([]byte("img"))}}}
	for _, bs := range []int{16, 64} {
		b.Run(fmt.Sprintf("bs%d/xxh3", bs), func(b *testing.B) {
			var h Hasher
			dst := make([]Hash, 0, 4096/bs)
			for b.Loop() {
				dst, _ = h.Chain(dst[:0], prompt, bs, keys)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/4096, "ns/token")
		})
		b.Run(fmt.Sprintf("bs%d/sha256", bs), func(b *testing.B) {
			var buf []byte
			var mm []BlockMM
			for b.Loop() {
				var parent Hash
				for i := range 4096 / bs {
					mm = appendBlockMM(mm[:0], keys.MM, i*bs, bs)
					var salt []byte
					if i == 0 {
						salt = keys.Salt
					}
					buf = AppendBlockInput(buf[:0], parent, prompt[i*bs:(i+1)*bs], keys.Adapter, mm, salt)
					sum := sha256.Sum256(buf)
					copy(parent[:], sum[:16])
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/4096, "ns/token")
		})
	}
}
