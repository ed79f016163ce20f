package attn

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// prefillProblem is a random varlen batch: the paged cache of a decode
// problem (kv_lens = its lengths) and q rows for the last q_len_b tokens of
// each sequence.
type prefillProblem struct {
	*decodeProblem
	s        PrefillShape
	l        PrefillLayout
	qo       []int32
	q        []byte
	totalQ   int
	outBytes int
}

func newPrefillProblem(t testing.TB, r *rand.Rand, ps problemShape, qLens []int, window int) *prefillProblem {
	t.Helper()
	dp := newDecodeProblem(t, r, ps)
	p := &prefillProblem{decodeProblem: dp}
	p.s = PrefillShape{DType: ps.d, HeadDim: ps.headDim, NumQHeads: ps.qHeads, NumKVHeads: ps.kvHeads, WindowLeft: window}
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
	p.l = PrefillLayout{
		QTokenStride: dl.QBatchStride + pad, QHeadStride: dl.QHeadStride,
		OutTokenStride: dl.OutBatchStride, OutHeadStride: dl.OutHeadStride,
		NumBlocks: dl.NumBlocks, BlockSize: dl.BlockSize,
		CacheBlockStride: dl.CacheBlockStride, CacheTokenStride: dl.CacheTokenStride, CacheHeadStride: dl.CacheHeadStride,
		MaxBlocksPerSeq: dl.MaxBlocksPerSeq, BlockTableStride: dl.BlockTableStride, Scale: dl.Scale,
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
		d              DType
		D, qh, kvh, bs int
		kvLens, qLens  []int
		window         int
		padded         bool
	}{
		{F32, 64, 4, 1, 16, []int{37, 5, 80}, []int{37, 1, 20}, -1, false},
		{F32, 64, 8, 2, 1, []int{9, 33}, []int{3, 33}, -1, true},
		{BF16, 128, 4, 4, 7, []int{50, 0, 12}, []int{17, 0, 12}, 5, false},
		{F16, 64, 6, 2, 64, []int{70}, []int{70}, 0, false},
	}
	for ci, c := range cases {
		p := newPrefillProblem(t, r, problemShape{d: c.d, headDim: c.D, qHeads: c.qh, kvHeads: c.kvh, blockSize: c.bs, lens: c.kvLens, padded: c.padded}, c.qLens, c.window)
		out := make([]byte, p.outBytes)
		lse := make([]float32, p.totalQ*c.qh)
		if err := RefPagedPrefill(&p.s, &p.l, p.qo, p.lens, p.q, p.kc, p.vc, p.table, out, lse); err != nil {
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
	p := newPrefillProblem(t, r, problemShape{d: F32, headDim: 128, qHeads: 8, kvHeads: 2, blockSize: 16, lens: lens}, []int{1, 1, 1}, -1)
	p.l.QTokenStride, p.l.OutTokenStride = p.decodeProblem.l.QBatchStride, p.decodeProblem.l.OutBatchStride
	copy(p.q, p.decodeProblem.q)
	out := make([]byte, p.outBytes)
	lse := make([]float32, 3*8)
	if err := RefPagedPrefill(&p.s, &p.l, p.qo, p.lens, p.q, p.kc, p.vc, p.table, out, lse); err != nil {
		t.Fatal(err)
	}
	dout := make([]byte, p.decodeProblem.outBytes())
	dlse := make([]float32, 3*8)
	if err := RefPagedDecode(&p.decodeProblem.l, p.decodeProblem.q, p.kc, p.vc, p.table, p.lens, dout, dlse, 1); err != nil {
		t.Fatal(err)
	}
	for i := range dlse {
		if lse[i] != dlse[i] {
			t.Fatalf("lse %d: prefill %g, decode %g", i, lse[i], dlse[i])
		}
	}
	for i := int64(0); i < int64(len(dout))/4; i++ {
		if a, b := F32.Load(out, i), F32.Load(dout, i); a != b && !(math.IsNaN(a) && math.IsNaN(b)) {
			t.Fatalf("out %d: prefill %g, decode %g", i, a, b)
		}
	}
}

func TestPrefillItems(t *testing.T) {
	s := PrefillShape{DType: BF16, HeadDim: 128, NumQHeads: 32, NumKVHeads: 8, WindowLeft: -1}
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

// Workspaces from PrefillWorkspaceSize hold the work list of any batch
// within its limits.
func TestPrefillWorkspaceSizeBound(t *testing.T) {
	r := rand.New(rand.NewPCG(10, 3))
	for it := 0; it < 200; it++ {
		qh := []int{1, 4, 8, 32}[r.IntN(4)]
		kvh := []int{1, 2, 4}[r.IntN(3)]
		if qh%kvh != 0 {
			kvh = 1
		}
		maxB, maxT := 1+r.IntN(64), 1+r.IntN(5000)
		ws, err := PrefillWorkspaceSize(maxB, maxT, qh, kvh, 128)
		if err != nil {
			t.Fatal(err)
		}
		batch := 1 + r.IntN(maxB)
		qo := make([]int32, batch+1)
		kv := make([]int32, batch)
		left := maxT
		for b := 0; b < batch; b++ {
			n := r.IntN(left + 1)
			left -= n
			qo[b+1] = qo[b] + int32(n)
			kv[b] = int32(n + r.IntN(50))
		}
		s := PrefillShape{DType: F16, HeadDim: 128, NumQHeads: qh, NumKVHeads: kvh, WindowLeft: -1}
		st, err := checkBatch("t", &s, qo, kv)
		if err != nil {
			t.Fatal(err)
		}
		if need := workBytes(st.items); need > ws {
			t.Fatalf("batch %v: work list needs %d bytes, workspace size gave %d", qo, need, ws)
		}
	}
	if _, err := PrefillWorkspaceSize(4, 100, 32, 7, 128); !kverr.Is(err, kverr.InvalidArgument) {
		t.Fatalf("gqa 32/7: %v", err)
	}
	if _, err := PrefillWorkspaceSize(4, 100, 32, 8, 96); !kverr.Is(err, kverr.Unsupported) {
		t.Fatalf("head_dim 96: %v", err)
	}
}

// Misuse is a status with a message, before any device is touched.
func TestPrefillArgumentErrors(t *testing.T) {
	shape := PrefillShape{DType: BF16, HeadDim: 128, NumQHeads: 8, NumKVHeads: 2, WindowLeft: -1}
	good := PrefillPlanArgs{PrefillShape: shape, QOIndptr: []int32{0, 3, 4}, KVLens: []int32{10, 4},
		QOIndptrDev: 0x1000, KVLensDev: 0x2000, Workspace: 0x3000, WorkspaceBytes: 1 << 20}
	cases := []struct {
		name string
		edit func(a *PrefillPlanArgs)
		want kverr.Code
	}{
		{"decreasing offsets", func(a *PrefillPlanArgs) { a.QOIndptr = []int32{0, 3, 2} }, kverr.InvalidArgument},
		{"offsets not from 0", func(a *PrefillPlanArgs) { a.QOIndptr = []int32{1, 3, 4} }, kverr.InvalidArgument},
		{"q_len > kv_len", func(a *PrefillPlanArgs) { a.KVLens = []int32{2, 4} }, kverr.InvalidArgument},
		{"offsets length", func(a *PrefillPlanArgs) { a.QOIndptr = []int32{0, 3} }, kverr.InvalidArgument},
		{"gqa", func(a *PrefillPlanArgs) { a.NumKVHeads = 3 }, kverr.InvalidArgument},
		{"head_dim", func(a *PrefillPlanArgs) { a.HeadDim = 80 }, kverr.Unsupported},
		{"dtype", func(a *PrefillPlanArgs) { a.DType = 7 }, kverr.InvalidArgument},
		{"window", func(a *PrefillPlanArgs) { a.WindowLeft = -2 }, kverr.InvalidArgument},
		{"flags", func(a *PrefillPlanArgs) { a.Flags = 4 }, kverr.InvalidArgument},
		{"workspace small", func(a *PrefillPlanArgs) { a.WorkspaceBytes = 40 }, kverr.BufferTooSmall},
		{"workspace 0", func(a *PrefillPlanArgs) { a.Workspace = 0 }, kverr.NullPointer},
		{"workspace unaligned", func(a *PrefillPlanArgs) { a.Workspace = 0x3004 }, kverr.InvalidArgument},
		{"qo_indptr 0", func(a *PrefillPlanArgs) { a.QOIndptrDev = 0 }, kverr.NullPointer},
		{"kv_lens 0", func(a *PrefillPlanArgs) { a.KVLensDev = 0 }, kverr.NullPointer},
	}
	for _, c := range cases {
		a := good
		c.edit(&a)
		if _, err := PlanPrefill(&a, 0); !kverr.Is(err, c.want) {
			t.Errorf("%s: got %v, want %v", c.name, err, c.want)
		}
	}

	plan := PrefillPlan{Kind: KindPrefill, Route: RoutePrefill, PrefillShape: shape, Batch: 2, TotalQ: 4,
		MaxQLen: 3, MaxKVLen: 10, NumItems: 2, Grid: 264, NumSplits: 1, Workspace: 0x3000, WorkspaceBytes: 1 << 20, KVLens: 0x2000}
	run := PagedPrefillArgs{
		PrefillLayout: PrefillLayout{QTokenStride: 1024, QHeadStride: 128, OutTokenStride: 1024, OutHeadStride: 128,
			NumBlocks: 8, BlockSize: 16, CacheBlockStride: 4096, CacheTokenStride: 256, CacheHeadStride: 128,
			MaxBlocksPerSeq: 1, BlockTableStride: 1, Scale: 0.08},
		Q: 0x10000, KCache: 0x20000, VCache: 0x30000, BlockTable: 0x40000, Out: 0x50000,
	}
	runCases := []struct {
		name string
		edit func(p *PrefillPlan, a *PagedPrefillArgs)
		want kverr.Code
	}{
		{"not planned", func(p *PrefillPlan, a *PagedPrefillArgs) { p.Kind = 0 }, kverr.InvalidArgument},
		{"table too short", func(p *PrefillPlan, a *PagedPrefillArgs) { a.BlockSize = 8 }, kverr.InvalidArgument},
		{"out overlaps", func(p *PrefillPlan, a *PagedPrefillArgs) { a.OutTokenStride = 512 }, kverr.InvalidArgument},
		{"stride not 16 bytes", func(p *PrefillPlan, a *PagedPrefillArgs) { a.QHeadStride = 132 }, kverr.InvalidArgument},
		{"q 0", func(p *PrefillPlan, a *PagedPrefillArgs) { a.Q = 0 }, kverr.NullPointer},
		{"out unaligned", func(p *PrefillPlan, a *PagedPrefillArgs) { a.Out = 0x50008 }, kverr.InvalidArgument},
		{"scale NaN", func(p *PrefillPlan, a *PagedPrefillArgs) { a.Scale = float32(math.NaN()) }, kverr.InvalidArgument},
		{"workspace shrunk", func(p *PrefillPlan, a *PagedPrefillArgs) { p.WorkspaceBytes = 64 }, kverr.BufferTooSmall},
	}
	for _, c := range runCases {
		p, a := plan, run
		c.edit(&p, &a)
		if err := PagedPrefill(&p, &a, 0); !kverr.Is(err, c.want) {
			t.Errorf("run %s: got %v, want %v", c.name, err, c.want)
		}
	}
	if err := PagedPrefill(nil, &run, 0); !kverr.Is(err, kverr.NullPointer) {
		t.Errorf("nil plan: %v", err)
	}
}

func TestPrefillSplits(t *testing.T) {
	const big = 1 << 40
	// B=1, 128 new tokens at group 4 (8 items) over 8192 cached, 8 kv heads,
	// 264 slots: 64 blocks -> 4 splits.
	if s := prefillSplits(264, 8, 8, 8320, 128, 32, 128, 2, big); s != 4 {
		t.Fatalf("splits %d, want 4", s)
	}
	// Enough blocks: no split.
	if s := prefillSplits(264, 40, 8, 8320, 640, 32, 128, 2, big); s != 1 {
		t.Fatalf("splits %d, want 1", s)
	}
	// Short sequences: no split (fewer than 4 tiles per split).
	if s := prefillSplits(264, 1, 1, 200, 10, 4, 128, 2, big); s != 1 {
		t.Fatalf("splits %d, want 1", s)
	}
	// At most 8, and no more than the workspace holds.
	if s := prefillSplits(264, 1, 1, 1<<20, 10, 4, 128, 2, big); s != 8 {
		t.Fatalf("splits %d, want 8", s)
	}
	need3 := splitOffset(3) + splitBytes(3, 10, 4, 128, 2)
	if s := prefillSplits(264, 1, 1, 1<<20, 10, 4, 128, 2, need3); s != 3 {
		t.Fatalf("splits %d with room for 3, want 3", s)
	}
	if s := prefillSplits(264, 1, 1, 1<<20, 10, 4, 128, 2, 64); s != 1 {
		t.Fatalf("splits %d without room, want 1", s)
	}
	// The workspace size covers the largest split plan of a small batch.
	ws, err := PrefillWorkspaceSize(4, 200, 32, 8, 128)
	if err != nil {
		t.Fatal(err)
	}
	if need := splitOffset(13*8) + splitBytes(8, 200, 32, 128, 4); need > ws {
		t.Fatalf("workspace %d < %d for 8 splits of 200 tokens", ws, need)
	}
}
