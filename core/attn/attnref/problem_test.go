package attnref

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvplug/kvplug/core/attn"
)

// decodeProblem is a random decode batch on host memory: the logical K and V
// of every sequence (float64 copies of dtype values), a paged cache filled
// from them by KVWrite through a random block allocation, and the
// matching block table.
type decodeProblem struct {
	l      attn.DecodeLayout
	w      attn.KVWriteLayout // the write that filled the cache
	lens   []int32
	table  []int32
	q      []byte
	kc, vc []byte
	// Inputs of the write: all tokens of all sequences, in order.
	key, value []byte
	slots      []int32
	// Logical keys/values: seqK[b][t][h*D+d].
	seqK, seqV [][][]float64
}

type problemShape struct {
	d         attn.DType
	headDim   int
	qHeads    int
	kvHeads   int
	blockSize int
	lens      []int
	padded    bool // strides with gaps, and a combined-tensor-like cache
}

// randVal is a uniform value in [-2, 2) representable in d.
func randVal(r *rand.Rand, d attn.DType) float64 {
	v := float32(r.Float64()*4 - 2)
	switch d {
	case attn.F16:
		return float64(attn.HalfToFloat(attn.FloatToHalf(v)))
	case attn.BF16:
		return float64(attn.BFloat16ToFloat(attn.FloatToBFloat16(v)))
	}
	return float64(v)
}

func newDecodeProblem(t testing.TB, r *rand.Rand, s problemShape) *decodeProblem {
	t.Helper()
	d, D := s.d, s.headDim
	vec := int64(16 / d.Size())
	pad := int64(0)
	if s.padded {
		pad = vec
	}
	batch := len(s.lens)
	maxBlocks := 1
	need := 0
	for _, L := range s.lens {
		nb := ceilDiv(L, s.blockSize)
		maxBlocks = max(maxBlocks, nb)
		need += nb
	}
	numBlocks := need + 3
	p := &decodeProblem{}
	headStride := int64(D) + pad
	tokenStride := int64(s.kvHeads) * headStride
	blockStride := int64(s.blockSize)*tokenStride + pad
	tableStride := int64(maxBlocks) + int64(r.IntN(3))
	p.l = attn.DecodeLayout{
		DType: d, HeadDim: D, Batch: batch, NumQHeads: s.qHeads, NumKVHeads: s.kvHeads,
		QBatchStride: int64(s.qHeads) * headStride, QHeadStride: headStride,
		OutBatchStride: int64(s.qHeads)*headStride + pad, OutHeadStride: headStride,

		Scale: float32(1 / math.Sqrt(float64(D))), PagedKV:

		// Blocks in random order; table columns past a sequence's blocks hold
		// garbage (including ids out of range) that must never be read.
		attn.PagedKV{NumBlocks: numBlocks, BlockSize: s.blockSize,
			CacheBlockStride: blockStride, CacheTokenStride: tokenStride, CacheHeadStride: headStride,
			MaxBlocksPerSeq: maxBlocks, BlockTableStride: tableStride},
	}

	perm := r.Perm(numBlocks)
	p.table = make([]int32, int64(max(batch, 1))*tableStride)
	for i := range p.table {
		p.table[i] = int32(r.IntN(3*numBlocks) - numBlocks)
	}
	p.lens = make([]int32, batch)
	total := 0
	for _, L := range s.lens {
		total += L
	}
	p.w = attn.KVWriteLayout{
		DType: d, HeadDim: D, NumTokens: total, NumKVHeads: s.kvHeads,
		KeyTokenStride: tokenStride + pad, KeyHeadStride: headStride,
		ValueTokenStride: tokenStride, ValueHeadStride: headStride, PagedKV: attn.PagedKV{NumBlocks: numBlocks, BlockSize: s.blockSize,
			CacheBlockStride: blockStride, CacheTokenStride: tokenStride, CacheHeadStride: headStride},
	}
	es := int64(d.Size())
	p.key = make([]byte, (int64(max(total, 1))*p.w.KeyTokenStride)*es)
	p.value = make([]byte, (int64(max(total, 1))*p.w.ValueTokenStride)*es)
	p.slots = make([]int32, total)
	p.seqK = make([][][]float64, batch)
	p.seqV = make([][][]float64, batch)
	next, tok := 0, 0
	for b, L := range s.lens {
		p.lens[b] = int32(L)
		nb := ceilDiv(L, s.blockSize)
		for c := 0; c < nb; c++ {
			p.table[int64(b)*tableStride+int64(c)] = int32(perm[next])
			next++
		}
		for i := 0; i < L; i++ {
			kRow := make([]float64, s.kvHeads*D)
			vRow := make([]float64, s.kvHeads*D)
			for h := 0; h < s.kvHeads; h++ {
				for e := 0; e < D; e++ {
					kRow[h*D+e] = randVal(r, d)
					vRow[h*D+e] = randVal(r, d)
					d.Store(p.key, int64(tok)*p.w.KeyTokenStride+int64(h)*headStride+int64(e), kRow[h*D+e])
					d.Store(p.value, int64(tok)*p.w.ValueTokenStride+int64(h)*headStride+int64(e), vRow[h*D+e])
				}
			}
			p.seqK[b] = append(p.seqK[b], kRow)
			p.seqV[b] = append(p.seqV[b], vRow)
			blk := p.table[int64(b)*tableStride+int64(i/s.blockSize)]
			p.slots[tok] = blk*int32(s.blockSize) + int32(i%s.blockSize)
			tok++
		}
	}
	cacheElems := int64(numBlocks) * blockStride
	p.kc = make([]byte, cacheElems*es)
	p.vc = make([]byte, cacheElems*es)
	// Poison the cache so that a read of an unwritten slot shows.
	for i := int64(0); i < cacheElems; i++ {
		d.Store(p.kc, i, math.NaN())
		d.Store(p.vc, i, math.NaN())
	}
	if err := KVWrite(&p.w, p.key, p.value, p.slots, p.kc, p.vc); err != nil {
		t.Fatalf("KVWrite: %v", err)
	}
	p.q = make([]byte, (int64(max(batch, 1))*p.l.QBatchStride)*es)
	for i := int64(0); i < int64(len(p.q))/es; i++ {
		d.Store(p.q, i, randVal(r, d))
	}
	return p
}

func (p *decodeProblem) outBytes() int {
	return int(int64(max(p.l.Rows(), 1))*p.l.OutBatchStride) * p.l.DType.Size()
}

// naive computes attention for (b, head i) directly from the logical K, V in
// float64: two passes, max then exp-sum.
func (p *decodeProblem) naive(b, i int) ([]float64, float64) {
	D := p.l.HeadDim
	g := i / (p.l.NumQHeads / p.l.NumKVHeads)
	out := make([]float64, D)
	L := len(p.seqK[b])
	if L == 0 {
		return out, math.Inf(-1)
	}
	qo := int64(b)*p.l.QBatchStride + int64(i)*p.l.QHeadStride
	s := make([]float64, L)
	m := math.Inf(-1)
	for t := 0; t < L; t++ {
		for e := 0; e < D; e++ {
			s[t] += p.l.DType.Load(p.q, qo+int64(e)) * p.seqK[b][t][g*D+e]
		}
		s[t] *= float64(p.l.Scale)
		m = math.Max(m, s[t])
	}
	z := 0.0
	for t := 0; t < L; t++ {
		z += math.Exp(s[t] - m)
	}
	for t := 0; t < L; t++ {
		w := math.Exp(s[t]-m) / z
		for e := 0; e < D; e++ {
			out[e] += w * p.seqV[b][t][g*D+e]
		}
	}
	return out, m + math.Log(z)
}

// ulp is the relative spacing of the dtype's values near 1.
func ulp(d attn.DType) float64 {
	switch d {
	case attn.F16:
		return 1.0 / 1024
	case attn.BF16:
		return 1.0 / 128
	}
	return 1.0 / (1 << 23)
}

// subnormalStep is the spacing of the dtype's smallest values.
func subnormalStep(d attn.DType) float64 {
	if d == attn.F16 {
		return 1.0 / (1 << 24)
	}
	return 1e-30
}
