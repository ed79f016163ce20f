package attn

import (
	"testing"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// Launch argument checks that run before any device work, so they hold on
// every machine.
func TestLaunchArgumentChecks(t *testing.T) {
	w := KVWriteArgs{
		KVWriteLayout: KVWriteLayout{DType: F16, HeadDim: 64, NumTokens: 2, NumKVHeads: 1,
			KeyTokenStride: 64, KeyHeadStride: 64, ValueTokenStride: 64, ValueHeadStride: 64, PagedKV: PagedKV{NumBlocks: 4, BlockSize: 2, CacheBlockStride: 128, CacheTokenStride: 64, CacheHeadStride: 64,
				KCache: 0x3000, VCache: 0x4000}},
		Key: 0x1000, Value: 0x2000, SlotMapping: 0x5000,
	}
	bad := w
	bad.Value = 0
	if err := KVWrite(&bad, 0); !kverr.Is(err, kverr.NullPointer) {
		t.Errorf("null value: %v", err)
	}
	bad = w
	bad.KCache = 0x3008
	if err := KVWrite(&bad, 0); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("misaligned k_cache: %v", err)
	}
	bad = w
	bad.SlotMapping = 0x5002
	if err := KVWrite(&bad, 0); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("misaligned slot_mapping: %v", err)
	}
	bad = w
	bad.HeadDim = 32
	if err := KVWrite(&bad, 0); !kverr.Is(err, kverr.Unsupported) {
		t.Errorf("head_dim 32: %v", err)
	}

	d := PagedDecodeArgs{
		DecodeLayout: DecodeLayout{DType: BF16, HeadDim: 128, Batch: 2, NumQHeads: 4, NumKVHeads: 1,
			QBatchStride: 512, QHeadStride: 128, OutBatchStride: 512, OutHeadStride: 128,

			Scale: 0.088, PagedKV: PagedKV{NumBlocks: 8, BlockSize: 16, CacheBlockStride: 2048, CacheTokenStride: 128, CacheHeadStride: 128,
				MaxBlocksPerSeq: 4, BlockTableStride: 4,
				KCache: 0x2000, VCache: 0x3000, BlockTable: 0x4000}},
		Q: 0x1000, SeqLens: 0x5000, Out: 0x6000,
	}
	bd := d
	bd.BlockTable = 0
	if err := PagedDecode(&bd, 0); !kverr.Is(err, kverr.NullPointer) {
		t.Errorf("null block_table: %v", err)
	}
	bd = d
	bd.NumSplits = 4
	if err := PagedDecode(&bd, 0); !kverr.Is(err, kverr.NullPointer) {
		t.Errorf("4 splits, no workspace: %v", err)
	}
	bd.Workspace, bd.WorkspaceBytes = 0x7000, workspaceBytes(2, 4, 128, 4)-1
	if err := PagedDecode(&bd, 0); !kverr.Is(err, kverr.BufferTooSmall) {
		t.Errorf("4 splits, workspace one byte short: %v", err)
	}
	bd = d
	bd.NumSplits = MaxSplits + 1
	if err := PagedDecode(&bd, 0); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("too many splits: %v", err)
	}
	bd = d
	bd.LSE = 0x7002
	if err := PagedDecode(&bd, 0); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("misaligned lse: %v", err)
	}
	bd = d
	bd.NumKVHeads = 3
	if err := PagedDecode(&bd, 0); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("4 q heads over 3 kv heads: %v", err)
	}

	m := MergeArgs{MergeLayout: MergeLayout{DType: F32, HeadDim: 64, NumStates: 2, NumTokens: 1, NumHeads: 1,
		VTokenStride: 64, VHeadStride: 64, STokenStride: 1, SHeadStride: 1, OutTokenStride: 64, OutHeadStride: 64}}
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
	d := PagedDecodeArgs{
		DecodeLayout: DecodeLayout{DType: BF16, HeadDim: 128, Batch: 2, NumQHeads: 4, NumKVHeads: 1,
			QBatchStride: 512, QHeadStride: 128, OutBatchStride: 512, OutHeadStride: 128,

			Scale: 0.088, PagedKV: PagedKV{NumBlocks: 8, BlockSize: 16, CacheBlockStride: 2048, CacheTokenStride: 128, CacheHeadStride: 128,
				MaxBlocksPerSeq: 4, BlockTableStride: 4}},
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = d.validate() }); n != 0 {
		t.Fatalf("DecodeLayout.validate allocates %v times", n)
	}
}
