package main

// Go-typed entry points over the tier copier's exports, for capi's tests
// (see testhooks.go). Arrays go through C memory, as from a real host.

/*
#include <stdlib.h>
#include "kvplug.h"
*/
import "C"

import (
	"reflect"
	"unsafe"
)

// hookTierCopyStoreCopyEngine is KVP_TIER_COPY_STORE_COPY_ENGINE.
const hookTierCopyStoreCopyEngine = C.KVP_TIER_COPY_STORE_COPY_ENGINE

// hookKVLayers is a kvp_kv_layers; v nil passes NULL.
type hookKVLayers struct {
	structSize                             uintptr // 0: the full struct
	numLayers, numBlocks                   int32
	k, v                                   []uint64
	nullK                                  bool
	blockBytes, kBlockStride, vBlockStride int64
	flags, reserved                        int32
}

// hookTierCopierCreate creates a copier over host (C memory of slots x
// slotBytes when host is true, NULL otherwise).
func hookTierCopierCreate(l hookKVLayers, host bool, slotBytes int64, slots int32) (unsafe.Pointer, abiStatus) {
	c := cStructOf[C.kvp_kv_layers](l.structSize)
	defer C.free(unsafe.Pointer(c))
	c.num_layers, c.num_blocks = C.int32_t(l.numLayers), C.int32_t(l.numBlocks)
	c.block_bytes, c.k_block_stride, c.v_block_stride = C.int64_t(l.blockBytes), C.int64_t(l.kBlockStride), C.int64_t(l.vBlockStride)
	c.flags, c.reserved = C.int32_t(l.flags), C.int32_t(l.reserved)
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

// hookTierLayersBothWays translates one layout of n layers (bf16, 8 kv
// heads of 128, blocks of 16 tokens, dense; V when withV) through the
// kvp_kv_layers fields and through per-layer kvp_paged_kv descriptors, and
// returns whether both give the same tier layout, with the descriptors'
// status; bad picks a broken descriptor case ("" none).
func hookTierLayersBothWays(n int, withV bool, bad string) (same bool, st abiStatus) {
	const elem, heads, dim, bs, blocks = 2, 8, 128, 16, 100
	blockElems := int64(bs * heads * dim)
	ks, vs := make([]uint64, n), make([]uint64, n)
	descs := (*[1 << 10]*C.kvp_paged_kv)(C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof(uintptr(0)))))
	defer C.free(unsafe.Pointer(descs))
	for i := range n {
		ks[i], vs[i] = uint64(0x10000000*(i+1)), uint64(0x10000000*(i+1)+0x8000000)
		d := (*C.kvp_paged_kv)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_paged_kv{}))))
		defer C.free(unsafe.Pointer(d))
		*d = C.kvp_paged_kv{struct_size: C.size_t(unsafe.Sizeof(C.kvp_paged_kv{})), dtype: C.KVP_DTYPE_BF16,
			num_kv_heads: heads, num_blocks: blocks, block_size: bs, k_cache: C.uint64_t(ks[i]),
			block_stride: C.int64_t(blockElems), token_stride: heads * dim, head_stride: dim, head_dim: dim}
		if withV {
			d.v_cache = C.uint64_t(vs[i])
		}
		switch {
		case bad == "head-major" && i == 0:
			d.token_stride, d.head_stride = dim, bs*dim // [blocks, heads, bs, dim]: not dense token rows
		case bad == "shape" && i == n-1:
			d.num_blocks = blocks + 1
		case bad == "no head_dim" && i == 0:
			d.head_dim = 0
		}
		descs[i] = d
	}
	kb, vb := cUint64s(ks), cUint64s(vs)
	defer kb.free()
	defer vb.free()
	legacy := C.kvp_kv_layers{struct_size: C.size_t(unsafe.Sizeof(C.kvp_kv_layers{})), num_layers: C.int32_t(n),
		num_blocks: blocks, k: (*C.uint64_t)(kb.p), block_bytes: C.int64_t(blockElems * elem),
		k_block_stride: C.int64_t(blockElems * elem), v_block_stride: C.int64_t(blockElems * elem)}
	if withV {
		legacy.v = (*C.uint64_t)(vb.p)
	}
	viaKV := C.kvp_kv_layers{struct_size: C.size_t(unsafe.Sizeof(C.kvp_kv_layers{})), num_layers: C.int32_t(n),
		kv: (**C.struct_kvp_paged_kv)(unsafe.Pointer(descs))}
	a, errA := tierLayersOf(&legacy, n)
	b, errB := tierLayersOf(&viaKV, n)
	if errA != nil {
		panic(errA)
	}
	return errB == nil && reflect.DeepEqual(a, b), abiStatus(fail(errB))
}

// hookTierLayersE4M3 translates n e4m3 layers (8 kv heads of 128, blocks of
// 16 tokens, dense, V when withV) of scale kind kind through kvp_paged_kv
// descriptors with scale arrays, and returns the tier layout's K chunk and
// scale chunk, its scale addresses and the status; bad picks a broken case
// ("" none).
func hookTierLayersE4M3(n int, withV bool, kind int32, bad string) (chunk, scaleChunk int64, kScales, vScales []uint64, st abiStatus) {
	const heads, dim, bs, blocks = 8, 128, 16, 100
	descs := (*[1 << 10]*C.kvp_paged_kv)(C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof(uintptr(0)))))
	defer C.free(unsafe.Pointer(descs))
	for i := range n {
		d := (*C.kvp_paged_kv)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_paged_kv{}))))
		defer C.free(unsafe.Pointer(d))
		base := uint64(0x10000000 * (i + 1))
		*d = C.kvp_paged_kv{struct_size: C.size_t(unsafe.Sizeof(C.kvp_paged_kv{})), dtype: C.KVP_DTYPE_E4M3,
			num_kv_heads: heads, num_blocks: blocks, block_size: bs, k_cache: C.uint64_t(base),
			block_stride: bs * heads * dim, token_stride: heads * dim, head_stride: dim, head_dim: dim,
			scale_kind: C.int32_t(kind), k_scale: C.uint64_t(base + 0x1000000)}
		if withV {
			d.v_cache, d.v_scale = C.uint64_t(base+0x2000000), C.uint64_t(base+0x3000000)
		}
		switch {
		case bad == "16-bit with scales" && i == 0:
			d.dtype = C.KVP_DTYPE_BF16
		case bad == "no scale kind" && i == 0:
			d.scale_kind = 0
		case bad == "no v_scale" && i == n-1:
			d.v_scale = 0
		case bad == "mixed kinds" && i == n-1:
			d.scale_kind = C.KVP_KV_SCALE_TENSOR + C.KVP_KV_SCALE_TOKEN_HEAD - C.int32_t(kind)
		}
		descs[i] = d
	}
	c := C.kvp_kv_layers{struct_size: C.size_t(unsafe.Sizeof(C.kvp_kv_layers{})), num_layers: C.int32_t(n),
		kv: (**C.struct_kvp_paged_kv)(unsafe.Pointer(descs))}
	l, err := tierLayersOf(&c, n)
	for _, p := range l.KScale {
		kScales = append(kScales, uint64(p))
	}
	for _, p := range l.VScale {
		vScales = append(vScales, uint64(p))
	}
	return l.ChunkBytes, l.ScaleChunkBytes, kScales, vScales, abiStatus(fail(err))
}

// The scale kinds, for tests (which cannot use cgo).
const (
	hookScaleTokenHead = int32(C.KVP_KV_SCALE_TOKEN_HEAD)
	hookScaleTensor    = int32(C.KVP_KV_SCALE_TENSOR)
)
