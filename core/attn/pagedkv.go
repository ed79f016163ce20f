package attn

import (
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// PagedKV is one layer's paged KV cache as every launch that reads or
// writes it takes it (kvp_paged_kv of the C header, kvp_paged_kv_params of
// the kernels): K and V [num_blocks, block_size, num_kv_heads, head_dim]
// sharing strides (elements), and the block table int32 [rows,
// block_table_stride] of which columns < MaxBlocksPerSeq are read. The KV
// write scatters through a slot mapping and reads no table: MaxBlocksPerSeq,
// BlockTableStride and BlockTable are 0 there.
//
// The cache's head count and head_dim are the launch's (the layouts carry
// them for q and out too), and so is its dtype unless DType says otherwise:
// an E4M3 cache under a 16-bit launch, with its scales. One validate and one
// kernel-side reader serve every launch, so a cache format is added here
// once.
type PagedKV struct {
	NumBlocks, BlockSize                                int
	CacheBlockStride, CacheTokenStride, CacheHeadStride int64 // elements of the cache's dtype

	MaxBlocksPerSeq  int
	BlockTableStride int64

	KCache, VCache cuda.DevicePtr
	BlockTable     cuda.DevicePtr // int32 [rows, block_table_stride]

	// DType is the cache's element type: 0 (or the launch's dtype) for a
	// cache of the launch's dtype, E4M3 for an FP8 cache under an F16 or
	// BF16 launch, which then needs Scale and the scale arrays.
	DType DType
	// ScaleKind is how an E4M3 cache is scaled (0 for any other); KScale and
	// VScale are its float32 scales: [NumBlocks, BlockSize, kv heads]
	// contiguous for ScaleTokenHead (written by the KV write), one value each
	// for ScaleTensor. A stored element x stands for x * scale.
	ScaleKind      ScaleKind
	KScale, VScale cuda.DevicePtr
}

// ScaleKind is how an E4M3 cache is scaled (enum kvp_kv_scale).
type ScaleKind int32

const (
	ScaleNone      ScaleKind = 0 // a 16-bit or f32 cache
	ScaleTokenHead ScaleKind = 1 // one float32 per (block, token, kv head)
	ScaleTensor    ScaleKind = 2 // one float32 for the whole cache
)

// cacheDType is the element type of kv's caches under a launch of dtype d.
func (kv *PagedKV) cacheDType(d DType) DType {
	if kv.DType == 0 {
		return d
	}
	return kv.DType
}

// E4M3 reports whether the cache is FP8 e4m3.
func (kv *PagedKV) E4M3() bool { return kv.DType == E4M3 }

// pagedKVParams mirrors kvp_paged_kv_params.
type pagedKVParams struct {
	KCache           uint64 `c:"k_cache"`
	VCache           uint64 `c:"v_cache"`
	BlockTable       uint64 `c:"block_table"`
	KScale           uint64 `c:"k_scale"`
	VScale           uint64 `c:"v_scale"`
	BlockStride      int64  `c:"block_stride"`
	TokenStride      int64  `c:"token_stride"`
	HeadStride       int64  `c:"head_stride"`
	BlockTableStride int64  `c:"block_table_stride"`
	NumKVHeads       int32  `c:"num_kv_heads"`
	BlockSize        int32  `c:"block_size"`
	NumBlocks        int32  `c:"num_blocks"`
	MaxBlocksPerSeq  int32  `c:"max_blocks_per_seq"`
	DType            int32  `c:"dtype"`
	ScaleKind        int32  `c:"scale_kind"`
}

// params is the kernels' view of kv for a cache of kvHeads heads under a
// launch of dtype d.
func (kv *PagedKV) params(d DType, kvHeads int) pagedKVParams {
	return pagedKVParams{
		KCache: uint64(kv.KCache), VCache: uint64(kv.VCache), BlockTable: uint64(kv.BlockTable),
		KScale: uint64(kv.KScale), VScale: uint64(kv.VScale),
		BlockStride: kv.CacheBlockStride, TokenStride: kv.CacheTokenStride, HeadStride: kv.CacheHeadStride,
		BlockTableStride: kv.BlockTableStride,
		NumKVHeads:       int32(kvHeads), BlockSize: int32(kv.BlockSize), NumBlocks: int32(kv.NumBlocks),
		MaxBlocksPerSeq: int32(kv.MaxBlocksPerSeq), DType: int32(kv.cacheDType(d)), ScaleKind: int32(kv.ScaleKind),
	}
}

// checkFormat checks the cache's dtype and scales against a launch of
// dtype d (already checked as a call dtype).
func (kv *PagedKV) checkFormat(what string, d DType) error {
	switch {
	case kv.DType == 0 || kv.DType == d:
		if kv.ScaleKind != ScaleNone || kv.KScale != 0 || kv.VScale != 0 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: a %v cache has no scales: scale_kind, k_scale and v_scale must be 0", what, d)
		}
		return nil
	case kv.DType != E4M3:
		return kverr.Errorf(kverr.InvalidArgument, "%s: the cache's dtype (%v) must be the call's (%v) or e4m3 (KVP_DTYPE_E4M3)", what, kv.DType, d)
	case d != F16 && d != BF16:
		return kverr.Errorf(kverr.InvalidArgument, "%s: an e4m3 cache is read and written by f16 and bf16 calls: the call's dtype is %v", what, d)
	case kv.ScaleKind != ScaleTokenHead && kv.ScaleKind != ScaleTensor:
		return kverr.Errorf(kverr.InvalidArgument, "%s: an e4m3 cache needs scale_kind KVP_KV_SCALE_TOKEN_HEAD (1) or KVP_KV_SCALE_TENSOR (2): got %d", what, kv.ScaleKind)
	}
	return nil
}

// validate checks kv's shape for a cache of kvHeads heads of headDim
// elements of dtype d, read through the block table when withTable (the KV
// write has none), and returns the elements the cache spans. rows is the
// block table's rows (0: no row is read).
func (kv *PagedKV) validate(what string, d DType, headDim, kvHeads int, withTable bool, rows int) (cache, table int64, err error) {
	if err := kv.checkFormat(what, d); err != nil {
		return 0, 0, err
	}
	if err := inRangeOf(what, "num_blocks", kv.NumBlocks, 1, 1<<31-1); err != nil {
		return 0, 0, err
	}
	if err := inRangeOf(what, "block_size", kv.BlockSize, 1, 1<<20); err != nil {
		return 0, 0, err
	}
	if withTable {
		if err := inRangeOf(what, "max_blocks_per_seq", kv.MaxBlocksPerSeq, 1, 1<<30); err != nil {
			return 0, 0, err
		}
		if int64(kv.MaxBlocksPerSeq)*int64(kv.BlockSize) > 1<<31-1 {
			return 0, 0, kverr.Errorf(kverr.InvalidArgument, "%s: max_blocks_per_seq*block_size must fit an int32 length: %d*%d", what, kv.MaxBlocksPerSeq, kv.BlockSize)
		}
		if kv.BlockTableStride < int64(kv.MaxBlocksPerSeq) || kv.BlockTableStride > 1<<31-1 {
			return 0, 0, kverr.Errorf(kverr.InvalidArgument, "%s: block_table_stride must be in [max_blocks_per_seq = %d, 2^31): got %d", what, kv.MaxBlocksPerSeq, kv.BlockTableStride)
		}
		if rows > 0 {
			table = int64(kv.MaxBlocksPerSeq) + int64(rows-1)*kv.BlockTableStride
		}
	} else if int64(kv.NumBlocks)*int64(kv.BlockSize) > 1<<31-1 {
		return 0, 0, kverr.Errorf(kverr.InvalidArgument, "%s: num_blocks*block_size must fit an int32 slot: %d*%d", what, kv.NumBlocks, kv.BlockSize)
	}
	if err := vecMultiple(what, kv.cacheDType(d), kv.CacheBlockStride, kv.CacheTokenStride, kv.CacheHeadStride); err != nil {
		return 0, 0, err
	}
	blocks, tokens, heads := dim{kv.NumBlocks, kv.CacheBlockStride}, dim{kv.BlockSize, kv.CacheTokenStride}, dim{kvHeads, kv.CacheHeadStride}
	if cache, err = span(what, "cache", headDim, blocks, tokens, heads); err != nil {
		return 0, 0, err
	}
	if kv.ScaleKind == ScaleTokenHead && int64(kv.NumBlocks)*int64(kv.BlockSize) > maxScaleIndex/int64(kvHeads) {
		return 0, 0, kverr.Errorf(kverr.InvalidArgument, "%s: the token-head scales of %d blocks of %d tokens of %d heads reach past 2^31 - 1 elements", what, kv.NumBlocks, kv.BlockSize, kvHeads)
	}
	if !withTable {
		// Written: no two (block, token, head) rows may share elements.
		if err := disjoint(what, "cache", headDim, blocks, tokens, heads); err != nil {
			return 0, 0, err
		}
	}
	return cache, table, nil
}

// checkPointers checks the device pointers a launch reads: the caches,
// an e4m3 cache's scales and, when withTable, the block table.
func (kv *PagedKV) checkPointers(what string, withTable bool) error {
	if kv.KCache != 0 && kv.KCache%16 == 0 && kv.VCache != 0 && kv.VCache%16 == 0 &&
		(!withTable || kv.BlockTable != 0 && kv.BlockTable%4 == 0) &&
		(kv.ScaleKind == ScaleNone || kv.KScale != 0 && kv.KScale%4 == 0 && kv.VScale != 0 && kv.VScale%4 == 0) {
		return nil // named below only on failure: a launch allocates nothing
	}
	err := firstErr(checkTensor(what+": k_cache", kv.KCache), checkTensor(what+": v_cache", kv.VCache))
	if err == nil && withTable {
		err = checkIndex(what+": block_table", kv.BlockTable)
	}
	if err == nil && kv.ScaleKind != ScaleNone {
		err = firstErr(checkIndex(what+": k_scale", kv.KScale), checkIndex(what+": v_scale", kv.VScale))
	}
	return err
}

// checkWrittenApart refuses a write whose K and V caches, or whose
// token-head scale arrays, are the same memory (the same tensor passed
// twice): V would overwrite K, and every later read take one for the
// other. Laid out alike from one address, they share every element. (Other
// overlaps are the caller's to avoid: K and V may interleave in one
// allocation, as an engine's [blocks, 2, ...] cache does.)
func (kv *PagedKV) checkWrittenApart(what string) error {
	if kv.KCache == kv.VCache {
		return kverr.Errorf(kverr.InvalidArgument, "%s: k_cache and v_cache are the same memory (%#x)", what, uint64(kv.KCache))
	}
	if kv.ScaleKind == ScaleTokenHead && kv.KScale == kv.VScale {
		return kverr.Errorf(kverr.InvalidArgument, "%s: k_scale and v_scale are the same memory (%#x): each token's K and V scales would overwrite each other", what, uint64(kv.KScale))
	}
	return nil
}

// inRangeOf is inRange for field of call what, naming it only on failure
// (the checks of every launch allocate nothing when they pass).
func inRangeOf(what, field string, v, lo, hi int) error {
	if v >= lo && v <= hi {
		return nil
	}
	return inRange(what+": "+field, v, lo, hi)
}
