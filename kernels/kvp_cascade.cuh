// Shared-prefix ("cascade") attention, decode or varlen prefill: two
// launches per layer over a plan that the host writes (core/cascade) into
// the device workspace.
//
// Query tokens. Sequence b's query tokens are rows [qstart[b], qstart[b+1])
// of q/out (one per sequence in decode), at positions [seq_lens[b] - q_len,
// seq_lens[b]). The plan lists every query token's row in `qrows`, grouped
// by sequence in the plan's order, so the tokens of the members of a shared
// run are one contiguous range of it.
//
// Work items (kvp_cascade_<dt>_h<D>): an item is a token range [kv_begin,
// kv_end) read through one sequence's block-table row (rep) for a tile of
// packed rows of query tokens qrows[m_begin .. m_begin + m_count): a shared
// run's members' tokens (whose sequences hold the same blocks over the range,
// which ends before any of their query tokens, so no mask) or one sequence's
// own tail (its tokens after the shared runs, causal over its query tokens).
// Rows are packed as (token, q head of the kv head's group), row r -> token
// r / group, head r % group, so the queries of every sequence sharing a run
// go through the tensor cores together and the run's K/V is read once for
// all of them. Shared items take tiles of CascadeCfg::MT m16 rows per warp
// (128 rows at head_dim <= 128). A tail of at most 16 packed rows (a decode
// tail: its sequence's q heads times at most 16 / group new tokens) runs the
// decode kernel's 16-row tile (decode_tile, kvp_decode.cuh), its 4 warps on
// different tokens of each K/V tile; longer tails take the plan's tail tile
// of rows (its header word KVP_CASCADE_H_TAIL_TILE_Q: 64, the sm_80 tile, or
// 128, the Hopper mainloop's, where that launch runs them). A tail item's end is clipped to
// seq_lens[rep] on the device and its positions follow seq_lens, so steps
// that only grow lengths reuse the plan. Each item writes one partial state
// per row (normalised output, float32, and its log2-domain lse; -inf when it
// saw no token) at part_base + token.
//
// Merge (kvp_cascade_merge_<dt>_h<D>): one warp per (query row, q head)
// walks its sequence's segments (first partial, count, stride; the row's
// partial is first + its token index + c * stride) and merges its partial
// states by online softmax into out and lse. Empty states have weight 0; a
// row with only empty states gets out = 0, lse = -inf.
//
// Every kernel runs a fixed grid over the counts in the plan's header (the
// Hopper launch through the plan's unit counter, which its last block
// zeroes), so a captured launch serves every later plan in the same
// workspace; a plan's launches must not overlap. On the sm_80 kernel shared
// items and long tails run attn_tile (kvp_attn_tile.cuh), the prefill
// kernel's inner loop; on Hopper the wgmma mainloop runs them.
#pragma once

#include "kvp_attn_tile.cuh"
#include "kvp_decode.cuh"
#include "kvp_prefill_sm90.cuh"

namespace kvp {

// E4M3: over an e4m3 cache (the tiles' raw stages and scales).
template <int D, bool E4M3 = false>
struct CascadeCfg {
    static constexpr int MT = D <= 128 ? 2 : 1;  // m16 row tiles per warp of shared items
    using Shared = TileCfg<D, MT, E4M3>;
    using Tail = TileCfg<D, 1, E4M3>;
    using DecodeTail = DecodeCfg<D, DecodeStages<D>::value, E4M3>;
    static constexpr int TQ = Shared::TQ;  // kvp_cascade_tile_q
    static constexpr int TILES = Shared::SMEM > Tail::SMEM ? Shared::SMEM : Tail::SMEM;
    static constexpr int SMEM = TILES > DecodeTail::SMEM ? TILES : DecodeTail::SMEM;
    static_assert(Tail::TQ == KVP_CASCADE_TAIL_TILE_Q, "tail tile");
};

struct CascadeItem {
    int rep, kv_begin, kv_end, dynamic, m_begin, m_count, tile, part_base;

    // A tail whose packed rows fit the decode kernel's 16-row tile.
    __device__ __forceinline__ bool decode_tail(int group) const {
        return dynamic && m_count * group <= KVP_DECODE_HEADS_PER_CTA;
    }
};

// The plan's packed rows per item of a tail longer than a decode tail:
// KVP_CASCADE_TAIL_TILE_Q, or KVP_PREFILL_SM90_TILE_Q where the planner cut
// them for the Hopper launch (any other value is read as the first).
__device__ __forceinline__ int cascade_tail_tile(const int32_t* work) {
    const int t = *reinterpret_cast<const volatile int32_t*>(work + KVP_CASCADE_H_TAIL_TILE_Q);
    return t == KVP_PREFILL_SM90_TILE_Q ? KVP_PREFILL_SM90_TILE_Q : KVP_CASCADE_TAIL_TILE_Q;
}

// The plan's items and, of them, the Hopper launch's (a prefix of the list).
__device__ __forceinline__ int2 cascade_item_counts(const int32_t* work) {
    const int n = *reinterpret_cast<const volatile int32_t*>(work + KVP_CASCADE_H_ITEMS);
    const int h = *reinterpret_cast<const volatile int32_t*>(work + KVP_CASCADE_H_HOPPER_ITEMS);
    return make_int2(n, min(max(h, 0), n));
}

// Item i of the plan.
__device__ __forceinline__ CascadeItem load_cascade_item(const kvp_cascade_params& p, int i) {
    const int4* ip = reinterpret_cast<const int4*>(reinterpret_cast<const int32_t*>(p.work) + p.items_off +
                                                   (int64_t)i * KVP_CASCADE_ITEM_INTS);
    const int4 a = ip[0], b = ip[1];
    return CascadeItem{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
}

// One item for one kv head, with MT m16 row tiles per warp; CAUSAL for tail
// items: its packed rows [r0, min(r0 + the tile's rows, r_end)). KT: the
// cache's element type, T or uint8_t (e4m3).
template <typename T, int D, int MT, bool CAUSAL, typename KT = T>
__device__ __forceinline__ void cascade_item(const kvp_cascade_params& p, const CascadeItem& it, int kvh, int r0,
                                             int r_end, uint8_t* smem) {
    using C = TileCfg<D, MT, sizeof(KT) == 1>;
    const int group = p.num_q_heads / p.kv.num_kv_heads;
    const int32_t* qrows = reinterpret_cast<const int32_t*>(p.work) + p.qrows_off + it.m_begin;
    const int kb = max(it.kv_begin, 0);
    int ke = it.kv_end;
    int delta = 1 << 30;  // shared run: every member's tokens come after it
    if (CAUSAL) {
        const int len = __ldg(reinterpret_cast<const int32_t*>(p.seq_lens) + it.rep);
        ke = min(ke, len);
        delta = len - it.m_count;  // the sequence's first query token
    }
    TileJob jb;
    jb.r0 = r0;
    jb.nrows = max(0, min(C::TQ, r_end - r0));
    jb.group = group;
    jb.kvh = kvh;
    jb.delta = delta;
    jb.window_left = -1;
    jb.kv_begin = kb;
    jb.kv_end = ke;
    jb.n_tiles = ke > kb ? (ke - kb + C::TK - 1) / C::TK : 0;
    jb.q_head_stride = p.q_head_stride;
    jb.scale = p.scale;
    const PagedRows rr = paged_rows(p.kv, it.rep, kvh);
    float* part_out = reinterpret_cast<float*>(p.part_out);
    float* part_lse = reinterpret_cast<float*>(p.part_lse);
    const int64_t q_stride = p.q_batch_stride;
    const int qd = (threadIdx.x & 3) * 2;
    const bool lse_lane = (threadIdx.x & 3) == 0;
    attn_tile<T, D, MT, CAUSAL, KT>(
        jb, rr, reinterpret_cast<const T*>(p.q), reinterpret_cast<const KT*>(p.kv.k_cache),
        reinterpret_cast<const KT*>(p.kv.v_cache), [&](int tok) { return (int64_t)__ldg(qrows + tok) * q_stride; },
        [&](int tok, int qh, const float(&o)[C::CPR][4], int h, const SoftmaxState& st) {
            // Partial state: normalised output and log2 lse.
            const int64_t pi = (int64_t)(it.part_base + tok) * p.num_q_heads + qh;
            write_state(st).to<float, true, C::CPR, 2, 8>(part_out + pi * D + qd, lse_lane ? part_lse + pi : nullptr,
                                                   [&](int c, int e) { return o[c][2 * h + e]; });
        },
        smem);
}

// A decode tail (CascadeItem::decode_tail: at most 16 packed rows): the decode
// kernel's 16-row tile over [kv_begin, min(kv_end, seq_lens[rep])), rows
// (new token, q head of kv head kvh), causal among the tail's query tokens
// (the last m_count positions of the sequence).
template <typename T, int D, typename KT = T>
__device__ __forceinline__ void cascade_decode_tail(const kvp_cascade_params& p, const CascadeItem& it, int kvh,
                                                    uint8_t* smem) {
    const int group = p.num_q_heads / p.kv.num_kv_heads;
    const int32_t* qrows = reinterpret_cast<const int32_t*>(p.work) + p.qrows_off + it.m_begin;
    DecodeWork w;
    w.kvh = kvh;
    w.qh0 = kvh * group;
    w.nh = group;
    w.b = it.rep;
    w.split = 0;
    w.S = 1;
    w.base = max(it.kv_begin, 0);
    w.end = w.L = w.n_tiles = 0;
    w.qlen = it.m_count;
    w.rows = it.m_count * group;
    const PagedRows rr = paged_rows(p.kv, it.rep, kvh);
    float* part_out = reinterpret_cast<float*>(p.part_out);
    float* part_lse = reinterpret_cast<float*>(p.part_lse);
    const int32_t* lens = reinterpret_cast<const int32_t*>(p.seq_lens);
    decode_tile<T, D, CascadeCfg<D>::DecodeTail::STAGES, false, KT>(
        w, rr, reinterpret_cast<const T*>(p.q), reinterpret_cast<const KT*>(p.kv.k_cache),
        reinterpret_cast<const KT*>(p.kv.v_cache), p.scale, -1,
        [&](int t, int qh) { return (int64_t)__ldg(qrows + t) * p.q_batch_stride + (int64_t)qh * p.q_head_stride; },
        [&] { return make_int2(__ldg(lens + it.rep), it.kv_end); },
        [&](int t, int qh, int d0, const float(&o)[8], const SoftmaxState& st) {
            // Partial state: normalised output and log2 lse.
            const int64_t pi = (int64_t)(it.part_base + t) * p.num_q_heads + qh;
            write_state(st).to<float, true>(part_out + pi * D + d0, d0 == 0 ? part_lse + pi : nullptr, o);
        },
        smem);
}

template <typename T, int D, typename KT = T>
__device__ __forceinline__ void cascade_attn(const kvp_cascade_params& p) {
    extern __shared__ __align__(128) uint8_t smem[];
    griddep_wait();  // the plan's copy or the previous layer may still be running under PDL
    const int32_t* work = reinterpret_cast<const int32_t*>(p.work);
    const int2 counts = cascade_item_counts(work);
    const int first = p.skip_shared ? counts.y : 0;  // kvp_cascade_sm90 ran the items before
    const int group = p.num_q_heads / p.kv.num_kv_heads;
    const int tail_tile = cascade_tail_tile(work);
    // A long tail cut for the Hopper launch, run here (a device without it):
    // its 128 rows in two units of this kernel's 64.
    const int halves = p.skip_shared ? 1 : tail_tile / KVP_CASCADE_TAIL_TILE_Q;
    const int64_t total = (int64_t)(counts.x - first) * p.kv.num_kv_heads * halves;
    for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
        const int64_t u = w / halves;
        const int half = (int)(w - u * halves);
        const int i = first + (int)(u / p.kv.num_kv_heads);
        const int kvh = (int)(u - (int64_t)(i - first) * p.kv.num_kv_heads);
        const CascadeItem it = load_cascade_item(p, i);
        const int rows = it.m_count * group;
        if (it.dynamic && !it.decode_tail(group)) {
            const int r0 = it.tile * tail_tile + half * KVP_CASCADE_TAIL_TILE_Q;
            const int r_end = min(rows, (it.tile + 1) * tail_tile);
            if (r0 >= r_end) continue;  // a last tile's half without rows
            cascade_item<T, D, 1, true, KT>(p, it, kvh, r0, r_end, smem);
        } else if (half > 0) {
            continue;
        } else if (it.dynamic) {
            cascade_decode_tail<T, D, KT>(p, it, kvh, smem);
        } else {
            constexpr int TQ = CascadeCfg<D>::TQ;
            cascade_item<T, D, CascadeCfg<D>::MT, false, KT>(p, it, kvh, it.tile * TQ, min(rows, (it.tile + 1) * TQ),
                                                             smem);
        }
    }
    griddep_launch_dependents();
}

// Over an e4m3 cache (16-bit T only): the items on the sm_80 tiles and the
// decode tile, which read e4m3 with its scales. On Hopper the e4m3 Hopper
// launch takes the shared items first and this one runs with skip_shared 1
// (as for 16-bit caches); with skip_shared 0 (KVP_CASCADE_NO_HOPPER, another
// device, or too little shared memory for the Hopper launch) it runs every
// item, also of a plan cut for the Hopper launch: its shared tiles are this
// kernel's, its long tails two halves.
template <typename T, int D>
__device__ __forceinline__ void cascade_attn_e4m3(const kvp_cascade_params& p) {
    cascade_attn<T, D, uint8_t>(p);
}

// The shared items, and the longer tails of a plan cut for it, on Hopper's
// wgmma mainloop (kvp_prefill_sm90.cuh). A unit is one (item, kv head); its
// rows the item's tile of packed rows of its query tokens (through qrows);
// its tokens the item's range, with no mask for a shared item (every
// member's queries come after it) and causal for a tail (clipped to
// seq_lens[rep] and to its rows' last position, as cascade_item reads
// them); its results partial states as cascade_item writes them. Its items
// are the list's first KVP_CASCADE_H_HOPPER_ITEMS (the cascade kernel,
// launched with skip_shared, runs the rest). Blocks take units from the
// plan's counter (Sm90Sched).
template <typename T, int D>
struct Sm90CascadeSrc : Sm90Src<kvp_cascade_params, KVP_CASCADE_W_NEXT_UNIT> {
    struct Unit : Sm90Unit {
        CascadeItem it;
    };
    int tile_q, tail_tile;

    __device__ __forceinline__ Sm90CascadeSrc(const kvp_cascade_params& p_) : Sm90Src(p_, -1) {
        tile_q = CascadeCfg<D>::TQ;
        tail_tile = cascade_tail_tile(work);
        total = (int64_t)cascade_item_counts(work).y * p.kv.num_kv_heads;
    }
    __device__ __forceinline__ Unit unit(int64_t w) const {
        constexpr int TN = Sm90Cfg<T, D>::TN;
        Unit u;
        const int i = (int)(w / p.kv.num_kv_heads);
        u.kvh = (int)(w - (int64_t)i * p.kv.num_kv_heads);
        u.it = load_cascade_item(p, i);
        const int rows = u.it.dynamic ? tail_tile : tile_q;
        u.sp.r0 = u.it.tile * rows;
        u.sp.nrows = max(0, min(rows, u.it.m_count * group - u.sp.r0));
        u.sp.kv_begin = max(u.it.kv_begin, 0);
        if (u.it.dynamic) {
            // The sequence's query tokens are its last m_count positions.
            const int len = __ldg(reinterpret_cast<const int32_t*>(p.seq_lens) + u.it.rep);
            u.sp.delta = len - u.it.m_count;
            const int last = u.sp.delta + (u.sp.r0 + max(u.sp.nrows, 1) - 1) / group;
            u.sp.kv_end = min(min(u.it.kv_end, len), last + 1);
        } else {
            u.sp.delta = 1 << 30;  // every member's query tokens come after the run: no mask
            u.sp.kv_end = u.it.kv_end;
        }
        u.t0 = u.sp.kv_begin / TN;
        u.t1 = u.sp.kv_end > u.sp.kv_begin ? (u.sp.kv_end + TN - 1) / TN : u.t0;
        return u;
    }
    __device__ __forceinline__ PagedRows rows(const Unit& u) const { return paged_rows(p.kv, u.it.rep, u.kvh); }
    __device__ __forceinline__ int64_t q_row(const Unit& u, int tok) const {
        return (int64_t)__ldg(work + p.qrows_off + u.it.m_begin + tok) * p.q_batch_stride;
    }
    // Partial state: normalised output (float32) and log2 lse.
    __device__ __forceinline__ void store(const Unit& u, int tok, int qh, int col, const float (&o)[D / 2], int h,
                                          const SoftmaxState& st, bool lse_lane) const {
        const int64_t pi = (int64_t)(u.it.part_base + tok) * p.num_q_heads + qh;
        write_state(st).to<float, true, D / 8, 2, 8>(reinterpret_cast<float*>(p.part_out) + pi * D + col,
                                              lse_lane ? reinterpret_cast<float*>(p.part_lse) + pi : nullptr,
                                              [&](int j, int e) { return o[4 * j + 2 * h + e]; });
    }
};

template <typename T, int D>
__device__ __forceinline__ void cascade_shared_sm90(const kvp_cascade_params& p) {
    sm90_attention<T, D, Sm90CascadeSrc<T, D>>(p);
}

// The same over an e4m3 cache: its tiles widened on the way into shared
// memory (Sm90Cfg's raw ring); cascade_attn_e4m3 runs the rest.
template <typename T, int D>
__device__ __forceinline__ void cascade_shared_sm90_e4m3(const kvp_cascade_params& p) {
    sm90_attention<T, D, Sm90CascadeSrc<T, D>, kvp_cascade_params, true>(p);
}

// One warp per (query row, q head): online-softmax merge of its partial
// states, in the log2 domain.
template <typename T, int D>
__device__ __forceinline__ void cascade_merge(const kvp_cascade_params& p) {
    constexpr int E = D / 32;
    griddep_wait();
    const int32_t* work = reinterpret_cast<const int32_t*>(p.work);
    const int batch = min(*reinterpret_cast<const volatile int32_t*>(work + KVP_CASCADE_H_BATCH), p.max_batch);
    const int n_rows = min(*reinterpret_cast<const volatile int32_t*>(work + KVP_CASCADE_H_ROWS), p.max_rows);
    const int32_t* seg_start = work + p.seg_start_off;
    const int32_t* segs = work + p.segs_off;
    const int32_t* rowseq = work + p.rowseq_off;
    const int32_t* qstart = work + p.qstart_off;
    const float* part_out = reinterpret_cast<const float*>(p.part_out);
    const float* part_lse = reinterpret_cast<const float*>(p.part_lse);
    const int lane = threadIdx.x & 31;
    const int64_t rows = (int64_t)n_rows * p.num_q_heads;
    const int64_t warps = (int64_t)gridDim.x * (KVP_CASCADE_MERGE_THREADS / 32);
    for (int64_t w = (int64_t)blockIdx.x * (KVP_CASCADE_MERGE_THREADS / 32) + (threadIdx.x >> 5); w < rows; w += warps) {
        const int g = (int)(w / p.num_q_heads);
        const int h = (int)(w - (int64_t)g * p.num_q_heads);
        const int b = rowseq[g];
        if ((unsigned)b >= (unsigned)batch) continue;  // not a plan's row map (the host writes only valid ones)
        const int i = g - qstart[b];                   // the row's token index in its sequence
        SoftmaxState st;
        st.init();
        float acc[E];
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = 0.f;
        const int k1 = seg_start[b + 1];
        for (int k = seg_start[b]; k < k1; ++k) {
            const int4 sg = *reinterpret_cast<const int4*>(segs + (int64_t)k * KVP_CASCADE_SEG_INTS);
            for (int c = 0; c < sg.y; ++c) {
                const int64_t pi = (int64_t)(sg.x + i + c * sg.z) * p.num_q_heads + h;
                const float s = __ldcg(part_lse + pi);
                if (s == neg_inf()) continue;  // empty state: weight 0
                float v[E];
                load_cg<E>(part_out + pi * D + lane * E, v);
                merge_out(acc, st.merge(SoftmaxState{s, 1.f}), v);
            }
        }
        // The items' partials hold no sink: the row's one sink joins here.
        const StateWriter end = write_state(st, sink_log2(p.sinks, h));
        T* out = reinterpret_cast<T*>(p.out) + (int64_t)g * p.out_batch_stride + (int64_t)h * p.out_head_stride + lane * E;
        end.to<T, false>(out, nullptr, acc);
        // The lse (end.st.lse(), what to() writes) after the output: its
        // address held across the output's stores spilled (h64, sm_90a).
        if (p.lse != 0 && lane == 0) reinterpret_cast<float*>(p.lse)[(int64_t)g * p.num_q_heads + h] = end.st.lse();
    }
    griddep_launch_dependents();
}

}  // namespace kvp
