package cascadeattn

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// call is the entry point a check reports under. A call made on another's
// behalf (the manager's plan is kvp_cascade_plan's over the tables it
// gathers) sets nameAll, so that errors from the packages below carry its
// name too: every message of kvp_manager_cascade_plan names it.
type call struct {
	op      string
	nameAll bool
}

// errorf is an error of one of the call's own checks.
func (c call) errorf(code kverr.Code, format string, args ...any) error {
	return kverr.Errorf(code, "%s: "+format, append([]any{c.op}, args...)...)
}

// wrap passes on an error from a package below: as it is, or named with the
// call when nameAll is set. An Internal error (a bug, not an argument) is
// passed on as it is, so its message stays the bug's.
func (c call) wrap(err error) error {
	if err == nil || !c.nameAll || kverr.CodeOf(err) == kverr.Internal {
		return err
	}
	return kverr.Wrap(kverr.CodeOf(err), err, "%s", c.op)
}

// device is what planning needs of the GPU. The tests replace it to plan
// on machines without one (slots then default and nothing is enqueued).
type device interface {
	// slots is how many cascade attention blocks the device runs at once.
	slots(headDim int) (int, error)
	// planPrefill enqueues the prefill kernel's work list.
	planPrefill(a *attn.PrefillPlanArgs, stream cuda.Stream) (attn.PrefillPlan, error)
	// upload enqueues copies of the host plan's byte ranges into the device
	// workspace at the same offsets.
	upload(dst cuda.DevicePtr, src unsafe.Pointer, ranges [][2]int64, stream cuda.Stream) error
	// prefillMainloop is the kernel the prefill route runs on this device
	// (attn.MainloopSM80 or attn.MainloopSM90).
	prefillMainloop(d attn.DType, headDim int) int
}

// gpu is the device of the calling thread's current CUDA context.
type gpu struct{}

func (gpu) slots(headDim int) (int, error) { return attn.CascadeSlots(headDim) }

func (gpu) planPrefill(a *attn.PrefillPlanArgs, stream cuda.Stream) (attn.PrefillPlan, error) {
	return attn.PlanPrefill(a, stream)
}

func (gpu) upload(dst cuda.DevicePtr, src unsafe.Pointer, ranges [][2]int64, stream cuda.Stream) error {
	return attn.CascadeUpload(dst, src, ranges, stream)
}

func (gpu) prefillMainloop(d attn.DType, headDim int) int {
	return attn.DefaultPrefillMainloop(d, headDim)
}

var dev device = gpu{}
