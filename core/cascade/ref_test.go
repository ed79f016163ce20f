package cascade_test

import (
	. "github.com/kvplug/kvplug/core/cascade"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/attn/attnref"
	"github.com/kvplug/kvplug/internal/testseed"
)

// rows is the batch's query rows.
func (b *batch) rows() int {
	if b.qo == nil {
		return len(b.lens)
	}
	return int(b.qo[len(b.lens)])
}

// problem is a batch with random queries and caches in a layer layout (q
// and out [rows, qh, D]).
type problem struct {
	b         *batch
	dl        attn.DecodeLayout
	q, kc, vc []byte
}

func newProblem(r *rand.Rand, b *batch, d attn.DType, qh, kvh, D int) *problem {
	nb := max(b.numBlocks, 1)
	p := &problem{b: b}
	p.dl = attn.DecodeLayout{DType: d, HeadDim: D, Batch: len(b.lens), NumQHeads: qh, NumKVHeads: kvh,
		QBatchStride: int64(qh * D), QHeadStride: int64(D), OutBatchStride: int64(qh * D), OutHeadStride: int64(D),

		Scale: float32(1 / math.Sqrt(float64(D))), PagedKV: attn.PagedKV{NumBlocks: nb, BlockSize: b.bs,
			CacheBlockStride: int64(b.bs * kvh * D), CacheTokenStride: int64(kvh * D), CacheHeadStride: int64(D),
			MaxBlocksPerSeq: b.maxBlocks, BlockTableStride: int64(b.stride)}}
	fill := func(n int) []byte {
		buf := make([]byte, n*d.Size())
		for i := 0; i < n; i++ {
			d.Store(buf, int64(i), r.Float64()*4-2)
		}
		return buf
	}
	p.q = fill(b.rows() * qh * D)
	p.kc = fill(nb * b.bs * kvh * D)
	p.vc = fill(nb * b.bs * kvh * D)
	return p
}

// The plan's two-phase attention (shared runs with batched queries, tails,
// merged) equals plain decode attention, in float64 before the one rounding
// into the output dtype, on random trees, forks and batches without sharing,
// with lengths ending inside shared runs and empty sequences.
func TestRefMatchesDecode(t *testing.T) {
	r := testseed.Rand(t, 11)
	cases := []treeCase{
		{"tree_f32_bs16", treeSpec{seqs: 12, depth: 3, maxRun: 6, maxTail: 90, bs: 16, partialOK: true}, attn.F32, 8, 2, 64},
		{"tree_f16_bs1", treeSpec{seqs: 9, depth: 2, maxRun: 40, maxTail: 30, bs: 1}, attn.F16, 4, 4, 64},
		{"tree_bf16_bs64", treeSpec{seqs: 7, depth: 4, maxRun: 3, maxTail: 150, bs: 64, partialOK: true}, attn.BF16, 8, 1, 128},
		{"forks_f32", treeSpec{seqs: 10, depth: 1, maxRun: 20, maxTail: 20, bs: 16}, attn.F32, 4, 2, 64},
		{"none_f32", treeSpec{seqs: 6, depth: 0, maxTail: 200, bs: 16}, attn.F32, 4, 2, 64},
		{"empty_tails", treeSpec{seqs: 5, depth: 2, maxRun: 4, maxTail: 0, bs: 16}, attn.F32, 4, 2, 256},
	}
	var pl Planner
	pl.SetKeepAll(true) // every shared run becomes a node, short ones included
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			nodes := 0
			for rep := 0; rep < 3; rep++ {
				b := genTree(r, c.spec)
				if c.name == "empty_tails" {
					b.lens[0] = 0
				}
				p := newProblem(r, b, c.d, c.qh, c.kvh, c.D)
				l, _ := NewLayout(len(b.lens), c.qh, c.kvh, c.D)
				in := b.input(c.qh, c.kvh, c.D)
				in.NoDecodeRoute = true
				in.Slots = 1 + r.IntN(50)
				ws, s := planPoisoned(t, &pl, in, &l, c.name)
				n := len(b.lens) * c.qh * c.D
				got := make([]byte, n*c.d.Size())
				want := make([]byte, n*c.d.Size())
				gl := make([]float32, len(b.lens)*c.qh)
				wl := make([]float32, len(b.lens)*c.qh)
				if err := Ref(ws, &l, &p.dl, p.q, p.kc, p.vc, b.table, b.lens, got, gl); err != nil {
					t.Fatal(err)
				}
				if err := attnref.PagedDecode(&p.dl, p.q, p.kc, p.vc, b.table, b.lens, want, wl, 1); err != nil {
					t.Fatal(err)
				}
				tol := map[attn.DType]float64{attn.F32: 1e-6, attn.F16: 1e-3, attn.BF16: 8e-3}[c.d]
				for i := 0; i < n; i++ {
					g, w := c.d.Load(got, int64(i)), c.d.Load(want, int64(i))
					if math.IsNaN(g) || math.Abs(g-w) > tol*(1+math.Abs(w)) {
						t.Fatalf("rep %d (nodes %d, parts %d) element %d (seq %d): got %g, want %g", rep, s.Nodes, s.Parts, i, i/(c.qh*c.D), g, w)
					}
				}
				for i := range wl {
					if math.IsInf(float64(wl[i]), -1) != math.IsInf(float64(gl[i]), -1) ||
						!math.IsInf(float64(wl[i]), -1) && math.Abs(float64(gl[i]-wl[i])) > 1e-5*(1+math.Abs(float64(wl[i]))) {
						t.Fatalf("lse %d: got %g, want %g", i, gl[i], wl[i])
					}
				}
				nodes += s.Nodes
			}
			if c.spec.depth > 0 && nodes == 0 {
				t.Fatalf("three tree batches planned with no shared node")
			}
		})
	}
}
