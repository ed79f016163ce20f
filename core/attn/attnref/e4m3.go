package attnref

import (
	"cmp"
	"math"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/kverr"
)

// The e4m3 (FP8) cache format in the references: the KV write quantises
// exactly as the kernels do (per-row scale max|x| / 448 computed in float32,
// x / scale rounded to nearest even and saturated), and the readers see the
// cache dequantised, e4m3 * scale, in float64.

// scaleLen is the float32 scales an e4m3 cache of kv's layout keeps for K
// (and for V): one per (block, token, kv head), or one.
func scaleLen(kv *attn.PagedKV, kvHeads int) int64 {
	if kv.ScaleKind == attn.ScaleTensor {
		return 1
	}
	return int64(kv.NumBlocks) * int64(kv.BlockSize) * int64(kvHeads)
}

// scaleIndex is the scale index of (blk, off, kv head h).
func scaleIndex(kv *attn.PagedKV, kvHeads int, blk, off, h int64) int64 {
	if kv.ScaleKind == attn.ScaleTensor {
		return 0
	}
	return (blk*int64(kv.BlockSize)+off)*int64(kvHeads) + h
}

func needE4M3(what string, kv *attn.PagedKV) error {
	if !kv.E4M3() {
		return kverr.Errorf(kverr.InvalidArgument, "%s: the layout's cache is not e4m3", what)
	}
	return nil
}

// KVWriteE4M3 is the CPU reference of attn.KVWrite into an e4m3 cache
// (l.PagedKV.DType E4M3): kScale and vScale are the caches' scales, written
// per row (ScaleTokenHead) or read (ScaleTensor).
func KVWriteE4M3(l *attn.KVWriteLayout, key, value []byte, slots []int32, kCache, vCache []byte, kScale, vScale []float32) error {
	e, err := l.Extents()
	if err != nil {
		return err
	}
	ns := scaleLen(&l.PagedKV, l.NumKVHeads)
	if err := cmp.Or(
		needE4M3("kv_write", &l.PagedKV),
		needBytes("kv_write: key", key, e.Key, l.DType),
		needBytes("kv_write: value", value, e.Value, l.DType),
		needLen("kv_write: slot_mapping", slots, int64(l.NumTokens)),
		needBytes("kv_write: k_cache", kCache, e.Cache, attn.E4M3),
		needBytes("kv_write: v_cache", vCache, e.Cache, attn.E4M3),
		needLen("kv_write: k_scale", kScale, ns),
		needLen("kv_write: v_scale", vScale, ns),
	); err != nil {
		return err
	}
	row := make([]float32, l.HeadDim)
	quant := func(src []byte, off int64, dst []byte, at int64, scales []float32, si int64) {
		amax := float32(0)
		for i := range row {
			row[i] = float32(l.DType.Load(src, off+int64(i)))
			amax = max(amax, float32(math.Abs(float64(row[i]))))
		}
		s := scales[si]
		if l.ScaleKind == attn.ScaleTokenHead {
			s = 1
			if amax > 0 {
				s = amax / attn.E4M3Max
			}
			scales[si] = s
		}
		for i, x := range row {
			dst[at+int64(i)] = attn.FloatToE4M3(x / s)
		}
	}
	writeRows(l, slots, func(r writeRow) {
		si := scaleIndex(&l.PagedKV, l.NumKVHeads, r.blk, r.off, r.head)
		quant(key, r.key, kCache, r.dst, kScale, si)
		quant(value, r.value, vCache, r.dst, vScale, si)
	})
	return nil
}

// Dequantize is an e4m3 cache of layout kv (kvHeads heads of headDim) as
// float32 elements at the same element offsets, each e4m3 * its scale
// (rounded to float32, exact for every finite product of the format); the
// elements between rows are 0.
func Dequantize(kv *attn.PagedKV, kvHeads, headDim int, cache []byte, scales []float32) ([]byte, error) {
	if err := cmp.Or(needE4M3("dequantize", kv), needLen("dequantize: scales", scales, scaleLen(kv, kvHeads))); err != nil {
		return nil, err
	}
	out := make([]byte, 4*len(cache))
	for blk := int64(0); blk < int64(kv.NumBlocks); blk++ {
		for off := int64(0); off < int64(kv.BlockSize); off++ {
			for h := int64(0); h < int64(kvHeads); h++ {
				o := blk*kv.CacheBlockStride + off*kv.CacheTokenStride + h*kv.CacheHeadStride
				s := float64(scales[scaleIndex(kv, kvHeads, blk, off, h)])
				for i := int64(0); i < int64(headDim); i++ {
					if o+i < int64(len(cache)) {
						attn.F32.Store(out, o+i, attn.E4M3.Load(cache, o+i)*s)
					}
				}
			}
		}
	}
	return out, nil
}

// PagedDecodeE4M3 is PagedDecode over an e4m3 cache (l.PagedKV.DType
// E4M3) with its scales: attention over the dequantised cache.
func PagedDecodeE4M3(l *attn.DecodeLayout, q, kCache, vCache []byte, kScale, vScale []float32, table, seqLens []int32, out []byte, lse []float32, numSplits int) error {
	e, err := l.Extents()
	if err != nil {
		return err
	}
	if err := cmp.Or(needBytes("paged_decode: k_cache", kCache, e.Cache, attn.E4M3),
		needBytes("paged_decode: v_cache", vCache, e.Cache, attn.E4M3)); err != nil {
		return err
	}
	kf, err := Dequantize(&l.PagedKV, l.NumKVHeads, l.HeadDim, kCache, kScale)
	if err != nil {
		return err
	}
	vf, err := Dequantize(&l.PagedKV, l.NumKVHeads, l.HeadDim, vCache, vScale)
	if err != nil {
		return err
	}
	return pagedDecode(l, attn.F32, q, kf, vf, table, seqLens, out, lse, numSplits, nil)
}
