// Package attnref is the float64 oracle of core/attn's kernels, for tests:
// the kernels' semantics on host memory, computed in float64 and rounded
// once into the output dtype. Tensors are []byte in the layouts of the
// launches (little-endian elements); index arrays are []int32 and
// log-sum-exp arrays []float32. Every layout is checked as its launch checks
// it (core/attn's Extents) and every buffer against the layout before
// anything is written.
//
// Only tests import it: it is a package of its own, not part of core/attn,
// so that programs that launch kernels do not link it.
package attnref

import (
	"cmp"
	"math"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
)

func needBytes(what string, buf []byte, elems int64, d attn.DType) error {
	if int64(len(buf)) < elems*int64(d.Size()) {
		return kverr.Errorf(kverr.BufferTooSmall, "%s holds %d bytes; its layout reaches %d elements of %v (%d bytes)", what, len(buf), elems, d, elems*int64(d.Size()))
	}
	return nil
}

func needLen[T any](what string, s []T, n int64) error {
	if int64(len(s)) < n {
		return kverr.Errorf(kverr.BufferTooSmall, "%s holds %d elements; the layout needs %d", what, len(s), n)
	}
	return nil
}

// KVWrite is the CPU reference of attn.KVWrite: for each token t with a slot in
// [0, num_blocks*block_size), copies key[t] and value[t] (all heads) into
// the caches at that slot; other slots are skipped.
func KVWrite(l *attn.KVWriteLayout, key, value []byte, slots []int32, kCache, vCache []byte) error {
	e, err := l.Extents()
	if err != nil {
		return err
	}
	if err := cmp.Or(
		needBytes("kv_write: key", key, e.Key, l.DType),
		needBytes("kv_write: value", value, e.Value, l.DType),
		needLen("kv_write: slot_mapping", slots, int64(l.NumTokens)),
		needBytes("kv_write: k_cache", kCache, e.Cache, l.DType),
		needBytes("kv_write: v_cache", vCache, e.Cache, l.DType),
	); err != nil {
		return err
	}
	es := int64(l.DType.Size())
	row := int64(l.HeadDim) * es
	writeRows(l, slots, func(r writeRow) {
		dst, k, v := r.dst*es, r.key*es, r.value*es
		copy(kCache[dst:dst+row], key[k:k+row])
		copy(vCache[dst:dst+row], value[v:v+row])
	})
	return nil
}

// writeRow is one (token, kv head) row of a KV write: its slot's block and
// offset, the element offsets of its row in the caches, key and value.
type writeRow struct {
	head, blk, off, dst, key, value int64
}

// writeRows calls fn for every row the write l stores: tokens whose slot is
// in [0, num_blocks*block_size), every kv head.
func writeRows(l *attn.KVWriteLayout, slots []int32, fn func(writeRow)) {
	capacity := int64(l.NumBlocks) * int64(l.BlockSize)
	for t := int64(0); t < int64(l.NumTokens); t++ {
		slot := int64(slots[t])
		if slot < 0 || slot >= capacity {
			continue
		}
		blk, off := slot/int64(l.BlockSize), slot%int64(l.BlockSize)
		for h := int64(0); h < int64(l.NumKVHeads); h++ {
			fn(writeRow{h, blk, off, blk*l.CacheBlockStride + off*l.CacheTokenStride + h*l.CacheHeadStride,
				t*l.KeyTokenStride + h*l.KeyHeadStride, t*l.ValueTokenStride + h*l.ValueHeadStride})
		}
	}
}

// PagedDecode is the CPU reference of attn.PagedDecode. For sequence b and
// query head i (kv head g = i / (num_q_heads/num_kv_heads)) it attends over
// tokens [0, seq_lens[b]): token t lives in block block_table[b][t /
// block_size] at offset t % block_size; tokens whose table column is >=
// max_blocks_per_seq or whose block id is outside [0, num_blocks) are
// ignored. out = softmax(scale * q.K) V; lse (when non-nil, [batch,
// num_q_heads] contiguous) = log(sum exp(scale * q.k)). An empty sequence
// gives out = 0 and lse = -inf. With QLen > 1, rows b*QLen+t of q, out and
// lse are sequence b's new token t, which attends over [0, L-QLen+t].
//
// numSplits (>= 1) partitions each sequence as the GPU does (chunks of
// ceil(ceil(L/numSplits)/64)*64 tokens), computes each chunk's state and
// merges them, so tests can compare a split launch with the same partition;
// the result equals the unsplit attention up to float64 rounding.
func PagedDecode(l *attn.DecodeLayout, q, kCache, vCache []byte, table, seqLens []int32, out []byte, lse []float32, numSplits int) error {
	if l.PagedKV.E4M3() {
		return kverr.Errorf(kverr.InvalidArgument, "paged_decode: an e4m3 cache comes with its scales: PagedDecodeE4M3")
	}
	return pagedDecode(l, l.DType, q, kCache, vCache, table, seqLens, out, lse, numSplits, nil)
}

// PagedDecodeSinks is PagedDecode with attention sinks (attn.PagedDecodeArgs.Sinks):
// sinks[h] (natural log) joins q head h's softmax denominator once, after
// the splits are merged (AddSink); nil is PagedDecode.
func PagedDecodeSinks(l *attn.DecodeLayout, q, kCache, vCache []byte, table, seqLens []int32, out []byte, lse []float32, numSplits int, sinks []float32) error {
	if l.PagedKV.E4M3() {
		return kverr.Errorf(kverr.InvalidArgument, "paged_decode: an e4m3 cache comes with its scales: PagedDecodeE4M3")
	}
	return pagedDecode(l, l.DType, q, kCache, vCache, table, seqLens, out, lse, numSplits, sinks)
}

// pagedDecode is PagedDecode over caches of element type cacheDT, with
// sinks (nil: none).
func pagedDecode(l *attn.DecodeLayout, cacheDT attn.DType, q, kCache, vCache []byte, table, seqLens []int32, out []byte, lse []float32, numSplits int, sinks []float32) error {
	e, err := l.Extents()
	if err != nil {
		return err
	}
	if err := limits.Range("paged_decode: num_splits", numSplits, 1, attn.MaxSplits); err != nil {
		return err
	}
	if err := cmp.Or(
		needBytes("paged_decode: q", q, e.Q, l.DType),
		needBytes("paged_decode: k_cache", kCache, e.Cache, cacheDT),
		needBytes("paged_decode: v_cache", vCache, e.Cache, cacheDT),
		needLen("paged_decode: block_table", table, e.Table),
		needLen("paged_decode: seq_lens", seqLens, int64(l.Batch)),
		needBytes("paged_decode: out", out, e.Out, l.DType),
	); err != nil {
		return err
	}
	if sinks != nil && l.Batch > 0 {
		if err := needLen("paged_decode: sinks", sinks, int64(l.NumQHeads)); err != nil {
			return err
		}
	}
	if lse != nil {
		if err := needLen("paged_decode: lse", lse, int64(l.Rows())*int64(l.NumQHeads)); err != nil {
			return err
		}
	}
	D := l.HeadDim
	group := l.NumQHeads / l.NumKVHeads
	qv := make([]float64, D)
	acc := make([]float64, D)
	parts := make([]float64, numSplits*D)
	partLSE := make([]float64, numSplits)
	var scores []float64
	kv := NewKeys(cacheDT, &l.PagedKV, kCache)
	scale := float64(attn.SoftmaxScale(l.Scale, l.HeadDim))
	for b := 0; b < l.Batch; b++ {
		L := int(seqLens[b])
		if L < 0 {
			L = 0
		}
		tableRow := table[int64(b)*l.BlockTableStride:]
		chunk := 0
		if L > 0 {
			chunk = ceilDiv(ceilDiv(L, numSplits), attn.DecodeTile) * attn.DecodeTile
		}
		qLen := max(l.QLen, 1)
		for t := 0; t < qLen; t++ {
			row := int64(b*qLen + t)
			end := min(L, L-qLen+t+1) // new token t sees positions [0, L-qLen+t]
			for i := 0; i < l.NumQHeads; i++ {
				g := int64(i / group)
				qo := row*l.QBatchStride + int64(i)*l.QHeadStride
				loadRow(l.DType, q, qo, qv)
				for s := 0; s < numSplits; s++ {
					lo, hi := s*chunk, min(end, (s+1)*chunk)
					var rows []int64
					scores, rows = kv.Score(tableRow, g, qv, scale, lo, max(lo, hi), scores[:0], nil)
					part := parts[s*D : (s+1)*D]
					partLSE[s] = Attend(cacheDT, vCache, rows, scores, part)
				}
				st := Merge(acc, parts, partLSE[:numSplits], D)
				if sinks != nil {
					st = AddSink(acc, st, float64(sinks[i]))
				}
				oo := row*l.OutBatchStride + int64(i)*l.OutHeadStride
				storeRow(l.DType, out, oo, acc)
				if lse != nil {
					lse[row*int64(l.NumQHeads)+int64(i)] = float32(st)
				}
			}
		}
	}
	return nil
}

// Attend writes softmax(scores) . V[rows] into o and returns the natural
// log-sum-exp of scores (-inf and o = 0 when there are none): one head's
// attention state in float64, for the CPU references.
func Attend(d attn.DType, v []byte, rows []int64, scores []float64, o []float64) float64 {
	clear(o)
	if len(scores) == 0 {
		return math.Inf(-1)
	}
	m := math.Inf(-1)
	for _, s := range scores {
		m = math.Max(m, s)
	}
	sum := 0.0
	for j, s := range scores {
		w := math.Exp(s - m)
		sum += w
		for k := range o {
			o[k] += w * d.Load(v, rows[j]+int64(k))
		}
	}
	for k := range o {
		o[k] /= sum
	}
	return m + math.Log(sum)
}

// AddSink adds an attention sink (natural log; one more term exp(sink) in
// the softmax denominator, none in the numerator) to a finished state: the
// normalised output o, whose log-sum-exp is lse, is scaled in place by
// exp(lse - new lse), and the new lse, log(exp(lse) + exp(sink)), the log of
// the whole denominator, is returned. An empty state (lse -inf) keeps o = 0
// and gets lse = sink.
func AddSink(o []float64, lse, sink float64) float64 {
	if math.IsInf(lse, -1) {
		clear(o)
		return sink
	}
	m := math.Max(lse, sink)
	total := m + math.Log(math.Exp(lse-m)+math.Exp(sink-m))
	w := math.Exp(lse - total)
	for k := range o {
		o[k] *= w
	}
	return total
}

// Merge merges the states parts[i*D:(i+1)*D] with log-sum-exps lses[i]
// (-inf = empty, weight 0) into out and returns the merged log-sum-exp, in
// float64 for the CPU references. Empty states only (or none) give out = 0
// and -inf: never NaN, since no weight exp(-inf - -inf) is formed.
func Merge(out []float64, parts []float64, lses []float64, D int) float64 {
	clear(out)
	m := math.Inf(-1)
	for _, s := range lses {
		m = math.Max(m, s)
	}
	if math.IsInf(m, -1) {
		return m
	}
	sum := 0.0
	for i, s := range lses {
		if math.IsInf(s, -1) {
			continue
		}
		w := math.Exp(s - m)
		sum += w
		for k := 0; k < D; k++ {
			out[k] += w * parts[i*D+k]
		}
	}
	for k := 0; k < D; k++ {
		out[k] /= sum
	}
	return m + math.Log(sum)
}

// MergeStates is the CPU reference of attn.MergeStates: out = sum_i w_i v_i
// with w_i = exp(s_i - lse) and lse = log(sum_i exp(s_i)), over the states
// whose s_i is not -inf; when every state is empty, out = 0 and lse = -inf.
// outLSE may be nil. out may alias v[0] (equal strides), outLSE s[0].
func MergeStates(l *attn.MergeLayout, v [][]byte, s [][]float32, out []byte, outLSE []float32) error {
	e, err := l.Extents(outLSE != nil)
	if err != nil {
		return err
	}
	if len(v) != l.NumStates || len(s) != l.NumStates {
		return kverr.Errorf(kverr.InvalidArgument, "merge_states: %d values and %d lse arrays given for num_states %d", len(v), len(s), l.NumStates)
	}
	for i := range v {
		if err := cmp.Or(needBytes("merge_states: v", v[i], e.V, l.DType), needLen("merge_states: s", s[i], e.S)); err != nil {
			return err
		}
	}
	if err := needBytes("merge_states: out", out, e.Out, l.DType); err != nil {
		return err
	}
	if outLSE != nil {
		if err := needLen("merge_states: out_lse", outLSE, e.OutLSE); err != nil {
			return err
		}
	}
	D, n := l.HeadDim, l.NumStates
	parts := make([]float64, n*D)
	lses := make([]float64, n)
	acc := make([]float64, D)
	for t := int64(0); t < int64(l.NumTokens); t++ {
		for h := int64(0); h < int64(l.NumHeads); h++ {
			vo := t*l.VTokenStride + h*l.VHeadStride
			for i := 0; i < n; i++ {
				lses[i] = float64(s[i][t*l.STokenStride+h*l.SHeadStride])
				loadRow(l.DType, v[i], vo, parts[i*D:(i+1)*D])
			}
			st := Merge(acc, parts, lses[:n], D)
			oo := t*l.OutTokenStride + h*l.OutHeadStride
			storeRow(l.DType, out, oo, acc)
			if outLSE != nil {
				outLSE[t*l.OutLSETokenStride+h*l.OutLSEHeadStride] = float32(st)
			}
		}
	}
	return nil
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// loadRow reads len(dst) elements of d at element offset off of buf.
func loadRow(d attn.DType, buf []byte, off int64, dst []float64) {
	for i := range dst {
		dst[i] = d.Load(buf, off+int64(i))
	}
}

// storeRow rounds src into len(src) elements of d at element offset off of
// buf.
func storeRow(d attn.DType, buf []byte, off int64, src []float64) {
	for i, v := range src {
		d.Store(buf, off+int64(i), v)
	}
}

// Keys is a K cache as the CPU references read it through a block table.
type Keys struct {
	dt                                   attn.DType
	k                                    []byte
	blockSize, maxBlocks, numBlocks      int
	blockStride, tokenStride, headStride int64
}

// NewKeys reads kCache, of element type d, in the paged layout kv.
func NewKeys(d attn.DType, kv *attn.PagedKV, kCache []byte) Keys {
	return Keys{dt: d, k: kCache, blockSize: kv.BlockSize, maxBlocks: kv.MaxBlocksPerSeq, numBlocks: kv.NumBlocks,
		blockStride: kv.CacheBlockStride, tokenStride: kv.CacheTokenStride, headStride: kv.CacheHeadStride}
}

// Score appends scale*q.k of tokens [lo, hi) of the sequence whose table row
// is tableRow, for kv head g, and each token's element offset in the caches
// (the rows Attend reads V at). Tokens past the table's columns end the
// range, as the kernels' lookups do; tokens whose block is out of range are
// skipped.
func (c *Keys) Score(tableRow []int32, g int64, qv []float64, scale float64, lo, hi int, scores []float64, rows []int64) ([]float64, []int64) {
	for t := lo; t < hi; t++ {
		col := t / c.blockSize
		if col >= c.maxBlocks {
			break
		}
		blk := int64(tableRow[col])
		if blk < 0 || blk >= int64(c.numBlocks) {
			continue
		}
		ko := blk*c.blockStride + int64(t%c.blockSize)*c.tokenStride + g*c.headStride
		dot := 0.0
		for d := range qv {
			dot += qv[d] * c.dt.Load(c.k, ko+int64(d))
		}
		scores = append(scores, scale*dot)
		rows = append(rows, ko)
	}
	return scores, rows
}
