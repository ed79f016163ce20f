package main

/*
#include "kvplug.h"
#include "glue.h"
*/
import "C"

import (
	"runtime"
	"strings"
	"sync"
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
)

// Shared-prefix planning from a kvp_manager's own block tables: the
// manager gathers the batch (core/kvmanager.CascadeInput) and the plan is
// made by kvp_cascade_plan itself over the gathered arrays, so both calls
// check the same arguments and write the same plan; or, with no
// workspaces, by a host planner for the summary alone.

// cascadeManagerScratch is one call's gather memory and host planner,
// pooled so that a step allocates nothing once the pool has grown to it.
type cascadeManagerScratch struct {
	sc kvmanager.CascadeScratch
	hp cascade.HostPlanner
}

var cascadeManagerScratches = sync.Pool{New: func() any { return new(cascadeManagerScratch) }}

// cascadePlanDevice is kvp_cascade_plan; tests without a device replace it
// (cascade_manager_testhooks.go).
var cascadePlanDevice = func(a *C.kvp_cascade_plan_args, plan *C.kvp_attn_plan, stream C.uint64_t) C.kvp_status {
	return kvp_cascade_plan(a, plan, stream)
}

//export kvp_manager_cascade_plan
func kvp_manager_cascade_plan(h *C.kvp_manager, ids *C.int64_t, n C.int32_t, ca *C.kvp_cascade_plan_args,
	plan *C.kvp_attn_plan, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	const what = "kvp_manager_cascade_plan"
	m, err := managerOf(h)
	if err != nil {
		return fail(err)
	}
	if ca == nil || plan == nil {
		return failf(kverr.NullPointer, "%s: args and plan must not be NULL", what)
	}
	if n < 0 || n > 65535 {
		return failf(kverr.InvalidArgument, "%s: n must be in [0, 65535]: got %d", what, int32(n))
	}
	if n > 0 && ids == nil {
		return failf(kverr.NullPointer, "%s: seq_ids must not be NULL", what)
	}
	var a C.kvp_cascade_plan_args
	if err := cascadePlanArgsStruct.in(unsafe.Pointer(ca), unsafe.Pointer(&a)); err != nil {
		return fail(err)
	}
	if err := attnPlanStruct.checkSize(plan.struct_size); err != nil {
		return fail(err)
	}
	// The tables and lengths are the manager's: host arrays given here
	// would be ignored, so they are refused instead.
	if a.block_table_host != nil || a.seq_lens_host != nil {
		return failf(kverr.InvalidArgument, "%s: block_table_host and seq_lens_host must be NULL (the tables and lengths are the manager's)", what)
	}
	if a.batch != 0 && a.batch != C.int32_t(n) {
		return failf(kverr.InvalidArgument, "%s: args->batch is %d for %d seq_ids (0 means n)", what, int32(a.batch), int32(n))
	}
	bs := m.BlockSize()
	if a.block_size != 0 && int(a.block_size) != bs {
		return failf(kverr.InvalidArgument, "%s: args->block_size is %d; the manager's blocks hold %d tokens (0 means the manager's)", what, int32(a.block_size), bs)
	}
	if a.max_blocks_per_seq < 1 {
		return failf(kverr.InvalidArgument, "%s: max_blocks_per_seq (the device block table's columns) must be >= 1: got %d", what, int32(a.max_blocks_per_seq))
	}
	hostOnly := a.workspace == 0 && a.host_workspace == nil
	if hostOnly {
		// Checked before the gather, as kvp_cascade_plan checks them.
		if dt := attn.DType(a.dtype); dt != attn.F16 && dt != attn.BF16 {
			return failf(kverr.Unsupported, "%s: dtype must be KVP_DTYPE_F16 or KVP_DTYPE_BF16: got %d", what, int32(a.dtype))
		}
		if a.flags&^C.KVP_CASCADE_NO_DECODE_ROUTE != 0 {
			return failf(kverr.InvalidArgument, "%s: unknown flags %#x", what, int32(a.flags))
		}
		if a.reserved != 0 {
			return failf(kverr.InvalidArgument, "%s: reserved must be 0", what)
		}
		// Fields appended to the struct after reserved are for
		// kvp_cascade_plan, which the device path hands them to; this host
		// planner knows none of them, so a set one is refused rather than
		// ignored.
		end := unsafe.Offsetof(a.reserved) + unsafe.Sizeof(a.reserved)
		for i, b := range unsafe.Slice((*byte)(unsafe.Pointer(&a)), unsafe.Sizeof(a))[end:] {
			if b != 0 {
				return failf(kverr.InvalidArgument, "%s: a host-only plan reads no field after reserved; byte %d of the args is set", what, end+uintptr(i))
			}
		}
	}

	scr := cascadeManagerScratches.Get().(*cascadeManagerScratch)
	defer cascadeManagerScratches.Put(scr)
	in := cascade.Input{NumQHeads: int(a.num_q_heads), NumKVHeads: int(a.num_kv_heads), HeadDim: int(a.head_dim),
		Headroom: int(a.headroom), NoDecodeRoute: a.flags&C.KVP_CASCADE_NO_DECODE_ROUTE != 0}
	if err := m.CascadeInput(slice[int64](unsafe.Pointer(ids), n), int(a.max_blocks_per_seq), &in, &scr.sc); err != nil {
		return fail(kverr.Wrap(kverr.CodeOf(err), err, "%s", what))
	}

	if hostOnly {
		in.DTypeBytes = attn.DType(a.dtype).Size()
		maxBatch, maxTokens := int(a.max_batch), int(a.max_tokens)
		if maxBatch < 0 || maxTokens < 0 {
			return failf(kverr.InvalidArgument, "%s: max_batch and max_tokens must be >= 0: got %d, %d", what, maxBatch, maxTokens)
		}
		if maxBatch == 0 {
			maxBatch = max(int(n), 1)
		}
		if a.qo_indptr_host != nil { // varlen queries; the device copy is not read
			in.QIndptr = unsafe.Slice((*int32)(unsafe.Pointer(a.qo_indptr_host)), int(n)+1)
			if maxTokens == 0 {
				// No workspace to fit: by default the capacity is the
				// batch's own rows (the planner checks the offsets).
				maxTokens = max(int(in.QIndptr[n]), maxBatch)
			}
		}
		s, err := scr.hp.Plan(&in, maxBatch, maxTokens)
		if err != nil {
			return fail(kverr.Wrap(kverr.CodeOf(err), err, "%s", what))
		}
		out := cascadePlanStruct(&a, s, maxBatch, bs, cascade.DefaultSlots)
		// A summary: it names no workspace or device array, so
		// kvp_cascade_update and kvp_paged_cascade refuse it (they find no
		// host workspace) and nothing can launch from it. The prefill
		// route's work list is planned on the device: no items here.
		out.grid, out.num_splits, out.workspace, out.workspace_bytes, out.kv_lens = 0, 0, 0, 0, 0
		out.reserved[0], out.reserved[1] = 0, 0
		return fail(attnPlanStruct.out(unsafe.Pointer(plan), unsafe.Pointer(&out)))
	}

	a.struct_size = C.size_t(unsafe.Sizeof(a))
	a.batch = C.int32_t(n)
	a.block_size = C.int32_t(bs)
	a.block_table_stride = C.int64_t(in.TableStride)
	if n > 0 {
		a.block_table_host = (*C.int32_t)(unsafe.Pointer(&in.Tables[0]))
		a.seq_lens_host = (*C.int32_t)(unsafe.Pointer(&in.SeqLens[0]))
	}
	st = cascadePlanDevice(&a, plan, stream)
	runtime.KeepAlive(scr)
	if st != C.KVP_OK && st != C.KVP_ERR_INTERNAL {
		// The checks are kvp_cascade_plan's: say which call the host made.
		msg := C.GoString(C.kvp_last_error())
		setError(what + ": " + strings.TrimPrefix(msg, "kvp_cascade_plan: "))
	}
	return st
}
