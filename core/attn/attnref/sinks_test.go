package attnref

// Attention sinks: the references against a direct computation of the
// definition (CPU), and the kernels against the references (GPU; skipped
// without one, see gpu_test.go).

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/internal/gputest"
	"github.com/kvplug/kvplug/internal/testseed"
)

// randSinks draws one sink per head from N(0, 2): large enough to move the
// outputs, and some above the rows' score maxima.
func randSinks(r *rand.Rand, n int) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = float32(r.NormFloat64() * 2)
	}
	return s
}

// withSink is the definition applied to naive's unsinked state of a row:
// out * Z / (Z + e^s) with Z = e^lse, and lse = log(Z + e^s).
func withSink(out []float64, lse, sink float64) ([]float64, float64) {
	o := make([]float64, len(out))
	if math.IsInf(lse, -1) {
		return o, sink
	}
	z, e := math.Exp(lse), math.Exp(sink)
	for k := range out {
		o[k] = out[k] * z / (z + e)
	}
	return o, math.Log(z + e)
}

// The decode reference with sinks (any split count) is the definition; an
// empty sequence gives out 0 and lse = its sink.
func TestRefPagedDecodeSinksMatchDefinition(t *testing.T) {
	r := testseed.Rand(t, 11)
	for _, splits := range []int{1, 3} {
		lens := raggedLens(r, 5, 16, 400)
		lens[1] = 0
		p := newDecodeProblem(t, r, problemShape{attn.F32, 64, 8, 2, 16, lens, false})
		sinks := randSinks(r, 8)
		out := make([]byte, p.outBytes())
		lse := make([]float32, 5*8)
		if err := PagedDecodeSinks(&p.l, p.q, p.kc, p.vc, p.table, p.lens, out, lse, splits, sinks); err != nil {
			t.Fatal(err)
		}
		for b := 0; b < 5; b++ {
			for i := 0; i < 8; i++ {
				want, wantLSE := withSinkOf(p, b, i, float64(sinks[i]))
				oo := int64(b)*p.l.OutBatchStride + int64(i)*p.l.OutHeadStride
				for e := range want {
					if got := attn.F32.Load(out, oo+int64(e)); math.Abs(got-want[e]) > 1e-6*math.Abs(want[e])+1e-30 {
						t.Fatalf("splits %d b %d (len %d) head %d d %d: got %g, want %g", splits, b, p.lens[b], i, e, got, want[e])
					}
				}
				if gl := float64(lse[b*8+i]); math.Abs(gl-wantLSE) > 1e-6*math.Max(1, math.Abs(wantLSE)) {
					t.Fatalf("splits %d b %d head %d: lse %g, want %g", splits, b, i, gl, wantLSE)
				}
			}
		}
		if got := float64(lse[1*8+3]); got != float64(sinks[3]) {
			t.Fatalf("empty sequence: lse %g, want its sink %g", got, sinks[3])
		}
	}
	// A sinks array shorter than the heads is refused, not read past.
	p := newDecodeProblem(t, r, problemShape{attn.F32, 64, 8, 2, 16, []int{5}, false})
	if err := PagedDecodeSinks(&p.l, p.q, p.kc, p.vc, p.table, p.lens, make([]byte, p.outBytes()), nil, 1, make([]float32, 7)); err == nil {
		t.Fatal("7 sinks for 8 heads accepted")
	}
}

// withSinkOf is withSink over naive's state of (b, head i).
func withSinkOf(p *decodeProblem, b, i int, sink float64) ([]float64, float64) {
	out, lse := p.naive(b, i)
	return withSink(out, lse, sink)
}

// AddSink on a normalised state is the definition too, and an empty state
// stays zero with lse = the sink.
func TestAddSink(t *testing.T) {
	o := []float64{1, -2, 0.5}
	lse := AddSink(o, math.Log(3), math.Log(1))
	if math.Abs(lse-math.Log(4)) > 1e-15 || math.Abs(o[0]-0.75) > 1e-15 || math.Abs(o[1]+1.5) > 1e-15 {
		t.Fatalf("AddSink: o %v lse %g; want [0.75 -1.5 0.375] and log 4", o, lse)
	}
	e := []float64{0, 0}
	if lse := AddSink(e, math.Inf(-1), 2.5); lse != 2.5 || e[0] != 0 || e[1] != 0 {
		t.Fatalf("empty: o %v lse %g; want zeros and 2.5", e, lse)
	}
}

// The prefill reference with sinks and a window is the decode reference's
// definition row by row: each row of a prompt is a decode row over its
// visible tokens, so the same withSink of the unsinked reference holds.
func TestRefPagedPrefillSinks(t *testing.T) {
	r := testseed.Rand(t, 12)
	pp := newPrefillProblem(t, r, problemShape{attn.F32, 64, 4, 2, 16, []int{90, 40, 1}, false}, []int{30, 40, 1}, 17)
	sinks := randSinks(r, 4)
	rows := pp.totalQ
	out, plain := make([]byte, pp.outBytes), make([]byte, pp.outBytes)
	lse, plainLSE := make([]float32, rows*4), make([]float32, rows*4)
	if err := PagedPrefillSinks(&pp.s, &pp.l, pp.qo, pp.lens, pp.q, pp.kc, pp.vc, pp.table, out, lse, sinks); err != nil {
		t.Fatal(err)
	}
	if err := PagedPrefill(&pp.s, &pp.l, pp.qo, pp.lens, pp.q, pp.kc, pp.vc, pp.table, plain, plainLSE); err != nil {
		t.Fatal(err)
	}
	D := 64
	row := make([]float64, D)
	for i := 0; i < rows; i++ {
		for h := 0; h < 4; h++ {
			oo := int64(i)*pp.l.OutTokenStride + int64(h)*pp.l.OutHeadStride
			for e := 0; e < D; e++ {
				row[e] = attn.F32.Load(plain, oo+int64(e))
			}
			want, wantLSE := withSink(row, float64(plainLSE[i*4+h]), float64(sinks[h]))
			for e := 0; e < D; e++ {
				if got := attn.F32.Load(out, oo+int64(e)); math.Abs(got-want[e]) > 1e-6*math.Abs(want[e])+1e-12 {
					t.Fatalf("row %d head %d d %d: got %g, want %g", i, h, e, got, want[e])
				}
			}
			if gl := float64(lse[i*4+h]); math.Abs(gl-wantLSE) > 1e-5*math.Max(1, math.Abs(wantLSE)) {
				t.Fatalf("row %d head %d: lse %g, want %g", i, h, gl, wantLSE)
			}
		}
	}
}

// The decode kernels with sinks against the reference: q_len 1 and 3,
// forced one split (the decode kernel adds the sink) and more (the partials
// hold none; the combine adds it), every dtype.
func TestGPUPagedDecodeSinks(t *testing.T) {
	gputest.NeedKernels(t, attn.Prepare)
	r := testseed.Rand(t, 13)
	for _, d := range []attn.DType{attn.F16, attn.BF16, attn.F32} {
		for _, qLen := range []int{1, 3} {
			for _, splits := range []int{1, 4} {
				name := fmt.Sprintf("%v_qlen%d_split%d", d, qLen, splits)
				r := rand.New(rand.NewPCG(r.Uint64(), 2))
				t.Run(name, func(t *testing.T) {
					lens := raggedLens(r, 6, 16, 1500)
					for i := range lens {
						lens[i] = max(lens[i], qLen)
					}
					if qLen == 1 {
						lens[4] = 0 // out 0, lse = the sink
					}
					p := newDecodeProblem(t, r, problemShape{d, 128, 16, 4, 16, lens, qLen == 1})
					p.l.QLen = qLen // q and out: qLen rows per sequence
					p.q = make([]byte, p.l.Rows()*int(p.l.QBatchStride)*d.Size())
					for i := 0; i < len(p.q)/d.Size(); i++ {
						d.Store(p.q, int64(i), randVal(r, d))
					}
					sinks := randSinks(r, 16)
					g := uploadDecode(t, p, splits, true)
					g.args.Sinks = gputest.Upload(t, gputest.Float32Bytes(sinks))
					if err := attn.PagedDecode(&g.args, 0); err != nil {
						t.Fatal(err)
					}
					if err := cuda.Synchronize(); err != nil {
						t.Fatal(err)
					}
					out := gputest.Download(t, g.args.Out, g.outBytes)
					want := make([]byte, g.outBytes)
					wantLSE := make([]float32, p.l.Rows()*p.l.NumQHeads)
					if err := PagedDecodeSinks(&p.l, p.q, p.kc, p.vc, p.table, p.lens, want, wantLSE, splits, sinks); err != nil {
						t.Fatal(err)
					}
					compareOut(t, name, d, 128, p.l.Rows(), 16, p.l.OutBatchStride, p.l.OutHeadStride, out, want)
					compareLSE(t, name, gputest.DownloadF32(t, g.args.LSE, len(wantLSE)), wantLSE)
				})
			}
		}
	}
}
