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

// The launch exports translate the args struct into core/attn's on the
// stack and call it: no allocation on success, and the caller's C thread
// (pinned for the call) is the one whose current CUDA context is used.

//export kvpgo_cuda_available
func kvpgo_cuda_available(out *C.int32_t) (st C.kvp_status) {
	defer guard(&st)
	if out == nil {
		return failf(kverr.NullPointer, "kvp_cuda_available: out must not be NULL")
	}
	*out = 0
	if cuda.Available() {
		*out = 1
	}
	return C.KVP_OK
}

//export kvpgo_attn_prepare
func kvpgo_attn_prepare() (st C.kvp_status) {
	defer guard(&st)
	return fail(attn.Prepare())
}

//export kvpgo_attn_workspace_size
func kvpgo_attn_workspace_size(maxBatch, qHeads, headDim, maxSplits C.int32_t, out *C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	if out == nil {
		return failf(kverr.NullPointer, "kvp_attn_workspace_size: out_bytes must not be NULL")
	}
	n, err := attn.WorkspaceSize(int(maxBatch), int(qHeads), int(headDim), int(maxSplits))
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(n)
	return C.KVP_OK
}

//export kvpgo_attn_num_splits
func kvpgo_attn_num_splits(dtype, headDim, batch, qHeads, kvHeads, maxSeqLen C.int32_t, out *C.int32_t) (st C.kvp_status) {
	defer guard(&st)
	if out == nil {
		return failf(kverr.NullPointer, "kvp_attn_num_splits: out must not be NULL")
	}
	n, err := attn.NumSplits(attn.DType(dtype), int(headDim), int(batch), int(qHeads), int(kvHeads), int(maxSeqLen))
	if err != nil {
		return fail(err)
	}
	*out = C.int32_t(n)
	return C.KVP_OK
}

//export kvpgo_kv_write
func kvpgo_kv_write(a *C.kvp_kv_write_args, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	if a == nil {
		return failf(kverr.NullPointer, "kvp_kv_write: args must not be NULL")
	}
	w, err := kvWriteArgsOf(a)
	if err != nil {
		return fail(err)
	}
	return fail(attn.KVWrite(&w, cuda.Stream(stream)))
}

// kvWriteArgsOf decodes the caller's kvp_kv_write_args.
func kvWriteArgsOf(p *C.kvp_kv_write_args) (attn.KVWriteArgs, error) {
	var a C.kvp_kv_write_args
	if err := kvWriteArgsStruct.in(unsafe.Pointer(p), unsafe.Pointer(&a)); err != nil {
		return attn.KVWriteArgs{}, err
	}
	own := ownKV(a.num_blocks, a.block_size, 0, a.cache_block_stride, a.cache_token_stride,
		a.cache_head_stride, 0, a.k_cache, a.v_cache, 0)
	kv, shape, err := pagedKVOf("kvp_kv_write", a.kv, own, kvShape{int32(a.dtype), int32(a.num_kv_heads), int32(a.head_dim)})
	if err != nil {
		return attn.KVWriteArgs{}, err
	}
	// The write reads no table: a descriptor's table is its attention
	// calls', let through unused.
	kv.MaxBlocksPerSeq, kv.BlockTableStride, kv.BlockTable = 0, 0, 0
	return attn.KVWriteArgs{
		KVWriteLayout: attn.KVWriteLayout{
			DType: attn.DType(shape.dtype), HeadDim: int(a.head_dim),
			NumTokens: int(a.num_tokens), NumKVHeads: int(shape.kvHeads),
			KeyTokenStride: int64(a.key_token_stride), KeyHeadStride: int64(a.key_head_stride),
			ValueTokenStride: int64(a.value_token_stride), ValueHeadStride: int64(a.value_head_stride),
			PagedKV: kv,
		},
		Key: cuda.DevicePtr(a.key), Value: cuda.DevicePtr(a.value),
		SlotMapping: cuda.DevicePtr(a.slot_mapping),
	}, nil
}

//export kvpgo_paged_decode
func kvpgo_paged_decode(a *C.kvp_paged_decode_args, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	if a == nil {
		return failf(kverr.NullPointer, "kvp_paged_decode: args must not be NULL")
	}
	d, err := pagedDecodeArgsOf(a)
	if err != nil {
		return fail(err)
	}
	return fail(attn.PagedDecode(&d, cuda.Stream(stream)))
}

// pagedDecodeArgsOf decodes the caller's kvp_paged_decode_args.
func pagedDecodeArgsOf(p *C.kvp_paged_decode_args) (attn.PagedDecodeArgs, error) {
	var a C.kvp_paged_decode_args
	if err := pagedDecodeArgsStruct.in(unsafe.Pointer(p), unsafe.Pointer(&a)); err != nil {
		return attn.PagedDecodeArgs{}, err
	}
	wsBytes, err := limits.ByteCount("kvp_paged_decode: workspace_bytes", uint64(a.workspace_bytes))
	if err != nil {
		return attn.PagedDecodeArgs{}, err
	}
	if a.reserved != 0 {
		return attn.PagedDecodeArgs{}, kverr.Errorf(kverr.InvalidArgument, "kvp_paged_decode: reserved must be 0: got %d", int32(a.reserved))
	}
	own := ownKV(a.num_blocks, a.block_size, a.max_blocks_per_seq, a.cache_block_stride, a.cache_token_stride,
		a.cache_head_stride, a.block_table_stride, a.k_cache, a.v_cache, a.block_table)
	kv, shape, err := pagedKVOf("kvp_paged_decode", a.kv, own, kvShape{int32(a.dtype), int32(a.num_kv_heads), int32(a.head_dim)})
	if err != nil {
		return attn.PagedDecodeArgs{}, err
	}
	return attn.PagedDecodeArgs{
		DecodeLayout: attn.DecodeLayout{
			DType: attn.DType(shape.dtype), HeadDim: int(a.head_dim), Batch: int(a.batch),
			NumQHeads: int(a.num_q_heads), NumKVHeads: int(shape.kvHeads),
			QBatchStride: int64(a.q_batch_stride), QHeadStride: int64(a.q_head_stride),
			OutBatchStride: int64(a.out_batch_stride), OutHeadStride: int64(a.out_head_stride),
			PagedKV: kv,
			Scale:   float32(a.scale), QLen: int(a.q_len),
		},
		Q: cuda.DevicePtr(a.q), SeqLens: cuda.DevicePtr(a.seq_lens),
		Out: cuda.DevicePtr(a.out), LSE: cuda.DevicePtr(a.lse), Sinks: cuda.DevicePtr(a.sinks),
		Workspace: cuda.DevicePtr(a.workspace), WorkspaceBytes: wsBytes,
		NumSplits: int(a.num_splits), MaxSeqLen: int(a.max_seq_len), WindowSize: int(a.window_size),
	}, nil
}

//export kvpgo_merge_states
func kvpgo_merge_states(a *C.kvp_merge_states_args, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	if a == nil {
		return failf(kverr.NullPointer, "kvp_merge_states: args must not be NULL")
	}
	var args C.kvp_merge_states_args
	if err := mergeStatesArgsStruct.in(unsafe.Pointer(a), unsafe.Pointer(&args)); err != nil {
		return fail(err)
	}
	a = &args
	if a.reserved != 0 {
		return failf(kverr.InvalidArgument, "kvp_merge_states: reserved must be 0: got %d", int32(a.reserved))
	}
	m := attn.MergeArgs{
		MergeLayout: attn.MergeLayout{
			DType: attn.DType(a.dtype), HeadDim: int(a.head_dim), NumStates: int(a.num_states),
			NumTokens: int(a.num_tokens), NumHeads: int(a.num_heads),
			VTokenStride: int64(a.v_token_stride), VHeadStride: int64(a.v_head_stride),
			STokenStride: int64(a.s_token_stride), SHeadStride: int64(a.s_head_stride),
			OutTokenStride: int64(a.out_token_stride), OutHeadStride: int64(a.out_head_stride),
			OutLSETokenStride: int64(a.out_lse_token_stride), OutLSEHeadStride: int64(a.out_lse_head_stride),
		},
		Out: cuda.DevicePtr(a.out), OutLSE: cuda.DevicePtr(a.out_lse),
	}
	for i := 0; i < attn.MaxMergeStates; i++ {
		m.V[i], m.S[i] = cuda.DevicePtr(a.v[i]), cuda.DevicePtr(a.s[i])
	}
	return fail(attn.MergeStates(&m, cuda.Stream(stream)))
}

//export kvpgo_prefill_workspace_size
func kvpgo_prefill_workspace_size(maxBatch, maxTokens, qHeads, kvHeads, headDim C.int32_t, out *C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	if out == nil {
		return failf(kverr.NullPointer, "kvp_prefill_workspace_size: out_bytes must not be NULL")
	}
	n, err := attn.PrefillWorkspaceSize(int(maxBatch), int(maxTokens), int(qHeads), int(kvHeads), int(headDim))
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(n)
	return C.KVP_OK
}

//export kvpgo_prefill_plan
func kvpgo_prefill_plan(a *C.kvp_prefill_plan_args, plan *C.kvp_attn_plan, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	if a == nil || plan == nil {
		return failf(kverr.NullPointer, "kvp_prefill_plan: args and plan must not be NULL")
	}
	var args C.kvp_prefill_plan_args
	if err := prefillPlanArgsStruct.in(unsafe.Pointer(a), unsafe.Pointer(&args)); err != nil {
		return fail(err)
	}
	a = &args
	if err := attnPlanStruct.checkSize(plan.struct_size); err != nil {
		return fail(err)
	}
	if a.reserved != 0 {
		return failf(kverr.InvalidArgument, "kvp_prefill_plan: reserved must be 0: got %d", int32(a.reserved))
	}
	if a.window_size < 0 {
		return failf(kverr.InvalidArgument, "kvp_prefill_plan: window_size must be 0 (no window) or positive: got %d", int32(a.window_size))
	}
	if err := limits.Range("kvp_prefill_plan: batch", int(a.batch), 0, limits.AttnBatch); err != nil {
		return fail(err)
	}
	wsBytes, err := limits.ByteCount("kvp_prefill_plan: workspace_bytes", uint64(a.workspace_bytes))
	if err != nil {
		return fail(err)
	}
	if a.qo_indptr_host == nil || (a.batch > 0 && a.kv_lens_host == nil) {
		return failf(kverr.NullPointer, "kvp_prefill_plan: qo_indptr_host and kv_lens_host must not be NULL")
	}
	qo, err := view[int32]("kvp_prefill_plan", "qo_indptr_host", unsafe.Pointer(a.qo_indptr_host), int64(a.batch)+1)
	if err != nil {
		return fail(err)
	}
	kv, err := view[int32]("kvp_prefill_plan", "kv_lens_host", unsafe.Pointer(a.kv_lens_host), int64(a.batch))
	if err != nil {
		return fail(err)
	}
	if kv == nil {
		kv = []int32{}
	}
	p, err := attn.PlanPrefill(&attn.PrefillPlanArgs{
		PrefillShape: attn.PrefillShape{DType: attn.DType(a.dtype), HeadDim: int(a.head_dim),
			NumQHeads: int(a.num_q_heads), NumKVHeads: int(a.num_kv_heads), WindowLeft: int(a.window_size) - 1},
		QOIndptr: qo, KVLens: kv,
		QOIndptrDev: cuda.DevicePtr(a.qo_indptr), KVLensDev: cuda.DevicePtr(a.kv_lens),
		Workspace: cuda.DevicePtr(a.workspace), WorkspaceBytes: wsBytes,
		Flags: int(a.flags),
	}, cuda.Stream(stream))
	if err != nil {
		return fail(err)
	}
	return fail(writeAttnPlan(plan, &p, p.PlanState()))
}

//export kvpgo_paged_prefill
func kvpgo_paged_prefill(plan *C.kvp_attn_plan, a *C.kvp_paged_prefill_args, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	p, state, r, err := planRunOf("kvp_paged_prefill", plan, a)
	if err != nil {
		return fail(err)
	}
	p.SetPlanState(&state)
	return fail(attn.PagedPrefill(&p, &r, cuda.Stream(stream)))
}
