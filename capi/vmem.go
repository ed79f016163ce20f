package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/vmem"
	"github.com/kvplug/kvplug/internal/logx"
)

const vcacheName = "kvp_vcache"

// vcache owns a cache and the driver it was created with.
type vcache struct {
	c   *vmem.Cache
	drv vmem.Driver
}

// onVcache is an export on a kvp_vcache handle (onHandle).
func onVcache(h *C.kvp_vcache, f func(*vcache) error) C.kvp_status {
	return onHandle(unsafe.Pointer(h), vcacheName, f)
}

//export kvpgo_vcache_create
func kvpgo_vcache_create(cfg *C.kvp_vcache_config, out **C.kvp_vcache) (st C.kvp_status) {
	defer guard(&st)
	if logx.InCallback() {
		return fail(errFromLogCallback("kvp_vcache_create"))
	}
	var c C.kvp_vcache_config
	if err := configIn("kvp_vcache_create", cfg, out == nil, vcacheConfigStruct, &c); err != nil {
		return fail(err)
	}
	vcfg := vmem.Config{
		Layers: int(c.num_layers), KVHeads: int(c.num_kv_heads), HeadDim: int(c.head_dim),
		DTypeBytes: int(c.dtype_bytes), MaxBatch: int(c.max_batch), MaxContext: int(c.max_context),
		PageSize: int(c.page_size), BudgetBytes: int64(c.budget_bytes),
		LookaheadTokens: int(c.lookahead_tokens), NoBackground: c.no_background != 0,
		ReclaimBelowBytes: int64(c.reclaim_below_bytes),
	}
	// Checked before a driver is opened: a CUDA context or a host page file
	// is not made for a configuration that cannot work.
	if err := vcfg.Check(); err != nil {
		return fail(err)
	}
	var drv vmem.Driver
	switch c.backend {
	case C.KVP_VMEM_CUDA:
		d, err := vmem.NewCUDA(int(c.device))
		if err != nil {
			return fail(err)
		}
		drv = d
	case C.KVP_VMEM_HOST:
		d, err := vmem.NewHost(0)
		if err != nil {
			return fail(err)
		}
		drv = d
	default:
		return failf(kverr.InvalidArgument, "kvp_vcache_create: backend must be KVP_VMEM_CUDA (0) or KVP_VMEM_HOST (1): got %d", int32(c.backend))
	}
	vc, err := vmem.New(vcfg, drv)
	if err != nil {
		_ = drv.Close()
		return fail(err)
	}
	*out = (*C.kvp_vcache)(newHandle(&vcache{c: vc, drv: drv}))
	return C.KVP_OK
}

//export kvpgo_vcache_destroy
func kvpgo_vcache_destroy(h *C.kvp_vcache) {
	// Only a live kvp_vcache is dropped: another object's handle stays.
	destroy(unsafe.Pointer(h), func(vc *vcache) {
		_ = vc.c.Close()
		_ = vc.drv.Close()
	})
}

//export kvpgo_vcache_layer_ptrs
func kvpgo_vcache_layer_ptrs(h *C.kvp_vcache, layer C.int32_t, k, v *C.uint64_t) C.kvp_status {
	return onVcache(h, func(vc *vcache) error {
		if k == nil || v == nil {
			return kverr.Errorf(kverr.NullPointer, "kvp_vcache_layer_ptrs: k_ptr and v_ptr must not be NULL")
		}
		kp, vp, err := vc.c.LayerPtrs(int(layer))
		if err != nil {
			return err
		}
		*k, *v = C.uint64_t(kp), C.uint64_t(vp)
		return nil
	})
}

//export kvpgo_vcache_strides
func kvpgo_vcache_strides(h *C.kvp_vcache, strides *C.int64_t) C.kvp_status {
	return onVcache(h, func(vc *vcache) error {
		if strides == nil {
			return kverr.Errorf(kverr.NullPointer, "kvp_vcache_strides: strides must not be NULL")
		}
		s := vc.c.Layout().ElementStrides()
		out := unsafe.Slice((*int64)(unsafe.Pointer(strides)), 4)
		copy(out, s[:])
		return nil
	})
}

//export kvpgo_vcache_alloc_slot
func kvpgo_vcache_alloc_slot(h *C.kvp_vcache, slot *C.int32_t) C.kvp_status {
	return onVcache(h, func(vc *vcache) error {
		if slot == nil {
			return kverr.Errorf(kverr.NullPointer, "kvp_vcache_alloc_slot: slot must not be NULL")
		}
		s, err := vc.c.Alloc()
		if err != nil {
			return err
		}
		*slot = C.int32_t(s)
		return nil
	})
}

//export kvpgo_vcache_free_slot
func kvpgo_vcache_free_slot(h *C.kvp_vcache, slot C.int32_t) C.kvp_status {
	return onVcache(h, func(vc *vcache) error {
		return vc.c.Free(int(slot))
	})
}

//export kvpgo_vcache_step
func kvpgo_vcache_step(h *C.kvp_vcache, slots, ctxLens *C.int32_t, n C.int32_t) C.kvp_status {
	return onVcache(h, func(vc *vcache) error {
		if n == 0 {
			return nil
		}
		if err := checkCount(n, "kvp_vcache_step: n"); err != nil {
			return err
		}
		if slots == nil || ctxLens == nil {
			return kverr.Errorf(kverr.NullPointer, "kvp_vcache_step: slots and ctx_lens must not be NULL")
		}
		return vc.c.Step(slice[int32](unsafe.Pointer(slots), n), slice[int32](unsafe.Pointer(ctxLens), n))
	})
}

//export kvpgo_vcache_trim
func kvpgo_vcache_trim(h *C.kvp_vcache) C.kvp_status {
	return onVcache(h, func(vc *vcache) error {
		return vc.c.Trim()
	})
}

//export kvpgo_vcache_stats_get
func kvpgo_vcache_stats_get(h *C.kvp_vcache, out *C.kvp_vcache_stats) C.kvp_status {
	return statsOut(unsafe.Pointer(h), vcacheName, "kvp_vcache_stats_get", out, vcacheStatsStruct, func(vc *vcache) (full C.kvp_vcache_stats) {
		s := vc.c.Stats()
		full = C.kvp_vcache_stats{
			page_size:         C.int64_t(s.PageSize),
			budget_bytes:      C.int64_t(s.BudgetBytes),
			tensor_bytes:      C.int64_t(vc.c.Layout().BufferBytes),
			mapped_bytes:      C.int64_t(s.MappedBytes),
			held_bytes:        C.int64_t(s.HeldBytes),
			active_slots:      C.int32_t(s.ActiveSlots),
			reusable_slots:    C.int32_t(s.ReusableSlots),
			steps:             C.int64_t(s.Steps),
			map_calls:         C.int64_t(s.MapCalls),
			unmap_calls:       C.int64_t(s.UnmapCalls),
			create_calls:      C.int64_t(s.CreateCalls),
			release_calls:     C.int64_t(s.ReleaseCalls),
			out_of_memory:     C.int64_t(s.OutOfMemory),
			step_map_ns:       C.int64_t(s.StepMapNs),
			step_wait_ns:      C.int64_t(s.StepWaitNs),
			background_map_ns: C.int64_t(s.BackgroundMapNs),
			background_errors: C.int64_t(s.BackgroundErrors),
		}
		return full
	})
}
