// Paged decode attention, for 1 to 16 new tokens per sequence (decode,
// speculative verification, multi-token prediction).
//
// One block per (kv head, group tile, sequence, split): the tile's rows are
// its q heads times the sequence's q_len new tokens (at most 16 rows, so a
// group tile holds 16 / q_len heads), and the K/V rows of a kv head are read
// once for all of them. New token t of a sequence of length L sits at
// position L - q_len + t and sees positions up to its own (causal).
// 16-bit types: K/V tiles of 64 tokens stream into shared memory through a
// cp.async pipeline (STAGES deep); Q.K^T and P.V run on the tensor cores
// (mma.sync m16n8k16, q heads as the 16 rows, FlashAttention-2 register
// layout so P never leaves registers); each of the 4 warps owns 16 tokens of
// a tile and keeps its own online-softmax state, merged once at the end.
// The physical row offset of every token of a tile is resolved once per tile
// (one block-table read per token, by 64 threads) one tile ahead of its copy,
// so token mode (block size 1) costs the same as large blocks.
// f32: a plain CUDA-core kernel, for tests.
#pragma once

#include "kvp_common.cuh"

namespace kvp {

template <int D>
struct DecodeStages {
    static constexpr int value = D <= 64 ? 4 : (D <= 128 ? 3 : 2);
};

// E4M3: the stages hold raw e4m3 tiles (swz8) and their scales, which the
// mainloop reads its fragments from (kvp_fp8.cuh).
template <int D, int STAGES_ = DecodeStages<D>::value, bool E4M3 = false>
struct DecodeCfg {
    static constexpr int TILE = KVP_DECODE_TILE;  // tokens per pipeline stage
    static constexpr int STAGES = STAGES_;
    // Row-offset tiles kept (see the loop): one more than the stages where the
    // scores' mask reads a tile's offsets while a later tile's are written;
    // e4m3 masks by the K scales instead (an unreadable row's is 0), so its
    // ring has one tile per stage and its scale indices are int32 (the
    // header bounds token-head scales below 2^31): 1.5 KB less shared
    // memory at head_dim 128, which a fourth block per SM needs.
    static constexpr int RING = E4M3 ? STAGES : STAGES + 1;
    static constexpr int CPR = D / 8;        // 16-byte chunks per 16-bit row
    static constexpr int RAW_CPR = E4M3 ? D / 16 : CPR;  // per cache row
    static constexpr int KV_TILE_BYTES = TILE * D * 2;    // a 16-bit tile
    static constexpr int RAW_TILE_BYTES = TILE * RAW_CPR * 16;
    static constexpr int SCALE_BYTES = E4M3 ? TILE * 4 : 0;
    static constexpr int STAGE_BYTES = 2 * RAW_TILE_BYTES + 2 * SCALE_BYTES;
    static constexpr int Q_BYTES = 16 * D * 2;
    static constexpr int OFF_BYTES = RING * TILE * (E4M3 ? 12 : 8);  // row offsets (and scale indices)
    static constexpr int SMEM = STAGES * STAGE_BYTES + Q_BYTES + OFF_BYTES;
    static constexpr int RED_STRIDE = D + 8;  // padded fp32 row of the final merge
    // The merge scratch, used once the pipeline has drained, may reach into
    // the query tile and the offsets (free by then).
    static_assert(4 * 16 * RED_STRIDE * 4 + 2 * 64 * 4 <= SMEM, "merge scratch fits");
};

// What one 16-row decode tile reads: tokens [base, end) of one sequence in
// the 64-token tiles split, split + S, split + 2S, ... counted from base
// (S = num_splits: interleaved rather than contiguous chunks, so where a
// block's tiles start does not depend on the sequence length and its first
// block-table reads can be in flight together with the read of the length;
// with a window the start is the window's tile, known once the length is),
// for rows = nh q heads x qlen new tokens, new token t at position
// L - qlen + t (causal among the new tokens).
struct DecodeWork {
    int kvh, qh0, nh, b, split, S;
    int base, end, L, n_tiles;
    int qlen, rows;  // new tokens per sequence; rows = nh * qlen (<= 16)
    // First token of the block's k-th tile.
    __device__ __forceinline__ int tile_start(int k) const { return base + (split + k * S) * KVP_DECODE_TILE; }
    // With a window (window >= 0), the tiles start at the tile boundary at
    // or below the first position any row sees (L - qlen - window).
    __device__ __forceinline__ void set_window_base(int seq_len, int window) {
        const int first = max(0, seq_len - qlen - window);
        base = max(base, first - first % KVP_DECODE_TILE);
    }
    // Sets the positions' end L and the tokens' end (<= L), then the tiles.
    __device__ __forceinline__ void set_len(int seq_len, int kv_end) {
        L = max(0, seq_len);
        end = min(kv_end, L);
        const int tiles = end > base ? (end - base + KVP_DECODE_TILE - 1) / KVP_DECODE_TILE : 0;
        n_tiles = tiles > split ? (tiles - split + S - 1) / S : 0;
    }
};

__device__ __forceinline__ DecodeWork decode_work_heads(const kvp_decode_params& p) {
    DecodeWork w;
    w.qlen = kvp_decode_q_len(p.q_len);
    const int hpc = kvp_decode_heads_per_cta(p.q_len);
    const int group = p.num_q_heads / p.kv.num_kv_heads;
    const int head_tiles = (group + hpc - 1) / hpc;
    w.kvh = blockIdx.x / head_tiles;
    const int ht = blockIdx.x - w.kvh * head_tiles;
    w.qh0 = w.kvh * group + ht * hpc;
    w.nh = min(hpc, group - ht * hpc);
    w.rows = w.nh * w.qlen;
    w.b = blockIdx.y;
    w.split = blockIdx.z;
    w.S = p.num_splits;
    w.base = 0;
    w.end = w.L = w.n_tiles = 0;
    return w;
}

// The row of q and out of sequence b's first new token: b * q_len, or
// q_indptr[b] when the launch serves the one-token sequences of a varlen
// batch (then -1 for a sequence with another count or a row outside q_rows:
// not this launch's).
__device__ __forceinline__ int64_t decode_first_row(const kvp_decode_params& p, int b, int qlen) {
    if (p.q_indptr == 0) return (int64_t)b * qlen;
    const int32_t* qi = reinterpret_cast<const int32_t*>(p.q_indptr);
    const int q0 = __ldg(qi + b);
    return __ldg(qi + b + 1) - q0 == 1 && (unsigned)q0 < (unsigned)p.q_rows ? (int64_t)q0 : -1;
}

// Writes N consecutive dims [d0, d0+N) of q head qh of new token t of the
// block's sequence (first row q0): the normalised output (or the split's
// partial) and, from the slice at d0 == 0, the lse. st: the row's softmax
// state, l reduced over the whole row.
template <typename T, int N>
__device__ __forceinline__ void decode_store(const kvp_decode_params& p, const DecodeWork& w, int64_t q0, int t, int qh,
                                             int d0, const float (&o)[N], const SoftmaxState& st, int D) {
    // A split's partial ends without the sink; the combine adds it.
    const StateWriter end = write_state(st, p.num_splits == 1 ? sink_log2(p.sinks, qh) : neg_inf());
    if (p.num_splits == 1) {
        const int64_t tok = q0 + t;  // the row of q and out
        T* out = reinterpret_cast<T*>(p.out) + tok * p.out_batch_stride + (int64_t)qh * p.out_head_stride + d0;
        end.to<T, false>(out, d0 == 0 && p.lse != 0 ? reinterpret_cast<float*>(p.lse) + tok * p.num_q_heads + qh : nullptr,
                         o);
    } else {
        // Partials are indexed by (sequence, new token), whatever q_indptr says.
        const int64_t row = ((int64_t)w.b * w.qlen + t) * p.num_q_heads + qh;
        const int64_t rows = (int64_t)p.batch * w.qlen * p.num_q_heads;
        const int64_t r = (int64_t)w.split * rows + row;
        float* part_o = reinterpret_cast<float*>(p.workspace);
        end.to<float, true>(part_o + r * D + d0, d0 == 0 ? part_o + (int64_t)p.num_splits * rows * D + r : nullptr, o);
    }
}

// ---- f32: plain kernel (tests) ----------------------------------------------
template <int D>
__device__ __forceinline__ void paged_decode_f32(const kvp_decode_params& p) {
    constexpr int E = D / 32;
    griddep_wait();
    DecodeWork w = decode_work_heads(p);
    const int64_t q0 = decode_first_row(p, w.b, w.qlen);
    if (q0 < 0) return;
    const int L = reinterpret_cast<const int32_t*>(p.seq_lens)[w.b];
    if (p.window_left >= 0) w.set_window_base(L, p.window_left);
    w.set_len(L, L);
    const PagedRows rr = paged_rows(p.kv, w.b, w.kvh);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* kc = reinterpret_cast<const float*>(p.kv.k_cache);
    const float* vc = reinterpret_cast<const float*>(p.kv.v_cache);
    const float sl = p.scale * kLog2e;
    for (int r = warp; r < w.rows; r += KVP_DECODE_THREADS / 32) {
        const int t = r / w.nh, qh = w.qh0 + (r - t * w.nh);
        const int last = w.L - w.qlen + t;  // the last position token t sees
        const int first = p.window_left >= 0 ? last - p.window_left : 0;
        F32Row<E> qr(reinterpret_cast<const float*>(p.q) + (q0 + t) * p.q_batch_stride + (int64_t)qh * p.q_head_stride,
                     lane);
        for (int k = 0; k < w.n_tiles; ++k) {
            const int t0 = w.tile_start(k);
            qr.attend(rr, kc, vc, lane, sl, max(t0, first), min(last + 1, t0 + KVP_DECODE_TILE));
        }
        decode_store<float, E>(p, w, q0, t, qh, lane * E, qr.o, qr.st, D);
    }
    griddep_launch_dependents();
}

// ---- f16 / bf16: one 16-row tensor-core tile ----------------------------------
// The block's 4 warps run w's tiles: q rows from qrow(t, qh) (the element
// offset in q of new token t, q head qh), the positions' and the tokens' end
// from load_len() (an int2 for w.set_len, read while the query and table
// loads are in flight), the result
// through store(t, qh, d0, o[8], st) for dims [d0, d0 + 8) of each of the
// w.rows rows (o unnormalised, st the row's state). window >= 0: a row at
// position pos sees only [pos - window, pos] (DecodeWork::set_window_base
// moves the tiles' start once the length is known). SIGNAL: call
// griddep_launch_dependents after the K/V loop. The shared memory (at least
// DecodeCfg<D, STAGES>::SMEM) is free again on return.
template <typename T, int D, int STAGES, bool SIGNAL, typename KT = T, class QRow, class LoadLen, class Store>
__device__ __forceinline__ void decode_tile(DecodeWork& w, const PagedRows& rr, const T* qp, const KT* kc, const KT* vc,
                                            float scale, int window, QRow qrow, LoadLen load_len, Store store,
                                            uint8_t* smem) {
    constexpr bool E4M3 = sizeof(KT) == 1;
    // e4m3: the mainloop runs on f16 tiles (every e4m3 value is exact in
    // f16), the K scales multiply the scores and the V scales the
    // probabilities, in fp32.
    using MT = typename Cond<E4M3, f16, T>::type;
    using C = DecodeCfg<D, STAGES, E4M3>;
    constexpr int TILE = C::TILE, RING = C::RING, CPR = C::CPR;
    constexpr int NT = KVP_DECODE_THREADS;
    constexpr int CHUNKS_PER_THREAD = TILE * C::RAW_CPR / NT;  // per tensor (K or V) per stage
    static_assert(TILE * C::RAW_CPR % NT == 0, "tile chunks divide evenly");
    static_assert(NT / C::RAW_CPR * CHUNKS_PER_THREAD == TILE, "row mapping");
    static_assert(!E4M3 || NT == 2 * TILE, "one scale per thread (gather_kv_scales)");

    uint8_t* s_kv = smem;                          // [STAGES][K tile, V tile(, K scales, V scales)]
    uint8_t* s_q = smem + STAGES * C::STAGE_BYTES;  // [16][D] swizzled
    int64_t* s_off = reinterpret_cast<int64_t*>(s_q + C::Q_BYTES);  // [RING][TILE]
    int32_t* s_soff = reinterpret_cast<int32_t*>(s_off + RING * TILE);  // e4m3: [RING][TILE] scale indices
    // Ring entry i of tile jt, token tid: its row offset (-1: not read) and scale index.
    auto set_off = [&](int i, bool live, int blk, int off) {
        s_off[i] = live ? rr.offset(blk, off) : -1;
        if constexpr (E4M3) s_soff[i] = live ? (int32_t)rr.scale_index(blk, off) : -1;
    };
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    // Everything that depends on no other load is issued at once: the query
    // rows, the length and, without a window, the block-table entries of
    // the first STAGES + 1 tiles (their positions do not depend on the
    // length; see DecodeWork).
    constexpr int Q_CHUNKS = (16 * CPR + NT - 1) / NT;
    uint4 qv[Q_CHUNKS];
#pragma unroll
    for (int k = 0; k < Q_CHUNKS; ++k) {
        // Row r is new token r / nh, head qh0 + r % nh.
        const int i = tid + k * NT;
        const int r = i / CPR, c = i % CPR;
        qv[k] = make_uint4(0, 0, 0, 0);
        if (i < 16 * CPR && r < w.rows) {
            const int t = r / w.nh;
            qv[k] = *reinterpret_cast<const uint4*>(qp + qrow(t, w.qh0 + r - t * w.nh) + c * 8);
        }
    }
    int pblk[STAGES + 1], poff[STAGES + 1];
    auto load_first_blocks = [&] {
#pragma unroll
        for (int j = 0; j <= STAGES; ++j) {
            pblk[j] = -1;
            poff[j] = 0;
            if (tid < TILE) pblk[j] = rr.load_block(w.tile_start(j) + tid, poff[j]);
        }
    };
    int2 len;
    if (window < 0) {  // the first tiles' table reads need not wait for the length
        len = load_len();
        load_first_blocks();
    } else {  // they start where the window does, which the length gives
        len = load_len();
        w.set_window_base(len.x, window);
        load_first_blocks();
    }
    w.set_len(len.x, len.y);
    if (tid < TILE) {
#pragma unroll
        for (int j = 0; j < STAGES; ++j)
            set_off(j * TILE + tid, j < w.n_tiles && w.tile_start(j) + tid < w.end, pblk[j], poff[j]);
    }
    // Table entry of tile STAGES, stored at the end of iteration 0.
    int cblk = pblk[STAGES], coff = poff[STAGES];
    // e4m3 under bf16: the query becomes f16, scaled by the power of two
    // 2^sh that brings its largest magnitude into [2^14, 2^15) (f16's
    // range); the scores take 2^-sh back.
    float q_unscale = 1.f;
    if constexpr (E4M3 && IsBF16<T>::value) {
        float m = 0.f;
#pragma unroll
        for (int k = 0; k < Q_CHUNKS; ++k) m = fmaxf(m, bf16x8_amax(qv[k]));
        // s_kv is free until the first copies below.
        const float qmul = q_f16_scale(m, reinterpret_cast<float*>(s_kv), warp, lane, q_unscale);
#pragma unroll
        for (int k = 0; k < Q_CHUNKS; ++k) qv[k] = bf16x8_to_f16(qv[k], qmul);
    }
    // Query tile: rows >= rows are zero so padded rows stay finite. e4m3:
    // stored as q's A fragments in the dim order of the raw K fragments (see
    // the S = Q K^T loop), one 16-byte entry per (32-dim step kp, half h,
    // lane), so that the loop reads each fragment with one 16-byte load into
    // the registers the mma takes: word i of chunk c of row r is word
    // (i & 1) * 2 + r / 8 of the entry (kp, h) = (c / 4, c / 2 % 2) of lane
    // (r % 8) * 4 + (c % 2) * 2 + i / 2.
#pragma unroll
    for (int k = 0; k < Q_CHUNKS; ++k) {
        const int i = tid + k * NT;
        const int r = i / CPR, c = i % CPR;
        if (i < 16 * CPR) {
            if constexpr (E4M3) {
                uint32_t* e = reinterpret_cast<uint32_t*>(s_q) + ((c >> 1) * 32 + (r & 7) * 4 + (c & 1) * 2) * 4 + (r >> 3);
                e[0] = qv[k].x;
                e[2] = qv[k].y;
                e[4] = qv[k].z;
                e[6] = qv[k].w;
            } else {
                *reinterpret_cast<uint4*>(s_q + (r * CPR + (c ^ (r & 7))) * 16) = qv[k];
            }
        }
    }
    __syncthreads();

    const uint32_t s_kv_u32 = smem_u32(s_kv);
    const uint64_t policy = l2_evict_first();
    GatherCursor<KT, C::RAW_CPR, NT, STAGES, C::STAGE_BYTES> kt(s_kv_u32, tid);
    auto issue = [&](int j) {  // j: the tiles in order, each once
        const uint32_t sk = s_kv_u32 + (j % STAGES) * C::STAGE_BYTES;
        gather_kv_tile<KT, C::RAW_CPR, CHUNKS_PER_THREAD, NT, C::RAW_TILE_BYTES>(
            sk, kt.cur, s_off + (j % RING) * TILE, kc, vc, tid, [&](uint32_t dst, const KT* src, int n) {
                if constexpr (E4M3)
                    cp_async16_or_zero(dst, src, n, policy);  // n: a sign
                else
                    cp_async16(dst, src, n, policy);  // n: the bytes
            });
        kt.next();
        if constexpr (E4M3) {
            const uint32_t ss = sk + 2 * C::RAW_TILE_BYTES;
            gather_kv_scales<TILE>(ss, ss + C::SCALE_BYTES, s_soff + (j % RING) * TILE, rr, tid);
        }
    };

#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) {
        if (j < w.n_tiles) issue(j);
        cp_async_commit();
    }

    const float sl = scale * kLog2e * q_unscale;
    float vmax = 0.f, vinv = 0.f;  // e4m3: the V scale o_acc is counted in (see below), 1 / it
    SoftmaxState row_st[2];  // rows g and g+8; l: this thread's partial sums
    row_st[0].init();
    row_st[1].init();
    float o_acc[CPR][4];
#pragma unroll
    for (int c = 0; c < CPR; ++c) o_acc[c][0] = o_acc[c][1] = o_acc[c][2] = o_acc[c][3] = 0.f;

    const uint32_t s_q_u32 = smem_u32(s_q);
    // ldmatrix lane addressing (row, chunk-in-pair) for the A (Q), B (K), B^T (V) fragments.
    const int qa_row = (lane & 7) + ((lane >> 3) & 1) * 8, qa_chk = lane >> 4;
    const int kb_row = warp * 16 + (lane & 7) + ((lane >> 4) << 3), kb_chk = (lane >> 3) & 1;
    const int vb_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, vb_chk = lane >> 4;
    // e4m3: the same addressing (tokens 0-7 / 8-15, two chunks) for both raw tiles.
    const int r8_row = vb_row, r8_chk = vb_chk;
    const int g = lane >> 2, qd = (lane & 3) * 2;
    // The last position rows g and g + 8 see (causal among the new tokens;
    // L - 1 for every row when q_len is 1). Padded rows see everything.
    // first: the first position they see (the window's start; 0 without one).
    int last[2], first[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        last[h] = r < w.rows ? w.L - w.qlen + r / w.nh : w.L - 1;
        first[h] = window >= 0 ? last[h] - window : 0;
    }

    for (int j = 0; j < w.n_tiles; ++j) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (j + STAGES - 1 < w.n_tiles) issue(j + STAGES - 1);
        cp_async_commit();

        // Table entries of tile j+STAGES+1: loaded now, stored one iteration
        // later, so a slow table read never stalls the block at a barrier.
        int nblk = -1, noff = 0;
        if (tid < TILE && j + STAGES + 1 < w.n_tiles) nblk = rr.load_block(w.tile_start(j + STAGES + 1) + tid, noff);

        const int st = j % STAGES;
        const uint32_t sk = s_kv_u32 + st * C::STAGE_BYTES;
        const uint32_t sv = sk + C::RAW_TILE_BYTES;

        // S = Q K^T: 16 rows x 16 tokens (two n-tiles of 8 tokens).
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        if constexpr (E4M3) {
            // One ldmatrix.x4 of the raw K tile (pairs of e4m3 bytes as b16)
            // gives 16 tokens x 32 dims: token g's dims 4q..4q+3 of a 16-dim
            // step are one register, the B fragment's k 2q, 2q+1 (dims 4q,
            // 4q+1) and 2q+8, 2q+9 (dims 4q+2, 4q+3); q's A fragment is read
            // in the same dim order (8 bytes of row g, 8 of row g + 8). The
            // halves h accumulate apart (sh) and are added at the end: two
            // chains of D / 32 dependent mmas instead of one of D / 16.
            float sh[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int kp = 0; kp < D / 32; ++kp) {
                uint32_t kr[4];  // tokens 0-7 / 8-15 of dims 32kp.. and 32kp+16..
                ldmatrix_x4(kr, sk + swz8<D>(r8_row, 2 * kp + r8_chk));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint4 q4 = reinterpret_cast<const uint4*>(s_q)[(2 * kp + h) * 32 + lane];
                    const uint32_t a[4] = {q4.x, q4.y, q4.z, q4.w};
                    uint32_t b0, b1, c0, c1;
                    e4m3x4_f16(kr[2 * h], b0, b1);
                    e4m3x4_f16(kr[2 * h + 1], c0, c1);
                    mma16816<f16>(h ? sh[0] : s[0], a, b0, b1);
                    mma16816<f16>(h ? sh[1] : s[1], a, c0, c1);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[nt][i] += sh[nt][i];
        } else {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t a[4], bk[4];
                const int qc = kk * 2 + qa_chk;
                ldmatrix_x4(a, s_q_u32 + (qa_row * CPR + (qc ^ (qa_row & 7))) * 16);
                const int kc2 = kk * 2 + kb_chk;
                ldmatrix_x4(bk, sk + (kb_row * CPR + (kc2 ^ (kb_row & 7))) * 16);
                mma16816<T>(s[0], a, bk[0], bk[1]);
                mma16816<T>(s[1], a, bk[2], bk[3]);
            }
        }

        // Mask tokens past the end, outside a new token's window (its own
        // position and, with a window, window tokens back) or with
        // an ignored block; scale into log2 domain.
        const int64_t* offs = s_off + (j % RING) * TILE;
        const int tpos = w.tile_start(j);
        // e4m3: the stage's K and V scales (still in place: the stage is
        // refilled only after the next iteration's barrier).
        const float* ksc = reinterpret_cast<const float*>(s_kv + st * C::STAGE_BYTES + 2 * C::RAW_TILE_BYTES);
        float mx[2] = {neg_inf(), neg_inf()};
        // positional: test each score's position against its row's range;
        // a warp slice that every row of the thread sees whole (every
        // tile but a sequence's last and, with a window, its first) needs
        // only the unreadable-row test.
        auto mask = [&](auto positional) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int tcol = warp * 16 + nt * 8 + qd + e;
                    // e4m3: an unreadable row's K scale was zero-filled (a
                    // real one is never 0), and its offsets' ring entry may
                    // already hold a later tile's.
                    const float f = E4M3 ? sl * ksc[tcol] : sl;
                    const bool ok = E4M3 ? f != 0.f : offs[tcol] >= 0;
                    if constexpr (decltype(positional)::value) {
                        const int pos = tpos + tcol;
                        s[nt][e] = ok && pos <= last[0] && pos >= first[0] ? s[nt][e] * f : neg_inf();
                        s[nt][e + 2] = ok && pos <= last[1] && pos >= first[1] ? s[nt][e + 2] * f : neg_inf();
                    } else {
                        s[nt][e] = ok ? s[nt][e] * f : neg_inf();
                        s[nt][e + 2] = ok ? s[nt][e + 2] * f : neg_inf();
                    }
                    mx[0] = fmaxf(mx[0], s[nt][e]);
                    mx[1] = fmaxf(mx[1], s[nt][e + 2]);
                }
            }
        };
        // (16-bit: with the second copy of the loop ptxas spills.)
        const int slice = tpos + warp * 16;  // the warp's first position
        if (E4M3 && slice + 15 <= min(last[0], last[1]) && slice >= max(first[0], first[1]))
            mask(BoolC<false>{});
        else
            mask(BoolC<true>{});
        float alpha[2], m_use[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) alpha[r] = row_st[r].rescale(quad_max(mx[r]), m_use[r]);
        float ps[2] = {0.f, 0.f};
        // e4m3: ex2.approx.ftz (weights below 2^-126 flush to zero).
        auto ex2 = [](float x) { return E4M3 ? fast_exp2(x) : exp2f(x); };
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            s[nt][0] = ex2(s[nt][0] - m_use[0]);
            s[nt][1] = ex2(s[nt][1] - m_use[0]);
            s[nt][2] = ex2(s[nt][2] - m_use[1]);
            s[nt][3] = ex2(s[nt][3] - m_use[1]);
            ps[0] += s[nt][0] + s[nt][1];
            ps[1] += s[nt][2] + s[nt][3];
        }
        row_st[0].accumulate(alpha[0], ps[0]);
        row_st[1].accumulate(alpha[1], ps[1]);
        // e4m3: P V with V's per-token scales taken into P. o_acc counts in
        // units of vmax, a V scale at least the largest of the warp's tokens
        // in this tile and at most 16 times it, so P * scale / vmax stays in
        // [0, 1] and loses at most 4 bits of f16's range to a small scale;
        // vmax moves (and rescales o_acc with alpha) only where a tile's
        // largest leaves that band, so most tiles keep it.
        float vr[2][2] = {{1.f, 1.f}, {1.f, 1.f}};
        if constexpr (E4M3) {
            const float* vsc = ksc + TILE;
            float m = 0.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float4 x = reinterpret_cast<const float4*>(vsc + warp * 16)[i];
                m = fmaxf(m, fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)));
            }
            if (m == 0.f) m = vmax > 0.f ? vmax : 1.f;  // no readable token in the warp's slice
            if (m > vmax || 16.f * m < vmax) {  // warp-uniform: every lane read the same scales
                const float inv = 1.f / m;
                alpha[0] *= vmax * inv;
                alpha[1] *= vmax * inv;
                vmax = m;
                vinv = inv;
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) vr[nt][e] = vsc[warp * 16 + nt * 8 + qd + e] * vinv;
        }
        // Most tiles move no row's maximum (alpha exactly 1): the rescale is
        // skipped where no row of the warp needs it.
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int c = 0; c < CPR; ++c) {
                o_acc[c][0] *= alpha[0];
                o_acc[c][1] *= alpha[0];
                o_acc[c][2] *= alpha[1];
                o_acc[c][3] *= alpha[1];
            }
        }
        // P as the A operand (FA2 layout: C fragments of S are A fragments of P).
        uint32_t pa[4];
        pa[0] = pack2<MT>(s[0][0] * vr[0][0], s[0][1] * vr[0][1]);
        pa[1] = pack2<MT>(s[0][2] * vr[0][0], s[0][3] * vr[0][1]);
        pa[2] = pack2<MT>(s[1][0] * vr[1][0], s[1][1] * vr[1][1]);
        pa[3] = pack2<MT>(s[1][2] * vr[1][0], s[1][3] * vr[1][1]);
        // O += P V: 16 rows x D.
        if constexpr (E4M3) {
            // One ldmatrix.x4.trans of the raw V tile gives tokens 2q, 2q+1
            // (and 2q+8, 2q+9) of dims 2g and 2g+1 of two 16-dim chunks; a
            // byte permute splits each register into the even dim's pair and
            // the odd dim's, the B fragments of two n-tiles: o_acc[c] holds
            // dims 8c + 2n (c even) or 8(c-1) + 2n + 1 (c odd) of its n.
#pragma unroll
            for (int G = 0; G < D / 32; ++G) {
                uint32_t vr4[4];  // tokens 0-7 / 8-15 of dims 32G.. and 32G+16..
                ldmatrix_x4_trans(vr4, sv + swz8<D>(r8_row, 2 * G + r8_chk));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    uint32_t e0, o0, e1, o1;
                    e4m3x4_f16(__byte_perm(vr4[2 * h], 0, 0x3120), e0, o0);
                    e4m3x4_f16(__byte_perm(vr4[2 * h + 1], 0, 0x3120), e1, o1);
                    mma16816<f16>(o_acc[4 * G + 2 * h], pa, e0, e1);
                    mma16816<f16>(o_acc[4 * G + 2 * h + 1], pa, o0, o1);
                }
            }
        } else {
#pragma unroll
            for (int c = 0; c < CPR; c += 2) {
                uint32_t bv[4];
                const int vc2 = c + vb_chk;
                ldmatrix_x4_trans(bv, sv + (vb_row * CPR + (vc2 ^ (vb_row & 7))) * 16);
                mma16816<T>(o_acc[c], pa, bv[0], bv[1]);
                mma16816<T>(o_acc[c + 1], pa, bv[2], bv[3]);
            }
        }

        const int jt = j + STAGES;
        if (tid < TILE && jt < w.n_tiles) set_off((jt % RING) * TILE + tid, w.tile_start(jt) + tid < w.end, cblk, coff);
        cblk = nblk;
        coff = noff;
    }
    if (SIGNAL) griddep_launch_dependents();  // the combine (PDL launch) may start its blocks

    // Merge the 4 warps' states through shared memory (the pipeline is drained).
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) row_st[r].l = quad_sum(row_st[r].l);
    if constexpr (E4M3) {
#pragma unroll
        for (int c = 0; c < CPR; ++c)
#pragma unroll
            for (int i = 0; i < 4; ++i) o_acc[c][i] *= vmax;
    }
    float* red_o = reinterpret_cast<float*>(smem);  // [4][16][RED_STRIDE]
    float* red_m = red_o + 4 * 16 * C::RED_STRIDE;  // [4][16]
    float* red_l = red_m + 64;                      // [4][16]
    {
        float* base = red_o + warp * 16 * C::RED_STRIDE;
        // Only real rows (< rows) are merged.
        if constexpr (E4M3) {
            // n-tiles c (even dims) and c + 1 (odd) hold dims 8c + 2qd .. + 3.
#pragma unroll
            for (int c = 0; c < CPR; c += 2) {
                if (g < w.rows)
                    *reinterpret_cast<float4*>(base + g * C::RED_STRIDE + c * 8 + 2 * qd) =
                        make_float4(o_acc[c][0], o_acc[c + 1][0], o_acc[c][1], o_acc[c + 1][1]);
                if (g + 8 < w.rows)
                    *reinterpret_cast<float4*>(base + (g + 8) * C::RED_STRIDE + c * 8 + 2 * qd) =
                        make_float4(o_acc[c][2], o_acc[c + 1][2], o_acc[c][3], o_acc[c + 1][3]);
            }
        } else {
            if (g < w.rows) {
#pragma unroll
                for (int c = 0; c < CPR; ++c)
                    *reinterpret_cast<float2*>(base + g * C::RED_STRIDE + c * 8 + qd) =
                        make_float2(o_acc[c][0], o_acc[c][1]);
            }
            if (g + 8 < w.rows) {
#pragma unroll
                for (int c = 0; c < CPR; ++c)
                    *reinterpret_cast<float2*>(base + (g + 8) * C::RED_STRIDE + c * 8 + qd) =
                        make_float2(o_acc[c][2], o_acc[c][3]);
            }
        }
        if ((lane & 3) == 0) {
            red_m[warp * 16 + g] = row_st[0].m;
            red_m[warp * 16 + g + 8] = row_st[1].m;
            red_l[warp * 16 + g] = row_st[0].l;
            red_l[warp * 16 + g + 8] = row_st[1].l;
        }
    }
    __syncthreads();
    for (int it = tid; it < w.rows * CPR; it += NT) {
        const int r = it / CPR, d0 = (it % CPR) * 8;
        float M = neg_inf();
#pragma unroll
        for (int ww = 0; ww < 4; ++ww) M = fmaxf(M, red_m[ww * 16 + r]);
        // The warps' largest maximum first: each warp's weight is taken
        // against it (merge_below), and the running output is never rescaled.
        SoftmaxState st{M, 0.f};
        float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (M != neg_inf()) {
#pragma unroll
            for (int ww = 0; ww < 4; ++ww) {
                const float sc = st.merge_below(SoftmaxState{red_m[ww * 16 + r], red_l[ww * 16 + r]});
                const float* src = red_o + (ww * 16 + r) * C::RED_STRIDE + d0;
                const float4 x0 = *reinterpret_cast<const float4*>(src);
                const float4 x1 = *reinterpret_cast<const float4*>(src + 4);
                o[0] += sc * x0.x; o[1] += sc * x0.y; o[2] += sc * x0.z; o[3] += sc * x0.w;
                o[4] += sc * x1.x; o[5] += sc * x1.y; o[6] += sc * x1.z; o[7] += sc * x1.w;
            }
        }
        const int t = r / w.nh;
        store(t, w.qh0 + r - t * w.nh, d0, o, st);
    }
    __syncthreads();  // the caller may reuse the shared memory
}

// ---- f16 / bf16: the decode kernel ---------------------------------------------
// KT: the cache's element type, T or uint8_t (e4m3).
template <typename T, int D, typename KT = T>
__device__ __forceinline__ void paged_decode_tc(const kvp_decode_params& p) {
    extern __shared__ __align__(128) uint8_t smem[];
    griddep_wait();  // inputs may come from the previous kernel (PDL launch)
    DecodeWork w = decode_work_heads(p);
    const int64_t q0 = decode_first_row(p, w.b, w.qlen);
    if (q0 < 0) return;
    const PagedRows rr = paged_rows(p.kv, w.b, w.kvh);
    const int32_t* lens = reinterpret_cast<const int32_t*>(p.seq_lens);
    decode_tile<T, D, DecodeStages<D>::value, true, KT>(
        w, rr, reinterpret_cast<const T*>(p.q), reinterpret_cast<const KT*>(p.kv.k_cache),
        reinterpret_cast<const KT*>(p.kv.v_cache), p.scale, p.window_left,
        [&](int t, int qh) { return (q0 + t) * p.q_batch_stride + (int64_t)qh * p.q_head_stride; },
        [&] {
            const int L = lens[w.b];
            return make_int2(L, L);
        },
        [&](int t, int qh, int d0, const float(&o)[8], const SoftmaxState& st) {
            decode_store<T, 8>(p, w, q0, t, qh, d0, o, st, D);
        },
        smem);
}

template <typename T, int D>
__device__ __forceinline__ void paged_decode(const kvp_decode_params& p) {
    if constexpr (sizeof(T) == 4) {
        paged_decode_f32<D>(p);
    } else {
        paged_decode_tc<T, D>(p);
    }
}

// Over an e4m3 cache (16-bit T only).
template <typename T, int D>
__device__ __forceinline__ void paged_decode_e4m3(const kvp_decode_params& p) {
    paged_decode_tc<T, D, uint8_t>(p);
}

}  // namespace kvp
