package attnref

// GPU tests: the kernels against the float64 CPU reference on fresh random
// inputs, outputs poisoned with NaN first. They skip only on machines with
// no NVIDIA device and fail on any other CUDA error (internal/gputest); run
// them on a GPU machine with
//   go test -c -o .device/attnref.test ./core/attn/attnref && KVPLUG_REQUIRE_GPU=1 .device/attnref.test -test.run GPU -test.v
// They live beside the oracle rather than in core/attn, whose own tests
// cannot import it (it imports core/attn).

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/internal/gputest"
	"github.com/kvplug/kvplug/internal/testseed"
)

// poisoned allocates bytes of device memory filled with the dtype's NaN.
func poisoned(t testing.TB, d attn.DType, bytes int) cuda.DevicePtr {
	t.Helper()
	p := gputest.Alloc(t, bytes)
	gputest.Poison(t, p, max(bytes, 16), d)
	return p
}

// tolerance of ||gpu - ref|| / ||ref|| per dtype: the kernels accumulate in
// float32; 16-bit types round the probabilities for the tensor cores.
func tolerance(d attn.DType) float64 {
	switch d {
	case attn.F16:
		return 2e-3
	case attn.BF16:
		return 1e-2
	}
	return 1e-5
}

// compareOut checks two [rows, heads, D] strided outputs row by row: no
// NaN or inf in got (an unwritten, poisoned element or an overflow), and a
// relative L2 error within tol in every row (one query token's heads), so
// one bad short row shows however long the others are. A row whose
// reference is zero (an empty sequence) must be zero.
func compareOut(t testing.TB, what string, d attn.DType, D int, rows, heads int, rowStride, headStride int64, got, want []byte) {
	t.Helper()
	for b := 0; b < rows; b++ {
		var num, den float64
		for h := 0; h < heads; h++ {
			o := int64(b)*rowStride + int64(h)*headStride
			for e := int64(0); e < int64(D); e++ {
				g, w := d.Load(got, o+e), d.Load(want, o+e)
				if math.IsNaN(g) || math.IsInf(g, 0) {
					t.Fatalf("%s: row %d head %d d %d is %g (unwritten or overflow); want %g", what, b, h, e, g, w)
				}
				num += (g - w) * (g - w)
				den += w * w
			}
		}
		if den == 0 {
			if num != 0 {
				t.Fatalf("%s: row %d: reference is zero, gpu is not (err^2 %g)", what, b, num)
			}
			continue
		}
		if rel := math.Sqrt(num / den); rel > tolerance(d) {
			t.Fatalf("%s: row %d: relative error %.3g exceeds %.1g", what, b, rel, tolerance(d))
		}
	}
}

func compareLSE(t testing.TB, what string, got, want []float32) {
	t.Helper()
	for i := range want {
		g, w := float64(got[i]), float64(want[i])
		if math.IsInf(w, -1) {
			if !math.IsInf(g, -1) {
				t.Fatalf("%s: lse[%d] = %g, want -inf (empty)", what, i, g)
			}
			continue
		}
		if math.IsNaN(g) || math.Abs(g-w) > 1e-3*math.Max(1, math.Abs(w)) {
			t.Fatalf("%s: lse[%d] = %g, want %g", what, i, g, w)
		}
	}
}

type gpuDecode struct {
	args     attn.PagedDecodeArgs
	outBytes int
}

// uploadDecode places a problem on the device with poisoned outputs (rows
// of q, out and lse: Batch times its new tokens).
func uploadDecode(t testing.TB, p *decodeProblem, splits int, withLSE bool) *gpuDecode {
	g := &gpuDecode{outBytes: p.outBytes()}
	g.args = attn.PagedDecodeArgs{
		DecodeLayout: p.l,
		Q:            gputest.Upload(t, p.q),

		SeqLens:   gputest.Upload(t, gputest.Int32Bytes(p.lens)),
		Out:       poisoned(t, p.l.DType, g.outBytes),
		NumSplits: splits,
	}
	g.args.KCache, g.args.VCache = gputest.Upload(t, p.kc), gputest.Upload(t, p.vc)
	g.args.BlockTable = gputest.Upload(t, gputest.Int32Bytes(p.table))
	if withLSE {
		g.args.LSE = poisoned(t, attn.F32, 4*p.l.Rows()*p.l.NumQHeads)
	}
	ws, err := attn.WorkspaceSize(p.l.Rows(), p.l.NumQHeads, p.l.HeadDim, attn.MaxSplits)
	if err != nil {
		t.Fatal(err)
	}
	g.args.Workspace = poisoned(t, attn.F32, int(ws))
	g.args.WorkspaceBytes = ws
	return g
}

func checkDecode(t testing.TB, p *decodeProblem, g *gpuDecode, splits int, what string) {
	t.Helper()
	out := gputest.Download(t, g.args.Out, g.outBytes)
	want := make([]byte, g.outBytes)
	wantLSE := make([]float32, p.l.Batch*p.l.NumQHeads)
	if err := PagedDecode(&p.l, p.q, p.kc, p.vc, p.table, p.lens, want, wantLSE, max(splits, 1)); err != nil {
		t.Fatal(err)
	}
	compareOut(t, what, p.l.DType, p.l.HeadDim, p.l.Batch, p.l.NumQHeads, p.l.OutBatchStride, p.l.OutHeadStride, out, want)
	if g.args.LSE != 0 {
		compareLSE(t, what, gputest.DownloadF32(t, g.args.LSE, len(wantLSE)), wantLSE)
	}
}

func TestGPUPagedDecode(t *testing.T) {
	gputest.NeedKernels(t, attn.Prepare)
	r := testseed.Rand(t, 7)
	type tc struct {
		d                    attn.DType
		D, qh, kvh, bs       int
		maxLen, batch, split int
		padded               bool
	}
	var cases []tc
	for _, d := range []attn.DType{attn.F16, attn.BF16, attn.F32} {
		for _, D := range []int{64, 128, 256} {
			for _, bs := range []int{1, 16, 64, 256} {
				for _, g := range []int{1, 4, 8} {
					split := []int{1, 0, 3}[(bs+g)%3]
					cases = append(cases, tc{d, D, 2 * g, 2, bs, 700, 5, split, bs == 64})
				}
			}
		}
	}
	// Long sequences, few of them: the split heuristic's case.
	cases = append(cases,
		tc{attn.BF16, 128, 32, 8, 16, 5000, 2, 0, false},
		tc{attn.F16, 128, 32, 8, 64, 3000, 3, 7, true},
		tc{attn.F16, 64, 16, 1, 1, 2500, 2, 0, false},
		tc{attn.BF16, 256, 16, 16, 16, 1200, 9, 0, false}, // group 1, many heads
		tc{attn.F16, 128, 40, 5, 16, 600, 4, 2, false},    // group 8 over 5 kv heads
		tc{attn.BF16, 128, 64, 2, 16, 400, 3, 1, false},   // group 32: two head tiles
	)
	for _, c := range cases {
		name := fmt.Sprintf("%v_D%d_q%d_kv%d_bs%d_split%d", c.d, c.D, c.qh, c.kvh, c.bs, c.split)
		r := rand.New(rand.NewPCG(r.Uint64(), 1))
		t.Run(name, func(t *testing.T) {
			t.Parallel() // the float64 reference dominates; launches are per-thread safe
			p := newDecodeProblem(t, r, problemShape{c.d, c.D, c.qh, c.kvh, c.bs, raggedLens(r, c.batch, c.bs, c.maxLen), c.padded})
			g := uploadDecode(t, p, c.split, true)
			maxLen := 0
			for _, L := range p.lens {
				maxLen = max(maxLen, int(L))
			}
			g.args.MaxSeqLen = maxLen
			if err := attn.PagedDecode(&g.args, 0); err != nil {
				t.Fatal(err)
			}
			if err := cuda.Synchronize(); err != nil {
				t.Fatal(err)
			}
			splits := c.split
			if splits == 0 {
				dev, _ := cuda.DeviceInfo(0)
				splits = attn.DecodeSplits(dev.SMs, c.d, c.D, p.l.Batch, c.qh, c.kvh, maxLen)
			}
			checkDecode(t, p, g, splits, name)
		})
	}
}

// KV write on the GPU is bit-exact with the reference, and decode over the
// cache it wrote matches too.
func TestGPUKVWriteThenDecode(t *testing.T) {
	gputest.NeedKernels(t, attn.Prepare)
	r := testseed.Rand(t, 7)
	for _, d := range []attn.DType{attn.F16, attn.BF16, attn.F32} {
		for _, bs := range []int{1, 16, 256} {
			name := fmt.Sprintf("%v_bs%d", d, bs)
			t.Run(name, func(t *testing.T) {
				p := newDecodeProblem(t, r, problemShape{d, 128, 8, 2, bs, raggedLens(r, 4, bs, 600), true})
				// Padding tokens and an out-of-range slot, which must be skipped.
				if len(p.slots) > 2 {
					p.slots[1] = -1
					p.slots[len(p.slots)-1] = int32(p.w.NumBlocks * p.w.BlockSize)
				}
				// Recompute the reference cache from a poisoned one with these slots.
				es := d.Size()
				cacheBytes := len(p.kc)
				for i := int64(0); i < int64(cacheBytes/es); i++ {
					d.Store(p.kc, i, math.NaN())
					d.Store(p.vc, i, math.NaN())
				}
				if err := KVWrite(&p.w, p.key, p.value, p.slots, p.kc, p.vc); err != nil {
					t.Fatal(err)
				}
				a := attn.KVWriteArgs{KVWriteLayout: p.w,
					Key: gputest.Upload(t, p.key), Value: gputest.Upload(t, p.value), SlotMapping: gputest.Upload(t, gputest.Int32Bytes(p.slots))}
				a.KCache, a.VCache = poisoned(t, d, cacheBytes), poisoned(t, d, cacheBytes)
				if err := attn.KVWrite(&a, 0); err != nil {
					t.Fatal(err)
				}
				gotK := gputest.Download(t, a.KCache, cacheBytes)
				gotV := gputest.Download(t, a.VCache, cacheBytes)
				for i := range gotK {
					if gotK[i] != p.kc[i] || gotV[i] != p.vc[i] {
						t.Fatalf("cache byte %d: gpu K %#x V %#x, reference K %#x V %#x", i, gotK[i], gotV[i], p.kc[i], p.vc[i])
					}
				}
				// Decode over the GPU-written cache (the reference uses p.kc,
				// which is bit-identical). Sequences whose tokens were skipped
				// read NaN keys, so give the test only clean sequences.
				g := uploadDecode(t, p, 0, true)
				g.args.KCache, g.args.VCache = a.KCache, a.VCache
				clean := p.cleanPrefix()
				g.args.Batch, p.l.Batch = clean, clean
				if clean == 0 {
					return
				}
				if err := attn.PagedDecode(&g.args, 0); err != nil {
					t.Fatal(err)
				}
				checkDecode(t, p, g, 1, name)
			})
		}
	}
}

// cleanPrefix is the number of leading sequences none of whose tokens had
// their slot replaced (so every token they attend to was written).
func (p *decodeProblem) cleanPrefix() int {
	tok := 0
	for b, L := range p.lens {
		for i := 0; i < int(L); i++ {
			if tok == 1 || tok == len(p.slots)-1 {
				return b
			}
			tok++
		}
	}
	return len(p.lens)
}

func TestGPUMergeStates(t *testing.T) {
	gputest.NeedKernels(t, attn.Prepare)
	r := testseed.Rand(t, 7)
	for _, d := range []attn.DType{attn.F16, attn.BF16, attn.F32} {
		for _, D := range []int{64, 128, 256} {
			for _, n := range []int{1, 2, 5, 8} {
				name := fmt.Sprintf("%v_D%d_n%d", d, D, n)
				t.Run(name, func(t *testing.T) {
					tokens, heads := 37, 6
					vec := int64(16 / d.Size())
					l := attn.MergeLayout{DType: d, HeadDim: D, NumStates: n, NumTokens: tokens, NumHeads: heads,
						VTokenStride: int64(heads*D) + vec, VHeadStride: int64(D),
						STokenStride: 1, SHeadStride: int64(tokens), // lse [heads, tokens]
						OutTokenStride: int64(heads * D), OutHeadStride: int64(D),
						OutLSETokenStride: int64(heads), OutLSEHeadStride: 1}
					es := d.Size()
					vBytes := int(int64(tokens)*l.VTokenStride) * es
					vs := make([][]byte, n)
					ss := make([][]float32, n)
					a := attn.MergeArgs{MergeLayout: l}
					for i := 0; i < n; i++ {
						vs[i] = make([]byte, vBytes)
						for k := int64(0); k < int64(vBytes/es); k++ {
							d.Store(vs[i], k, randVal(r, d))
						}
						ss[i] = make([]float32, tokens*heads)
						for k := range ss[i] {
							ss[i][k] = float32(r.NormFloat64() * 5)
							if r.IntN(5) == 0 {
								ss[i][k] = float32(math.Inf(-1))
							}
						}
						a.V[i], a.S[i] = gputest.Upload(t, vs[i]), gputest.Upload(t, gputest.Float32Bytes(ss[i]))
					}
					// Token 0: every state empty.
					for i := 0; i < n; i++ {
						for h := 0; h < heads; h++ {
							ss[i][h*tokens] = float32(math.Inf(-1))
						}
						a.S[i] = gputest.Upload(t, gputest.Float32Bytes(ss[i]))
					}
					outBytes := tokens * heads * D * es
					a.Out = poisoned(t, d, outBytes)
					a.OutLSE = poisoned(t, attn.F32, 4*tokens*heads)
					if err := attn.MergeStates(&a, 0); err != nil {
						t.Fatal(err)
					}
					want := make([]byte, outBytes)
					wantLSE := make([]float32, tokens*heads)
					if err := MergeStates(&l, vs, ss, want, wantLSE); err != nil {
						t.Fatal(err)
					}
					got := gputest.Download(t, a.Out, outBytes)
					compareOut(t, name, d, D, tokens, heads, l.OutTokenStride, l.OutHeadStride, got, want)
					compareLSE(t, name, gputest.DownloadF32(t, a.OutLSE, tokens*heads), wantLSE)
				})
			}
		}
	}
}

// attn.PagedDecode captured into a CUDA graph replays correctly on new inputs.
func TestGPUPagedDecodeGraph(t *testing.T) {
	gputest.NeedKernels(t, attn.Prepare)
	r := testseed.Rand(t, 7)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	s := gputest.Stream(t)
	for _, split := range []int{1, 0} {
		p := newDecodeProblem(t, r, problemShape{attn.BF16, 128, 32, 8, 16, []int{3000, 17, 0, 900}, false})
		g := uploadDecode(t, p, split, true)
		g.args.MaxSeqLen = 3000
		graph, err := cuda.Capture(s, func() error { return attn.PagedDecode(&g.args, s) })
		if err != nil {
			t.Fatalf("capture: %v", err)
		}
		for round := 0; round < 2; round++ {
			// New queries and a poisoned output before each replay.
			es := int64(p.l.DType.Size())
			for i := int64(0); i < int64(len(p.q))/es; i++ {
				p.l.DType.Store(p.q, i, randVal(r, p.l.DType))
			}
			if err := cuda.CopyToDevice(g.args.Q, p.q); err != nil {
				t.Fatal(err)
			}
			if err := cuda.Memset16(g.args.Out, uint16(p.l.DType.NaNBits()), g.outBytes/2); err != nil {
				t.Fatal(err)
			}
			if err := graph.Launch(s); err != nil {
				t.Fatal(err)
			}
			if err := cuda.StreamSynchronize(s); err != nil {
				t.Fatal(err)
			}
			dev, _ := cuda.DeviceInfo(0)
			splits := split
			if split == 0 {
				splits = attn.DecodeSplits(dev.SMs, attn.BF16, 128, 4, 32, 8, 3000)
			}
			checkDecode(t, p, g, splits, fmt.Sprintf("graph split %d round %d", split, round))
		}
		if err := graph.Destroy(); err != nil {
			t.Fatal(err)
		}
	}
}

var benchSink error

// BenchmarkPagedDecodeLaunch measures the host cost of one attn.PagedDecode call
// (checks, context and module lookup, cuLaunchKernel) on a tiny problem.
func BenchmarkPagedDecodeLaunch(b *testing.B) {
	gputest.NeedKernels(b, attn.Prepare)
	r := rand.New(rand.NewPCG(1, 2))
	p := newDecodeProblem(b, r, problemShape{attn.F16, 128, 8, 2, 16, []int{32}, false})
	g := uploadDecode(b, p, 1, false)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	s := gputest.Stream(b)
	if err := attn.PagedDecode(&g.args, s); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		benchSink = attn.PagedDecode(&g.args, s)
		if i%256 == 255 {
			b.StopTimer()
			cuda.StreamSynchronize(s)
			b.StartTimer()
		}
	}
	b.StopTimer()
	if err := cuda.StreamSynchronize(s); err != nil || benchSink != nil {
		b.Fatal(err, benchSink)
	}
}
