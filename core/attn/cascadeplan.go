package attn

// Shared-prefix ("cascade") plans: a batch planned by core/cascade (a pure
// host planner) into the engine's workspaces, with the plan's copy to the
// device, or on the prefill route the prefill planner's work list. The
// plan is a PrefillPlan of kind KindCascade with the State that Update and
// Run (cascaderun.go) read back; the prefill and decode routes run on
// PagedPrefill and PagedDecode, the cascade route on CascadeRun.
//
// Messages name the C entry point (kvp_cascade_plan and so on), the name
// under which the header documents each check.

import (
	"math"
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
	Flags                   int   // 0 or CascadeNoDecodeRoute
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
	// slots is how many cascade attention blocks the device runs at once.
	slots(headDim int) (int, error)
	// planPrefill enqueues the prefill kernel's work list.
	planPrefill(a *PrefillPlanArgs, stream cuda.Stream) (PrefillPlan, error)
	// upload enqueues copies of the host plan's byte ranges into the device
	// workspace at the same offsets.
	upload(dst cuda.DevicePtr, src []byte, ranges [][2]int64, stream cuda.Stream) error
	// prefillMainloop is the kernel the prefill route runs on this device
	// (MainloopSM80 or MainloopSM90).
	prefillMainloop(d DType, headDim int) int
}

// gpu is the device of the calling thread's current CUDA context.
type gpu struct{}

func (gpu) slots(headDim int) (int, error) { return CascadeSlots(headDim) }

func (gpu) planPrefill(a *PrefillPlanArgs, stream cuda.Stream) (PrefillPlan, error) {
	return PlanPrefill(a, stream)
}

func (gpu) upload(dst cuda.DevicePtr, src []byte, ranges [][2]int64, stream cuda.Stream) error {
	return cascadeUpload(dst, src, ranges, stream)
}

func (gpu) prefillMainloop(d DType, headDim int) int { return DefaultPrefillMainloop(d, headDim) }

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
		if a.Flags&^CascadeNoDecodeRoute != 0 {
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
	if a.Flags&^CascadeNoDecodeRoute != 0 {
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
	slots, err := cascadeDev.slots(a.HeadDim)
	if err != nil {
		return CascadePlan{}, c.wrap(err)
	}
	lens := a.SeqLens
	if lens == nil {
		lens = []int32{}
	}
	hopper := cascadeDev.prefillMainloop(a.DType, a.HeadDim) == MainloopSM90
	in := cascade.Input{NumQHeads: a.NumQHeads, NumKVHeads: a.NumKVHeads, HeadDim: a.HeadDim,
		DTypeBytes: a.DType.Size(), BlockSize: bs, Tables: table, TableStride: int(stride),
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
		pp, err := cascadeDev.planPrefill(&PrefillPlanArgs{
			PrefillShape: p.PrefillShape,
			QOIndptr:     qo, KVLens: lens, QOIndptrDev: a.QOIndptrDev, KVLensDev: a.SeqLensDev,
			Workspace:      a.Workspace + cuda.DevicePtr(l.PartOut),
			WorkspaceBytes: l.DeviceBytes - l.PartOut, Flags: PrefillNoDecodeRoute,
		}, stream)
		if err != nil {
			return CascadePlan{}, c.wrap(err)
		}
		p.NumItems, p.Grid, p.NumSplits = pp.NumItems, pp.Grid, pp.NumSplits
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
	hopper := cascadeDev.prefillMainloop(a.DType, a.HeadDim) == MainloopSM90
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
