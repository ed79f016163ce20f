package attn

// A cascade plan's check against its host workspace, its update for a step
// that only grew, and its run: the cascade kernels, or on the other routes
// PagedPrefill and PagedDecode.

import (
	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// cascadePlanned is a cascade plan checked against the host workspace it names:
// that workspace's layout, words and summary.
type cascadePlanned struct {
	l  cascade.Layout
	ws []int32
	s  cascade.Summary
}

// check reads p's host workspace back, refusing a plan that no
// kvp_cascade_plan wrote (kind, route, sizes), one that names no host
// workspace (a host-only summary) and a stale one (its workspaces were
// planned into again since).
func (c cascadeCall) check(p *CascadePlan) (cascadePlanned, error) {
	var r cascadePlanned
	if p.Kind != KindCascade {
		return r, c.errorf(kverr.InvalidArgument, "the plan's kind is %d; plan it with kvp_cascade_plan", p.Kind)
	}
	if p.Route != cascade.RouteCascade && p.Route != cascade.RouteDecode && p.Route != cascade.RoutePrefill {
		return r, c.errorf(kverr.InvalidArgument, "the plan's route is %d (written by kvp_cascade_plan only)", p.Route)
	}
	if p.Batch < 0 || p.Batch > p.MaxBatch {
		return r, c.errorf(kverr.InvalidArgument, "the plan's batch %d is outside [0, max_batch %d]", p.Batch, p.MaxBatch)
	}
	var err error
	if r.l, err = cascade.NewLayout(p.MaxBatch, p.NumQHeads, p.NumKVHeads, p.HeadDim); err != nil {
		return r, c.wrap(err)
	}
	if p.HostWorkspace == nil || len(p.HostWorkspace) < r.l.HostInts*4 {
		return r, c.errorf(kverr.InvalidArgument, "the plan names no host workspace of the plan's size")
	}
	r.ws = hostWords(p.HostWorkspace)
	// The query-row capacity is the plan's (its header): the layout again
	// with it, and the workspace checked against that.
	if r.l, err = cascade.PlanLayout(r.ws, p.MaxBatch, p.NumQHeads, p.NumKVHeads, p.HeadDim); err != nil {
		return r, c.wrap(err)
	}
	if len(p.HostWorkspace) < r.l.HostInts*4 {
		return r, c.errorf(kverr.InvalidArgument, "the plan names no host workspace of the plan's size")
	}
	if r.s, err = cascade.Header(r.ws, &r.l); err != nil {
		return r, c.wrap(err)
	}
	if r.s.Gen != p.Gen || r.s.Batch != p.Batch || r.s.Route != p.Route || r.s.Rows != p.TotalQ {
		return r, c.errorf(kverr.InvalidArgument, "stale plan: its workspaces were planned again since (generation %d, batch %d; the workspaces hold generation %d, batch %d)",
			p.Gen, p.Batch, r.s.Gen, r.s.Batch)
	}
	return r, nil
}

// UpdateCascade reports whether a step whose sequences only grew to the
// lengths seqLens (one a sequence of the plan's batch) still fits plan p:
// then nothing needs planning or copying. O(batch), host only; a
// decode-route plan always fits, a plan with varlen queries never does
// (cascade.Update).
func UpdateCascade(p *CascadePlan, seqLens []int32) (bool, error) {
	c := cascadeCall{op: "kvp_cascade_update"}
	r, err := c.check(p)
	if err != nil {
		return false, err
	}
	if len(seqLens) != p.Batch {
		return false, c.errorf(kverr.InvalidArgument, "batch %d differs from the plan's %d", len(seqLens), p.Batch)
	}
	return cascade.Update(r.ws, &r.l, p.Route, p.Batch, seqLens)
}

// PagedCascade enqueues one layer of plan p over a's tensors on stream:
// the cascade kernels over the plan's work items, or on the other routes
// the prefill or decode kernel, whose split-KV workspace is the
// partial-state region.
func PagedCascade(p *CascadePlan, a *PagedPrefillArgs, stream cuda.Stream) error {
	c := cascadeCall{op: "kvp_paged_cascade"}
	r, err := c.check(p)
	if err != nil {
		return err
	}
	if a.BlockSize != p.BlockSize {
		return c.errorf(kverr.InvalidArgument, "block_size %d differs from the %d the plan read the tables with", a.BlockSize, p.BlockSize)
	}
	if int64(a.MaxBlocksPerSeq)*int64(a.BlockSize) < int64(p.MaxKVLen) {
		return c.errorf(kverr.InvalidArgument, "the plan's sequences reach %d tokens; the block table holds %d blocks of %d", p.MaxKVLen, a.MaxBlocksPerSeq, a.BlockSize)
	}
	if p.WorkspaceBytes < r.l.DeviceBytes {
		return c.errorf(kverr.BufferTooSmall, "the plan's workspace_bytes %d is below the %d its max_batch needs", p.WorkspaceBytes, r.l.DeviceBytes)
	}
	// The partial-state region doubles as the other routes' workspace.
	parts, partBytes := p.Workspace+cuda.DevicePtr(r.l.PartOut), r.l.DeviceBytes-r.l.PartOut
	switch p.Route {
	case cascade.RoutePrefill:
		sh := p.PrefillShape
		sh.WindowLeft = -1 // shared-prefix plans have no window
		pp := PrefillPlan{Kind: KindPrefill, Route: RoutePrefill, PrefillShape: sh,
			Batch: p.Batch, TotalQ: r.s.Rows, MaxQLen: r.s.MaxQLen, MaxKVLen: p.MaxKVLen,
			NumItems: p.NumItems, Grid: p.Grid, NumSplits: p.NumSplits,
			// The plan records no mainloop: it was planned for this device's.
			Mainloop:  MainloopOfDevice,
			Workspace: parts, WorkspaceBytes: partBytes, KVLens: p.KVLens}
		return PagedPrefill(&pp, a, stream)
	case cascade.RouteDecode:
		d := PagedDecodeArgs{DecodeLayout: cascadeDecodeLayout(p, a),
			Q: a.Q, SeqLens: p.KVLens,
			Out: a.Out, LSE: a.LSE, Workspace: parts, WorkspaceBytes: partBytes, MaxSeqLen: p.MaxKVLen}
		return PagedDecode(&d, stream)
	}
	if r.s.Rows == 0 {
		return nil // no query rows: nothing to compute
	}
	return CascadeRun(&CascadeRunArgs{DecodeLayout: cascadeDecodeLayout(p, a), Rows: r.s.Rows,
		Q: a.Q, SeqLens: p.KVLens,
		Out: a.Out, LSE: a.LSE, Workspace: p.Workspace, WorkspaceBytes: p.WorkspaceBytes,
		PartOut: r.l.PartOut, PartLSE: r.l.PartLSE,
		ItemsOff: r.l.Items, QRowsOff: r.l.QRows, SegStartOff: r.l.SegStart, SegsOff: r.l.Segs,
		RowSeqOff: r.l.RowSeq, QStartOff: r.l.QStart, MaxBatch: p.MaxBatch, MaxRows: r.l.MaxTokens}, stream)
}

// cascadeDecodeLayout is a layer's tensors as the decode and cascade launches take
// them: one row of q and out per query row (a sequence, in decode).
func cascadeDecodeLayout(p *CascadePlan, a *PagedPrefillArgs) DecodeLayout {
	return DecodeLayout{
		DType: p.DType, HeadDim: p.HeadDim, Batch: p.Batch, NumQHeads: p.NumQHeads, NumKVHeads: p.NumKVHeads,
		QBatchStride: a.QTokenStride, QHeadStride: a.QHeadStride,
		OutBatchStride: a.OutTokenStride, OutHeadStride: a.OutHeadStride,
		PagedKV: a.PagedKV, Scale: a.Scale,
	}
}
