package cascade_test

import (
	"fmt"
	. "github.com/kvplug/kvplug/core/cascade"
	"math"
	"testing"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/attn/attnref"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/testseed"
)

// prefillLayout is a layout with room for the batch's query rows.
func prefillLayout(t *testing.T, b *batch, extraSeqs, qh, kvh, D int) Layout {
	t.Helper()
	mb := len(b.lens) + extraSeqs
	// Room for MaxParts partial states per query row.
	l, err := NewPrefillLayout(max(mb, 1), 4*max(mb, b.rows(), 1)+MaxParts*mb, qh, kvh, D)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// Random trees with varlen queries (decode rows, empty rows and prompts of
// up to 300 tokens mixed): every plan checks out by brute force, shared runs
// end before each member's first query token, and with every shared run
// emitted the saving is at most the brute-force maximum of runs that end
// there.
func TestPlanRandomTreesPrefill(t *testing.T) {
	r := testseed.Rand(t, 11)
	var p Planner
	for iter := 0; iter < 300; iter++ {
		spec := randomSpec(r, 30, 400)
		b := withQueries(r, genTree(r, spec), 1+r.IntN(300))
		qh, kvh, D := cycleHeads(iter)
		in := b.input(qh, kvh, D)
		in.NoDecodeRoute = true
		in.Slots = 1 + r.IntN(600)
		in.SharedWgmma = iter%4 >= 2 // long tails in 128-row tiles
		l := prefillLayout(t, b, r.IntN(3), qh, kvh, D)
		p.SetKeepAll(iter%2 == 0)
		ws, s := planPoisoned(t, &p, in, &l, fmt.Sprintf("iter %d %+v", iter, spec))
		checkPlan(t, b, in, &l, ws, s)
	}
}

// A plan's run equals plain paged prefill (attnref.PagedPrefill), in float64
// before the one rounding into the output dtype: random trees of prompts
// sharing prefixes, with decode rows, empty rows and long queries mixed,
// block sizes 1/16/64, lengths ending inside shared runs.
func TestRefMatchesPrefill(t *testing.T) {
	r := testseed.Rand(t, 11)
	cases := []prefillCase{
		{"tree_f32_bs16", treeSpec{seqs: 10, depth: 3, maxRun: 5, maxTail: 80, bs: 16, partialOK: true}, 60, attn.F32, 8, 2, 64},
		{"tree_f16_bs1", treeSpec{seqs: 7, depth: 2, maxRun: 30, maxTail: 40, bs: 1}, 40, attn.F16, 4, 4, 64},
		{"tree_bf16_bs64", treeSpec{seqs: 5, depth: 2, maxRun: 2, maxTail: 150, bs: 64, partialOK: true}, 100, attn.BF16, 4, 1, 128},
		{"prompts_f32", treeSpec{seqs: 4, depth: 1, maxRun: 8, maxTail: 200, bs: 16}, 150, attn.F32, 4, 2, 64},
	}
	var pl Planner
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			nodes := 0
			// Three batches, and more while none has shared a node (a random
			// tree whose queries start before its shared runs end shares
			// nothing): up to 8. The second is planned for the wgmma
			// mainloop with the cost model's choice of runs, the others
			// share every run.
			for rep := 0; rep < 3 || (nodes == 0 && rep < 8); rep++ {
				pl.SetKeepAll(rep != 1)
				b := withQueries(r, genTree(r, c.spec), c.maxQ)
				p := newProblem(r, b, c.d, c.qh, c.kvh, c.D)
				l := prefillLayout(t, b, 0, c.qh, c.kvh, c.D)
				in := b.input(c.qh, c.kvh, c.D)
				in.NoDecodeRoute = true
				in.Slots = 1 + r.IntN(50)
				in.SharedWgmma = rep%2 == 1 // long tails in 128-row tiles
				ws, s := planPoisoned(t, &pl, in, &l, c.name)
				compareWithPrefill(t, p, &l, ws, s, c.d)
				nodes += s.Nodes
			}
			if nodes == 0 {
				t.Fatalf("eight tree batches planned with no shared node")
			}
		})
	}
}

// compareWithPrefill runs Ref on the plan and attnref.PagedPrefill on the
// batch and compares outputs and lse.
func compareWithPrefill(t *testing.T, p *problem, l *Layout, ws []int32, s Summary, d attn.DType) {
	t.Helper()
	b := p.b
	qh, D := p.dl.NumQHeads, p.dl.HeadDim
	n := b.rows() * qh * D
	got := make([]byte, n*d.Size())
	want := make([]byte, n*d.Size())
	gl := make([]float32, b.rows()*qh)
	wl := make([]float32, b.rows()*qh)
	if err := Ref(ws, l, &p.dl, p.q, p.kc, p.vc, b.table, b.lens, got, gl); err != nil {
		t.Fatal(err)
	}
	sh, pl := prefillOf(&p.dl)
	if err := attnref.PagedPrefill(&sh, &pl, b.qo, b.lens, p.q, p.kc, p.vc, b.table, want, wl); err != nil {
		t.Fatal(err)
	}
	tol := map[attn.DType]float64{attn.F32: 1e-6, attn.F16: 1e-3, attn.BF16: 8e-3}[d]
	for i := 0; i < n; i++ {
		g, w := d.Load(got, int64(i)), d.Load(want, int64(i))
		if math.IsNaN(g) || math.Abs(g-w) > tol*(1+math.Abs(w)) {
			t.Fatalf("route %d (nodes %d, parts %d) element %d (row %d): got %g, want %g", s.Route, s.Nodes, s.Parts, i, i/(qh*D), g, w)
		}
	}
	for i := range wl {
		if math.IsInf(float64(wl[i]), -1) != math.IsInf(float64(gl[i]), -1) ||
			!math.IsInf(float64(wl[i]), -1) && math.Abs(float64(gl[i]-wl[i])) > 1e-5*(1+math.Abs(float64(wl[i]))) {
			t.Fatalf("lse %d: got %g, want %g", i, gl[i], wl[i])
		}
	}
}

func prefillOf(dl *attn.DecodeLayout) (attn.PrefillShape, attn.PrefillLayout) {
	return attn.PrefillShape{DType: dl.DType, HeadDim: dl.HeadDim, NumQHeads: dl.NumQHeads, NumKVHeads: dl.NumKVHeads, WindowLeft: -1},
		attn.PrefillLayout{QTokenStride: dl.QBatchStride, QHeadStride: dl.QHeadStride,
			OutTokenStride: dl.OutBatchStride, OutHeadStride: dl.OutHeadStride,

			Scale: dl.Scale, PagedKV:

			// sharedPrompts is n sequences sharing a prompt of p tokens (block size
			// 16), each with q new tokens after own cached tokens of `own`.
			attn.PagedKV{NumBlocks: dl.NumBlocks, BlockSize: dl.BlockSize,
				CacheBlockStride: dl.CacheBlockStride, CacheTokenStride: dl.CacheTokenStride, CacheHeadStride: dl.CacheHeadStride,
				MaxBlocksPerSeq: dl.MaxBlocksPerSeq, BlockTableStride: dl.BlockTableStride}}
}

func sharedPrompts(n, p, own, q int) *batch {
	cols := (p + own + q + 15) / 16
	b := &batch{bs: 16, maxBlocks: cols, stride: cols, table: make([]int32, n*cols), lens: make([]int32, n), qo: make([]int32, n+1)}
	next := int32(p / 16)
	for s := 0; s < n; s++ {
		for c := 0; c < cols; c++ {
			if c < p/16 {
				b.table[s*cols+c] = int32(c)
			} else {
				b.table[s*cols+c] = next
				next++
			}
		}
		b.lens[s] = int32(p + own + q)
		b.qo[s+1] = b.qo[s] + int32(q)
	}
	b.numBlocks = int(next)
	return b
}

// Prefill routes: 8 prompts of 200-1000 new tokens over a shared 4096-token
// prompt take the cascade; the same prompts without sharing, and a batch
// whose sharing is a single block, take the prefill kernel; a plan that
// needs more partial states than the workspaces hold takes the prefill
// kernel too, or is refused with NoDecodeRoute. Ref of every route equals
// plain prefill.
func TestPlanPrefillRoutes(t *testing.T) {
	r := testseed.Rand(t, 11)
	var p Planner
	b := sharedPrompts(8, 4096, 0, 900)
	for s := 0; s < 8; s++ { // 200-900 new tokens each
		q := int32(200 + 100*s)
		b.qo[s+1] = b.qo[s] + q
		b.lens[s] = 4096 + q
	}
	l := prefillLayout(t, b, 0, 32, 8, 128)
	ws := make([]int32, l.HostInts)
	s, err := p.Plan(b.input(32, 8, 128), &l, ws)
	if err != nil || s.Route != RouteCascade || s.SavedTokens != 7*4096 || s.Rows != int(b.qo[8]) || s.MaxQLen != 900 {
		t.Fatalf("shared prompt: %+v %v", s, err)
	}
	checkPlan(t, b, b.input(32, 8, 128), &l, ws, s)
	if ok, err := Update(ws, &l, s.Route, 8, b.lens); ok || err != nil {
		t.Fatalf("a prefill plan fits a later step: %v %v", ok, err)
	}

	none := sharedPrompts(8, 0, 512, 300)
	l2 := prefillLayout(t, none, 0, 32, 8, 128)
	ws2 := make([]int32, l2.HostInts)
	if s, err := p.Plan(none.input(32, 8, 128), &l2, ws2); err != nil || s.Route != RoutePrefill || s.Items != 0 {
		t.Fatalf("no sharing: %+v %v", s, err)
	}
	one := sharedPrompts(8, 16, 2000, 300)
	if s, err := p.Plan(one.input(32, 8, 128), &l2, ws2); err != nil || s.Route != RoutePrefill {
		t.Fatalf("one shared block: %+v %v", s, err)
	}

	// Too little room for partial states: max_tokens just the rows.
	tight, err := NewPrefillLayout(8, int(b.qo[8]), 32, 8, 128)
	if err != nil {
		t.Fatal(err)
	}
	wst := make([]int32, tight.HostInts)
	deep := sharedPrompts(8, 4096, 0, 200)
	for s := 0; s < 8; s++ { // 4 levels: 4096 by all, then pairs share 1024 more, then ... each with 200 new tokens
		for c := 256; c < deep.maxBlocks; c++ {
			deep.table[s*deep.stride+c] = int32(100000 + (s/2)*1000 + c)
		}
	}
	in := deep.input(32, 8, 128)
	in.Headroom = 1 << 20 // tails of several chunks
	in.Slots = 100000
	tight, _ = NewPrefillLayout(8, int(deep.qo[8]), 32, 8, 128)
	wst = make([]int32, tight.HostInts)
	s, err = p.Plan(in, &tight, wst)
	if err != nil {
		t.Fatal(err)
	}
	if s.Route == RouteCascade && s.Parts > tight.PartCap {
		t.Fatalf("plan exceeds the partial capacity: %+v", s)
	}
	in.NoDecodeRoute = true
	for i := range wst {
		wst[i] = 77
	}
	if s2, err := p.Plan(in, &tight, wst); err == nil {
		checkPlan(t, deep, in, &tight, wst, s2)
	} else if kverr.CodeOf(err) != kverr.BufferTooSmall {
		t.Fatalf("too many partial states: %v", err)
	} else {
		for i, v := range wst {
			if v != 77 {
				t.Fatalf("word %d written on error", i)
			}
		}
	}

	// The plain prefill route's reference is the prefill kernel's.
	small := sharedPrompts(3, 0, 40, 30)
	pr := newProblem(r, small, attn.F32, 4, 2, 64)
	l3 := prefillLayout(t, small, 0, 4, 2, 64)
	ws3 := make([]int32, l3.HostInts)
	s, err = p.Plan(small.input(4, 2, 64), &l3, ws3)
	if err != nil || s.Route != RoutePrefill {
		t.Fatalf("small: %+v %v", s, err)
	}
	compareWithPrefill(t, pr, &l3, ws3, s, attn.F32)
}

// Bad query offsets are status codes with messages and write nothing.
func TestPlanPrefillErrors(t *testing.T) {
	b := sharedPrompts(4, 64, 16, 20)
	l := prefillLayout(t, b, 0, 8, 2, 64)
	var p Planner
	cases := []struct {
		name string
		qo   []int32
		code kverr.Code
	}{
		{"short", []int32{0, 20, 40, 60}, kverr.InvalidArgument},
		{"not from 0", []int32{1, 20, 40, 60, 80}, kverr.InvalidArgument},
		{"decreasing", []int32{0, 20, 10, 60, 80}, kverr.InvalidArgument},
		{"q_len above length", []int32{0, 20, 40, 60, 161}, kverr.InvalidArgument},
	}
	ws := make([]int32, l.HostInts)
	for _, c := range cases {
		in := b.input(8, 2, 64)
		in.QIndptr = c.qo
		for i := range ws {
			ws[i] = 5
		}
		_, err := p.Plan(in, &l, ws)
		if kverr.CodeOf(err) != c.code || err.Error() == "" {
			t.Fatalf("%s: got %v, want code %v", c.name, err, c.code)
		}
		for i, v := range ws {
			if v != 5 {
				t.Fatalf("%s: word %d written on error", c.name, i)
			}
		}
	}
	small, _ := NewPrefillLayout(4, 40, 8, 2, 64)
	if _, err := p.Plan(b.input(8, 2, 64), &small, make([]int32, small.HostInts)); kverr.CodeOf(err) != kverr.BufferTooSmall {
		t.Fatalf("rows above max_tokens: %v", err)
	}
	if _, err := NewPrefillLayout(8, 7, 8, 2, 64); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("max_tokens below max_batch: %v", err)
	}
}

// With PlainPrefillFaster (a Hopper device, whose plain prefill kernel
// outruns the cascade's shared items), the same shared-prompt batch that
// takes the cascade above takes the prefill route; NoDecodeRoute still keeps
// the cascade, and a decode batch over a shared prompt is not affected.
func TestPlanPlainPrefillFaster(t *testing.T) {
	var p Planner
	b := sharedPrompts(8, 4096, 0, 900)
	for s := 0; s < 8; s++ {
		q := int32(200 + 100*s)
		b.qo[s+1] = b.qo[s] + q
		b.lens[s] = 4096 + q
	}
	l := prefillLayout(t, b, 0, 32, 8, 128)
	ws := make([]int32, l.HostInts)
	in := b.input(32, 8, 128)
	in.PlainPrefillFaster = true
	s, err := p.Plan(in, &l, ws)
	if err != nil || s.Route != RoutePrefill || s.Items != 0 || s.SavedTokens != 7*4096 {
		t.Fatalf("prefill rows on a faster plain prefill: %+v %v", s, err)
	}
	in.NoDecodeRoute = true
	if s, err = p.Plan(in, &l, ws); err != nil || s.Route != RouteCascade {
		t.Fatalf("NoDecodeRoute: %+v %v", s, err)
	}
	checkPlan(t, b, in, &l, ws, s)

	d := decodeTree(64, 4096, 0, 0, 512)
	dl, err := NewLayout(len(d.lens), 32, 8, 128)
	if err != nil {
		t.Fatal(err)
	}
	dws := make([]int32, dl.HostInts)
	din := d.input(32, 8, 128)
	din.PlainPrefillFaster = true
	if s, err := p.Plan(din, &dl, dws); err != nil || s.Route != RouteCascade {
		t.Fatalf("decode rows: %+v %v", s, err)
	}
}
