package cascadeattn

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

// managerScratch is one call's gather memory and planners, pooled so that
// a step allocates nothing once the pool has grown to it.
type managerScratch struct {
	sc kvmanager.CascadeScratch
	pl cascade.Planner
	hp cascade.HostPlanner
}

var managerScratches = sync.Pool{New: func() any { return new(managerScratch) }}

// PlanFromManager plans the batch ids[n] of manager m from the manager's own
// block tables and lengths (kvp_manager_cascade_plan): the plan, the
// workspaces and the result are PlanBatch's for the tables and lengths
// m.Describe writes with a's MaxBlocksPerSeq, and a is PlanBatch's but for
// Batch (0 or n), BlockSize (0 or the manager's), the host arrays (nil:
// the manager's) and BlockTableStride (not read).
//
// With neither workspace (Workspace 0, HostWorkspace nil) the batch is
// planned on the host for its summary alone: a Plan with no workspace, no
// device array and no prefill work list, which Update and Run refuse.
// Every error names kvp_manager_cascade_plan.
func PlanFromManager(m *kvmanager.Manager, ids *int64, n int, a *PlanArgs, stream cuda.Stream) (Plan, error) {
	c := call{op: "kvp_manager_cascade_plan", nameAll: true}
	if err := limits.Range(c.op+": n", n, 0, limits.AttnBatch); err != nil {
		return Plan{}, err
	}
	if n > 0 && ids == nil {
		return Plan{}, c.errorf(kverr.NullPointer, "seq_ids must not be NULL")
	}
	// The tables and lengths are the manager's: host arrays given here
	// would be ignored, so they are refused instead.
	if a.BlockTableHost != nil || a.SeqLensHost != nil {
		return Plan{}, c.errorf(kverr.InvalidArgument, "block_table_host and seq_lens_host must be NULL (the tables and lengths are the manager's)")
	}
	if a.Batch != 0 && a.Batch != n {
		return Plan{}, c.errorf(kverr.InvalidArgument, "args->batch is %d for %d seq_ids (0 means n)", a.Batch, n)
	}
	bs := m.BlockSize()
	if a.BlockSize != 0 && a.BlockSize != bs {
		return Plan{}, c.errorf(kverr.InvalidArgument, "args->block_size is %d; the manager's blocks hold %d tokens (0 means the manager's)", a.BlockSize, bs)
	}
	if a.MaxBlocksPerSeq < 1 {
		return Plan{}, c.errorf(kverr.InvalidArgument, "max_blocks_per_seq (the device block table's columns) must be >= 1: got %d", a.MaxBlocksPerSeq)
	}
	hostOnly := a.Workspace == 0 && a.HostWorkspace == nil
	if hostOnly {
		// Checked before the gather, as PlanBatch checks them. (A field
		// added to PlanArgs later is PlanBatch's: this host planner must
		// refuse it when set rather than ignore it.)
		if err := attn.CheckCascadeDType(c.op, a.DType); err != nil {
			return Plan{}, err
		}
		if a.Flags&^FlagNoDecodeRoute != 0 {
			return Plan{}, c.errorf(kverr.InvalidArgument, "unknown flags %#x", a.Flags)
		}
	}

	scr := managerScratches.Get().(*managerScratch)
	defer managerScratches.Put(scr)
	in := cascade.Input{NumQHeads: a.NumQHeads, NumKVHeads: a.NumKVHeads, HeadDim: a.HeadDim,
		Headroom: a.Headroom, NoDecodeRoute: a.Flags&FlagNoDecodeRoute != 0,
		PlainPrefillFaster: dev.prefillMainloop(a.DType, a.HeadDim) == attn.MainloopSM90,
		SharedWgmma:        dev.prefillMainloop(a.DType, a.HeadDim) == attn.MainloopSM90}
	var idv []int64
	if n > 0 {
		idv = unsafe.Slice(ids, n)
	}
	if err := m.CascadeInput(idv, a.MaxBlocksPerSeq, &in, &scr.sc); err != nil {
		return Plan{}, kverr.Wrap(kverr.CodeOf(err), err, "%s", c.op)
	}
	if hostOnly {
		return c.planSummary(a, &in, n, bs, &scr.hp)
	}
	b := *a
	b.Batch, b.BlockSize, b.BlockTableStride = n, bs, int64(in.TableStride)
	if n > 0 {
		b.BlockTableHost, b.SeqLensHost = &in.Tables[0], &in.SeqLens[0]
	}
	return plan(c, &b, &scr.pl, stream)
}

// planSummary plans a gathered batch on the host for its summary alone:
// the plan a device would get, less the workspaces, the device arrays and
// the prefill route's work list (planned on the device), with the chunking
// of cascade.DefaultSlots.
func (c call) planSummary(a *PlanArgs, in *cascade.Input, n, bs int, hp *cascade.HostPlanner) (Plan, error) {
	in.DTypeBytes = a.DType.Size()
	maxBatch, maxTokens := a.MaxBatch, a.MaxTokens
	if maxBatch < 0 || maxTokens < 0 {
		return Plan{}, c.errorf(kverr.InvalidArgument, "max_batch and max_tokens must be >= 0: got %d, %d", maxBatch, maxTokens)
	}
	if maxBatch == 0 {
		maxBatch = max(n, 1)
	}
	if a.QOIndptrHost != nil { // varlen queries; the device copy is not read
		in.QIndptr = unsafe.Slice(a.QOIndptrHost, n+1)
		if maxTokens == 0 {
			// No workspace to fit: by default the capacity is the batch's
			// own rows (the planner checks the offsets).
			maxTokens = max(int(in.QIndptr[n]), maxBatch)
		}
	}
	s, err := hp.Plan(in, maxBatch, maxTokens)
	if err != nil {
		return Plan{}, kverr.Wrap(kverr.CodeOf(err), err, "%s", c.op)
	}
	p := newPlan(a, s, maxBatch, bs, cascade.DefaultSlots)
	p.Grid = 0 // nothing launches from a summary
	return p, nil
}
