package cascade

import (
	"math"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/kverr"
)

// Ref is the CPU reference of a planned run, in float64: every work item's
// partial state (the queries of a shared run's members against its tokens,
// or one sequence's tail chunk), then each sequence's merge of its states
// by log-sum-exp weights, rounded once into out. It follows the plan in ws
// exactly as the kernels do, so comparing it with attn.RefPagedDecode checks
// the plan, and comparing the GPU with it checks the kernels. A decode-route
// plan runs attn.RefPagedDecode. dl describes the layer (its Batch, heads
// and head_dim must be the plan's); lse may be nil.
func Ref(ws []int32, l *Layout, dl *attn.DecodeLayout, q, kCache, vCache []byte, table, seqLens []int32, out []byte, lse []float32) error {
	s, err := Header(ws, l)
	if err != nil {
		return err
	}
	if dl.Batch != s.Batch || dl.NumQHeads != l.NumQHeads || dl.NumQHeads/max(dl.NumKVHeads, 1) != l.Group || dl.HeadDim != l.HeadDim {
		return kverr.Errorf(kverr.InvalidArgument, "cascade_ref: the layer (batch %d, %d/%d heads, head_dim %d) is not the plan's (batch %d, %d q heads, group %d, head_dim %d)",
			dl.Batch, dl.NumQHeads, dl.NumKVHeads, dl.HeadDim, s.Batch, l.NumQHeads, l.Group, l.HeadDim)
	}
	if s.Route == RouteDecode {
		return attn.RefPagedDecode(dl, q, kCache, vCache, table, seqLens, out, lse, 1)
	}
	if len(seqLens) < s.Batch || len(out) < s.Batch*dl.DType.Size() {
		return kverr.Errorf(kverr.BufferTooSmall, "cascade_ref: seq_lens or out too short for %d sequences", s.Batch)
	}
	D, H, g := l.HeadDim, l.NumQHeads, l.Group
	dt := dl.DType
	parts := make([]float64, s.Parts*H*D)
	plse := make([]float64, s.Parts*H)
	for i := range plse {
		plse[i] = math.Inf(-1)
	}
	order := ws[l.Order : l.Order+s.Batch]
	qv := make([]float64, D)
	var scores []float64
	var rows []int64
	for i := 0; i < s.Items; i++ {
		it := ws[l.Items+i*ItemInts : l.Items+(i+1)*ItemInts]
		rep, kb, ke := it[iRep], it[iKVBegin], it[iKVEnd]
		if it[iDynamic] != 0 {
			ke = min(ke, seqLens[rep])
		}
		kb = max(kb, 0)
		trow := table[int64(rep)*dl.BlockTableStride:]
		r0 := int(it[iTile]) * l.TileQ
		r1 := min(r0+l.TileQ, int(it[iMCount])*g)
		for kvh := 0; kvh < dl.NumKVHeads; kvh++ {
			for r := r0; r < r1; r++ {
				j, hh := r/g, r%g
				qh := kvh*g + hh
				sq := int64(order[int(it[iMBegin])+j])
				qo := sq*dl.QBatchStride + int64(qh)*dl.QHeadStride
				for d := 0; d < D; d++ {
					qv[d] = dt.Load(q, qo+int64(d))
				}
				scores, rows = scores[:0], rows[:0]
				for t := int(kb); t < int(ke); t++ {
					col := t / dl.BlockSize
					if col >= dl.MaxBlocksPerSeq {
						break
					}
					blk := int64(trow[col])
					if blk < 0 || blk >= int64(dl.NumBlocks) {
						continue
					}
					ko := blk*dl.CacheBlockStride + int64(t%dl.BlockSize)*dl.CacheTokenStride + int64(kvh)*dl.CacheHeadStride
					dot := 0.0
					for d := 0; d < D; d++ {
						dot += qv[d] * dt.Load(kCache, ko+int64(d))
					}
					scores = append(scores, float64(attn.SoftmaxScale(dl.Scale, dl.HeadDim))*dot)
					rows = append(rows, ko)
				}
				pi := (int(it[iPartBase])+j)*H + qh
				plse[pi] = attn.AttendRef(dt, vCache, rows, scores, parts[pi*D:(pi+1)*D])
			}
		}
	}
	segStart := ws[l.SegStart : l.SegStart+s.Batch+1]
	acc := make([]float64, D)
	var stP []float64
	var stL []float64
	for b := 0; b < s.Batch; b++ {
		for h := 0; h < H; h++ {
			stP, stL = stP[:0], stL[:0]
			for k := segStart[b]; k < segStart[b+1]; k++ {
				sg := ws[l.Segs+int(k)*SegInts : l.Segs+int(k+1)*SegInts]
				for c := int32(0); c < sg[1]; c++ {
					pi := int(sg[0]+c*sg[2])*H + h
					stP = append(stP, parts[pi*D:(pi+1)*D]...)
					stL = append(stL, plse[pi])
				}
			}
			st := attn.MergeRef(acc, stP, stL, D)
			oo := int64(b)*dl.OutBatchStride + int64(h)*dl.OutHeadStride
			for d := 0; d < D; d++ {
				dt.Store(out, oo+int64(d), acc[d])
			}
			if lse != nil {
				lse[b*H+h] = float32(st)
			}
		}
	}
	return nil
}
