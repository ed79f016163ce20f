package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
	"github.com/kvplug/kvplug/core/tiercopy"
	"github.com/kvplug/kvplug/internal/logx"
)

// The tier copier at the ABI (include/kvplug.h, "tier copy"): a handle on
// a tiercopy.Copier. kvp_tier_copy and tiercopy.Op share one layout
// (two int32: block, slot), so the caller's op arrays are read in place.

const tierCopierName = "kvp_tier_copier"

var _ [unsafe.Sizeof(C.kvp_tier_copy{}) - unsafe.Sizeof(tiercopy.Op{})]struct{}
var _ [unsafe.Sizeof(tiercopy.Op{}) - unsafe.Sizeof(C.kvp_tier_copy{})]struct{}

//export kvpgo_tier_copier_create
func kvpgo_tier_copier_create(layers *C.kvp_kv_layers, host unsafe.Pointer, slotBytes C.int64_t, numSlots C.int32_t,
	out **C.kvp_tier_copier) (st C.kvp_status) {
	defer guard(&st)
	if logx.InCallback() {
		return fail(errFromLogCallback("kvp_tier_copier_create"))
	}
	if layers == nil || host == nil || out == nil {
		return failf(kverr.NullPointer, "kvp_tier_copier_create: layers, host and out must not be NULL")
	}
	var c C.kvp_kv_layers
	if err := kvLayersStruct.in(unsafe.Pointer(layers), unsafe.Pointer(&c)); err != nil {
		return fail(err)
	}
	n := int(c.num_layers)
	if err := limits.Range("kvp_tier_copier_create: num_layers", n, 1, limits.TierLayers); err != nil {
		return fail(err)
	}
	l, err := tierLayersOf(&c, n)
	if err != nil {
		return fail(err)
	}
	opts, err := tierCopyOptions(&c)
	if err != nil {
		return fail(err)
	}
	cp, err := tiercopy.New(l, tiercopy.Host{Base: host, SlotBytes: int64(slotBytes), NumSlots: int32(numSlots)}, opts)
	if err != nil {
		return fail(err)
	}
	*out = (*C.kvp_tier_copier)(newHandle(cp))
	return C.KVP_OK
}

// tierCopyOptions is the copier's settings of a kvp_kv_layers' flags:
// KVP_TIER_COPY_STORE_COPY_ENGINE or none; other bits and a non-zero
// reserved word are refused, so that a setting of a later version is never
// taken for another.
func tierCopyOptions(c *C.kvp_kv_layers) (tiercopy.Options, error) {
	const known = C.KVP_TIER_COPY_STORE_COPY_ENGINE
	if c.flags&^known != 0 || c.reserved != 0 {
		return tiercopy.Options{}, kverr.Errorf(kverr.InvalidArgument,
			"kvp_tier_copier_create: layers->flags must be 0 or KVP_TIER_COPY_STORE_COPY_ENGINE and layers->reserved 0: got %#x and %d",
			uint32(c.flags), int32(c.reserved))
	}
	var o tiercopy.Options
	if c.flags&C.KVP_TIER_COPY_STORE_COPY_ENGINE != 0 {
		o.Stores = tiercopy.StoreCopyEngine
	}
	return o, nil
}

// tierLayersOf is the tier copier's layout of a kvp_kv_layers of n layers:
// its descriptors (kv) or its own fields.
func tierLayersOf(c *C.kvp_kv_layers, n int) (tiercopy.Layers, error) {
	if c.kv != nil {
		return tierLayersOfKV(c, n)
	}
	if c.k == nil {
		return tiercopy.Layers{}, kverr.Errorf(kverr.NullPointer, "kvp_tier_copier_create: layers->k must not be NULL")
	}
	l := tiercopy.Layers{
		K:          ptrs(c.k, n),
		ChunkBytes: int64(c.block_bytes), KBlockStride: int64(c.k_block_stride), VBlockStride: int64(c.v_block_stride),
		NumBlocks: int32(c.num_blocks),
	}
	if c.v != nil {
		l.V = ptrs(c.v, n)
	}
	return l, nil
}

// tierLayersOfKV is the tier copier's layout of the n layers whose
// descriptors c.kv lists: one block of a layer is its block_size dense
// token rows (K and V alike), so a layer's block is one chunk of
// block_size * num_kv_heads * head_dim elements, block_stride elements
// apart. Every layer must have the first one's shape.
func tierLayersOfKV(c *C.kvp_kv_layers, n int) (tiercopy.Layers, error) {
	const what = "kvp_tier_copier_create"
	if c.num_blocks != 0 || c.k != nil || c.v != nil || c.block_bytes != 0 || c.k_block_stride != 0 || c.v_block_stride != 0 {
		return tiercopy.Layers{}, kverr.Errorf(kverr.InvalidArgument,
			"%s: layers->kv is set, so num_blocks, k, v, block_bytes and the block strides must be 0: the descriptors describe the layers", what)
	}
	descs := unsafe.Slice(c.kv, n)
	var first C.kvp_paged_kv
	l := tiercopy.Layers{K: make([]cuda.DevicePtr, n)}
	for i, p := range descs {
		if p == nil {
			return tiercopy.Layers{}, kverr.Errorf(kverr.NullPointer, "%s: layers->kv[%d] must not be NULL", what, i)
		}
		if uintptr(unsafe.Pointer(p)) < minPointer {
			return tiercopy.Layers{}, kverr.Errorf(kverr.InvalidArgument, "%s: layers->kv[%d] is %p: not NULL and not a valid address", what, i, p)
		}
		var d C.kvp_paged_kv
		if err := pagedKVStruct.in(unsafe.Pointer(p), unsafe.Pointer(&d)); err != nil {
			return tiercopy.Layers{}, kverr.Wrap(kverr.CodeOf(err), err, "%s: layers->kv[%d]", what, i)
		}
		if err := tierScalesOf(&d, i); err != nil {
			return tiercopy.Layers{}, err
		}
		if i == 0 {
			first = d
			elem := attn.DType(d.dtype).Size()
			if elem == 0 || d.num_kv_heads < 1 || d.head_dim < 1 || d.block_size < 1 || d.num_blocks < 1 {
				return tiercopy.Layers{}, kverr.Errorf(kverr.InvalidArgument,
					"%s: layers->kv[0] needs a dtype, num_kv_heads, head_dim, block_size and num_blocks: got %d, %d, %d, %d, %d",
					what, int32(d.dtype), int32(d.num_kv_heads), int32(d.head_dim), int32(d.block_size), int32(d.num_blocks))
			}
			row := int64(d.num_kv_heads) * int64(d.head_dim)
			if int64(d.head_stride) != int64(d.head_dim) || int64(d.token_stride) != row {
				return tiercopy.Layers{}, kverr.Errorf(kverr.InvalidArgument,
					"%s: a block's tokens must be dense rows for the tier's one copy a block (head_stride = head_dim = %d, token_stride = num_kv_heads * head_dim = %d): got %d and %d",
					what, int32(d.head_dim), row, int64(d.head_stride), int64(d.token_stride))
			}
			l.ChunkBytes = int64(d.block_size) * row * int64(elem)
			l.KBlockStride = int64(d.block_stride) * int64(elem)
			l.VBlockStride = l.KBlockStride
			l.NumBlocks = int32(d.num_blocks)
			if d.v_cache != 0 {
				l.V = make([]cuda.DevicePtr, n)
			}
			if d.scale_kind == C.KVP_KV_SCALE_TOKEN_HEAD {
				// [num_blocks, block_size, num_kv_heads] float32: a block's
				// scales are one chunk, stored after the slot's K/V chunks.
				l.ScaleChunkBytes = int64(d.block_size) * int64(d.num_kv_heads) * 4
				l.ScaleBlockStride = l.ScaleChunkBytes
				l.KScale = make([]cuda.DevicePtr, n)
				if l.V != nil {
					l.VScale = make([]cuda.DevicePtr, n)
				}
			}
		} else if d.dtype != first.dtype || d.num_kv_heads != first.num_kv_heads || d.head_dim != first.head_dim ||
			d.block_size != first.block_size || d.num_blocks != first.num_blocks || d.block_stride != first.block_stride ||
			d.token_stride != first.token_stride || d.head_stride != first.head_stride || (d.v_cache == 0) != (first.v_cache == 0) ||
			d.scale_kind != first.scale_kind {
			return tiercopy.Layers{}, kverr.Errorf(kverr.InvalidArgument, "%s: layers->kv[%d] has another shape than layers->kv[0] (one layout for every layer)", what, i)
		}
		l.K[i] = cuda.DevicePtr(d.k_cache)
		if l.V != nil {
			l.V[i] = cuda.DevicePtr(d.v_cache)
		}
		if l.KScale != nil {
			l.KScale[i] = cuda.DevicePtr(d.k_scale)
			if l.VScale != nil {
				l.VScale[i] = cuda.DevicePtr(d.v_scale)
			}
		}
	}
	return l, nil
}

// tierScalesOf checks layer i's scale fields for the tier: an e4m3 cache
// has a scale kind and its arrays (per block with token-head scales, which
// the slots carry; one value a cache with a tensor scale, which stays
// with the engine); a 16-bit or f32 cache has none.
func tierScalesOf(d *C.kvp_paged_kv, i int) error {
	const what = "kvp_tier_copier_create"
	if d.dtype != C.KVP_DTYPE_E4M3 {
		if d.scale_kind != 0 || d.k_scale != 0 || d.v_scale != 0 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: layers->kv[%d] is not e4m3 but has a scale kind or scales", what, i)
		}
		return nil
	}
	if d.scale_kind != C.KVP_KV_SCALE_TOKEN_HEAD && d.scale_kind != C.KVP_KV_SCALE_TENSOR {
		return kverr.Errorf(kverr.InvalidArgument, "%s: layers->kv[%d] is e4m3 with scale_kind %d: KVP_KV_SCALE_TOKEN_HEAD or KVP_KV_SCALE_TENSOR", what, i, int32(d.scale_kind))
	}
	if d.k_scale == 0 || (d.v_cache != 0 && d.v_scale == 0) {
		return kverr.Errorf(kverr.NullPointer, "%s: layers->kv[%d] is e4m3 without its k_scale or v_scale", what, i)
	}
	return nil
}

// ptrs copies n device addresses from a caller's uint64 array.
func ptrs(p *C.uint64_t, n int) []cuda.DevicePtr {
	out := make([]cuda.DevicePtr, n)
	for i, v := range unsafe.Slice(p, n) {
		out[i] = cuda.DevicePtr(v)
	}
	return out
}

//export kvpgo_tier_copier_run
func kvpgo_tier_copier_run(h *C.kvp_tier_copier, demote *C.kvp_tier_copy, numDemote C.int32_t,
	reload *C.kvp_tier_copy, numReload C.int32_t, stream unsafe.Pointer) C.kvp_status {
	return onHandle(unsafe.Pointer(h), tierCopierName, func(cp *tiercopy.Copier) error {
		for _, a := range []struct {
			what string
			p    *C.kvp_tier_copy
			n    C.int32_t
		}{{"demote", demote, numDemote}, {"reload", reload, numReload}} {
			if a.n < 0 || a.n > limits.Batch {
				return kverr.Errorf(kverr.InvalidArgument, "kvp_tier_copier_run: num_%s must be in [0, %d]: got %d", a.what, limits.Batch, int32(a.n))
			}
			if a.p == nil && a.n > 0 {
				return kverr.Errorf(kverr.NullPointer, "kvp_tier_copier_run: %s must not be NULL with num_%s %d", a.what, a.what, int32(a.n))
			}
		}
		return cp.Run(slice[tiercopy.Op](unsafe.Pointer(demote), numDemote), slice[tiercopy.Op](unsafe.Pointer(reload), numReload),
			cuda.Stream(uintptr(stream)))
	})
}

//export kvpgo_tier_copier_destroy
func kvpgo_tier_copier_destroy(h *C.kvp_tier_copier) {
	destroy(unsafe.Pointer(h), func(cp *tiercopy.Copier) { _ = cp.Close() })
}
