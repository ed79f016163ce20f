// Package cascade plans shared-prefix ("cascade") attention, decode or
// varlen prefill: from a batch's block tables, lengths and query lengths
// (host arrays) it finds the tree of block
// runs that several sequences share (a system prompt shared by all, few-shot
// blocks shared by a group, forks sharing all but their tails) and writes a
// plan that the kernels of kernels/kvp_cascade.cuh execute in two launches
// per layer: one over work items (a shared run's K/V read once for the
// query tokens of every sequence that shares it, or one sequence's own tail,
// causal over its new tokens),
// writing partial attention states, and one merging each sequence's states
// by online softmax.
//
// The plan lives in caller-owned memory of fixed capacity (a host workspace
// and a device workspace sized by WorkspaceSizes), in the same int32 layout
// on both sides, so that a CUDA graph captured over the run launches stays
// valid for every later plan into the same workspaces: the kernels' grids
// are fixed and they read every count from the device copy. A step whose
// sequences only grew is absorbed by Update in O(batch) without re-planning,
// while each tail stays within the chunks planned for it (the kernels read
// the tails' ends from the device's sequence lengths).
package cascade

import (
	"github.com/kvplug/kvplug/core/kverr"
)

// Layout constants shared with kernels/kvplug_kernels.h (section 5).
const (
	// MaxParts is the most partial states one sequence's plan may have
	// (KVP_CASCADE_MAX_PARTS): the shared nodes on its path and its tail,
	// each counted once per KV chunk. It bounds the workspaces.
	MaxParts = 16
	// PrefillParts is the partial states the workspaces provide for each
	// query token beyond one per sequence: a shared level and the tail. A
	// prefill plan that needs more (deeper trees, split tails) fits while
	// other rows use less; otherwise it takes the plain route.
	PrefillParts = 2
	HeaderInts   = 32  // KVP_CASCADE_HEADER_INTS
	ItemInts     = 8   // KVP_CASCADE_ITEM_INTS
	SegInts      = 4   // KVP_CASCADE_SEG_INTS
	TailTileQ    = 64  // KVP_CASCADE_TAIL_TILE_Q: packed rows per tail item on the sm_80 tile
	SM90TileQ    = 128 // KVP_PREFILL_SM90_TILE_Q: packed rows per tail item on the wgmma mainloop
	// decodeTailRows: a tail of at most this many packed rows runs the
	// decode kernel's 16-row tile (kvp_cascade.cuh).
	decodeTailRows = 16
	chunkAlign     = 64      // KV tile of the kernel: chunks are whole tiles
	maxChunk       = 1 << 29 // longest KV chunk (tokens): a longer one is one chunk a tail all the same
	maxBatchCap    = 1 << 16
	maxRowsCap     = 1 << 24
)

// Header words of a plan (both workspaces).
const (
	hMagic     = 0
	hItems     = 1  // work items
	hBatch     = 2  // sequences (merge rows)
	hNodes     = 3  // shared nodes
	hParts     = 4  // partial states in use
	hChunk     = 5  // tokens per KV chunk
	hMaxBatch  = 6  // capacity the offsets were computed for
	hGroup     = 7  // num_q_heads / num_kv_heads
	hTileQ     = 8  // packed rows per item
	hBlockSize = 9  // block size the tables were read with
	hMaxKV     = 10 // longest planned length (tail capacities included)
	hSaved     = 11 // KV tokens per kv head the shared reads save (clamped to int32)
	hTotal     = 12 // KV tokens per kv head plain decode would read (clamped)
	hRoute     = 13 // RouteDecode or RouteCascade
	hGen       = 14 // plans made into this workspace before this one (stale-plan check)
	hRows      = 15 // query rows (KVP_CASCADE_H_ROWS): total_q, the merge's rows
	hMaxTokens = 16 // query-row capacity the offsets were computed for
	hMaxQLen   = 17 // longest query
	hTailTileQ = 18 // KVP_CASCADE_H_TAIL_TILE_Q: packed rows per item of a long tail (TailTileQ or SM90TileQ)
	// hHopperItems (KVP_CASCADE_H_HOPPER_ITEMS): the items at the list's
	// start that the wgmma launch runs (shared items, then long tails when
	// cut for it); the cascade kernel skips them behind that launch.
	hHopperItems = 19
	// Words 20 and 21 (KVP_CASCADE_W_NEXT_UNIT) are the wgmma launch's unit
	// counter: zero in every plan, and zero again after each launch.
	// hPrefillMainloop: on the prefill route, the mainloop its work list was
	// cut for, plus one (0: none recorded), which only the host reads: the
	// run must launch that one (SetPrefillMainloop).
	hPrefillMainloop = 22

	planMagic = 0x6b766331 // "kvc1"
)

// Item fields (ItemInts int32 each; the last is free).
const (
	iRep      = 0 // sequence whose block-table row is read
	iKVBegin  = 1 // first token
	iKVEnd    = 2 // end token (exclusive); tails clip it to seq_lens[rep]
	iDynamic  = 3 // 1: tail item (clip to the device length)
	iMBegin   = 4 // first query token (index into the qrows array)
	iMCount   = 5 // query tokens: the members' (shared) or the sequence's (tail)
	iTile     = 6 // packed-row tile: rows [tile*tile_q, ...) of tokens*group
	iPartBase = 7 // partial state of token k is part_base + k
)

// Layout is where each region of a plan sits, in int32 words from the start
// of either workspace, for a capacity of MaxBatch sequences and MaxTokens
// query tokens (MaxBatch in decode).
type Layout struct {
	MaxBatch, MaxTokens, Group, TileQ, NumQHeads, HeadDim int

	PartCap, ItemCap, SegCap int
	// Items; QRows [MaxTokens]: query rows in the plan's order of
	// sequences; SegStart [MaxBatch+1]; Segs; RowSeq [MaxTokens]: each query
	// row's sequence; QStart [MaxBatch+1]: each sequence's first query row.
	Items, QRows, SegStart, Segs, RowSeq, QStart, PlanInts int
	// Host-only, after the plan: per-sequence tail start and tail capacity
	// end (tokens), which Update checks.
	TailBegin, TailEnd, HostInts int
	// Device-only, after the plan (byte offsets): partial outputs float32
	// [PartCap][num_q_heads][head_dim] and their log2-domain lse float32
	// [PartCap][num_q_heads].
	PartOut, PartLSE, DeviceBytes int64
}

func align4(n int) int { return (n + 3) &^ 3 }

// TileQ is the kernel's packed rows per item (kvp_cascade_tile_q): 128 at
// head_dim <= 128, 64 at 256.
func TileQ(headDim int) int {
	if headDim <= 128 {
		return 128
	}
	return 64
}

// NewLayout computes the regions for maxBatch sequences of one query token
// each (decode).
func NewLayout(maxBatch, numQHeads, numKVHeads, headDim int) (Layout, error) {
	return NewPrefillLayout(maxBatch, maxBatch, numQHeads, numKVHeads, headDim)
}

// NewPrefillLayout computes the regions for maxBatch sequences with
// maxTokens query tokens in all (maxTokens >= maxBatch).
func NewPrefillLayout(maxBatch, maxTokens, numQHeads, numKVHeads, headDim int) (Layout, error) {
	var l Layout
	if maxBatch < 1 || maxBatch > maxBatchCap {
		return l, kverr.Errorf(kverr.InvalidArgument, "cascade: max_batch must be in [1, %d]: got %d", maxBatchCap, maxBatch)
	}
	if maxTokens < maxBatch || maxTokens > maxRowsCap {
		return l, kverr.Errorf(kverr.InvalidArgument, "cascade: max_tokens must be in [max_batch = %d, %d]: got %d", maxBatch, maxRowsCap, maxTokens)
	}
	if headDim != 64 && headDim != 128 && headDim != 256 {
		return l, kverr.Errorf(kverr.Unsupported, "cascade: head_dim must be 64, 128 or 256: got %d", headDim)
	}
	if numKVHeads < 1 || numQHeads < 1 || numQHeads > 1<<12 || numQHeads%numKVHeads != 0 {
		return l, kverr.Errorf(kverr.InvalidArgument, "cascade: num_q_heads (%d) must be in [1, 4096] and a multiple of num_kv_heads (%d)", numQHeads, numKVHeads)
	}
	l.MaxBatch, l.MaxTokens, l.Group, l.TileQ, l.NumQHeads, l.HeadDim = maxBatch, maxTokens, numQHeads/numKVHeads, TileQ(headDim), numQHeads, headDim
	l.PartCap = maxBatch*MaxParts + (maxTokens-maxBatch)*PrefillParts
	// A node of m tokens in c chunks has c*ceil(m*group/tile) items and c*m
	// partial states, a tail chunk of q tokens ceil(q*group/tail tile) items
	// and q states; both tiles >= TailTileQ, so items <= parts *
	// ceil(group/TailTileQ).
	l.ItemCap = l.PartCap * ((l.Group + TailTileQ - 1) / TailTileQ)
	// A sequence has one segment per node on its path and its tail.
	l.SegCap = maxBatch * MaxParts
	l.Items = HeaderInts
	l.QRows = l.Items + l.ItemCap*ItemInts
	l.SegStart = l.QRows + maxTokens
	l.Segs = align4(l.SegStart + maxBatch + 1)
	l.RowSeq = l.Segs + l.SegCap*SegInts
	l.QStart = l.RowSeq + maxTokens
	l.PlanInts = align4(l.QStart + maxBatch + 1)
	l.TailBegin = l.PlanInts
	l.TailEnd = l.TailBegin + maxBatch
	l.HostInts = l.TailEnd + maxBatch
	l.PartOut = int64(l.PlanInts) * 4
	l.PartLSE = l.PartOut + int64(l.PartCap)*int64(numQHeads)*int64(headDim)*4
	l.DeviceBytes = l.PartLSE + int64(l.PartCap)*int64(numQHeads)*4
	l.DeviceBytes = (l.DeviceBytes + 15) &^ 15
	return l, nil
}

// WorkspaceSizes returns the device and host workspace bytes for batches of
// up to maxBatch sequences and maxTokens query tokens in all (maxBatch for
// decode).
func WorkspaceSizes(maxBatch, maxTokens, numQHeads, numKVHeads, headDim int) (device, host int64, err error) {
	l, err := NewPrefillLayout(maxBatch, maxTokens, numQHeads, numKVHeads, headDim)
	if err != nil {
		return 0, 0, err
	}
	return l.DeviceBytes, int64(l.HostInts) * 4, nil
}

// ReadPlan reads back the plan in host workspace ws made for a capacity of
// maxBatch sequences: its layout (the query-row capacity from the plan's
// header, PlanLayout) and its summary (Header). fits is false, with nothing
// read, when ws is too small for the layout (nil included): the caller
// names that error.
func ReadPlan(ws []int32, maxBatch, numQHeads, numKVHeads, headDim int) (l Layout, s Summary, fits bool, err error) {
	if l, err = NewLayout(maxBatch, numQHeads, numKVHeads, headDim); err != nil || len(ws) < l.HostInts {
		return l, s, false, err
	}
	if l, err = PlanLayout(ws, maxBatch, numQHeads, numKVHeads, headDim); err != nil || len(ws) < l.HostInts {
		return l, s, false, err
	}
	s, err = Header(ws, &l)
	return l, s, true, err
}

// PlanLayout is the layout of the plan in the host workspace ws for a
// capacity of maxBatch sequences: its query-row capacity is read from the
// plan's header (max_batch when ws holds no plan, which Header then
// refuses).
func PlanLayout(ws []int32, maxBatch, numQHeads, numKVHeads, headDim int) (Layout, error) {
	maxTok := maxBatch
	if len(ws) >= HeaderInts && ws[hMagic] == planMagic && int(ws[hMaxTokens]) >= maxBatch {
		maxTok = int(ws[hMaxTokens])
	}
	return NewPrefillLayout(maxBatch, maxTok, numQHeads, numKVHeads, headDim)
}

// Header reads a plan's summary back from its host workspace (what the run
// and Update trust), checking that ws holds a plan of layout l.
func Header(ws []int32, l *Layout) (Summary, error) {
	var s Summary
	if len(ws) < l.HostInts {
		return s, kverr.Errorf(kverr.BufferTooSmall, "cascade: the host workspace holds %d bytes; %d needed", 4*len(ws), 4*l.HostInts)
	}
	h := ws[:HeaderInts]
	if h[hMagic] != planMagic {
		return s, kverr.Errorf(kverr.InvalidArgument, "cascade: the host workspace holds no plan (plan with kvp_cascade_plan first)")
	}
	if int(h[hMaxBatch]) != l.MaxBatch || int(h[hMaxTokens]) != l.MaxTokens || int(h[hGroup]) != l.Group || int(h[hTileQ]) != l.TileQ {
		return s, kverr.Errorf(kverr.InvalidArgument, "cascade: the host workspace's plan was made for another layout (max_batch %d, max_tokens %d, group %d, tile %d; expected %d, %d, %d, %d)",
			h[hMaxBatch], h[hMaxTokens], h[hGroup], h[hTileQ], l.MaxBatch, l.MaxTokens, l.Group, l.TileQ)
	}
	s.Items, s.Batch, s.Nodes, s.Parts, s.Chunk = int(h[hItems]), int(h[hBatch]), int(h[hNodes]), int(h[hParts]), int(h[hChunk])
	s.MaxKV, s.SavedTokens, s.TotalTokens = int(h[hMaxKV]), int64(h[hSaved]), int64(h[hTotal])
	s.Route = int(h[hRoute])
	s.Gen = h[hGen]
	s.Rows, s.MaxQLen = int(h[hRows]), int(h[hMaxQLen])
	s.PrefillMainloop = int(h[hPrefillMainloop]) - 1
	if s.Batch < 0 || s.Batch > l.MaxBatch || s.Rows < 0 || s.Rows > l.MaxTokens || s.Items < 0 || s.Items > l.ItemCap || s.Parts < 0 || s.Parts > l.PartCap {
		return s, kverr.Errorf(kverr.InvalidArgument, "cascade: the host workspace's plan header is corrupt (batch %d, rows %d, items %d, parts %d)", s.Batch, s.Rows, s.Items, s.Parts)
	}
	return s, nil
}

// SetPrefillMainloop records in a plan's host workspace the mainloop
// (core/attn's MainloopSM80 or MainloopSM90) that its prefill route's work
// list was cut for; Header reads it back as Summary.PrefillMainloop.
func SetPrefillMainloop(ws []int32, mainloop int) {
	if len(ws) >= HeaderInts {
		ws[hPrefillMainloop] = int32(mainloop) + 1
	}
}
