package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

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
	if c.k == nil {
		return failf(kverr.NullPointer, "kvp_tier_copier_create: layers->k must not be NULL")
	}
	l := tiercopy.Layers{
		K:          ptrs(c.k, n),
		ChunkBytes: int64(c.block_bytes), KBlockStride: int64(c.k_block_stride), VBlockStride: int64(c.v_block_stride),
		NumBlocks: int32(c.num_blocks),
	}
	if c.v != nil {
		l.V = ptrs(c.v, n)
	}
	cp, err := tiercopy.New(l, tiercopy.Host{Base: host, SlotBytes: int64(slotBytes), NumSlots: int32(numSlots)})
	if err != nil {
		return fail(err)
	}
	*out = (*C.kvp_tier_copier)(newHandle(cp))
	return C.KVP_OK
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
