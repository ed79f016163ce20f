// Paged prefill / extend attention on Hopper (sm_90a): the same work list, items
// and outputs as kvp_prefill.cuh, on a warp-specialized wgmma mainloop.
//
// A block is three warpgroups over a persistent grid whose blocks take
// (item, kv head) units from a counter (Sm90Sched):
//   - warpgroup 0, the producer (setmaxnreg down to 56 registers), gathers the
//     item's query rows and then its K/V tiles from the paged cache into shared
//     memory with cp.async (any block size: each token's row is looked up in
//     the block table once per tile), STAGES tiles deep, K one tile ahead of
//     V, signalling each full K or V tile on an mbarrier;
//   - warpgroups 1 and 2, the consumers (setmaxnreg up to 224), each own 64 of
//     the item's 128 packed rows: S = Q K^T with wgmma from shared memory,
//     masking only on tiles that need it, online softmax in registers, then
//     O += P V with P from registers, and release the stage to the producer.
// Shared-memory tiles are stored in 128-byte rows with the 128-byte swizzle
// (16-byte chunk c of row r at chunk c ^ (r % 8)) that wgmma's descriptors
// name, so the producer's 16-byte copies and the tensor cores' reads are both
// free of bank conflicts. Every size in bytes is derived from sizeof(T): an
// 8-bit cache changes the element count per 128-byte row, not the layout.
#pragma once

#include "kvp_prefill.cuh"
#include "kvp_sm90_ptx.cuh"

namespace kvp {

// F8: FP8 Q/K/V (over an e4m3 cache, q quantised to e4m3 by the producer):
// the shared Q, K and V tiles hold e4m3 bytes and both products run on the
// 8-bit wgmma (Sm90Cfg's F8 section below).
template <typename T, int D, bool E4M3 = false, bool F8 = false>
struct Sm90Cfg {
    static constexpr int TQ = KVP_PREFILL_SM90_TILE_Q;  // packed rows per item: 2 consumers x 64
    static constexpr int TN = D <= 128 ? 128 : 64;      // tokens per K/V tile
    static constexpr int STAGES = 2;
    static constexpr int ES = F8 ? 1 : (int)sizeof(T);      // bytes an element of the shared tiles
    static constexpr int ROW = 128;                          // bytes per swizzled row
    static constexpr int EPR = ROW / ES;                     // elements per 128-byte row
    static constexpr int CB = D / EPR;                       // 128-byte column blocks of a head row
    static constexpr int CPR = D * ES / 16;                  // 16-byte chunks of a head row
    static constexpr int KSTEPS = D * ES / 32;               // 32-byte k steps of Q K^T (k16 of 16 bits, k32 of e4m3)
    static constexpr int Q_BYTES = TQ * D * ES;
    static constexpr int KV_BYTES = TN * D * ES;  // one K or one V tile
    static constexpr int OFF_BYTES = STAGES * TN * 8;
    // Registers per thread after setmaxnreg (128 x producer + 256 x consumer
    // within the 64 Ki register file). At 40 the producer's unrolled gather
    // spills; the consumers fit 224 at every head_dim without spilling.
    // The e4m3 producer's widening pass holds a raw chunk, its sixteen
    // widened values and the ring's counters: at 56 it spills.
    static constexpr int PRODUCER_REGS = E4M3 ? 72 : 56;
    static constexpr int CONSUMER_REGS = E4M3 ? 216 : 224;
    // setmaxnreg moves registers within the block's launch allocation:
    // __launch_bounds__(384, 1) gives 168 a thread (65536 / 384 rounded down to
    // a multiple of 8). A split that asks for more waits in setmaxnreg.inc forever.
    static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 384 * 168, "register pool of the launch"); 
    static constexpr int BAR_BYTES = 128;  // mbarriers (4 per stage + 2), per-stage flags, unit slots
    static constexpr int SLOT_OFF = 8 * (4 * STAGES + 2) + 8;  // after the barriers and flags, 8-aligned
    static_assert(4 * STAGES <= 8 && SLOT_OFF + 3 * 8 <= BAR_BYTES, "barrier space");
    static constexpr int BASE_SMEM = 1024 + Q_BYTES + 2 * STAGES * KV_BYTES + OFF_BYTES + BAR_BYTES;
    // Over an e4m3 cache (E4M3) the producer lands each K or V tile raw (TN
    // rows of D bytes, unswizzled) in a ring of RAW slots, each with its
    // rows' scales, a readable-rows mask and where the tile goes (RAW_META
    // bytes), and widens it into the stage's 16-bit tile, the scale folded
    // in, so the consumers run the 16-bit mainloop as they are. The ring is
    // as deep as the shared memory allows (3 slots keep two tiles' loads in
    // flight while one widens; 2 at D 256); each stage also keeps its K
    // tile's mask for the consumers (STAGE_MASK bytes), since the offsets
    // the 16-bit path masks by are rewritten as soon as the raw ring moves on.
    static constexpr int SMEM_MAX = 232448;                   // sm_90's opt-in shared memory per block
    static constexpr int RAW_BYTES = TN * D;                  // one raw e4m3 tile
    static constexpr int MASK_BYTES = TN / 8;                 // a bit per row: readable
    static constexpr int RAW_META = TN * 4 + 16 + 16;         // scales, mask (16 B at most), {stage, phase, v, any}
    static constexpr int STAGE_MASK = 16;
    static constexpr int RAW = !E4M3 ? 0
                               : BASE_SMEM + 3 * (RAW_BYTES + RAW_META) + STAGES * STAGE_MASK <= SMEM_MAX ? 3
                                                                                                            : 2;
    // F8: after the barriers, each stage's K and V scales (fp32 a token:
    // the cache's per-token-head scales, or its one scale repeated), the
    // query rows' scales, then two raw V tiles (TN rows of D bytes as they
    // are in the cache, a row's 16-byte chunk c at c ^ (row / 16 % 8)),
    // which the producer transposes into the stage's V tile: the 8-bit
    // wgmma reads B only K-major, so P V^T needs V as [dim][token].
    // Per stage also P's V factors (w_j = sv_j * 256 / max sv, fp32), their
    // reciprocals (f16), and the tile's max sv / 256, which the producer
    // computes as it transposes the tile; then its warps' maxima.
    static constexpr int F8_KSC = 0, F8_VSC = 4 * STAGES * TN, F8_QSC = 8 * STAGES * TN;
    static constexpr int F8_VW = F8_QSC + 4 * TQ, F8_VR = F8_VW + 4 * STAGES * TN, F8_FV = F8_VR + 2 * STAGES * TN;
    static constexpr int F8_WM = F8_FV + 4 * STAGES;
    static constexpr int F8_RAW_OFF = (F8_WM + 16 + 127) / 128 * 128;
    static constexpr int SMEM = BASE_SMEM + (E4M3 ? RAW * (RAW_BYTES + RAW_META) + STAGES * STAGE_MASK : 0) +
                                (F8 ? F8_RAW_OFF + 2 * TN * D : 0);
    static_assert(!F8 || (D == 128 && TN == 128 && F8_RAW_OFF % 128 == 0), "the FP8 Q/K/V mainloop is cut for head_dim 128");
    static_assert(!(E4M3 && F8), "one cache mode");
    static_assert(SMEM <= SMEM_MAX, "shared memory of the Hopper mainloop");
    static_assert(MASK_BYTES <= 16, "a tile's mask");
    static_assert(D % EPR == 0, "head rows must fill whole 128-byte rows");
};

template <bool B>
struct Flag {  // a compile-time flag for a generic lambda's instances
    static constexpr bool value = B;
};
template <int N>
struct Int {  // a compile-time count for a generic lambda's instances
    static constexpr int value = N;
};
template <bool B, class X, class Y>
struct Pick {  // X if B, else Y
    using type = X;
};
template <class X, class Y>
struct Pick<false, X, Y> {
    using type = Y;
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a [rows][128 B] block
// (the 128-byte swizzle of the wgmma descriptors).
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
    return (uint32_t)(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// Which unit the producer takes next. Blocks take units from one counter
// (two int32 words the plan zeroes: the next unit, and blocks done), in the
// work list's order, as they near the end of the last: a causal prefill's
// units range from one K/V tile to all of them, and a static stride over
// them leaves some blocks with half again the average. The last block to
// finish zeroes both words, so a launch captured in a graph (or the next
// layer's, under the same plan) starts from zero again.
//
// take(ctr) is the block's next unit (producer thread 0); finish(ctr)
// follows its last take, the one past the end.
struct Sm90Sched {
    static __device__ __forceinline__ int64_t take(int32_t* ctr) { return atomicAdd(ctr, 1); }
    static __device__ __forceinline__ void finish(int32_t* ctr) {
        __threadfence();
        if (atomicAdd(ctr + 1, 1) == (int)gridDim.x - 1) {
            atomicExch(ctr, 0);
            atomicExch(ctr + 1, 0);
        }
    }
};

// What the mainloop runs: a source of (item, kv head) units that both roles
// decode the same way, each naming its packed query rows (sp.r0, sp.nrows;
// row r -> token (r0 + r) / group, head r % group; positions from
// sp.delta), the readable tokens [sp.kv_begin, sp.kv_end) read in the
// TN-token tiles [t0, t1) through one block-table row, and where the rows'
// results go.
//
// What both roles read of a unit; a source's Unit adds its item.
struct Sm90Unit {
    PrefillSpan sp;
    int kvh, t0, t1;
};

// What every source holds: its params P (p.work its work list, Sm90Sched's
// words NEXT_UNIT words into it), group (q heads a kv head), window
// (window_left; < 0: none) and total (units); a source's constructor sets
// total.
template <class P, int NEXT_UNIT>
struct Sm90Src {
    const P& p;
    const int32_t* work;
    int32_t* sched;  // Sm90Sched's words
    int group, window;
    int64_t total;

    __device__ __forceinline__ Sm90Src(const P& p_, int window_) : p(p_) {
        work = reinterpret_cast<const int32_t*>(p.work);
        sched = reinterpret_cast<int32_t*>(p.work) + NEXT_UNIT;
        group = p.num_q_heads / p.kv.num_kv_heads;
        window = window_;
    }
};

// Paged prefill's work list (kvp_prefill.cuh's items, split-KV runs).
template <typename T, int D>
struct Sm90PrefillSrc : Sm90Src<kvp_prefill_params, KVP_PREFILL_W_NEXT_UNIT> {
    struct Unit : Sm90Unit {
        PrefillItem it;
    };

    __device__ __forceinline__ Sm90PrefillSrc(const kvp_prefill_params& p_) : Sm90Src(p_, p_.window_left) {
        total = (int64_t)(*reinterpret_cast<const volatile int32_t*>(work)) * p.kv.num_kv_heads;
    }
    __device__ __forceinline__ Unit unit(int64_t w) const {
        Unit u;
        const int item = (int)(w / p.kv.num_kv_heads);
        u.kvh = (int)(w - (int64_t)item * p.kv.num_kv_heads);
        u.it = load_item(work, item);
        u.sp = item_span(u.it, group, window, KVP_PREFILL_SM90_TILE_Q);
        split_tiles<Sm90Cfg<T, D>::TN>(u.sp, u.it.split, p.num_splits, u.t0, u.t1);
        return u;
    }
    __device__ __forceinline__ PagedRows rows(const Unit& u) const { return paged_rows(p.kv, u.it.b, u.kvh); }
    // Element offset in q of the unit's token tok (head 0).
    __device__ __forceinline__ int64_t q_row(const Unit& u, int tok) const {
        return ((int64_t)u.it.q_start + tok) * p.q_token_stride;
    }
    // Dims 8j + col, 8j + col + 1 of row (tok, qh) for every j: o[4j + 2h],
    // o[4j + 2h + 1], unnormalised; st the row's state (l reduced).
    __device__ __forceinline__ void store(const Unit& u, int tok, int qh, int col, const float (&o)[D / 2], int h,
                                          const SoftmaxState& st, bool lse_lane) const {
        const PrefillOut<T> po(p, u.it.split, p.total_q, D);
        const int64_t row = (int64_t)u.it.q_start + tok;
        write_state(st, po.sink(qh)).template to<T, false, D / 8, 2, 8>(po.out + row * po.tok_stride + (int64_t)qh * po.head_stride + col,
                                           po.lse != nullptr && lse_lane ? po.lse + row * p.num_q_heads + qh : nullptr,
                                           [&](int j, int e) { return o[4 * j + 2 * h + e]; });
    }
};

// The mainloop over src's units; P is the params struct (the cache, the
// table and the shapes).
// Shared-memory accesses by address, for the e4m3 producer's widening pass.
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t a, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t a) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ void st_shared_u32(uint32_t a, uint32_t v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(v) : "memory");
}

// Sixteen e4m3 values (byte i of x is element i) times sc as sixteen T
// values: elements 0-7 in lo, 8-15 in hi (element 2i in the low half of a
// word). Exact to e4m3 (one rounding, of the product, to T).
template <typename T>
__device__ __forceinline__ void widen_e4m3x16(uint4 x, float sc, uint4& lo, uint4& hi) {
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
    uint32_t o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t a, b;
        e4m3x4_f16(w[i], a, b);
        const float2 fa = f16x2_to_float2(a), fb = f16x2_to_float2(b);
        o[2 * i] = pack2<T>(fa.x * sc, fa.y * sc);
        o[2 * i + 1] = pack2<T>(fb.x * sc, fb.y * sc);
    }
    lo = make_uint4(o[0], o[1], o[2], o[3]);
    hi = make_uint4(o[4], o[5], o[6], o[7]);
}

__device__ __forceinline__ void st_shared_v2(uint32_t a, uint2 v) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(a), "r"(v.x), "r"(v.y) : "memory");
}
// The two T values of a word as floats (element 0 in the low half).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t w);
template <>
__device__ __forceinline__ float2 unpack2<f16>(uint32_t w) {
    return f16x2_to_float2(w);
}
template <>
__device__ __forceinline__ float2 unpack2<bf16>(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
// 1 / x to 1 ulp (one MUFU; ftz): for x >= 2^-14 here.
__device__ __forceinline__ float rcp_approx(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
// d += a * b on f16 pairs.
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t d) {
    asm("fma.rn.f16x2 %0, %1, %2, %0;" : "+r"(d) : "r"(a), "r"(b));
    return d;
}

// A 4 x 4 byte transpose: out[e] holds byte e of x0, x1, x2, x3 (in bytes
// 0..3).
__device__ __forceinline__ void transpose4x4(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3, uint32_t (&out)[4]) {
    const uint32_t a0 = __byte_perm(x0, x1, 0x5140), a1 = __byte_perm(x0, x1, 0x7362);  // x0/x1 bytes 0,1 | 2,3 interleaved
    const uint32_t b0 = __byte_perm(x2, x3, 0x5140), b1 = __byte_perm(x2, x3, 0x7362);
    out[0] = __byte_perm(a0, b0, 0x5410);
    out[1] = __byte_perm(a0, b0, 0x7632);
    out[2] = __byte_perm(a1, b1, 0x5410);
    out[3] = __byte_perm(a1, b1, 0x7632);
}

// E4M3: the cache is e4m3 with its scales (Sm90Cfg's raw ring); T stays
// the query's and the consumers' type. F8: the cache is e4m3 and both
// products run on e4m3 (Sm90Cfg's F8 section): the producer quantises the
// query rows (one scale a row, from its largest magnitude), copies K tiles
// as they are, and transposes V tiles; the consumers multiply the scores by
// the K scales in fp32, and fold the V scales into P before it is
// quantised (P_ij * sv_j / max_j sv_j * 256, the tile's factor applied when
// its product is added to O). Each tile's P V^T runs into a fresh
// accumulator that is added to O in fp32 (two-level accumulation: the 8-bit
// wgmma's accumulation keeps fewer bits than fp32, which over a long
// context loses a lone strong token). The row sums l add the quantised P
// (divided back by its factor), so a row's weights still sum to one.
template <typename T, int D, class Src, class P, bool E4M3 = false, bool F8 = false>
__device__ __forceinline__ void sm90_attention(const P& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = Sm90Cfg<T, D, E4M3, F8>;
    using TT = typename Pick<F8, e4m3, T>::type;  // the type the products read
    constexpr int TN = C::TN, TQ = C::TQ, S = C::STAGES;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    uint8_t* const sm = smem_raw + (base - smem_u32(smem_raw));
    const uint32_t q_s = base;
    auto k_s = [&](int s) { return base + C::Q_BYTES + (uint32_t)(2 * s) * C::KV_BYTES; };
    auto v_s = [&](int s) { return base + C::Q_BYTES + (uint32_t)(2 * s + 1) * C::KV_BYTES; };
    int64_t* const offs = reinterpret_cast<int64_t*>(sm + C::Q_BYTES + 2 * S * C::KV_BYTES);  // [S][TN]
    const uint32_t bars = base + C::Q_BYTES + 2 * S * C::KV_BYTES + C::OFF_BYTES;
    // K and V of a stage fill and drain separately: K is free once S = Q K^T
    // is done, V only after O += P V, which runs one tile later.
    auto full_k = [&](int s) { return bars + 8u * s; };
    auto full_v = [&](int s) { return bars + 8u * (S + s); };
    auto empty_k = [&](int s) { return bars + 8u * (2 * S + s); };
    auto empty_v = [&](int s) { return bars + 8u * (3 * S + s); };
    const uint32_t q_full = bars + 8u * (4 * S), q_empty = bars + 8u * (4 * S + 1);
    int32_t* const flags = reinterpret_cast<int32_t*>(sm + C::Q_BYTES + 2 * S * C::KV_BYTES + C::OFF_BYTES +
                                                      8 * (4 * S + 2));  // [S]: the tile has unreadable tokens
    // The unit handed to the consumers with its query rows (-1: no more), and
    // the producer's own next unit, double-buffered for its 128 threads.
    // Shared-window addresses (32-bit) keep the producer within its registers.
    const uint32_t unit_slot = bars + C::SLOT_OFF, next_slot = unit_slot + 8;  // next_slot: [2]
    // The e4m3 ring (Sm90Cfg): raw tiles, then each slot's scales, readable
    // mask and {stage, phase, is V, any unreadable}, then the stages' masks.
    const uint32_t ext = bars + C::BAR_BYTES;
    auto raw_s = [&](int i) { return ext + (uint32_t)(i * C::RAW_BYTES); };
    auto raw_meta = [&](int i) { return ext + (uint32_t)(C::RAW * C::RAW_BYTES + i * C::RAW_META); };
    auto stage_mask = [&](int s) { return ext + (uint32_t)(C::RAW * (C::RAW_BYTES + C::RAW_META) + s * C::STAGE_MASK); };
    // F8's scales and raw V tiles (Sm90Cfg).
    auto k_sc = [&](int s) { return ext + (uint32_t)(C::F8_KSC + 4 * TN * s); };
    auto v_sc = [&](int s) { return ext + (uint32_t)(C::F8_VSC + 4 * TN * s); };
    const uint32_t q_sc = ext + (uint32_t)C::F8_QSC;
    auto raw_v = [&](int i) { return ext + (uint32_t)(C::F8_RAW_OFF + i * TN * D); };
    // The consumers read the scales as plain shared memory, which the
    // compiler may batch ahead of their uses (the barriers' asm orders them).
    const float* const f8_scales =
        reinterpret_cast<const float*>(sm + C::Q_BYTES + 2 * S * C::KV_BYTES + C::OFF_BYTES + C::BAR_BYTES);
    auto k_scales = [&](int s) { return reinterpret_cast<const float2*>(f8_scales + C::F8_KSC / 4 + TN * s); };
    auto v_factors = [&](int s) { return reinterpret_cast<const float2*>(f8_scales + C::F8_VW / 4 + TN * s); };
    auto v_recips = [&](int s) { return reinterpret_cast<const uint32_t*>(f8_scales + C::F8_VR / 4) + TN / 2 * s; };
    auto v_tile_factor = [&](int s) { return f8_scales[C::F8_FV / 4 + s]; };

    const int tid = threadIdx.x;
    // The warpgroup index through a shuffle from lane 0: the compiler then
    // knows it is warp-uniform, and the consumers' wgmma paths are not
    // divergent code (where ptxas serialises wgmma, C7520).
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (tid == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(full_k(s), 128);  // every producer thread, when its copies land
            mbar_init(full_v(s), 128);
            mbar_init(empty_k(s), 256);  // every consumer thread (lane 0 may arrive for its warp)
            mbar_init(empty_v(s), 8);
        }
        mbar_init(q_full, 129);  // the producer threads' query-row copies and thread 0's slot write (hand_over)
        mbar_init(q_empty, 8);
        fence_mbarrier_init();
    }
    __syncthreads();
    griddep_wait();  // the plan kernel (or the previous layer) may still be running under PDL

    const Src src(p);
    const int64_t total = src.total;
    const int group = src.group;

    if (wg == 0) {
        // ---------------- producer ----------------
        // Never waits for its own copies: each thread's cp.async arrive on the
        // stage's barrier when they land, so it runs ahead as far as the free
        // stages allow.
        setmaxnreg_dec<C::PRODUCER_REGS>();
        const T* kc = reinterpret_cast<const T*>(p.kv.k_cache);
        const T* vc = reinterpret_cast<const T*>(p.kv.v_cache);
        const T* qg = reinterpret_cast<const T*>(p.q);
        int tile_it = 0, item_it = 0;
        // The tile's 16-byte chunks from the cache at src into the K or V
        // tile at dst, through the stage's row byte offsets (unreadable rows,
        // only where the tile has any: zeros). Thread tid copies chunk
        // tid % CPR of rows tid / CPR + RPP * k: its column, swizzle phase and
        // source column are fixed, so each copy costs an offset load and an
        // add (the loop once cost some 50 instructions a copy, and the
        // producer's instructions were most of the kernel's).
        constexpr int RPP = 128 / C::CPR;  // rows per pass
        static_assert(128 % C::CPR == 0 && TN % RPP == 0 && RPP % 4 == 0, "gather passes");
        const int g_col = tid % C::CPR, g_row = tid / C::CPR;
        // Row g_row + RPP * k: its swizzle phase (row % 8) is g_row's, or with
        // RPP = 4 (g_row < 4) g_row's plus 4 on odd passes, so chunk
        // (g_col % 8) ^ phase is one of two values fixed per thread.
        const uint32_t g_dst0 = (uint32_t)(g_col >> 3) * (TN * 128) + (uint32_t)g_row * 128;
        const uint32_t g_sw0 = (uint32_t)((g_col & 7) ^ (g_row & 7)) << 4, g_sw4 = g_sw0 ^ 64u;
        auto g_dst = [&](int k) {  // k: a compile-time pass index
            return g_dst0 + (uint32_t)(RPP * k * 128) + (((RPP * k) & 7) ? g_sw4 : g_sw0);
        };
        // at(k): where pass k's chunk goes (a compile-time k).
        auto gather_to = [&](auto at, const T* src, int s, bool any_bad) {
            const char* from = reinterpret_cast<const char*>(src) + g_col * 16;
            const int64_t* off = offs + s * TN + g_row;
            if (!any_bad) {
                // Offsets in batches of four ahead of their copies: each
                // cp.async is an asm with a memory clobber, which keeps the
                // compiler from hoisting the next load over it, and a load
                // then an add then a copy in turn waits out the shared-memory
                // latency once per copy.
                constexpr int B = 4;
                static_assert((TN / RPP) % B == 0, "offset batches");
#pragma unroll 2
                for (int k = 0; k < TN / RPP; k += B) {
                    int64_t o[B];
#pragma unroll
                    for (int i = 0; i < B; ++i) o[i] = off[RPP * (k + i)];
#pragma unroll
                    for (int i = 0; i < B; ++i) cp_async16_full(at(k + i), from + o[i]);
                }
            } else {
#pragma unroll 4
                for (int k = 0; k < TN / RPP; ++k) {
                    const int64_t o = off[RPP * k];
                    cp_async16_keep(at(k), from + (o < 0 ? 0 : o), o < 0 ? 0 : 16);
                }
            }
        };
        auto gather = [&](uint32_t dst, const T* src, int s, bool any_bad) {
            gather_to([&](int k) { return dst + g_dst(k); }, src, s, any_bad);
        };
        // Thread 0 takes unit n + 1 once unit n's copies are issued (its
        // consumers still have a tile or two to run, which hide the atomic;
        // taken at the unit's start, a block would hold a second unit for
        // the whole of its first, and the last units wait on busy blocks);
        // the others learn it through next_slot[(n + 1) % 2].
        auto take = [&](int n) {
            if (tid == 0) st_shared_s64(next_slot + 8 * (n & 1), Sm90Sched::take(src.sched));
        };
        take(0);
        // Hands unit w (or -1, the end) to the consumers: thread 0's arrive
        // on q_full publishes the slot, and every thread's cp.async arrive
        // the query rows; with no rows to copy (rows false), thread 0
        // arrives for all 129 at once.
        auto hand_over = [&](int64_t w, bool rows) {
            mbar_wait(q_empty, (item_it & 1) ^ 1);
            if (tid == 0) {
                st_shared_s64(unit_slot, w);
                mbar_arrive_n(q_full, rows ? 1u : 129u);
            }
        };
        // Tile t of a unit, for each producer loop: its stage, the phase of
        // the stage's empty barriers, its first token, and the block-table
        // lookahead: thread tid < TN's block and offset of token k0 + tid
        // (looked up a tile earlier), and tile t + 1's, issued now.
        struct TileAt {
            int s, ph, blk, boff, k0;
        };
        auto tile_at = [&](int t, int t1, const PrefillSpan& sp, const PagedRows& rr, int kb, int& nxt_blk,
                           int& nxt_off) {
            const TileAt x{tile_it % S, ((tile_it / S) & 1) ^ 1, nxt_blk, nxt_off, t * TN};
            nxt_blk = -1;
            if (tid < TN && t + 1 < t1 && x.k0 + TN + tid < sp.kv_end && x.k0 + TN + tid >= kb)
                nxt_blk = rr.load_block(x.k0 + TN + tid, nxt_off);
            return x;
        };
        // Tile x's row byte offsets into its stage (-1: an unreadable token)
        // and, over an e4m3 cache, thread tid < TN's scale index (-1:
        // unreadable); returns whether thread tid's token is unreadable.
        auto tile_offsets = [&](const TileAt& x, const PrefillSpan& sp, const PagedRows& rr, int kb, int64_t& si) {
            constexpr int64_t EB = E4M3 || F8 ? 1 : (int64_t)sizeof(T);  // bytes a cache element
            int bad = 0;
            if (tid < TN) {
                const int64_t off = x.k0 + tid < sp.kv_end && x.k0 + tid >= kb ? rr.offset(x.blk, x.boff) * EB : -1;
                offs[x.s * TN + tid] = off;
                if constexpr (E4M3 || F8) si = off >= 0 ? rr.scale_index(x.blk, x.boff) : -1;
                bad = off < 0;
            }
            return bad;
        };
        // ---- over an e4m3 cache: raw tiles through the ring, widened into the stages ----
        // A unit's halves go K_t0, then K_t and V_{t-1} for each later t,
        // then V_{t1-1}: the 16-bit path's order. Each is issued raw (its
        // rows' bytes and scales, cp.async) as soon as its offsets are
        // known, which waits for no consumer, and widened into its stage
        // L = RAW - 1 halves later, once the stage is free; the unit's last
        // halves are widened at its end (a half of the next unit cannot go
        // first: the consumers finish a unit only with all of its tiles).
        // raw_it and fin_it count the halves issued and widened.
        constexpr int L = E4M3 ? C::RAW - 1 : 1;
        constexpr int RING = E4M3 ? C::RAW : 1;
        constexpr int CPR8 = D / 16, RPP8 = 128 / CPR8, NP8 = TN / RPP8;  // raw chunks a row, rows a pass, passes
        static_assert(!E4M3 || (128 % CPR8 == 0 && NP8 % 4 == 0 && RPP8 % 8 == 0), "raw passes");
        // A raw tile is PL planes of 64-byte half rows (plane h: bytes
        // 64 h .. 64 h + 63 of every row). Thread tid takes 16-byte chunk
        // c8 = tid % 4 + 4 h of rows r8 + RPP8 k, h = (tid / 8) % PL, r8 =
        // 2 (tid / (8 PL)) + (tid / 4) % 2: a quarter warp reads two rows'
        // halves of one plane, 128 contiguous bytes, and stores 16-bit chunks
        // 2 c8 + {0, 1} of one column block of two rows, whose swizzle
        // phases differ in their low bit: eight different bank groups.
        constexpr int PL = CPR8 >= 4 ? CPR8 / 4 : 1, PLB = TN * 64;  // planes, bytes a plane
        int raw_it = 0, fin_it = 0;
        const int h8 = (tid >> 3) % PL;
        const int r8 = 2 * (tid / (8 * PL)) + ((tid >> 2) & 1), c8 = (tid & 3) + 4 * h8;
        const uint32_t raw_off = (uint32_t)(h8 * PLB + r8 * 64 + (tid & 3) * 16);  // chunk (r8, c8) in a slot
        // The raw half of tile stage s's rows (offsets in offs[s]) from the
        // cache at src, with scales at sbase[si] (thread tid < TN: its row's
        // scale index, -1 unreadable); a K half also records its readable
        // rows. Thread 0 records where the half goes.
        auto issue_raw = [&](bool v, int s, int ph, int any, int64_t si, bool valid) {
            const int slot = raw_it % RING;
            const uint32_t dst = raw_s(slot) + raw_off;  // row r8 + RPP8 k at dst + k RPP8 64
            const char* from = reinterpret_cast<const char*>(v ? p.kv.v_cache : p.kv.k_cache) + c8 * 16;
            const int64_t* off = offs + s * TN + r8;
            if (!any) {
                constexpr int B = 4;
#pragma unroll 2
                for (int k = 0; k < NP8; k += B) {
                    int64_t o[B];
#pragma unroll
                    for (int i = 0; i < B; ++i) o[i] = off[RPP8 * (k + i)];
#pragma unroll
                    for (int i = 0; i < B; ++i) cp_async16_full(dst + (uint32_t)((k + i) * RPP8 * 64), from + o[i]);
                }
            } else {
#pragma unroll 4
                for (int k = 0; k < NP8; ++k) {
                    const int64_t o = off[RPP8 * k];
                    cp_async16_keep(dst + (uint32_t)(k * RPP8 * 64), from + (o < 0 ? 0 : o), o < 0 ? 0 : 16);
                }
            }
            const uint32_t meta = raw_meta(slot);
            if (tid < TN) {
                const float* sb = reinterpret_cast<const float*>(v ? p.kv.v_scale : p.kv.k_scale);
                cp_async4(meta + 4u * (uint32_t)tid, sb + (si >= 0 ? si : 0), si >= 0 ? 4 : 0);
            }
            if (!v) {
                const uint32_t m = __ballot_sync(0xffffffffu, valid);
                if ((tid & 31) == 0 && tid < TN) st_shared_u32(meta + TN * 4 + (uint32_t)(tid >> 5) * 4u, m);
            }
            if (tid == 0) {
                st_shared_u32(meta + TN * 4 + 16, (uint32_t)s);
                st_shared_u32(meta + TN * 4 + 20, (uint32_t)ph);
                st_shared_u32(meta + TN * 4 + 24, v ? 1u : 0u);
                st_shared_u32(meta + TN * 4 + 28, (uint32_t)any);
            }
            cp_async_commit();
            ++raw_it;
        };
        // Widens the oldest issued half into its stage (its copies have
        // landed once at most N later groups are pending) and hands the stage
        // over. Thread tid converts the raw chunks it copied: chunk c8 of
        // rows r8 + RPP8 k becomes 16-bit chunks 2 c8 and 2 c8 + 1 of the
        // swizzled tile.
        auto widen = [&](auto n_pending) {
            cp_async_wait<decltype(n_pending)::value>();
            producer_sync();  // every thread's copies of the half (and its scales, mask, record) have landed
            const int slot = fin_it % RING;
            ++fin_it;
            const uint32_t meta = raw_meta(slot);
            const int s = (int)ld_shared_u32(meta + TN * 4 + 16), ph = (int)ld_shared_u32(meta + TN * 4 + 20);
            const bool v = ld_shared_u32(meta + TN * 4 + 24) != 0;
            mbar_wait(v ? empty_v(s) : empty_k(s), ph);
            if (!v) {
                if (tid < TN / 32) st_shared_u32(stage_mask(s) + 4u * (uint32_t)tid, ld_shared_u32(meta + TN * 4 + 4u * (uint32_t)tid));
                if (tid == 0) flags[s] = (int)ld_shared_u32(meta + TN * 4 + 28);
            }
            const int j0 = 2 * c8;
            const uint32_t dst0 = (v ? v_s(s) : k_s(s)) + (uint32_t)(j0 >> 3) * (TN * 128) + (uint32_t)r8 * 128u +
                                  ((uint32_t)((j0 & 7) ^ (r8 & 7)) << 4);
            const uint32_t src0 = raw_s(slot) + raw_off;
            // Four chunks' loads before their conversions: the accesses are
            // volatile asm, kept in this order, and a load's latency would
            // otherwise stall every chunk (ncu: the conversions' waits on
            // their loads were most of the producer's stalls).
            constexpr int G = 4;
            static_assert(NP8 % G == 0, "chunk groups");
#pragma unroll 1
            for (int k0 = 0; k0 < NP8; k0 += G) {
                uint4 x[G];
                float sc[G];
#pragma unroll
                for (int i = 0; i < G; ++i) {
                    x[i] = ld_shared_v4(src0 + (uint32_t)((k0 + i) * RPP8 * 64));
                    sc[i] = __uint_as_float(ld_shared_u32(meta + 4u * (uint32_t)(r8 + RPP8 * (k0 + i))));
                }
#pragma unroll
                for (int i = 0; i < G; ++i) {
                    uint4 lo, hi;
                    widen_e4m3x16<T>(x[i], sc[i], lo, hi);
                    const uint32_t d = dst0 + (uint32_t)((k0 + i) * RPP8 * 128);
                    st_shared_v4(d, lo);
                    st_shared_v4(d ^ 16u, hi);
                }
            }
            fence_proxy_async();  // the stores, before wgmma reads them
            mbar_arrive(v ? full_v(s) : full_k(s));
            producer_sync();  // the slot is read: the next issue may rewrite it
        };
        auto produce_e4m3 = [&](const PrefillSpan& sp, const PagedRows& rr, int kb, int t0, int t1, int nxt_blk,
                                int nxt_off) {
            int64_t si = -1, si_prev = -1;  // thread tid < TN: its token's scale index in tiles t and t - 1
            int s_prev = 0, ph_prev = 0, any_prev = 0, pending = 0;
            for (int t = t0; t < t1; ++t, ++tile_it) {
                const TileAt x = tile_at(t, t1, sp, rr, kb, nxt_blk, nxt_off);
                const int s = x.s, ph = x.ph;
                // V_{t-2}'s raw copies read this stage's offsets: every
                // producer thread is past them (the unit loop's barrier, for
                // its first tile).
                if (t > t0) producer_sync();
                si_prev = si;
                const int bad = tile_offsets(x, sp, rr, kb, si);
                const int any = producer_sync_or(bad);
                issue_raw(false, s, ph, any, si, tid < TN && !bad);
                if (++pending > L) widen(Int<L>{}), --pending;
                if (t > t0) {
                    issue_raw(true, s_prev, ph_prev, any_prev, si_prev, false);
                    if (++pending > L) widen(Int<L>{}), --pending;
                }
                s_prev = s, ph_prev = ph, any_prev = any;
            }
            issue_raw(true, s_prev, ph_prev, any_prev, si, false);  // the unit's last V
            for (++pending; pending > 0; --pending) widen(Int<0>{});
        };
        // ---- F8: K tiles as they are, V tiles through the raw ring, transposed ----
        // Tile t's K (with its K and V scales) goes straight to its stage,
        // its V raw to ring slot (t - t0) % 2 in the same group; V_{t-1} is
        // transposed into its stage once its group has landed, after tile
        // t's copies are issued, so the copies of one tile are in flight
        // while the previous one is transposed.
        auto transpose_v = [&](uint32_t slot, int s, int ph) {
            producer_sync();  // every thread's raw copies of the tile have landed
            mbar_wait(empty_v(s), ph);
            // Lane (g, q) = (lane % 8, lane / 8) reads tokens 16 g + 2 q +
            // {0, 1, 8, 9} (four rows, 16 dims each) and writes word q of
            // 16-byte chunk g in each of the 16 dims' rows: the order in
            // which the P fragment of the 8-bit wgmma holds those tokens
            // (the S accumulator's columns 2q, 2q + 1, 2q + 8, 2q + 9 of a
            // 16-column group, as bytes 0-3 of one A register). The raw
            // rows' swizzle (chunk c of row r at c ^ (r / 16)) puts the
            // eight lanes of a quarter warp's loads on different banks; the
            // stores of one dim's row fill all 32 banks.
            const int lane = tid & 31, warp = tid >> 5, g = lane & 7, q = lane >> 3;
            const uint32_t dst = v_s(s);
            // P's V factors, a thread a token: the tile's largest V scale
            // (scales are positive or 0, so their bits order as they do),
            // through the warps' maxima; the transposition's loads and
            // stores run between the two halves.
            const float sv = __uint_as_float(ld_shared_u32(v_sc(s) + 4u * (uint32_t)tid));
            const uint32_t wmax = __reduce_max_sync(0xffffffffu, __float_as_uint(sv));
            if (lane == 0) st_shared_u32(ext + (uint32_t)(C::F8_WM + 4 * warp), wmax);
#pragma unroll
            for (int u = 0; u < D / 64; ++u) {
                const int c = warp + 4 * u;  // the 16 dims 16 c .. 16 c + 15
                uint4 xv[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int tok = 16 * g + 2 * q + (i & 1) + 8 * (i >> 1);
                    xv[i] = ld_shared_v4(slot + (uint32_t)(tok * 128) + ((uint32_t)(c ^ g) << 4));
                }
                const uint32_t w0[4] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w}, w1[4] = {xv[1].x, xv[1].y, xv[1].z, xv[1].w};
                const uint32_t w2[4] = {xv[2].x, xv[2].y, xv[2].z, xv[2].w}, w3[4] = {xv[3].x, xv[3].y, xv[3].z, xv[3].w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    uint32_t o[4];
                    transpose4x4(w0[j], w1[j], w2[j], w3[j], o);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int d = 16 * c + 4 * j + e;
                        st_shared_u32(dst + (uint32_t)(d * 128) + ((uint32_t)(g ^ (d & 7)) << 4) + 4u * (uint32_t)q, o[e]);
                    }
                }
            }
            producer_sync();  // the warps' maxima
            float mv = 0.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) mv = fmaxf(mv, __uint_as_float(ld_shared_u32(ext + (uint32_t)(C::F8_WM + 4 * i))));
            // w = sv * 256 / mv and 1 / w, at most 2^14 (f16 holds it):
            // where w is below 2^-14, P w rounds to 0 in e4m3 (its least
            // value is 2^-9), so the reciprocal multiplies only zeros.
            const float w = mv > 0.f ? sv * (256.f / mv) : 0.f;
            st_shared_u32(ext + (uint32_t)(C::F8_VW + 4 * (TN * s + tid)), __float_as_uint(w));
            const uint32_t r2 = pack2<f16>(rcp_approx(fmaxf(w, 1.f / 16384.f)), 0.f);
            asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(ext + (uint32_t)(C::F8_VR + 2 * (TN * s + tid))), "h"((uint16_t)r2)
                         : "memory");
            if (tid == 0) st_shared_u32(ext + (uint32_t)(C::F8_FV + 4 * s), __float_as_uint(mv * (1.f / 256.f)));
            fence_proxy_async();  // the stores, before wgmma reads them
            mbar_arrive(full_v(s));
        };
        auto produce_f8 = [&](const PrefillSpan& sp, const PagedRows& rr, int kb, int t0, int t1, int nxt_blk,
                              int nxt_off) {
            const float* ksb = reinterpret_cast<const float*>(p.kv.k_scale);
            const float* vsb = reinterpret_cast<const float*>(p.kv.v_scale);
            int s_prev = 0, ph_prev = 0;
            for (int t = t0; t < t1; ++t, ++tile_it) {
                const TileAt x = tile_at(t, t1, sp, rr, kb, nxt_blk, nxt_off);
                const int s = x.s, ph = x.ph;
                mbar_wait(empty_k(s), ph);  // the consumers are done with the stage's K, scales, offsets, flag
                // The previous tile's gathers read their own stage's
                // offsets, and its transpose the other raw slot: every
                // thread is past them before this tile's are written.
                if (t > t0) producer_sync();
                int64_t si = -1;
                const int any = producer_sync_or(tile_offsets(x, sp, rr, kb, si));
                if (tid == 0) flags[s] = any;
                gather(k_s(s), kc, s, any);
                if (tid < TN) {
                    const int64_t i = si >= 0 ? si : 0;
                    cp_async4(k_sc(s) + 4u * (uint32_t)tid, ksb + i, si >= 0 ? 4 : 0);
                    cp_async4(v_sc(s) + 4u * (uint32_t)tid, vsb + i, si >= 0 ? 4 : 0);
                }
                mbar_arrive_cp_async(full_k(s));
                // Raw row r, chunk c at slot + 128 r + ((c ^ (r / 16)) << 4):
                // pass k's rows are g_row + 16 k (g_row < 16).
                static_assert(!F8 || RPP == 16, "raw V passes");
                const uint32_t slot = raw_v((t - t0) & 1) + (uint32_t)(g_row * 128);
                gather_to([&](int k) { return slot + (uint32_t)(RPP * k * 128) + ((uint32_t)(g_col ^ (k & 7)) << 4); }, vc,
                          s, any);
                cp_async_commit();
                if (t > t0) {
                    cp_async_wait<1>();
                    transpose_v(raw_v((t - 1 - t0) & 1), s_prev, ph_prev);
                }
                s_prev = s, ph_prev = ph;
            }
            cp_async_wait<0>();
            transpose_v(raw_v((t1 - 1 - t0) & 1), s_prev, ph_prev);
        };
        for (int n = 0;; ++n) {
            producer_sync();  // unit n is in its slot
            const int64_t w = ld_shared_s64(next_slot + 8 * (n & 1));
            if (w >= total) break;
            // Every thread reads slot n % 2 before thread 0 writes it again
            // (take(n + 2), after the next bar.sync).
            const typename Src::Unit x = src.unit(w);
            const PrefillSpan& sp = x.sp;
            const int kvh = x.kvh, t0 = x.t0, t1 = x.t1;
            hand_over(w, t0 < t1);
            ++item_it;
            if (t0 >= t1) {  // no K/V to read (an empty split run): the consumers write its empty state
                take(n + 1);
                continue;
            }
            const PagedRows rr = src.rows(x);
            // Query rows: packed row r -> token (r0 + r) / group, head (r0 + r) % group.
            auto q_ptr = [&](int r, int c) {  // chunk c (16 bytes) of packed row r, or null past the item's rows
                const int pr = sp.r0 + r;
                const int tok = pr / group;
                return r < sp.nrows ? qg + src.q_row(x, tok) + (int64_t)(kvh * group + pr - tok * group) * p.q_head_stride +
                                          c * (16 / (int)sizeof(T))
                                    : nullptr;
            };
            if constexpr (F8) {
                // Quantised to e4m3 on the way in: the 16 threads of a
                // half warp hold one row's 16 chunks (8 values each), share
                // its largest magnitude, and store 8 bytes each; the row's
                // scale goes to q_sc. Four rows' loads are in flight at once.
                constexpr int QC = D * (int)sizeof(T) / 16;
                static_assert(QC == 16 && TQ * QC % (4 * 128) == 0, "a half warp a query row");
#pragma unroll 1
                for (int i0 = 0; i0 < TQ * QC; i0 += 4 * 128) {
                    uint4 xv[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        const int i = i0 + u * 128 + tid;
                        const T* qp = q_ptr(i / QC, i % QC);
                        xv[u] = qp != nullptr ? *reinterpret_cast<const uint4*>(qp) : make_uint4(0u, 0u, 0u, 0u);
                    }
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        const int i = i0 + u * 128 + tid, r = i / QC, c = i % QC;
                        float f[8];
                        const uint32_t w[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w};
                        float amax = 0.f;
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float2 v = unpack2<T>(w[e]);
                            f[2 * e] = v.x, f[2 * e + 1] = v.y;
                            amax = fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y)));
                        }
#pragma unroll
                        for (int m = 1; m < QC; m <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
                        const float sc = e4m3_row_scale(amax), inv = 1.f / sc;
                        uint32_t b[4];
#pragma unroll
                        for (int e = 0; e < 4; ++e) b[e] = pack_e4m3x2(f[2 * e] * inv, f[2 * e + 1] * inv);
                        st_shared_v2(q_s + swz(r, c >> 1) + (uint32_t)(c & 1) * 8u, make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16)));
                        if (c == 0) st_shared_u32(q_sc + 4u * (uint32_t)r, __float_as_uint(sc));
                    }
                }
                fence_proxy_async();  // the stores, before wgmma reads them
                mbar_arrive(q_full);
            } else {
                for (int i = tid; i < TQ * C::CPR; i += 128) {
                    const int r = i / C::CPR, c = i - r * C::CPR;
                    const T* qp = q_ptr(r, c);
                    cp_async16_keep(q_s + (uint32_t)(c >> 3) * (TQ * 128) + swz(r, c & 7), qp != nullptr ? qp : qg,
                                    qp != nullptr ? 16 : 0);
                }
                mbar_arrive_cp_async(q_full);
            }
            // Thread tid < TN looks up token k0 + tid of a tile in the block
            // table one tile ahead: the load's latency hides behind the
            // current tile's copies and the wait for a free stage.
            int nxt_blk = -1, nxt_off = 0;
            const int kb = sp.kv_begin;  // tokens before it (a tile's start) are unreadable too
            if (tid < TN && t0 * TN + tid < sp.kv_end && t0 * TN + tid >= kb)
                nxt_blk = rr.load_block(t0 * TN + tid, nxt_off);
            // K runs one tile ahead of V: K_t, V_{t-1}, K_{t+1}, V_t, ... V_t's
            // stage frees only when P_{t-2} V_{t-2} is done, and K_{t+1}
            // queued behind it arrived late (in ncu, the consumers' waits for
            // K and the producer's for a free V slot were the pipeline's
            // largest stalls). A tile's offsets stay in its stage until the
            // K two tiles on writes it, so V_{t-1}'s gather still reads them.
            if constexpr (E4M3) {
                produce_e4m3(sp, rr, kb, t0, t1, nxt_blk, nxt_off);
            } else if constexpr (F8) {
                produce_f8(sp, rr, kb, t0, t1, nxt_blk, nxt_off);
            } else {
            struct VStage {
                int s, ph, any;  // stage, its phase, whether it has unreadable tokens
            } prev{0, 0, 0};
            auto gather_v = [&](const VStage& v) {
                mbar_wait(empty_v(v.s), v.ph);
                gather(v_s(v.s), vc, v.s, v.any);
                mbar_arrive_cp_async(full_v(v.s));
            };
            for (int t = t0; t < t1; ++t, ++tile_it) {
                const TileAt x = tile_at(t, t1, sp, rr, kb, nxt_blk, nxt_off);
                const int s = x.s, ph = x.ph;
                mbar_wait(empty_k(s), ph);  // the consumers are done with the stage's K, offsets, flag
                // The last iteration's V gather read this stage's offsets
                // (tile t - 2's): every producer thread is past it before
                // any writes tile t's. (The unit loop's barrier does this
                // for a unit's first tile.)
                if (t > t0) producer_sync();
                // Every producer thread sees the tile's offsets after this
                // barrier; thread 0 records whether any token is unreadable.
                int64_t no_scales;
                const int any = producer_sync_or(tile_offsets(x, sp, rr, kb, no_scales));
                if (tid == 0) flags[s] = any;
                gather(k_s(s), kc, s, any);
                mbar_arrive_cp_async(full_k(s));
                if (t > t0) gather_v(prev);
                prev = VStage{s, ph, any};
            }
            gather_v(prev);  // the unit's last V
            }
            take(n + 1);
        }
        hand_over(-1, false);
        if (tid == 0) Sm90Sched::finish(src.sched);
    } else {
        // ---------------- consumers ----------------
        // Per tile t: S_t = Q K_t^T and O += P_{t-1} V_{t-1} are issued
        // together, so the softmax of S_t overlaps the second product; and
        // the two consumer warpgroups take turns issuing (named barriers 2
        // and 3), so one's softmax overlaps the other's products.
        setmaxnreg_inc<C::CONSUMER_REGS>();
        const int c = wg - 1;  // which 64 rows of the item
        const int warp = (tid >> 5) & 3, lane = tid & 31;
        const int row_a = 64 * c + 16 * warp + (lane >> 2);  // this thread's rows: row_a, row_a + 8
        const int col_q = 2 * (lane & 3);
        const float sl = p.scale * kLog2e;
        const uint64_t dq = gmma_desc(q_s + (uint32_t)(64 * c * 128), 16, 1024);  // this warpgroup's Q rows
        // V: [token][dim] 16-bit tiles are read MN-major; F8's transposed
        // [dim][token] tiles K-major.
        const uint64_t dk0 = gmma_desc(k_s(0), 16, 1024), dv0 = F8 ? gmma_desc(v_s(0), 16, 1024) : gmma_desc(v_s(0), TN * 128, 1024);
        if (c == 1) turn_pass(1);  // the first turn is warpgroup 1's
        int tile_it = 0, item_it = 0;
        for (;; ++item_it) {
            // The producer's next unit, with its query rows when it has K/V.
            mbar_wait(q_full, item_it & 1);
            // Lane 0 reads the slot, and its arrive on q_empty (after the
            // unit's last read of Q) is the warp's: the producer writes the
            // slot again only after it.
            int64_t w = 0;
            if (lane == 0) w = ld_shared_s64(unit_slot);
            w = __shfl_sync(0xffffffffu, w, 0);
            if (w < 0) break;
            const typename Src::Unit x = src.unit(w);
            const PrefillSpan& sp = x.sp;
            const int kvh = x.kvh, t0 = x.t0, t1 = x.t1;
            const int wg_rows = min(64, sp.nrows - 64 * c);  // may be <= 0
            const int wg_min_pos = sp.delta + (sp.r0 + 64 * c) / group;
            const int wg_max_pos = sp.delta + (sp.r0 + 64 * c + max(wg_rows, 1) - 1) / group;
            const int pos_a = sp.delta + (sp.r0 + row_a) / group, pos_b = sp.delta + (sp.r0 + row_a + 8) / group;
            const int win = src.window;

            float o[D / 2];
#pragma unroll
            for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
            SoftmaxState st_a, st_b;  // rows row_a and row_a + 8; l: this thread's columns
            st_a.init();
            st_b.init();
            constexpr int PK = F8 ? 32 : 16;  // tokens a k step of P V
            uint32_t pa[TN / PK][4];  // P of the previous tile, the A operand of its P V
            // F8: the previous tile's P V^T (its own accumulator) and the
            // factor that scales it into O (max_j sv_j / 256).
            [[maybe_unused]] float ot[F8 ? D / 2 : 1];
            [[maybe_unused]] float fv_prev = 0.f;
            // O += P V over the V tile of stage sv (P from registers); F8:
            // ot = P V^T.
            auto issue_pv = [&](int sv) {
#pragma unroll
                for (int kk = 0; kk < TN / PK; ++kk) {
                    if constexpr (F8) {
                        const uint64_t db = desc_at(dv0, (uint32_t)(2 * sv * C::KV_BYTES + kk * 32));
                        wgmma_rs<e4m3, D>(ot, pa[kk], db, kk > 0);
                    } else {
                        const uint64_t db = desc_at(dv0, (uint32_t)(2 * sv * C::KV_BYTES + kk * 16 * 128));
                        wgmma_rs<T, D>(o, pa[kk], db, 1);
                    }
                }
            };
            // F8: O += ot times its factor, in fp32.
            auto add_pv = [&]() {
                if constexpr (F8) {
#pragma unroll
                    for (int i = 0; i < D / 2; ++i) o[i] = fmaf(ot[i], fv_prev, o[i]);
                }
            };
            int sv_prev = 0;  // the stage of the previous tile's V
            // F8: the scores' factor of this thread's two rows (the softmax
            // scale times the query row's e4m3 scale).
            float sl_a = sl, sl_b = sl;
            if (t0 < t1) {
                fence_proxy_async();
                if constexpr (F8) {
                    sl_a = sl * __uint_as_float(ld_shared_u32(q_sc + 4u * (uint32_t)row_a));
                    sl_b = sl * __uint_as_float(ld_shared_u32(q_sc + 4u * (uint32_t)(row_a + 8)));
                }
            } else {
                if (lane == 0) mbar_arrive(q_empty);  // the slot is read; there are no query rows
            }
            // One tile: S_t = Q K_t^T, issued with O += P_{t-1} V_{t-1} after
            // the first tile (PV, a compile-time flag: the first tile is its
            // own instance, so no wgmma sits under a run-time branch, where
            // ptxas closes the group with a dummy wgmma that stalls). A tile
            // this warpgroup's rows do not see still runs its products, with
            // P = 0 (its V is read next step like any other).
            auto step = [&](int t, auto pv_flag) {
                constexpr bool PV = decltype(pv_flag)::value;
                const int s = tile_it % S;
                const int ph = (tile_it / S) & 1;
                const int k0 = t * TN;
                const bool active = wg_rows > 0 && k0 <= wg_max_pos && (win < 0 || k0 + TN - 1 >= wg_min_pos - win);
                mbar_wait(full_k(s), ph);
                if constexpr (PV) mbar_wait(full_v(sv_prev), ((tile_it - 1) / S) & 1);
                fence_proxy_async();
                float sc[TN / 2];
                turn_wait(c);  // this warpgroup's turn on the tensor cores
                pin_regs(sc);
                pin_regs(o);
                if constexpr (F8) pin_regs(ot);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < C::KSTEPS; ++kk) {
                    constexpr uint32_t KB = 32;  // bytes of one k step
                    const uint32_t kb = kk * KB / 128, ki = kk * KB % 128;
                    const uint64_t da = desc_at(dq, kb * (TQ * 128) + ki);
                    const uint64_t db = desc_at(dk0, (uint32_t)(2 * s * C::KV_BYTES) + kb * (TN * 128) + ki);
                    wgmma_ss<TT, TN>(sc, da, db, kk > 0);
                }
                wgmma_commit();
                if constexpr (PV) {
                    issue_pv(sv_prev);
                    wgmma_commit();
                }
                turn_pass(c);
                wgmma_wait<PV ? 1 : 0>();  // S_t is done; P_{t-1} V_{t-1} may still run
                pin_regs(sc);
                float al_a = 1.f, al_b = 1.f, mu_a = 0.f, mu_b = 0.f;
                if constexpr (F8) {
                    if (active) {  // the K scales of this thread's columns
#pragma unroll
                        for (int j = 0; j < TN / 8; ++j) {
                            const float2 ks = k_scales(s)[(8 * j + col_q) / 2];
                            sc[4 * j] *= ks.x, sc[4 * j + 1] *= ks.y;
                            sc[4 * j + 2] *= ks.x, sc[4 * j + 3] *= ks.y;
                        }
                    }
                }
                const bool unreadable = active && flags[s] != 0;  // the tile has unreadable tokens
                if (active) {
                    if (unreadable || k0 + TN - 1 > wg_min_pos || (win >= 0 && k0 < wg_max_pos - win)) {
                        // Row a sees column col_q + 8j + e of the tile when
                        // lo_a <= 8j + e <= hi_a (causal and window; col_q is
                        // folded into both bounds): compares and selects, no
                        // branch per element.
                        const int hi_a = pos_a - k0 - col_q, hi_b = pos_b - k0 - col_q;
                        const int lo_a = win >= 0 ? hi_a - win : -TN, lo_b = win >= 0 ? hi_b - win : -TN;
#pragma unroll
                        for (int j = 0; j < TN / 8; ++j) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int kl = 8 * j + (e & 1);
                                const int hi = e < 2 ? hi_a : hi_b, lo = e < 2 ? lo_a : lo_b;
                                sc[4 * j + e] = kl > hi || kl < lo ? neg_inf() : sc[4 * j + e];
                            }
                        }
                        if (unreadable) {  // tokens outside the sequence or the readable range
                            [[maybe_unused]] const int64_t* off = offs + s * TN + col_q;
                            [[maybe_unused]] uint32_t mk[TN / 32];  // e4m3: the stage's readable rows
                            if constexpr (E4M3) {
#pragma unroll
                                for (int i = 0; i < TN / 32; ++i) mk[i] = ld_shared_u32(stage_mask(s) + 4u * i);
                            }
#pragma unroll
                            for (int j = 0; j < TN / 8; ++j) {
                                bool bad0, bad1;
                                if constexpr (E4M3) {
                                    const int c0 = col_q + 8 * j;  // even: c0 + 1 is in the same word
                                    bad0 = !((mk[c0 >> 5] >> (c0 & 31)) & 1u);
                                    bad1 = !((mk[c0 >> 5] >> ((c0 + 1) & 31)) & 1u);
                                } else {
                                    bad0 = off[8 * j] < 0, bad1 = off[8 * j + 1] < 0;
                                }
                                sc[4 * j] = bad0 ? neg_inf() : sc[4 * j];
                                sc[4 * j + 2] = bad0 ? neg_inf() : sc[4 * j + 2];
                                sc[4 * j + 1] = bad1 ? neg_inf() : sc[4 * j + 1];
                                sc[4 * j + 3] = bad1 ? neg_inf() : sc[4 * j + 3];
                            }
                        }
                    }
                }
                // K_t, its offsets and flag are no longer read. Where the
                // lanes read offsets, each releases them with its own
                // arrive; elsewhere lane 0 arrives for the warp after
                // __syncwarp. Both order the lanes' reads before the
                // producer's rewrite; compute-sanitizer's racecheck follows
                // only the first, and the offsets of an unreadable tile are
                // rewritten soonest (a causal tail's first tile).
                if (unreadable) {
                    mbar_arrive(empty_k(s));
                    __syncwarp();
                } else {
                    __syncwarp();
                    if (lane == 0) mbar_arrive_n(empty_k(s), 32);
                }
                if (lane == 0 && t == t1 - 1) mbar_arrive(q_empty);  // the item's last read of Q
                if (active) {
                    // Maxima of the unscaled scores: the scale is positive.
                    const float mx_a = tree_reduce<TN / 8>([&](int j) { return fmaxf(sc[4 * j], sc[4 * j + 1]); }, MaxOp{});
                    const float mx_b = tree_reduce<TN / 8>([&](int j) { return fmaxf(sc[4 * j + 2], sc[4 * j + 3]); }, MaxOp{});
                    al_a = st_a.rescale(quad_max(mx_a) * sl_a, mu_a);
                    al_b = st_b.rescale(quad_max(mx_b) * sl_b, mu_b);
#pragma unroll
                    for (int j = 0; j < TN / 8; ++j) {
                        sc[4 * j] = fast_exp2(fmaf(sc[4 * j], sl_a, -mu_a));
                        sc[4 * j + 1] = fast_exp2(fmaf(sc[4 * j + 1], sl_a, -mu_a));
                        sc[4 * j + 2] = fast_exp2(fmaf(sc[4 * j + 2], sl_b, -mu_b));
                        sc[4 * j + 3] = fast_exp2(fmaf(sc[4 * j + 3], sl_b, -mu_b));
                    }
                    if constexpr (!F8) {
                        st_a.accumulate(al_a, tree_reduce<TN / 8>([&](int j) { return sc[4 * j] + sc[4 * j + 1]; }, AddOp{}));
                        st_b.accumulate(al_b, tree_reduce<TN / 8>([&](int j) { return sc[4 * j + 2] + sc[4 * j + 3]; }, AddOp{}));
                    }
                }
                if constexpr (PV) {
                    wgmma_wait<0>();  // P_{t-1} V_{t-1} is done: O and pa may change, V_{t-1} is free
                    pin_regs(o);
                    if constexpr (F8) pin_regs(ot);
                    __syncwarp();
                    if (lane == 0) mbar_arrive(empty_v(sv_prev));
                    add_pv();
                }
                // F8 skips the rescale where no row of the warp has a new
                // maximum (most tiles after a row's first few): its
                // consumers issue more per element than the 16-bit ones.
                if (active && (!F8 || __any_sync(0xffffffffu, al_a != 1.f || al_b != 1.f))) {
#pragma unroll
                    for (int j = 0; j < D / 8; ++j) {
                        o[4 * j] *= al_a, o[4 * j + 1] *= al_a;
                        o[4 * j + 2] *= al_b, o[4 * j + 3] *= al_b;
                    }
                }
                if (active) {
                    if constexpr (F8) {
                        // P_ij w_j as e4m3, in the A fragment's token order
                        // (transpose_v, which also wrote the factors w_j =
                        // sv_j * 256 / max sv and their reciprocals: V_t's
                        // stage is waited for here, one step early); the
                        // row sums add each quantised value times 1 / w_j,
                        // in f16 pairs a k step and fp32 across them.
                        mbar_wait(full_v(s), (tile_it / S) & 1);
                        float la = 0.f, lb = 0.f;
#pragma unroll
                        for (int kk = 0; kk < TN / 32; ++kk) {
                            uint32_t ha = 0u, hb = 0u;  // f16 pairs
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const int j0 = 4 * kk + 2 * h;
                                const float2 v0 = v_factors(s)[(8 * j0 + col_q) / 2];
                                const float2 v1 = v_factors(s)[(8 * j0 + 8 + col_q) / 2];
                                const float w00 = v0.x, w01 = v0.y, w10 = v1.x, w11 = v1.y;
                                const uint32_t qa = pack_e4m3x2(sc[4 * j0] * w00, sc[4 * j0 + 1] * w01) |
                                                    (pack_e4m3x2(sc[4 * j0 + 4] * w10, sc[4 * j0 + 5] * w11) << 16);
                                const uint32_t qb = pack_e4m3x2(sc[4 * j0 + 2] * w00, sc[4 * j0 + 3] * w01) |
                                                    (pack_e4m3x2(sc[4 * j0 + 6] * w10, sc[4 * j0 + 7] * w11) << 16);
                                pa[kk][2 * h] = qa;
                                pa[kk][2 * h + 1] = qb;
                                const uint32_t r0 = v_recips(s)[(8 * j0 + col_q) / 2];
                                const uint32_t r1 = v_recips(s)[(8 * j0 + 8 + col_q) / 2];
                                uint32_t lo, hi;
                                e4m3x4_f16(qa, lo, hi);
                                ha = hfma2(lo, r0, ha);
                                ha = hfma2(hi, r1, ha);
                                e4m3x4_f16(qb, lo, hi);
                                hb = hfma2(lo, r0, hb);
                                hb = hfma2(hi, r1, hb);
                            }
                            const float2 fa = f16x2_to_float2(ha), fb = f16x2_to_float2(hb);
                            la += fa.x + fa.y;
                            lb += fb.x + fb.y;
                        }
                        st_a.accumulate(al_a, la);
                        st_b.accumulate(al_b, lb);
                        fv_prev = v_tile_factor(s);
                    } else {
#pragma unroll
                        for (int j = 0; j < TN / 8; ++j) {
                            pa[j >> 1][(j & 1) * 2] = pack2<T>(sc[4 * j], sc[4 * j + 1]);
                            pa[j >> 1][(j & 1) * 2 + 1] = pack2<T>(sc[4 * j + 2], sc[4 * j + 3]);
                        }
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < TN / PK; ++j) pa[j][0] = pa[j][1] = pa[j][2] = pa[j][3] = 0u;
                }
                sv_prev = s;
                ++tile_it;
            };
            if (t0 < t1) {
                step(t0, Flag<false>{});
                for (int t = t0 + 1; t < t1; ++t) step(t, Flag<true>{});
                // The item's last P V.
                mbar_wait(full_v(sv_prev), ((tile_it - 1) / S) & 1);
                fence_proxy_async();
                pin_regs(o);
                if constexpr (F8) pin_regs(ot);
                wgmma_fence();
                issue_pv(sv_prev);
                wgmma_commit();
                wgmma_wait<0>();
                pin_regs(o);
                if constexpr (F8) pin_regs(ot);
                __syncwarp();
                if (lane == 0) mbar_arrive(empty_v(sv_prev));
                add_pv();
            }
            // Epilogue: normalise and write this thread's two rows.
            st_a.l = quad_sum(st_a.l);
            st_b.l = quad_sum(st_b.l);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = row_a + 8 * h;
                if (r >= sp.nrows) continue;
                const int pr = sp.r0 + r;
                const int tok = pr / group;
                src.store(x, tok, kvh * group + (pr - tok * group), col_q, o, h, h ? st_b : st_a, (lane & 3) == 0);
            }
        }
        if (c == 0) turn_wait(0);  // take the last turn warpgroup 1 handed over
    }
    griddep_launch_dependents();
#endif
}

template <typename T, int D>
__device__ __forceinline__ void paged_prefill_sm90(const kvp_prefill_params& p) {
    sm90_attention<T, D, Sm90PrefillSrc<T, D>>(p);
}

// The same over an e4m3 cache (T the query's and output's type).
template <typename T, int D>
__device__ __forceinline__ void paged_prefill_sm90_e4m3(const kvp_prefill_params& p) {
    sm90_attention<T, D, Sm90PrefillSrc<T, D>, kvp_prefill_params, true>(p);
}

// FP8 Q/K/V over an e4m3 cache (T the query's and output's type).
template <typename T, int D>
__device__ __forceinline__ void paged_prefill_sm90_fp8(const kvp_prefill_params& p) {
    sm90_attention<T, D, Sm90PrefillSrc<T, D>, kvp_prefill_params, false, true>(p);
}

}  // namespace kvp
