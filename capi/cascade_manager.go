package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/cascadeattn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
)

// Shared-prefix planning from a kvp_manager's own block tables
// (core/cascadeattn.PlanFromManager).

//export kvpgo_manager_cascade_plan
func kvpgo_manager_cascade_plan(h *C.kvp_manager, ids *C.int64_t, n C.int32_t, ca *C.kvp_cascade_plan_args,
	plan *C.kvp_attn_plan, stream C.uint64_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		const what = "kvp_manager_cascade_plan"
		if ca == nil || plan == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: args and plan must not be NULL", what)
		}
		a, err := cascadePlanArgsOf(what, ca, plan)
		if err != nil {
			return err
		}
		p, err := cascadeattn.PlanFromManager(m, (*int64)(unsafe.Pointer(ids)), int(n), &a, cuda.Stream(stream))
		if err != nil {
			return err
		}
		return writeCascadePlan(plan, &p)
	})
}
