package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"math"
	"sync"
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// Shared-prefix attention: the planner (core/cascade) writes into the
// engine's host workspace and the plan is copied into its device workspace;
// the run launches core/attn's cascade kernels (or plain decode, or plain
// prefill planned into the same workspace).

var planners = sync.Pool{New: func() any { return new(cascade.Planner) }}

//export kvp_cascade_workspace_size
func kvp_cascade_workspace_size(maxBatch, qHeads, kvHeads, headDim C.int32_t, deviceBytes, hostBytes *C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	if deviceBytes == nil || hostBytes == nil {
		return failf(kverr.NullPointer, "kvp_cascade_workspace_size: device_bytes and host_bytes must not be NULL")
	}
	d, h, err := cascade.WorkspaceSizes(int(maxBatch), int(maxBatch), int(qHeads), int(kvHeads), int(headDim))
	if err != nil {
		return fail(err)
	}
	*deviceBytes, *hostBytes = C.uint64_t(d), C.uint64_t(h)
	return C.KVP_OK
}

//export kvp_cascade_prefill_workspace_size
func kvp_cascade_prefill_workspace_size(maxBatch, maxTokens, qHeads, kvHeads, headDim C.int32_t, deviceBytes, hostBytes *C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	if deviceBytes == nil || hostBytes == nil {
		return failf(kverr.NullPointer, "kvp_cascade_prefill_workspace_size: device_bytes and host_bytes must not be NULL")
	}
	d, h, err := cascade.WorkspaceSizes(int(maxBatch), int(maxTokens), int(qHeads), int(kvHeads), int(headDim))
	if err != nil {
		return fail(err)
	}
	*deviceBytes, *hostBytes = C.uint64_t(d), C.uint64_t(h)
	return C.KVP_OK
}

// hostWords views a host workspace as int32 words.
func hostWords(p unsafe.Pointer, bytes uint64) []int32 {
	return unsafe.Slice((*int32)(p), int(bytes/4))
}

//export kvp_cascade_plan
func kvp_cascade_plan(ca *C.kvp_cascade_plan_args, plan *C.kvp_attn_plan, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	const what = "kvp_cascade_plan"
	if ca == nil || plan == nil {
		return failf(kverr.NullPointer, "%s: args and plan must not be NULL", what)
	}
	var a C.kvp_cascade_plan_args
	if err := cascadePlanArgsStruct.in(unsafe.Pointer(ca), unsafe.Pointer(&a)); err != nil {
		return fail(err)
	}
	if err := attnPlanStruct.checkSize(plan.struct_size); err != nil {
		return fail(err)
	}
	dt := attn.DType(a.dtype)
	if dt != attn.F16 && dt != attn.BF16 {
		return failf(kverr.Unsupported, "%s: dtype must be KVP_DTYPE_F16 or KVP_DTYPE_BF16: got %d", what, int32(a.dtype))
	}
	if a.flags&^C.KVP_CASCADE_NO_DECODE_ROUTE != 0 {
		return failf(kverr.InvalidArgument, "%s: unknown flags %#x", what, int32(a.flags))
	}
	if a.reserved != 0 {
		return failf(kverr.InvalidArgument, "%s: reserved must be 0", what)
	}
	batch := int(a.batch)
	if batch < 0 || batch > 65535 {
		return failf(kverr.InvalidArgument, "%s: batch must be in [0, 65535]: got %d", what, batch)
	}
	maxBatch := int(a.max_batch)
	if maxBatch == 0 {
		maxBatch = max(batch, 1)
	}
	bs := int(a.block_size)
	if bs == 0 {
		bs = 16
	}
	stride := int64(a.block_table_stride)
	if stride == 0 {
		stride = int64(a.max_blocks_per_seq)
	}
	if stride < 0 || stride > math.MaxInt32 {
		return failf(kverr.InvalidArgument, "%s: block_table_stride must be in [0, 2^31): got %d", what, stride)
	}
	maxTokens := int(a.max_tokens)
	if maxTokens == 0 {
		maxTokens = maxBatch
	}
	l, err := cascade.NewPrefillLayout(maxBatch, maxTokens, int(a.num_q_heads), int(a.num_kv_heads), int(a.head_dim))
	if err != nil {
		return fail(err)
	}
	if a.host_workspace == nil {
		return failf(kverr.NullPointer, "%s: host_workspace must not be NULL", what)
	}
	if uintptr(a.host_workspace)%4 != 0 {
		return failf(kverr.InvalidArgument, "%s: host_workspace must be 4-byte aligned", what)
	}
	if need := uint64(l.HostInts) * 4; uint64(a.host_workspace_bytes) < need {
		return failf(kverr.BufferTooSmall, "%s: host_workspace_bytes is %d; max_batch %d needs %d (kvp_cascade_workspace_size)", what, uint64(a.host_workspace_bytes), maxBatch, need)
	}
	if a.workspace == 0 {
		return failf(kverr.NullPointer, "%s: workspace must not be 0", what)
	}
	if a.workspace%16 != 0 {
		return failf(kverr.InvalidArgument, "%s: workspace must be 16-byte aligned: got %#x", what, uint64(a.workspace))
	}
	if uint64(a.workspace_bytes) < uint64(l.DeviceBytes) {
		return failf(kverr.BufferTooSmall, "%s: workspace_bytes is %d; max_batch %d needs %d (kvp_cascade_workspace_size)", what, uint64(a.workspace_bytes), maxBatch, l.DeviceBytes)
	}
	if uint64(a.workspace_bytes) > math.MaxInt64 || uint64(a.host_workspace_bytes) > math.MaxInt64 {
		return failf(kverr.InvalidArgument, "%s: workspace sizes too large", what)
	}
	var table, lens, qo []int32
	if a.qo_indptr_host != nil {
		if a.qo_indptr == 0 || a.qo_indptr%4 != 0 {
			return failf(kverr.InvalidArgument, "%s: with qo_indptr_host, qo_indptr must be a 4-byte aligned device pointer: got %#x", what, uint64(a.qo_indptr))
		}
		qo = unsafe.Slice((*int32)(unsafe.Pointer(a.qo_indptr_host)), batch+1)
	}
	if batch > 0 {
		if a.block_table_host == nil || a.seq_lens_host == nil {
			return failf(kverr.NullPointer, "%s: block_table_host and seq_lens_host must not be NULL", what)
		}
		if a.seq_lens == 0 || a.seq_lens%4 != 0 {
			return failf(kverr.InvalidArgument, "%s: seq_lens must be a 4-byte aligned device pointer: got %#x", what, uint64(a.seq_lens))
		}
		if a.max_blocks_per_seq < 1 || int64(a.max_blocks_per_seq) > stride {
			return failf(kverr.InvalidArgument, "%s: max_blocks_per_seq must be in [1, block_table_stride = %d]: got %d", what, stride, int32(a.max_blocks_per_seq))
		}
		n := int64(batch-1)*stride + int64(a.max_blocks_per_seq)
		table = unsafe.Slice((*int32)(unsafe.Pointer(a.block_table_host)), n)
		lens = unsafe.Slice((*int32)(unsafe.Pointer(a.seq_lens_host)), batch)
	} else {
		lens = []int32{}
		stride = max(stride, 1) // an empty batch reads no table
	}
	slots, err := attn.CascadeSlots(int(a.head_dim))
	if err != nil {
		return fail(err)
	}
	in := cascade.Input{NumQHeads: int(a.num_q_heads), NumKVHeads: int(a.num_kv_heads), HeadDim: int(a.head_dim),
		DTypeBytes: dt.Size(), BlockSize: bs, Tables: table, TableStride: int(stride),
		MaxBlocksPerSeq: max(int(a.max_blocks_per_seq), 1), SeqLens: lens, QIndptr: qo, Slots: slots, Headroom: int(a.headroom),
		NoDecodeRoute: a.flags&C.KVP_CASCADE_NO_DECODE_ROUTE != 0}
	ws := hostWords(a.host_workspace, uint64(a.host_workspace_bytes))
	pl := planners.Get().(*cascade.Planner)
	s, err := pl.Plan(&in, &l, ws)
	planners.Put(pl)
	if err != nil {
		return fail(err)
	}
	out := cascadePlanStruct(&a, s, maxBatch, bs, slots)
	if s.Route == cascade.RoutePrefill {
		// The prefill kernel's work list goes where the partial states
		// would: the plan kernel writes it on stream.
		pp, err := attn.PlanPrefill(&attn.PrefillPlanArgs{
			PrefillShape: attn.PrefillShape{DType: dt, HeadDim: int(a.head_dim), NumQHeads: int(a.num_q_heads),
				NumKVHeads: int(a.num_kv_heads), WindowLeft: -1},
			QOIndptr: qo, KVLens: lens, QOIndptrDev: cuda.DevicePtr(a.qo_indptr), KVLensDev: cuda.DevicePtr(a.seq_lens),
			Workspace:      cuda.DevicePtr(a.workspace) + cuda.DevicePtr(l.PartOut),
			WorkspaceBytes: l.DeviceBytes - l.PartOut, Flags: attn.PrefillNoDecodeRoute,
		}, cuda.Stream(stream))
		if err != nil {
			return fail(err)
		}
		out.num_items, out.grid, out.num_splits = C.int32_t(pp.NumItems), C.int32_t(pp.Grid), C.int32_t(pp.NumSplits)
	}
	if err := attn.CascadeUpload(cuda.DevicePtr(a.workspace), a.host_workspace, uploadRanges(&l, ws, s), cuda.Stream(stream)); err != nil {
		return fail(err)
	}
	return fail(attnPlanStruct.out(unsafe.Pointer(plan), unsafe.Pointer(&out)))
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

// cascadePlanStruct is the kvp_attn_plan of a cascade plan (the header's
// section on shared-prefix attention lists the fields).
func cascadePlanStruct(a *C.kvp_cascade_plan_args, s cascade.Summary, maxBatch, bs, slots int) C.kvp_attn_plan {
	grid := 0
	if s.Route == cascade.RouteCascade {
		grid = slots
	}
	p := C.kvp_attn_plan{
		struct_size: C.size_t(unsafe.Sizeof(C.kvp_attn_plan{})), kind: C.KVP_ATTN_PLAN_CASCADE, route: C.int32_t(s.Route),
		dtype: a.dtype, head_dim: a.head_dim, num_q_heads: a.num_q_heads, num_kv_heads: a.num_kv_heads,
		window_left: -1, batch: C.int32_t(s.Batch), total_q: C.int32_t(s.Rows), max_q_len: C.int32_t(s.MaxQLen),
		max_kv_len: C.int32_t(s.MaxKV), num_items: C.int32_t(s.Items), grid: C.int32_t(grid),
		workspace: a.workspace, workspace_bytes: a.workspace_bytes, kv_lens: a.seq_lens,
	}
	p.reserved[0] = C.uint64_t(uintptr(a.host_workspace))
	p.reserved[1] = a.host_workspace_bytes
	p.reserved[2] = C.uint64_t(uint64(maxBatch) | uint64(bs)<<32)
	p.reserved[3] = C.uint64_t(uint64(uint32(s.Parts)) | uint64(uint32(s.Gen))<<32)
	p.reserved[4] = C.uint64_t(s.SavedTokens)
	p.reserved[5] = C.uint64_t(s.TotalTokens)
	return p
}

// cascadePlan is what a kvp_attn_plan of kind cascade says, checked
// against the host workspace it names.
type cascadePlan struct {
	route, batch, maxBatch, blockSize, maxKV int
	gen                                      int32
	l                                        cascade.Layout
	ws                                       []int32
	s                                        cascade.Summary
}

func readCascadePlan(what string, plan *C.kvp_attn_plan) (cascadePlan, error) {
	var p cascadePlan
	if err := attnPlanStruct.checkSize(plan.struct_size); err != nil {
		return p, err
	}
	if plan.kind != C.KVP_ATTN_PLAN_CASCADE {
		return p, kverr.Errorf(kverr.InvalidArgument, "%s: the plan's kind is %d; plan it with kvp_cascade_plan", what, int32(plan.kind))
	}
	p.route, p.batch, p.maxKV = int(plan.route), int(plan.batch), int(plan.max_kv_len)
	p.maxBatch, p.blockSize = int(uint32(plan.reserved[2])), int(uint32(plan.reserved[2]>>32))
	p.gen = int32(uint32(plan.reserved[3] >> 32))
	if p.route != cascade.RouteCascade && p.route != cascade.RouteDecode && p.route != cascade.RoutePrefill {
		return p, kverr.Errorf(kverr.InvalidArgument, "%s: the plan's route is %d (written by kvp_cascade_plan only)", what, p.route)
	}
	if p.batch < 0 || p.batch > p.maxBatch {
		return p, kverr.Errorf(kverr.InvalidArgument, "%s: the plan's batch %d is outside [0, max_batch %d]", what, p.batch, p.maxBatch)
	}
	var err error
	if p.l, err = cascade.NewLayout(p.maxBatch, int(plan.num_q_heads), int(plan.num_kv_heads), int(plan.head_dim)); err != nil {
		return p, err
	}
	// reserved[0] holds the host workspace's address (64-bit targets only).
	host := *(*unsafe.Pointer)(unsafe.Pointer(&plan.reserved[0]))
	if host == nil || uint64(plan.reserved[1]) < uint64(p.l.HostInts)*4 {
		return p, kverr.Errorf(kverr.InvalidArgument, "%s: the plan names no host workspace of the plan's size", what)
	}
	p.ws = hostWords(host, uint64(plan.reserved[1]))
	// The query-row capacity is the plan's (its header): the layout again
	// with it, and the workspace checked against that.
	if p.l, err = cascade.PlanLayout(p.ws, p.maxBatch, int(plan.num_q_heads), int(plan.num_kv_heads), int(plan.head_dim)); err != nil {
		return p, err
	}
	if uint64(plan.reserved[1]) < uint64(p.l.HostInts)*4 {
		return p, kverr.Errorf(kverr.InvalidArgument, "%s: the plan names no host workspace of the plan's size", what)
	}
	if p.s, err = cascade.Header(p.ws, &p.l); err != nil {
		return p, err
	}
	if p.s.Gen != p.gen || p.s.Batch != p.batch || p.s.Route != p.route || p.s.Rows != int(plan.total_q) {
		return p, kverr.Errorf(kverr.InvalidArgument, "%s: stale plan: its workspaces were planned again since (generation %d, batch %d; the workspaces hold generation %d, batch %d)",
			what, p.gen, p.batch, p.s.Gen, p.s.Batch)
	}
	return p, nil
}

//export kvp_cascade_update
func kvp_cascade_update(plan *C.kvp_attn_plan, seqLens *C.int32_t, batch C.int32_t, fits *C.int32_t) (st C.kvp_status) {
	defer guard(&st)
	const what = "kvp_cascade_update"
	if plan == nil || fits == nil || (seqLens == nil && batch > 0) {
		return failf(kverr.NullPointer, "%s: plan, seq_lens_host and fits must not be NULL", what)
	}
	p, err := readCascadePlan(what, plan)
	if err != nil {
		return fail(err)
	}
	if int(batch) != p.batch {
		return failf(kverr.InvalidArgument, "%s: batch %d differs from the plan's %d", what, int32(batch), p.batch)
	}
	lens := []int32{}
	if batch > 0 {
		lens = unsafe.Slice((*int32)(unsafe.Pointer(seqLens)), int(batch))
	}
	ok, err := cascade.Update(p.ws, &p.l, p.route, p.batch, lens)
	if err != nil {
		return fail(err)
	}
	*fits = 0
	if ok {
		*fits = 1
	}
	return C.KVP_OK
}

//export kvp_paged_cascade
func kvp_paged_cascade(plan *C.kvp_attn_plan, a *C.kvp_paged_prefill_args, stream C.uint64_t) (st C.kvp_status) {
	defer guard(&st)
	const what = "kvp_paged_cascade"
	if plan == nil || a == nil {
		return failf(kverr.NullPointer, "%s: plan and args must not be NULL", what)
	}
	var args C.kvp_paged_prefill_args
	if err := pagedPrefillArgsStruct.in(unsafe.Pointer(a), unsafe.Pointer(&args)); err != nil {
		return fail(err)
	}
	a = &args
	if a.reserved != 0 || a.reserved2 != 0 {
		return failf(kverr.InvalidArgument, "%s: reserved fields must be 0", what)
	}
	p, err := readCascadePlan(what, plan)
	if err != nil {
		return fail(err)
	}
	if int(a.block_size) != p.blockSize {
		return failf(kverr.InvalidArgument, "%s: block_size %d differs from the %d the plan read the tables with", what, int32(a.block_size), p.blockSize)
	}
	if int64(a.max_blocks_per_seq)*int64(a.block_size) < int64(p.maxKV) {
		return failf(kverr.InvalidArgument, "%s: the plan's sequences reach %d tokens; the block table holds %d blocks of %d", what, p.maxKV, int32(a.max_blocks_per_seq), int32(a.block_size))
	}
	if uint64(plan.workspace_bytes) > math.MaxInt64 || int64(plan.workspace_bytes) < p.l.DeviceBytes {
		return failf(kverr.BufferTooSmall, "%s: the plan's workspace_bytes %d is below the %d its max_batch needs", what, uint64(plan.workspace_bytes), p.l.DeviceBytes)
	}
	dl := attn.DecodeLayout{
		DType: attn.DType(plan.dtype), HeadDim: int(plan.head_dim), Batch: p.batch,
		NumQHeads: int(plan.num_q_heads), NumKVHeads: int(plan.num_kv_heads),
		QBatchStride: int64(a.q_token_stride), QHeadStride: int64(a.q_head_stride),
		OutBatchStride: int64(a.out_token_stride), OutHeadStride: int64(a.out_head_stride),
		NumBlocks: int(a.num_blocks), BlockSize: int(a.block_size),
		CacheBlockStride: int64(a.cache_block_stride), CacheTokenStride: int64(a.cache_token_stride),
		CacheHeadStride: int64(a.cache_head_stride),
		MaxBlocksPerSeq: int(a.max_blocks_per_seq), BlockTableStride: int64(a.block_table_stride), Scale: float32(a.scale),
	}
	ws := cuda.DevicePtr(plan.workspace)
	if p.route == cascade.RoutePrefill {
		pp := attn.PrefillPlan{Kind: attn.KindPrefill, Route: attn.RoutePrefill,
			PrefillShape: attn.PrefillShape{DType: dl.DType, HeadDim: dl.HeadDim, NumQHeads: dl.NumQHeads, NumKVHeads: dl.NumKVHeads, WindowLeft: -1},
			Batch:        p.batch, TotalQ: p.s.Rows, MaxQLen: p.s.MaxQLen, MaxKVLen: p.maxKV,
			NumItems: int(plan.num_items), Grid: int(plan.grid), NumSplits: int(plan.num_splits),
			Mainloop:  attn.DefaultPrefillMainloop(dl.DType, dl.HeadDim),
			Workspace: ws + cuda.DevicePtr(p.l.PartOut), WorkspaceBytes: p.l.DeviceBytes - p.l.PartOut,
			KVLens: cuda.DevicePtr(plan.kv_lens)}
		pa := attn.PagedPrefillArgs{PrefillLayout: attn.PrefillLayout{
			QTokenStride: dl.QBatchStride, QHeadStride: dl.QHeadStride,
			OutTokenStride: dl.OutBatchStride, OutHeadStride: dl.OutHeadStride,
			NumBlocks: dl.NumBlocks, BlockSize: dl.BlockSize,
			CacheBlockStride: dl.CacheBlockStride, CacheTokenStride: dl.CacheTokenStride, CacheHeadStride: dl.CacheHeadStride,
			MaxBlocksPerSeq: dl.MaxBlocksPerSeq, BlockTableStride: dl.BlockTableStride, Scale: dl.Scale},
			Q: cuda.DevicePtr(a.q), KCache: cuda.DevicePtr(a.k_cache), VCache: cuda.DevicePtr(a.v_cache),
			BlockTable: cuda.DevicePtr(a.block_table), Out: cuda.DevicePtr(a.out), LSE: cuda.DevicePtr(a.lse)}
		return fail(attn.PagedPrefill(&pp, &pa, cuda.Stream(stream)))
	}
	if p.route == cascade.RouteDecode {
		d := attn.PagedDecodeArgs{DecodeLayout: dl,
			Q: cuda.DevicePtr(a.q), KCache: cuda.DevicePtr(a.k_cache), VCache: cuda.DevicePtr(a.v_cache),
			BlockTable: cuda.DevicePtr(a.block_table), SeqLens: cuda.DevicePtr(plan.kv_lens),
			Out: cuda.DevicePtr(a.out), LSE: cuda.DevicePtr(a.lse),
			// The partial-state region doubles as the split-KV workspace.
			Workspace: ws + cuda.DevicePtr(p.l.PartOut), WorkspaceBytes: p.l.DeviceBytes - p.l.PartOut,
			MaxSeqLen: p.maxKV}
		return fail(attn.PagedDecode(&d, cuda.Stream(stream)))
	}
	if p.s.Rows == 0 {
		return C.KVP_OK // no query rows: nothing to compute
	}
	r := attn.CascadeRunArgs{DecodeLayout: dl, Rows: p.s.Rows,
		Q: cuda.DevicePtr(a.q), KCache: cuda.DevicePtr(a.k_cache), VCache: cuda.DevicePtr(a.v_cache),
		BlockTable: cuda.DevicePtr(a.block_table), SeqLens: cuda.DevicePtr(plan.kv_lens),
		Out: cuda.DevicePtr(a.out), LSE: cuda.DevicePtr(a.lse),
		Workspace: ws, WorkspaceBytes: int64(plan.workspace_bytes),
		PartOut: p.l.PartOut, PartLSE: p.l.PartLSE,
		ItemsOff: p.l.Items, QRowsOff: p.l.QRows, SegStartOff: p.l.SegStart, SegsOff: p.l.Segs,
		RowSeqOff: p.l.RowSeq, QStartOff: p.l.QStart, MaxBatch: p.maxBatch, MaxRows: p.l.MaxTokens}
	return fail(attn.CascadeRun(&r, cuda.Stream(stream)))
}
