package attn

// Paged prefill / extend attention: plan once per batch composition, run per
// layer. The plan checks the batch's host-side lengths, decides the route
// (the decode kernel for a batch of one-token queries, the prefill kernel
// otherwise) and, for the prefill route, launches the plan kernel that writes
// the work list into the engine's workspace. The run checks the layer's
// tensors against the plan and launches: no host work beyond that, no
// allocation, no synchronisation.

import (
	"math"
	"runtime"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// Plan kinds (kvp_attn_plan.kind) and routes (kvp_attn_plan.route).
const (
	KindPrefill  = 1 // KVP_ATTN_PLAN_PREFILL
	RoutePrefill = 1 // KVP_ATTN_ROUTE_PREFILL: the prefill kernel over the work list
	RouteDecode  = 2 // KVP_ATTN_ROUTE_DECODE: one q_len <= 16 for every sequence; the decode kernel
)

// Plan flags (kvp_prefill_plan_args.flags). PrefillNoDecodeRoute keeps a
// batch of one-token queries on the prefill kernel and PrefillNoSplitKV
// keeps every plan at one split, so that one captured graph serves any
// batch composition.
const (
	PrefillNoDecodeRoute = 1
	PrefillNoSplitKV     = 2
	// PrefillNoHopper keeps a plan on the sm_80 mainloop on a Hopper GPU
	// (for comparisons and as a way around a fault in the Hopper one).
	PrefillNoHopper = 4
	// PrefillFP8QKV plans the Hopper mainloop's fast mode over an e4m3
	// cache: q quantised to e4m3 a row at a time and both products on the
	// 8-bit tensor cores (MainloopSM90FP8; head_dim 128). Without it an e4m3
	// cache is widened to q's type on the way into shared memory.
	PrefillFP8QKV = 8
	prefillFlags  = PrefillNoDecodeRoute | PrefillNoSplitKV | PrefillNoHopper | PrefillFP8QKV
	// fp8QKVHeadDim is the one head_dim the FP8 Q/K/V kernels are cut for
	// (kernelSet.prefillSM90FP8 exists there only).
	fp8QKVHeadDim = 128
	// prefillMaxSplits bounds split-KV of the prefill route (the merge
	// kernel's KVP_MERGE_MAX_STATES).
	prefillMaxSplits = maxMergeStates
	// prefillSplitTokens bounds the query rows whose split partials
	// PrefillWorkspaceSize provisions for.
	prefillSplitTokens = 256
)

// Prefill mainloops: which kernel runs a plan's prefill route.
const (
	// MainloopSM80: mma.sync tiles of 64 packed rows, every supported device.
	MainloopSM80 = 0
	// MainloopSM90: the warp-specialized wgmma kernel (tiles of 128 packed
	// rows), on compute capability 9.0 for 16-bit types.
	MainloopSM90 = 1
	// MainloopSM90FP8: the same kernel's FP8 Q/K/V mode (PrefillFP8QKV),
	// over e4m3 caches only.
	MainloopSM90FP8 = 2
	// MainloopOfDevice: PagedPrefill runs the one PlanPrefill picks without
	// flags on the run's device, for plans that record none (the
	// shared-prefix planner's prefill route). Plan state from the C ABI
	// never holds it.
	MainloopOfDevice = -1
)

// Launch constants of kvplug_kernels.h, section 4.
const (
	prefillThreads     = 128  // KVP_PREFILL_THREADS
	prefillSM90Threads = 384  // KVP_PREFILL_SM90_THREADS
	prefillSM90TileQ   = 128  // KVP_PREFILL_SM90_TILE_Q
	prefillPlanThreads = 1024 // KVP_PREFILL_PLAN_THREADS
	prefillTileQF32    = 64   // KVP_PREFILL_TILE_Q_F32
	prefillTileQMin    = 64   // the smallest tile of any kernel: workspace bounds use it
	prefillHeaderInts  = 8    // KVP_PREFILL_HEADER_INTS
	prefillItemInts    = 8    // KVP_PREFILL_ITEM_INTS
	maxPrefillTokens   = 1<<31 - 1
)

// kvp_prefill_plan_params
type prefillPlanParams struct {
	QOIndptr   uint64 `c:"qo_indptr"`
	KVLens     uint64 `c:"kv_lens"`
	Work       uint64 `c:"work"`
	Batch      int32  `c:"batch"`
	Group      int32  `c:"group"`
	TotalQ     int32  `c:"total_q"`
	MaxItems   int32  `c:"max_items"`
	TileQ      int32  `c:"tile_q"`
	NumSplits  int32  `c:"num_splits"`
	SkipDecode int32  `c:"skip_decode"`
	Reserved   int32  `c:"reserved"`
}

// kvp_prefill_params
type prefillParams struct {
	KV             pagedKVParams `c:"kv"`
	Q              uint64        `c:"q"`
	Out            uint64        `c:"out"`
	LSE            uint64        `c:"lse"`
	Work           uint64        `c:"work"`
	QTokenStride   int64         `c:"q_token_stride"`
	QHeadStride    int64         `c:"q_head_stride"`
	OutTokenStride int64         `c:"out_token_stride"`
	OutHeadStride  int64         `c:"out_head_stride"`
	NumQHeads      int32         `c:"num_q_heads"`
	WindowLeft     int32         `c:"window_left"`
	Scale          float32       `c:"scale"`
	NumSplits      int32         `c:"num_splits"`
	PartOut        uint64        `c:"part_out"`
	PartLSE        uint64        `c:"part_lse"`
	TotalQ         int32         `c:"total_q"`
	Reserved       int32         `c:"reserved"`
	Sinks          uint64        `c:"sinks"`
}

// prefillTileQ is kvp_prefill_tile_q: packed rows per work item.
func prefillTileQ(d DType, headDim int) int {
	if d.Size() == 4 {
		return prefillTileQF32
	}
	return 64
}

// prefillSM90SharedBytes is kvp_prefill_sm90_smem_bytes.
func prefillSM90SharedBytes(d DType, headDim int) uint32 {
	D, e, tn := uint32(headDim), uint32(d.Size()), prefillSM90TileKV(headDim)
	return 1024 + prefillSM90TileQ*D*e + 2*2*tn*D*e + 2*tn*8 + 128
}

// prefillSM90TileKV is kvp_prefill_sm90_tile_kv: tokens per K/V tile.
func prefillSM90TileKV(headDim int) uint32 {
	if headDim > 128 {
		return 64
	}
	return 128
}

// prefillSM90SharedBytesE4M3 is kvp_prefill_sm90_smem_bytes_e4m3: the
// Hopper mainloop over an e4m3 cache adds a ring of raw tiles (three
// where they fit, else two), each with its scales, mask and record, and
// the stages' masks.
func prefillSM90SharedBytesE4M3(headDim int) uint32 {
	const maxShared = 232448 // sm_90's opt-in shared memory per block
	tn := prefillSM90TileKV(headDim)
	base, slot := prefillSM90SharedBytes(F16, headDim), tn*uint32(headDim)+tn*4+32
	raw := uint32(3)
	if base+3*slot+32 > maxShared {
		raw = 2
	}
	return base + raw*slot + 32
}

// prefillSM90SharedBytesFP8 is kvp_prefill_sm90_smem_bytes_fp8: the FP8
// Q/K/V mode's tiles are one byte an element, plus the stages' K and V
// scales and P's V factors, the query rows' scales and a ring of two raw V
// tiles.
func prefillSM90SharedBytesFP8(headDim int) uint32 {
	tn, d := uint32(prefillSM90TileKV(headDim)), uint32(headDim)
	scales := (4*(4*tn+prefillSM90TileQ) + 12*tn + 24 + 127) / 128 * 128
	return prefillSM90SharedBytes(E4M3, headDim) + scales + 2*tn*d
}

// prefillMainloop picks the kernel of a plan's prefill route on dev: the
// Hopper one where it runs (compute capability 9.0 exactly: its sm_90a code
// runs nowhere else; 16-bit types; enough shared memory) unless the flags
// keep the sm_80 one.
func prefillMainloop(dev cuda.Device, d DType, headDim, flags int) int {
	if d.Size() == 2 && dev.Major == 9 && dev.Minor == 0 && flags&PrefillNoHopper == 0 &&
		uint32(dev.SharedPerBlockOptin) >= prefillSM90SharedBytes(d, headDim) {
		return MainloopSM90
	}
	return MainloopSM80
}

// prefillSM90Config is the launch of the Hopper mainloop's kernels on dev
// (one block per SM) where prefillMainloop picks it without flags, a zero
// grid where it does not: the cascade's shared items run on it.
func prefillSM90Config(dev cuda.Device, d DType, headDim int) cuda.LaunchConfig {
	if prefillMainloop(dev, d, headDim, 0) != MainloopSM90 {
		return cuda.LaunchConfig{}
	}
	return cuda.LaunchConfig{
		Grid:   cuda.Dim3{X: uint32(dev.SMs), Y: 1, Z: 1},
		Block:  cuda.Dim3{X: prefillSM90Threads, Y: 1, Z: 1},
		Shared: prefillSM90SharedBytes(d, headDim),
	}
}

// DefaultPrefillMainloop is the mainloop PlanPrefill picks without flags on
// the calling thread's current device (MainloopSM80 where none is usable):
// what a plan that records no mainloop of its own (the shared-prefix
// planner's prefill route) was planned for.
func DefaultPrefillMainloop(d DType, headDim int) int {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module("prefill")
	if err != nil {
		return MainloopSM80
	}
	return prefillMainloop(m.Device(), d, headDim, 0)
}

// prefillSharedBytes is kvp_prefill_smem_bytes.
func prefillSharedBytes(d DType, headDim int) uint32 {
	if d.Size() == 4 {
		return 0
	}
	stages, D := prefillStages(headDim), uint32(headDim)
	return uint32(prefillTileQ(d, headDim))*D*2 + stages*64*D*4 + (stages+1)*64*8
}

// prefillStages is the sm_80 tile's pipeline depth (TileCfg::STAGES).
func prefillStages(headDim int) uint32 {
	if headDim <= 64 {
		return 3
	}
	return 2
}

// prefillSharedBytesE4M3 is kvp_prefill_smem_bytes_e4m3: the sm_80 prefill
// kernel over an e4m3 cache (raw tiles and their scales, rings of row and
// scale offsets, the query's reduction).
func prefillSharedBytesE4M3(headDim int) uint32 {
	stages, D := prefillStages(headDim), uint32(headDim)
	return 128*D + stages*(128*D+512) + 2*(stages+1)*512 + 16
}

// prefillBlocksPerSM is how many prefill blocks an SM holds at once (shared
// memory and registers on sm_80/sm_90); the run's grid is that many per SM.
func prefillBlocksPerSM(d DType, headDim int) int {
	if d.Size() == 4 {
		return 4
	}
	// h64: shared memory and registers (153 per thread) allow 3; h128:
	// 2 (216 registers); h256: shared memory allows 1.
	switch {
	case headDim <= 64:
		return 3
	case headDim <= 128:
		return 2
	}
	return 1
}

// PrefillShape is what a plan fixes besides the batch: the types, heads and
// the attention window.
type PrefillShape struct {
	DType      DType
	HeadDim    int
	NumQHeads  int
	NumKVHeads int
	// WindowLeft >= 0 limits row i (at position pos_i) to tokens
	// [pos_i - WindowLeft, pos_i]; -1: no window.
	WindowLeft int
}

func (s *PrefillShape) validate(what string) error {
	if err := checkHead(what, s.DType, s.HeadDim); err != nil {
		return err
	}
	if err := firstErr(
		inRange(what+": num_q_heads", s.NumQHeads, 1, MaxHeads),
		inRange(what+": num_kv_heads", s.NumKVHeads, 1, MaxHeads),
		inRange(what+": window_left", s.WindowLeft, -1, maxPrefillTokens),
	); err != nil {
		return err
	}
	if s.NumQHeads%s.NumKVHeads != 0 {
		return kverr.Errorf(kverr.InvalidArgument, "%s: num_q_heads (%d) must be a multiple of num_kv_heads (%d)", what, s.NumQHeads, s.NumKVHeads)
	}
	return nil
}

// batchStats are the host-side facts of a batch composition.
type batchStats struct {
	totalQ, maxQLen, maxKVLen int
	items                     int64 // in tiles of prefillTileQ
	itemsSM90                 int64 // in the Hopper kernel's tiles of prefillSM90TileQ
	// The sequences of one new token (decode rows) and their longest kv_len.
	decodeSeqs, decodeMaxKV int
}

// checkBatch validates the host copies of qo_indptr ([batch+1], from 0,
// non-decreasing) and kv_lens ([batch], kv_len_b >= q_len_b) and counts the
// prefill kernel's work items.
func checkBatch(what string, s *PrefillShape, qoIndptr, kvLens []int32) (batchStats, error) {
	var st batchStats
	batch := len(kvLens)
	if err := inRange(what+": batch", batch, 0, maxBatch); err != nil {
		return st, err
	}
	if len(qoIndptr) != batch+1 {
		return st, kverr.Errorf(kverr.InvalidArgument, "%s: qo_indptr must hold batch + 1 = %d offsets: got %d", what, batch+1, len(qoIndptr))
	}
	if qoIndptr[0] != 0 {
		return st, kverr.Errorf(kverr.InvalidArgument, "%s: qo_indptr[0] must be 0: got %d", what, qoIndptr[0])
	}
	group := int64(s.NumQHeads / s.NumKVHeads)
	tile := int64(prefillTileQ(s.DType, s.HeadDim))
	for b := 0; b < batch; b++ {
		qLen := int64(qoIndptr[b+1]) - int64(qoIndptr[b])
		if qLen < 0 {
			return st, kverr.Errorf(kverr.InvalidArgument, "%s: qo_indptr must not decrease: qo_indptr[%d] = %d > qo_indptr[%d] = %d", what, b, qoIndptr[b], b+1, qoIndptr[b+1])
		}
		kv := int64(kvLens[b])
		if kv < qLen {
			return st, kverr.Errorf(kverr.InvalidArgument, "%s: sequence %d has %d new tokens but kv_len %d (kv_len counts them: it must be >= q_len)", what, b, qLen, kv)
		}
		st.maxQLen = max(st.maxQLen, int(qLen))
		st.maxKVLen = max(st.maxKVLen, int(kv))
		st.items += (qLen*group + tile - 1) / tile
		st.itemsSM90 += (qLen*group + prefillSM90TileQ - 1) / prefillSM90TileQ
		if qLen == 1 {
			st.decodeSeqs++
			st.decodeMaxKV = max(st.decodeMaxKV, int(kv))
		}
	}
	st.totalQ = int(qoIndptr[batch])
	if int64(st.totalQ)*int64(s.NumQHeads) > math.MaxInt32 {
		return st, kverr.Errorf(kverr.InvalidArgument, "%s: total_q * num_q_heads must be below 2^31: %d * %d", what, st.totalQ, s.NumQHeads)
	}
	return st, nil
}

// PrefillWorkspaceSize returns the bytes of workspace (device memory,
// 16-byte aligned) that plans of batches of up to maxBatch sequences and
// maxTokens query tokens in all need, on either route.
func PrefillWorkspaceSize(batchLimit, maxTokens, qHeads, kvHeads, headDim int) (int64, error) {
	const what = "prefill workspace size"
	if err := firstErr(
		inRange(what+": max_batch", batchLimit, 1, maxBatch),
		inRange(what+": max_tokens", maxTokens, 1, maxPrefillTokens),
		inRange(what+": num_q_heads", qHeads, 1, MaxHeads),
		inRange(what+": num_kv_heads", kvHeads, 1, MaxHeads),
	); err != nil {
		return 0, err
	}
	if qHeads%kvHeads != 0 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "%s: num_q_heads (%d) must be a multiple of num_kv_heads (%d)", what, qHeads, kvHeads)
	}
	if !SupportedHeadDim(headDim) {
		return 0, kverr.Errorf(kverr.Unsupported, "%s: head_dim must be 64, 128 or 256: got %d", what, headDim)
	}
	// Each sequence adds at most one partly filled tile.
	items := (int64(maxTokens)*int64(qHeads/kvHeads)+prefillTileQMin-1)/prefillTileQMin + int64(batchLimit)
	split := splitOffset(items*prefillMaxSplits) + splitBytes(prefillMaxSplits, min(maxTokens, prefillSplitTokens), qHeads, headDim, 4)
	return max(split, workspaceBytes(batchLimit, qHeads, headDim, DefaultMaxSplits)), nil
}

func workBytes(items int64) int64 { return 4 * (prefillHeaderInts + prefillItemInts*items) }

// splitOffset is where the split partials start in the workspace: after the
// work list, 256-byte aligned.
func splitOffset(items int64) int64 { return (workBytes(items) + 255) &^ 255 }

// splitBytes is the partial outputs (dtype) and lse (float32) of splits.
func splitBytes(splits, totalQ, qHeads, headDim, elem int) int64 {
	rows := int64(splits) * int64(totalQ) * int64(qHeads)
	return rows*int64(headDim)*int64(elem) + rows*4
}

// prefillSplits is the split-KV count of a prefill plan: when the items
// fill less than half of the device's resident blocks, each row tile's K/V
// range is cut into up to slots / blocks runs (at most 8, at least 4 tiles
// of 64 tokens each for the longest sequence), as many as the workspace
// holds.
func prefillSplits(slots int, items int64, kvHeads, maxKVLen, totalQ, qHeads, headDim, elem int, wsBytes int64) int {
	blocks := items * int64(kvHeads)
	if blocks == 0 || 2*blocks > int64(slots) {
		return 1
	}
	s := min(int64(prefillMaxSplits), int64(slots)/blocks, int64(ceilDiv(maxKVLen, 64)/4))
	for ; s > 1; s-- {
		if splitOffset(items*s)+splitBytes(int(s), totalQ, qHeads, headDim, elem) <= wsBytes {
			break
		}
	}
	return int(max(s, 1))
}

// PrefillPlanArgs is the input of PlanPrefill.
type PrefillPlanArgs struct {
	PrefillShape
	// Host copies of the batch: qo_indptr [batch+1] (query rows of sequence
	// b are [qo_indptr[b], qo_indptr[b+1])) and kv_lens [batch] (tokens in
	// the cache after this step's append, the new ones included).
	QOIndptr, KVLens []int32
	// The same arrays on the device, read by the kernels; keeping them equal
	// to the host copies is the caller's obligation (the kernels clamp what
	// they read so that a mismatch cannot make them write outside out).
	QOIndptrDev, KVLensDev cuda.DevicePtr
	Workspace              cuda.DevicePtr
	WorkspaceBytes         int64
	Flags                  int
}

// PrefillPlan is a planned batch composition (kvp_attn_plan's fields). It
// holds no host memory the run needs beyond itself, so engines copy it
// freely; the work list lives in the workspace.
type PrefillPlan struct {
	Kind, Route int
	PrefillShape
	Batch, TotalQ, MaxQLen, MaxKVLen int
	NumItems, Grid, NumSplits        int
	Mainloop                         int // MainloopSM80, MainloopSM90 or MainloopOfDevice
	Workspace                        cuda.DevicePtr
	WorkspaceBytes                   int64
	KVLens                           cuda.DevicePtr
	// Decode rows of a mixed batch (prefill route): DecodeSeqs > 0 sequences
	// of one new token that the work list leaves out and a decode launch of
	// DecodeSplits splits serves, its rows found through QOIndptr (device).
	DecodeSeqs, DecodeSplits int
	QOIndptr                 cuda.DevicePtr
	// WorkList is the fingerprint of the work list the plan wrote into its
	// workspace (prefill route; 0: none), checked by each run (worklist.go).
	WorkList uint64
}

// PlanPrefill plans a batch on stream: checks, route, and for the prefill
// route the plan kernel writing the work list. The workspace must not be
// in use by a run of an earlier plan that has not been enqueued before it on
// stream.
func PlanPrefill(a *PrefillPlanArgs, stream cuda.Stream) (PrefillPlan, error) {
	const what = "prefill_plan"
	var p PrefillPlan
	if err := a.PrefillShape.validate(what); err != nil {
		return p, err
	}
	if a.Flags&^prefillFlags != 0 {
		return p, kverr.Errorf(kverr.InvalidArgument, "%s: unknown flags %#x", what, a.Flags)
	}
	if a.Flags&PrefillFP8QKV != 0 {
		if a.Flags&PrefillNoHopper != 0 {
			return p, kverr.Errorf(kverr.InvalidArgument, "%s: KVP_PREFILL_FP8_QKV runs on the Hopper mainloop, which KVP_PREFILL_NO_HOPPER turns off", what)
		}
		if a.HeadDim != fp8QKVHeadDim || a.DType.Size() != 2 { // f32 never takes the Hopper mainloop
			return p, kverr.Errorf(kverr.Unsupported, "%s: KVP_PREFILL_FP8_QKV is cut for head_dim %d with f16 or bf16 q: got head_dim %d, %s", what, fp8QKVHeadDim, a.HeadDim, a.DType)
		}
	}
	if a.WorkspaceBytes < 0 {
		return p, kverr.Errorf(kverr.InvalidArgument, "%s: workspace_bytes must not be negative: got %d", what, a.WorkspaceBytes)
	}
	st, err := checkBatch(what, &a.PrefillShape, a.QOIndptr, a.KVLens)
	if err != nil {
		return p, err
	}
	batch := len(a.KVLens)
	p = PrefillPlan{Kind: KindPrefill, Route: RoutePrefill, PrefillShape: a.PrefillShape,
		Batch: batch, TotalQ: st.totalQ, MaxQLen: st.maxQLen, MaxKVLen: st.maxKVLen,
		NumItems: int(st.items), NumSplits: 1,
		Workspace: a.Workspace, WorkspaceBytes: a.WorkspaceBytes, KVLens: a.KVLensDev}
	decode := batch > 0 && decodeRoutes(st.maxQLen, a.NumQHeads/a.NumKVHeads) && st.totalQ == batch*st.maxQLen &&
		a.Flags&PrefillNoDecodeRoute == 0
	if decode {
		p.Route, p.NumItems = RouteDecode, 0
	}
	if batch > 0 {
		// The pointers are named below only on failure.
		if a.KVLensDev == 0 || a.KVLensDev%4 != 0 || a.Workspace%16 != 0 {
			return PrefillPlan{}, firstErr(checkIndex(what+": kv_lens", a.KVLensDev), aligned(what+": workspace", 16, a.Workspace))
		}
		if !decode {
			if a.QOIndptrDev == 0 || a.QOIndptrDev%4 != 0 {
				return PrefillPlan{}, checkIndex(what+": qo_indptr", a.QOIndptrDev)
			}
			need := workBytes(st.items)
			if a.Workspace == 0 {
				return PrefillPlan{}, kverr.Errorf(kverr.NullPointer, "%s: the work list of %d items needs a workspace of %d bytes; workspace is 0", what, st.items, need)
			}
			if a.WorkspaceBytes < need {
				return PrefillPlan{}, kverr.Errorf(kverr.BufferTooSmall, "%s: the work list of %d items needs %d bytes of workspace; workspace_bytes is %d (kvp_prefill_workspace_size sizes it)", what, st.items, need, a.WorkspaceBytes)
			}
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module(what)
	if err != nil {
		return PrefillPlan{}, err
	}
	sms := m.Device().SMs
	if decode {
		s := decodeSplits(sms, a.DType, a.HeadDim, batch, a.NumQHeads, a.NumKVHeads,
			decodeReadLen(st.maxKVLen, a.WindowLeft+1, st.maxQLen), st.maxQLen, false)
		p.NumSplits = fitSplits(s, a.Workspace, a.WorkspaceBytes, st.totalQ, a.NumQHeads, a.HeadDim)
		if p.NumSplits > 1 {
			recordWorkList(a.Workspace, splitPartials) // its runs' partials overwrite any work list there
		}
		return p, nil
	}
	p.Grid = sms * prefillBlocksPerSM(a.DType, a.HeadDim)
	tileQ := prefillTileQ(a.DType, a.HeadDim)
	// Mixed batches: the decode kernel takes the one-token rows, whose
	// sequences would otherwise each fill a whole row tile with one group.
	mixed := st.decodeSeqs > 0 && a.Flags&PrefillNoDecodeRoute == 0
	if p.Mainloop = prefillMainloop(m.Device(), a.DType, a.HeadDim, a.Flags); p.Mainloop == MainloopSM90 {
		// One block per SM fits; items of 128 rows are fewer than the
		// workspace (sized for 64-row items) holds.
		p.Grid, tileQ = sms, prefillSM90TileQ
		st.items = st.itemsSM90
		if a.Flags&PrefillFP8QKV != 0 {
			p.Mainloop = MainloopSM90FP8 // the same work list
		}
	} else if a.Flags&PrefillFP8QKV != 0 {
		return PrefillPlan{}, kverr.Errorf(kverr.Unsupported, "%s: KVP_PREFILL_FP8_QKV needs the Hopper mainloop (compute capability 9.0), which this device (%d.%d) does not run", what, m.Device().Major, m.Device().Minor)
	}
	if mixed { // each one-token sequence's single row tile is the decode launch's
		st.items -= int64(st.decodeSeqs) * int64(ceilDiv(a.NumQHeads/a.NumKVHeads, tileQ))
	}
	p.NumItems = int(st.items)
	if batch == 0 {
		return p, nil
	}
	if a.Flags&PrefillNoSplitKV == 0 {
		p.NumSplits = prefillSplits(p.Grid, st.items, a.NumKVHeads, st.maxKVLen, st.totalQ, a.NumQHeads, a.HeadDim, a.DType.Size(), a.WorkspaceBytes)
		p.NumItems = int(st.items) * p.NumSplits
	}
	pp := prefillPlanParams{
		QOIndptr: uint64(a.QOIndptrDev), KVLens: uint64(a.KVLensDev), Work: uint64(a.Workspace),
		Batch: int32(batch), Group: int32(a.NumQHeads / a.NumKVHeads), TotalQ: int32(st.totalQ),
		MaxItems: int32(p.NumItems), TileQ: int32(tileQ), NumSplits: int32(p.NumSplits),
	}
	if mixed {
		pp.SkipDecode = 1
		p.DecodeSeqs, p.QOIndptr, p.DecodeSplits = st.decodeSeqs, a.QOIndptrDev, 1
		if a.Flags&PrefillNoSplitKV == 0 {
			s := decodeSplits(sms, a.DType, a.HeadDim, st.decodeSeqs, a.NumQHeads, a.NumKVHeads,
				decodeReadLen(st.decodeMaxKV, a.WindowLeft+1, 1), 1, false)
			off := p.decodePartsOffset()
			p.DecodeSplits = fitSplits(s, a.Workspace+cuda.DevicePtr(off), a.WorkspaceBytes-off, batch, a.NumQHeads, a.HeadDim)
		}
	}
	cfg := cuda.LaunchConfig{Grid: cuda.Dim3{X: 1, Y: 1, Z: 1}, Block: cuda.Dim3{X: prefillPlanThreads, Y: 1, Z: 1}}
	if err := cuda.Launch(m, prefillPlanKernel, cfg, stream, &pp); err != nil {
		return PrefillPlan{}, err
	}
	p.WorkList = workListOf(&pp, a.QOIndptr, a.KVLens)
	recordWorkList(a.Workspace, p.WorkList)
	return p, nil
}

// decodePartsOffset is where the split partials of a mixed batch's decode
// launch start in the workspace: after the work list and the prefill
// kernel's split partials, 256-byte aligned.
func (p *PrefillPlan) decodePartsOffset() int64 {
	end := workBytes(int64(p.NumItems))
	if p.NumSplits > 1 {
		end = splitOffset(int64(p.NumItems)) + splitBytes(p.NumSplits, p.TotalQ, p.NumQHeads, p.HeadDim, p.DType.Size())
	}
	return (end + 255) &^ 255
}

// PrefillLayout is the per-layer shape of a run: strides of q and out
// ([total_q, num_q_heads, head_dim]), the paged cache and the block table.
type PrefillLayout struct {
	QTokenStride, QHeadStride     int64
	OutTokenStride, OutHeadStride int64

	PagedKV // the caches read and the block table [batch, block_table_stride]

	Scale float32 // softmax scale; 0 means 1/sqrt(head_dim) (SoftmaxScale)
}

type prefillExtents struct{ q, cache, out, table int64 }

// validate checks the layout against the plan p.
func (l *PrefillLayout) validate(what string, p *PrefillPlan) (prefillExtents, error) {
	var e prefillExtents
	if p.Kind != KindPrefill {
		return e, kverr.Errorf(kverr.InvalidArgument, "%s: the plan's kind is %d; plan it with kvp_prefill_plan first", what, p.Kind)
	}
	if p.Route != RoutePrefill && p.Route != RouteDecode {
		return e, kverr.Errorf(kverr.InvalidArgument, "%s: the plan's route is %d (a plan is written by kvp_prefill_plan only)", what, p.Route)
	}
	if err := p.PrefillShape.validate(what); err != nil {
		return e, err
	}
	if err := firstErr(
		inRange(what+": plan batch", p.Batch, 0, maxBatch),
		inRange(what+": plan total_q", p.TotalQ, 0, maxPrefillTokens),
		inRange(what+": plan max_kv_len", p.MaxKVLen, 0, maxPrefillTokens),
		inRange(what+": plan num_items", p.NumItems, 0, maxPrefillTokens),
		inRange(what+": plan grid", p.Grid, 0, 1<<20),
		inRange(what+": plan num_splits", p.NumSplits, 1, MaxSplits),
		inRange(what+": plan mainloop", p.Mainloop, MainloopOfDevice, MainloopSM90FP8),
		inRange(what+": plan decode rows", p.DecodeSeqs, 0, p.Batch),
		inRange(what+": plan decode splits", p.DecodeSplits, 0, MaxSplits),
	); err != nil {
		return e, err
	}
	if int64(p.TotalQ)*int64(p.NumQHeads) > math.MaxInt32 {
		return e, kverr.Errorf(kverr.InvalidArgument, "%s: plan total_q * num_q_heads must be below 2^31", what)
	}
	var err error
	if e.cache, e.table, err = l.PagedKV.validate(what, p.DType, p.HeadDim, p.NumKVHeads, true, p.Batch); err != nil {
		return e, err
	}
	if int64(l.MaxBlocksPerSeq)*int64(l.BlockSize) < int64(p.MaxKVLen) {
		return e, kverr.Errorf(kverr.InvalidArgument, "%s: the plan's longest sequence has %d tokens; the block table holds %d blocks of %d tokens", what, p.MaxKVLen, l.MaxBlocksPerSeq, l.BlockSize)
	}
	if err := checkScale(what, l.Scale); err != nil {
		return e, err
	}
	if err := vecMultiple(what, p.DType, l.QTokenStride, l.QHeadStride, l.OutTokenStride, l.OutHeadStride); err != nil {
		return e, err
	}
	if e.q, e.out, err = spanQOut(what, p.HeadDim, p.TotalQ, p.NumQHeads, l.QTokenStride, l.QHeadStride, l.OutTokenStride, l.OutHeadStride); err != nil {
		return e, err
	}
	if p.TotalQ == 0 {
		e.q, e.out = 0, 0
	}
	return e, nil
}

// PagedPrefillArgs is one layer's run of a plan on device memory.
type PagedPrefillArgs struct {
	PrefillLayout // with the caches' and the block table's pointers
	Q             cuda.DevicePtr
	Out           cuda.DevicePtr
	LSE           cuda.DevicePtr // float32 [total_q, num_q_heads] contiguous; 0: not wanted
	// Sinks is the attention sinks, float32 [num_q_heads], or 0 for none
	// (PagedDecodeArgs.Sinks); every route adds each row's sink once.
	Sinks cuda.DevicePtr
}

// PagedPrefill runs attention of plan p over one layer's tensors on stream.
func PagedPrefill(p *PrefillPlan, a *PagedPrefillArgs, stream cuda.Stream) error {
	const what = "paged_prefill"
	if p == nil {
		return kverr.Errorf(kverr.NullPointer, "%s: plan must not be NULL", what)
	}
	if err := checkWorkList(what, p); err != nil {
		return err
	}
	return pagedPrefill(p, a, stream)
}

// pagedPrefill is PagedPrefill without the work list's check, for the
// shared-prefix route's prefill plans (their own check is the cascade
// plan's generation).
func pagedPrefill(p *PrefillPlan, a *PagedPrefillArgs, stream cuda.Stream) error {
	const what = "paged_prefill"
	if _, err := a.validate(what, p); err != nil {
		return err
	}
	if p.Batch > 0 {
		if err := firstErr(
			a.PagedKV.checkPointers(what, true),
			checkIndex(what+": plan kv_lens", p.KVLens),
			aligned(what+": lse", 4, a.LSE),
			aligned(what+": sinks", 4, a.Sinks),
			aligned(what+": plan workspace", 16, p.Workspace),
		); err != nil {
			return err
		}
	}
	if p.TotalQ > 0 {
		if err := firstErr(checkTensor(what+": q", a.Q), checkTensor(what+": out", a.Out)); err != nil {
			return err
		}
	}
	if p.Route == RouteDecode {
		return p.runDecode(a, stream)
	}
	if p.NumItems > 0 {
		if p.Workspace == 0 {
			return kverr.Errorf(kverr.NullPointer, "%s: the plan has no workspace", what)
		}
		if p.WorkspaceBytes < workBytes(int64(p.NumItems)) {
			return kverr.Errorf(kverr.BufferTooSmall, "%s: the plan's %d items need %d bytes of workspace; it has %d", what, p.NumItems, workBytes(int64(p.NumItems)), p.WorkspaceBytes)
		}
		if p.Grid < 1 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: the plan's grid is %d", what, p.Grid)
		}
		if p.NumSplits > prefillMaxSplits {
			return kverr.Errorf(kverr.InvalidArgument, "%s: the plan's num_splits is %d; the prefill route splits at most %d ways", what, p.NumSplits, prefillMaxSplits)
		}
		if p.NumSplits > 1 {
			items := int64(p.NumItems / p.NumSplits)
			need := splitOffset(items*int64(p.NumSplits)) + splitBytes(p.NumSplits, p.TotalQ, p.NumQHeads, p.HeadDim, p.DType.Size())
			if p.WorkspaceBytes < need {
				return kverr.Errorf(kverr.BufferTooSmall, "%s: the plan's %d splits need %d bytes of workspace; it has %d", what, p.NumSplits, need, p.WorkspaceBytes)
			}
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module(what)
	if err != nil {
		return err
	}
	if p.NumItems == 0 {
		if p.DecodeSeqs == 0 {
			return nil
		}
		return p.runDecodeRows(m, a, stream)
	}
	pp := prefillParams{
		KV: a.PagedKV.params(p.DType, p.NumKVHeads),
		Q:  uint64(a.Q), Out: uint64(a.Out), LSE: uint64(a.LSE), Work: uint64(p.Workspace),
		QTokenStride: a.QTokenStride, QHeadStride: a.QHeadStride,
		OutTokenStride: a.OutTokenStride, OutHeadStride: a.OutHeadStride,
		NumQHeads:  int32(p.NumQHeads),
		WindowLeft: int32(p.WindowLeft), Scale: SoftmaxScale(a.Scale, p.HeadDim),
		NumSplits: int32(p.NumSplits), TotalQ: int32(p.TotalQ),
		// With splits the kernel writes partials without the sinks and the
		// merge (mergeSplits) adds them.
		Sinks: uint64(a.Sinks),
	}
	S := p.NumSplits
	rows := int64(p.TotalQ) * int64(p.NumQHeads)
	if S > 1 {
		pp.PartOut = uint64(p.Workspace) + uint64(splitOffset(int64(p.NumItems)))
		pp.PartLSE = pp.PartOut + uint64(int64(S)*rows*int64(p.HeadDim)*int64(p.DType.Size()))
	}
	cfg := cuda.LaunchConfig{
		Grid:   cuda.Dim3{X: uint32(p.Grid), Y: 1, Z: 1},
		Block:  cuda.Dim3{X: prefillThreads, Y: 1, Z: 1},
		Shared: prefillSharedBytes(p.DType, p.HeadDim),
	}
	kernel := kernelsFor(p.DType, p.HeadDim).prefill
	mainloop := p.Mainloop
	if mainloop == MainloopOfDevice {
		mainloop = prefillMainloop(m.Device(), p.DType, p.HeadDim, 0)
	}
	e4m3 := a.PagedKV.E4M3()
	if mainloop == MainloopSM90FP8 {
		if !e4m3 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: the plan is for FP8 Q/K/V (KVP_PREFILL_FP8_QKV), which reads an e4m3 cache; this one is %s: plan without the flag", what, a.PagedKV.cacheDType(p.DType))
		}
		// Plan state from the C ABI may say so of any plan: a dtype the
		// Hopper mainloop does not run is refused just below.
		if p.HeadDim != fp8QKVHeadDim {
			return kverr.Errorf(kverr.InvalidArgument, "%s: the plan is for FP8 Q/K/V, which is cut for head_dim %d: the plan has head_dim %d", what, fp8QKVHeadDim, p.HeadDim)
		}
	}
	if mainloop == MainloopSM90 || mainloop == MainloopSM90FP8 {
		if prefillMainloop(m.Device(), p.DType, p.HeadDim, 0) != MainloopSM90 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: the plan is for the Hopper mainloop, which this device (compute capability %d.%d) does not run: plan on this device", what, m.Device().Major, m.Device().Minor)
		}
		cfg.Block.X, cfg.Shared = prefillSM90Threads, prefillSM90SharedBytes(p.DType, p.HeadDim)
		kernel = kernelsFor(p.DType, p.HeadDim).prefillSM90
		if mainloop == MainloopSM90FP8 {
			cfg.Shared, kernel = prefillSM90SharedBytesFP8(p.HeadDim), kernelsFor(p.DType, p.HeadDim).prefillSM90FP8
		} else if e4m3 {
			if uint32(m.Device().SharedPerBlockOptin) < prefillSM90SharedBytesE4M3(p.HeadDim) {
				return kverr.Errorf(kverr.Unsupported, "%s: the Hopper mainloop over an e4m3 cache needs %d bytes of shared memory a block; this device offers %d: plan with KVP_PREFILL_NO_HOPPER", what, prefillSM90SharedBytesE4M3(p.HeadDim), m.Device().SharedPerBlockOptin)
			}
			cfg.Shared, kernel = prefillSM90SharedBytesE4M3(p.HeadDim), kernelsFor(p.DType, p.HeadDim).prefillSM90E4M3
		}
	} else if e4m3 {
		cfg.Shared = prefillSharedBytesE4M3(p.HeadDim)
		kernel = kernelsFor(p.DType, p.HeadDim).prefillE4M3
	}
	if err := cuda.Launch(m, kernel, cfg, stream, &pp); err != nil {
		return err
	}
	if S > 1 {
		if err := p.mergeSplits(m, a, &pp, stream); err != nil {
			return err
		}
	}
	if p.DecodeSeqs == 0 {
		return nil
	}
	return p.runDecodeRows(m, a, stream)
}

// mergeSplits merges the prefill kernel's split partials into out and lse.
func (p *PrefillPlan) mergeSplits(m *cuda.Module, a *PagedPrefillArgs, pp *prefillParams, stream cuda.Stream) error {
	S := p.NumSplits
	rows := int64(p.TotalQ) * int64(p.NumQHeads)
	// The splits' partial states are merged into out and lse.
	mp := mergeParams{
		Out: uint64(a.Out), OutLSE: uint64(a.LSE),
		VTokenStride: int64(p.NumQHeads) * int64(p.HeadDim), VHeadStride: int64(p.HeadDim),
		STokenStride: int64(p.NumQHeads), SHeadStride: 1,
		OutTokenStride: a.OutTokenStride, OutHeadStride: a.OutHeadStride,
		OutLSETokenStride: int64(p.NumQHeads), OutLSEHeadStride: 1,
		NumStates: int32(S), NumTokens: int32(p.TotalQ), NumHeads: int32(p.NumQHeads),
		Sinks: pp.Sinks,
	}
	for i := 0; i < S; i++ {
		mp.V[i] = pp.PartOut + uint64(int64(i)*rows*int64(p.HeadDim)*int64(p.DType.Size()))
		mp.S[i] = pp.PartLSE + uint64(int64(i)*rows*4)
	}
	mcfg := cuda.LaunchConfig{
		Grid:  cuda.Dim3{X: uint32(ceilDiv64(rows, mergeThreads/32)), Y: 1, Z: 1},
		Block: cuda.Dim3{X: mergeThreads, Y: 1, Z: 1},
	}
	return cuda.Launch(m, kernelsFor(p.DType, p.HeadDim).merge, mcfg, stream, &mp)
}

// runDecodeRows runs the decode kernel over a mixed batch's one-token
// sequences (the others' blocks exit at once): sequence b's row of q and
// out is qo_indptr[b].
func (p *PrefillPlan) runDecodeRows(m *cuda.Module, a *PagedPrefillArgs, stream cuda.Stream) error {
	d := p.decodeArgs(a)
	d.QLen = 1
	if p.DecodeSplits > 1 {
		d.Workspace = p.Workspace + cuda.DevicePtr(p.decodePartsOffset())
		d.WorkspaceBytes = p.WorkspaceBytes - p.decodePartsOffset()
		if err := d.checkWorkspace(p.DecodeSplits); err != nil {
			return err
		}
	}
	if p.QOIndptr == 0 {
		return kverr.Errorf(kverr.NullPointer, "paged_prefill: the plan's decode rows have no qo_indptr")
	}
	return d.launch(m, p.DecodeSplits, p.QOIndptr, p.TotalQ, stream)
}

// decodeArgs is a decode launch over the plan's batch and a's tensors.
func (p *PrefillPlan) decodeArgs(a *PagedPrefillArgs) PagedDecodeArgs {
	return PagedDecodeArgs{
		DecodeLayout: DecodeLayout{
			DType: p.DType, HeadDim: p.HeadDim, Batch: p.Batch, NumQHeads: p.NumQHeads, NumKVHeads: p.NumKVHeads,
			QLen:         p.MaxQLen,
			QBatchStride: a.QTokenStride, QHeadStride: a.QHeadStride,
			OutBatchStride: a.OutTokenStride, OutHeadStride: a.OutHeadStride,
			PagedKV: a.PagedKV, Scale: a.Scale,
		},
		Q: a.Q, SeqLens: p.KVLens,
		Out: a.Out, LSE: a.LSE, Sinks: a.Sinks, Workspace: p.Workspace, WorkspaceBytes: p.WorkspaceBytes,
		NumSplits: p.NumSplits, MaxSeqLen: p.MaxKVLen, WindowSize: p.WindowLeft + 1,
	}
}

// decodeRoutes reports whether a batch whose every sequence brings qLen new
// tokens runs on the decode kernel: at most 16 rows of (new token, q head)
// per kv head, so that one block takes a kv head's whole group and reads
// each K/V tile once (more rows split the group over blocks that each read
// it; the prefill kernel's tiles hold them all).
func decodeRoutes(qLen, group int) bool {
	return qLen >= 1 && (qLen == 1 || qLen*group <= decodeHeadsPerBlock)
}

// runDecode runs a plan of uniform short queries through the decode
// kernel: rows [b*q_len, (b+1)*q_len) of q are sequence b's.
func (p *PrefillPlan) runDecode(a *PagedPrefillArgs, stream cuda.Stream) error {
	d := p.decodeArgs(a)
	if d.Batch == 0 {
		return nil
	}
	return PagedDecode(&d, stream)
}
