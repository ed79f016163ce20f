package attn

// Shared-prefix ("cascade") attention, plan to launch, in one file: a batch
// planned by core/cascade (a pure host planner) into the engine's
// workspaces, with the plan's copy to the device, or on the prefill route
// the prefill planner's work list; the plan's check against its host
// workspace, its update for a step that only grew, and its run: the cascade
// kernels (the attention kernel over the plan's work items, then the merge
// of each sequence's partial states), or on the other routes PagedPrefill
// and PagedDecode. The plan is a PrefillPlan of kind KindCascade with the
// CascadeState that UpdateCascade and PagedCascade read back.
//
// Messages name the C entry point (kvp_cascade_plan and so on), the name
// under which the header documents each check.

import (
	"math"
	"runtime"
	"strconv"
	"sync"
	"unsafe"

	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
)

// KindCascade is a cascade plan's kvp_attn_plan.kind (KVP_ATTN_PLAN_CASCADE).
const KindCascade = 2

// CascadeNoDecodeRoute keeps a plan on the cascade (or prefill) kernels
// when sharing does not pay, so that one captured graph serves every batch
// (KVP_CASCADE_NO_DECODE_ROUTE).
const CascadeNoDecodeRoute = 1

// CascadeNoHopper plans for the sm_80 kernels on a Hopper GPU too
// (KVP_CASCADE_NO_HOPPER).
const CascadeNoHopper = 4

// cascadeFlags are the flags a cascade plan takes.
const cascadeFlags = CascadeNoDecodeRoute | CascadeNoHopper

// cascadeDefaultBlockSize is the block size of CascadePlanArgs.BlockSize 0.
const cascadeDefaultBlockSize = 16

// CascadePlanArgs is a batch to plan (kvp_cascade_plan_args). The batch is
// len(SeqLens) sequences; zero values are the header's defaults.
type CascadePlanArgs struct {
	DType                          DType // f16 or bf16
	HeadDim, NumQHeads, NumKVHeads int
	MaxBatch                       int // the workspaces' capacity; 0: the batch (at least 1)
	MaxTokens                      int // their query-row capacity; 0: MaxBatch
	BlockSize                      int // 0: 16
	MaxBlocksPerSeq                int // block table columns read
	BlockTableStride               int64
	// Host copies of the batch: the block table (row b at b*stride, its
	// first MaxBlocksPerSeq entries read), the sequences' lengths (this
	// step's tokens included) and, for varlen queries, the query offsets
	// [batch+1] (nil: one query token per sequence).
	BlockTable, SeqLens, QOIndptr []int32
	// The same lengths and offsets on the device, read by the kernels.
	SeqLensDev, QOIndptrDev cuda.DevicePtr
	HostWorkspace           []byte // 4-byte aligned; pinned, since the copy is asynchronous
	Workspace               cuda.DevicePtr
	WorkspaceBytes          int64 // 16-byte aligned
	Flags                   int   // 0 or CascadeNoDecodeRoute | CascadeNoHopper
	Headroom                int   // tokens each tail may grow before a new plan is needed; 0: 64
}

// CascadePlan is a planned batch as kvp_attn_plan holds it: the fields it
// shares with a prefill plan (Kind KindCascade, the route, the shape, the
// batch's rows and lengths, the workspace, the device sequence lengths as
// KVLens) and the CascadeState that Update and Run read back.
type CascadePlan struct {
	PrefillPlan
	CascadeState
}

// CascadeState is what a cascade plan carries beyond a prefill plan's
// fields: its host workspace, the capacity and block size it was planned
// for, its generation in the workspaces (a later plan makes it stale) and
// the sharing it found. kvp_attn_plan holds it in its plan-state words.
type CascadeState struct {
	HostWorkspace []byte
	MaxBatch      int
	BlockSize     int
	Parts         int   // partial states in use
	Gen           int32 // plans made into the workspaces before this one
	SavedTokens   int64 // KV tokens per kv head the shared reads save
	TotalTokens   int64 // KV tokens per kv head plain attention reads
}

// cascadeCall is the entry point a check reports under. A call made on
// another's behalf (the manager's plan is kvp_cascade_plan's over the
// tables it gathers) sets nameAll, so that errors from the planner carry
// its name too: every message of kvp_manager_cascade_plan names it.
type cascadeCall struct {
	op      string
	nameAll bool
}

// errorf is an error of one of the call's own checks.
func (c cascadeCall) errorf(code kverr.Code, format string, args ...any) error {
	return kverr.Errorf(code, "%s: "+format, append([]any{c.op}, args...)...)
}

// wrap passes on an error from the planner: as it is, or named with the
// call when nameAll is set. An Internal error (a bug, not an argument) is
// passed on as it is, so its message stays the bug's.
func (c cascadeCall) wrap(err error) error {
	if err == nil || !c.nameAll || kverr.CodeOf(err) == kverr.Internal {
		return err
	}
	return kverr.Wrap(kverr.CodeOf(err), err, "%s", c.op)
}

// cascadeDevice is what planning needs of the GPU. The tests replace it to
// plan on machines without one (slots then default and nothing is
// enqueued).
type cascadeDevice interface {
	// open readies the device of the calling thread (locked by the caller)
	// for a plan: how many cascade attention blocks it runs at once, and
	// whether the prefill route runs on the Hopper mainloop there.
	open(d DType, headDim int) (slots int, hopper bool, err error)
	// planPrefill enqueues the prefill kernel's work list.
	planPrefill(a *PrefillPlanArgs, stream cuda.Stream) (PrefillPlan, error)
	// upload enqueues copies of host byte ranges [off, off+n) of the plan
	// into the device workspace at the same offsets (after open, on the
	// same thread).
	upload(dst cuda.DevicePtr, src []byte, ranges [][2]int64, stream cuda.Stream) error
	// hopper is open's answer for a plan that enqueues nothing (a host-only
	// summary): false where no device is usable.
	hopper(d DType, headDim int) bool
}

// gpu is the device of the calling thread's current CUDA context.
type gpu struct{}

func (gpu) open(d DType, headDim int) (int, bool, error) {
	m, err := module("cascade_plan")
	if err != nil {
		return 0, false, err
	}
	dev := m.Device()
	return dev.SMs * cascadeBlocksPerSM(headDim), prefillMainloop(dev, d, headDim, 0) == MainloopSM90, nil
}

func (gpu) planPrefill(a *PrefillPlanArgs, stream cuda.Stream) (PrefillPlan, error) {
	return PlanPrefill(a, stream)
}

func (gpu) upload(dst cuda.DevicePtr, src []byte, ranges [][2]int64, stream cuda.Stream) error {
	for _, r := range ranges {
		b := src[r[0] : r[0]+r[1]]
		if err := cuda.CopyToDeviceAsync(dst+cuda.DevicePtr(r[0]), unsafe.Pointer(unsafe.SliceData(b)), len(b), stream); err != nil {
			return err
		}
	}
	return nil
}

func (gpu) hopper(d DType, headDim int) bool {
	return DefaultPrefillMainloop(d, headDim) == MainloopSM90
}

var cascadeDev cascadeDevice = gpu{}

// cascadeScratch is one call's planners, pooled so that a step allocates
// nothing once the pool has grown to its batches.
type cascadeScratch struct {
	pl cascade.Planner
	hp cascade.HostPlanner
}

var cascadeScratches = sync.Pool{New: func() any { return new(cascadeScratch) }}

// PlanCascade plans the batch a describes into its workspaces
// (kvp_cascade_plan): the host plan, and on stream its copy into the device
// workspace or, on the prefill route, the prefill kernel's work list where
// the partial states would be. On an argument or planning error the
// workspaces are left as they were; an error of the device work (NoDevice,
// CUDA) leaves the host workspace holding the new plan.
func PlanCascade(a *CascadePlanArgs, stream cuda.Stream) (CascadePlan, error) {
	scr := cascadeScratches.Get().(*cascadeScratch)
	defer cascadeScratches.Put(scr)
	return planCascade(cascadeCall{op: "kvp_cascade_plan"}, a, &scr.pl, stream)
}

// PlanCascadeInput plans a batch whose block tables, lengths and block size
// a block manager gathered into in (kvmanager.Manager.CascadeInput with a's
// MaxBlocksPerSeq): kvp_manager_cascade_plan. The plan, the workspaces and
// the result are PlanCascade's for in's tables and lengths, and a is
// PlanCascade's but for BlockSize (0 or in's), the host arrays (nil: in's)
// and BlockTableStride (not read). The other fields of in are set here.
//
// With neither workspace (Workspace 0, HostWorkspace nil) the batch is
// planned on the host for its summary alone: a plan with no workspace, no
// device array and no prefill work list, which Update and Run refuse.
// Every error names kvp_manager_cascade_plan.
func PlanCascadeInput(a *CascadePlanArgs, in *cascade.Input, stream cuda.Stream) (CascadePlan, error) {
	c := cascadeCall{op: "kvp_manager_cascade_plan", nameAll: true}
	// The tables and lengths are in's: host arrays given here would be
	// ignored, so they are refused instead.
	if a.BlockTable != nil || a.SeqLens != nil {
		return CascadePlan{}, c.errorf(kverr.InvalidArgument, "block_table_host and seq_lens_host must be NULL (the tables and lengths are the manager's)")
	}
	if a.BlockSize != 0 && a.BlockSize != in.BlockSize {
		return CascadePlan{}, c.errorf(kverr.InvalidArgument, "args->block_size is %d; the manager's blocks hold %d tokens (0 means the manager's)", a.BlockSize, in.BlockSize)
	}
	scr := cascadeScratches.Get().(*cascadeScratch)
	defer cascadeScratches.Put(scr)
	if a.Workspace == 0 && a.HostWorkspace == nil {
		// (A field added to CascadePlanArgs later is planCascade's: this
		// host planner must refuse it when set rather than ignore it.)
		if err := CheckCascadeDType(c.op, a.DType); err != nil {
			return CascadePlan{}, err
		}
		if a.Flags&^cascadeFlags != 0 {
			return CascadePlan{}, c.errorf(kverr.InvalidArgument, "unknown flags %#x", a.Flags)
		}
		return c.planSummary(a, in, &scr.hp)
	}
	b := *a
	b.BlockSize, b.BlockTableStride, b.BlockTable, b.SeqLens = in.BlockSize, int64(in.TableStride), in.Tables, in.SeqLens
	return planCascade(c, &b, &scr.pl, stream)
}

// planCascade plans a with pl (PlanCascade).
func planCascade(c cascadeCall, a *CascadePlanArgs, pl *cascade.Planner, stream cuda.Stream) (CascadePlan, error) {
	if err := CheckCascadeDType(c.op, a.DType); err != nil {
		return CascadePlan{}, err
	}
	if a.Flags&^cascadeFlags != 0 {
		return CascadePlan{}, c.errorf(kverr.InvalidArgument, "unknown flags %#x", a.Flags)
	}
	batch := len(a.SeqLens)
	if batch > limits.AttnBatch {
		return CascadePlan{}, c.errorf(kverr.InvalidArgument, "batch must be in [0, %d]: got %d", limits.AttnBatch, batch)
	}
	maxBatch := a.MaxBatch
	if maxBatch == 0 {
		maxBatch = max(batch, 1)
	}
	bs := a.BlockSize
	if bs == 0 {
		bs = cascadeDefaultBlockSize
	}
	stride := a.BlockTableStride
	if stride == 0 {
		stride = int64(a.MaxBlocksPerSeq)
	}
	if stride < 0 || stride > math.MaxInt32 {
		return CascadePlan{}, c.errorf(kverr.InvalidArgument, "block_table_stride must be in [0, 2^31): got %d", stride)
	}
	maxTokens := a.MaxTokens
	if maxTokens == 0 {
		maxTokens = maxBatch
	}
	l, err := cascade.NewPrefillLayout(maxBatch, maxTokens, a.NumQHeads, a.NumKVHeads, a.HeadDim)
	if err != nil {
		return CascadePlan{}, c.wrap(err)
	}
	if err := c.checkWorkspaces(a, &l, maxBatch); err != nil {
		return CascadePlan{}, err
	}
	qo := a.QOIndptr
	if qo != nil {
		if a.QOIndptrDev == 0 || a.QOIndptrDev%4 != 0 {
			return CascadePlan{}, c.errorf(kverr.InvalidArgument, "with qo_indptr_host, qo_indptr must be a 4-byte aligned device pointer: got %#x", uint64(a.QOIndptrDev))
		}
		if len(qo) != batch+1 {
			return CascadePlan{}, c.errorf(kverr.InvalidArgument, "qo_indptr_host holds %d offsets for a batch of %d", len(qo), batch)
		}
	}
	table := a.BlockTable
	if batch > 0 {
		if a.MaxBlocksPerSeq < 1 || int64(a.MaxBlocksPerSeq) > stride {
			return CascadePlan{}, c.errorf(kverr.InvalidArgument, "max_blocks_per_seq must be in [1, block_table_stride = %d]: got %d", stride, a.MaxBlocksPerSeq)
		}
		if table == nil {
			return CascadePlan{}, c.errorf(kverr.NullPointer, "block_table_host and seq_lens_host must not be NULL")
		}
		if a.SeqLensDev == 0 || a.SeqLensDev%4 != 0 {
			return CascadePlan{}, c.errorf(kverr.InvalidArgument, "seq_lens must be a 4-byte aligned device pointer: got %#x", uint64(a.SeqLensDev))
		}
		need := int64(batch-1)*stride + int64(a.MaxBlocksPerSeq)
		if int64(len(table)) < need {
			return CascadePlan{}, c.errorf(kverr.InvalidArgument, "block_table_host holds %d entries; %d sequences of stride %d need %d", len(table), batch, stride, need)
		}
		table = table[:need]
	} else {
		stride = max(stride, 1) // an empty batch reads no table
	}
	// One thread from here to the upload: the device open readies is the
	// one the plan's copies go to.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	slots, hopper, err := cascadeDev.open(a.DType, a.HeadDim)
	if err != nil {
		return CascadePlan{}, c.wrap(err)
	}
	hopper = hopper && a.Flags&CascadeNoHopper == 0
	lens := a.SeqLens
	if lens == nil {
		lens = []int32{}
	}
	in := cascade.Input{NumQHeads: a.NumQHeads, NumKVHeads: a.NumKVHeads, HeadDim: a.HeadDim,
		DTypeBytes: 2 /* f16 or bf16 (CheckCascadeDType) */, BlockSize: bs, Tables: table, TableStride: int(stride),
		MaxBlocksPerSeq: max(a.MaxBlocksPerSeq, 1), SeqLens: lens, QIndptr: qo, Slots: slots, Headroom: a.Headroom,
		NoDecodeRoute: a.Flags&CascadeNoDecodeRoute != 0, PlainPrefillFaster: hopper, SharedWgmma: hopper}
	ws := hostWords(a.HostWorkspace)
	s, err := pl.Plan(&in, &l, ws)
	if err != nil {
		return CascadePlan{}, c.wrap(err)
	}
	p := newCascadePlan(a, s, maxBatch, bs, slots)
	p.Workspace, p.WorkspaceBytes, p.KVLens = a.Workspace, a.WorkspaceBytes, a.SeqLensDev
	p.HostWorkspace = a.HostWorkspace
	if s.Route == cascade.RoutePrefill {
		// The prefill kernel's work list goes where the partial states
		// would: the plan kernel writes it on stream.
		flags := PrefillNoDecodeRoute
		if !hopper {
			flags |= PrefillNoHopper
		}
		pp, err := cascadeDev.planPrefill(&PrefillPlanArgs{
			PrefillShape: p.PrefillShape,
			QOIndptr:     qo, KVLens: lens, QOIndptrDev: a.QOIndptrDev, KVLensDev: a.SeqLensDev,
			Workspace:      a.Workspace + cuda.DevicePtr(l.PartOut),
			WorkspaceBytes: l.DeviceBytes - l.PartOut, Flags: flags,
		}, stream)
		if err != nil {
			return CascadePlan{}, c.wrap(err)
		}
		p.NumItems, p.Grid, p.NumSplits = pp.NumItems, pp.Grid, pp.NumSplits
		// The run launches the mainloop the work list was cut for: it is
		// the device's unless the plan says NO_HOPPER.
		cascade.SetPrefillMainloop(ws, pp.Mainloop)
	}
	if err := cascadeDev.upload(a.Workspace, a.HostWorkspace, uploadRanges(&l, ws, s), stream); err != nil {
		return CascadePlan{}, c.wrap(err)
	}
	return p, nil
}

// checkWorkspaces checks that both workspaces are given, aligned and large
// enough for layout l.
func (c cascadeCall) checkWorkspaces(a *CascadePlanArgs, l *cascade.Layout, maxBatch int) error {
	if a.HostWorkspace == nil {
		return c.errorf(kverr.NullPointer, "host_workspace must not be NULL")
	}
	if uintptr(unsafe.Pointer(unsafe.SliceData(a.HostWorkspace)))%4 != 0 {
		return c.errorf(kverr.InvalidArgument, "host_workspace must be 4-byte aligned")
	}
	if need := int64(l.HostInts) * 4; int64(len(a.HostWorkspace)) < need {
		return c.errorf(kverr.BufferTooSmall, "host_workspace_bytes is %d; max_batch %d needs %d (kvp_cascade_workspace_size)", len(a.HostWorkspace), maxBatch, need)
	}
	if a.Workspace == 0 {
		return c.errorf(kverr.NullPointer, "workspace must not be 0")
	}
	if a.Workspace%16 != 0 {
		return c.errorf(kverr.InvalidArgument, "workspace must be 16-byte aligned: got %#x", uint64(a.Workspace))
	}
	if a.WorkspaceBytes < l.DeviceBytes {
		return c.errorf(kverr.BufferTooSmall, "workspace_bytes is %d; max_batch %d needs %d (kvp_cascade_workspace_size)", a.WorkspaceBytes, maxBatch, l.DeviceBytes)
	}
	return nil
}

// planSummary plans a gathered batch on the host for its summary alone:
// the plan a device would get, less the workspaces, the device arrays and
// the prefill route's work list (planned on the device), with the chunking
// of cascade.DefaultSlots.
func (c cascadeCall) planSummary(a *CascadePlanArgs, in *cascade.Input, hp *cascade.HostPlanner) (CascadePlan, error) {
	n := len(in.SeqLens)
	in.NumQHeads, in.NumKVHeads, in.HeadDim, in.DTypeBytes = a.NumQHeads, a.NumKVHeads, a.HeadDim, a.DType.Size()
	hopper := cascadeDev.hopper(a.DType, a.HeadDim) && a.Flags&CascadeNoHopper == 0
	in.Headroom, in.NoDecodeRoute, in.PlainPrefillFaster, in.SharedWgmma = a.Headroom, a.Flags&CascadeNoDecodeRoute != 0, hopper, hopper
	maxBatch, maxTokens := a.MaxBatch, a.MaxTokens
	if maxBatch < 0 || maxTokens < 0 {
		return CascadePlan{}, c.errorf(kverr.InvalidArgument, "max_batch and max_tokens must be >= 0: got %d, %d", maxBatch, maxTokens)
	}
	if maxBatch == 0 {
		maxBatch = max(n, 1)
	}
	if a.QOIndptr != nil { // varlen queries; the device copy is not read
		if len(a.QOIndptr) != n+1 {
			return CascadePlan{}, c.errorf(kverr.InvalidArgument, "qo_indptr_host holds %d offsets for a batch of %d", len(a.QOIndptr), n)
		}
		in.QIndptr = a.QOIndptr
		if maxTokens == 0 {
			// No workspace to fit: by default the capacity is the batch's
			// own rows (the planner checks the offsets).
			maxTokens = max(int(in.QIndptr[n]), maxBatch)
		}
	}
	s, err := hp.Plan(in, maxBatch, maxTokens)
	if err != nil {
		return CascadePlan{}, kverr.Wrap(kverr.CodeOf(err), err, "%s", c.op)
	}
	p := newCascadePlan(a, s, maxBatch, in.BlockSize, cascade.DefaultSlots)
	p.Grid = 0 // nothing launches from a summary
	return p, nil
}

// newCascadePlan is the plan of summary s: every field but the workspaces,
// the device sequence lengths and (on the prefill route) the work list's,
// which only a plan into device memory has.
func newCascadePlan(a *CascadePlanArgs, s cascade.Summary, maxBatch, bs, slots int) CascadePlan {
	grid := 0
	if s.Route == cascade.RouteCascade {
		grid = slots
	}
	return CascadePlan{
		PrefillPlan: PrefillPlan{Kind: KindCascade, Route: s.Route,
			PrefillShape: PrefillShape{DType: a.DType, HeadDim: a.HeadDim, NumQHeads: a.NumQHeads,
				NumKVHeads: a.NumKVHeads, WindowLeft: -1},
			Batch: s.Batch, TotalQ: s.Rows, MaxQLen: s.MaxQLen, MaxKVLen: s.MaxKV, NumItems: s.Items, Grid: grid},
		CascadeState: CascadeState{MaxBatch: maxBatch, BlockSize: bs, Parts: s.Parts, Gen: s.Gen,
			SavedTokens: s.SavedTokens, TotalTokens: s.TotalTokens},
	}
}

// hostWords views a host workspace (4-byte aligned, checked by the caller)
// as the int32 words the planner writes.
func hostWords(b []byte) []int32 {
	if len(b) < 4 {
		return nil
	}
	return unsafe.Slice((*int32)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/4)
}

// uploadRanges are the byte ranges of the host workspace that the kernels
// read: the header always; on the cascade route the used items, query rows,
// segment starts, used segments, row map and query starts, as few ranges as
// small gaps allow (each is one copy call).
func uploadRanges(l *cascade.Layout, ws []int32, s cascade.Summary) [][2]int64 {
	ranges := [][2]int64{{0, 4 * int64(l.Items+s.Items*cascade.ItemInts)}}
	if s.Route != cascade.RouteCascade || s.Batch == 0 {
		return ranges
	}
	B := int64(s.Batch)
	words := [][2]int64{
		{int64(l.QRows), int64(s.Rows)},
		{int64(l.SegStart), int64(l.Segs-l.SegStart) + int64(ws[l.SegStart+s.Batch])*cascade.SegInts},
		{int64(l.RowSeq), int64(s.Rows)},
		{int64(l.QStart), B + 1},
	}
	const gap = 1024 // words: below this, copying the gap costs less than a call
	for _, w := range words {
		last := &ranges[len(ranges)-1]
		if end := last[0] + last[1]; 4*w[0]-end <= 4*gap {
			last[1] = 4*(w[0]+w[1]) - last[0]
		} else {
			ranges = append(ranges, [2]int64{4 * w[0], 4 * w[1]})
		}
	}
	return ranges
}

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
	r.ws = hostWords(p.HostWorkspace)
	l, s, fits, err := cascade.ReadPlan(r.ws, p.MaxBatch, p.NumQHeads, p.NumKVHeads, p.HeadDim)
	if err != nil {
		return r, c.wrap(err)
	}
	if !fits {
		return r, c.errorf(kverr.InvalidArgument, "the plan names no host workspace of the plan's size")
	}
	r.l, r.s = l, s
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
			NumItems: p.NumItems, Grid: p.Grid, NumSplits: p.NumSplits, Mainloop: r.s.PrefillMainloop,
			Workspace: parts, WorkspaceBytes: partBytes, KVLens: p.KVLens}
		return pagedPrefill(&pp, a, stream)
	case cascade.RouteDecode:
		d := PagedDecodeArgs{DecodeLayout: cascadeDecodeLayout(p, a),
			Q: a.Q, SeqLens: p.KVLens,
			Out: a.Out, LSE: a.LSE, Sinks: a.Sinks, Workspace: parts, WorkspaceBytes: partBytes, MaxSeqLen: p.MaxKVLen}
		return PagedDecode(&d, stream)
	}
	if r.s.Rows == 0 {
		return nil // no query rows: nothing to compute
	}
	return CascadeRun(&CascadeRunArgs{DecodeLayout: cascadeDecodeLayout(p, a), Rows: r.s.Rows,
		Q: a.Q, SeqLens: p.KVLens,
		Out: a.Out, LSE: a.LSE, Sinks: a.Sinks, Workspace: p.Workspace, WorkspaceBytes: p.WorkspaceBytes,
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

// Launch constants of kvplug_kernels.h, section 5.
const (
	cascadeThreads      = 128 // KVP_CASCADE_THREADS
	cascadeMergeThreads = 128 // KVP_CASCADE_MERGE_THREADS
)

// kvp_cascade_params
type cascadeParams struct {
	KV             pagedKVParams `c:"kv"`
	Q              uint64        `c:"q"`
	SeqLens        uint64        `c:"seq_lens"`
	Out            uint64        `c:"out"`
	LSE            uint64        `c:"lse"`
	Work           uint64        `c:"work"`
	PartOut        uint64        `c:"part_out"`
	PartLSE        uint64        `c:"part_lse"`
	QBatchStride   int64         `c:"q_batch_stride"`
	QHeadStride    int64         `c:"q_head_stride"`
	OutBatchStride int64         `c:"out_batch_stride"`
	OutHeadStride  int64         `c:"out_head_stride"`
	NumQHeads      int32         `c:"num_q_heads"`
	ItemsOff       int32         `c:"items_off"`
	QRowsOff       int32         `c:"qrows_off"`
	SegStartOff    int32         `c:"seg_start_off"`
	SegsOff        int32         `c:"segs_off"`
	MaxBatch       int32         `c:"max_batch"`
	Scale          float32       `c:"scale"`
	RowSeqOff      int32         `c:"rowseq_off"`
	QStartOff      int32         `c:"qstart_off"`
	MaxRows        int32         `c:"max_rows"`
	SkipShared     int32         `c:"skip_shared"`
	Reserved       int32         `c:"reserved"`
	Sinks          uint64        `c:"sinks"`
}

// cascadeKernels[dtype f16/bf16][head_dim index]: attention, merge, the
// shared items on Hopper's wgmma mainloop, and attention and the Hopper
// launch over an e4m3 cache.
var cascadeKernels = func() (t [2][len(headDims)][5]*cuda.Kernel) {
	for di, d := range []DType{F16, BF16} {
		for hi, h := range headDims {
			suffix := "_" + d.String() + "_h" + strconv.Itoa(h)
			e4m3 := "_" + d.String() + "_e4m3_h" + strconv.Itoa(h)
			t[di][hi] = [5]*cuda.Kernel{image.Kernel("kvp_cascade" + suffix), image.Kernel("kvp_cascade_merge" + suffix),
				image.Kernel("kvp_cascade_sm90" + suffix), image.Kernel("kvp_cascade" + e4m3), image.Kernel("kvp_cascade_sm90" + e4m3)}
		}
	}
	return t
}()

// cascadeSharedBytes is kvp_cascade_smem_bytes: the larger of a shared
// item's tile and a decode tail's 16-row decode tile.
func cascadeSharedBytes(headDim int) uint32 {
	stages, D, tq := prefillStages(headDim), uint32(headDim), uint32(cascade.TileQ(headDim))
	return max(tq*D*2+stages*64*D*4+(stages+1)*64*8, decodeSharedBytes(F16, headDim))
}

// cascadeSharedBytesE4M3 is kvp_cascade_smem_bytes_e4m3: the e4m3 tile of
// a shared item's rows (the sm_80 prefill tile's, with cascadeTileQ rows)
// or the e4m3 decode tile.
func cascadeSharedBytesE4M3(headDim int) uint32 {
	tq := uint32(cascade.TileQ(headDim))
	return max(prefillSharedBytesE4M3(headDim)+(tq-64)*uint32(headDim)*2, decodeSharedBytesE4M3(headDim))
}

// cascadeBlocksPerSM is how many attention blocks an SM holds at once (as
// the prefill kernel: registers bound h64/h128, shared memory h256).
func cascadeBlocksPerSM(headDim int) int {
	if headDim <= 128 {
		return 2
	}
	return 1
}

// CheckCascadeDType refuses a dtype the cascade kernels are not built for
// (Unsupported): they take f16 and bf16 only.
func CheckCascadeDType(what string, d DType) error {
	if d != F16 && d != BF16 {
		return kverr.Errorf(kverr.Unsupported, "%s: dtype must be KVP_DTYPE_F16 or KVP_DTYPE_BF16: got %d", what, int32(d))
	}
	return nil
}

// CascadeSlots is how many cascade attention blocks the current context's
// device runs at once: the planner sizes its KV chunks from it, and the
// attention launch's grid is this many blocks.
func CascadeSlots(headDim int) (int, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module("cascade_plan")
	if err != nil {
		return 0, err
	}
	return m.Device().SMs * cascadeBlocksPerSM(headDim), nil
}

// CascadeRunArgs is one layer's run of a cascade plan: the layer's tensors
// (DecodeLayout: Batch sequences, q and out [Rows, num_q_heads, head_dim]
// with QBatchStride / OutBatchStride between rows, the cache, the block
// table) and where the plan's regions sit in the device workspace.
type CascadeRunArgs struct {
	DecodeLayout     // with the caches' and the block table's pointers
	Rows         int // query rows (total_q); 0: Batch (decode)
	Q            cuda.DevicePtr
	SeqLens      cuda.DevicePtr // int32 [batch]: tails end here
	Out          cuda.DevicePtr
	LSE          cuda.DevicePtr // float32 [batch, num_q_heads]; 0: not wanted
	Sinks        cuda.DevicePtr // float32 [num_q_heads] or 0: the merge adds each row's sink

	Workspace      cuda.DevicePtr // the plan at offset 0
	WorkspaceBytes int64
	// Byte offsets of the partial states in the workspace, and of the plan
	// regions in int32 words.
	PartOut, PartLSE                                               int64
	ItemsOff, QRowsOff, SegStartOff, SegsOff, RowSeqOff, QStartOff int
	MaxBatch, MaxRows                                              int // the workspace's capacities (MaxRows 0: MaxBatch)
	// SM80 runs every item on the sm_80 kernels even on a Hopper device
	// (tests: a plan cut for the wgmma mainloop must run there too).
	SM80 bool
}

// CascadeRun enqueues the attention and merge kernels of a cascade plan on
// stream. Both grids depend only on the device, the head shape and the
// workspace's capacity, so a captured pair serves every later plan in the
// same workspace.
func CascadeRun(a *CascadeRunArgs, stream cuda.Stream) error {
	const what = "paged_cascade"
	if _, err := a.validate(); err != nil {
		return err
	}
	rows, maxRows := a.Rows, a.MaxRows
	if rows == 0 {
		rows = a.Batch
	}
	if maxRows == 0 {
		maxRows = a.MaxBatch
	}
	if rows > maxRows || maxRows > 1<<24 {
		return kverr.Errorf(kverr.InvalidArgument, "%s: %d query rows above the workspace's capacity of %d", what, rows, maxRows)
	}
	if rows != a.Batch {
		// q and out hold rows, not sequences: check their extents as such.
		dl := a.DecodeLayout
		dl.Batch = rows
		if _, err := dl.validate(); err != nil {
			return err
		}
	}
	if err := CheckCascadeDType(what, a.DType); err != nil {
		return err
	}
	if a.MaxBatch < a.Batch || a.MaxBatch < 1 || a.PartOut <= 0 || a.PartLSE <= a.PartOut || a.PartLSE > a.WorkspaceBytes ||
		a.PartOut%16 != 0 || a.PartLSE%4 != 0 || min(a.ItemsOff, a.QRowsOff, a.SegStartOff, a.SegsOff, a.RowSeqOff, a.QStartOff) < 0 ||
		int64(max(a.ItemsOff, a.QRowsOff, a.SegStartOff, a.SegsOff, a.RowSeqOff, a.QStartOff))*4 >= a.PartOut {
		return kverr.Errorf(kverr.InvalidArgument, "%s: the plan's workspace geometry is inconsistent (not written by kvp_cascade_plan?)", what)
	}
	kv := &a.PagedKV
	if a.Batch > 0 && (a.Q == 0 || a.Q%16 != 0 || kv.checkPointers(what, true) != nil ||
		a.SeqLens == 0 || a.SeqLens%4 != 0 || a.Out == 0 || a.Out%16 != 0 ||
		a.LSE%4 != 0 || a.Sinks%4 != 0 || a.Workspace == 0 || a.Workspace%16 != 0) {
		// The pointers are named only on failure: a launch allocates nothing.
		return firstErr(
			checkTensor(what+": q", a.Q),
			kv.checkPointers(what, true),
			checkIndex(what+": seq_lens", a.SeqLens),
			checkTensor(what+": out", a.Out),
			aligned(what+": lse", 4, a.LSE),
			aligned(what+": sinks", 4, a.Sinks),
			checkTensor(what+": workspace", a.Workspace),
		)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module(what)
	if err != nil || a.Batch == 0 {
		return err
	}
	p := cascadeParams{
		KV: a.PagedKV.params(a.DType, a.NumKVHeads),
		Q:  uint64(a.Q), SeqLens: uint64(a.SeqLens), Out: uint64(a.Out), LSE: uint64(a.LSE), Work: uint64(a.Workspace),
		PartOut: uint64(a.Workspace) + uint64(a.PartOut), PartLSE: uint64(a.Workspace) + uint64(a.PartLSE),
		QBatchStride: a.QBatchStride, QHeadStride: a.QHeadStride,
		OutBatchStride: a.OutBatchStride, OutHeadStride: a.OutHeadStride,
		NumQHeads: int32(a.NumQHeads),
		ItemsOff:  int32(a.ItemsOff), QRowsOff: int32(a.QRowsOff), SegStartOff: int32(a.SegStartOff), SegsOff: int32(a.SegsOff),
		MaxBatch: int32(a.MaxBatch), Scale: SoftmaxScale(a.Scale, a.HeadDim),
		RowSeqOff: int32(a.RowSeqOff), QStartOff: int32(a.QStartOff), MaxRows: int32(maxRows),
		Sinks: uint64(a.Sinks),
	}
	di := 0
	if a.DType == BF16 {
		di = 1
	}
	hi := 0
	for i, h := range headDims {
		if h == a.HeadDim {
			hi = i
		}
	}
	ks := cascadeKernels[di][hi]
	sms := m.Device().SMs
	attnKernel, attnShared, hopperKernel := ks[0], cascadeSharedBytes(a.HeadDim), ks[2]
	hcfg := prefillSM90Config(m.Device(), a.DType, a.HeadDim)
	if a.PagedKV.E4M3() {
		attnKernel, attnShared, hopperKernel = ks[3], cascadeSharedBytesE4M3(a.HeadDim), ks[4]
		hcfg.Shared = prefillSM90SharedBytesE4M3(a.HeadDim)
		if uint32(m.Device().SharedPerBlockOptin) < hcfg.Shared {
			hcfg.Grid.X = 0 // every item on the sm_80 tiles
		}
	}
	if !a.SM80 && hcfg.Grid.X > 0 {
		// The shared items (and the long tails of a plan cut for it) on the
		// wgmma mainloop first (one block per SM), then the rest; launched
		// whatever the plan holds, so that a captured run serves every
		// later plan.
		if err := cuda.Launch(m, hopperKernel, hcfg, stream, &p); err != nil {
			return err
		}
		p.SkipShared = 1
	}
	cfg := cuda.LaunchConfig{
		Grid:   cuda.Dim3{X: uint32(sms * cascadeBlocksPerSM(a.HeadDim)), Y: 1, Z: 1},
		Block:  cuda.Dim3{X: cascadeThreads, Y: 1, Z: 1},
		Shared: attnShared,
	}
	if err := cuda.Launch(m, attnKernel, cfg, stream, &p); err != nil {
		return err
	}
	// The merge grid depends on the capacity only (graph capture).
	mrows := int64(maxRows) * int64(a.NumQHeads)
	cfg = cuda.LaunchConfig{
		Grid:  cuda.Dim3{X: uint32(min(ceilDiv64(mrows, cascadeMergeThreads/32), int64(sms)*16)), Y: 1, Z: 1},
		Block: cuda.Dim3{X: cascadeMergeThreads, Y: 1, Z: 1},
	}
	return cuda.Launch(m, ks[1], cfg, stream, &p)
}
