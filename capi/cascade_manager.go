package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"sync"
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/limits"
)

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
		if err := limits.Range(what+": n", int(n), 0, limits.AttnBatch); err != nil {
			return err
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
