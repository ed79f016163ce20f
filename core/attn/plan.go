package attn

import (
	"runtime"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// DefaultMaxSplits is the split count WorkspaceSize provisions for when the
// caller passes 0: what Plan picks for one Llama-shaped sequence (8 KV heads)
// of 2048+ tokens on an H100.
const DefaultMaxSplits = 32

// DecodeSplits returns the split-KV count for a decode launch, by the heuristic of
// kernels/README.md: when the batch's (sequence, kv head, 16-head tile)
// blocks are fewer than the device holds at once (sms times the resident
// blocks per SM), each sequence is cut into up to that many splits of whole
// 64-token tiles of the longest sequence, and splits that would be empty are
// dropped; then, unless each block streams at most 4 tiles (a wave then
// costs less than the combine launch), where the blocks would leave the last wave less than 80%
// full on average (waves / ceil(waves) < 0.8), the split count grows to the
// first one that fills the waves that well. The result is also capped at
// MaxSplits. sms is the device's multiprocessor count; maxSeqLen bounds the
// batch's lengths. DecodeSplits depends only on the batch's shape, so an
// engine computes it once per step and passes it to every layer. It is the
// 16-bit cache's count; an e4m3 cache's kernel holds more blocks per SM.
func DecodeSplits(sms int, d DType, headDim, batch, qHeads, kvHeads, maxSeqLen int) int {
	return decodeSplits(sms, d, headDim, batch, qHeads, kvHeads, maxSeqLen, 1, false)
}

// decodeHeadsPer is the q heads of one decode block at qLen new tokens per
// sequence (kvp_decode_heads_per_cta): its 16 rows hold heads x tokens.
func decodeHeadsPer(qLen int) int { return decodeHeadsPerBlock / max(qLen, 1) }

// fewDecodeTiles: up to this many 64-token tiles per block, a wave lasts
// less than the combine launch that more splits would add, so the waves'
// fill is left as it is (gpt-oss's 128-token windows, 3 tiles, at B=32 on
// an H200: 3 splits for the fill took 17.7 us, where one split is a single
// 0.65-full wave).
const fewDecodeTiles = 4

// decodeSplits is DecodeSplits for qLen new tokens per sequence, over an
// e4m3 cache when e4m3.
func decodeSplits(sms int, d DType, headDim, batch, qHeads, kvHeads, maxSeqLen, qLen int, e4m3 bool) int {
	if sms <= 0 || batch <= 0 || kvHeads <= 0 || qHeads < kvHeads || maxSeqLen <= 0 {
		return 1
	}
	ctas := batch * kvHeads * ceilDiv(qHeads/kvHeads, decodeHeadsPer(qLen))
	slots := sms * decodeBlocksPerSM(d, headDim, e4m3)
	tiles := ceilDiv(maxSeqLen, decodeTile)
	if tiles <= 1 {
		return 1
	}
	s := 1
	if ctas < slots {
		s = min(slots/ctas, tiles, MaxSplits)
	}
	if s > 1 {
		per := ceilDiv(tiles, s)
		s = ceilDiv(tiles, per)
	}
	if tiles <= fewDecodeTiles {
		return s
	}
	// The waves' fill: a last wave that leaves most slots idle costs a
	// whole wave's time (an e4m3 kernel at 3 blocks per SM ran 512 blocks
	// in 1.29 waves: 65% of its slots busy).
	fill := func(s int) float64 {
		waves := float64(ctas*s) / float64(slots)
		return waves / float64(ceilDiv(ctas*s, slots))
	}
	if fill(s) >= 0.8 {
		return s
	}
	for t := s + 1; t <= min(tiles, MaxSplits, 2*s+2); t++ {
		if ceilDiv(tiles, ceilDiv(tiles, t)) == t && fill(t) >= 0.8 {
			return t
		}
	}
	return s
}

// workspaceBytes is the decode workspace of kvplug_kernels.h: float32
// partial outputs [splits][batch][heads][head_dim] and partial lse
// [splits][batch][heads].
func workspaceBytes(batch, qHeads, headDim, splits int) int64 {
	return 4 * int64(splits) * int64(batch) * int64(qHeads) * int64(headDim+1)
}

// fitSplits caps a split count at what bytes of workspace (at ws; 0: none)
// hold for rows query rows: never below 1.
func fitSplits(splits int, ws cuda.DevicePtr, bytes int64, rows, qHeads, headDim int) int {
	if splits <= 1 || ws == 0 || bytes <= 0 {
		return 1
	}
	return int(max(1, min(int64(splits), bytes/workspaceBytes(rows, qHeads, headDim, 1))))
}

// WorkspaceSize returns the bytes of decode workspace an engine allocates
// once (device memory, 16-byte aligned) to run batches of up to batchLimit
// sequences with up to maxSplits splits (0: DefaultMaxSplits). A launch whose
// library-chosen split count needs more than the workspace holds runs fewer
// splits.
func WorkspaceSize(batchLimit, qHeads, headDim, maxSplits int) (int64, error) {
	const what = "attn workspace size"
	if maxSplits == 0 {
		maxSplits = DefaultMaxSplits
	}
	if err := firstErr(
		inRange(what+": max_batch", batchLimit, 1, maxBatch),
		inRange(what+": num_q_heads", qHeads, 1, MaxHeads),
		inRange(what+": max_splits", maxSplits, 1, MaxSplits),
	); err != nil {
		return 0, err
	}
	if !SupportedHeadDim(headDim) {
		return 0, kverr.Errorf(kverr.Unsupported, "%s: head_dim must be 64, 128 or 256: got %d", what, headDim)
	}
	if maxSplits == 1 {
		return 0, nil
	}
	return workspaceBytes(batchLimit, qHeads, headDim, maxSplits), nil
}

// NumSplits is Plan on the device of the calling thread's current context
// (device 0's primary context when none is current), after checking the
// shape: what PagedDecode chooses for NumSplits 0 before capping it to the
// workspace.
func NumSplits(d DType, headDim, batch, qHeads, kvHeads, maxSeqLen int) (int, error) {
	const what = "attn num_splits"
	e4m3 := d == E4M3 // a decode over an e4m3 cache (its q is f16 or bf16: the same count)
	if e4m3 {
		d = F16
	}
	if err := checkHead(what, d, headDim); err != nil {
		return 0, err
	}
	if err := firstErr(
		inRange(what+": batch", batch, 0, maxBatch),
		inRange(what+": num_q_heads", qHeads, 1, MaxHeads),
		inRange(what+": num_kv_heads", kvHeads, 1, MaxHeads),
		inRange(what+": max_seq_len", maxSeqLen, 0, 1<<31-1),
	); err != nil {
		return 0, err
	}
	if qHeads%kvHeads != 0 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "%s: num_q_heads (%d) must be a multiple of num_kv_heads (%d)", what, qHeads, kvHeads)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module(what)
	if err != nil {
		return 0, err
	}
	return decodeSplits(m.Device().SMs, d, headDim, batch, qHeads, kvHeads, maxSeqLen, 1, e4m3), nil
}
