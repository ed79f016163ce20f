package main

import (
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// The paged-KV descriptor: a call that points to one reaches core/attn
// exactly as the same call with the cache in its own fields, and a cache
// described twice, a scale array or a disagreeing dtype is refused.
func TestPagedKVDescriptor(t *testing.T) {
	good := kvHookCache{dtype: 2, kvHeads: 2, numBlocks: 64, blockSize: 16, maxBlocks: 8, headDim: 128,
		k: 0x100000, v: 0x200000, table: 0x300000, blockStride: 4096, tokenStride: 256, headStride: 128, tableStride: 12}
	for _, call := range []string{"kv_write", "decode", "prefill"} {
		for _, c := range []kvHookCache{good, func() kvHookCache { c := good; c.tableStride, c.headDim = 0, 0; return c }()} {
			same, viaDesc, both := hookKVCallSides(call, c)
			if !same || viaDesc != 0 {
				t.Errorf("%s %+v: through the descriptor: same %v, status %d", call, c, same, viaDesc)
			}
			expect(t, call+": cache in both places", both, kverr.InvalidArgument)
		}
		bad := func(name string, f func(c *kvHookCache)) {
			t.Helper()
			c := good
			f(&c)
			_, viaDesc, _ := hookKVCallSides(call, c)
			expect(t, call+": "+name, viaDesc, kverr.InvalidArgument)
		}
		bad("k_scale", func(c *kvHookCache) { c.kScale = 0x400000 })
		bad("head_dim 64", func(c *kvHookCache) { c.headDim = 64 })
		if call == "prefill" {
			// The plan gives dtype and kv heads: the descriptor must agree.
			bad("dtype f16", func(c *kvHookCache) { c.dtype = 1 })
			bad("kv heads 4", func(c *kvHookCache) { c.kvHeads = 4 })
		}
	}
}

// The descriptor costs the host nothing measurable: a decode call's
// translation and checks through it against the args' own fields.
//
//	go test -run '^$' -bench PagedKVHostCost -count 5 ./capi
func BenchmarkPagedKVHostCost(b *testing.B) {
	for _, desc := range []bool{false, true} {
		name := "own-fields"
		if desc {
			name = "descriptor"
		}
		b.Run(name, func(b *testing.B) {
			b.ReportMetric(float64(hookDecodeHostCost(b.N, desc).Nanoseconds()), "ns/call")
		})
	}
}

// The tier copier takes the layers as the attention calls do: per-layer
// descriptors give the layout the kvp_kv_layers fields give, and a layout
// the tier cannot copy in one chunk a block, layers of different shapes or
// a descriptor without head_dim are refused.
func TestTierLayersFromDescriptors(t *testing.T) {
	for _, n := range []int{1, 3} {
		for _, v := range []bool{true, false} {
			if same, st := hookTierLayersBothWays(n, v, ""); !same || st != 0 {
				t.Errorf("%d layers, V %v: same layout %v, status %d", n, v, same, st)
			}
		}
	}
	for _, bad := range []string{"head-major", "shape", "no head_dim"} {
		_, st := hookTierLayersBothWays(3, true, bad)
		expect(t, "tier layers from descriptors: "+bad, st, kverr.InvalidArgument)
	}
}
