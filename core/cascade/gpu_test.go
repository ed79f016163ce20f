package cascade_test

// GPU tests: the cascade kernels over plans of random sharing trees, against
// the float64 reference of the same plan, outputs and partial states
// poisoned with NaN first, and inside a captured CUDA graph across steps
// that grow every sequence. They skip only on machines with no NVIDIA
// device and fail on any other CUDA error (internal/gputest); run them on a
// GPU machine with
//   go test -c -o .device/cascade.test ./core/cascade && KVPLUG_REQUIRE_GPU=1 .device/cascade.test -test.run GPU -test.v
// (the prefill tests alone: -test.run GPUCascadePrefill).

import (
	"bytes"
	"encoding/binary"
	"fmt"
	. "github.com/kvplug/kvplug/core/cascade"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/internal/gputest"
	"github.com/kvplug/kvplug/internal/testseed"
)

// growable gives every sequence `extra` more table columns with fresh
// blocks after its last used one, so that lengths can grow.
func growable(b *batch, extra int) *batch {
	w := widen(b, extra)
	next := int32(b.numBlocks)
	for s, n := range b.lens {
		used := 0
		for c := 0; c < b.maxBlocks; c++ {
			if b.table[s*b.stride+c] >= 0 {
				used = c + 1
			}
		}
		used = max(used, (int(n)+b.bs-1)/b.bs)
		for c := used; c < w.maxBlocks; c++ {
			w.table[s*w.stride+c] = next
			next++
		}
	}
	w.numBlocks = int(next)
	return w
}

// gpuRun is a problem on the device with its workspaces.
type gpuRun struct {
	p      *problem
	l      Layout
	ws     []int32
	run    attn.CascadeRunArgs
	dev    cuda.DevicePtr
	lensD  cuda.DevicePtr
	outB   int
	planer Planner
	slots  int
}

func newGPURun(t *testing.T, r *rand.Rand, b *batch, d attn.DType, qh, kvh, D int, withLSE bool) *gpuRun {
	g := &gpuRun{p: newProblem(r, b, d, qh, kvh, D)}
	var err error
	maxTok := max(len(b.lens), 1) // decode: the decode layout
	if b.qo != nil {
		maxTok = 4*b.rows() + MaxParts*len(b.lens) // room for MaxParts partial states per row
	}
	if g.l, err = NewPrefillLayout(max(len(b.lens), 1), maxTok, qh, kvh, D); err != nil {
		t.Fatal(err)
	}
	if g.slots, err = attn.CascadeSlots(D); err != nil {
		t.Fatal(err)
	}
	g.ws = make([]int32, g.l.HostInts)
	g.dev = gputest.Alloc(t, int(g.l.DeviceBytes))
	gputest.Poison(t, g.dev, int(g.l.DeviceBytes), attn.F32)
	g.lensD = gputest.Upload(t, gputest.Int32Bytes(b.lens))
	g.outB = b.rows() * qh * D * d.Size()
	g.run = attn.CascadeRunArgs{DecodeLayout: g.p.dl, Rows: b.rows(),
		Q:       gputest.Upload(t, g.p.q),
		SeqLens: g.lensD,
		Out:     gputest.Alloc(t, g.outB), Workspace: g.dev, WorkspaceBytes: g.l.DeviceBytes,
		PartOut: g.l.PartOut, PartLSE: g.l.PartLSE,
		ItemsOff: g.l.Items, QRowsOff: g.l.QRows, SegStartOff: g.l.SegStart, SegsOff: g.l.Segs,
		RowSeqOff: g.l.RowSeq, QStartOff: g.l.QStart, MaxBatch: g.l.MaxBatch, MaxRows: g.l.MaxTokens,
	}
	g.run.KCache, g.run.VCache = gputest.Upload(t, g.p.kc), gputest.Upload(t, g.p.vc)
	g.run.BlockTable = gputest.Upload(t, gputest.Int32Bytes(b.table))
	if withLSE {
		g.run.LSE = gputest.Alloc(t, 4*b.rows()*qh)
	}
	return g
}

// plan plans the batch and uploads the whole plan region.
func (g *gpuRun) plan(t *testing.T, keepAll bool) Summary {
	return g.planFor(t, keepAll, false)
}

// planFor plans the batch, for the wgmma mainloop's tail tiles if wgmma,
// and uploads the whole plan region.
func (g *gpuRun) planFor(t *testing.T, keepAll, wgmma bool) Summary {
	in := g.p.b.input(g.p.dl.NumQHeads, g.p.dl.NumKVHeads, g.p.dl.HeadDim)
	in.NoDecodeRoute, in.Slots, in.SharedWgmma = true, g.slots, wgmma
	g.planer.SetKeepAll(keepAll)
	s, err := g.planer.Plan(in, &g.l, g.ws)
	if err != nil {
		t.Fatal(err)
	}
	gputest.Put(t, g.dev, gputest.Int32Bytes(g.ws[:g.l.PlanInts]))
	return s
}

// poisonParts fills the workspace's partial states with NaN.
func (g *gpuRun) poisonParts(t *testing.T) {
	gputest.Poison(t, g.dev+cuda.DevicePtr(g.l.PartOut), int(g.l.DeviceBytes-g.l.PartOut), attn.F32)
}

func (g *gpuRun) poisonOut(t *testing.T) {
	gputest.Poison(t, g.run.Out, g.outB, g.p.dl.DType)
	if g.run.LSE != 0 {
		gputest.Poison(t, g.run.LSE, 4*g.p.b.rows()*g.p.dl.NumQHeads, attn.F32)
	}
}

// check compares the device output with the plan's float64 reference.
func (g *gpuRun) check(t *testing.T, what string) {
	t.Helper()
	if err := cuda.Synchronize(); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	R, H := g.p.b.rows(), g.p.dl.NumQHeads
	want := make([]byte, g.outB)
	wantLSE := make([]float32, R*H)
	if err := Ref(g.ws, &g.l, &g.p.dl, g.p.q, g.p.kc, g.p.vc, g.p.b.table, g.p.b.lens, want, wantLSE); err != nil {
		t.Fatal(err)
	}
	var gotLSE []byte
	if g.run.LSE != 0 {
		gotLSE = gputest.Download(t, g.run.LSE, 4*R*H)
	}
	compareRows(t, what+" vs float64", g.p, gputest.Download(t, g.run.Out, g.outB), gotLSE, want, wantLSE, 1)
}

// compareRows compares outputs [rows, H, D] (and lse when got holds one)
// row by row: relative L2 error per query row, NaN or inf anywhere (an
// unwritten, poisoned element) fails. slack widens the tolerance for two
// rounded results.
func compareRows(t *testing.T, what string, p *problem, got, gotLSE, want []byte, wantLSE []float32, slack float64) {
	t.Helper()
	d, H, D := p.dl.DType, p.dl.NumQHeads, p.dl.HeadDim
	b := p.b
	seqOf := func(row int) (int, int) { // sequence and token index of a query row
		if b.qo == nil {
			return row, 0
		}
		s := 0
		for int(b.qo[s+1]) <= row {
			s++
		}
		return s, row - int(b.qo[s])
	}
	tol := slack * map[attn.DType]float64{attn.F16: 3e-3, attn.BF16: 1.5e-2}[d]
	for r := 0; r < b.rows(); r++ {
		var num, den float64
		for i := 0; i < H*D; i++ {
			gv, wv := d.Load(got, int64(r*H*D+i)), d.Load(want, int64(r*H*D+i))
			if math.IsNaN(gv) || math.IsInf(gv, 0) {
				s, k := seqOf(r)
				t.Fatalf("%s: row %d (seq %d token %d, len %d) element %d is %g (unwritten?); want %g", what, r, s, k, b.lens[s], i, gv, wv)
			}
			num += (gv - wv) * (gv - wv)
			den += wv * wv
		}
		if den == 0 && num != 0 || den > 0 && math.Sqrt(num/den) > tol {
			s, k := seqOf(r)
			t.Fatalf("%s: row %d (seq %d token %d, len %d): relative error %.3g above %.1g", what, r, s, k, b.lens[s], math.Sqrt(num/max(den, 1e-300)), tol)
		}
	}
	if gotLSE == nil {
		return
	}
	for i := range wantLSE {
		gl := float64(math.Float32frombits(binary.LittleEndian.Uint32(gotLSE[4*i:])))
		wl := float64(wantLSE[i])
		if math.IsInf(wl, -1) != math.IsInf(gl, -1) || !math.IsInf(wl, -1) && math.Abs(gl-wl) > slack*2e-3*math.Max(1, math.Abs(wl)) {
			s, k := seqOf(i / H)
			t.Fatalf("%s: lse[row %d head %d] (seq %d token %d) = %g, want %g", what, i/H, i%H, s, k, gl, wl)
		}
	}
}

// Random trees (depth 1-4, groups up to 128, tails 0-2048, block sizes
// 1/16/64), forks and batches with no sharing, f16 and bf16, head_dim
// 64/128/256, GQA groups 1-8: the kernels equal the float64 reference.
func TestGPUCascade(t *testing.T) {
	gputest.NeedKernels(t, attn.Prepare)
	r := testseed.Rand(t, 11)
	cases := []treeCase{
		{"tree_d3_bs16", treeSpec{seqs: 40, depth: 3, maxRun: 20, maxTail: 300, bs: 16, partialOK: true}, attn.F16, 32, 8, 128},
		{"tree_d4_bs1", treeSpec{seqs: 24, depth: 4, maxRun: 90, maxTail: 100, bs: 1}, attn.BF16, 8, 8, 64},
		{"tree_d2_bs64", treeSpec{seqs: 16, depth: 2, maxRun: 6, maxTail: 2048, bs: 64}, attn.F16, 16, 2, 256},
		{"group128_bs16", treeSpec{seqs: 128, depth: 1, maxRun: 40, maxTail: 64, bs: 16}, attn.BF16, 32, 8, 128},
		{"forks_bs16", treeSpec{seqs: 64, depth: 1, maxRun: 64, maxTail: 40, bs: 16}, attn.F16, 32, 4, 128},
		{"tails_only", treeSpec{seqs: 30, depth: 0, maxTail: 1500, bs: 16}, attn.F16, 32, 8, 128},
		{"tree_d1_h64_g1", treeSpec{seqs: 20, depth: 1, maxRun: 30, maxTail: 500, bs: 16}, attn.BF16, 4, 4, 64},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for rep := 0; rep < 2; rep++ {
				b := genTree(r, c.spec)
				if c.name == "forks_bs16" { // all but the tails shared: one run for every sequence
					for s := range b.lens {
						copy(b.table[s*b.stride:s*b.stride+b.maxBlocks/2], b.table[:b.maxBlocks/2])
					}
				}
				b.lens[r.IntN(len(b.lens))] = 0 // an empty sequence: out 0, lse -inf
				g := newGPURun(t, r, b, c.d, c.qh, c.kvh, c.D, rep == 0)
				s := g.plan(t, rep == 1)
				g.poisonOut(t)
				if err := attn.CascadeRun(&g.run, 0); err != nil {
					t.Fatal(err)
				}
				g.check(t, fmt.Sprintf("rep %d (nodes %d, items %d, parts %d, chunk %d)", rep, s.Nodes, s.Items, s.Parts, s.Chunk))
			}
		})
	}
}

// A captured graph of the run replays correctly across steps that grow
// every sequence: Update absorbs most steps (only the device lengths
// change), and a new plan into the same workspaces serves the same graph.
func TestGPUCascadeGraphAcrossSteps(t *testing.T) {
	gputest.NeedKernels(t, attn.Prepare)
	r := testseed.Rand(t, 11)
	b := growable(genTree(r, treeSpec{seqs: 48, depth: 2, maxRun: 16, maxTail: 200, bs: 16}), 24) // room for 150 steps of up to 2 tokens
	g := newGPURun(t, r, b, attn.F16, 32, 8, 128, true)
	g.plan(t, false)
	s := gputest.Stream(t)
	// One run outside the capture resolves the kernels and raises their
	// shared-memory limit, which a replay cannot do.
	if err := attn.CascadeRun(&g.run, s); err != nil {
		t.Fatal(err)
	}
	if err := cuda.StreamSynchronize(s); err != nil {
		t.Fatal(err)
	}
	graph, err := cuda.Capture(s, func() error { return attn.CascadeRun(&g.run, s) })
	if err != nil {
		t.Fatal(err)
	}
	defer graph.Destroy()
	replans := 0
	for step := 0; step < 150; step++ {
		if step > 0 {
			for i := range b.lens {
				if b.lens[i] > 0 {
					b.lens[i] += int32(1 + r.IntN(2))
				}
			}
			ok, err := Update(g.ws, &g.l, RouteCascade, len(b.lens), b.lens)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				g.plan(t, false)
				replans++
			}
			gputest.Put(t, g.lensD, gputest.Int32Bytes(b.lens))
		}
		if step%30 != 0 && step != 149 {
			continue
		}
		g.poisonOut(t)
		if err := graph.Launch(s); err != nil {
			t.Fatal(err)
		}
		if err := cuda.StreamSynchronize(s); err != nil {
			t.Fatal(err)
		}
		g.check(t, fmt.Sprintf("step %d", step))
	}
	if replans == 0 {
		t.Fatalf("150 steps of growth needed no new plan: the test does not cover one")
	}
	t.Logf("%d new plans in 150 steps", replans)
}

// prefillOnDevice runs kvplug's own paged prefill (plan kernel and run) on
// the problem's device tensors and returns its output and lse.
func (g *gpuRun) prefillOnDevice(t *testing.T) ([]byte, []byte) {
	t.Helper()
	b := g.p.b
	R, H := b.rows(), g.p.dl.NumQHeads
	sh, pl := prefillOf(&g.p.dl)
	wsBytes, err := attn.PrefillWorkspaceSize(len(b.lens), max(R, 1), H, g.p.dl.NumKVHeads, g.p.dl.HeadDim)
	if err != nil {
		t.Fatal(err)
	}
	qoD := gputest.Upload(t, gputest.Int32Bytes(b.qo))
	pp, err := attn.PlanPrefill(&attn.PrefillPlanArgs{PrefillShape: sh, QOIndptr: b.qo, KVLens: b.lens,
		QOIndptrDev: qoD, KVLensDev: g.lensD, Workspace: gputest.Alloc(t, int(wsBytes)), WorkspaceBytes: wsBytes}, 0)
	if err != nil {
		t.Fatal(err)
	}
	out := gputest.Alloc(t, g.outB)
	lse := gputest.Alloc(t, 4*R*H)
	gputest.Poison(t, out, g.outB, g.p.dl.DType)
	gputest.Poison(t, lse, 4*R*H, attn.F32)
	pl.KCache, pl.VCache, pl.BlockTable = g.run.KCache, g.run.VCache, g.run.BlockTable
	if err := attn.PagedPrefill(&pp, &attn.PagedPrefillArgs{PrefillLayout: pl, Q: g.run.Q,
		Out: out, LSE: lse}, 0); err != nil {
		t.Fatal(err)
	}
	if err := cuda.Synchronize(); err != nil {
		t.Fatal(err)
	}
	return gputest.Download(t, out, g.outB), gputest.Download(t, lse, 4*R*H)
}

// Varlen prefill queries sharing cached prefixes: random trees (depth 1-3,
// block sizes 1/16/64) of sequences with 1-1000 new tokens (decode rows,
// sequences without queries and prompts mixed), f16 and bf16, head_dim
// 64/128/256, GQA groups 1-8: the cascade kernels equal the plan's float64
// reference and kvplug's own paged prefill on the same device inputs, with
// outputs and partial states poisoned first. The second batch is planned
// with the wgmma mainloop's 128-row tail tiles (run there on Hopper), and
// run again on the sm_80 kernels alone.
func TestGPUCascadePrefill(t *testing.T) {
	gputest.NeedKernels(t, attn.Prepare)
	r := testseed.Rand(t, 11)
	cases := []prefillCase{
		// Sizes keep the float64 reference to about a minute on one core.
		{"prompts_bs16", treeSpec{seqs: 4, depth: 1, maxRun: 64, maxTail: 1000, bs: 16}, 1000, attn.F16, 8, 2, 128},
		{"tree_d3_bs16", treeSpec{seqs: 16, depth: 3, maxRun: 15, maxTail: 200, bs: 16, partialOK: true}, 200, attn.BF16, 8, 2, 128},
		{"tree_d2_bs1", treeSpec{seqs: 10, depth: 2, maxRun: 100, maxTail: 100, bs: 1}, 100, attn.F16, 8, 8, 64},
		{"tree_d2_bs64", treeSpec{seqs: 8, depth: 2, maxRun: 4, maxTail: 400, bs: 64}, 300, attn.BF16, 4, 1, 256},
		{"group8_h64", treeSpec{seqs: 12, depth: 1, maxRun: 20, maxTail: 300, bs: 16}, 300, attn.F16, 16, 2, 64},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for rep := 0; rep < 2; rep++ {
				b := withQueries(r, genTree(r, c.spec), c.maxQ)
				g := newGPURun(t, r, b, c.d, c.qh, c.kvh, c.D, true)
				s := g.planFor(t, rep == 1, rep == 1)
				if s.Route != RouteCascade {
					t.Fatalf("route %d with NoDecodeRoute", s.Route)
				}
				g.poisonOut(t)
				if err := attn.CascadeRun(&g.run, 0); err != nil {
					t.Fatal(err)
				}
				what := fmt.Sprintf("rep %d (rows %d, max q %d, nodes %d, items %d, parts %d, chunk %d)", rep, s.Rows, s.MaxQLen, s.Nodes, s.Items, s.Parts, s.Chunk)
				g.check(t, what)
				// kvplug's paged prefill: both are rounded once from float32
				// accumulations, so twice the tolerance.
				got := gputest.Download(t, g.run.Out, g.outB)
				gotLSE := gputest.Download(t, g.run.LSE, 4*b.rows()*c.qh)
				pout, plse := g.prefillOnDevice(t)
				lse := gputest.F32s(plse)
				compareRows(t, what+" vs paged_prefill", g.p, got, gotLSE, pout, lse, 2)
				if rep == 1 {
					// The same plan again: its outputs to the bit (on
					// Hopper the first launch's counter was left at zero
					// for it), then on the sm_80 kernels alone; partial
					// states poisoned before each.
					g.poisonParts(t)
					g.poisonOut(t)
					if err := attn.CascadeRun(&g.run, 0); err != nil {
						t.Fatal(err)
					}
					if again := gputest.Download(t, g.run.Out, g.outB); !bytes.Equal(again, got) {
						t.Fatalf("%s: a second run of the plan differs from the first", what)
					}
					g.run.SM80 = true
					g.poisonParts(t)
					g.poisonOut(t)
					if err := attn.CascadeRun(&g.run, 0); err != nil {
						t.Fatal(err)
					}
					got = gputest.Download(t, g.run.Out, g.outB)
					gotLSE = gputest.Download(t, g.run.LSE, 4*b.rows()*c.qh)
					compareRows(t, what+" on the sm_80 kernels vs paged_prefill", g.p, got, gotLSE, pout, lse, 2)
				}
			}
		})
	}
}
