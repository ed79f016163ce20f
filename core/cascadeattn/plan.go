// Package cascadeattn is shared-prefix ("cascade") attention on the device,
// from a batch to a layer's output: it plans a batch with core/cascade into
// the engine's workspaces (the plan on the host, its copy to the device, or
// on the prefill route the prefill kernel's work list), tells whether a batch
// that only grew still fits its plan, and runs one layer of a plan with
// core/attn's kernels. It is what kvp_cascade_plan, kvp_cascade_update,
// kvp_paged_cascade and kvp_manager_cascade_plan do; the C ABI only
// translates their structs to and from these types.
//
// Messages name the C entry point (kvp_cascade_plan and so on), the name
// under which the header documents each check.
package cascadeattn

import (
	"math"
	"sync"
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
)

// KindCascade is a cascade plan's kvp_attn_plan.kind (KVP_ATTN_PLAN_CASCADE).
const KindCascade = 2

// FlagNoDecodeRoute keeps a plan on the cascade (or prefill) kernels when
// sharing does not pay, so that one captured graph serves every batch
// (KVP_CASCADE_NO_DECODE_ROUTE).
const FlagNoDecodeRoute = 1

// defaultBlockSize is the block size of PlanArgs.BlockSize 0.
const defaultBlockSize = 16

// PlanArgs is a batch to plan (kvp_cascade_plan_args). The host arrays are
// given by their first element, as the C ABI gives them: how many elements
// are read follows from Batch, BlockTableStride and MaxBlocksPerSeq, which
// Plan checks before it reads any. Zero values are the header's defaults.
type PlanArgs struct {
	DType                          attn.DType // f16 or bf16
	HeadDim, NumQHeads, NumKVHeads int
	Batch                          int // sequences, in [0, MaxBatch]
	MaxBatch                       int // the workspaces' capacity; 0: Batch (at least 1)
	MaxTokens                      int // their query-row capacity; 0: MaxBatch
	BlockSize                      int // 0: 16
	MaxBlocksPerSeq                int // block table columns read
	BlockTableStride               int64
	BlockTableHost                 *int32 // [Batch, BlockTableStride]
	SeqLensHost                    *int32 // [Batch], this step's tokens included
	QOIndptrHost                   *int32 // [Batch+1] varlen query offsets; nil: one query token per sequence
	SeqLens, QOIndptr              cuda.DevicePtr
	HostWorkspace                  unsafe.Pointer // 4-byte aligned; pinned, since the copy is asynchronous
	HostWorkspaceBytes             uint64
	Workspace                      cuda.DevicePtr // 16-byte aligned
	WorkspaceBytes                 uint64
	Flags                          int // 0 or FlagNoDecodeRoute
	Headroom                       int // tokens each tail may grow before a new plan is needed; 0: 64
}

// Plan is a planned batch as kvp_attn_plan holds it: the fields it shares
// with a prefill plan (Kind KindCascade, the route, the shape, the batch's
// rows and lengths, the workspace, the device sequence lengths as KVLens)
// and the State that Update and Run read back.
type Plan struct {
	attn.PrefillPlan
	State
}

// State is what a cascade plan carries beyond a prefill plan's fields:
// where its host workspace is, the capacity and block size it was planned
// for, its generation in the workspaces (a later plan makes it stale) and
// the sharing it found. kvp_attn_plan holds it in its six plan-state words
// (PlanState).
type State struct {
	HostWorkspace      unsafe.Pointer
	HostWorkspaceBytes uint64
	MaxBatch           int
	BlockSize          int
	Parts              int   // partial states in use
	Gen                int32 // plans made into the workspaces before this one
	SavedTokens        int64 // KV tokens per kv head the shared reads save
	TotalTokens        int64 // KV tokens per kv head plain attention reads
}

// The plan-state words (kvp_attn_plan.state[KVP_PLAN_STATE_*]).
const (
	WordHostWorkspace      = 0 // the host workspace's address
	WordHostWorkspaceBytes = 1
	WordCapacity           = 2 // max_batch | block_size << 32
	WordGeneration         = 3 // parts | generation << 32
	WordSavedTokens        = 4
	WordTotalTokens        = 5
)

// PlanState packs p's State into kvp_attn_plan's plan-state words (a
// cascade plan's words, not the prefill plan's it embeds).
func (p *Plan) PlanState() [6]uint64 { return p.State.words() }

// SetPlanState unpacks plan-state words that PlanState packed.
func (p *Plan) SetPlanState(w *[6]uint64) { p.State = stateOf(w) }

func (s *State) words() [6]uint64 {
	var w [6]uint64
	w[WordHostWorkspace] = uint64(uintptr(s.HostWorkspace))
	w[WordHostWorkspaceBytes] = s.HostWorkspaceBytes
	w[WordCapacity] = uint64(uint32(s.MaxBatch)) | uint64(uint32(s.BlockSize))<<32
	w[WordGeneration] = uint64(uint32(s.Parts)) | uint64(uint32(s.Gen))<<32
	w[WordSavedTokens], w[WordTotalTokens] = uint64(s.SavedTokens), uint64(s.TotalTokens)
	return w
}

func stateOf(w *[6]uint64) State {
	return State{
		// The address word read as a pointer (64-bit targets only).
		HostWorkspace:      *(*unsafe.Pointer)(unsafe.Pointer(&w[WordHostWorkspace])),
		HostWorkspaceBytes: w[WordHostWorkspaceBytes],
		MaxBatch:           int(uint32(w[WordCapacity])), BlockSize: int(uint32(w[WordCapacity] >> 32)),
		Parts: int(uint32(w[WordGeneration])), Gen: int32(uint32(w[WordGeneration] >> 32)),
		SavedTokens: int64(w[WordSavedTokens]), TotalTokens: int64(w[WordTotalTokens]),
	}
}

// planners are the host planners' scratch memory, pooled so that a step
// allocates nothing once the pool has grown to its batches.
var planners = sync.Pool{New: func() any { return new(cascade.Planner) }}

// PlanBatch plans the batch a describes into its workspaces: the host plan, and
// on stream its copy into the device workspace or, on the prefill route, the
// prefill kernel's work list where the partial states would be. On an
// argument or planning error the workspaces are left as they were; an error
// of the device work (NoDevice, CUDA) leaves the host workspace holding the
// new plan (kvp_cascade_plan's header comment).
func PlanBatch(a *PlanArgs, stream cuda.Stream) (Plan, error) {
	pl := planners.Get().(*cascade.Planner)
	defer planners.Put(pl)
	return plan(call{op: "kvp_cascade_plan"}, a, pl, stream)
}

func plan(c call, a *PlanArgs, pl *cascade.Planner, stream cuda.Stream) (Plan, error) {
	if err := attn.CheckCascadeDType(c.op, a.DType); err != nil {
		return Plan{}, err
	}
	if a.Flags&^FlagNoDecodeRoute != 0 {
		return Plan{}, c.errorf(kverr.InvalidArgument, "unknown flags %#x", a.Flags)
	}
	batch := a.Batch
	if err := limits.Range(c.op+": batch", batch, 0, limits.AttnBatch); err != nil {
		return Plan{}, err
	}
	maxBatch := a.MaxBatch
	if maxBatch == 0 {
		maxBatch = max(batch, 1)
	}
	bs := a.BlockSize
	if bs == 0 {
		bs = defaultBlockSize
	}
	stride := a.BlockTableStride
	if stride == 0 {
		stride = int64(a.MaxBlocksPerSeq)
	}
	if stride < 0 || stride > math.MaxInt32 {
		return Plan{}, c.errorf(kverr.InvalidArgument, "block_table_stride must be in [0, 2^31): got %d", stride)
	}
	maxTokens := a.MaxTokens
	if maxTokens == 0 {
		maxTokens = maxBatch
	}
	l, err := cascade.NewPrefillLayout(maxBatch, maxTokens, a.NumQHeads, a.NumKVHeads, a.HeadDim)
	if err != nil {
		return Plan{}, c.wrap(err)
	}
	wsBytes, err := c.checkWorkspaces(a, &l, maxBatch)
	if err != nil {
		return Plan{}, err
	}
	var table, lens, qo []int32
	if a.QOIndptrHost != nil {
		if a.QOIndptr == 0 || a.QOIndptr%4 != 0 {
			return Plan{}, c.errorf(kverr.InvalidArgument, "with qo_indptr_host, qo_indptr must be a 4-byte aligned device pointer: got %#x", uint64(a.QOIndptr))
		}
		qo = unsafe.Slice(a.QOIndptrHost, batch+1)
	}
	if batch > 0 {
		if a.BlockTableHost == nil || a.SeqLensHost == nil {
			return Plan{}, c.errorf(kverr.NullPointer, "block_table_host and seq_lens_host must not be NULL")
		}
		if a.SeqLens == 0 || a.SeqLens%4 != 0 {
			return Plan{}, c.errorf(kverr.InvalidArgument, "seq_lens must be a 4-byte aligned device pointer: got %#x", uint64(a.SeqLens))
		}
		if a.MaxBlocksPerSeq < 1 || int64(a.MaxBlocksPerSeq) > stride {
			return Plan{}, c.errorf(kverr.InvalidArgument, "max_blocks_per_seq must be in [1, block_table_stride = %d]: got %d", stride, a.MaxBlocksPerSeq)
		}
		table = unsafe.Slice(a.BlockTableHost, int64(batch-1)*stride+int64(a.MaxBlocksPerSeq))
		lens = unsafe.Slice(a.SeqLensHost, batch)
	} else {
		lens = []int32{}
		stride = max(stride, 1) // an empty batch reads no table
	}
	slots, err := dev.slots(a.HeadDim)
	if err != nil {
		return Plan{}, c.wrap(err)
	}
	in := cascade.Input{NumQHeads: a.NumQHeads, NumKVHeads: a.NumKVHeads, HeadDim: a.HeadDim,
		DTypeBytes: a.DType.Size(), BlockSize: bs, Tables: table, TableStride: int(stride),
		MaxBlocksPerSeq: max(a.MaxBlocksPerSeq, 1), SeqLens: lens, QIndptr: qo, Slots: slots, Headroom: a.Headroom,
		NoDecodeRoute:      a.Flags&FlagNoDecodeRoute != 0,
		PlainPrefillFaster: dev.prefillMainloop(a.DType, a.HeadDim) == attn.MainloopSM90,
		SharedWgmma:        dev.prefillMainloop(a.DType, a.HeadDim) == attn.MainloopSM90}
	ws := hostWords(a.HostWorkspace, a.HostWorkspaceBytes)
	s, err := pl.Plan(&in, &l, ws)
	if err != nil {
		return Plan{}, c.wrap(err)
	}
	p := newPlan(a, s, maxBatch, bs, slots)
	p.Workspace, p.WorkspaceBytes, p.KVLens = a.Workspace, wsBytes, a.SeqLens
	p.HostWorkspace, p.HostWorkspaceBytes = a.HostWorkspace, a.HostWorkspaceBytes
	if s.Route == cascade.RoutePrefill {
		// The prefill kernel's work list goes where the partial states
		// would: the plan kernel writes it on stream.
		pp, err := dev.planPrefill(&attn.PrefillPlanArgs{
			PrefillShape: p.PrefillShape,
			QOIndptr:     qo, KVLens: lens, QOIndptrDev: a.QOIndptr, KVLensDev: a.SeqLens,
			Workspace:      a.Workspace + cuda.DevicePtr(l.PartOut),
			WorkspaceBytes: l.DeviceBytes - l.PartOut, Flags: attn.PrefillNoDecodeRoute,
		}, stream)
		if err != nil {
			return Plan{}, c.wrap(err)
		}
		p.NumItems, p.Grid, p.NumSplits = pp.NumItems, pp.Grid, pp.NumSplits
	}
	if err := dev.upload(a.Workspace, a.HostWorkspace, uploadRanges(&l, ws, s), stream); err != nil {
		return Plan{}, c.wrap(err)
	}
	return p, nil
}

// checkWorkspaces checks that both workspaces are given, aligned and large
// enough for layout l, and returns the device workspace's bytes.
func (c call) checkWorkspaces(a *PlanArgs, l *cascade.Layout, maxBatch int) (int64, error) {
	if a.HostWorkspace == nil {
		return 0, c.errorf(kverr.NullPointer, "host_workspace must not be NULL")
	}
	if uintptr(a.HostWorkspace)%4 != 0 {
		return 0, c.errorf(kverr.InvalidArgument, "host_workspace must be 4-byte aligned")
	}
	if need := uint64(l.HostInts) * 4; a.HostWorkspaceBytes < need {
		return 0, c.errorf(kverr.BufferTooSmall, "host_workspace_bytes is %d; max_batch %d needs %d (kvp_cascade_workspace_size)", a.HostWorkspaceBytes, maxBatch, need)
	}
	if a.Workspace == 0 {
		return 0, c.errorf(kverr.NullPointer, "workspace must not be 0")
	}
	if a.Workspace%16 != 0 {
		return 0, c.errorf(kverr.InvalidArgument, "workspace must be 16-byte aligned: got %#x", uint64(a.Workspace))
	}
	if a.WorkspaceBytes < uint64(l.DeviceBytes) {
		return 0, c.errorf(kverr.BufferTooSmall, "workspace_bytes is %d; max_batch %d needs %d (kvp_cascade_workspace_size)", a.WorkspaceBytes, maxBatch, l.DeviceBytes)
	}
	if _, err := limits.ByteCount(c.op+": host_workspace_bytes", a.HostWorkspaceBytes); err != nil {
		return 0, err
	}
	return limits.ByteCount(c.op+": workspace_bytes", a.WorkspaceBytes)
}

// newPlan is the plan of summary s: every field but the workspaces, the
// device sequence lengths and (on the prefill route) the work list's,
// which only a plan into device memory has.
func newPlan(a *PlanArgs, s cascade.Summary, maxBatch, bs, slots int) Plan {
	grid := 0
	if s.Route == cascade.RouteCascade {
		grid = slots
	}
	return Plan{
		PrefillPlan: attn.PrefillPlan{Kind: KindCascade, Route: s.Route,
			PrefillShape: attn.PrefillShape{DType: a.DType, HeadDim: a.HeadDim, NumQHeads: a.NumQHeads,
				NumKVHeads: a.NumKVHeads, WindowLeft: -1},
			Batch: s.Batch, TotalQ: s.Rows, MaxQLen: s.MaxQLen, MaxKVLen: s.MaxKV, NumItems: s.Items, Grid: grid},
		State: State{MaxBatch: maxBatch, BlockSize: bs, Parts: s.Parts, Gen: s.Gen,
			SavedTokens: s.SavedTokens, TotalTokens: s.TotalTokens},
	}
}

// hostWords views a host workspace as int32 words.
func hostWords(p unsafe.Pointer, bytes uint64) []int32 {
	if p == nil {
		return nil
	}
	return unsafe.Slice((*int32)(p), int(bytes/4))
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
