package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"math"
	"sync"
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/limits"
)

// Shared-prefix attention: core/attn plans, checks and runs (with
// core/cascade's host planner); these exports translate
// kvp_cascade_plan_args and kvp_attn_plan (plan.go) to and from its types,
// one call into core/attn each: the host arrays and the host workspace
// become slices here, and the plan's state words are packed and unpacked
// here. kvp_manager_cascade_plan (below) plans a kvp_manager's own tables.

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

// cascadePlanArgsIn reads the caller's kvp_cascade_plan_args, after
// checking that plan's struct_size is one this library can write.
func cascadePlanArgsIn(what string, ca *C.kvp_cascade_plan_args, plan *C.kvp_attn_plan) (C.kvp_cascade_plan_args, error) {
	var a C.kvp_cascade_plan_args
	if err := cascadePlanArgsStruct.in(unsafe.Pointer(ca), unsafe.Pointer(&a)); err != nil {
		return a, err
	}
	if err := attnPlanStruct.checkSize(plan.struct_size); err != nil {
		return a, err
	}
	if a.reserved != 0 {
		return a, kverr.Errorf(kverr.InvalidArgument, "%s: reserved must be 0", what)
	}
	return a, nil
}

// cascadePlanArgsOf is a's batch of batch sequences (in [0,
// KVP_MAX_ATTN_BATCH]) as core/attn takes it: the counts checked, the host
// arrays and the host workspace as slices (nil where NULL; the block table
// nil too where its extent is not one the core accepts, which it then
// refuses).
func cascadePlanArgsOf(what string, a *C.kvp_cascade_plan_args, batch int) (attn.CascadePlanArgs, error) {
	hostBytes, wsBytes := uint64(a.host_workspace_bytes), uint64(a.workspace_bytes)
	if hostBytes > limits.Bytes || wsBytes > limits.Bytes { // named only on failure
		_, err := limits.ByteCount(what+": host_workspace_bytes", hostBytes)
		if err == nil {
			_, err = limits.ByteCount(what+": workspace_bytes", wsBytes)
		}
		return attn.CascadePlanArgs{}, err
	}
	r := attn.CascadePlanArgs{
		DType: attn.DType(a.dtype), HeadDim: int(a.head_dim), NumQHeads: int(a.num_q_heads), NumKVHeads: int(a.num_kv_heads),
		MaxBatch: int(a.max_batch), MaxTokens: int(a.max_tokens), BlockSize: int(a.block_size),
		MaxBlocksPerSeq: int(a.max_blocks_per_seq), BlockTableStride: int64(a.block_table_stride),
		SeqLensDev: cuda.DevicePtr(a.seq_lens), QOIndptrDev: cuda.DevicePtr(a.qo_indptr),
		Workspace: cuda.DevicePtr(a.workspace), WorkspaceBytes: int64(wsBytes),
		Flags: int(a.flags), Headroom: int(a.headroom),
	}
	stride, cols := int64(a.block_table_stride), int64(a.max_blocks_per_seq)
	if stride == 0 {
		stride = cols
	}
	var err error
	if batch > 0 && cols >= 1 && cols <= stride && stride <= math.MaxInt32 {
		n := int64(batch-1)*stride + cols
		if n > maxHostView/4 {
			return attn.CascadePlanArgs{}, kverr.Errorf(kverr.InvalidArgument,
				"%s: a block table of %d rows %d entries apart spans %d entries, above 2^38", what, batch, stride, n)
		}
		if r.BlockTable, err = view[int32](what, "block_table_host", unsafe.Pointer(a.block_table_host), n); err != nil {
			return attn.CascadePlanArgs{}, err
		}
	}
	if r.SeqLens, err = view[int32](what, "seq_lens_host", unsafe.Pointer(a.seq_lens_host), int64(batch)); err != nil {
		return attn.CascadePlanArgs{}, err
	}
	if r.QOIndptr, err = view[int32](what, "qo_indptr_host", unsafe.Pointer(a.qo_indptr_host), int64(batch)+1); err != nil {
		return attn.CascadePlanArgs{}, err
	}
	r.HostWorkspace = hostView(a.host_workspace, hostBytes)
	return r, nil
}

// writeCascadePlan encodes a cascade plan into the caller's kvp_attn_plan.
func writeCascadePlan(plan *C.kvp_attn_plan, p *attn.CascadePlan) error {
	return writeAttnPlan(plan, &p.PrefillPlan, cascadeStateWords(&p.CascadeState))
}

// cascadeStateWords packs a cascade plan's state into kvp_attn_plan's
// plan-state words (KVP_PLAN_STATE_HOST_WORKSPACE and on).
func cascadeStateWords(s *attn.CascadeState) [6]uint64 {
	var w [6]uint64
	w[C.KVP_PLAN_STATE_HOST_WORKSPACE] = uint64(uintptr(unsafe.Pointer(unsafe.SliceData(s.HostWorkspace))))
	w[C.KVP_PLAN_STATE_HOST_WORKSPACE_BYTES] = uint64(len(s.HostWorkspace))
	w[C.KVP_PLAN_STATE_CAPACITY] = uint64(uint32(s.MaxBatch)) | uint64(uint32(s.BlockSize))<<32
	w[C.KVP_PLAN_STATE_GENERATION] = uint64(uint32(s.Parts)) | uint64(uint32(s.Gen))<<32
	w[C.KVP_PLAN_STATE_SAVED_TOKENS], w[C.KVP_PLAN_STATE_TOTAL_TOKENS] = uint64(s.SavedTokens), uint64(s.TotalTokens)
	return w
}

// cascadeStateOf unpacks plan-state words that cascadeStateWords packed.
// The host workspace they name is viewed for a plan of the cascade kind
// only: another plan's words are not an address (core/attn refuses the
// kind).
func cascadeStateOf(kind int, w *[6]uint64) attn.CascadeState {
	s := attn.CascadeState{
		MaxBatch: int(uint32(w[C.KVP_PLAN_STATE_CAPACITY])), BlockSize: int(uint32(w[C.KVP_PLAN_STATE_CAPACITY] >> 32)),
		Parts: int(uint32(w[C.KVP_PLAN_STATE_GENERATION])), Gen: int32(uint32(w[C.KVP_PLAN_STATE_GENERATION] >> 32)),
		SavedTokens: int64(w[C.KVP_PLAN_STATE_SAVED_TOKENS]), TotalTokens: int64(w[C.KVP_PLAN_STATE_TOTAL_TOKENS]),
	}
	// The address word read as a pointer (64-bit targets only).
	host := *(*unsafe.Pointer)(unsafe.Pointer(&w[C.KVP_PLAN_STATE_HOST_WORKSPACE]))
	if n := w[C.KVP_PLAN_STATE_HOST_WORKSPACE_BYTES]; kind == attn.KindCascade && n <= limits.Bytes {
		s.HostWorkspace = hostView(host, n)
	}
	return s
}

// readCascadePlan decodes a kvp_attn_plan into a cascade plan (its kind and
// state are core/attn's to check).
func readCascadePlan(what string, plan *C.kvp_attn_plan) (attn.CascadePlan, error) {
	pp, w, err := readAttnPlan(what, plan)
	return attn.CascadePlan{PrefillPlan: pp, CascadeState: cascadeStateOf(pp.Kind, &w)}, err
}

//export kvpgo_cascade_plan
func kvpgo_cascade_plan(ca *C.kvp_cascade_plan_args, plan *C.kvp_attn_plan, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	const what = "kvp_cascade_plan"
	if ca == nil || plan == nil {
		return failf(kverr.NullPointer, "%s: args and plan must not be NULL", what)
	}
	c, err := cascadePlanArgsIn(what, ca, plan)
	if err != nil {
		return fail(err)
	}
	if c.batch < 0 || c.batch > limits.AttnBatch {
		return fail(limits.Range(what+": batch", int(c.batch), 0, limits.AttnBatch))
	}
	if c.batch > 0 && (c.block_table_host == nil || c.seq_lens_host == nil) {
		return failf(kverr.NullPointer, "%s: block_table_host and seq_lens_host must not be NULL", what)
	}
	a, err := cascadePlanArgsOf(what, &c, int(c.batch))
	if err != nil {
		return fail(err)
	}
	p, err := attn.PlanCascade(&a, cuda.Stream(stream))
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
	if batch < 0 {
		return failf(kverr.InvalidArgument, "%s: batch must be >= 0: got %d", what, int32(batch))
	}
	p, err := readCascadePlan(what, plan)
	if err != nil {
		return fail(err)
	}
	lens, err := view[int32](what, "seq_lens_host", unsafe.Pointer(seqLens), int64(batch))
	if err != nil {
		return fail(err)
	}
	if lens == nil {
		lens = []int32{}
	}
	ok, err := attn.UpdateCascade(&p, lens)
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
	pp, w, r, err := planRunOf("kvp_paged_cascade", plan, a)
	if err != nil {
		return fail(err)
	}
	p := attn.CascadePlan{PrefillPlan: pp, CascadeState: cascadeStateOf(pp.Kind, &w)}
	return fail(attn.PagedCascade(&p, &r, cuda.Stream(stream)))
}

// Shared-prefix planning from a kvp_manager's own block tables: the
// manager gathers the batch's tables and lengths (under its lock, which it
// holds only while it copies them), then core/attn plans them
// (attn.PlanCascadeInput).

// cascadeGathers are the gather memory of kvp_manager_cascade_plan, pooled
// so that a step allocates nothing once the pool has grown to it.
var cascadeGathers = sync.Pool{New: func() any { return new(kvmanager.CascadeScratch) }}

//export kvpgo_manager_cascade_plan
func kvpgo_manager_cascade_plan(h *C.kvp_manager, ids *C.int64_t, n C.int32_t, ca *C.kvp_cascade_plan_args,
	plan *C.kvp_attn_plan, stream C.uint64_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		const what = "kvp_manager_cascade_plan"
		if ca == nil || plan == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: args and plan must not be NULL", what)
		}
		c, err := cascadePlanArgsIn(what, ca, plan)
		if err != nil {
			return err
		}
		if n < 0 || n > limits.AttnBatch {
			return limits.Range(what+": n", int(n), 0, limits.AttnBatch)
		}
		if n > 0 && ids == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: seq_ids must not be NULL", what)
		}
		// The tables and lengths are the manager's: host arrays given here
		// would be ignored, so they are refused instead.
		if c.block_table_host != nil || c.seq_lens_host != nil {
			return kverr.Errorf(kverr.InvalidArgument, "%s: block_table_host and seq_lens_host must be NULL (the tables and lengths are the manager's)", what)
		}
		if c.batch != 0 && c.batch != n {
			return kverr.Errorf(kverr.InvalidArgument, "%s: args->batch is %d for %d seq_ids (0 means n)", what, int32(c.batch), int32(n))
		}
		a, err := cascadePlanArgsOf(what, &c, int(n))
		if err != nil {
			return err
		}
		var idv []int64
		if n > 0 {
			idv = unsafe.Slice((*int64)(unsafe.Pointer(ids)), int(n))
		}
		sc := cascadeGathers.Get().(*kvmanager.CascadeScratch)
		defer cascadeGathers.Put(sc)
		var in cascade.Input
		if err := m.CascadeInput(idv, a.MaxBlocksPerSeq, &in, sc); err != nil {
			return kverr.Wrap(kverr.CodeOf(err), err, "%s", what)
		}
		p, err := attn.PlanCascadeInput(&a, &in, cuda.Stream(stream))
		if err != nil {
			return err
		}
		return writeCascadePlan(plan, &p)
	})
}
