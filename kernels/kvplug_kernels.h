/*
 * kvplug_kernels.h -- the launch contract of the kernels in kvplug.fatbin.
 *
 * Every kernel takes exactly ONE parameter: its params struct, by value.
 * The structs hold fixed-width fields only (device pointers as uint64_t,
 * shapes as int32_t, strides as int64_t counted in ELEMENTS of the kernel's
 * dtype, softmax scale as float) and have no implicit padding, so a host
 * language can mirror them field for field. kvplug_kernels.cu static_asserts
 * every size and offset listed here.
 *
 * Kernel names (extern "C", no mangling):
 *     kvp_kv_write_<dt>_h<D>
 *     kvp_kv_write_<dt>_e4m3_h<D>       (quantises into an e4m3 cache)
 *     kvp_paged_decode_<dt>_h<D>
 *     kvp_paged_decode_<dt>_e4m3_h<D>   (reads an e4m3 cache)
 *     kvp_paged_prefill_<dt>_e4m3_h<D>  (reads an e4m3 cache; sm_80 mainloop)
 *     kvp_paged_decode_combine_<dt>_h<D>
 *     kvp_merge_states_<dt>_h<D>
 *     kvp_paged_prefill_<dt>_h<D>
 *     kvp_prefill_plan (one kernel for every dtype and head_dim)
 *     kvp_tier_copy (dtype-blind)
 * with <dt> in {f32, f16, bf16} and <D> (head_dim) in {64, 128, 256}; the
 * e4m3 kernels for <dt> in {f16, bf16} (the q, out, key and value dtype; the
 * cache is e4m3, kv.dtype KVP_KV_E4M3). Their combine is the 16-bit one.
 *
 * Alignment (all kernels): every tensor pointer of the kernel's dtype and the
 * workspace are 16-byte aligned, and every stride of such a tensor is a
 * multiple of KVP_VEC(dt) = 16 / sizeof(dt) elements (8 for f16/bf16, 4 for
 * f32). int32/float32 index and lse arrays need 4-byte alignment only.
 * The launcher must check this; the kernels use 16-byte vector accesses.
 *
 * Layouts
 *   KV cache (K and V separate pointers, SAME strides):
 *       [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous.
 *       element (blk, off, h, d) = cache[blk*kv.block_stride
 *                                        + off*kv.token_stride
 *                                        + h*kv.head_stride + d]
 *       A combined tensor (e.g. [num_blocks, 2, block_size, H, D]) is passed
 *       as two pointers with the same strides.
 *   slot = block * block_size + offset; slot < 0 = padding token, skipped.
 *   block_size is any value >= 1 (1 = token mode: table entries are slots).
 *   GQA: q head i reads kv head i / (num_q_heads / num_kv_heads);
 *   num_q_heads must be a multiple of num_kv_heads.
 *   lse outputs and inputs are float32, NATURAL log of sum(exp(scale*q.k)).
 *
 * Attention sinks (gpt-oss): `sinks`, where a params struct has it, is 0 or
 * a float32 [num_q_heads] device array (4-byte aligned) of one logit s_h per
 * q head, natural log, NOT multiplied by the softmax scale. It adds a term
 * exp(s_h) to the softmax denominator and nothing to the numerator:
 *     out = sum_j exp(x_j) v_j / (exp(s_h) + sum_j exp(x_j)),
 * x_j = scale * q.k_j over the keys the row attends to, and the lse written
 * is log(exp(s_h) + sum_j exp(x_j)), the log of that whole denominator (a
 * row with no keys: out 0, lse s_h). Split partials (decode workspace,
 * prefill part_out/part_lse, cascade partial states) never include it: the
 * kernel that ends a row (the one-split kernel, the combine, the merge)
 * adds it once.
 */
#ifndef KVPLUG_KERNELS_H
#define KVPLUG_KERNELS_H

#include <stdint.h>

/* 4: the paged cache is one descriptor, kvp_paged_kv_params, the first
 * member `kv` of kvp_kv_write_params, kvp_decode_params, kvp_prefill_params
 * and kvp_cascade_params (their own copies of its fields are gone).
 * 5: kv.dtype may be KVP_KV_E4M3 (the e4m3 kernels below), with kv.k_scale,
 * kv.v_scale and kv.scale_kind (was reserved).
 * 6: attention sinks: `sinks` appended to kvp_decode_params,
 * kvp_merge_params, kvp_prefill_params and kvp_cascade_params (see
 * "Attention sinks" below).
 * 7: `window_left` and `reserved` appended to kvp_decode_params (a window
 * in the decode kernel); kvp_cascade_<dt>_e4m3_h<D> reads an e4m3 cache.
 * 8: the Hopper mainloop reads e4m3 caches: kvp_paged_prefill_sm90_<dt>_e4m3_h<D>
 * and kvp_cascade_sm90_<dt>_e4m3_h<D> (kvp_prefill_sm90_smem_bytes_e4m3);
 * the e4m3 cascade kernel honours skip_shared as the 16-bit one does.
 * 9: kvp_paged_prefill_sm90_<dt>_e4m3_qkv_h128, FP8 Q/K/V on the Hopper
 * mainloop (kvp_prefill_sm90_smem_bytes_fp8). */
#define KVP_KERNELS_ABI_VERSION 9

/* kv.dtype of an e4m3 cache (1, 2, 3 are f16, bf16, f32: the kernel's dt). */
#define KVP_KV_E4M3 4
/* kv.scale_kind of an e4m3 cache: one float32 scale per (token, kv head),
 * k_scale/v_scale [num_blocks, block_size, num_kv_heads] contiguous
 * (element ((blk * block_size + off) * num_kv_heads + h)), written by the KV
 * write; or one float32 scale for the whole cache (k_scale[0], v_scale[0]),
 * read by every kernel. A stored value x holds x * scale. */
#define KVP_KV_SCALE_TOKEN_HEAD 1
#define KVP_KV_SCALE_TENSOR 2

/* Threads per block for every kernel below. */
#define KVP_KV_WRITE_THREADS 256
#define KVP_DECODE_THREADS 128
#define KVP_COMBINE_THREADS 128 /* 4 warps, one (row, head) per warp */
#define KVP_MERGE_THREADS 128   /* 4 warps, one (token, head) per warp */

/* Tokens per pipeline tile of the decode kernel; split chunks are multiples. */
#define KVP_DECODE_TILE 64
/* Query heads handled by one decode block (one kv head's group is split into
 * ceil(group / KVP_DECODE_HEADS_PER_CTA) blocks when larger). */
#define KVP_DECODE_HEADS_PER_CTA 16

/* ------------------------------------------------------------------------
 * 0. The paged KV cache as every kernel that reads or writes it sees it: K
 *    and V [num_blocks, block_size, num_kv_heads, head_dim] sharing strides
 *    (elements), the block table int32 [rows, block_table_stride] of which
 *    columns < max_blocks_per_seq are read (0 and unused for the KV write),
 *    and, for an e4m3 cache, its scale arrays (KVP_KV_SCALE_*). The first
 *    member, `kv`, of every params struct below that touches the cache.
 * offsets: 0 k_cache, 8 v_cache, 16 block_table, 24 k_scale, 32 v_scale,
 *          40 block_stride, 48 token_stride, 56 head_stride,
 *          64 block_table_stride, 72 num_kv_heads, 76 block_size,
 *          80 num_blocks, 84 max_blocks_per_seq, 88 dtype, 92 scale_kind;
 *          size 96.
 * ---------------------------------------------------------------------- */
typedef struct kvp_paged_kv_params {
    uint64_t k_cache;
    uint64_t v_cache;
    uint64_t block_table;
    uint64_t k_scale; /* float32, e4m3 only (KVP_KV_SCALE_*); else 0 */
    uint64_t v_scale; /* float32, e4m3 only; else 0 */
    int64_t block_stride;
    int64_t token_stride;
    int64_t head_stride;
    int64_t block_table_stride;
    int32_t num_kv_heads;
    int32_t block_size;
    int32_t num_blocks;
    int32_t max_blocks_per_seq;
    int32_t dtype;      /* the cache's: 1 f16, 2 bf16, 3 f32 (the kernel's dt), 4 e4m3 */
    int32_t scale_kind; /* e4m3: KVP_KV_SCALE_TOKEN_HEAD or _TENSOR; else 0 */
} kvp_paged_kv_params; /* 96 bytes */

/* ------------------------------------------------------------------------
 * 1. KV write: scatter this step's K and V into the paged caches.
 *    key/value: [num_tokens, kv.num_kv_heads, head_dim] with the strides below.
 *    kv.block_table and kv.max_blocks_per_seq are not read (0).
 *    Launch: block (KVP_KV_WRITE_THREADS,1,1),
 *            grid  (ceil_div(num_tokens*kv.num_kv_heads*head_dim/KVP_VEC, 256),1,1)
 *            dynamic shared memory 0.
 *    num_tokens == 0: launch nothing.
 * offsets: 0 kv (96 bytes), 96 key, 104 value, 112 slot_mapping,
 *          120 key_token_stride, 128 key_head_stride, 136 value_token_stride,
 *          144 value_head_stride, 152 num_tokens, 156 reserved; size 160.
 * Slots >= kv.num_blocks*kv.block_size are skipped like negative ones (memory
 * safety; the launcher should reject them where it can see them).
 * ---------------------------------------------------------------------- */
typedef struct kvp_kv_write_params {
    kvp_paged_kv_params kv;
    uint64_t key;
    uint64_t value;
    uint64_t slot_mapping; /* int32 [num_tokens] */
    int64_t key_token_stride;
    int64_t key_head_stride;
    int64_t value_token_stride;
    int64_t value_head_stride;
    int32_t num_tokens;
    int32_t reserved; /* 0 */
} kvp_kv_write_params;

/* ------------------------------------------------------------------------
 * 2. Paged decode attention: q_len (1..16; 0 means 1) new tokens per
 *    sequence, the last q_len of its seq_lens[b] tokens: new token t (row
 *    b * q_len + t of q and out) sits at position seq_lens[b] - q_len + t
 *    and attends to positions [0, that position] (causal).
 *    q   [batch * q_len, num_q_heads, head_dim]  (q_batch_stride: row stride)
 *    out [batch * q_len, num_q_heads, head_dim]  (out_batch_stride, out_head_stride)
 *    lse float32 [batch * q_len, num_q_heads] contiguous, or 0 = not requested
 *    kv.block_table int32 [batch, kv.block_table_stride]; row b holds the
 *        blocks of sequence b; only columns < kv.max_blocks_per_seq are read
 *    seq_lens int32 [batch]; 0 gives out = 0 and lse = -inf
 *    Tokens whose table column is >= kv.max_blocks_per_seq or whose block id
 *    is outside [0, kv.num_blocks) are ignored (memory safety, not a feature).
 *
 *  num_splits == 1: one launch of kvp_paged_decode_<dt>_h<D>, writes out/lse.
 *  num_splits  > 1: kvp_paged_decode_<dt>_h<D> writes partial results into
 *      workspace, then kvp_paged_decode_combine_<dt>_h<D> (same params struct,
 *      same stream) writes out/lse.
 *
 *  Split s of sequence b (length L) takes the KVP_DECODE_TILE-token tiles
 *  s, s + num_splits, s + 2*num_splits, ... that start below L (a split with
 *  none is empty and contributes nothing). Results do not depend on the
 *  partition beyond rounding.
 *
 *  Window (window_left >= 0): new token t, at position pos, sees positions
 *  [max(0, pos - window_left), pos]. The tiles are then counted from the
 *  first tile boundary at or below L - q_len - window_left (the first
 *  position any row sees), so a window of W reads about W tokens whatever
 *  L is. Table entries before that tile boundary are never read, and
 *  those between it and the window are masked, so every entry before the
 *  window may be -1 (a sliding-window layer group's dropped blocks).
 *
 *  Varlen rows (q_indptr != 0, q_len 1): sequence b's one new token is row
 *  q_indptr[b] of q, out and lse; a sequence whose q_indptr[b + 1] -
 *  q_indptr[b] is not 1, or whose row is outside [0, q_rows), is skipped
 *  (nothing written for it), so one launch
 *  serves the decode rows of a mixed batch whose other rows another kernel
 *  writes. The split partials stay indexed by b.
 *
 *  Workspace (float32, 16-byte aligned, needed only when num_splits > 1;
 *  rows = batch * q_len):
 *      part_out [num_splits][rows][num_q_heads][head_dim]  at float offset 0
 *      part_lse [num_splits][rows][num_q_heads]            at float offset
 *               num_splits*rows*num_q_heads*head_dim  (log2 domain, internal)
 *      bytes = 4 * num_splits * rows * num_q_heads * (head_dim + 1)
 *
 *  Launch of kvp_paged_decode_<dt>_h<D>:
 *      block (KVP_DECODE_THREADS,1,1)
 *      grid  (kv.num_kv_heads * ceil_div(num_q_heads/kv.num_kv_heads,
 *             kvp_decode_heads_per_cta(q_len)), batch, num_splits)
 *      dynamic shared memory: kvp_decode_smem_bytes(dt, D) below; values above
 *      48 KiB need cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) once.
 *      batch <= 65535, num_splits <= 65535.
 *  Launch of kvp_paged_decode_combine_<dt>_h<D>:
 *      block (KVP_COMBINE_THREADS,1,1), grid (ceil_div(batch*q_len*num_q_heads, 4),1,1), smem 0
 *  batch == 0: launch nothing.
 *  PDL: every kernel begins with griddepcontrol.wait, so any of them may be
 *  launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
 *  (cuLaunchKernelEx) to overlap its launch with the previous kernel's tail;
 *  with plain cuLaunchKernel this is a no-op.
 * offsets: 0 kv (96 bytes), 96 q, 104 seq_lens, 112 out, 120 lse,
 *          128 workspace, 136 q_batch_stride, 144 q_head_stride,
 *          152 out_batch_stride, 160 out_head_stride, 168 batch,
 *          172 num_q_heads, 176 num_splits, 180 scale, 184 q_len,
 *          188 q_rows, 192 q_indptr, 200 sinks, 208 window_left,
 *          212 reserved; size 216.
 * ---------------------------------------------------------------------- */
typedef struct kvp_decode_params {
    kvp_paged_kv_params kv;
    uint64_t q;
    uint64_t seq_lens; /* int32 */
    uint64_t out;
    uint64_t lse;       /* float32 or 0 */
    uint64_t workspace; /* float32; 0 allowed when num_splits == 1 */
    int64_t q_batch_stride;
    int64_t q_head_stride;
    int64_t out_batch_stride;
    int64_t out_head_stride;
    int32_t batch;
    int32_t num_q_heads;
    int32_t num_splits;
    float scale; /* softmax scale, usually 1/sqrt(head_dim) */
    int32_t q_len; /* new tokens per sequence, 1..16 (0: 1) */
    int32_t q_rows; /* with q_indptr: rows of q/out (a row at or past it is skipped); else 0 */
    uint64_t q_indptr; /* int32 [batch + 1] or 0; with q_len 1 only (see above) */
    uint64_t sinks;    /* float32 [num_q_heads] or 0 (attention sinks, above; the one-split kernel or the combine adds them) */
    int32_t window_left; /* < 0: no window; else each row sees [pos - window_left, pos] (above) */
    int32_t reserved;    /* 0 */
} kvp_decode_params;

/* Most new tokens per sequence of the decode kernel. */
#define KVP_DECODE_MAX_Q_LEN 16

/* Both sides of the launch use these two. */
#ifdef __CUDACC__
#define KVP_HOST_DEVICE __host__ __device__
#else
#define KVP_HOST_DEVICE
#endif
static inline KVP_HOST_DEVICE int32_t kvp_decode_q_len(int32_t q_len) { return q_len < 1 ? 1 : q_len; }
/* q heads per decode block: the 16 tensor-core rows hold heads x new tokens. */
static inline KVP_HOST_DEVICE int32_t kvp_decode_heads_per_cta(int32_t q_len) {
    return KVP_DECODE_HEADS_PER_CTA / kvp_decode_q_len(q_len);
}

/* Dynamic shared memory of kvp_paged_decode_<dt>_h<D>, in bytes.
 * dtype_bytes: 4 for f32, 2 for f16/bf16.
 *   16-bit: stages(D) * 64 * D * 4      (K and V tiles)
 *         + 16 * D * 2                  (query tile)
 *         + (stages(D) + 1) * 64 * 8    (row offsets)
 *     with stages(64) = 4, stages(128) = 3, stages(256) = 2:
 *     h64: 70144, h128: 104448, h256: 140800
 *   f32 (reference-speed kernel): 0
 * Resident blocks per SM on sm_90 (for the split heuristic, see README):
 *     16-bit h64: 3, h128: 2, h256: 1; f32: 4. */
static inline uint32_t kvp_decode_smem_bytes(int dtype_bytes, int head_dim) {
    if (dtype_bytes == 4) return 0;
    uint32_t stages = head_dim <= 64 ? 4u : (head_dim <= 128 ? 3u : 2u);
    return stages * 64u * (uint32_t)head_dim * 4u + 16u * (uint32_t)head_dim * 2u + (stages + 1u) * 64u * 8u;
}

/* Dynamic shared memory of kvp_paged_decode_<dt>_e4m3_h<D>, in bytes:
 *     stages(D) * (2 * 64 * D + 2 * 64 * 4)   (raw e4m3 K and V tiles, their scales)
 *   + 16 * D * 2                              (query tile, f16)
 *   + stages(D) * 64 * (8 + 4)                (row offsets, int32 scale indices)
 *     with stages as the 16-bit kernel's:
 *     h64: 39936, h128: 57088, h256: 76288
 * Resident blocks per SM on sm_90 (registers and shared memory): h64: 5,
 * h128: 4, h256: 2. */
static inline uint32_t kvp_decode_smem_bytes_e4m3(int head_dim) {
    uint32_t d = (uint32_t)head_dim, stages = head_dim <= 64 ? 4u : (head_dim <= 128 ? 3u : 2u);
    return stages * (128u * d + 512u) + 32u * d + stages * 64u * 12u;
}

/* ------------------------------------------------------------------------
 * 3. Merge of attention states: out = sum_i w_i v_i, w_i = exp(s_i - lse),
 *    lse = log(sum_i exp(s_i)), over num_states (1..KVP_MERGE_MAX_STATES)
 *    partial states given as separate pointers with shared strides.
 *    v[i] [num_tokens, num_heads, head_dim] dtype; s[i] float32 natural-log
 *    lse [num_tokens, num_heads] (-inf = empty state, weight 0).
 *    All states empty: out = 0, out_lse = -inf. out may alias v[0] when
 *    their strides are equal; out_lse may alias s[0] likewise.
 *    Launch: block (KVP_MERGE_THREADS,1,1),
 *            grid (ceil_div(num_tokens*num_heads, 4),1,1), smem 0.
 * offsets: 0 v[8], 64 s[8], 128 out, 136 out_lse, 144 v_token_stride,
 *          152 v_head_stride, 160 s_token_stride, 168 s_head_stride,
 *          176 out_token_stride, 184 out_head_stride,
 *          192 out_lse_token_stride, 200 out_lse_head_stride,
 *          208 num_states, 212 num_tokens, 216 num_heads, 220 reserved,
 *          224 sinks; size 232.
 *    sinks: float32 [num_heads] or 0: an attention sink per head joins the
 *    merged state (the prefill launcher's merge of its split partials; the
 *    public kvp_merge_states passes 0).
 * ---------------------------------------------------------------------- */
#define KVP_MERGE_MAX_STATES 8

typedef struct kvp_merge_params {
    uint64_t v[KVP_MERGE_MAX_STATES];
    uint64_t s[KVP_MERGE_MAX_STATES]; /* float32 */
    uint64_t out;
    uint64_t out_lse; /* float32 or 0 */
    int64_t v_token_stride;
    int64_t v_head_stride;
    int64_t s_token_stride; /* in float32 elements */
    int64_t s_head_stride;
    int64_t out_token_stride;
    int64_t out_head_stride;
    int64_t out_lse_token_stride; /* in float32 elements */
    int64_t out_lse_head_stride;
    int32_t num_states;
    int32_t num_tokens;
    int32_t num_heads;
    int32_t reserved; /* must be 0 */
    uint64_t sinks;   /* float32 [num_heads] or 0 */
} kvp_merge_params;

/* ------------------------------------------------------------------------
 * 4. Paged prefill / extend attention over a varlen batch (plan + run).
 *    Sequence b has q_len_b = qo_indptr[b+1] - qo_indptr[b] new tokens, rows
 *    [qo_indptr[b], qo_indptr[b+1]) of q/out, at positions
 *    [kv_len_b - q_len_b, kv_len_b); row i attends to tokens
 *    [max(0, pos_i - window_left), pos_i] (window_left < 0: [0, pos_i]) of
 *    the sequence's paged cache (layout and table rules as decode).
 *    q   [total_q, num_q_heads, head_dim] (q_token_stride, q_head_stride)
 *    out [total_q, num_q_heads, head_dim] (out_token_stride, out_head_stride)
 *    lse float32 [total_q, num_q_heads] contiguous, or 0 = not requested
 *
 *  Work list (int32, in the workspace `work`, 16-byte aligned):
 *      work[0]                      number of items
 *      work[1], work[2]             the Hopper kernel's unit counter and
 *                                   blocks done (the plan zeroes them; the
 *                                   run leaves them zero)
 *      work[8 + 8*i .. 8 + 8*i + 7] item i: b, q_start, q_len, kv_len,
 *                                   row tile, split, 0, 0
 *      bytes = 4 * (KVP_PREFILL_HEADER_INTS + KVP_PREFILL_ITEM_INTS * max_items)
 *  An item is one sequence's row tile: its rows packed as (token, q head of
 *  one kv head's group), packed row r -> token r / group, head r % group,
 *  tile_q = kvp_prefill_tile_q(dt, D) packed rows per tile:
 *  ceil(q_len * group / tile_q) items per sequence.
 *
 *  Split-KV (num_splits > 1): each row tile becomes num_splits items; split s
 *  takes the s-th of num_splits equal runs of the tile's visible K/V tiles
 *  and writes its normalised partial output (dtype) and natural-log lse to
 *      part_out [num_splits][total_q][num_q_heads][head_dim] (contiguous)
 *      part_lse [num_splits][total_q][num_q_heads]           (float32)
 *  (an empty run writes 0 and -inf); kvp_merge_states_<dt>_h<D> with
 *  num_states = num_splits then writes out and lse.
 *  Plan: kvp_prefill_plan, block
 *  (KVP_PREFILL_PLAN_THREADS,1,1), grid (1,1,1), smem 0 (static only).
 *  It clamps rows to [0, total_q) and writes at most max_items items;
 *  tile_q must be the run kernel's kvp_prefill_tile_q.
 *  Run: kvp_paged_prefill_<dt>_h<D>, block (KVP_PREFILL_THREADS,1,1), any
 *  grid (x only; blocks stride over item * kv.num_kv_heads + kv head, so a
 *  launch captured in a graph serves any later plan into the same work
 *  list); dynamic smem kvp_prefill_smem_bytes(dt, D); values above 48 KiB
 *  need cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) once.
 * plan offsets: 0 qo_indptr, 8 kv_lens, 16 work, 24 batch, 28 group,
 *          32 total_q, 36 max_items, 40 tile_q, 44 num_splits,
 *          48 skip_decode, 52 reserved; size 56.
 * run offsets: 0 kv (96 bytes), 96 q, 104 out, 112 lse, 120 work,
 *          128 q_token_stride, 136 q_head_stride, 144 out_token_stride,
 *          152 out_head_stride, 160 num_q_heads, 164 window_left, 168 scale,
 *          172 num_splits, 176 part_out, 184 part_lse, 192 total_q,
 *          196 reserved, 200 sinks; size 208.
 * ---------------------------------------------------------------------- */
#define KVP_PREFILL_THREADS 128
#define KVP_PREFILL_PLAN_THREADS 1024
#define KVP_PREFILL_TILE_Q_F32 64 /* packed rows per item of the f32 kernel */
#define KVP_PREFILL_TILE_KV 64 /* tokens per K/V pipeline tile */
#define KVP_PREFILL_HEADER_INTS 8
#define KVP_PREFILL_W_NEXT_UNIT 1 /* work[1], work[2]: the Hopper kernel's scheduler */
#define KVP_PREFILL_ITEM_INTS 8

typedef struct kvp_prefill_plan_params {
    uint64_t qo_indptr; /* int32 [batch + 1] */
    uint64_t kv_lens;   /* int32 [batch] */
    uint64_t work;      /* int32 work list (above) */
    int32_t batch;
    int32_t group; /* num_q_heads / kv.num_kv_heads of the run */
    int32_t total_q;
    int32_t max_items;
    int32_t tile_q;     /* kvp_prefill_tile_q of the run kernel */
    int32_t num_splits; /* >= 1: items per row tile */
    int32_t skip_decode; /* 1: no items for sequences of one new token (a decode launch serves them) */
    int32_t reserved;    /* 0 */
} kvp_prefill_plan_params;

typedef struct kvp_prefill_params {
    kvp_paged_kv_params kv; /* kv.block_table: int32 [batch, kv.block_table_stride] */
    uint64_t q;
    uint64_t out;
    uint64_t lse;  /* float32 or 0 */
    uint64_t work; /* the plan's work list */
    int64_t q_token_stride;
    int64_t q_head_stride;
    int64_t out_token_stride;
    int64_t out_head_stride;
    int32_t num_q_heads;
    int32_t window_left; /* < 0: no window */
    float scale;
    int32_t num_splits; /* 1: write out/lse; > 1: part_out/part_lse */
    uint64_t part_out;  /* dtype [num_splits][total_q][num_q_heads][head_dim] */
    uint64_t part_lse;  /* float32 [num_splits][total_q][num_q_heads] */
    int32_t total_q;    /* rows of q/out: the partials' slice size */
    int32_t reserved;   /* 0 */
    uint64_t sinks;     /* float32 [num_q_heads] or 0; with num_splits > 1 the merge adds them */
} kvp_prefill_params;

/* Packed rows per work item: 4 warps of 16 rows (16-bit), f32:
 * KVP_PREFILL_TILE_Q_F32. A function of dtype and head_dim so that a kernel
 * may take larger tiles without a change of the plan kernel's contract. */
static inline int32_t kvp_prefill_tile_q(int dtype_bytes, int head_dim) {
    (void)head_dim;
    if (dtype_bytes == 4) return KVP_PREFILL_TILE_Q_F32;
    return 64;
}

/* Dynamic shared memory of kvp_paged_prefill_<dt>_h<D>, in bytes.
 *   16-bit: tile_q * D * 2 (query tile) + stages(D) * 64 * D * 4 (K and V
 *         tiles) + (stages(D) + 1) * 64 * 8 (row offsets), stages(64) = 3,
 *         else 2: h64: 59392, h128: 83456, h256: 165376
 *   f32: 0 */
static inline uint32_t kvp_prefill_smem_bytes(int dtype_bytes, int head_dim) {
    if (dtype_bytes == 4) return 0;
    uint32_t stages = head_dim <= 64 ? 3u : 2u;
    return (uint32_t)kvp_prefill_tile_q(dtype_bytes, head_dim) * (uint32_t)head_dim * 2u +
           stages * 64u * (uint32_t)head_dim * 4u + (stages + 1u) * 64u * 8u;
}

/* Dynamic shared memory of kvp_paged_prefill_<dt>_e4m3_h<D> (the sm_80
 * mainloop over an e4m3 cache; run it with a plan of the sm_80 mainloop,
 * tile_q 64), in bytes: 64 * D * 2 (query tile) + stages(D) * (2 * 64 * D +
 * 2 * 64 * 4) (raw K and V tiles, their scales) + 2 * (stages(D) + 1) * 64 * 8
 * (row and scale offsets) + 16: h64: 38416, h128: 53264, h256: 102416 */
static inline uint32_t kvp_prefill_smem_bytes_e4m3(int head_dim) {
    uint32_t d = (uint32_t)head_dim, stages = head_dim <= 64 ? 3u : 2u;
    return 128u * d + stages * (128u * d + 512u) + 2u * (stages + 1u) * 512u + 16u;
}

/* 4a. The same run on Hopper (sm_90a only; compute capability 9.0):
 *  kvp_paged_prefill_sm90_<dt>_h<D>, <dt> in {f16, bf16}: the same params
 *  struct, work list and outputs, planned with tile_q = KVP_PREFILL_SM90_TILE_Q;
 *  block (KVP_PREFILL_SM90_THREADS,1,1) (one producer and two consumer
 *  warpgroups), any grid (one block per SM is what fits), dynamic smem
 *  kvp_prefill_sm90_smem_bytes(dt, D). Split-KV runs are cut in tiles of
 *  kvp_prefill_sm90_tile_kv(D) tokens. On other devices the kernel is empty:
 *  the launcher picks it only on compute capability 9.0. Its blocks take
 *  (item, kv head) units from work[1] and count themselves done in work[2]:
 *  both must be zero when a run starts (the plan kernel zeroes them, and
 *  each run's last block zeroes them again), and two runs over one work list
 *  must not overlap in time (a work list built without the plan kernel must
 *  zero them too). */
#define KVP_PREFILL_SM90_THREADS 384
#define KVP_PREFILL_SM90_TILE_Q 128

static inline int32_t kvp_prefill_sm90_tile_kv(int head_dim) { return head_dim <= 128 ? 128 : 64; }

/* 1024 (alignment) + tile_q * D * bytes (queries) + 2 stages * 2 * tile_kv * D * bytes
 * (K and V) + 2 * tile_kv * 8 (row offsets) + 128 (barriers, flags, unit slots):
 * f16/bf16 h64: 83072, h128: 167040, h256: 198784. */
static inline uint32_t kvp_prefill_sm90_smem_bytes(int dtype_bytes, int head_dim) {
    uint32_t tn = (uint32_t)kvp_prefill_sm90_tile_kv(head_dim), d = (uint32_t)head_dim, e = (uint32_t)dtype_bytes;
    return 1024u + KVP_PREFILL_SM90_TILE_Q * d * e + 2u * 2u * tn * d * e + 2u * tn * 8u + 128u;
}

/* kvp_paged_prefill_sm90_<dt>_e4m3_h<D> and kvp_cascade_sm90_<dt>_e4m3_h<D>:
 * the same launches over an e4m3 cache (kv.dtype KVP_KV_E4M3, its scales):
 * the producer lands each K or V tile raw in a ring of `raw` slots and widens
 * it to <dt>, its scale folded in, into the 16-bit stages the consumers
 * read. Dynamic smem: the 16-bit formula (2-byte <dt>) + raw * (tile_kv * D
 * (a raw tile) + tile_kv * 4 + 32 (its scales, readable mask, record)) +
 * 2 * 16 (the stages' masks), raw 3 where that fits in 232448 bytes, else 2:
 * h64: 111360, h128: 217856, h256: 232160. */
static inline uint32_t kvp_prefill_sm90_smem_bytes_e4m3(int head_dim) {
    uint32_t tn = (uint32_t)kvp_prefill_sm90_tile_kv(head_dim), d = (uint32_t)head_dim;
    uint32_t base = kvp_prefill_sm90_smem_bytes(2, head_dim), slot = tn * d + tn * 4u + 32u;
    return base + (base + 3u * slot + 32u <= 232448u ? 3u : 2u) * slot + 32u;
}

/* kvp_paged_prefill_sm90_<dt>_e4m3_qkv_h128: the same launch over an e4m3
 * cache with both products on the 8-bit wgmma (head_dim 128 only): the
 * producer quantises each query row to e4m3 (one scale a row, from its
 * largest magnitude), copies K tiles as they are, and transposes each V tile
 * through a ring of two raw tiles, computing P's V factors as it goes; the
 * consumers apply the K scales to the scores in fp32 and the V factors to P.
 * Dynamic smem: the 16-bit formula at 1 byte an element + the scales and
 * factors (4 * (4 * tile_kv + TILE_Q) + 12 * tile_kv + 24 bytes, rounded up
 * to 128) + 2 * tile_kv * D (the raw ring): 122112. */
static inline uint32_t kvp_prefill_sm90_smem_bytes_fp8(int head_dim) {
    uint32_t tn = (uint32_t)kvp_prefill_sm90_tile_kv(head_dim), d = (uint32_t)head_dim;
    uint32_t scales = (4u * (4u * tn + KVP_PREFILL_SM90_TILE_Q) + 12u * tn + 24u + 127u) / 128u * 128u;
    return kvp_prefill_sm90_smem_bytes(1, head_dim) + scales + 2u * tn * d;
}

/* ------------------------------------------------------------------------
 * 5. Shared-prefix (cascade) attention, decode or varlen prefill, over a
 *    host-written plan (core/cascade). q/out [total_q, num_q_heads,
 *    head_dim] (q_batch_stride / out_batch_stride between query rows; in
 *    decode total_q = batch). Plan (int32, at `work`, 16-byte aligned),
 *    words from `work`:
 *      header [KVP_CASCADE_HEADER_INTS]: [1] items, [2] batch, [15] query
 *             rows (merge rows), [18] tail tile, [19] the Hopper launch's
 *             items, [20..21] zero (its unit counter)
 *      items  at items_off, KVP_CASCADE_ITEM_INTS each: rep, kv_begin,
 *             kv_end, dynamic (1: a tail: end clipped to seq_lens[rep],
 *             causal, row positions from seq_lens[rep] - m_count), m_begin,
 *             m_count (query tokens qrows[m_begin .. +m_count)), tile,
 *             part_base (token k's partial state: part_base + k)
 *      qrows  at qrows_off: int32 [max_rows], query rows grouped by sequence
 *      seg_start at seg_start_off: int32 [batch + 1]
 *      segs   at segs_off, KVP_CASCADE_SEG_INTS each: first partial, count,
 *             stride, 0 (token i of the sequence: first + i + c * stride)
 *      rowseq at rowseq_off: int32 [max_rows], each query row's sequence
 *      qstart at qstart_off: int32 [batch + 1], each sequence's first row
 *    Partial states: part_out float32 [parts][num_q_heads][head_dim]
 *    (normalised), part_lse float32 [parts][num_q_heads] (log2 domain).
 *  On compute capability 9.0 first kvp_cascade_sm90_<dt>_h<D>: the items
 *      before [19] (the shared items, and the tails of more than 16 packed
 *      rows when the plan's tail tile is 128) on the Hopper prefill mainloop,
 *      block (KVP_PREFILL_SM90_THREADS,1,1), any grid (one block per SM
 *      fits), dynamic smem kvp_prefill_sm90_smem_bytes(dt, D); then the
 *      launch below with skip_shared = 1 (empty kernel on other devices).
 *  Launch kvp_cascade_<dt>_h<D> (dt f16 or bf16): block
 *      (KVP_CASCADE_THREADS,1,1), any grid (x; blocks stride over
 *      (item, kv head) pairs, and the two 64-row halves of a 128-row tail
 *      tile when no Hopper launch ran it), dynamic smem
 *      kvp_cascade_smem_bytes(D) (cuFuncSetAttribute above 48 KiB); a
 *      tail of at most 16 packed rows runs the decode kernel's 16-row tile;
 *  then kvp_cascade_merge_<dt>_h<D>: block (KVP_CASCADE_MERGE_THREADS,1,1),
 *      any grid (warps stride over rows * num_q_heads), smem 0.
 * offsets: 0 kv (96 bytes), 96 q, 104 seq_lens, 112 out, 120 lse,
 *          128 work, 136 part_out, 144 part_lse, 152 q_batch_stride,
 *          160 q_head_stride, 168 out_batch_stride, 176 out_head_stride,
 *          184 num_q_heads, 188 items_off, 192 qrows_off, 196 seg_start_off,
 *          200 segs_off, 204 max_batch, 208 scale, 212 rowseq_off,
 *          216 qstart_off, 220 max_rows, 224 skip_shared, 228 reserved,
 *          232 sinks; size 240.
 * ---------------------------------------------------------------------- */
#define KVP_CASCADE_THREADS 128
#define KVP_CASCADE_MERGE_THREADS 128
#define KVP_CASCADE_TILE_KV 64
#define KVP_CASCADE_TAIL_TILE_Q 64 /* packed rows per tail item of the sm_80 kernel */
#define KVP_CASCADE_HEADER_INTS 32
#define KVP_CASCADE_ITEM_INTS 8
#define KVP_CASCADE_SEG_INTS 4
#define KVP_CASCADE_H_ITEMS 1
#define KVP_CASCADE_H_BATCH 2
#define KVP_CASCADE_H_ROWS 15
/* Packed rows per item of a tail longer than 16 packed rows: 64
 * (KVP_CASCADE_TAIL_TILE_Q, the sm_80 tile) or 128 (KVP_PREFILL_SM90_TILE_Q:
 * on compute capability 9.0 the Hopper launch runs them). */
#define KVP_CASCADE_H_TAIL_TILE_Q 18
/* Items at the list's start that the Hopper launch runs: the shared items,
 * then the tails of more than 16 packed rows when the tail tile is 128. */
#define KVP_CASCADE_H_HOPPER_ITEMS 19
/* Two words the Hopper launch takes its units from (the next, and blocks
 * done): zero in every plan; its last block zeroes them again, so the
 * plan's launches must not overlap. */
#define KVP_CASCADE_W_NEXT_UNIT 20

typedef struct kvp_cascade_params {
    kvp_paged_kv_params kv; /* kv.block_table: int32 [batch, kv.block_table_stride] */
    uint64_t q;
    uint64_t seq_lens; /* int32 [batch] */
    uint64_t out;
    uint64_t lse;      /* float32 [total_q, num_q_heads] or 0 */
    uint64_t work;     /* the plan */
    uint64_t part_out; /* float32 */
    uint64_t part_lse; /* float32 */
    int64_t q_batch_stride; /* between query rows */
    int64_t q_head_stride;
    int64_t out_batch_stride;
    int64_t out_head_stride;
    int32_t num_q_heads;
    int32_t items_off;
    int32_t qrows_off;
    int32_t seg_start_off;
    int32_t segs_off;
    int32_t max_batch;
    float scale;
    int32_t rowseq_off;
    int32_t qstart_off;
    int32_t max_rows; /* the workspace's query-row capacity */
    int32_t skip_shared; /* 1: kvp_cascade_<dt>_h<D> skips the items kvp_cascade_sm90 ran */
    int32_t reserved;    /* 0 */
    uint64_t sinks;      /* float32 [num_q_heads] or 0: kvp_cascade_merge adds them */
} kvp_cascade_params;

/* Packed rows per shared item: 128 at head_dim <= 128, 64 at 256 (tail
 * items: the plan's KVP_CASCADE_H_TAIL_TILE_Q word). */
static inline int32_t kvp_cascade_tile_q(int head_dim) { return head_dim <= 128 ? 128 : 64; }

/* Dynamic shared memory of kvp_cascade_<dt>_h<D> (16-bit types only): the
 * larger of a shared item's tile,
 *   tile_q * D * 2 + stages(D) * 64 * D * 4 + (stages(D) + 1) * 64 * 8,
 *   stages(64) = 3, else 2,
 * and a decode tail's 16-row tile (kvp_decode_smem_bytes(2, D)):
 *   h64: 70144, h128: 104448, h256: 165376 */
static inline uint32_t kvp_cascade_smem_bytes(int head_dim) {
    uint32_t stages = head_dim <= 64 ? 3u : 2u;
    uint32_t tile = (uint32_t)kvp_cascade_tile_q(head_dim) * (uint32_t)head_dim * 2u +
                    stages * 64u * (uint32_t)head_dim * 4u + (stages + 1u) * 64u * 8u;
    uint32_t tail = kvp_decode_smem_bytes(2, head_dim);
    return tile > tail ? tile : tail;
}

/* kvp_cascade_<dt>_e4m3_h<D>: the same kernel over an e4m3 cache
 * (kvp_paged_kv.dtype KVP_DTYPE_E4M3, its scales beside it), every item on
 * the sm_80 tiles and the decode tile, launched with skip_shared 0 on every
 * device (no Hopper launch before it; a plan cut for one runs here whole).
 * Its merge is kvp_cascade_merge_<dt>_h<D>. Dynamic smem: the larger of the
 * shared items' e4m3 tile (kvp_prefill_smem_bytes_e4m3's with
 * kvp_cascade_tile_q rows) and the e4m3 decode tile. */
static inline uint32_t kvp_cascade_smem_bytes_e4m3(int head_dim) {
    uint32_t tile = kvp_prefill_smem_bytes_e4m3(head_dim) +
                    ((uint32_t)kvp_cascade_tile_q(head_dim) - 64u) * (uint32_t)head_dim * 2u;
    uint32_t tail = kvp_decode_smem_bytes_e4m3(head_dim);
    return tile > tail ? tile : tail;
}

/* ------------------------------------------------------------------------
 * 6. Tier copy: blocks between the paged KV caches (device memory) and the
 *    slots of a host KV tier (pinned host memory mapped into the device's
 *    address space), every layer's K and V of each block, in one launch.
 *    STRIDES HERE ARE IN BYTES (the kernel is dtype-blind).
 *    layers: uint64 [num_layers][2], device memory: the address of block 0
 *            of layer l's K ([l][0]) and V ([l][1]; unused when kv == 1).
 *    Block b of layer l's K is the chunk_bytes at layers[l][0] +
 *    b * k_block_stride (V: layers[l][1] + b * v_block_stride).
 *    Host slot s holds, for l = 0..num_layers-1 and t = 0..kv-1 (K, V),
 *    chunk (l, t) at host + s * slot_bytes + (l * kv + t) * chunk_bytes.
 *    ops[i] = {block, slot}: i < n_demote copies block -> slot, the others
 *    slot -> block. Ops naming a block or slot out of range are skipped
 *    (memory safety; the launcher rejects them).
 *    Alignment: layers' addresses, host, strides, slot_bytes and
 *    chunk_bytes are multiples of 16.
 *    Launch: block (KVP_TIER_COPY_THREADS,1,1),
 *            grid (n_ops * num_layers * kv * parts,1,1) with
 *            parts = ceil_div(chunk_bytes, KVP_TIER_COPY_CTA_BYTES),
 *            dynamic shared memory 0. n_ops == 0: launch nothing; more
 *            than KVP_TIER_COPY_OPS ops: one launch per KVP_TIER_COPY_OPS.
 * offsets: 0 layers, 8 host, 16 slot_bytes, 24 chunk_bytes,
 *          32 k_block_stride, 40 v_block_stride, 48 num_layers, 52 kv,
 *          56 n_ops, 60 n_demote, 64 parts, 68 num_blocks, 72 num_slots,
 *          76 reserved, 80 ops; size 4080 (within the 4 KiB parameter limit).
 * ---------------------------------------------------------------------- */
#define KVP_TIER_COPY_THREADS 256
#define KVP_TIER_COPY_CTA_BYTES 16384 /* 4 loads of 16 bytes per thread */
#define KVP_TIER_COPY_OPS 500

typedef struct kvp_tier_copy_params {
    uint64_t layers;
    uint64_t host;
    int64_t slot_bytes;
    int64_t chunk_bytes;
    int64_t k_block_stride;
    int64_t v_block_stride;
    int32_t num_layers;
    int32_t kv; /* 1 (K only) or 2 */
    int32_t n_ops;
    int32_t n_demote;
    int32_t parts;
    int32_t num_blocks;
    int32_t num_slots;
    int32_t reserved;
    int32_t ops[KVP_TIER_COPY_OPS][2];
} kvp_tier_copy_params;

#endif /* KVPLUG_KERNELS_H */
