// Package attn launches the library's attention kernels (KV write, paged
// decode with split-KV, merge of attention states) on the engine's device
// pointers and stream. Their float64 oracle, which the tests hold the
// kernels to, is core/attn/attnref.
//
// Layouts follow kernels/kvplug_kernels.h: strides count elements of the
// tensor's dtype (float32 elements for log-sum-exp arrays), head_dim is
// contiguous, and the paged cache is [num_blocks, block_size, num_kv_heads,
// head_dim] with K and V sharing strides. Launches check every argument
// first and report misuse as a status, never as a fault; they allocate
// nothing and never synchronise, so they can be captured in CUDA graphs.
package attn

import (
	"math"
	"math/bits"
	"slices"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
)

// Limits of the arguments (beyond these the kernels' grids or the int32
// fields of their parameters overflow).
const (
	MaxHeads      = 1 << 12
	MaxSplits     = 256
	maxBatch      = limits.AttnBatch // decode grid.y (at most maxGridYZ: limits_test.go)
	maxElemIndex  = 1 << 50          // largest element offset any stride may reach
	maxScaleIndex = 1<<31 - 1        // largest token-head scale index (the decode keeps them as int32)
)

// SupportedHeadDim reports whether the kernels are built for head_dim d.
func SupportedHeadDim(d int) bool { return d == 64 || d == 128 || d == 256 }

// KVWriteLayout is the shape of a KV write: K and V of this step
// ([num_tokens, num_kv_heads, head_dim]) scattered into the paged caches
// through a slot mapping (slot = block*block_size + offset; negative =
// padding, skipped).
type KVWriteLayout struct {
	DType      DType
	HeadDim    int
	NumTokens  int // 0: nothing to do
	NumKVHeads int

	KeyTokenStride, KeyHeadStride     int64
	ValueTokenStride, ValueHeadStride int64

	// The caches written (no block table: MaxBlocksPerSeq,
	// BlockTableStride and BlockTable are 0).
	PagedKV
}

// DecodeLayout is the shape of paged decode attention: one query token per
// sequence, q and out [batch, num_q_heads, head_dim], the block table int32
// [batch, block_table_stride] of which columns < max_blocks_per_seq are read,
// sequence lengths int32 [batch], and an optional float32 log-sum-exp
// [batch, num_q_heads], contiguous.
type DecodeLayout struct {
	DType      DType
	HeadDim    int
	Batch      int // 0: nothing to do
	NumQHeads  int
	NumKVHeads int

	QBatchStride, QHeadStride     int64
	OutBatchStride, OutHeadStride int64

	PagedKV // the caches read and the block table [batch, block_table_stride]

	Scale float32 // softmax scale; 0 means 1/sqrt(head_dim) (SoftmaxScale)

	// QLen is the new tokens per sequence, 0..MaxDecodeQLen (0 means 1):
	// q and out hold Batch*QLen rows (sequence b's token t at row
	// b*QLen+t; QBatchStride and OutBatchStride are row strides), each new
	// token at position seq_len-QLen+t, causal among them.
	QLen int
}

// MaxDecodeQLen is the most new tokens per sequence of one paged decode
// (KVP_DECODE_MAX_Q_LEN): the tensor-core tile's 16 rows.
const MaxDecodeQLen = 16

// Rows is the q and out rows: Batch times the new tokens per sequence.
func (l *DecodeLayout) Rows() int { return l.Batch * l.qLen() }

func (l *DecodeLayout) qLen() int { return max(l.QLen, 1) }

// MergeLayout is the shape of a merge of NumStates attention states, each a
// value [num_tokens, num_heads, head_dim] (dtype) and a float32 natural-log
// log-sum-exp [num_tokens, num_heads] (-inf: empty state), all values with
// the same strides and all lse arrays with the same strides.
type MergeLayout struct {
	DType     DType
	HeadDim   int
	NumStates int // 1..8
	NumTokens int // 0: nothing to do
	NumHeads  int

	VTokenStride, VHeadStride           int64
	STokenStride, SHeadStride           int64 // float32 elements
	OutTokenStride, OutHeadStride       int64
	OutLSETokenStride, OutLSEHeadStride int64 // float32 elements; used when out_lse is given
}

// dim is one dimension of a strided view: extent and stride in elements.
type dim struct {
	n      int
	stride int64
}

// span returns one past the largest element offset of a view whose innermost
// inner elements are contiguous, or an error when a stride is negative or
// the offsets overflow.
func span(what, name string, inner int, dims ...dim) (int64, error) {
	end := int64(inner)
	for _, d := range dims {
		if d.stride < 0 {
			return 0, kverr.Errorf(kverr.InvalidArgument, "%s: %s: strides must not be negative: got %d", what, name, d.stride)
		}
		if d.n <= 1 {
			continue
		}
		hi, lo := bits.Mul64(uint64(d.stride), uint64(d.n-1))
		if hi != 0 || lo > maxElemIndex {
			return 0, kverr.Errorf(kverr.InvalidArgument, "%s: %s: stride %d over %d elements reaches past 2^50 elements", what, name, d.stride, d.n)
		}
		end += int64(lo)
		if end > maxElemIndex {
			return 0, kverr.Errorf(kverr.InvalidArgument, "%s: %s: strides reach past 2^50 elements", what, name)
		}
	}
	return end, nil
}

// disjoint reports an error unless the rows of a written view (inner
// contiguous elements each) never overlap: sorted by stride, each stride must
// step over everything the smaller ones span.
func disjoint(what, name string, inner int, dims ...dim) error {
	ds := make([]dim, 0, 4)
	for _, d := range dims {
		if d.n > 1 {
			ds = append(ds, d)
		}
	}
	slices.SortFunc(ds, func(a, b dim) int {
		switch {
		case a.stride < b.stride:
			return -1
		case a.stride > b.stride:
			return 1
		}
		return 0
	})
	reach := int64(inner)
	for _, d := range ds {
		if d.stride < reach {
			return kverr.Errorf(kverr.InvalidArgument, "%s: %s: written rows overlap: a stride of %d elements is less than the %d elements the inner dimensions span", what, name, d.stride, reach)
		}
		reach += d.stride * int64(d.n-1)
	}
	return nil
}

// spanQOut is the extents of a layer's q and out, each rows by heads rows of
// headDim elements at the given strides; rows and heads of out must not
// overlap (disjoint).
func spanQOut(what string, headDim, rows, heads int, qRow, qHead, outRow, outHead int64) (q, out int64, err error) {
	if q, err = span(what, "q", headDim, dim{rows, qRow}, dim{heads, qHead}); err != nil {
		return q, out, err
	}
	o := []dim{{rows, outRow}, {heads, outHead}}
	if out, err = span(what, "out", headDim, o...); err != nil {
		return q, out, err
	}
	return q, out, disjoint(what, "out", headDim, o...)
}

// vecMultiple checks the kernels' 16-byte vector rule: every stride of a
// dtype tensor is a multiple of 16 / sizeof(dtype) elements.
func vecMultiple(what string, d DType, strides ...int64) error {
	v := int64(16 / d.Size())
	for _, s := range strides {
		if s%v != 0 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: strides of a %v tensor must be multiples of %d elements (16 bytes): got %d", what, d, v, s)
		}
	}
	return nil
}

func inRange(what string, v, lo, hi int) error { return limits.Range(what, v, lo, hi) }

func checkHead(what string, d DType, headDim int) error {
	if err := d.check(what); err != nil {
		return err
	}
	if !SupportedHeadDim(headDim) {
		return kverr.Errorf(kverr.Unsupported, "%s: head_dim must be 64, 128 or 256: got %d", what, headDim)
	}
	return nil
}

// extents of a layout's tensors in elements, for the CPU reference's bounds
// checks.
type kvWriteExtents struct{ key, value, cache int64 }

func (l *KVWriteLayout) validate() (kvWriteExtents, error) {
	const what = "kv_write"
	var e kvWriteExtents
	if err := firstErr(
		checkHead(what, l.DType, l.HeadDim),
		inRange(what+": num_tokens", l.NumTokens, 0, 1<<30),
		inRange(what+": num_kv_heads", l.NumKVHeads, 1, MaxHeads),
	); err != nil {
		return e, err
	}
	if err := vecMultiple(what, l.DType, l.KeyTokenStride, l.KeyHeadStride, l.ValueTokenStride, l.ValueHeadStride); err != nil {
		return e, err
	}
	var err error
	if e.cache, _, err = l.PagedKV.validate(what, l.DType, l.HeadDim, l.NumKVHeads, false, 0); err != nil {
		return e, err
	}
	if e.key, err = span(what, "key", l.HeadDim, dim{l.NumTokens, l.KeyTokenStride}, dim{l.NumKVHeads, l.KeyHeadStride}); err != nil {
		return e, err
	}
	if e.value, err = span(what, "value", l.HeadDim, dim{l.NumTokens, l.ValueTokenStride}, dim{l.NumKVHeads, l.ValueHeadStride}); err != nil {
		return e, err
	}
	if l.NumTokens == 0 {
		e.key, e.value = 0, 0
	}
	return e, nil
}

type decodeExtents struct{ q, cache, out, table int64 }

func (l *DecodeLayout) validate() (decodeExtents, error) {
	const what = "paged_decode"
	var e decodeExtents
	if err := firstErr(
		checkHead(what, l.DType, l.HeadDim),
		inRange(what+": batch", l.Batch, 0, maxBatch),
		inRange(what+": num_q_heads", l.NumQHeads, 1, MaxHeads),
		inRange(what+": num_kv_heads", l.NumKVHeads, 1, MaxHeads),
	); err != nil {
		return e, err
	}
	if l.NumQHeads%l.NumKVHeads != 0 {
		return e, kverr.Errorf(kverr.InvalidArgument, "%s: num_q_heads (%d) must be a multiple of num_kv_heads (%d)", what, l.NumQHeads, l.NumKVHeads)
	}
	if err := inRange(what+": q_len", l.QLen, 0, MaxDecodeQLen); err != nil {
		return e, err
	}
	if err := checkScale(what, l.Scale); err != nil {
		return e, err
	}
	if err := vecMultiple(what, l.DType, l.QBatchStride, l.QHeadStride, l.OutBatchStride, l.OutHeadStride); err != nil {
		return e, err
	}
	var err error
	if e.cache, e.table, err = l.PagedKV.validate(what, l.DType, l.HeadDim, l.NumKVHeads, true, l.Batch); err != nil {
		return e, err
	}
	if e.q, e.out, err = spanQOut(what, l.HeadDim, l.Rows(), l.NumQHeads, l.QBatchStride, l.QHeadStride, l.OutBatchStride, l.OutHeadStride); err != nil {
		return e, err
	}
	if l.Batch == 0 {
		e.q, e.out, e.table = 0, 0, 0
	}
	return e, nil
}

type mergeExtents struct{ v, s, out, outLSE int64 }

func (l *MergeLayout) validate(withLSE bool) (mergeExtents, error) {
	const what = "merge_states"
	var e mergeExtents
	if err := firstErr(
		checkHead(what, l.DType, l.HeadDim),
		inRange(what+": num_states", l.NumStates, 1, maxMergeStates),
		inRange(what+": num_tokens", l.NumTokens, 0, 1<<30),
		inRange(what+": num_heads", l.NumHeads, 1, MaxHeads),
	); err != nil {
		return e, err
	}
	if int64(l.NumTokens)*int64(l.NumHeads) > 1<<31-1 {
		return e, kverr.Errorf(kverr.InvalidArgument, "%s: num_tokens*num_heads must be below 2^31: %d*%d", what, l.NumTokens, l.NumHeads)
	}
	if err := vecMultiple(what, l.DType, l.VTokenStride, l.VHeadStride, l.OutTokenStride, l.OutHeadStride); err != nil {
		return e, err
	}
	var err error
	if e.v, err = span(what, "v", l.HeadDim, dim{l.NumTokens, l.VTokenStride}, dim{l.NumHeads, l.VHeadStride}); err != nil {
		return e, err
	}
	if e.s, err = span(what, "s", 1, dim{l.NumTokens, l.STokenStride}, dim{l.NumHeads, l.SHeadStride}); err != nil {
		return e, err
	}
	out := []dim{{l.NumTokens, l.OutTokenStride}, {l.NumHeads, l.OutHeadStride}}
	if e.out, err = span(what, "out", l.HeadDim, out...); err != nil {
		return e, err
	}
	if err := disjoint(what, "out", l.HeadDim, out...); err != nil {
		return e, err
	}
	if withLSE {
		lse := []dim{{l.NumTokens, l.OutLSETokenStride}, {l.NumHeads, l.OutLSEHeadStride}}
		if e.outLSE, err = span(what, "out_lse", 1, lse...); err != nil {
			return e, err
		}
		if err := disjoint(what, "out_lse", 1, lse...); err != nil {
			return e, err
		}
	}
	if l.NumTokens == 0 {
		e = mergeExtents{}
	}
	return e, nil
}

// checkScale accepts a finite scale of 0 (the default) or above. The
// tensor-core kernels take a row's maximum over the unscaled scores, which
// is the maximum of the scaled ones only for a positive scale.
func checkScale(what string, scale float32) error {
	if !(scale >= 0) || scale > math.MaxFloat32 {
		return kverr.Errorf(kverr.InvalidArgument, "%s: scale must be finite and not negative (0: 1/sqrt(head_dim)): got %g", what, scale)
	}
	return nil
}

// SoftmaxScale is the scale a launch uses: scale itself, or 1/sqrt(headDim)
// when scale is 0, the default of every attention call (Go, C and the
// bindings alike).
func SoftmaxScale(scale float32, headDim int) float32 {
	if scale == 0 && headDim > 0 {
		return float32(1 / math.Sqrt(float64(headDim)))
	}
	return scale
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// firstErr is the first non-nil error of a list of checks.
func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
