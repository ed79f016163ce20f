package attn

import (
	"hash/maphash"
	"sync"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// A prefill-route plan's work list lives in its workspace, written there by
// the plan kernel; a later plan into the same workspace overwrites it. A run
// of the earlier plan then reads the later plan's list: when the two lists
// differ (another batch, mainloop or split count), the kernels compute rows
// the plan does not describe, silently. So each plan carries a fingerprint
// of the list it wrote (PrefillPlan.WorkList: the plan kernel's arguments and
// the batch), the library remembers the fingerprint of the last list
// written into each workspace, and a run whose plan's list is no longer its
// workspace's is refused. A later plan of the same batch and flags writes
// the same list, so an earlier plan of it still runs. A decode launch with
// split partials at a workspace's start (paged_decode, or a decode-route
// plan's run) overwrites a list there too: it marks the workspace as
// holding partials (notePartials), so the list's plan is refused after it.

// splitPartials stands for a workspace that a decode-route plan's split
// partials take from its start: no prefill plan's list is there.
const splitPartials uint64 = 0x5b117ba27a1a1500

// workListSeed keys the fingerprints: they are compared within a process
// only.
var workListSeed = maphash.MakeSeed()

// maxWorkspaces bounds the workspaces remembered; past it the record
// starts again (a workspace without a record is not checked).
const maxWorkspaces = 1 << 12

var workLists struct {
	sync.Mutex
	of map[cuda.DevicePtr]uint64
}

// workListOf is the fingerprint of the list the plan kernel writes with pp
// for the batch (qoIndptr, kvLens: the host copies of the device arrays pp
// names); never 0.
func workListOf(pp *prefillPlanParams, qoIndptr, kvLens []int32) uint64 {
	// The list depends on the device arrays' values, which are the host
	// copies' (the caller's obligation), not on where they lie: a later
	// plan of the same batch from fresh arrays writes the same list.
	q := *pp
	q.QOIndptr, q.KVLens = 0, 0
	var h maphash.Hash
	h.SetSeed(workListSeed)
	h.Write(unsafe.Slice((*byte)(unsafe.Pointer(&q)), unsafe.Sizeof(q)))
	h.Write(int32Bytes(qoIndptr))
	h.Write(int32Bytes(kvLens))
	if f := h.Sum64(); f != 0 {
		return f
	}
	return 1
}

func int32Bytes(s []int32) []byte {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), 4*len(s))
}

// recordWorkList notes that the list with fingerprint f is now
// workspace ws's.
func recordWorkList(ws cuda.DevicePtr, f uint64) {
	workLists.Lock()
	defer workLists.Unlock()
	if workLists.of == nil || len(workLists.of) >= maxWorkspaces {
		workLists.of = make(map[cuda.DevicePtr]uint64)
	}
	workLists.of[ws] = f
}

// notePartials notes that a launch wrote split partials from ws's start:
// a work list recorded there is gone. A workspace without a record stays
// without one (no plan's list is there to protect).
func notePartials(ws cuda.DevicePtr) {
	workLists.Lock()
	defer workLists.Unlock()
	if f, ok := workLists.of[ws]; ok && f != splitPartials {
		workLists.of[ws] = splitPartials
	}
}

// checkWorkList refuses a run of plan p whose work list its workspace no
// longer holds. A plan without a fingerprint, or a workspace without a
// record, is not checked.
func checkWorkList(what string, p *PrefillPlan) error {
	if p.WorkList == 0 || p.Route != RoutePrefill || p.NumItems == 0 {
		return nil
	}
	workLists.Lock()
	f, ok := workLists.of[p.Workspace]
	workLists.Unlock()
	if ok && f != p.WorkList {
		return kverr.Errorf(kverr.InvalidArgument, "%s: stale plan: its workspace (%#x) was planned into again since, for another batch, mainloop or split count, and holds that plan's work list; run the latest plan, or give each plan its own workspace", what, uint64(p.Workspace))
	}
	return nil
}
