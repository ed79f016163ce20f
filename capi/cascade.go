package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/cascadeattn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// Shared-prefix attention: core/cascadeattn plans, checks and runs; these
// exports translate kvp_cascade_plan_args and kvp_attn_plan (plan.go) to
// and from its types.

//export kvpgo_cascade_workspace_size
func kvpgo_cascade_workspace_size(maxBatch, qHeads, kvHeads, headDim C.int32_t, deviceBytes, hostBytes *C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	return cascadeWorkspaceSize("kvp_cascade_workspace_size", maxBatch, maxBatch, qHeads, kvHeads, headDim, deviceBytes, hostBytes)
}

//export kvpgo_cascade_prefill_workspace_size
func kvpgo_cascade_prefill_workspace_size(maxBatch, maxTokens, qHeads, kvHeads, headDim C.int32_t, deviceBytes, hostBytes *C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	return cascadeWorkspaceSize("kvp_cascade_prefill_workspace_size", maxBatch, maxTokens, qHeads, kvHeads, headDim, deviceBytes, hostBytes)
}

func cascadeWorkspaceSize(what string, maxBatch, maxTokens, qHeads, kvHeads, headDim C.int32_t, deviceBytes, hostBytes *C.uint64_t) C.kvp_status {
	if deviceBytes == nil || hostBytes == nil {
		return failf(kverr.NullPointer, "%s: device_bytes and host_bytes must not be NULL", what)
	}
	d, h, err := cascade.WorkspaceSizes(int(maxBatch), int(maxTokens), int(qHeads), int(kvHeads), int(headDim))
	if err != nil {
		return fail(err)
	}
	*deviceBytes, *hostBytes = C.uint64_t(d), C.uint64_t(h)
	return C.KVP_OK
}

// cascadePlanArgsOf decodes the caller's kvp_cascade_plan_args, after
// checking that plan's struct_size is one this library can write.
func cascadePlanArgsOf(what string, ca *C.kvp_cascade_plan_args, plan *C.kvp_attn_plan) (cascadeattn.PlanArgs, error) {
	var a C.kvp_cascade_plan_args
	if err := cascadePlanArgsStruct.in(unsafe.Pointer(ca), unsafe.Pointer(&a)); err != nil {
		return cascadeattn.PlanArgs{}, err
	}
	if err := attnPlanStruct.checkSize(plan.struct_size); err != nil {
		return cascadeattn.PlanArgs{}, err
	}
	if a.reserved != 0 {
		return cascadeattn.PlanArgs{}, kverr.Errorf(kverr.InvalidArgument, "%s: reserved must be 0", what)
	}
	return cascadeattn.PlanArgs{
		DType: attn.DType(a.dtype), HeadDim: int(a.head_dim), NumQHeads: int(a.num_q_heads), NumKVHeads: int(a.num_kv_heads),
		Batch: int(a.batch), MaxBatch: int(a.max_batch), MaxTokens: int(a.max_tokens), BlockSize: int(a.block_size),
		MaxBlocksPerSeq: int(a.max_blocks_per_seq), BlockTableStride: int64(a.block_table_stride),
		BlockTableHost: (*int32)(unsafe.Pointer(a.block_table_host)), SeqLensHost: (*int32)(unsafe.Pointer(a.seq_lens_host)),
		QOIndptrHost: (*int32)(unsafe.Pointer(a.qo_indptr_host)),
		SeqLens:      cuda.DevicePtr(a.seq_lens), QOIndptr: cuda.DevicePtr(a.qo_indptr),
		HostWorkspace: a.host_workspace, HostWorkspaceBytes: uint64(a.host_workspace_bytes),
		Workspace: cuda.DevicePtr(a.workspace), WorkspaceBytes: uint64(a.workspace_bytes),
		Flags: int(a.flags), Headroom: int(a.headroom),
	}, nil
}

// writeCascadePlan encodes a cascade plan into the caller's kvp_attn_plan.
func writeCascadePlan(plan *C.kvp_attn_plan, p *cascadeattn.Plan) error {
	return writeAttnPlan(plan, &p.PrefillPlan, p.PlanState())
}

// readCascadePlan decodes a kvp_attn_plan into a cascade plan (its kind and
// state are cascadeattn's to check).
func readCascadePlan(what string, plan *C.kvp_attn_plan) (cascadeattn.Plan, error) {
	pp, state, err := readAttnPlan(what, plan)
	p := cascadeattn.Plan{PrefillPlan: pp}
	p.SetPlanState(&state)
	return p, err
}

//export kvpgo_cascade_plan
func kvpgo_cascade_plan(ca *C.kvp_cascade_plan_args, plan *C.kvp_attn_plan, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	const what = "kvp_cascade_plan"
	if ca == nil || plan == nil {
		return failf(kverr.NullPointer, "%s: args and plan must not be NULL", what)
	}
	a, err := cascadePlanArgsOf(what, ca, plan)
	if err != nil {
		return fail(err)
	}
	p, err := cascadeattn.PlanBatch(&a, cuda.Stream(stream))
	if err != nil {
		return fail(err)
	}
	return fail(writeCascadePlan(plan, &p))
}

//export kvpgo_cascade_update
func kvpgo_cascade_update(plan *C.kvp_attn_plan, seqLens *C.int32_t, batch C.int32_t, fits *C.int32_t) (st C.kvp_status) {
	defer guard(&st)
	const what = "kvp_cascade_update"
	if plan == nil || fits == nil || (seqLens == nil && batch > 0) {
		return failf(kverr.NullPointer, "%s: plan, seq_lens_host and fits must not be NULL", what)
	}
	p, err := readCascadePlan(what, plan)
	if err != nil {
		return fail(err)
	}
	ok, err := cascadeattn.Update(&p, (*int32)(unsafe.Pointer(seqLens)), int(batch))
	if err != nil {
		return fail(err)
	}
	*fits = 0
	if ok {
		*fits = 1
	}
	return C.KVP_OK
}

//export kvpgo_paged_cascade
func kvpgo_paged_cascade(plan *C.kvp_attn_plan, a *C.kvp_paged_prefill_args, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	pp, state, r, err := planRunOf("kvp_paged_cascade", plan, a)
	if err != nil {
		return fail(err)
	}
	p := cascadeattn.Plan{PrefillPlan: pp}
	p.SetPlanState(&state)
	return fail(cascadeattn.Run(&p, &r, cuda.Stream(stream)))
}
