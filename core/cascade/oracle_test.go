package cascade_test

import (
	. "github.com/kvplug/kvplug/core/cascade"
	"math"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/attn/attnref"
	"github.com/kvplug/kvplug/core/kverr"
)

// The float64 oracle of a planned run, for this package's tests. It sits in
// a test file, not beside the planner, because the planner is host-only: the
// block manager (core/kvmanager) imports it, and an oracle there would link
// core/attn and the CUDA layer into every program that manages blocks.

// Ref is the CPU reference of a planned run, in float64: every work item's
// partial state (the query tokens of a shared run's members against its
// tokens, or one sequence's tail chunk, causal over its query tokens), then
// each query row's merge of its states by log-sum-exp weights, rounded once
// into out. It follows the plan in ws exactly as the kernels do, so
// comparing it with attnref.PagedDecode or attnref.PagedPrefill checks the
// plan, and comparing the GPU with it checks the kernels. A plan on the
// decode or prefill route runs attnref.PagedDecode or attnref.PagedPrefill.
// dl describes the layer: its Batch is the plan's sequences, q and out have
// the plan's Rows rows of QBatchStride / OutBatchStride (one per sequence in
// decode); heads and head_dim must be the plan's. lse ([rows, num_q_heads])
// may be nil.
func Ref(ws []int32, l *Layout, dl *attn.DecodeLayout, q, kCache, vCache []byte, table, seqLens []int32, out []byte, lse []float32) error {
	s, err := Header(ws, l)
	if err != nil {
		return err
	}
	if dl.Batch != s.Batch || dl.NumQHeads != l.NumQHeads || dl.NumQHeads/max(dl.NumKVHeads, 1) != l.Group || dl.HeadDim != l.HeadDim {
		return kverr.Errorf(kverr.InvalidArgument, "cascade_ref: the layer (batch %d, %d/%d heads, head_dim %d) is not the plan's (batch %d, %d q heads, group %d, head_dim %d)",
			dl.Batch, dl.NumQHeads, dl.NumKVHeads, dl.HeadDim, s.Batch, l.NumQHeads, l.Group, l.HeadDim)
	}
	if len(seqLens) < s.Batch {
		return kverr.Errorf(kverr.BufferTooSmall, "cascade_ref: seq_lens too short for %d sequences", s.Batch)
	}
	qstart := ws[l.QStart : l.QStart+s.Batch+1]
	switch s.Route {
	case RouteDecode:
		return attnref.PagedDecode(dl, q, kCache, vCache, table, seqLens, out, lse, 1)
	case RoutePrefill:
		sh := attn.PrefillShape{DType: dl.DType, HeadDim: dl.HeadDim, NumQHeads: dl.NumQHeads, NumKVHeads: dl.NumKVHeads, WindowLeft: -1}
		pl := attn.PrefillLayout{QTokenStride: dl.QBatchStride, QHeadStride: dl.QHeadStride,
			OutTokenStride: dl.OutBatchStride, OutHeadStride: dl.OutHeadStride,

			Scale: dl.Scale, PagedKV: attn.PagedKV{NumBlocks: dl.NumBlocks, BlockSize: dl.BlockSize,
				CacheBlockStride: dl.CacheBlockStride, CacheTokenStride: dl.CacheTokenStride, CacheHeadStride: dl.CacheHeadStride,
				MaxBlocksPerSeq: dl.MaxBlocksPerSeq, BlockTableStride: dl.BlockTableStride}}
		return attnref.PagedPrefill(&sh, &pl, qstart, seqLens[:s.Batch], q, kCache, vCache, table, out, lse)
	}
	dt := dl.DType
	if int64(len(out)) < int64(s.Rows)*int64(dt.Size()) {
		return kverr.Errorf(kverr.BufferTooSmall, "cascade_ref: out too short for %d rows", s.Rows)
	}
	D, H, g := l.HeadDim, l.NumQHeads, l.Group
	parts := make([]float64, s.Parts*H*D)
	plse := make([]float64, s.Parts*H)
	for i := range plse {
		plse[i] = math.Inf(-1)
	}
	qrows := ws[l.QRows : l.QRows+s.Rows]
	qv := make([]float64, D)
	var scores []float64
	var rows []int64
	keys := attnref.NewKeys(dt, &dl.PagedKV, kCache)
	scale := float64(attn.SoftmaxScale(dl.Scale, dl.HeadDim))
	for i := 0; i < s.Items; i++ {
		it := ws[l.Items+i*ItemInts : l.Items+(i+1)*ItemInts]
		rep, kb, ke := it[IRep], it[IKVBegin], it[IKVEnd]
		tq := l.TileQ
		delta := int64(1) << 30 // shared run: no mask
		if it[IDynamic] != 0 {
			tq = int(ws[HTailTileQ])
			ke = min(ke, seqLens[rep])
			delta = int64(seqLens[rep]) - int64(it[IMCount])
		}
		kb = max(kb, 0)
		trow := table[int64(rep)*dl.BlockTableStride:]
		r0 := int(it[ITile]) * tq
		r1 := min(r0+tq, int(it[IMCount])*g)
		for kvh := 0; kvh < dl.NumKVHeads; kvh++ {
			for r := r0; r < r1; r++ {
				k, hh := r/g, r%g
				qh := kvh*g + hh
				qo := int64(qrows[int(it[IMBegin])+k])*dl.QBatchStride + int64(qh)*dl.QHeadStride
				for d := 0; d < D; d++ {
					qv[d] = dt.Load(q, qo+int64(d))
				}
				pos := delta + int64(k)
				scores, rows = keys.Score(trow, int64(kvh), qv, scale, int(kb), int(min(int64(ke), pos+1)), scores[:0], rows[:0])
				pi := (int(it[IPartBase])+k)*H + qh
				plse[pi] = attnref.Attend(dt, vCache, rows, scores, parts[pi*D:(pi+1)*D])
			}
		}
	}
	segStart := ws[l.SegStart : l.SegStart+s.Batch+1]
	rowSeq := ws[l.RowSeq : l.RowSeq+s.Rows]
	acc := make([]float64, D)
	var stP []float64
	var stL []float64
	for row := 0; row < s.Rows; row++ {
		b := rowSeq[row]
		i := int32(row) - qstart[b]
		for h := 0; h < H; h++ {
			stP, stL = stP[:0], stL[:0]
			for k := segStart[b]; k < segStart[b+1]; k++ {
				sg := ws[l.Segs+int(k)*SegInts : l.Segs+int(k+1)*SegInts]
				for c := int32(0); c < sg[1]; c++ {
					pi := int(sg[0]+i+c*sg[2])*H + h
					stP = append(stP, parts[pi*D:(pi+1)*D]...)
					stL = append(stL, plse[pi])
				}
			}
			st := attnref.Merge(acc, stP, stL, D)
			oo := int64(row)*dl.OutBatchStride + int64(h)*dl.OutHeadStride
			for d := 0; d < D; d++ {
				dt.Store(out, oo+int64(d), acc[d])
			}
			if lse != nil {
				lse[row*H+h] = float32(st)
			}
		}
	}
	return nil
}
