package attn

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

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
		{"flags", func(a *PrefillPlanArgs) { a.Flags = 16 }, kverr.InvalidArgument}, // 8 is PrefillFP8QKV
		{"fp8 q/k/v without the Hopper mainloop", func(a *PrefillPlanArgs) { a.Flags = PrefillFP8QKV | PrefillNoHopper }, kverr.InvalidArgument},
		{"fp8 q/k/v at head_dim 64", func(a *PrefillPlanArgs) { a.Flags, a.HeadDim = PrefillFP8QKV, 64 }, kverr.Unsupported},
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

			Scale: 0.08, PagedKV: PagedKV{NumBlocks: 8, BlockSize: 16, CacheBlockStride: 4096, CacheTokenStride: 256, CacheHeadStride: 128,
				MaxBlocksPerSeq: 1, BlockTableStride: 1,
				KCache: 0x20000, VCache: 0x30000, BlockTable: 0x40000}},
		Q: 0x10000, Out: 0x50000,
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
		{"scale negative", func(p *PrefillPlan, a *PagedPrefillArgs) { a.Scale = -0.125 }, kverr.InvalidArgument},
		{"workspace shrunk", func(p *PrefillPlan, a *PagedPrefillArgs) { p.WorkspaceBytes = 64 }, kverr.BufferTooSmall},
		{"decode rows above batch", func(p *PrefillPlan, a *PagedPrefillArgs) { p.DecodeSeqs = 3 }, kverr.InvalidArgument},
		{"decode splits above max", func(p *PrefillPlan, a *PagedPrefillArgs) { p.DecodeSplits = MaxSplits + 1 }, kverr.InvalidArgument},
		{"e4m3 without scales", func(p *PrefillPlan, a *PagedPrefillArgs) { a.PagedKV.DType, a.ScaleKind = E4M3, ScaleTokenHead }, kverr.NullPointer},
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
