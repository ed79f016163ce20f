package attn

// Go mirrors of the kernels' parameter structs in kernels/kvplug_kernels.h,
// field for field: every field fixed-width and naturally aligned, no
// implicit padding. Each kernel takes one of them by value. The `c` tags name
// the C fields; TestParamsLayout compiles the header with the system C
// compiler and compares every size and offset, and on a GPU the launcher
// checks each struct's size against the kernel's parameter size as the
// driver reports it.

// maxMergeStates is KVP_MERGE_MAX_STATES.
const maxMergeStates = 8

// Launch constants of kvplug_kernels.h.
const (
	kvWriteThreads      = 256 // KVP_KV_WRITE_THREADS
	decodeThreads       = 128 // KVP_DECODE_THREADS
	combineThreads      = 128 // KVP_COMBINE_THREADS: one (row, head) per warp
	mergeThreads        = 128 // KVP_MERGE_THREADS: one (token, head) per warp
	decodeTile          = 64  // KVP_DECODE_TILE: split chunks are multiples
	decodeHeadsPerBlock = 16  // KVP_DECODE_HEADS_PER_CTA
	maxGridYZ           = 65535
)

// kvp_kv_write_params
type kvWriteParams struct {
	KV               pagedKVParams `c:"kv"`
	Key              uint64        `c:"key"`
	Value            uint64        `c:"value"`
	SlotMapping      uint64        `c:"slot_mapping"`
	KeyTokenStride   int64         `c:"key_token_stride"`
	KeyHeadStride    int64         `c:"key_head_stride"`
	ValueTokenStride int64         `c:"value_token_stride"`
	ValueHeadStride  int64         `c:"value_head_stride"`
	NumTokens        int32         `c:"num_tokens"`
	Reserved         int32         `c:"reserved"`
}

// kvp_decode_params
type decodeParams struct {
	KV             pagedKVParams `c:"kv"`
	Q              uint64        `c:"q"`
	SeqLens        uint64        `c:"seq_lens"`
	Out            uint64        `c:"out"`
	LSE            uint64        `c:"lse"`
	Workspace      uint64        `c:"workspace"`
	QBatchStride   int64         `c:"q_batch_stride"`
	QHeadStride    int64         `c:"q_head_stride"`
	OutBatchStride int64         `c:"out_batch_stride"`
	OutHeadStride  int64         `c:"out_head_stride"`
	Batch          int32         `c:"batch"`
	NumQHeads      int32         `c:"num_q_heads"`
	NumSplits      int32         `c:"num_splits"`
	Scale          float32       `c:"scale"`
	QLen           int32         `c:"q_len"`
	QRows          int32         `c:"q_rows"`
	QIndptr        uint64        `c:"q_indptr"`
	Sinks          uint64        `c:"sinks"`
	WindowLeft     int32         `c:"window_left"`
	Reserved       int32         `c:"reserved"`
}

// kvp_merge_params
type mergeParams struct {
	V                 [maxMergeStates]uint64 `c:"v"`
	S                 [maxMergeStates]uint64 `c:"s"`
	Out               uint64                 `c:"out"`
	OutLSE            uint64                 `c:"out_lse"`
	VTokenStride      int64                  `c:"v_token_stride"`
	VHeadStride       int64                  `c:"v_head_stride"`
	STokenStride      int64                  `c:"s_token_stride"`
	SHeadStride       int64                  `c:"s_head_stride"`
	OutTokenStride    int64                  `c:"out_token_stride"`
	OutHeadStride     int64                  `c:"out_head_stride"`
	OutLSETokenStride int64                  `c:"out_lse_token_stride"`
	OutLSEHeadStride  int64                  `c:"out_lse_head_stride"`
	NumStates         int32                  `c:"num_states"`
	NumTokens         int32                  `c:"num_tokens"`
	NumHeads          int32                  `c:"num_heads"`
	Reserved          int32                  `c:"reserved"`
	Sinks             uint64                 `c:"sinks"`
}

// decodeSharedBytes is kvp_decode_smem_bytes: the decode kernel's dynamic
// shared memory (K and V tile stages, the query tile, a ring of row
// offsets one tile deeper than the stages).
func decodeSharedBytes(d DType, headDim int) uint32 {
	if d.Size() == 4 {
		return 0
	}
	stages, D := decodeStages(headDim), uint32(headDim)
	return stages*64*D*4 + 16*D*2 + (stages+1)*64*8
}

// decodeStages is the decode kernels' pipeline depth (DecodeStages): 4 at
// head_dim 64, 3 at 128, 2 at 256.
func decodeStages(headDim int) uint32 {
	switch {
	case headDim <= 64:
		return 4
	case headDim <= 128:
		return 3
	}
	return 2
}

// decodeSharedBytesE4M3 is kvp_decode_smem_bytes_e4m3: the e4m3 decode
// kernel's (raw tiles and their scales in the 16-bit kernel's stages, the
// f16 query tile, a ring of one tile a stage of row offsets and int32
// scale indices).
func decodeSharedBytesE4M3(headDim int) uint32 {
	stages, D := decodeStages(headDim), uint32(headDim)
	return stages*(128*D+512) + 32*D + stages*64*12
}

// decodeBlocksPerSM is the resident decode blocks per SM on sm_90 that the
// header gives for the split heuristic (the e4m3 kernel's, by its registers
// and shared memory, when e4m3).
func decodeBlocksPerSM(d DType, headDim int, e4m3 bool) int {
	if d.Size() == 4 {
		return 4
	}
	switch {
	case e4m3 && headDim <= 64:
		return 5
	case e4m3 && headDim <= 128:
		return 4
	case e4m3:
		return 2
	case headDim <= 64:
		return 3
	case headDim <= 128:
		return 2
	}
	return 1
}
