package main

// Go-typed entry points over kvp_manager_cascade_plan, for capi's tests
// (test files cannot use cgo).

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/kvmanager"
)

// hookManagerHandle registers a core manager as a kvp_manager handle, so a
// test can build sharing through the Go API (prefix cache, forks) and plan
// through the ABI.
func hookManagerHandle(m *kvmanager.Manager) unsafe.Pointer { return newHandle(m) }

// hookManagerCascadePlan calls kvp_manager_cascade_plan with h's fields
// (host arrays included, so a test can check they are refused); nullArgs
// and nullPlan pass NULL for them. The plan struct starts as prev.
func hookManagerCascadePlan(m unsafe.Pointer, ids []int64, n int32, h *cascadeHookArgs, prev *cascadeHookPlan, nullArgs, nullPlan bool) (*cascadeHookPlan, abiStatus) {
	p := &cascadeHookPlan{}
	if prev != nil {
		*p = *prev
	} else {
		p.p.struct_size = C.size_t(unsafe.Sizeof(p.p))
	}
	a := h.c()
	ap, pp := &a, &p.p
	if nullArgs {
		ap = nil
	}
	if nullPlan {
		pp = nil
	}
	var idp *C.int64_t
	if len(ids) > 0 {
		idp = (*C.int64_t)(unsafe.Pointer(&ids[0]))
	}
	st := kvp_manager_cascade_plan((*C.kvp_manager)(m), idp, C.int32_t(n), ap, pp, 0)
	return p, abiStatus(st)
}

// hookCascadeSeen is what the replaced kvp_cascade_plan was given.
type hookCascadeSeen struct {
	calls                   int
	batch, blockSize, mbps  int32
	stride                  int64
	hostWS                  unsafe.Pointer
	workspace, seqLens      uint64
	tableNonNil, lensNonNil bool
}

// hookPlanDeviceWithoutDevice replaces the device planning that
// kvp_manager_cascade_plan delegates to (kvp_cascade_plan) with the same
// planning minus the device (the slot count is the default and nothing is
// copied; see hookPlanWithoutDevice), recording what it was given. The
// returned function restores kvp_cascade_plan.
func hookPlanDeviceWithoutDevice(seen *hookCascadeSeen) (restore func()) {
	old := cascadePlanDevice
	cascadePlanDevice = func(a *C.kvp_cascade_plan_args, plan *C.kvp_attn_plan, _ C.uint64_t) C.kvp_status {
		seen.calls++
		seen.batch, seen.blockSize, seen.mbps, seen.stride = int32(a.batch), int32(a.block_size), int32(a.max_blocks_per_seq), int64(a.block_table_stride)
		seen.hostWS, seen.workspace, seen.seqLens = a.host_workspace, uint64(a.workspace), uint64(a.seq_lens)
		seen.tableNonNil, seen.lensNonNil = a.block_table_host != nil, a.seq_lens_host != nil
		b := int(a.batch)
		h := cascadeHookArgs{dtype: int32(a.dtype), headDim: int32(a.head_dim), qHeads: int32(a.num_q_heads),
			kvHeads: int32(a.num_kv_heads), batch: int32(b), maxBatch: int32(max(int(a.max_batch), b, 1)),
			blockSize: int32(a.block_size), maxBlocks: int32(a.max_blocks_per_seq), stride: int64(a.block_table_stride),
			seqLensDev: uint64(a.seq_lens), hostBytes: uint64(a.host_workspace_bytes), workspace: uint64(a.workspace),
			workspaceBytes: uint64(a.workspace_bytes), flags: int32(a.flags), headroom: int32(a.headroom),
			qoDev: uint64(a.qo_indptr), maxTokens: int32(a.max_tokens), reserved: int32(a.reserved)}
		h.structSize = unsafe.Sizeof(*a)
		if a.qo_indptr_host != nil {
			h.qo = unsafe.Slice((*int32)(unsafe.Pointer(a.qo_indptr_host)), b+1)
		}
		if b > 0 {
			h.table = unsafe.Slice((*int32)(unsafe.Pointer(a.block_table_host)), int64(b-1)*h.stride+int64(h.maxBlocks))
			h.lens = unsafe.Slice((*int32)(unsafe.Pointer(a.seq_lens_host)), b)
		}
		h.host = hostWords(a.host_workspace, uint64(a.host_workspace_bytes))
		p, err := hookPlanWithoutDevice(&h)
		if err != nil {
			return fail(err)
		}
		*plan = p.p
		return C.KVP_OK
	}
	return func() { cascadePlanDevice = old }
}

// hookPlanSentinel is a plan struct with values no call writes (route 77,
// batch 99), to see that a failed call leaves it alone.
func hookPlanSentinel() *cascadeHookPlan {
	p := &cascadeHookPlan{}
	p.p.struct_size = C.size_t(unsafe.Sizeof(p.p))
	p.p.route, p.p.batch = 77, 99
	return p
}

// cascadePlanFields are a kvp_attn_plan's fields that a test compares.
type cascadePlanFields struct {
	Kind, Route, Batch, TotalQ, MaxQ, MaxKV, Items, Grid int32
	Workspace, WorkspaceBytes, KVLens                    uint64
	Reserved                                             [6]uint64
}

func (p *cascadeHookPlan) fields() cascadePlanFields {
	c := &p.p
	f := cascadePlanFields{Kind: int32(c.kind), Route: int32(c.route), Batch: int32(c.batch), TotalQ: int32(c.total_q),
		MaxQ: int32(c.max_q_len), MaxKV: int32(c.max_kv_len), Items: int32(c.num_items), Grid: int32(c.grid),
		Workspace: uint64(c.workspace), WorkspaceBytes: uint64(c.workspace_bytes), KVLens: uint64(c.kv_lens)}
	for i := range f.Reserved {
		f.Reserved[i] = uint64(c.reserved[i])
	}
	return f
}

const hookDefaultSlots = cascade.DefaultSlots
