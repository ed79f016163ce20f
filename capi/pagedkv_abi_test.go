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
		bad := func(name string, f func(c *kvHookCache)) { t.Helper(); refusedKVCache(t, call, name, good, f) }
		if call != "prefill" { // core/attn's checks (the hook runs them for these two)
			bad("k_scale", func(c *kvHookCache) { c.kScale = 0x400000 })
			bad("scale_kind", func(c *kvHookCache) { c.scaleKind = 1 })
		}
		bad("reserved", func(c *kvHookCache) { c.reserved = 1 })
		bad("head_dim 64", func(c *kvHookCache) { c.headDim = 64 })
		if call == "prefill" {
			// The plan gives dtype and kv heads: the descriptor must agree.
			bad("dtype f16", func(c *kvHookCache) { c.dtype = 1 })
			bad("kv heads 4", func(c *kvHookCache) { c.kvHeads = 4 })
		}
	}
}

// An e4m3 descriptor under a 16-bit call: its scales and scale kind reach
// core/attn, which takes it for kv_write and decode; without the call's own
// dtype, without a scale kind or under an f32 call it is refused (prefill's
// UNSUPPORTED is core/attn's: TestE4M3Refused there).
func TestPagedKVDescriptorE4M3(t *testing.T) {
	e4m3 := kvHookCache{dtype: 4, kvHeads: 2, numBlocks: 64, blockSize: 16, maxBlocks: 8, headDim: 128,
		k: 0x100000, v: 0x200000, table: 0x300000, blockStride: 4096, tokenStride: 256, headStride: 128,
		kScale: 0x400000, vScale: 0x500000, scaleKind: 1, callDType: 2}
	for _, call := range []string{"kv_write", "decode"} {
		for _, kind := range []int32{1, 2} {
			c := e4m3
			c.scaleKind = kind
			if _, viaDesc, _ := hookKVCallSides(call, c); viaDesc != 0 {
				t.Errorf("%s: e4m3 with scale kind %d: status %d, want OK", call, kind, viaDesc)
			}
		}
		bad := func(name string, f func(c *kvHookCache)) { t.Helper(); refusedKVCache(t, call, "e4m3 "+name, e4m3, f) }
		bad("without the call's dtype", func(c *kvHookCache) { c.callDType = 0 })
		bad("under an f32 call", func(c *kvHookCache) { c.callDType = 3 })
		bad("without a scale kind", func(c *kvHookCache) { c.scaleKind = 0 })
		bad("with scale kind 3", func(c *kvHookCache) { c.scaleKind = 3 })
		bad("with 16-bit strides", func(c *kvHookCache) { c.headStride = 136 }) // not a multiple of 16 bytes
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

// e4m3 layers reach the tier copier with their scales: token-head scales as
// a chunk a block (block_size x kv heads x 4 bytes) per layer and tensor, a
// tensor scale not at all (it stays with the engine); a 16-bit layer with
// scales, an e4m3 one without a kind or a V scale, and layers of two
// kinds are refused.
func TestTierLayersE4M3(t *testing.T) {
	for _, v := range []bool{true, false} {
		chunk, sc, ks, vs, st := hookTierLayersE4M3(3, v, hookScaleTokenHead, "")
		if st != 0 || chunk != 16*8*128 || sc != 16*8*4 || len(ks) != 3 || ks[2] != 0x31000000 || (len(vs) == 3) != v {
			t.Errorf("token-head, V %v: chunk %d, scale chunk %d, K scales %#x, V scales %#x, status %d", v, chunk, sc, ks, vs, st)
		}
		if v && vs[0] != 0x13000000 {
			t.Errorf("V scale of layer 0: %#x", vs[0])
		}
		chunk, sc, ks, vs, st = hookTierLayersE4M3(2, v, hookScaleTensor, "")
		if st != 0 || chunk != 16*8*128 || sc != 0 || ks != nil || vs != nil {
			t.Errorf("tensor scale, V %v: chunk %d, scale chunk %d, scales %v %v, status %d", v, chunk, sc, ks, vs, st)
		}
	}
	for bad, want := range map[string]kverr.Code{"16-bit with scales": kverr.InvalidArgument, "no scale kind": kverr.InvalidArgument,
		"no v_scale": kverr.NullPointer, "mixed kinds": kverr.InvalidArgument} {
		_, _, _, _, st := hookTierLayersE4M3(3, true, hookScaleTokenHead, bad)
		expect(t, "e4m3 tier layers: "+bad, st, want)
	}
}

// refusedKVCache checks that call refuses base, changed by f, given
// through the descriptor, as INVALID_ARGUMENT.
func refusedKVCache(t *testing.T, call, name string, base kvHookCache, f func(c *kvHookCache)) {
	t.Helper()
	f(&base)
	_, viaDesc, _ := hookKVCallSides(call, base)
	expect(t, call+": "+name, viaDesc, kverr.InvalidArgument)
}
