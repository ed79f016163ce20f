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
)

// kvp_attn_plan and kvp_paged_prefill_args serve both planners of
// core/attn, the prefill one and the shared-prefix one: one translation of
// each, here.

// writeAttnPlan encodes plan p, with the plan-state words of a cascade plan
// (zero for a prefill plan), into the caller's kvp_attn_plan.
func writeAttnPlan(plan *C.kvp_attn_plan, p *attn.PrefillPlan, state [6]uint64) error {
	out := C.kvp_attn_plan{
		kind: C.int32_t(p.Kind), route: C.int32_t(p.Route),
		dtype: C.int32_t(p.DType), head_dim: C.int32_t(p.HeadDim),
		num_q_heads: C.int32_t(p.NumQHeads), num_kv_heads: C.int32_t(p.NumKVHeads), window_left: C.int32_t(p.WindowLeft),
		batch: C.int32_t(p.Batch), total_q: C.int32_t(p.TotalQ), max_q_len: C.int32_t(p.MaxQLen), max_kv_len: C.int32_t(p.MaxKVLen),
		num_items: C.int32_t(p.NumItems), grid: C.int32_t(p.Grid), num_splits: C.int32_t(p.NumSplits),
		workspace: C.uint64_t(p.Workspace), workspace_bytes: C.uint64_t(p.WorkspaceBytes), kv_lens: C.uint64_t(p.KVLens),
	}
	for i, w := range state {
		out.state[i] = C.uint64_t(w)
	}
	return attnPlanStruct.out(unsafe.Pointer(plan), unsafe.Pointer(&out))
}

// readAttnPlan decodes the caller's kvp_attn_plan: the plan's fields and its
// plan-state words.
func readAttnPlan(what string, plan *C.kvp_attn_plan) (attn.PrefillPlan, [6]uint64, error) {
	var c C.kvp_attn_plan
	var state [6]uint64
	if err := attnPlanStruct.in(unsafe.Pointer(plan), unsafe.Pointer(&c)); err != nil {
		return attn.PrefillPlan{}, state, err
	}
	wsBytes := uint64(c.workspace_bytes)
	if wsBytes > limits.Bytes { // named only on failure
		_, err := limits.ByteCount(what+": plan workspace_bytes", wsBytes)
		return attn.PrefillPlan{}, state, err
	}
	for i, w := range c.state {
		state[i] = uint64(w)
	}
	return attn.PrefillPlan{
		Kind: int(c.kind), Route: int(c.route),
		PrefillShape: attn.PrefillShape{DType: attn.DType(c.dtype), HeadDim: int(c.head_dim),
			NumQHeads: int(c.num_q_heads), NumKVHeads: int(c.num_kv_heads), WindowLeft: int(c.window_left)},
		Batch: int(c.batch), TotalQ: int(c.total_q), MaxQLen: int(c.max_q_len), MaxKVLen: int(c.max_kv_len),
		NumItems: int(c.num_items), Grid: int(c.grid), NumSplits: int(c.num_splits),
		Workspace: cuda.DevicePtr(c.workspace), WorkspaceBytes: int64(wsBytes), KVLens: cuda.DevicePtr(c.kv_lens),
	}, state, nil
}

// planRunOf decodes a run's arguments: the caller's kvp_attn_plan and the
// layer's kvp_paged_prefill_args.
func planRunOf(what string, plan *C.kvp_attn_plan, a *C.kvp_paged_prefill_args) (attn.PrefillPlan, [6]uint64, attn.PagedPrefillArgs, error) {
	if plan == nil || a == nil {
		return attn.PrefillPlan{}, [6]uint64{}, attn.PagedPrefillArgs{}, kverr.Errorf(kverr.NullPointer, "%s: plan and args must not be NULL", what)
	}
	p, state, err := readAttnPlan(what, plan)
	if err != nil {
		return p, state, attn.PagedPrefillArgs{}, err
	}
	r, err := pagedPrefillArgsOf(what, a, &p)
	return p, state, r, err
}

// pagedPrefillArgsOf decodes the caller's kvp_paged_prefill_args for a run
// of plan p, whose dtype, kv heads and head_dim a descriptor must match.
func pagedPrefillArgsOf(what string, a *C.kvp_paged_prefill_args, p *attn.PrefillPlan) (attn.PagedPrefillArgs, error) {
	var c C.kvp_paged_prefill_args
	if err := pagedPrefillArgsStruct.in(unsafe.Pointer(a), unsafe.Pointer(&c)); err != nil {
		return attn.PagedPrefillArgs{}, err
	}
	if c.reserved != 0 || c.reserved2 != 0 {
		return attn.PagedPrefillArgs{}, kverr.Errorf(kverr.InvalidArgument, "%s: reserved fields must be 0", what)
	}
	own := ownKV(c.num_blocks, c.block_size, c.max_blocks_per_seq, c.cache_block_stride, c.cache_token_stride,
		c.cache_head_stride, c.block_table_stride, c.k_cache, c.v_cache, c.block_table)
	kv, _, err := pagedKVOf(what, c.kv, own, kvShape{int32(p.DType), int32(p.NumKVHeads), int32(p.HeadDim)})
	if err != nil {
		return attn.PagedPrefillArgs{}, err
	}
	return attn.PagedPrefillArgs{
		PrefillLayout: attn.PrefillLayout{
			QTokenStride: int64(c.q_token_stride), QHeadStride: int64(c.q_head_stride),
			OutTokenStride: int64(c.out_token_stride), OutHeadStride: int64(c.out_head_stride),
			PagedKV: kv,
			Scale:   float32(c.scale),
		},
		Q: cuda.DevicePtr(c.q), Out: cuda.DevicePtr(c.out), LSE: cuda.DevicePtr(c.lse),
		Sinks: cuda.DevicePtr(c.sinks),
	}, nil
}
