package attn

import (
	"strings"
	"testing"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// Valid launch arguments on made-up device addresses, for the checks that
// run before any device work.
func testKVWriteArgs() KVWriteArgs {
	return KVWriteArgs{
		KVWriteLayout: KVWriteLayout{DType: F16, HeadDim: 64, NumTokens: 2, NumKVHeads: 1,
			KeyTokenStride: 64, KeyHeadStride: 64, ValueTokenStride: 64, ValueHeadStride: 64, PagedKV: PagedKV{NumBlocks: 4, BlockSize: 2, CacheBlockStride: 128, CacheTokenStride: 64, CacheHeadStride: 64,
				KCache: 0x3000, VCache: 0x4000}},
		Key: 0x1000, Value: 0x2000, SlotMapping: 0x5000,
	}
}

func testDecodeArgs() PagedDecodeArgs {
	return PagedDecodeArgs{
		DecodeLayout: DecodeLayout{DType: BF16, HeadDim: 128, Batch: 2, NumQHeads: 4, NumKVHeads: 1,
			QBatchStride: 512, QHeadStride: 128, OutBatchStride: 512, OutHeadStride: 128,

			Scale: 0.088, PagedKV: PagedKV{NumBlocks: 8, BlockSize: 16, CacheBlockStride: 2048, CacheTokenStride: 128, CacheHeadStride: 128,
				MaxBlocksPerSeq: 4, BlockTableStride: 4,
				KCache: 0x2000, VCache: 0x3000, BlockTable: 0x4000}},
		Q: 0x1000, SeqLens: 0x5000, Out: 0x6000,
	}
}

// testMergeArgs has the layout of two states and no pointers.
func testMergeArgs() MergeArgs {
	return MergeArgs{MergeLayout: MergeLayout{DType: F32, HeadDim: 64, NumStates: 2, NumTokens: 1, NumHeads: 1,
		VTokenStride: 64, VHeadStride: 64, STokenStride: 1, SHeadStride: 1, OutTokenStride: 64, OutHeadStride: 64}}
}

// badArg is a change to valid launch arguments and the error code the
// launch must answer it with.
type badArg[A any] struct {
	what   string
	change func(*A)
	want   kverr.Code
}

// checkBadArgs launches a copy of valid changed by each case.
func checkBadArgs[A any](t *testing.T, valid A, launch func(*A, cuda.Stream) error, cases []badArg[A]) {
	t.Helper()
	for _, c := range cases {
		bad := valid
		c.change(&bad)
		if err := launch(&bad, 0); !kverr.Is(err, c.want) {
			t.Errorf("%s: %v", c.what, err)
		}
	}
}

// Launch argument checks that run before any device work, so they hold on
// every machine.
func TestLaunchArgumentChecks(t *testing.T) {
	w := testKVWriteArgs()
	checkBadArgs(t, w, KVWrite, []badArg[KVWriteArgs]{
		{"null value", func(a *KVWriteArgs) { a.Value = 0 }, kverr.NullPointer},
		{"misaligned k_cache", func(a *KVWriteArgs) { a.KCache = 0x3008 }, kverr.InvalidArgument},
		{"misaligned slot_mapping", func(a *KVWriteArgs) { a.SlotMapping = 0x5002 }, kverr.InvalidArgument},
		{"head_dim 32", func(a *KVWriteArgs) { a.HeadDim = 32 }, kverr.Unsupported},
	})

	d := testDecodeArgs()
	checkBadArgs(t, d, PagedDecode, []badArg[PagedDecodeArgs]{
		{"null block_table", func(a *PagedDecodeArgs) { a.BlockTable = 0 }, kverr.NullPointer},
		{"4 splits, no workspace", func(a *PagedDecodeArgs) { a.NumSplits = 4 }, kverr.NullPointer},
		{"4 splits, workspace one byte short", func(a *PagedDecodeArgs) {
			a.NumSplits = 4
			a.Workspace, a.WorkspaceBytes = 0x7000, workspaceBytes(2, 4, 128, 4)-1
		}, kverr.BufferTooSmall},
		{"too many splits", func(a *PagedDecodeArgs) { a.NumSplits = MaxSplits + 1 }, kverr.InvalidArgument},
		{"misaligned lse", func(a *PagedDecodeArgs) { a.LSE = 0x7002 }, kverr.InvalidArgument},
		{"4 q heads over 3 kv heads", func(a *PagedDecodeArgs) { a.NumKVHeads = 3 }, kverr.InvalidArgument},
		{"negative window_size", func(a *PagedDecodeArgs) { a.WindowSize = -1 }, kverr.InvalidArgument},
	})

	m := testMergeArgs()
	m.V[0], m.S[0], m.Out = 0x1000, 0x2000, 0x3000
	if err := MergeStates(&m, 0); !kverr.Is(err, kverr.NullPointer) {
		t.Errorf("state 1 missing: %v", err)
	}

	// With valid arguments, a machine without a driver answers NO_DEVICE
	// (a build without the kernels answers UNSUPPORTED: TestNoKernelsBuild).
	if cuda.Load() != nil && KernelsBuilt() {
		if err := PagedDecode(&d, 0); !kverr.Is(err, kverr.NoDevice) {
			t.Errorf("no driver: PagedDecode gave %v, want NO_DEVICE", err)
		}
		if err := KVWrite(&w, 0); !kverr.Is(err, kverr.NoDevice) {
			t.Errorf("no driver: KVWrite gave %v, want NO_DEVICE", err)
		}
		if err := Prepare(); !kverr.Is(err, kverr.NoDevice) {
			t.Errorf("no driver: Prepare gave %v, want NO_DEVICE", err)
		}
	}
}

// The launch path's argument checks allocate nothing.
func TestValidateAllocatesNothing(t *testing.T) {
	d := testDecodeArgs()
	if n := testing.AllocsPerRun(100, func() { _, _ = d.validate() }); n != 0 {
		t.Fatalf("DecodeLayout.validate allocates %v times", n)
	}
}

// A window bounds the tokens the decode kernel reads, which the choice of
// splits counts: the window of every new token, plus the part of a tile
// before the first one; never more than the sequences hold.
func TestDecodeReadLen(t *testing.T) {
	for _, c := range []struct{ maxLen, window, qLen, want int }{
		{8192, 0, 1, 8192},                 // no window
		{8192, 128, 1, 128 + decodeTile},   // gpt-oss's window
		{8192, 1024, 4, 1027 + decodeTile}, // four new tokens: each its own window
		{100, 1024, 1, 100},                // a window longer than the sequences
		{8192, 1, 0, 1 + decodeTile},       // q_len 0 is one new token
	} {
		if got := decodeReadLen(c.maxLen, c.window, c.qLen); got != c.want {
			t.Errorf("decodeReadLen(%d, %d, %d) = %d, want %d", c.maxLen, c.window, c.qLen, got, c.want)
		}
	}
}

// A KV write into the same memory twice (the same tensor passed as K and V,
// or as both token-head scale arrays) is refused before any device work;
// one calibrated scale may serve both K and V.
func TestKVWriteRefusesTheSameMemoryTwice(t *testing.T) {
	w := testKVWriteArgs()
	w.VCache = w.KCache
	if err := KVWrite(&w, 0); !kverr.Is(err, kverr.InvalidArgument) || !strings.Contains(err.Error(), "k_cache and v_cache") {
		t.Errorf("k_cache == v_cache: %v", err)
	}
	e4 := testKVWriteArgs()
	e4.DType = BF16
	e4.PagedKV.DType, e4.ScaleKind = E4M3, ScaleTokenHead
	e4.CacheBlockStride, e4.CacheTokenStride, e4.CacheHeadStride = 128, 64, 64
	e4.KScale, e4.VScale = 0x6000, 0x6000
	if err := KVWrite(&e4, 0); !kverr.Is(err, kverr.InvalidArgument) || !strings.Contains(err.Error(), "k_scale and v_scale") {
		t.Errorf("token-head k_scale == v_scale: %v", err)
	}
	for _, ok := range []func(*KVWriteArgs){
		func(a *KVWriteArgs) { a.VScale = 0x7000 },
		func(a *KVWriteArgs) { a.ScaleKind = ScaleTensor }, // one scale for K and V: read, not written
	} {
		a := e4
		ok(&a)
		if err := KVWrite(&a, 0); kverr.Is(err, kverr.InvalidArgument) || kverr.Is(err, kverr.NullPointer) {
			t.Errorf("valid scales refused: %v", err)
		}
	}
}
