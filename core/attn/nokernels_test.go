package attn

import (
	"strings"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// A build without the fatbin answers every launch with UNSUPPORTED and a
// message saying how to build the kernels, before it looks for a device, and
// still answers bad arguments as such.
func TestNoKernelsBuild(t *testing.T) {
	saved := kernelsBuilt
	kernelsBuilt = func() bool { return false }
	defer func() { kernelsBuilt = saved }()

	w := KVWriteArgs{
		KVWriteLayout: KVWriteLayout{DType: F16, HeadDim: 64, NumTokens: 2, NumKVHeads: 1,
			KeyTokenStride: 64, KeyHeadStride: 64, ValueTokenStride: 64, ValueHeadStride: 64, PagedKV: PagedKV{NumBlocks: 4, BlockSize: 2, CacheBlockStride: 128, CacheTokenStride: 64, CacheHeadStride: 64,
				KCache: 0x3000, VCache: 0x4000}},
		Key: 0x1000, Value: 0x2000, SlotMapping: 0x5000,
	}
	d := PagedDecodeArgs{
		DecodeLayout: DecodeLayout{DType: BF16, HeadDim: 128, Batch: 2, NumQHeads: 4, NumKVHeads: 1,
			QBatchStride: 512, QHeadStride: 128, OutBatchStride: 512, OutHeadStride: 128,

			Scale: 0.088, PagedKV: PagedKV{NumBlocks: 8, BlockSize: 16, CacheBlockStride: 2048, CacheTokenStride: 128, CacheHeadStride: 128,
				MaxBlocksPerSeq: 4, BlockTableStride: 4,
				KCache: 0x2000, VCache: 0x3000, BlockTable: 0x4000}},
		Q: 0x1000, SeqLens: 0x5000, Out: 0x6000,
	}
	m := MergeArgs{MergeLayout: MergeLayout{DType: F32, HeadDim: 64, NumStates: 2, NumTokens: 1, NumHeads: 1,
		VTokenStride: 64, VHeadStride: 64, STokenStride: 1, SHeadStride: 1, OutTokenStride: 64, OutHeadStride: 64}}
	m.V[0], m.S[0], m.V[1], m.S[1], m.Out = 0x1000, 0x2000, 0x3000, 0x4000, 0x5000

	calls := map[string]func() error{
		"kv_write":     func() error { return KVWrite(&w, 0) },
		"paged_decode": func() error { return PagedDecode(&d, 0) },
		"merge_states": func() error { return MergeStates(&m, 0) },
		"attn_prepare": Prepare,
	}
	for name, call := range calls {
		err := call()
		if !kverr.Is(err, kverr.Unsupported) {
			t.Errorf("%s: got %v, want UNSUPPORTED", name, err)
			continue
		}
		msg := err.Error()
		for _, want := range []string{name + ":", "built without its CUDA kernels", "make"} {
			if !strings.Contains(msg, want) {
				t.Errorf("%s: message %q lacks %q", name, msg, want)
			}
		}
	}
	if KernelsBuilt() {
		t.Error("KernelsBuilt with the kernels taken away")
	}

	bad := w
	bad.Value = 0
	if err := KVWrite(&bad, 0); !kverr.Is(err, kverr.NullPointer) {
		t.Errorf("null value without kernels: %v, want NULL_POINTER first", err)
	}
}
