// Paged prefill / extend attention over a varlen batch.
//
// Sequence b has q_len new query tokens at positions [kv_len - q_len, kv_len)
// (q rows [q_start, q_start + q_len) of q/out); each attends causally to the
// kv_len tokens of its paged cache (optionally only the last window_left + 1
// of them). q_len 1 rows (decode) and longer rows (prompts, chunks, draft
// tokens) mix freely in one launch.
//
// Work partition (plan kernel, once per batch composition): each sequence's
// rows are packed as (token, q head of the kv head's group) pairs, row
// p -> token p / group, head p % group, and cut into tiles of
// kvp_prefill_tile_q(dtype, head_dim) packed rows: with GQA the rows of one tile share every
// K/V tile they read, and a decode sequence of group g fills g rows instead of
// one. A work item is one (sequence, row tile); the attention kernel runs a
// fixed grid whose blocks stride over (item, kv head) pairs, reading the item
// count from the workspace, so one captured launch serves any later plan.
//
// Attention kernel (16-bit): FlashAttention-2 layout on mma.sync m16n8k16;
// 4 warps, each owning 16 packed rows (PrefillCfg::MT m16 tiles) and all 64
// tokens of a K/V tile; K/V
// tiles stream through a cp.async pipeline; the physical row offset of each
// token of a tile is resolved once per tile from the block table (so block
// size 1 costs what large blocks cost). A warp skips the tiles its rows cannot
// see (causal / window). f32: a plain CUDA-core kernel, for tests.
#pragma once

#include "kvp_common.cuh"

namespace kvp {

// ---- plan ----------------------------------------------------------------
// One block of KVP_PREFILL_PLAN_THREADS threads: per-thread tile counts over
// a contiguous run of sequences, a block-wide exclusive scan, then each thread
// writes its sequences' items (last row tile first: it sees the most K/V, so
// the strided grid starts on the long items). Lengths are clamped so that a
// device array that disagrees with what the host planned cannot make the
// attention kernel write outside out (rows < total_q) or the item list.
__device__ __forceinline__ void prefill_plan(const kvp_prefill_plan_params& p) {
    constexpr int NT = KVP_PREFILL_PLAN_THREADS;
    const int TQ = p.tile_q;
    __shared__ int s_scan[NT];
    griddep_wait();
    const int tid = threadIdx.x;
    const int32_t* cu = reinterpret_cast<const int32_t*>(p.qo_indptr);
    const int32_t* kl = reinterpret_cast<const int32_t*>(p.kv_lens);
    int32_t* work = reinterpret_cast<int32_t*>(p.work);
    const int per = (p.batch + NT - 1) / NT;
    const int b0 = min(p.batch, tid * per), b1 = min(p.batch, b0 + per);
    auto seq = [&](int b, int& q_start, int& q_len, int& kv_len) {
        q_start = min(max(cu[b], 0), p.total_q);
        const int q_end = min(max(cu[b + 1], q_start), p.total_q);
        q_len = q_end - q_start;
        kv_len = max(kl[b], q_len);  // rows never sit before position 0
        return (int)(((int64_t)q_len * p.group + TQ - 1) / TQ);
    };
    int count = 0;
    for (int b = b0; b < b1; ++b) {
        int qs, ql, kvl;
        count += seq(b, qs, ql, kvl) * p.num_splits;
    }
    s_scan[tid] = count;
    __syncthreads();
    for (int o = 1; o < NT; o <<= 1) {  // Hillis-Steele inclusive scan
        const int v = tid >= o ? s_scan[tid - o] : 0;
        __syncthreads();
        s_scan[tid] += v;
        __syncthreads();
    }
    int idx = s_scan[tid] - count;
    for (int b = b0; b < b1; ++b) {
        int qs, ql, kvl;
        const int tiles = seq(b, qs, ql, kvl);
        for (int t = tiles - 1; t >= 0; --t) {
            for (int sp = 0; sp < p.num_splits; ++sp, ++idx) {
                if (idx >= p.max_items) break;
                int4* it =
                    reinterpret_cast<int4*>(work + KVP_PREFILL_HEADER_INTS + (int64_t)idx * KVP_PREFILL_ITEM_INTS);
                it[0] = make_int4(b, qs, ql, kvl);
                it[1] = make_int4(t, sp, 0, 0);
            }
        }
    }
    if (tid == NT - 1) work[0] = min(s_scan[NT - 1], p.max_items);
    griddep_launch_dependents();
}

struct PrefillItem {
    int b, q_start, q_len, kv_len, tile, split;
};

__device__ __forceinline__ PrefillItem load_item(const int32_t* work, int i) {
    const int4* it = reinterpret_cast<const int4*>(work + KVP_PREFILL_HEADER_INTS + (int64_t)i * KVP_PREFILL_ITEM_INTS);
    const int4 a = it[0], c = it[1];
    return PrefillItem{a.x, a.y, a.z, a.w, c.x, c.y};
}

// Block-table lookups of one sequence for one kv head (as the decode
// kernel's RowResolver): a token's element offset in the caches, or -1 when
// its table column is past max_blocks_per_seq or its block is out of range.
struct PrefillRows {
    const int32_t* table;
    int block_size, shift, max_blocks, num_blocks;
    int64_t block_stride, token_stride, head_off;

    __device__ __forceinline__ void init(const kvp_prefill_params& p, int b, int kvh) {
        table = reinterpret_cast<const int32_t*>(p.block_table) + (int64_t)b * p.block_table_stride;
        block_size = p.block_size;
        shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
        max_blocks = p.max_blocks_per_seq;
        num_blocks = p.num_blocks;
        block_stride = p.cache_block_stride;
        token_stride = p.cache_token_stride;
        head_off = (int64_t)kvh * p.cache_head_stride;
    }
    __device__ __forceinline__ int load_block(int tok, int& off) const {
        const int col = shift >= 0 ? tok >> shift : tok / block_size;
        off = tok - col * block_size;
        if (col >= max_blocks) return -1;
        return __ldg(table + col);
    }
    __device__ __forceinline__ int64_t offset(int blk, int off) const {
        if ((unsigned)blk >= (unsigned)num_blocks) return -1;
        return (int64_t)blk * block_stride + (int64_t)off * token_stride + head_off;
    }
};

// The K/V range an item's rows can see: tokens [kv_begin, kv_end).
struct PrefillSpan {
    int r0, nrows, delta, kv_begin, kv_end;
};

__device__ __forceinline__ PrefillSpan item_span(const PrefillItem& it, int group, int window_left, int tile_q) {
    PrefillSpan s;
    s.r0 = it.tile * tile_q;
    s.nrows = min(tile_q, it.q_len * group - s.r0);
    s.delta = it.kv_len - it.q_len;  // position of the sequence's first new token
    const int first = s.delta + s.r0 / group, last = s.delta + (s.r0 + s.nrows - 1) / group;
    s.kv_end = min(it.kv_len, last + 1);
    s.kv_begin = window_left >= 0 ? max(0, first - window_left) : 0;
    return s;
}

// The run of 64-token tiles [t0, t1) that split `split` of `splits` takes of
// the item's visible tiles (possibly empty).
__device__ __forceinline__ void split_tiles(const PrefillSpan& s, int split, int splits, int& t0, int& t1) {
    constexpr int TK = KVP_PREFILL_TILE_KV;
    const int b = s.kv_begin / TK;
    const int n = s.kv_end > s.kv_begin ? (s.kv_end + TK - 1) / TK - b : 0;
    const int per = (n + splits - 1) / splits;
    t0 = min(b + n, b + split * per);
    t1 = min(b + n, t0 + per);
}

// Where an item writes: out/lse, or its split's slices of part_out/part_lse.
template <typename T>
struct PrefillOut {
    T* out;
    float* lse;
    int64_t tok_stride, head_stride;
    __device__ __forceinline__ PrefillOut(const kvp_prefill_params& p, int split, int64_t total_q, int D) {
        if (p.num_splits > 1) {
            const int64_t rows = total_q * p.num_q_heads;
            out = reinterpret_cast<T*>(p.part_out) + split * rows * D;
            lse = reinterpret_cast<float*>(p.part_lse) + split * rows;
            tok_stride = (int64_t)p.num_q_heads * D;
            head_stride = D;
        } else {
            out = reinterpret_cast<T*>(p.out);
            lse = reinterpret_cast<float*>(p.lse);
            tok_stride = p.out_token_stride;
            head_stride = p.out_head_stride;
        }
    }
};

// ---- f32: plain kernel (tests) ----------------------------------------------
template <int D>
__device__ __forceinline__ void prefill_item_f32(const kvp_prefill_params& p, const PrefillItem& it, int kvh) {
    constexpr int E = D / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = p.num_q_heads / p.num_kv_heads;
    const PrefillSpan sp = item_span(it, group, p.window_left, KVP_PREFILL_TILE_Q_F32);
    PrefillRows rr;
    rr.init(p, it.b, kvh);
    const float* kc = reinterpret_cast<const float*>(p.k_cache);
    const float* vc = reinterpret_cast<const float*>(p.v_cache);
    const float sl = p.scale * kLog2e;
    for (int r = warp; r < sp.nrows; r += KVP_PREFILL_THREADS / 32) {
        const int pr = sp.r0 + r;
        const int tok = pr / group;
        const int qh = kvh * group + (pr - tok * group);
        const int pos = sp.delta + tok;
        const int64_t row = (int64_t)it.q_start + tok;
        float q[E];
        load_f<float, E>(reinterpret_cast<const float*>(p.q) + row * p.q_token_stride + (int64_t)qh * p.q_head_stride +
                             lane * E,
                         q);
        float m = neg_inf(), l = 0.f, o[E];
#pragma unroll
        for (int i = 0; i < E; ++i) o[i] = 0.f;
        int t0, t1;
        split_tiles(sp, it.split, p.num_splits, t0, t1);
        const int lo = max(t0 * KVP_PREFILL_TILE_KV, p.window_left >= 0 ? max(0, pos - p.window_left) : 0);
        const int hi = min(t1 * KVP_PREFILL_TILE_KV, min(pos + 1, it.kv_len));
        for (int t = lo; t < hi; ++t) {
            int off;
            const int blk = rr.load_block(t, off);
            const int64_t base = rr.offset(blk, off);
            if (base < 0) continue;
            float kv[E], vv[E];
            load_f<float, E>(kc + base + lane * E, kv);
            load_f<float, E>(vc + base + lane * E, vv);
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < E; ++i) s += q[i] * kv[i];
            s = warp_sum(s) * sl;
            const float mn = fmaxf(m, s);
            const float alpha = exp2f(m - mn);
            const float pe = exp2f(s - mn);
            l = l * alpha + pe;
#pragma unroll
            for (int i = 0; i < E; ++i) o[i] = o[i] * alpha + pe * vv[i];
            m = mn;
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i) o[i] *= inv;
        const PrefillOut<float> po(p, it.split, p.total_q, D);
        store_f<float, E>(po.out + row * po.tok_stride + (int64_t)qh * po.head_stride + lane * E, o);
        if (po.lse != nullptr && lane == 0) po.lse[row * p.num_q_heads + qh] = l > 0.f ? (m + log2f(l)) * kLn2 : neg_inf();
    }
}

// ---- f16 / bf16: tensor-core kernel ------------------------------------------
template <int D>
struct PrefillCfg {
    // m16 row tiles per warp. Two (128-row items, each K/V fragment read
    // from shared memory feeding twice the MMAs) measured no faster on an
    // H100 at head_dim 128 (255 registers with spills, 185-191 TFLOP/s as
    // with one) and slower for small batches (half the items), so one.
    static constexpr int MT = 1;
    static constexpr int TQ = 4 * 16 * MT;  // packed rows per item (KVP_PREFILL_TILE_Q(D))
    static constexpr int TK = KVP_PREFILL_TILE_KV;
    static constexpr int STAGES = D <= 64 ? 3 : 2;
    static constexpr int RING = STAGES + 1;  // row-offset tiles kept (see loop)
    static constexpr int CPR = D / 8;        // 16-byte chunks per row
    static constexpr int Q_BYTES = TQ * D * 2;
    static constexpr int KV_TILE_BYTES = TK * D * 2;
    static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES;
    static constexpr int OFF_BYTES = RING * TK * 8;
    static constexpr int SMEM = Q_BYTES + STAGES * STAGE_BYTES + OFF_BYTES;
};

// 16-byte async copy with the default L2 policy: K/V tiles are read again by
// the sequence's other row tiles, so they should stay in L2.
__device__ __forceinline__ void cp_async16_keep(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

// Swizzled byte offset of 16-byte chunk c of row r in a [rows][CPR] tile:
// ldmatrix's 8 row addresses of one chunk column land in 8 different banks.
template <int CPR>
__device__ __forceinline__ uint32_t swz(int r, int c) {
    return (uint32_t)(r * CPR + (c ^ (r & 7))) * 16u;
}

template <typename T, int D>
__device__ __forceinline__ void prefill_item_tc(const kvp_prefill_params& p, const PrefillItem& it, int kvh,
                                                uint8_t* smem) {
    using C = PrefillCfg<D>;
    constexpr int MT = C::MT, TQ = C::TQ, TK = C::TK, STAGES = C::STAGES, RING = C::RING, CPR = C::CPR;
    constexpr int NT = KVP_PREFILL_THREADS;
    constexpr int WR = 16 * MT;               // rows per warp
    constexpr int KV_CHUNKS = TK * CPR / NT;  // per tensor per stage per thread
    constexpr int Q_CHUNKS = TQ * CPR / NT;
    static_assert(TK * CPR % NT == 0 && TQ * CPR % NT == 0, "chunks divide evenly");

    uint8_t* s_q = smem;
    uint8_t* s_kv = smem + C::Q_BYTES;
    int64_t* s_off = reinterpret_cast<int64_t*>(s_kv + STAGES * C::STAGE_BYTES);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int group = p.num_q_heads / p.num_kv_heads;
    const int wl = p.window_left;
    const PrefillSpan sp = item_span(it, group, wl, TQ);
    PrefillRows rr;
    rr.init(p, it.b, kvh);
    const T* kc = reinterpret_cast<const T*>(p.k_cache);
    const T* vc = reinterpret_cast<const T*>(p.v_cache);

    int t_begin, t_end;
    split_tiles(sp, it.split, p.num_splits, t_begin, t_end);
    const int n_tiles = t_end - t_begin;

    // Table entries of the first STAGES + 1 tiles.
    int pblk[STAGES + 1], poff[STAGES + 1];
#pragma unroll
    for (int j = 0; j <= STAGES; ++j) {
        pblk[j] = -1;
        poff[j] = 0;
        if (tid < TK && j < n_tiles) pblk[j] = rr.load_block((t_begin + j) * TK + tid, poff[j]);
    }
    // Query tile: packed rows past nrows are zero-filled.
    const uint32_t s_q_u32 = smem_u32(s_q);
#pragma unroll
    for (int k = 0; k < Q_CHUNKS; ++k) {
        const int i = tid + k * NT;
        const int r = i / CPR, c = i % CPR;
        const T* src = reinterpret_cast<const T*>(p.q);
        int bytes = 0;
        if (r < sp.nrows) {
            const int pr = sp.r0 + r;
            const int tok = pr / group;
            const int qh = kvh * group + (pr - tok * group);
            src += ((int64_t)it.q_start + tok) * p.q_token_stride + (int64_t)qh * p.q_head_stride + c * 8;
            bytes = 16;
        }
        cp_async16_keep(s_q_u32 + swz<CPR>(r, c), src, bytes);
    }
    if (tid < TK) {
#pragma unroll
        for (int j = 0; j < STAGES; ++j) {
            const int tok = (t_begin + j) * TK + tid;
            s_off[j * TK + tid] = (j < n_tiles && tok < it.kv_len) ? rr.offset(pblk[j], poff[j]) : -1;
        }
    }
    int cblk = pblk[STAGES], coff = poff[STAGES];
    __syncthreads();

    const uint32_t s_kv_u32 = smem_u32(s_kv);
    auto issue = [&](int j) {
        const int64_t* offs = s_off + (j % RING) * TK;
        const uint32_t sk = s_kv_u32 + (j % STAGES) * C::STAGE_BYTES;
        const uint32_t sv = sk + C::KV_TILE_BYTES;
#pragma unroll
        for (int i = 0; i < KV_CHUNKS; ++i) {
            const int c = tid + i * NT;
            const int r = c / CPR, col = c % CPR;
            const int64_t o = offs[r];
            const int bytes = o >= 0 ? 16 : 0;
            const int64_t src = o >= 0 ? o + col * 8 : 0;
            cp_async16_keep(sk + swz<CPR>(r, col), kc + src, bytes);
            cp_async16_keep(sv + swz<CPR>(r, col), vc + src, bytes);
        }
    };
    cp_async_commit();  // the query tile
#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) {
        if (j < n_tiles) issue(j);
        cp_async_commit();
    }

    // This thread's rows: g and g + 8 of each of the warp's m16 tiles.
    const int g = lane >> 2, qd = (lane & 3) * 2;
    int pos[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp * WR + mt * 16 + g + h * 8;
            pos[mt][h] = r < sp.nrows ? sp.delta + (sp.r0 + r) / group : -1;  // -1: padding row, sees nothing
        }
    }
    const bool warp_live = warp * WR < sp.nrows;
    const int wlast = min(warp * WR + WR - 1, sp.nrows - 1);
    const int wpos_max = sp.delta + (sp.r0 + wlast) / group;    // last position of the warp's rows
    const int wpos_min = sp.delta + (sp.r0 + warp * WR) / group;  // first

    const float sl = p.scale * kLog2e;
    float m_run[MT][2], l_run[MT][2];
    float o_acc[MT][CPR][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m_run[mt][0] = m_run[mt][1] = neg_inf();
        l_run[mt][0] = l_run[mt][1] = 0.f;
#pragma unroll
        for (int c = 0; c < CPR; ++c) o_acc[mt][c][0] = o_acc[mt][c][1] = o_acc[mt][c][2] = o_acc[mt][c][3] = 0.f;
    }

    const int qa_row = warp * WR + (lane & 7) + ((lane >> 3) & 1) * 8, qa_chk = lane >> 4;
    const int kb_row = (lane & 7) + ((lane >> 4) << 3), kb_chk = (lane >> 3) & 1;
    const int vb_row = (lane & 7) + ((lane >> 3) & 1) * 8, vb_chk = lane >> 4;

    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (j + STAGES - 1 < n_tiles) issue(j + STAGES - 1);
        cp_async_commit();
        int nblk = -1, noff = 0;
        if (tid < TK && j + STAGES + 1 < n_tiles) nblk = rr.load_block((t_begin + j + STAGES + 1) * TK + tid, noff);

        const int kv0 = (t_begin + j) * TK;
        const bool visible = warp_live && kv0 <= wpos_max && (wl < 0 || kv0 + TK - 1 >= wpos_min - wl);
        if (visible) {
            const uint32_t sk = s_kv_u32 + (j % STAGES) * C::STAGE_BYTES;
            const uint32_t sv = sk + C::KV_TILE_BYTES;
            float s[MT][8][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldmatrix_x4(a[mt], s_q_u32 + swz<CPR>(qa_row + mt * 16, kk * 2 + qa_chk));
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    uint32_t bk[4];
                    ldmatrix_x4(bk, sk + swz<CPR>(np * 16 + kb_row, kk * 2 + kb_chk));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<T>(s[mt][2 * np], a[mt], bk[0], bk[1]);
                        mma16816<T>(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
                    }
                }
            }
            // Mask: causal (token <= the row's position), window, tokens past
            // the sequence or in ignored blocks (row offset -1).
            const int64_t* offs = s_off + (j % RING) * TK;
            const bool full = kv0 + TK - 1 <= wpos_min && (wl < 0 || kv0 >= wpos_max - wl) && kv0 + TK <= it.kv_len;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
                for (int n = 0; n < 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = n * 8 + qd + e;
                        const int kv = kv0 + col;
                        bool ok0 = true, ok1 = true;
                        if (!full) {
                            const bool tok_ok = offs[col] >= 0;
                            ok0 = tok_ok && kv <= pos[mt][0] && (wl < 0 || kv >= pos[mt][0] - wl);
                            ok1 = tok_ok && kv <= pos[mt][1] && (wl < 0 || kv >= pos[mt][1] - wl);
                        } else if (offs[col] < 0) {
                            ok0 = ok1 = false;
                        }
                        s[mt][n][e] = ok0 ? s[mt][n][e] * sl : neg_inf();
                        s[mt][n][e + 2] = ok1 ? s[mt][n][e + 2] * sl : neg_inf();
                        mx[0] = fmaxf(mx[0], s[mt][n][e]);
                        mx[1] = fmaxf(mx[1], s[mt][n][e + 2]);
                    }
                }
                float alpha[2], m_use[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                    const float mn = fmaxf(m_run[mt][r], mx[r]);
                    m_use[r] = mn == neg_inf() ? 0.f : mn;  // row fully masked so far: keep exp2 finite
                    alpha[r] = exp2f(m_run[mt][r] - m_use[r]);
                    m_run[mt][r] = mn;
                }
                float ps[2] = {0.f, 0.f};
#pragma unroll
                for (int n = 0; n < 8; ++n) {
                    s[mt][n][0] = exp2f(s[mt][n][0] - m_use[0]);
                    s[mt][n][1] = exp2f(s[mt][n][1] - m_use[0]);
                    s[mt][n][2] = exp2f(s[mt][n][2] - m_use[1]);
                    s[mt][n][3] = exp2f(s[mt][n][3] - m_use[1]);
                    ps[0] += s[mt][n][0] + s[mt][n][1];
                    ps[1] += s[mt][n][2] + s[mt][n][3];
                }
                l_run[mt][0] = l_run[mt][0] * alpha[0] + ps[0];
                l_run[mt][1] = l_run[mt][1] * alpha[1] + ps[1];
#pragma unroll
                for (int c = 0; c < CPR; ++c) {
                    o_acc[mt][c][0] *= alpha[0];
                    o_acc[mt][c][1] *= alpha[0];
                    o_acc[mt][c][2] *= alpha[1];
                    o_acc[mt][c][3] *= alpha[1];
                }
            }
            // O += P V, 16 tokens per k-step; the C fragments of S are the A
            // fragments of P; each V fragment feeds every m16 tile.
#pragma unroll
            for (int kt = 0; kt < TK / 16; ++kt) {
                uint32_t pa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    pa[mt][0] = pack2<T>(s[mt][2 * kt][0], s[mt][2 * kt][1]);
                    pa[mt][1] = pack2<T>(s[mt][2 * kt][2], s[mt][2 * kt][3]);
                    pa[mt][2] = pack2<T>(s[mt][2 * kt + 1][0], s[mt][2 * kt + 1][1]);
                    pa[mt][3] = pack2<T>(s[mt][2 * kt + 1][2], s[mt][2 * kt + 1][3]);
                }
#pragma unroll
                for (int c = 0; c < CPR; c += 2) {
                    uint32_t bv[4];
                    ldmatrix_x4_trans(bv, sv + swz<CPR>(kt * 16 + vb_row, c + vb_chk));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<T>(o_acc[mt][c], pa[mt], bv[0], bv[1]);
                        mma16816<T>(o_acc[mt][c + 1], pa[mt], bv[2], bv[3]);
                    }
                }
            }
        }

        const int jt = j + STAGES;
        if (tid < TK && jt < n_tiles) {
            const int tok = (t_begin + jt) * TK + tid;
            s_off[(jt % RING) * TK + tid] = tok < it.kv_len ? rr.offset(cblk, coff) : -1;
        }
        cblk = nblk;
        coff = noff;
    }

    // Each warp holds whole rows: normalise and store.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_run[mt][h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int r = warp * WR + mt * 16 + g + h * 8;
            if (r >= sp.nrows) continue;
            const int pr = sp.r0 + r;
            const int tok = pr / group;
            const int qh = kvh * group + (pr - tok * group);
            const bool empty = !(l > 0.f);
            const float inv = empty ? 0.f : 1.f / l;
            const int64_t row = (int64_t)it.q_start + tok;
            const PrefillOut<T> po(p, it.split, p.total_q, D);
            T* out = po.out + row * po.tok_stride + (int64_t)qh * po.head_stride + qd;
#pragma unroll
            for (int c = 0; c < CPR; ++c)
                *reinterpret_cast<uint32_t*>(out + c * 8) =
                    pack2<T>(o_acc[mt][c][2 * h] * inv, o_acc[mt][c][2 * h + 1] * inv);
            if (po.lse != nullptr && (lane & 3) == 0)
                po.lse[row * p.num_q_heads + qh] = empty ? neg_inf() : (m_run[mt][h] + log2f(l)) * kLn2;
        }
    }
    // The next item reuses the shared memory.
    cp_async_wait<0>();
    __syncthreads();
}

template <typename T, int D>
__device__ __forceinline__ void paged_prefill(const kvp_prefill_params& p) {
    extern __shared__ __align__(128) uint8_t smem[];
    griddep_wait();  // the plan kernel (or the previous layer) may still be running under PDL
    const int32_t* work = reinterpret_cast<const int32_t*>(p.work);
    const int n_items = *reinterpret_cast<const volatile int32_t*>(work);
    const int64_t total = (int64_t)n_items * p.num_kv_heads;
    for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
        const int item = (int)(w / p.num_kv_heads);
        const int kvh = (int)(w - (int64_t)item * p.num_kv_heads);
        const PrefillItem it = load_item(work, item);
        if constexpr (sizeof(T) == 4) {
            prefill_item_f32<D>(p, it, kvh);
        } else {
            prefill_item_tc<T, D>(p, it, kvh, smem);
        }
    }
    griddep_launch_dependents();
}

}  // namespace kvp
