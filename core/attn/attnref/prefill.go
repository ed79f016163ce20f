package attnref

import (
	"cmp"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/kverr"
)

// PagedPrefill is the CPU reference of attn.PlanPrefill + attn.PagedPrefill, in
// float64. Sequence b's query rows [qoIndptr[b], qoIndptr[b+1]) sit at
// positions [kvLens[b] - q_len_b, kvLens[b]); row i at position pos_i and
// query head h (kv head h / (num_q_heads/num_kv_heads)) attends to tokens
// [max(0, pos_i - window_left), pos_i] (window_left < 0: [0, pos_i]) of the
// sequence, token t read from block table[b][t / block_size] at offset
// t % block_size; tokens whose table column is >= max_blocks_per_seq or whose
// block id is outside [0, num_blocks) are ignored. out = softmax(scale q.K) V;
// lse (when non-nil, [total_q, num_q_heads] contiguous) = log(sum exp(scale
// q.k)). A row that sees no token gives out = 0, lse = -inf.
func PagedPrefill(s *attn.PrefillShape, l *attn.PrefillLayout, qoIndptr, kvLens []int32, q, kCache, vCache []byte, table []int32, out []byte, lse []float32) error {
	return PagedPrefillSinks(s, l, qoIndptr, kvLens, q, kCache, vCache, table, out, lse, nil)
}

// PagedPrefillSinks is PagedPrefill with attention sinks
// (attn.PagedPrefillArgs.Sinks): sinks[h] (natural log) joins each row's
// softmax denominator for q head h once (AddSink), after the causal mask
// and the window; nil is PagedPrefill.
func PagedPrefillSinks(s *attn.PrefillShape, l *attn.PrefillLayout, qoIndptr, kvLens []int32, q, kCache, vCache []byte, table []int32, out []byte, lse []float32, sinks []float32) error {
	const what = "paged_prefill"
	st, err := s.CheckBatch(what, qoIndptr, kvLens)
	if err != nil {
		return err
	}
	p := attn.PrefillPlan{Kind: attn.KindPrefill, Route: attn.RoutePrefill, PrefillShape: *s, Batch: len(kvLens),
		TotalQ: st.TotalQ, MaxQLen: st.MaxQLen, MaxKVLen: st.MaxKVLen, NumItems: int(st.Items), NumSplits: 1}
	e, err := l.Extents(what, &p)
	if err != nil {
		return err
	}
	if err := cmp.Or(
		needBytes(what+": q", q, e.Q, s.DType),
		needBytes(what+": k_cache", kCache, e.Cache, s.DType),
		needBytes(what+": v_cache", vCache, e.Cache, s.DType),
		needLen(what+": block_table", table, e.Table),
		needBytes(what+": out", out, e.Out, s.DType),
	); err != nil {
		return err
	}
	if lse != nil {
		if err := needLen(what+": lse", lse, int64(st.TotalQ)*int64(s.NumQHeads)); err != nil {
			return err
		}
	}
	if sinks != nil {
		if err := needLen(what+": sinks", sinks, int64(s.NumQHeads)); err != nil {
			return err
		}
	}
	D := s.HeadDim
	group := s.NumQHeads / s.NumKVHeads
	qv := make([]float64, D)
	o := make([]float64, D)
	var scores []float64
	var rows []int64
	kv := NewKeys(s.DType, &l.PagedKV, kCache)
	scale := float64(attn.SoftmaxScale(l.Scale, p.HeadDim))
	for b := range kvLens {
		qStart, qLen, kvLen := int(qoIndptr[b]), int(qoIndptr[b+1]-qoIndptr[b]), int(kvLens[b])
		tableRow := table[int64(b)*l.BlockTableStride:]
		for i := 0; i < qLen; i++ {
			pos := kvLen - qLen + i
			lo := 0
			if s.WindowLeft >= 0 {
				lo = max(0, pos-s.WindowLeft)
			}
			row := int64(qStart + i)
			for h := 0; h < s.NumQHeads; h++ {
				g := int64(h / group)
				qo := row*l.QTokenStride + int64(h)*l.QHeadStride
				loadRow(s.DType, q, qo, qv)
				scores, rows = kv.Score(tableRow, g, qv, scale, lo, pos+1, scores[:0], rows[:0])
				st := Attend(s.DType, vCache, rows, scores, o)
				if sinks != nil {
					st = AddSink(o, st, float64(sinks[h]))
				}
				oo := row*l.OutTokenStride + int64(h)*l.OutHeadStride
				storeRow(s.DType, out, oo, o)
				if lse != nil {
					lse[row*int64(s.NumQHeads)+int64(h)] = float32(st)
				}
			}
		}
	}
	return nil
}

// PrefillItems returns the work items the plan kernel writes for a batch
// (host copies), in its order: for each sequence, its row tiles from the
// last to the first, as (b, q_start, q_len, kv_len, tile). For tests and
// tools; the launch path never builds it.
func PrefillItems(s *attn.PrefillShape, qoIndptr, kvLens []int32) ([][5]int32, error) {
	st, err := s.CheckBatch("prefill_items", qoIndptr, kvLens)
	if err != nil {
		return nil, err
	}
	if st.Items > 1<<24 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "prefill_items: %d items is more than a test needs", st.Items)
	}
	group := int64(s.NumQHeads / s.NumKVHeads)
	tile := int64(attn.PrefillTileRows(s.DType, s.HeadDim))
	items := make([][5]int32, 0, st.Items)
	for b := range kvLens {
		qLen := int64(qoIndptr[b+1] - qoIndptr[b])
		tiles := (qLen*group + tile - 1) / tile
		for t := tiles - 1; t >= 0; t-- {
			items = append(items, [5]int32{int32(b), qoIndptr[b], int32(qLen), kvLens[b], int32(t)})
		}
	}
	return items, nil
}
