package attn

import (
	"math"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// Layouts the launches refuse, each with its status.
func TestValidation(t *testing.T) {
	good := func() DecodeLayout {
		return DecodeLayout{DType: F16, HeadDim: 128, Batch: 2, NumQHeads: 8, NumKVHeads: 2,
			QBatchStride: 8 * 128, QHeadStride: 128, OutBatchStride: 8 * 128, OutHeadStride: 128,

			Scale: 0.1, PagedKV: PagedKV{NumBlocks: 4, BlockSize: 16, CacheBlockStride: 16 * 2 * 128, CacheTokenStride: 2 * 128, CacheHeadStride: 128,
				MaxBlocksPerSeq: 2, BlockTableStride: 2}}
	}
	if _, err := (&[]DecodeLayout{good()}[0]).validate(); err != nil {
		t.Fatalf("good layout refused: %v", err)
	}
	cases := []struct {
		name string
		mod  func(*DecodeLayout)
		code kverr.Code
	}{
		{"dtype", func(l *DecodeLayout) { l.DType = 0 }, kverr.InvalidArgument},
		{"head_dim", func(l *DecodeLayout) { l.HeadDim = 96 }, kverr.Unsupported},
		{"gqa", func(l *DecodeLayout) { l.NumKVHeads = 3 }, kverr.InvalidArgument},
		{"kv heads 0", func(l *DecodeLayout) { l.NumKVHeads = 0 }, kverr.InvalidArgument},
		{"batch<0", func(l *DecodeLayout) { l.Batch = -1 }, kverr.InvalidArgument},
		{"batch big", func(l *DecodeLayout) { l.Batch = 70000 }, kverr.InvalidArgument},
		{"block size 0", func(l *DecodeLayout) { l.BlockSize = 0 }, kverr.InvalidArgument},
		{"table stride", func(l *DecodeLayout) { l.BlockTableStride = 1 }, kverr.InvalidArgument},
		{"misaligned stride", func(l *DecodeLayout) { l.QHeadStride = 129 }, kverr.InvalidArgument},
		{"negative stride", func(l *DecodeLayout) { l.CacheTokenStride = -256 }, kverr.InvalidArgument},
		{"overlapping out", func(l *DecodeLayout) { l.OutHeadStride = 64 }, kverr.InvalidArgument},
		{"huge stride", func(l *DecodeLayout) { l.CacheBlockStride = 1 << 60 }, kverr.InvalidArgument},
		{"nan scale", func(l *DecodeLayout) { l.Scale = float32(math.NaN()) }, kverr.InvalidArgument},
		{"negative scale", func(l *DecodeLayout) { l.Scale = -0.125 }, kverr.InvalidArgument},
		{"infinite scale", func(l *DecodeLayout) { l.Scale = float32(math.Inf(1)) }, kverr.InvalidArgument},
	}
	for _, c := range cases {
		l := good()
		c.mod(&l)
		_, err := l.validate()
		if kverr.CodeOf(err) != c.code {
			t.Errorf("%s: got %v (%v), want %v", c.name, kverr.CodeOf(err), err, c.code)
		}
	}
	ml := MergeLayout{DType: F32, HeadDim: 64, NumStates: 9, NumTokens: 1, NumHeads: 1}
	if _, err := ml.validate(false); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("9 states: got %v", err)
	}
	wl := KVWriteLayout{DType: BF16, HeadDim: 64, NumTokens: 1, NumKVHeads: 2, PagedKV: PagedKV{NumBlocks: 1, BlockSize: 1,
		CacheBlockStride: 64, CacheTokenStride: 64, CacheHeadStride: 8}}
	if _, err := wl.validate(); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("overlapping cache heads: got %v", err)
	}
}

func TestPlanAndWorkspace(t *testing.T) {
	// kernels/README.md's examples: H100, D=128, 32 q / 8 kv heads.
	for _, c := range []struct{ batch, maxLen, want int }{
		{1, 4096, 32}, {8, 2048, 4}, {16, 2048, 2}, {33, 2048, 1}, {128, 16384, 1},
		{1, 64, 1},  // one tile
		{1, 300, 5}, // five tiles, one split each
		{1, 0, 1},
	} {
		if s := DecodeSplits(132, BF16, 128, c.batch, 32, 8, c.maxLen); s != c.want {
			t.Errorf("DecodeSplits(B=%d, L=%d) = %d, want %d", c.batch, c.maxLen, s, c.want)
		}
	}
	// 33 slots per CTA over 40 tiles: 33 splits would leave empty ones;
	// ceil(40/33) = 2 tiles each gives 20.
	if s := DecodeSplits(132, BF16, 128, 1, 32, 8, 40*64); s != 20 {
		t.Errorf("40 tiles: %d splits, want 20", s)
	}
	if s := DecodeSplits(132, F32, 64, 1, 1, 1, 1<<30); s != MaxSplits {
		t.Errorf("MQA, huge L: %d splits, want the cap %d", s, MaxSplits)
	}
	if s := DecodeSplits(0, F16, 64, 1, 1, 1, 100); s != 1 {
		t.Errorf("no SMs: %d", s)
	}
	// The e4m3 kernel holds 4 blocks per SM at D=128 (528 slots): 512
	// blocks fill 0.97 of a wave unsplit, 256 blocks take two splits (0.97),
	// 1024 blocks fill 1.94 waves unsplit, 64 blocks take eight splits.
	for _, c := range []struct{ batch, maxLen, want int }{{64, 8192, 1}, {32, 2048, 2}, {128, 2048, 1}, {8, 4096, 8}} {
		if s := decodeSplits(132, BF16, 128, c.batch, 32, 8, c.maxLen, 1, true); s != c.want {
			t.Errorf("e4m3: decodeSplits(B=%d, L=%d) = %d, want %d", c.batch, c.maxLen, s, c.want)
		}
	}
	// A few tiles per block (gpt-oss's window of 128 over 8 kv heads, head
	// dim 64, 396 slots): the fill is left alone, no split where 256 blocks
	// fill 0.65 of a wave; one sequence still takes a split per tile.
	for _, c := range []struct{ batch, maxLen, want int }{{32, 192, 1}, {64, 192, 1}, {1, 192, 3}, {32, 320, 3}} {
		if s := decodeSplits(132, BF16, 64, c.batch, 64, 8, c.maxLen, 1, false); s != c.want {
			t.Errorf("few tiles: decodeSplits(B=%d, L=%d) = %d, want %d", c.batch, c.maxLen, s, c.want)
		}
	}
	n, err := WorkspaceSize(64, 32, 128, 0)
	if err != nil || n != 4*DefaultMaxSplits*64*32*129 {
		t.Errorf("WorkspaceSize = %d, %v", n, err)
	}
	if n, err := WorkspaceSize(64, 32, 128, 1); err != nil || n != 0 {
		t.Errorf("one split needs no workspace: %d, %v", n, err)
	}
	if _, err := WorkspaceSize(0, 32, 128, 4); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("batch 0: %v", err)
	}
	if _, err := WorkspaceSize(70000, 32, 128, 4); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("batch 70000: %v", err)
	}
	if _, err := WorkspaceSize(1, 32, 80, 4); !kverr.Is(err, kverr.Unsupported) {
		t.Errorf("head_dim 80: %v", err)
	}
}

// A prefill plan's state words hold its mainloop; a word no plan holds is
// clamped into a value the run's check refuses, never wrapped into a valid
// one.
func TestPrefillPlanState(t *testing.T) {
	p := PrefillPlan{Mainloop: MainloopSM90}
	w := p.PlanState()
	if w != [6]uint64{MainloopSM90} {
		t.Fatalf("words %v", w)
	}
	var q PrefillPlan
	if q.SetPlanState(&w); q.Mainloop != MainloopSM90 {
		t.Fatalf("mainloop %d", q.Mainloop)
	}
	w[WordMainloop] = 1<<32 + MainloopSM90
	if q.SetPlanState(&w); q.Mainloop != 1<<16 {
		t.Fatalf("mainloop %d from word %#x", q.Mainloop, w[WordMainloop])
	}
	// A mixed batch's decode rows: count and splits in one word, the device
	// qo_indptr in the next.
	p = PrefillPlan{Mainloop: MainloopSM80, DecodeSeqs: 12, DecodeSplits: 5, QOIndptr: 0xabc000}
	w = p.PlanState()
	if w[WordDecodeRows] != 12|5<<32 || w[WordDecodeIndex] != 0xabc000 {
		t.Fatalf("decode words %#x %#x", w[WordDecodeRows], w[WordDecodeIndex])
	}
	q = PrefillPlan{}
	if q.SetPlanState(&w); q.DecodeSeqs != 12 || q.DecodeSplits != 5 || q.QOIndptr != 0xabc000 {
		t.Fatalf("decode state %+v", q)
	}
	w[WordDecodeRows] = 1<<63 | 1<<40
	if q.SetPlanState(&w); q.DecodeSeqs != 0 || q.DecodeSplits != 1<<31-1 {
		t.Fatalf("clamped decode state %d %d", q.DecodeSeqs, q.DecodeSplits)
	}
	// The work list's fingerprint travels with the plan.
	p = PrefillPlan{WorkList: 0xfeedface12345678}
	w = p.PlanState()
	if q = (PrefillPlan{}); w[WordWorkList] != p.WorkList {
		t.Fatalf("work list word %#x", w[WordWorkList])
	}
	if q.SetPlanState(&w); q.WorkList != p.WorkList {
		t.Fatalf("work list %#x", q.WorkList)
	}
}

// The cache formats a launch takes: a cache of the launch's dtype without
// scales, or e4m3 under f16/bf16 with a scale kind; every other pairing is
// refused.
func TestE4M3Refused(t *testing.T) {
	kv := PagedKV{NumBlocks: 4, BlockSize: 16, CacheBlockStride: 16 * 2 * 128, CacheTokenStride: 2 * 128, CacheHeadStride: 128,
		MaxBlocksPerSeq: 4, BlockTableStride: 4}
	e4 := kv
	e4.DType, e4.ScaleKind, e4.KScale, e4.VScale = E4M3, ScaleTokenHead, 0x1000, 0x2000
	cases := []struct {
		name string
		kv   PagedKV
		d    DType
		want kverr.Code
	}{
		{"16-bit", kv, BF16, kverr.OK},
		{"e4m3 under bf16", e4, BF16, kverr.OK},
		{"e4m3 under f16", e4, F16, kverr.OK},
		{"e4m3 under f32", e4, F32, kverr.InvalidArgument},
		{"e4m3 without a scale kind", func() PagedKV { k := e4; k.ScaleKind = 0; return k }(), BF16, kverr.InvalidArgument},
		{"16-bit with scales", func() PagedKV { k := kv; k.KScale = 0x1000; return k }(), BF16, kverr.InvalidArgument},
		{"16-bit with a scale kind", func() PagedKV { k := kv; k.ScaleKind = ScaleTensor; return k }(), BF16, kverr.InvalidArgument},
		{"f16 cache under bf16", func() PagedKV { k := kv; k.DType = F16; return k }(), BF16, kverr.InvalidArgument},
		{"e4m3 with 8-element strides", func() PagedKV { k := e4; k.CacheHeadStride = 136; k.CacheTokenStride = 272; return k }(), BF16, kverr.InvalidArgument},
		// Token-head scale indices are int32 in the decode: 2^26 blocks of
		// 16 tokens of 2 heads would index scale 2^31.
		{"token-head scales at 2^31 - 2", func() PagedKV { k := e4; k.NumBlocks = 1<<26 - 1; return k }(), BF16, kverr.OK},
		{"token-head scales past 2^31 - 1", func() PagedKV { k := e4; k.NumBlocks = 1 << 26; return k }(), BF16, kverr.InvalidArgument},
		{"one scale per cache over 2^26 blocks", func() PagedKV { k := e4; k.NumBlocks, k.ScaleKind = 1<<26, ScaleTensor; return k }(), BF16, kverr.OK},
	}
	for _, c := range cases {
		l := DecodeLayout{DType: c.d, HeadDim: 128, Batch: 2, NumQHeads: 4, NumKVHeads: 2, QBatchStride: 512, QHeadStride: 128,
			OutBatchStride: 512, OutHeadStride: 128, PagedKV: c.kv}
		_, err := l.Extents()
		if kverr.CodeOf(err) != c.want {
			t.Errorf("decode, %s: %v, want %v", c.name, err, c.want)
		}
	}
}

// A cascade launch over an e4m3 cache checks the scale pointers as the
// other launches do: a missing or misaligned k_scale or v_scale is a
// status before any kernel is loaded, never a read through it.
func TestCascadeRunChecksScalePointers(t *testing.T) {
	kv := PagedKV{NumBlocks: 4, BlockSize: 16, CacheBlockStride: 16 * 2 * 128, CacheTokenStride: 2 * 128, CacheHeadStride: 128,
		MaxBlocksPerSeq: 4, BlockTableStride: 4, KCache: 0x10000, VCache: 0x20000, BlockTable: 0x30000,
		DType: E4M3, ScaleKind: ScaleTokenHead, KScale: 0x40000, VScale: 0x50000}
	run := func(kv PagedKV) error {
		a := CascadeRunArgs{
			DecodeLayout: DecodeLayout{DType: BF16, HeadDim: 128, Batch: 2, NumQHeads: 4, NumKVHeads: 2, QBatchStride: 512,
				QHeadStride: 128, OutBatchStride: 512, OutHeadStride: 128, PagedKV: kv},
			Q: 0x60000, SeqLens: 0x70000, Out: 0x80000, Workspace: 0x90000, WorkspaceBytes: 1 << 20,
			PartOut: 4096, PartLSE: 8192, ItemsOff: 0, QRowsOff: 64, SegStartOff: 128, SegsOff: 192, RowSeqOff: 256, QStartOff: 320,
			MaxBatch: 2,
		}
		return CascadeRun(&a, 0)
	}
	cases := []struct {
		name string
		edit func(*PagedKV)
		want kverr.Code
	}{
		{"k_scale 0", func(k *PagedKV) { k.KScale = 0 }, kverr.NullPointer},
		{"v_scale 0", func(k *PagedKV) { k.VScale = 0 }, kverr.NullPointer},
		{"k_scale misaligned", func(k *PagedKV) { k.KScale += 2 }, kverr.InvalidArgument},
		{"one scale per cache, v_scale 0", func(k *PagedKV) { k.ScaleKind, k.VScale = ScaleTensor, 0 }, kverr.NullPointer},
	}
	for _, c := range cases {
		k := kv
		c.edit(&k)
		if err := run(k); kverr.CodeOf(err) != c.want {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	// The same arguments with valid scales pass the checks (and stop at the kernels: none here, or no device).
	if err := run(kv); kverr.CodeOf(err) == kverr.NullPointer || kverr.CodeOf(err) == kverr.InvalidArgument {
		t.Fatalf("valid scales: %v", err)
	}
}
