package attnref

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvplug/kvplug/core/attn"
)

// prefillProblem is a random varlen batch: the paged cache of a decode
// problem (kv_lens = its lengths) and q rows for the last q_len_b tokens of
// each sequence.
type prefillProblem struct {
	*decodeProblem
	s        attn.PrefillShape
	l        attn.PrefillLayout
	qo       []int32
	q        []byte
	totalQ   int
	outBytes int
}

func newPrefillProblem(t testing.TB, r *rand.Rand, ps problemShape, qLens []int, window int) *prefillProblem {
	t.Helper()
	dp := newDecodeProblem(t, r, ps)
	p := &prefillProblem{decodeProblem: dp}
	p.s = attn.PrefillShape{DType: ps.d, HeadDim: ps.headDim, NumQHeads: ps.qHeads, NumKVHeads: ps.kvHeads, WindowLeft: window}
	p.qo = make([]int32, len(qLens)+1)
	for b, n := range qLens {
		p.qo[b+1] = p.qo[b] + int32(n)
	}
	p.totalQ = int(p.qo[len(qLens)])
	dl := dp.l
	pad := int64(0)
	if ps.padded {
		pad = int64(16 / ps.d.Size())
	}
	p.l = attn.PrefillLayout{
		QTokenStride: dl.QBatchStride + pad, QHeadStride: dl.QHeadStride,
		OutTokenStride: dl.OutBatchStride, OutHeadStride: dl.OutHeadStride,

		Scale: dl.Scale, PagedKV: attn.PagedKV{NumBlocks: dl.NumBlocks, BlockSize: dl.BlockSize,
			CacheBlockStride: dl.CacheBlockStride, CacheTokenStride: dl.CacheTokenStride, CacheHeadStride: dl.CacheHeadStride,
			MaxBlocksPerSeq: dl.MaxBlocksPerSeq, BlockTableStride: dl.BlockTableStride},
	}
	es := int64(ps.d.Size())
	p.q = make([]byte, int64(max(p.totalQ, 1))*p.l.QTokenStride*es)
	for i := int64(0); i < int64(len(p.q))/es; i++ {
		ps.d.Store(p.q, i, randVal(r, ps.d))
	}
	p.outBytes = int(int64(max(p.totalQ, 1)) * p.l.OutTokenStride * es)
	return p
}

// naiveRow is attention of query row `row` (sequence b, i-th new token) and
// head h straight from the logical K and V, two passes in float64.
func (p *prefillProblem) naiveRow(b, i, h int) ([]float64, float64) {
	D := p.s.HeadDim
	g := h / (p.s.NumQHeads / p.s.NumKVHeads)
	qLen := int(p.qo[b+1] - p.qo[b])
	kv := len(p.seqK[b])
	pos := kv - qLen + i
	lo := 0
	if p.s.WindowLeft >= 0 {
		lo = max(0, pos-p.s.WindowLeft)
	}
	qo := int64(int(p.qo[b])+i)*p.l.QTokenStride + int64(h)*p.l.QHeadStride
	out := make([]float64, D)
	sc := make([]float64, 0, pos-lo+1)
	m := math.Inf(-1)
	for t := lo; t <= pos; t++ {
		s := 0.0
		for e := 0; e < D; e++ {
			s += p.s.DType.Load(p.q, qo+int64(e)) * p.seqK[b][t][g*D+e]
		}
		s *= float64(p.l.Scale)
		sc = append(sc, s)
		m = math.Max(m, s)
	}
	z := 0.0
	for _, s := range sc {
		z += math.Exp(s - m)
	}
	for j, s := range sc {
		w := math.Exp(s-m) / z
		for e := 0; e < D; e++ {
			out[e] += w * p.seqV[b][lo+j][g*D+e]
		}
	}
	return out, m + math.Log(z)
}

// The reference against naive attention on the logical K/V: ragged q_len
// (prefix 0, a decode row, chunks), GQA groups, block sizes, windows.
func TestRefPagedPrefillMatchesNaive(t *testing.T) {
	r := rand.New(rand.NewPCG(10, 1))
	cases := []struct {
		d              attn.DType
		D, qh, kvh, bs int
		kvLens, qLens  []int
		window         int
		padded         bool
	}{
		{attn.F32, 64, 4, 1, 16, []int{37, 5, 80}, []int{37, 1, 20}, -1, false},
		{attn.F32, 64, 8, 2, 1, []int{9, 33}, []int{3, 33}, -1, true},
		{attn.BF16, 128, 4, 4, 7, []int{50, 0, 12}, []int{17, 0, 12}, 5, false},
		{attn.F16, 64, 6, 2, 64, []int{70}, []int{70}, 0, false},
	}
	for ci, c := range cases {
		p := newPrefillProblem(t, r, problemShape{d: c.d, headDim: c.D, qHeads: c.qh, kvHeads: c.kvh, blockSize: c.bs, lens: c.kvLens, padded: c.padded}, c.qLens, c.window)
		out := make([]byte, p.outBytes)
		lse := make([]float32, p.totalQ*c.qh)
		if err := PagedPrefill(&p.s, &p.l, p.qo, p.lens, p.q, p.kc, p.vc, p.table, out, lse); err != nil {
			t.Fatalf("case %d: %v", ci, err)
		}
		for b := range c.qLens {
			for i := 0; i < c.qLens[b]; i++ {
				row := int(p.qo[b]) + i
				for h := 0; h < c.qh; h++ {
					want, wl := p.naiveRow(b, i, h)
					oo := int64(row)*p.l.OutTokenStride + int64(h)*p.l.OutHeadStride
					for e := range want {
						got := c.d.Load(out, oo+int64(e))
						if math.Abs(got-want[e]) > 2*ulp(c.d)*(1+math.Abs(want[e])) {
							t.Fatalf("case %d seq %d row %d head %d d %d: %g, want %g", ci, b, i, h, e, got, want[e])
						}
					}
					if g := float64(lse[row*c.qh+h]); math.Abs(g-wl) > 1e-5*(1+math.Abs(wl)) {
						t.Fatalf("case %d seq %d row %d head %d: lse %g, want %g", ci, b, i, h, g, wl)
					}
				}
			}
		}
		if c.window == 0 { // each row sees only its own token: out is its V
			for i := 0; i < c.qLens[0]; i++ {
				pos := c.kvLens[0] - c.qLens[0] + i
				if got, want := c.d.Load(out, int64(i)*p.l.OutTokenStride), p.seqV[0][pos][0]; got != want {
					t.Fatalf("window 0 row %d: %g, want its own value %g", i, got, want)
				}
			}
		}
	}
}

// A batch of one-token queries through the prefill reference equals decode.
func TestRefPagedPrefillDecodeRows(t *testing.T) {
	r := rand.New(rand.NewPCG(10, 2))
	lens := []int{1, 40, 129}
	p := newPrefillProblem(t, r, problemShape{d: attn.F32, headDim: 128, qHeads: 8, kvHeads: 2, blockSize: 16, lens: lens}, []int{1, 1, 1}, -1)
	p.l.QTokenStride, p.l.OutTokenStride = p.decodeProblem.l.QBatchStride, p.decodeProblem.l.OutBatchStride
	copy(p.q, p.decodeProblem.q)
	out := make([]byte, p.outBytes)
	lse := make([]float32, 3*8)
	if err := PagedPrefill(&p.s, &p.l, p.qo, p.lens, p.q, p.kc, p.vc, p.table, out, lse); err != nil {
		t.Fatal(err)
	}
	dout := make([]byte, p.decodeProblem.outBytes())
	dlse := make([]float32, 3*8)
	if err := PagedDecode(&p.decodeProblem.l, p.decodeProblem.q, p.kc, p.vc, p.table, p.lens, dout, dlse, 1); err != nil {
		t.Fatal(err)
	}
	for i := range dlse {
		if lse[i] != dlse[i] {
			t.Fatalf("lse %d: prefill %g, decode %g", i, lse[i], dlse[i])
		}
	}
	for i := int64(0); i < int64(len(dout))/4; i++ {
		if a, b := attn.F32.Load(out, i), attn.F32.Load(dout, i); a != b && !(math.IsNaN(a) && math.IsNaN(b)) {
			t.Fatalf("out %d: prefill %g, decode %g", i, a, b)
		}
	}
}

func TestPrefillItems(t *testing.T) {
	s := attn.PrefillShape{DType: attn.BF16, HeadDim: 128, NumQHeads: 32, NumKVHeads: 8, WindowLeft: -1}
	items, err := PrefillItems(&s, []int32{0, 1, 1, 40}, []int32{100, 5, 40})
	if err != nil {
		t.Fatal(err)
	}
	// group 4, 64-row tiles: 1 row -> 1 tile, 0 rows -> none, 39 tokens =
	// 156 rows -> 3 tiles, last first.
	want := [][5]int32{{0, 0, 1, 100, 0}, {2, 1, 39, 40, 2}, {2, 1, 39, 40, 1}, {2, 1, 39, 40, 0}}
	if len(items) != len(want) {
		t.Fatalf("items %v, want %v", items, want)
	}
	for i := range want {
		if items[i] != want[i] {
			t.Fatalf("item %d: %v, want %v", i, items[i], want[i])
		}
	}
}
