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
)

// The paged-KV descriptor (kvp_paged_kv) at the ABI: every launch that reads
// or writes the cache takes its cache from here, either the descriptor its
// args point to or, for args that leave kv NULL (a host built against 0.3),
// the args' own cache fields. core/attn sees one attn.PagedKV either way.

// kvShape is what a call says of its cache beside the descriptor: its dtype,
// kv heads and head_dim (0 where the call has no such field of its own).
type kvShape struct{ dtype, kvHeads, headDim int32 }

// pagedKVOf resolves a call's cache: own is what the args' own fields give
// (zero when the call has none set), kv the args' descriptor pointer, and
// shape the call's dtype, kv heads and head_dim, which the descriptor may
// fill (a 0) or must equal. It returns the cache and the resolved shape.
func pagedKVOf(what string, kv *C.kvp_paged_kv, own attn.PagedKV, shape kvShape) (attn.PagedKV, kvShape, error) {
	if kv == nil {
		return own, shape, nil
	}
	if own != (attn.PagedKV{}) {
		return attn.PagedKV{}, shape, kverr.Errorf(kverr.InvalidArgument,
			"%s: kv is set, so the args' own cache fields (k_cache, v_cache, cache_*_stride, num_blocks, block_size, "+
				"block_table, block_table_stride, max_blocks_per_seq) must be 0: a cache is described once", what)
	}
	var c C.kvp_paged_kv
	if err := pagedKVStruct.in(unsafe.Pointer(kv), unsafe.Pointer(&c)); err != nil {
		return attn.PagedKV{}, shape, err
	}
	if c.reserved != 0 {
		return attn.PagedKV{}, shape, kverr.Errorf(kverr.InvalidArgument, "%s: kv.reserved must be 0: got %d", what, int32(c.reserved))
	}
	var err error
	cacheDType := attn.DType(0)
	if c.dtype == C.KVP_DTYPE_E4M3 {
		// The call's dtype is q's and out's; the descriptor's is the cache's.
		if shape.dtype == 0 {
			return attn.PagedKV{}, shape, kverr.Errorf(kverr.InvalidArgument,
				"%s: kv.dtype is KVP_DTYPE_E4M3, so the args' dtype (the dtype of q and out, or of key and value) must be set: f16 or bf16", what)
		}
		cacheDType = attn.E4M3
	} else if shape.dtype, err = agree(what, "dtype", shape.dtype, int32(c.dtype)); err != nil {
		return attn.PagedKV{}, shape, err
	}
	if shape.kvHeads, err = agree(what, "num_kv_heads", shape.kvHeads, int32(c.num_kv_heads)); err != nil {
		return attn.PagedKV{}, shape, err
	}
	if _, err = agree(what, "head_dim", shape.headDim, int32(c.head_dim)); err != nil {
		return attn.PagedKV{}, shape, err
	}
	stride := int64(c.block_table_stride)
	if stride == 0 {
		stride = int64(c.max_blocks_per_seq)
	}
	return attn.PagedKV{
		NumBlocks: int(c.num_blocks), BlockSize: int(c.block_size),
		CacheBlockStride: int64(c.block_stride), CacheTokenStride: int64(c.token_stride), CacheHeadStride: int64(c.head_stride),
		MaxBlocksPerSeq: int(c.max_blocks_per_seq), BlockTableStride: stride,
		KCache: cuda.DevicePtr(c.k_cache), VCache: cuda.DevicePtr(c.v_cache), BlockTable: cuda.DevicePtr(c.block_table),
		DType: cacheDType, ScaleKind: attn.ScaleKind(c.scale_kind),
		KScale: cuda.DevicePtr(c.k_scale), VScale: cuda.DevicePtr(c.v_scale),
	}, shape, nil
}

// ownKV is the cache that an args struct's own fields (the 0.3 form)
// describe: the args of kv_write pass 0 for the table's three.
func ownKV(numBlocks, blockSize, maxBlocks C.int32_t, blockStride, tokenStride, headStride, tableStride C.int64_t,
	k, v, table C.uint64_t) attn.PagedKV {
	return attn.PagedKV{
		NumBlocks: int(numBlocks), BlockSize: int(blockSize),
		CacheBlockStride: int64(blockStride), CacheTokenStride: int64(tokenStride), CacheHeadStride: int64(headStride),
		MaxBlocksPerSeq: int(maxBlocks), BlockTableStride: int64(tableStride),
		KCache: cuda.DevicePtr(k), VCache: cuda.DevicePtr(v), BlockTable: cuda.DevicePtr(table),
	}
}

// agree is the value a call and its descriptor give for one field: either
// may leave it 0; set in both, they must be equal.
func agree(what, field string, call, desc int32) (int32, error) {
	switch {
	case desc == 0:
		return call, nil
	case call == 0 || call == desc:
		return desc, nil
	}
	return 0, kverr.Errorf(kverr.InvalidArgument, "%s: the args' %s is %d and kv.%s is %d: they describe one cache", what, field, call, field, desc)
}
