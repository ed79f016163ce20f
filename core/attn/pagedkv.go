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
// The cache's head count, head_dim and dtype are the launch's (the layouts
// carry them for q and out too); one validate and one kernel-side
// conversion serve every launch, so a cache format is added here once.
type PagedKV struct {
	NumBlocks, BlockSize                                int
	CacheBlockStride, CacheTokenStride, CacheHeadStride int64

	MaxBlocksPerSeq  int
	BlockTableStride int64

	KCache, VCache cuda.DevicePtr
	BlockTable     cuda.DevicePtr // int32 [rows, block_table_stride]
}

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
	Reserved         int32  `c:"reserved"`
}

// params is the kernels' view of kv for a cache of kvHeads heads of dtype d.
func (kv *PagedKV) params(d DType, kvHeads int) pagedKVParams {
	return pagedKVParams{
		KCache: uint64(kv.KCache), VCache: uint64(kv.VCache), BlockTable: uint64(kv.BlockTable),
		BlockStride: kv.CacheBlockStride, TokenStride: kv.CacheTokenStride, HeadStride: kv.CacheHeadStride,
		BlockTableStride: kv.BlockTableStride,
		NumKVHeads:       int32(kvHeads), BlockSize: int32(kv.BlockSize), NumBlocks: int32(kv.NumBlocks),
		MaxBlocksPerSeq: int32(kv.MaxBlocksPerSeq), DType: int32(d),
	}
}

// validate checks kv's shape for a cache of kvHeads heads of headDim
// elements of dtype d, read through the block table when withTable (the KV
// write has none), and returns the elements the cache spans. rows is the
// block table's rows (0: no row is read).
func (kv *PagedKV) validate(what string, d DType, headDim, kvHeads int, withTable bool, rows int) (cache, table int64, err error) {
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
	if err := vecMultiple(what, d, kv.CacheBlockStride, kv.CacheTokenStride, kv.CacheHeadStride); err != nil {
		return 0, 0, err
	}
	blocks, tokens, heads := dim{kv.NumBlocks, kv.CacheBlockStride}, dim{kv.BlockSize, kv.CacheTokenStride}, dim{kvHeads, kv.CacheHeadStride}
	if cache, err = span(what, "cache", headDim, blocks, tokens, heads); err != nil {
		return 0, 0, err
	}
	if !withTable {
		// Written: no two (block, token, head) rows may share elements.
		if err := disjoint(what, "cache", headDim, blocks, tokens, heads); err != nil {
			return 0, 0, err
		}
	}
	return cache, table, nil
}

// checkPointers checks the device pointers a launch reads: the caches and,
// when withTable, the block table.
func (kv *PagedKV) checkPointers(what string, withTable bool) error {
	if kv.KCache != 0 && kv.KCache%16 == 0 && kv.VCache != 0 && kv.VCache%16 == 0 &&
		(!withTable || kv.BlockTable != 0 && kv.BlockTable%4 == 0) {
		return nil // named below only on failure: a launch allocates nothing
	}
	err := firstErr(checkTensor(what+": k_cache", kv.KCache), checkTensor(what+": v_cache", kv.VCache))
	if err == nil && withTable {
		err = checkIndex(what+": block_table", kv.BlockTable)
	}
	return err
}

// inRangeOf is inRange for field of call what, naming it only on failure
// (the checks of every launch allocate nothing when they pass).
func inRangeOf(what, field string, v, lo, hi int) error {
	if v >= lo && v <= hi {
		return nil
	}
	return inRange(what+": "+field, v, lo, hi)
}
