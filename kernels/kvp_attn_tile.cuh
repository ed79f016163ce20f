// One tile of packed query rows against a run of paged K/V tokens, on the
// tensor cores: the inner loop shared by the prefill kernel (kvp_prefill.cuh)
// and the shared-prefix kernel's items (kvp_cascade.cuh), so that both run
// the same code.
//
// FlashAttention-2 layout on mma.sync m16n8k16: 4 warps, each owning 16 * MT
// packed rows and all 64 tokens of a K/V tile; K/V tiles stream through a
// cp.async pipeline; the physical row offset of each token of a tile is
// resolved once per tile from the block table (so block size 1 costs what
// large blocks cost). Packed row r of the tile is (token, q head) =
// ((r0 + r) / group, (r0 + r) % group) of the caller's rows; a row at
// position pos sees tokens t <= pos (and t >= pos - window_left when
// window_left >= 0): causal for prefill and a sequence's own tail, and
// unmasked for a shared run (every member's queries come after it), which
// passes a position past every token. A warp skips the tiles its rows cannot
// see.
#pragma once

#include "kvp_common.cuh"

namespace kvp {

static_assert(KVP_PREFILL_TILE_KV == KVP_CASCADE_TILE_KV, "one K/V tile size for both kernels");

// Geometry of a tile of 4 warps x MT m16 row tiles at head_dim D, and the
// layout of its shared memory: query tile, K/V pipeline stages, token row
// offsets. E4M3: the stages hold raw e4m3 tiles (swz8) and their scales,
// the offsets a second ring of scale indices, and 16 bytes at the end the
// query's reduction (kvp_fp8.cuh).
template <int D, int MT_, bool E4M3 = false>
struct TileCfg {
    static constexpr int MT = MT_;
    static constexpr int TQ = 4 * 16 * MT;  // packed rows per tile
    static constexpr int TK = KVP_PREFILL_TILE_KV;
    static constexpr int STAGES = D <= 64 ? 3 : 2;
    static constexpr int RING = STAGES + 1;  // row-offset tiles kept (see loop)
    static constexpr int CPR = D / 8;        // 16-byte chunks per 16-bit row
    static constexpr int RAW_CPR = E4M3 ? D / 16 : CPR;
    static constexpr int Q_BYTES = TQ * D * 2;
    static constexpr int KV_TILE_BYTES = TK * RAW_CPR * 16;
    static constexpr int SCALE_BYTES = E4M3 ? TK * 4 : 0;
    static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES + 2 * SCALE_BYTES;
    static constexpr int OFF_BYTES = RING * TK * 8 * (E4M3 ? 2 : 1);
    static constexpr int RED_BYTES = E4M3 ? 16 : 0;
    static constexpr int SMEM = Q_BYTES + STAGES * STAGE_BYTES + OFF_BYTES + RED_BYTES;
};

// 16-byte async copy with the default L2 policy: K/V tiles are read again by
// the other row tiles of the same rows' sequence (or shared run), so they
// should stay in L2.
__device__ __forceinline__ void cp_async16_keep(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

// What one tile computes: packed rows [r0, r0 + nrows) of the caller's rows
// (row r -> token r / group, head kvh * group + r % group), token of row r
// at position delta + r / group, against tokens [kv_begin, kv_end) read in
// n_tiles tiles from kv_begin on.
struct TileJob {
    int r0, nrows, group, kvh;
    int delta;        // position of the caller's token 0 (large: no causal mask)
    int window_left;  // < 0: no window
    int kv_begin, kv_end, n_tiles;
    int64_t q_head_stride;
    float scale;
};

// Runs one tile. CAUSAL: rows see tokens up to their positions (and the
// window); false: every token of the range (a shared run), with no position
// state in registers, which the 128-row tiles of shared items have no room
// for. qrow(tok) is the element offset in q of token tok's row
// (head 0); emit(tok, qh, o, h, st) stores the row g + 8h of this thread
// (o: its m16 tile's accumulators, this thread's columns qd + 8c, qd + 8c + 1
// in o[c][2h], o[c][2h + 1]; st: the row's softmax state over the tile's
// tokens, l summed over the whole row, empty when it saw none). The shared
// memory is free again on return.
//
// KT: the cache's element type, T or uint8_t (e4m3: the mainloop runs on
// f16 fragments read straight from the raw tiles, K scales on the scores,
// V scales on the probabilities, as the decode tile does; a bf16 query is
// scaled by a power of two into f16 first).
template <typename T, int D, int MT, bool CAUSAL, typename KT = T, class QRow, class Emit>
__device__ __forceinline__ void attn_tile(const TileJob& jb, const PagedRows& rr, const T* q, const KT* kc, const KT* vc,
                                          QRow qrow, Emit emit, uint8_t* smem) {
    constexpr bool E4M3 = sizeof(KT) == 1;
    using MTY = typename Cond<E4M3, f16, T>::type;  // the mma's input type
    using C = TileCfg<D, MT, E4M3>;
    constexpr int TQ = C::TQ, TK = C::TK, STAGES = C::STAGES, RING = C::RING, CPR = C::CPR;
    constexpr int NT = 128;
    constexpr int WR = 16 * MT;                      // rows per warp
    constexpr int KV_CHUNKS = TK * C::RAW_CPR / NT;  // per tensor per stage per thread
    constexpr int Q_CHUNKS = TQ * CPR / NT;
    static_assert(KVP_PREFILL_THREADS == NT && KVP_CASCADE_THREADS == NT, "4 warps per tile");
    static_assert(TK * C::RAW_CPR % NT == 0 && TQ * CPR % NT == 0, "chunks divide evenly");
    static_assert(!E4M3 || NT == 2 * TK, "one scale per thread (gather_kv_scales)");

    uint8_t* s_q = smem;
    uint8_t* s_kv = smem + C::Q_BYTES;
    int64_t* s_off = reinterpret_cast<int64_t*>(s_kv + STAGES * C::STAGE_BYTES);
    int64_t* s_soff = s_off + RING * TK;  // e4m3: scale indices
    float* s_red = reinterpret_cast<float*>(s_kv + STAGES * C::STAGE_BYTES + C::OFF_BYTES);  // e4m3: [4]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int group = jb.group, wl = jb.window_left, kb = jb.kv_begin, ke = jb.kv_end, n_tiles = jb.n_tiles;

    // Table entries of the first STAGES + 1 tiles.
    int pblk[STAGES + 1], poff[STAGES + 1];
#pragma unroll
    for (int j = 0; j <= STAGES; ++j) {
        pblk[j] = -1;
        poff[j] = 0;
        if (tid < TK && j < n_tiles) pblk[j] = rr.load_block(kb + j * TK + tid, poff[j]);
    }
    // Query tile: packed rows past nrows are zero-filled.
    const uint32_t s_q_u32 = smem_u32(s_q);
#pragma unroll
    for (int k = 0; k < Q_CHUNKS; ++k) {
        const int i = tid + k * NT;
        const int r = i / CPR, c = i % CPR;
        const T* src = q;
        int bytes = 0;
        if (r < jb.nrows) {
            const int pr = jb.r0 + r;
            const int tok = pr / group;
            const int qh = jb.kvh * group + (pr - tok * group);
            src += qrow(tok) + (int64_t)qh * jb.q_head_stride + c * 8;
            bytes = 16;
        }
        cp_async16_keep(s_q_u32 + swz<CPR>(r, c), src, bytes);
    }
    // Bit (j % RING) of bad_tiles: tile j has an unreadable token (past the
    // range, or in an ignored block). Tiles without one skip the per-token
    // offset test in the mask.
    uint32_t bad_tiles = 0;
    int first_bad = 0;  // bit j: this thread's token of tile j is unreadable
    if (tid < TK) {
#pragma unroll
        for (int j = 0; j < STAGES; ++j) {
            const int tok = kb + j * TK + tid;
            const bool live = j < n_tiles && tok < ke;
            const int64_t o = live ? rr.offset(pblk[j], poff[j]) : -1;
            s_off[j * TK + tid] = o;
            if constexpr (E4M3) s_soff[j * TK + tid] = live ? rr.scale_index(pblk[j], poff[j]) : -1;
            first_bad |= (o < 0) << j;
        }
    }
    int cblk = pblk[STAGES], coff = poff[STAGES];
#pragma unroll
    for (int j = 0; j < STAGES; ++j)
        if (__syncthreads_or((first_bad >> j) & 1)) bad_tiles |= 1u << j;
    int last_bad = 0;  // this thread's token of the tile written last is unreadable

    const uint32_t s_kv_u32 = smem_u32(s_kv);
    GatherCursor<KT, C::RAW_CPR, NT, STAGES, C::STAGE_BYTES> kt(s_kv_u32, tid);
    auto issue = [&](int j) {  // j: the tiles in order, each once
        const uint32_t sk = s_kv_u32 + (j % STAGES) * C::STAGE_BYTES;
        gather_kv_tile<KT, C::RAW_CPR, KV_CHUNKS, NT, C::KV_TILE_BYTES>(
            sk, kt.cur, s_off + (j % RING) * TK, kc, vc, tid,
            [&](uint32_t dst, const KT* src, int n) {
                cp_async16_keep(dst, src, E4M3 ? (n < 0 ? 0 : 16) : n);  // n: a sign (e4m3) or the bytes
            });
        kt.next();
        if constexpr (E4M3) {
            const uint32_t ss = sk + 2 * C::KV_TILE_BYTES;
            gather_kv_scales<TK>(ss, ss + C::SCALE_BYTES, s_soff + (j % RING) * TK, rr, tid);
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
            pos[mt][h] = r < jb.nrows ? jb.delta + (jb.r0 + r) / group : -1;  // -1: padding row, sees nothing
        }
    }
    const bool warp_live = warp * WR < jb.nrows;
    const int wlast = min(warp * WR + WR - 1, jb.nrows - 1);
    const int wpos_max = CAUSAL ? jb.delta + (jb.r0 + wlast) / group : 0x7fffffff;    // last position of the warp's rows
    const int wpos_min = CAUSAL ? jb.delta + (jb.r0 + warp * WR) / group : 0x7fffffff;  // first

    // e4m3 under bf16: the query tile becomes f16 in place, scaled by 2^sh
    // so that its largest magnitude lies in [2^14, 2^15); the scores take
    // 2^-sh back. Each thread converts the chunks it copied.
    float q_unscale = 1.f;
    if constexpr (E4M3 && IsBF16<T>::value) {
        cp_async_wait<STAGES - 1>();  // the query tile's group
        float m = 0.f;
#pragma unroll
        for (int k = 0; k < Q_CHUNKS; ++k) {
            const int i = tid + k * NT;
            m = fmaxf(m, bf16x8_amax(*reinterpret_cast<const uint4*>(s_q + swz<CPR>(i / CPR, i % CPR))));
        }
        const float qmul = q_f16_scale(m, s_red, warp, lane, q_unscale);
#pragma unroll
        for (int k = 0; k < Q_CHUNKS; ++k) {
            const int i = tid + k * NT;
            uint4* p = reinterpret_cast<uint4*>(s_q + swz<CPR>(i / CPR, i % CPR));
            *p = bf16x8_to_f16(*p, qmul);
        }
    }
    const float sl = jb.scale * kLog2e * q_unscale;
    float vmax = 0.f;        // e4m3: the V scale o_acc is counted in
    SoftmaxState st[MT][2];  // rows g and g + 8 of each m16 tile; l: this thread's columns
    float o_acc[MT][CPR][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        st[mt][0].init();
        st[mt][1].init();
#pragma unroll
        for (int c = 0; c < CPR; ++c) o_acc[mt][c][0] = o_acc[mt][c][1] = o_acc[mt][c][2] = o_acc[mt][c][3] = 0.f;
    }

    const int qa_row = warp * WR + (lane & 7) + ((lane >> 3) & 1) * 8, qa_chk = lane >> 4;
    const int kb_row = (lane & 7) + ((lane >> 4) << 3), kb_chk = (lane >> 3) & 1;
    const int vb_row = (lane & 7) + ((lane >> 3) & 1) * 8, vb_chk = lane >> 4;

    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait<STAGES - 2>();
        const int bad_last = __syncthreads_or(last_bad);  // tile j - 1 + STAGES, written by the last iteration
        if (j > 0) {
            const uint32_t bit = 1u << ((j - 1 + STAGES) % RING);
            bad_tiles = bad_last ? bad_tiles | bit : bad_tiles & ~bit;
        }
        if (j + STAGES - 1 < n_tiles) issue(j + STAGES - 1);
        cp_async_commit();
        int nblk = -1, noff = 0;
        if (tid < TK && j + STAGES + 1 < n_tiles) nblk = rr.load_block(kb + (j + STAGES + 1) * TK + tid, noff);

        const int kv0 = kb + j * TK;
        const bool visible = CAUSAL ? warp_live && kv0 <= wpos_max && (wl < 0 || kv0 + TK - 1 >= wpos_min - wl) : warp_live;
        if (visible) {
            const uint32_t sk = s_kv_u32 + (j % STAGES) * C::STAGE_BYTES;
            const uint32_t sv = sk + C::KV_TILE_BYTES;
            // e4m3: the stage's K and V scales.
            const float* ksc = reinterpret_cast<const float*>(s_kv + (j % STAGES) * C::STAGE_BYTES + 2 * C::KV_TILE_BYTES);
            float s[MT][8][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
            if constexpr (E4M3) {
                // As the decode tile: token g's dims 4q..4q+3 of a 16-dim step
                // in one register of an ldmatrix of the raw tile; q read in
                // the same dim order.
#pragma unroll
                for (int kp = 0; kp < D / 32; ++kp) {
                    uint32_t kr[4][4];
#pragma unroll
                    for (int np = 0; np < 4; ++np) ldmatrix_x4(kr[np], sk + swz8<D>(np * 16 + vb_row, 2 * kp + vb_chk));
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int chunk = 4 * kp + 2 * h + (qd >> 2);
                        uint32_t a[MT][4];
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            const int ra = warp * WR + mt * 16 + g, rb = ra + 8;
                            const uint2 q0 = *reinterpret_cast<const uint2*>(s_q + swz<CPR>(ra, chunk) + (qd & 2) * 4);
                            const uint2 q1 = *reinterpret_cast<const uint2*>(s_q + swz<CPR>(rb, chunk) + (qd & 2) * 4);
                            a[mt][0] = q0.x, a[mt][1] = q1.x, a[mt][2] = q0.y, a[mt][3] = q1.y;
                        }
#pragma unroll
                        for (int np = 0; np < 4; ++np) {
                            uint32_t b0, b1, c0, c1;
                            e4m3x4_f16(kr[np][2 * h], b0, b1);
                            e4m3x4_f16(kr[np][2 * h + 1], c0, c1);
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt) {
                                mma16816<f16>(s[mt][2 * np], a[mt], b0, b1);
                                mma16816<f16>(s[mt][2 * np + 1], a[mt], c0, c1);
                            }
                        }
                    }
                }
                // The K scales, per token (column), into the raw scores.
#pragma unroll
                for (int n = 0; n < 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float f = ksc[n * 8 + qd + e];
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) s[mt][n][e] *= f, s[mt][n][e + 2] *= f;
                    }
                }
            }
#pragma unroll
            for (int kk = 0; kk < (E4M3 ? 0 : D / 16); ++kk) {
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
            // e4m3: V's per-token scales into P, relative to the tile's
            // largest (o_acc counts in units of vmax; a new one rescales it,
            // folded into each row's alpha below).
            float vr[8][2], ratio = 1.f;
#pragma unroll
            for (int n = 0; n < 8; ++n) vr[n][0] = vr[n][1] = 1.f;
            if constexpr (E4M3) {
                const float* vsc = ksc + TK;
                float m = warp_max(fmaxf(vsc[lane], vsc[lane + 32]));
                if (m == 0.f) m = vmax > 0.f ? vmax : 1.f;  // no readable token in the tile
                const float inv = 1.f / m;
                ratio = vmax * inv;
                vmax = m;
#pragma unroll
                for (int n = 0; n < 8; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) vr[n][e] = vsc[n * 8 + qd + e] * inv;
            }
            // Mask: causal (token <= the row's position), window, tokens past
            // the range or in ignored blocks (row offset -1).
            const int64_t* offs = s_off + (j % RING) * TK;
            const bool full = CAUSAL && kv0 + TK - 1 <= wpos_min && (wl < 0 || kv0 >= wpos_max - wl) && kv0 + TK <= ke;
            const bool readable = !((bad_tiles >> (j % RING)) & 1u);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int n = 0; n < 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = n * 8 + qd + e;
                        const int kv = kv0 + col;
                        // Past the range or in an ignored block: offset -1.
                        const bool tok_ok = readable || offs[col] >= 0;
                        bool ok0 = tok_ok, ok1 = tok_ok;
                        if (CAUSAL && !full) {
                            ok0 = ok0 && kv <= pos[mt][0] && (wl < 0 || kv >= pos[mt][0] - wl);
                            ok1 = ok1 && kv <= pos[mt][1] && (wl < 0 || kv >= pos[mt][1] - wl);
                        }
                        s[mt][n][e] = ok0 ? s[mt][n][e] : neg_inf();
                        s[mt][n][e + 2] = ok1 ? s[mt][n][e + 2] : neg_inf();
                    }
                }
                // Maxima of the unscaled scores (the scale is positive).
                const float mx0 = tree_reduce<8>([&](int n) { return fmaxf(s[mt][n][0], s[mt][n][1]); }, MaxOp{});
                const float mx1 = tree_reduce<8>([&](int n) { return fmaxf(s[mt][n][2], s[mt][n][3]); }, MaxOp{});
                float alpha[2], m_use[2];
                alpha[0] = st[mt][0].rescale(quad_max(mx0) * sl, m_use[0]);
                alpha[1] = st[mt][1].rescale(quad_max(mx1) * sl, m_use[1]);
#pragma unroll
                for (int n = 0; n < 8; ++n) {
                    s[mt][n][0] = fast_exp2(fmaf(s[mt][n][0], sl, -m_use[0]));
                    s[mt][n][1] = fast_exp2(fmaf(s[mt][n][1], sl, -m_use[0]));
                    s[mt][n][2] = fast_exp2(fmaf(s[mt][n][2], sl, -m_use[1]));
                    s[mt][n][3] = fast_exp2(fmaf(s[mt][n][3], sl, -m_use[1]));
                }
                st[mt][0].accumulate(alpha[0], tree_reduce<8>([&](int n) { return s[mt][n][0] + s[mt][n][1]; }, AddOp{}));
                st[mt][1].accumulate(alpha[1], tree_reduce<8>([&](int n) { return s[mt][n][2] + s[mt][n][3]; }, AddOp{}));
                const float oa0 = alpha[0] * ratio, oa1 = alpha[1] * ratio;  // ratio: 1 but for e4m3
#pragma unroll
                for (int c = 0; c < CPR; ++c) {
                    o_acc[mt][c][0] *= oa0;
                    o_acc[mt][c][1] *= oa0;
                    o_acc[mt][c][2] *= oa1;
                    o_acc[mt][c][3] *= oa1;
                }
            }
            // O += P V, 16 tokens per k-step; the C fragments of S are the A
            // fragments of P; each V fragment feeds every m16 tile.
#pragma unroll
            for (int kt = 0; kt < TK / 16; ++kt) {
                uint32_t pa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const int n0 = 2 * kt, n1 = 2 * kt + 1;
                    pa[mt][0] = pack2<MTY>(s[mt][n0][0] * vr[n0][0], s[mt][n0][1] * vr[n0][1]);
                    pa[mt][1] = pack2<MTY>(s[mt][n0][2] * vr[n0][0], s[mt][n0][3] * vr[n0][1]);
                    pa[mt][2] = pack2<MTY>(s[mt][n1][0] * vr[n1][0], s[mt][n1][1] * vr[n1][1]);
                    pa[mt][3] = pack2<MTY>(s[mt][n1][2] * vr[n1][0], s[mt][n1][3] * vr[n1][1]);
                }
                if constexpr (E4M3) {
                    // As the decode tile: the even and the odd dims of two
                    // 16-dim chunks per ldmatrix (o_acc's n-tiles c, c + 1).
#pragma unroll
                    for (int G = 0; G < D / 32; ++G) {
                        uint32_t v4[4];
                        ldmatrix_x4_trans(v4, sv + swz8<D>(kt * 16 + vb_row, 2 * G + vb_chk));
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            uint32_t e0, o0, e1, o1;
                            e4m3x4_f16(__byte_perm(v4[2 * h], 0, 0x3120), e0, o0);
                            e4m3x4_f16(__byte_perm(v4[2 * h + 1], 0, 0x3120), e1, o1);
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt) {
                                mma16816<f16>(o_acc[mt][4 * G + 2 * h], pa[mt], e0, e1);
                                mma16816<f16>(o_acc[mt][4 * G + 2 * h + 1], pa[mt], o0, o1);
                            }
                        }
                    }
                } else {
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
        }

        const int jt = j + STAGES;
        last_bad = 0;
        if (tid < TK && jt < n_tiles) {
            const int tok = kb + jt * TK + tid;
            const int64_t o = tok < ke ? rr.offset(cblk, coff) : -1;
            s_off[(jt % RING) * TK + tid] = o;
            if constexpr (E4M3) s_soff[(jt % RING) * TK + tid] = tok < ke ? rr.scale_index(cblk, coff) : -1;
            last_bad = o < 0;
        }
        cblk = nblk;
        coff = noff;
    }

    if constexpr (E4M3) {
        // Back to the 16-bit layout emit takes: this thread holds dims
        // 8c + 4q .. 4q + 3 of n-tiles c (even dims) and c + 1 (odd); emit
        // wants 8c + 2q, 2q + 1 and 8c + 8 + 2q, 2q + 1 (quad shuffles).
        const int q4 = qd >> 1, src0 = (lane & ~3) | (q4 >> 1), src1 = (lane & ~3) | (2 + (q4 >> 1)), odd = q4 & 1;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int c = 0; c < CPR; c += 2) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float* E = &o_acc[mt][c][2 * h];
                    float* O = &o_acc[mt][c + 1][2 * h];
                    const float e0 = vmax * E[0], e1 = vmax * E[1], o0 = vmax * O[0], o1 = vmax * O[1];
                    const float a0 = __shfl_sync(0xffffffffu, e0, src0), a1 = __shfl_sync(0xffffffffu, e1, src0);
                    const float b0 = __shfl_sync(0xffffffffu, o0, src0), b1 = __shfl_sync(0xffffffffu, o1, src0);
                    const float c0 = __shfl_sync(0xffffffffu, e0, src1), c1 = __shfl_sync(0xffffffffu, e1, src1);
                    const float d0 = __shfl_sync(0xffffffffu, o0, src1), d1 = __shfl_sync(0xffffffffu, o1, src1);
                    E[0] = odd ? a1 : a0;  // dim 8c + 2q: the source's r = 2 (q % 2)
                    E[1] = odd ? b1 : b0;  // 8c + 2q + 1
                    O[0] = odd ? c1 : c0;  // 8c + 8 + 2q
                    O[1] = odd ? d1 : d0;  // 8c + 8 + 2q + 1
                }
            }
        }
    }
    // Each warp holds whole rows: hand each live row to the caller.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const SoftmaxState row{st[mt][h].m, quad_sum(st[mt][h].l)};
            const int r = warp * WR + mt * 16 + g + h * 8;
            if (r >= jb.nrows) continue;
            const int pr = jb.r0 + r;
            const int tok = pr / group;
            emit(tok, jb.kvh * group + (pr - tok * group), o_acc[mt], h, row);
        }
    }
    // The next tile reuses the shared memory.
    cp_async_wait<0>();
    __syncthreads();
}

}  // namespace kvp
