package main

// Go-typed entry points over the attention exports, for capi's tests (test
// files cannot use cgo).

/*
#include <stdlib.h>
#include "kvplug.h"
*/
import "C"

import (
	"time"
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
)

// decodeHookArgs mirrors the kvp_paged_decode_args fields the tests set.
type decodeHookArgs struct {
	structSize                             uintptr
	dtype, headDim, batch, qHeads, kvHeads int32
	numBlocks, blockSize, maxBlocks        int32
	q, k, v, table, lens, out, lse         uint64
	workspace, workspaceBytes              uint64
	numSplits, qLen                        int32
	sinks                                  uint64
}

func hookPagedDecode(h *decodeHookArgs, null bool) abiStatus {
	if null {
		return abiStatus(kvpgo_paged_decode(nil, 0))
	}
	a := C.kvp_paged_decode_args{
		struct_size: C.size_t(h.structSize), dtype: C.int32_t(h.dtype), head_dim: C.int32_t(h.headDim),
		batch: C.int32_t(h.batch), num_q_heads: C.int32_t(h.qHeads), num_kv_heads: C.int32_t(h.kvHeads),
		num_blocks: C.int32_t(h.numBlocks), block_size: C.int32_t(h.blockSize), max_blocks_per_seq: C.int32_t(h.maxBlocks),
		q: C.uint64_t(h.q), k_cache: C.uint64_t(h.k), v_cache: C.uint64_t(h.v),
		block_table: C.uint64_t(h.table), seq_lens: C.uint64_t(h.lens), out: C.uint64_t(h.out), lse: C.uint64_t(h.lse),
		workspace: C.uint64_t(h.workspace), workspace_bytes: C.uint64_t(h.workspaceBytes),
		num_splits: C.int32_t(h.numSplits), q_len: C.int32_t(h.qLen), sinks: C.uint64_t(h.sinks),
	}
	// Contiguous layouts.
	D, qh, kvh, bs := int64(h.headDim), int64(h.qHeads), int64(h.kvHeads), int64(h.blockSize)
	a.q_batch_stride, a.q_head_stride = C.int64_t(qh*D), C.int64_t(D)
	a.out_batch_stride, a.out_head_stride = C.int64_t(qh*D), C.int64_t(D)
	a.cache_block_stride, a.cache_token_stride, a.cache_head_stride = C.int64_t(bs*kvh*D), C.int64_t(kvh*D), C.int64_t(D)
	a.block_table_stride = C.int64_t(h.maxBlocks)
	return abiStatus(kvpgo_paged_decode(&a, 0))
}

func sizeofPagedDecodeArgs() uintptr { return unsafe.Sizeof(C.kvp_paged_decode_args{}) }

func hookKVWrite(structSize uintptr, dtype, headDim int32) abiStatus {
	a := C.kvp_kv_write_args{struct_size: C.size_t(structSize), dtype: C.int32_t(dtype), head_dim: C.int32_t(headDim),
		num_tokens: 1, num_kv_heads: 1, num_blocks: 1, block_size: 1,
		key: 0x1000, value: 0x2000, k_cache: 0x3000, v_cache: 0x4000, slot_mapping: 0x5000,
		key_token_stride: C.int64_t(headDim), key_head_stride: C.int64_t(headDim),
		value_token_stride: C.int64_t(headDim), value_head_stride: C.int64_t(headDim),
		cache_block_stride: C.int64_t(headDim), cache_token_stride: C.int64_t(headDim), cache_head_stride: C.int64_t(headDim)}
	return abiStatus(kvpgo_kv_write(&a, 0))
}

func sizeofKVWriteArgs() uintptr { return unsafe.Sizeof(C.kvp_kv_write_args{}) }

func hookMergeStates(numStates int32, reserved int32) abiStatus {
	a := C.kvp_merge_states_args{struct_size: C.size_t(unsafe.Sizeof(C.kvp_merge_states_args{})),
		dtype: C.KVP_DTYPE_F32, head_dim: 64, num_states: C.int32_t(numStates), num_tokens: 1, num_heads: 1,
		reserved: C.int32_t(reserved), v_token_stride: 64, v_head_stride: 64, s_token_stride: 1, s_head_stride: 1,
		out: 0x9000, out_token_stride: 64, out_head_stride: 64}
	for i := 0; i < int(C.KVP_MERGE_MAX_STATES); i++ {
		a.v[i], a.s[i] = C.uint64_t(0x1000*(i+1)), C.uint64_t(0x100000+0x1000*i)
	}
	return abiStatus(kvpgo_merge_states(&a, 0))
}

func hookWorkspaceSize(maxBatch, qHeads, headDim, maxSplits int32, null bool) (uint64, abiStatus) {
	var n C.uint64_t
	p := &n
	if null {
		p = nil
	}
	st := kvpgo_attn_workspace_size(C.int32_t(maxBatch), C.int32_t(qHeads), C.int32_t(headDim), C.int32_t(maxSplits), p)
	return uint64(n), abiStatus(st)
}

func hookCudaAvailable() (int32, abiStatus) {
	var v C.int32_t = 7
	st := kvpgo_cuda_available(&v)
	return int32(v), abiStatus(st)
}

func hookNumSplits(dtype, headDim, batch, qHeads, kvHeads, maxLen int32) (int32, abiStatus) {
	var v C.int32_t
	st := kvpgo_attn_num_splits(C.int32_t(dtype), C.int32_t(headDim), C.int32_t(batch), C.int32_t(qHeads), C.int32_t(kvHeads), C.int32_t(maxLen), &v)
	return int32(v), abiStatus(st)
}

// hookPrefillPlan plans a batch with host arrays qo and kv (device pointers
// are placeholders: the checks fail before any launch) and returns the
// status and the plan's kind.
func hookPrefillPlan(qo, kv []int32, wsBytes uint64, structSize uintptr, reserved int32) (int32, abiStatus) {
	a := C.kvp_prefill_plan_args{struct_size: C.size_t(structSize), dtype: C.KVP_DTYPE_BF16, head_dim: 128,
		num_q_heads: 8, num_kv_heads: 2, batch: C.int32_t(len(kv)), reserved: C.int32_t(reserved),
		qo_indptr: 0x1000, kv_lens: 0x2000, workspace: 0x3000, workspace_bytes: C.uint64_t(wsBytes)}
	// Copies in C memory: cgo forbids passing Go pointers inside a struct.
	cqo := (*C.int32_t)(C.malloc(C.size_t(4 * max(len(qo), 1))))
	ckv := (*C.int32_t)(C.malloc(C.size_t(4 * max(len(kv), 1))))
	defer C.free(unsafe.Pointer(cqo))
	defer C.free(unsafe.Pointer(ckv))
	copy(unsafe.Slice((*int32)(unsafe.Pointer(cqo)), len(qo)), qo)
	copy(unsafe.Slice((*int32)(unsafe.Pointer(ckv)), len(kv)), kv)
	a.qo_indptr_host, a.kv_lens_host = cqo, ckv
	plan := C.kvp_attn_plan{struct_size: C.size_t(unsafe.Sizeof(C.kvp_attn_plan{}))}
	st := kvpgo_prefill_plan(&a, &plan, 0)
	return int32(plan.kind), abiStatus(st)
}

func sizeofPrefillPlanArgs() uintptr { return unsafe.Sizeof(C.kvp_prefill_plan_args{}) }

// hookPrefillRun runs an unplanned (kind 0) or hand-made plan.
func hookPrefillRun(kind int32, nullPlan bool) abiStatus {
	plan := C.kvp_attn_plan{struct_size: C.size_t(unsafe.Sizeof(C.kvp_attn_plan{})), kind: C.int32_t(kind), route: 1,
		dtype: C.KVP_DTYPE_F16, head_dim: 64, num_q_heads: 2, num_kv_heads: 1, window_left: -1, batch: 1, total_q: 1,
		max_q_len: 1, max_kv_len: 4, num_items: 1, grid: 8, num_splits: 1, workspace: 0x3000, workspace_bytes: 1024, kv_lens: 0x2000}
	a := C.kvp_paged_prefill_args{struct_size: C.size_t(unsafe.Sizeof(C.kvp_paged_prefill_args{})),
		num_blocks: 4, block_size: 4, max_blocks_per_seq: 1, q: 0x10000, q_token_stride: 128, q_head_stride: 64,
		k_cache: 0x20000, v_cache: 0x30000, cache_block_stride: 256, cache_token_stride: 64, cache_head_stride: 64,
		block_table: 0x40000, block_table_stride: 1, out: 0x50000, out_token_stride: 128, out_head_stride: 64}
	if nullPlan {
		return abiStatus(kvpgo_paged_prefill(nil, &a, 0))
	}
	return abiStatus(kvpgo_paged_prefill(&plan, &a, 0))
}

func hookPrefillWorkspaceSize(maxBatch, maxTokens, qh, kvh, d int32) (uint64, abiStatus) {
	var n C.uint64_t
	st := kvpgo_prefill_workspace_size(C.int32_t(maxBatch), C.int32_t(maxTokens), C.int32_t(qh), C.int32_t(kvh), C.int32_t(d), &n)
	return uint64(n), abiStatus(st)
}

// kvHookCache is a cache as the tests describe it: the descriptor's fields.
type kvHookCache struct {
	dtype, kvHeads, numBlocks, blockSize, maxBlocks, headDim int32
	k, v, table                                              uint64
	blockStride, tokenStride, headStride, tableStride        int64
	kScale, vScale                                           uint64
	scaleKind, reserved                                      int32
	// callDType is the args' own dtype beside the descriptor (0: the
	// descriptor gives it), for e4m3 caches under a 16-bit call.
	callDType int32
}

func (h *kvHookCache) desc() *C.kvp_paged_kv {
	d := (*C.kvp_paged_kv)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_paged_kv{}))))
	*d = C.kvp_paged_kv{struct_size: C.size_t(unsafe.Sizeof(C.kvp_paged_kv{})),
		dtype: C.int32_t(h.dtype), num_kv_heads: C.int32_t(h.kvHeads), num_blocks: C.int32_t(h.numBlocks),
		block_size: C.int32_t(h.blockSize), k_cache: C.uint64_t(h.k), v_cache: C.uint64_t(h.v),
		block_stride: C.int64_t(h.blockStride), token_stride: C.int64_t(h.tokenStride), head_stride: C.int64_t(h.headStride),
		block_table: C.uint64_t(h.table), block_table_stride: C.int64_t(h.tableStride),
		max_blocks_per_seq: C.int32_t(h.maxBlocks), head_dim: C.int32_t(h.headDim), k_scale: C.uint64_t(h.kScale),
		v_scale: C.uint64_t(h.vScale), scale_kind: C.int32_t(h.scaleKind), reserved: C.int32_t(h.reserved)}
	return d
}

// setOwn writes the cache into an args struct's own fields (the 0.3 form),
// the table stride's 0 default resolved as the descriptor resolves it.
func (h *kvHookCache) setOwn(numBlocks, blockSize, maxBlocks *C.int32_t, k, v, table *C.uint64_t,
	blockStride, tokenStride, headStride, tableStride *C.int64_t) {
	*numBlocks, *blockSize, *maxBlocks = C.int32_t(h.numBlocks), C.int32_t(h.blockSize), C.int32_t(h.maxBlocks)
	*k, *v, *table = C.uint64_t(h.k), C.uint64_t(h.v), C.uint64_t(h.table)
	*blockStride, *tokenStride, *headStride = C.int64_t(h.blockStride), C.int64_t(h.tokenStride), C.int64_t(h.headStride)
	*tableStride = C.int64_t(h.tableStride)
	if h.tableStride == 0 {
		*tableStride = C.int64_t(h.maxBlocks)
	}
}

// hookKVCallSides translates one call three ways: with the cache in the
// args' own fields (legacy), through a descriptor (own fields 0, dtype and
// kv heads 0 so that the descriptor gives them, or the dtype callDType),
// and through a descriptor with the own fields also set (refused). It
// returns whether the first two reach core/attn identically, and the
// statuses of the second (its translation, then, for kv_write and decode,
// core/attn's checks of the layout) and third. call is "kv_write", "decode" or "prefill".
func hookKVCallSides(call string, h kvHookCache) (same bool, viaDesc, both abiStatus) {
	d := h.desc()
	defer C.free(unsafe.Pointer(d))
	switch call {
	case "kv_write":
		legacy := C.kvp_kv_write_args{struct_size: C.size_t(unsafe.Sizeof(C.kvp_kv_write_args{})),
			dtype: C.int32_t(h.dtype), head_dim: 128, num_tokens: 3, num_kv_heads: C.int32_t(h.kvHeads),
			key: 0x11000, value: 0x12000, slot_mapping: 0x13000, key_token_stride: 1024, key_head_stride: 128,
			value_token_stride: 1024, value_head_stride: 128}
		withDesc := legacy
		var maxBlocks C.int32_t
		var table C.uint64_t
		var tableStride C.int64_t // the write reads no table
		h.setOwn(&legacy.num_blocks, &legacy.block_size, &maxBlocks, &legacy.k_cache, &legacy.v_cache, &table,
			&legacy.cache_block_stride, &legacy.cache_token_stride, &legacy.cache_head_stride, &tableStride)
		withDesc.dtype, withDesc.num_kv_heads, withDesc.kv = C.int32_t(h.callDType), 0, d
		a, errA := kvWriteArgsOf(&legacy)
		b, errB := kvWriteArgsOf(&withDesc)
		if errB == nil {
			_, errB = b.Extents()
		}
		legacy.kv = d
		_, errC := kvWriteArgsOf(&legacy)
		return errA == nil && errB == nil && a == b, abiStatus(fail(errB)), abiStatus(fail(errC))
	case "decode":
		legacy := C.kvp_paged_decode_args{struct_size: C.size_t(unsafe.Sizeof(C.kvp_paged_decode_args{})),
			dtype: C.int32_t(h.dtype), head_dim: 128, batch: 2, num_q_heads: 4 * C.int32_t(h.kvHeads),
			num_kv_heads: C.int32_t(h.kvHeads), q: 0x21000, seq_lens: 0x22000, out: 0x23000, q_batch_stride: 4096,
			q_head_stride: 128, out_batch_stride: 4096, out_head_stride: 128, scale: 0.5, q_len: 2}
		withDesc := legacy
		h.setOwn(&legacy.num_blocks, &legacy.block_size, &legacy.max_blocks_per_seq, &legacy.k_cache, &legacy.v_cache,
			&legacy.block_table, &legacy.cache_block_stride, &legacy.cache_token_stride, &legacy.cache_head_stride,
			&legacy.block_table_stride)
		withDesc.dtype, withDesc.num_kv_heads, withDesc.kv = C.int32_t(h.callDType), 0, d
		a, errA := pagedDecodeArgsOf(&legacy)
		b, errB := pagedDecodeArgsOf(&withDesc)
		if errB == nil {
			_, errB = b.Extents()
		}
		legacy.kv = d
		_, errC := pagedDecodeArgsOf(&legacy)
		return errA == nil && errB == nil && a == b, abiStatus(fail(errB)), abiStatus(fail(errC))
	case "prefill":
		legacy := C.kvp_paged_prefill_args{struct_size: C.size_t(unsafe.Sizeof(C.kvp_paged_prefill_args{})),
			q: 0x31000, out: 0x32000, q_token_stride: 4096, q_head_stride: 128, out_token_stride: 4096, out_head_stride: 128}
		withDesc := legacy
		h.setOwn(&legacy.num_blocks, &legacy.block_size, &legacy.max_blocks_per_seq, &legacy.k_cache, &legacy.v_cache,
			&legacy.block_table, &legacy.cache_block_stride, &legacy.cache_token_stride, &legacy.cache_head_stride,
			&legacy.block_table_stride)
		withDesc.kv = d
		plan := attn.PrefillPlan{PrefillShape: attn.PrefillShape{DType: attn.BF16, HeadDim: 128, NumQHeads: 8, NumKVHeads: 2}}
		a, errA := pagedPrefillArgsOf("test", &legacy, &plan)
		b, errB := pagedPrefillArgsOf("test", &withDesc, &plan)
		legacy.kv = d
		_, errC := pagedPrefillArgsOf("test", &legacy, &plan)
		return errA == nil && errB == nil && a == b, abiStatus(fail(errB)), abiStatus(fail(errC))
	}
	panic("unknown call " + call)
}

// hookDecodeHostCost runs n translations and checks of one decode call (what
// kvp_paged_decode does on the host before the launch), with the cache in the
// args' own fields or through a descriptor, and returns the time per call.
func hookDecodeHostCost(n int, withDesc bool) time.Duration {
	h := kvHookCache{dtype: 2, kvHeads: 8, numBlocks: 4096, blockSize: 16, maxBlocks: 64, headDim: 128,
		k: 0x100000, v: 0x200000, table: 0x300000, blockStride: 16 * 8 * 128, tokenStride: 8 * 128, headStride: 128}
	d := h.desc()
	defer C.free(unsafe.Pointer(d))
	a := (*C.kvp_paged_decode_args)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_paged_decode_args{}))))
	defer C.free(unsafe.Pointer(a))
	*a = C.kvp_paged_decode_args{struct_size: C.size_t(unsafe.Sizeof(C.kvp_paged_decode_args{})),
		dtype: 2, head_dim: 128, batch: 64, num_q_heads: 32, q: 0x21000, seq_lens: 0x22000, out: 0x23000,
		q_batch_stride: 4096, q_head_stride: 128, out_batch_stride: 4096, out_head_stride: 128}
	if withDesc {
		a.kv = d
	} else {
		a.num_kv_heads = 8
		h.setOwn(&a.num_blocks, &a.block_size, &a.max_blocks_per_seq, &a.k_cache, &a.v_cache, &a.block_table,
			&a.cache_block_stride, &a.cache_token_stride, &a.cache_head_stride, &a.block_table_stride)
	}
	start := time.Now()
	for range n {
		g, err := pagedDecodeArgsOf(a)
		if err != nil {
			panic(err)
		}
		if _, err := g.DecodeLayout.Extents(); err != nil {
			panic(err)
		}
	}
	return time.Since(start) / time.Duration(n)
}

// hookSinksOf decodes a kvp_paged_decode_args and a kvp_paged_prefill_args
// of struct_size size (from the whole struct in memory, sinks set to
// sinks) as the launches do, and returns the sinks each decoded: a size
// that ends before the field must leave it 0 (the struct rule).
func hookAppendedOf(decodeSize, prefillSize uintptr, sinks uint64, window int32) (fromDecode, fromPrefill uint64, windowSize int, err error) {
	d := C.kvp_paged_decode_args{struct_size: C.size_t(decodeSize), dtype: C.KVP_DTYPE_F16, head_dim: 64, sinks: C.uint64_t(sinks),
		window_size: C.int32_t(window)}
	da, err := pagedDecodeArgsOf(&d)
	if err != nil {
		return 0, 0, 0, err
	}
	p := C.kvp_paged_prefill_args{struct_size: C.size_t(prefillSize), sinks: C.uint64_t(sinks)}
	plan := attn.PrefillPlan{PrefillShape: attn.PrefillShape{DType: attn.F16, HeadDim: 64, NumQHeads: 2, NumKVHeads: 1}}
	pa, err := pagedPrefillArgsOf("kvp_paged_prefill", &p, &plan)
	return uint64(da.Sinks), uint64(pa.Sinks), da.WindowSize, err
}

// sizeofThroughKV is the 0.5 size of both args structs: through kv, before
// the sinks appended in 0.6.
func sizeofThroughKV() (decode, prefill uintptr) {
	return unsafe.Offsetof(C.kvp_paged_decode_args{}.kv) + 8, unsafe.Offsetof(C.kvp_paged_prefill_args{}.kv) + 8
}

// sizeofDecodeThroughSinks is kvp_paged_decode_args through sinks, before
// window_size.
func sizeofDecodeThroughSinks() uintptr { return unsafe.Offsetof(C.kvp_paged_decode_args{}.sinks) + 8 }

func sizeofPagedPrefillArgs() uintptr { return unsafe.Sizeof(C.kvp_paged_prefill_args{}) }
