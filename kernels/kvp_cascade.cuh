// Shared-prefix ("cascade") decode attention: two launches per layer over a
// plan that the host writes (core/cascade) into the device workspace.
//
// Work items (kvp_cascade_<dt>_h<D>): an item is a token range [kv_begin,
// kv_end) read through one sequence's block-table row (rep) for a tile of
// packed query rows of its members: a shared run's members (sequences
// order[m_begin .. m_begin + m_count), which hold the same blocks over the
// range) or one sequence's own tail. Rows are packed as (member, q head of
// the kv head's group), row r -> member r / group, head r % group, so the
// queries of every sequence sharing a run go through the tensor cores
// together and the run's K/V is read once for all of them. A tail item's
// end is clipped to seq_lens[rep] on the device, so steps that only grow
// lengths reuse the plan. Each item writes one partial state per row
// (normalised output, float32, and its log2-domain lse; -inf when it saw no
// token) at part_base + member.
//
// Merge (kvp_cascade_merge_<dt>_h<D>): one warp per (sequence, q head) walks
// the sequence's segments (first partial, count, stride) and merges its
// partial states by online softmax into out and lse. Empty states have
// weight 0; a sequence with only empty states gets out = 0, lse = -inf.
//
// Both kernels run fixed grids that stride over the counts in the plan's
// header, so a captured launch serves every later plan in the same
// workspace. The attention kernel's inner loop is the prefill kernel's
// (mma.sync m16n8k16, cp.async pipeline, per-token row offsets resolved once
// per tile), without a causal mask.
#pragma once

#include "kvp_common.cuh"

namespace kvp {

template <int D>
struct CascadeCfg {
    static constexpr int MT = D <= 128 ? 2 : 1;  // m16 row tiles per warp
    static constexpr int TQ = 4 * 16 * MT;       // packed rows per item
    static constexpr int TK = KVP_CASCADE_TILE_KV;
    static constexpr int STAGES = D <= 64 ? 3 : 2;
    static constexpr int RING = STAGES + 1;
    static constexpr int CPR = D / 8;
    static constexpr int Q_BYTES = TQ * D * 2;
    static constexpr int KV_TILE_BYTES = TK * D * 2;
    static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES;
    static constexpr int OFF_BYTES = RING * TK * 8;
    static constexpr int SMEM = Q_BYTES + STAGES * STAGE_BYTES + OFF_BYTES;
};

// 16-byte async copy, default L2 policy: a shared run's tiles are read by
// each row tile of its members, so they should stay in L2.
__device__ __forceinline__ void cas_cp16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

template <int CPR>
__device__ __forceinline__ uint32_t cas_swz(int r, int c) {
    return (uint32_t)(r * CPR + (c ^ (r & 7))) * 16u;
}

struct CascadeItem {
    int rep, kv_begin, kv_end, dynamic, m_begin, m_count, tile, part_base;
};

// Block-table lookups of the rep's row for one kv head.
struct CascadeRows {
    const int32_t* table;
    int block_size, shift, max_blocks, num_blocks;
    int64_t block_stride, token_stride, head_off;

    __device__ __forceinline__ void init(const kvp_cascade_params& p, int b, int kvh) {
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

template <typename T, int D>
__device__ __forceinline__ void cascade_item(const kvp_cascade_params& p, const CascadeItem& it, int kvh,
                                             uint8_t* smem) {
    using C = CascadeCfg<D>;
    constexpr int MT = C::MT, TQ = C::TQ, TK = C::TK, STAGES = C::STAGES, RING = C::RING, CPR = C::CPR;
    constexpr int NT = KVP_CASCADE_THREADS;
    constexpr int WR = 16 * MT;
    constexpr int KV_CHUNKS = TK * CPR / NT;
    constexpr int Q_CHUNKS = TQ * CPR / NT;
    static_assert(TK * CPR % NT == 0 && TQ * CPR % NT == 0, "chunks divide evenly");

    uint8_t* s_q = smem;
    uint8_t* s_kv = smem + C::Q_BYTES;
    int64_t* s_off = reinterpret_cast<int64_t*>(s_kv + STAGES * C::STAGE_BYTES);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int group = p.num_q_heads / p.num_kv_heads;
    const int32_t* work = reinterpret_cast<const int32_t*>(p.work);
    const int32_t* order = work + p.order_off;
    const int r0 = it.tile * TQ;
    const int nrows = max(0, min(TQ, it.m_count * group - r0));
    const int kb = max(it.kv_begin, 0);
    int ke = it.kv_end;
    if (it.dynamic) ke = min(ke, __ldg(reinterpret_cast<const int32_t*>(p.seq_lens) + it.rep));
    const int n_tiles = ke > kb ? (ke - kb + TK - 1) / TK : 0;

    CascadeRows rr;
    rr.init(p, it.rep, kvh);
    const T* kc = reinterpret_cast<const T*>(p.k_cache);
    const T* vc = reinterpret_cast<const T*>(p.v_cache);

    int pblk[STAGES + 1], poff[STAGES + 1];
#pragma unroll
    for (int j = 0; j <= STAGES; ++j) {
        pblk[j] = -1;
        poff[j] = 0;
        if (tid < TK && j < n_tiles) pblk[j] = rr.load_block(kb + j * TK + tid, poff[j]);
    }
    // Query tile: each packed row is one member's q head; rows past nrows
    // are zero-filled.
    const uint32_t s_q_u32 = smem_u32(s_q);
#pragma unroll
    for (int k = 0; k < Q_CHUNKS; ++k) {
        const int i = tid + k * NT;
        const int r = i / CPR, c = i % CPR;
        const T* src = reinterpret_cast<const T*>(p.q);
        int bytes = 0;
        if (r < nrows) {
            const int pr = r0 + r;
            const int j = pr / group;
            const int qh = kvh * group + (pr - j * group);
            const int seq = __ldg(order + it.m_begin + j);
            src += (int64_t)seq * p.q_batch_stride + (int64_t)qh * p.q_head_stride + c * 8;
            bytes = 16;
        }
        cas_cp16(s_q_u32 + cas_swz<CPR>(r, c), src, bytes);
    }
    if (tid < TK) {
#pragma unroll
        for (int j = 0; j < STAGES; ++j) {
            const int tok = kb + j * TK + tid;
            s_off[j * TK + tid] = (j < n_tiles && tok < ke) ? rr.offset(pblk[j], poff[j]) : -1;
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
            cas_cp16(sk + cas_swz<CPR>(r, col), kc + src, bytes);
            cas_cp16(sv + cas_swz<CPR>(r, col), vc + src, bytes);
        }
    };
    cp_async_commit();  // the query tile
#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) {
        if (j < n_tiles) issue(j);
        cp_async_commit();
    }

    const int g = lane >> 2, qd = (lane & 3) * 2;
    const bool warp_live = warp * WR < nrows;
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
        if (tid < TK && j + STAGES + 1 < n_tiles) nblk = rr.load_block(kb + (j + STAGES + 1) * TK + tid, noff);

        if (warp_live) {
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
                    ldmatrix_x4(a[mt], s_q_u32 + cas_swz<CPR>(qa_row + mt * 16, kk * 2 + qa_chk));
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    uint32_t bk[4];
                    ldmatrix_x4(bk, sk + cas_swz<CPR>(np * 16 + kb_row, kk * 2 + kb_chk));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<T>(s[mt][2 * np], a[mt], bk[0], bk[1]);
                        mma16816<T>(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
                    }
                }
            }
            // Mask: tokens past the range or in ignored blocks (offset -1).
            const int64_t* offs = s_off + (j % RING) * TK;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
                for (int n = 0; n < 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const bool ok = offs[n * 8 + qd + e] >= 0;
                        s[mt][n][e] = ok ? s[mt][n][e] * sl : neg_inf();
                        s[mt][n][e + 2] = ok ? s[mt][n][e + 2] * sl : neg_inf();
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
                    m_use[r] = mn == neg_inf() ? 0.f : mn;  // nothing seen yet: keep exp2 finite
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
                    ldmatrix_x4_trans(bv, sv + cas_swz<CPR>(kt * 16 + vb_row, c + vb_chk));
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
            const int tok = kb + jt * TK + tid;
            s_off[(jt % RING) * TK + tid] = tok < ke ? rr.offset(cblk, coff) : -1;
        }
        cblk = nblk;
        coff = noff;
    }

    // Partial states: normalised output and log2 lse of each live row.
    float* part_out = reinterpret_cast<float*>(p.part_out);
    float* part_lse = reinterpret_cast<float*>(p.part_lse);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_run[mt][h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int r = warp * WR + mt * 16 + g + h * 8;
            if (r >= nrows) continue;
            const int pr = r0 + r;
            const int j = pr / group;
            const int qh = kvh * group + (pr - j * group);
            const bool empty = !(l > 0.f);
            const float inv = empty ? 0.f : 1.f / l;
            const int64_t pi = (int64_t)(it.part_base + j) * p.num_q_heads + qh;
            float* dst = part_out + pi * D + qd;
#pragma unroll
            for (int c = 0; c < CPR; ++c)
                *reinterpret_cast<float2*>(dst + c * 8) = make_float2(o_acc[mt][c][2 * h] * inv, o_acc[mt][c][2 * h + 1] * inv);
            if ((lane & 3) == 0) part_lse[pi] = empty ? neg_inf() : m_run[mt][h] + log2f(l);
        }
    }
    cp_async_wait<0>();
    __syncthreads();
}

template <typename T, int D>
__device__ __forceinline__ void cascade_attn(const kvp_cascade_params& p) {
    extern __shared__ __align__(128) uint8_t smem[];
    griddep_wait();  // the plan's copy or the previous layer may still be running under PDL
    const int32_t* work = reinterpret_cast<const int32_t*>(p.work);
    const int n_items = *reinterpret_cast<const volatile int32_t*>(work + KVP_CASCADE_H_ITEMS);
    const int32_t* items = work + p.items_off;
    const int64_t total = (int64_t)n_items * p.num_kv_heads;
    for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
        const int i = (int)(w / p.num_kv_heads);
        const int kvh = (int)(w - (int64_t)i * p.num_kv_heads);
        const int4* ip = reinterpret_cast<const int4*>(items + (int64_t)i * KVP_CASCADE_ITEM_INTS);
        const int4 a = ip[0], b = ip[1];
        const CascadeItem it{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        cascade_item<T, D>(p, it, kvh, smem);
    }
    griddep_launch_dependents();
}

// One warp per (sequence, q head): online-softmax merge of its partial
// states, in the log2 domain.
template <typename T, int D>
__device__ __forceinline__ void cascade_merge(const kvp_cascade_params& p) {
    constexpr int E = D / 32;
    griddep_wait();
    const int32_t* work = reinterpret_cast<const int32_t*>(p.work);
    const int batch = min(*reinterpret_cast<const volatile int32_t*>(work + KVP_CASCADE_H_BATCH), p.max_batch);
    const int32_t* seg_start = work + p.seg_start_off;
    const int32_t* segs = work + p.segs_off;
    const float* part_out = reinterpret_cast<const float*>(p.part_out);
    const float* part_lse = reinterpret_cast<const float*>(p.part_lse);
    const int lane = threadIdx.x & 31;
    const int64_t rows = (int64_t)batch * p.num_q_heads;
    const int64_t warps = (int64_t)gridDim.x * (KVP_CASCADE_MERGE_THREADS / 32);
    for (int64_t w = (int64_t)blockIdx.x * (KVP_CASCADE_MERGE_THREADS / 32) + (threadIdx.x >> 5); w < rows; w += warps) {
        const int b = (int)(w / p.num_q_heads);
        const int h = (int)(w - (int64_t)b * p.num_q_heads);
        float m = neg_inf(), l = 0.f, acc[E];
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = 0.f;
        const int k1 = seg_start[b + 1];
        for (int k = seg_start[b]; k < k1; ++k) {
            const int4 sg = *reinterpret_cast<const int4*>(segs + (int64_t)k * KVP_CASCADE_SEG_INTS);
            for (int c = 0; c < sg.y; ++c) {
                const int64_t pi = (int64_t)(sg.x + c * sg.z) * p.num_q_heads + h;
                const float s = __ldcg(part_lse + pi);
                if (s == neg_inf()) continue;  // empty state: weight 0
                float v[E];
                load_cg<E>(part_out + pi * D + lane * E, v);
                const float mn = fmaxf(m, s);
                const float a = exp2f(m - mn), wgt = exp2f(s - mn);
                l = l * a + wgt;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[e] = acc[e] * a + wgt * v[e];
                m = mn;
            }
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] *= inv;
        store_f<T, E>(reinterpret_cast<T*>(p.out) + (int64_t)b * p.out_batch_stride + (int64_t)h * p.out_head_stride +
                          lane * E,
                      acc);
        if (p.lse != 0 && lane == 0)
            reinterpret_cast<float*>(p.lse)[(int64_t)b * p.num_q_heads + h] = l > 0.f ? (m + log2f(l)) * kLn2 : neg_inf();
    }
    griddep_launch_dependents();
}

}  // namespace kvp
