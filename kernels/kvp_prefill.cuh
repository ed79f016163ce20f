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
// Attention kernel (16-bit): each item is one attn_tile (kvp_attn_tile.cuh,
// the inner loop the shared-prefix kernel runs too) of 64 packed rows,
// causal, optionally windowed. f32: a plain CUDA-core kernel, for tests.
#pragma once

#include "kvp_attn_tile.cuh"

namespace kvp {

// ---- plan ----------------------------------------------------------------
// One block of KVP_PREFILL_PLAN_THREADS threads: per-thread tile counts over
// a contiguous run of sequences, a block-wide exclusive scan, then each thread
// writes its sequences' items (last row tile first: it sees the most K/V, so
// the blocks start on the long items; with skip_decode, none for a
// sequence of one new token). Lengths are clamped so that a
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
        if (p.skip_decode && q_len == 1) return 0;  // the decode launch's row
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
    if (tid == NT - 1) {
        work[0] = min(s_scan[NT - 1], p.max_items);
        work[KVP_PREFILL_W_NEXT_UNIT] = 0;  // the Hopper kernel's scheduler starts from zero
        work[KVP_PREFILL_W_NEXT_UNIT + 1] = 0;
    }
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

// The run of TK-token tiles [t0, t1) that split `split` of `splits` takes of
// the item's visible tiles (possibly empty).
template <int TK = KVP_PREFILL_TILE_KV>
__device__ __forceinline__ void split_tiles(const PrefillSpan& s, int split, int splits, int& t0, int& t1) {
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
        sinks = p.num_splits > 1 ? 0 : p.sinks;
    }
    uint64_t sinks;  // the run's sinks, or 0 for a split's partials (kvp_merge_states adds them)
    // q head qh's sink for write_state (-inf: none).
    __device__ __forceinline__ float sink(int qh) const { return sink_log2(sinks, qh); }
};

// ---- f32: plain kernel (tests) ----------------------------------------------
template <int D>
__device__ __forceinline__ void prefill_item_f32(const kvp_prefill_params& p, const PrefillItem& it, int kvh) {
    constexpr int E = D / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = p.num_q_heads / p.kv.num_kv_heads;
    const PrefillSpan sp = item_span(it, group, p.window_left, KVP_PREFILL_TILE_Q_F32);
    const PagedRows rr = paged_rows(p.kv, it.b, kvh);
    const float* kc = reinterpret_cast<const float*>(p.kv.k_cache);
    const float* vc = reinterpret_cast<const float*>(p.kv.v_cache);
    const float sl = p.scale * kLog2e;
    for (int r = warp; r < sp.nrows; r += KVP_PREFILL_THREADS / 32) {
        const int pr = sp.r0 + r;
        const int tok = pr / group;
        const int qh = kvh * group + (pr - tok * group);
        const int pos = sp.delta + tok;
        const int64_t row = (int64_t)it.q_start + tok;
        F32Row<E> qr(reinterpret_cast<const float*>(p.q) + row * p.q_token_stride + (int64_t)qh * p.q_head_stride,
                     lane);
        int t0, t1;
        split_tiles(sp, it.split, p.num_splits, t0, t1);
        const int lo = max(t0 * KVP_PREFILL_TILE_KV, p.window_left >= 0 ? max(0, pos - p.window_left) : 0);
        const int hi = min(t1 * KVP_PREFILL_TILE_KV, min(pos + 1, it.kv_len));
        qr.attend(rr, kc, vc, lane, sl, lo, hi);
        const PrefillOut<float> po(p, it.split, p.total_q, D);
        write_state(qr.st, po.sink(qh)).template to<float, false>(
            po.out + row * po.tok_stride + (int64_t)qh * po.head_stride + lane * E,
            po.lse != nullptr && lane == 0 ? po.lse + row * p.num_q_heads + qh : nullptr, qr.o);
    }
}

// ---- f16 / bf16: tensor-core kernel ------------------------------------------
// m16 row tiles per warp: one. Two (128-row items, each K/V fragment read
// from shared memory feeding twice the MMAs) measured no faster on an H100 at
// head_dim 128 (255 registers with spills, 185-191 TFLOP/s as with one) and
// slower for small batches (half the items).
template <int D>
using PrefillCfg = TileCfg<D, 1>;  // PrefillCfg<D>::TQ is KVP_PREFILL_TILE_Q(D)

// KT: the cache's element type, T or uint8_t (e4m3).
template <typename T, int D, typename KT = T>
__device__ __forceinline__ void prefill_item_tc(const kvp_prefill_params& p, const PrefillItem& it, int kvh,
                                                uint8_t* smem) {
    using C = PrefillCfg<D>;
    const int group = p.num_q_heads / p.kv.num_kv_heads;
    const PrefillSpan sp = item_span(it, group, p.window_left, C::TQ);
    int t_begin, t_end;
    split_tiles(sp, it.split, p.num_splits, t_begin, t_end);
    TileJob jb;
    jb.r0 = sp.r0;
    jb.nrows = sp.nrows;
    jb.group = group;
    jb.kvh = kvh;
    jb.delta = sp.delta;
    jb.window_left = p.window_left;
    jb.kv_begin = t_begin * C::TK;
    jb.kv_end = it.kv_len;
    jb.n_tiles = t_end - t_begin;
    jb.q_head_stride = p.q_head_stride;
    jb.scale = p.scale;
    const PrefillOut<T> po(p, it.split, p.total_q, D);
    const int64_t q_start = it.q_start, q_stride = p.q_token_stride;
    const int qd = (threadIdx.x & 3) * 2;
    const bool lse_lane = (threadIdx.x & 3) == 0;
    attn_tile<T, D, C::MT, true, KT>(
        jb, paged_rows(p.kv, it.b, kvh), reinterpret_cast<const T*>(p.q), reinterpret_cast<const KT*>(p.kv.k_cache),
        reinterpret_cast<const KT*>(p.kv.v_cache), [&](int tok) { return (q_start + tok) * q_stride; },
        [&](int tok, int qh, const float(&o)[C::CPR][4], int h, const SoftmaxState& st) {
            const int64_t row = q_start + tok;
            write_state(st, po.sink(qh)).template to<T, false, C::CPR, 2, 8>(po.out + row * po.tok_stride + (int64_t)qh * po.head_stride + qd,
                po.lse != nullptr && lse_lane ? po.lse + row * p.num_q_heads + qh : nullptr,
                [&](int c, int e) { return o[c][2 * h + e]; });
        },
        smem);
}

template <typename T, int D, typename KT = T>
__device__ __forceinline__ void paged_prefill(const kvp_prefill_params& p) {
    extern __shared__ __align__(128) uint8_t smem[];
    griddep_wait();  // the plan kernel (or the previous layer) may still be running under PDL
    const int32_t* work = reinterpret_cast<const int32_t*>(p.work);
    const int n_items = *reinterpret_cast<const volatile int32_t*>(work);
    const int64_t total = (int64_t)n_items * p.kv.num_kv_heads;
    for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
        const int item = (int)(w / p.kv.num_kv_heads);
        const int kvh = (int)(w - (int64_t)item * p.kv.num_kv_heads);
        const PrefillItem it = load_item(work, item);
        if constexpr (sizeof(T) == 4) {
            prefill_item_f32<D>(p, it, kvh);
        } else {
            prefill_item_tc<T, D, KT>(p, it, kvh, smem);
        }
    }
    griddep_launch_dependents();
}

// Over an e4m3 cache (16-bit T only; the sm_80 mainloop on every device).
template <typename T, int D>
__device__ __forceinline__ void paged_prefill_e4m3(const kvp_prefill_params& p) {
    paged_prefill<T, D, uint8_t>(p);
}

}  // namespace kvp
