package main

// Go-typed entry points over the tier copier's exports, for capi's tests
// (see testhooks.go). Arrays go through C memory, as from a real host.

/*
#include <stdlib.h>
#include "kvplug.h"
*/
import "C"

import "unsafe"

// hookKVLayers is a kvp_kv_layers; v nil passes NULL.
type hookKVLayers struct {
	structSize                             uintptr // 0: the full struct
	numLayers, numBlocks                   int32
	k, v                                   []uint64
	nullK                                  bool
	blockBytes, kBlockStride, vBlockStride int64
}

// hookTierCopierCreate creates a copier over host (C memory of slots x
// slotBytes when host is true, NULL otherwise).
func hookTierCopierCreate(l hookKVLayers, host bool, slotBytes int64, slots int32) (unsafe.Pointer, abiStatus) {
	c := (*C.kvp_kv_layers)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_kv_layers{}))))
	defer C.free(unsafe.Pointer(c))
	c.struct_size = C.size_t(unsafe.Sizeof(C.kvp_kv_layers{}))
	if l.structSize != 0 {
		c.struct_size = C.size_t(l.structSize)
	}
	c.num_layers, c.num_blocks = C.int32_t(l.numLayers), C.int32_t(l.numBlocks)
	c.block_bytes, c.k_block_stride, c.v_block_stride = C.int64_t(l.blockBytes), C.int64_t(l.kBlockStride), C.int64_t(l.vBlockStride)
	arr := func(v []uint64) *C.uint64_t {
		p := (*C.uint64_t)(C.calloc(C.size_t(max(len(v), 1)), 8))
		copy(unsafe.Slice((*uint64)(unsafe.Pointer(p)), len(v)), v)
		return p
	}
	if !l.nullK {
		c.k = arr(l.k)
		defer C.free(unsafe.Pointer(c.k))
	}
	if l.v != nil {
		c.v = arr(l.v)
		defer C.free(unsafe.Pointer(c.v))
	}
	var hp unsafe.Pointer
	if host {
		hp = C.aligned_alloc(64, C.size_t(max(int64(slots)*slotBytes, 64)))
		defer C.free(hp)
	}
	var out *C.kvp_tier_copier
	st := kvpgo_tier_copier_create(c, hp, C.int64_t(slotBytes), C.int32_t(slots), &out)
	return unsafe.Pointer(out), abiStatus(st)
}

// hookTierCopierRun runs demote and reload ops ((block, slot) pairs; a nil
// slice with n > 0 passes NULL with that count).
func hookTierCopierRun(h unsafe.Pointer, demote [][2]int32, nd int32, reload [][2]int32, nr int32) abiStatus {
	arr := func(ops [][2]int32) *C.kvp_tier_copy {
		if ops == nil {
			return nil
		}
		p := (*C.kvp_tier_copy)(C.calloc(C.size_t(max(len(ops), 1)), C.size_t(unsafe.Sizeof(C.kvp_tier_copy{}))))
		for i, o := range ops {
			e := (*C.kvp_tier_copy)(unsafe.Add(unsafe.Pointer(p), i*int(unsafe.Sizeof(C.kvp_tier_copy{}))))
			e.block, e.slot = C.int32_t(o[0]), C.int32_t(o[1])
		}
		return p
	}
	d, r := arr(demote), arr(reload)
	defer C.free(unsafe.Pointer(d))
	defer C.free(unsafe.Pointer(r))
	return abiStatus(kvpgo_tier_copier_run((*C.kvp_tier_copier)(h), d, C.int32_t(nd), r, C.int32_t(nr), nil))
}

func hookTierCopierDestroy(h unsafe.Pointer) { kvpgo_tier_copier_destroy((*C.kvp_tier_copier)(h)) }
