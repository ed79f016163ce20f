package cascade

import (
	"github.com/kvplug/kvplug/core/kverr"
)

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
	if s.Batch < 0 || s.Batch > l.MaxBatch || s.Rows < 0 || s.Rows > l.MaxTokens || s.Items < 0 || s.Items > l.ItemCap || s.Parts < 0 || s.Parts > l.PartCap {
		return s, kverr.Errorf(kverr.InvalidArgument, "cascade: the host workspace's plan header is corrupt (batch %d, rows %d, items %d, parts %d)", s.Batch, s.Rows, s.Items, s.Parts)
	}
	return s, nil
}

// Update checks that a cascade plan still covers a step whose sequences only
// grew: every sequence's length within [its tail's start, its tail's planned
// capacity]. It reads the host workspace only (O(batch)) and writes nothing:
// the kernels read the tails' ends from the device's sequence lengths. false
// means the batch needs a new plan (a tail outgrew its chunks, or a length
// fell below the shared part it was planned with). A decode-route plan
// always fits; a plan with prefill rows (more query rows than sequences, or
// the prefill route) never does: the next step's queries differ. The block tables' shared columns must not have changed: the
// host cannot see that here (the caller's obligation).
func Update(ws []int32, l *Layout, route, batch int, seqLens []int32) (bool, error) {
	if len(seqLens) != batch {
		return false, kverr.Errorf(kverr.InvalidArgument, "cascade_update: %d lengths given for the plan's batch of %d", len(seqLens), batch)
	}
	if route == RouteDecode {
		return true, nil
	}
	s, err := Header(ws, l)
	if err != nil {
		return false, err
	}
	if route == RoutePrefill || s.Rows != s.Batch {
		return false, nil
	}
	if s.Batch != batch {
		return false, kverr.Errorf(kverr.InvalidArgument, "cascade_update: the host workspace holds a plan of %d sequences; the plan given has %d (planned again since?)", s.Batch, batch)
	}
	tb := ws[l.TailBegin : l.TailBegin+batch]
	te := ws[l.TailEnd : l.TailEnd+batch]
	for i, n := range seqLens {
		if n < tb[i] || n > te[i] {
			return false, nil
		}
	}
	return true, nil
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
