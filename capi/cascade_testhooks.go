package main

// Go-typed entry points over the shared-prefix attention exports, for capi's
// tests (test files cannot use cgo).

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/cascade"
)

// cascadeHookArgs mirrors kvp_cascade_plan_args.
type cascadeHookArgs struct {
	structSize                             uintptr
	dtype, headDim, qHeads, kvHeads, batch int32
	maxBatch, blockSize, maxBlocks         int32
	stride                                 int64
	table, lens                            []int32
	seqLensDev                             uint64
	host                                   []int32
	hostBytes, workspace, workspaceBytes   uint64
	flags, headroom                        int32
	qo                                     []int32 // qo_indptr_host; nil: NULL
	qoDev                                  uint64
	maxTokens, reserved                    int32
}

func (h *cascadeHookArgs) c() C.kvp_cascade_plan_args {
	a := C.kvp_cascade_plan_args{
		struct_size: C.size_t(h.structSize), dtype: C.int32_t(h.dtype), head_dim: C.int32_t(h.headDim),
		num_q_heads: C.int32_t(h.qHeads), num_kv_heads: C.int32_t(h.kvHeads), batch: C.int32_t(h.batch),
		max_batch: C.int32_t(h.maxBatch), block_size: C.int32_t(h.blockSize), max_blocks_per_seq: C.int32_t(h.maxBlocks),
		block_table_stride: C.int64_t(h.stride), seq_lens: C.uint64_t(h.seqLensDev),
		host_workspace_bytes: C.uint64_t(h.hostBytes), workspace: C.uint64_t(h.workspace),
		workspace_bytes: C.uint64_t(h.workspaceBytes), flags: C.int32_t(h.flags), headroom: C.int32_t(h.headroom),
		qo_indptr: C.uint64_t(h.qoDev), max_tokens: C.int32_t(h.maxTokens), reserved: C.int32_t(h.reserved),
	}
	if h.qo != nil {
		a.qo_indptr_host = (*C.int32_t)(unsafe.Pointer(&h.qo[0]))
	}
	if len(h.table) > 0 {
		a.block_table_host = (*C.int32_t)(unsafe.Pointer(&h.table[0]))
	}
	if len(h.lens) > 0 {
		a.seq_lens_host = (*C.int32_t)(unsafe.Pointer(&h.lens[0]))
	}
	if len(h.host) > 0 {
		a.host_workspace = unsafe.Pointer(&h.host[0])
	}
	return a
}

func sizeofCascadePlanArgs() uintptr { return unsafe.Sizeof(C.kvp_cascade_plan_args{}) }

// firstCascadePlanArgsSize is kvp_cascade_plan_args's first released size.
func firstCascadePlanArgsSize() uintptr { return cascadePlanArgsStruct.first }

// cascadeHookPlan is a kvp_attn_plan kept in Go memory for the tests.
type cascadeHookPlan struct{ p C.kvp_attn_plan }

func hookCascadePlan(h *cascadeHookArgs, null bool) (*cascadeHookPlan, abiStatus) {
	var p cascadeHookPlan
	p.p.struct_size = C.size_t(unsafe.Sizeof(p.p))
	if null {
		return &p, abiStatus(kvp_cascade_plan(nil, &p.p, 0))
	}
	a := h.c()
	return &p, abiStatus(kvp_cascade_plan(&a, &p.p, 0))
}

// hookPlanWithoutDevice plans as kvp_cascade_plan does but skips the device
// (the slot count is the default and nothing is copied), so that the
// update and run checks can be tested on a machine without a GPU.
func hookPlanWithoutDevice(h *cascadeHookArgs) (*cascadeHookPlan, error) {
	a := h.c()
	maxTok := int(h.maxTokens)
	if maxTok == 0 {
		maxTok = int(h.maxBatch)
	}
	l, err := cascade.NewPrefillLayout(int(h.maxBatch), maxTok, int(h.qHeads), int(h.kvHeads), int(h.headDim))
	if err != nil {
		return nil, err
	}
	in := cascade.Input{NumQHeads: int(h.qHeads), NumKVHeads: int(h.kvHeads), HeadDim: int(h.headDim), DTypeBytes: 2,
		BlockSize: int(h.blockSize), Tables: h.table, TableStride: int(h.stride), MaxBlocksPerSeq: int(h.maxBlocks),
		SeqLens: h.lens, QIndptr: h.qo, Headroom: int(h.headroom), NoDecodeRoute: h.flags != 0}
	var pl cascade.Planner
	s, err := pl.Plan(&in, &l, h.host)
	if err != nil {
		return nil, err
	}
	return &cascadeHookPlan{cascadePlanStruct(&a, s, int(h.maxBatch), int(h.blockSize), cascade.DefaultSlots)}, nil
}

func (p *cascadeHookPlan) route() int32 { return int32(p.p.route) }
func (p *cascadeHookPlan) rows() (int32, int32) {
	return int32(p.p.total_q), int32(p.p.max_q_len)
}
func (p *cascadeHookPlan) setKind(k int32) { p.p.kind = C.int32_t(k) }
func (p *cascadeHookPlan) saved() (uint64, uint64) {
	return uint64(p.p.reserved[4]), uint64(p.p.reserved[5])
}

func hookCascadeUpdate(p *cascadeHookPlan, lens []int32, batch int32) (int32, abiStatus) {
	var fits C.int32_t = -1
	var lp *C.int32_t
	if len(lens) > 0 {
		lp = (*C.int32_t)(unsafe.Pointer(&lens[0]))
	}
	st := kvp_cascade_update(&p.p, lp, C.int32_t(batch), &fits)
	return int32(fits), abiStatus(st)
}

func hookCascadePrefillWorkspaceSize(maxBatch, maxTokens, qh, kvh, d int32) (uint64, uint64, abiStatus) {
	var dev, host C.uint64_t
	st := kvp_cascade_prefill_workspace_size(C.int32_t(maxBatch), C.int32_t(maxTokens), C.int32_t(qh), C.int32_t(kvh), C.int32_t(d), &dev, &host)
	return uint64(dev), uint64(host), abiStatus(st)
}

func hookCascadeWorkspaceSize(maxBatch, qh, kvh, d int32) (uint64, uint64, abiStatus) {
	var dev, host C.uint64_t
	st := kvp_cascade_workspace_size(C.int32_t(maxBatch), C.int32_t(qh), C.int32_t(kvh), C.int32_t(d), &dev, &host)
	return uint64(dev), uint64(host), abiStatus(st)
}

// hookPagedCascade runs a plan over contiguous tensors at fake addresses.
func hookPagedCascade(p *cascadeHookPlan, blockSize, maxBlocks, reserved int32) abiStatus {
	return hookPagedCascadeQ(p, blockSize, maxBlocks, reserved, 0)
}

// hookPagedCascadeQ is hookPagedCascade with q and out strides of qStride
// elements between rows (0: contiguous).
func hookPagedCascadeQ(p *cascadeHookPlan, blockSize, maxBlocks, reserved int32, qStride int64) abiStatus {
	D, qh, kvh := int64(p.p.head_dim), int64(p.p.num_q_heads), int64(p.p.num_kv_heads)
	a := C.kvp_paged_prefill_args{struct_size: C.size_t(unsafe.Sizeof(C.kvp_paged_prefill_args{})),
		num_blocks: 1 << 20, block_size: C.int32_t(blockSize), max_blocks_per_seq: C.int32_t(maxBlocks), reserved: C.int32_t(reserved),
		q: 0x10000, q_token_stride: C.int64_t(max(qh*D, qStride)), q_head_stride: C.int64_t(D),
		k_cache: 0x20000, v_cache: 0x30000,
		cache_block_stride: C.int64_t(int64(blockSize) * kvh * D), cache_token_stride: C.int64_t(kvh * D), cache_head_stride: C.int64_t(D),
		block_table: 0x40000, block_table_stride: C.int64_t(maxBlocks),
		out: 0x50000, out_token_stride: C.int64_t(qh * D), out_head_stride: C.int64_t(D)}
	return abiStatus(kvp_paged_cascade(&p.p, &a, 0))
}

// hookCascadePlanSized passes the args in a buffer larger than this
// library's struct, with struct_size = callerSize and the byte just past
// this library's size set to tail.
func hookCascadePlanSized(h *cascadeHookArgs, callerSize uintptr, tail byte) abiStatus {
	size := unsafe.Sizeof(C.kvp_cascade_plan_args{})
	buf := newStructBuf(size + 64)
	defer buf.free()
	a := h.c()
	a.struct_size = C.size_t(callerSize)
	*(*C.kvp_cascade_plan_args)(buf.p) = a
	buf.bytes()[size] = tail
	var p C.kvp_attn_plan
	p.struct_size = C.size_t(unsafe.Sizeof(p))
	return abiStatus(kvp_cascade_plan((*C.kvp_cascade_plan_args)(buf.p), &p, 0))
}
