// Shared device helpers: vector loads/stores with conversion, PTX wrappers
// (cp.async, ldmatrix, mma.sync), the softmax state with its merge and its
// epilogue, the paged-cache row reader, and the small kernels (KV write,
// split combine, merge of states).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "kvplug_kernels.h"

namespace kvp {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---- 16-bit storage types -------------------------------------------------
// Plain bit containers converted with PTX, so the build needs no cuda_fp16.h /
// cuda_bf16.h (whose CCCL dependency the PyPI nvcc wheels lack).
struct f16 {
    uint16_t bits;
};
struct bf16 {
    uint16_t bits;
};
// An e4m3 byte (kvp_fp8.cuh has its conversions): the tag of the 8-bit wgmma.
struct e4m3 {
    uint8_t bits;
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_f(bf16 x) { return __uint_as_float((uint32_t)x.bits << 16); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ f16 from_f<f16>(float x) {
    f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) {
    bf16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}

// N elements of T moved as one (or two) aligned vector accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Pack {
    T x[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_f(const T* src, float (&v)[N]) {
    Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(src);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = to_f(pk.x[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_f(T* dst, const float (&v)[N]) {
    Pack<T, N> pk;
#pragma unroll
    for (int i = 0; i < N; ++i) pk.x[i] = from_f<T>(v[i]);
    *reinterpret_cast<Pack<T, N>*>(dst) = pk;
}

// ---- PTX wrappers ----------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global->shared; src_bytes == 0 writes zeros, reads nothing.
// `policy` is an L2 cache policy (l2_evict_first): K/V are streamed once per
// launch and should not push the block tables, sequence lengths and queries,
// which every layer's launch reads again, out of L2.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes, uint64_t policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
                 "l"(src), "r"(src_bytes), "l"(policy)
                 : "memory");
}
// The same where the zero-fill is a predicate (PTX ignore-src): where sign
// is negative it writes 16 zero bytes and reads nothing. Cheaper to set up
// than a src-size, which the copy turns into a predicate itself.
__device__ __forceinline__ void cp_async16_or_zero(uint32_t dst, const void* src, int sign, uint64_t policy) {
    asm volatile(
        "{\n .reg .pred z;\n setp.lt.s32 z, %2, 0;\n"
        " cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, z, %3;\n}\n" ::"r"(dst),
        "l"(src), "r"(sign), "l"(policy)
        : "memory");
}
__device__ __forceinline__ uint64_t l2_evict_first() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// D(16x8,f32) += A(16x16) * B(16x8), A row-major, B column-major.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<bf16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<f16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
// Two floats -> one register of two 16-bit values, `lo` in the low half.
template <> __device__ __forceinline__ uint32_t pack2<bf16>(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ uint32_t pack2<f16>(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

}  // namespace kvp

#include "kvp_fp8.cuh"

namespace kvp {

// Programmatic dependent launch (sm_90): with the launch attribute
// PROGRAMMATIC_STREAM_SERIALIZATION a kernel may start while the previous one
// in the stream finishes; griddep_wait() blocks until that one's memory is
// visible. Without the attribute (plain cuLaunchKernel) both are no-ops.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// ---- online softmax ----------------------------------------------------------
// The running state of one query row, shared by every attention kernel and
// merge. Log2 domain: scores enter scaled by scale * log2(e); m is the running
// maximum and l the running sum of exp2(score - m). In the tensor-core kernels
// a thread holds the sum over its own columns only; quad_sum reduces l over
// the row's four threads before the ending. An empty state (no visible token)
// has m = -inf, l = 0 and ends as output 0, lse -inf.
//
// Two operations change a state: rescale/accumulate, the mainloops' online
// softmax over a tile of raw scores (the tile's exp2 terms are the caller's,
// computed against the offset rescale returns), and merge, the one combine
// of partial states (another warp's, split's or item's (m, l), or a
// normalised partial output with log2 lse s as {s, 1}) that every split
// combine, merge kernel and cross-warp reduction goes through. A state ends
// through write_state below.
struct SoftmaxState {
    float m, l;

    __device__ __forceinline__ void init() {
        m = neg_inf();
        l = 0.f;
    }
    // Moves the maximum to cover a tile whose row maximum is tile_max. Returns
    // the factor that rescales the output accumulated so far (pass it to
    // accumulate too), and sets offset, what the tile's scores subtract before
    // exp2: 0 while the whole row has been masked, so that exp2 stays finite.
    __device__ __forceinline__ float rescale(float tile_max, float& offset) {
        const float mn = fmaxf(m, tile_max);
        offset = mn == neg_inf() ? 0.f : mn;
        const float alpha = exp2f(m - offset);
        m = mn;
        return alpha;
    }
    // Adds a tile's sum of exp2(score - offset) after rescale returned alpha.
    __device__ __forceinline__ void accumulate(float alpha, float tile_sum) { l = l * alpha + tile_sum; }
    // Merges partial state part into this one: the running output is scaled
    // by .x and the partial's output (unnormalised, relative to part.m; a
    // normalised one is {lse2, 1}) weighted by .y, as merge_out does. An empty
    // partial (m = -inf) changes nothing (1, 0). Where the maximum of a group
    // of partials is known first, a state started at {max, 0} takes each
    // partial's weight against it (.x is then exactly 1).
    __device__ __forceinline__ float2 merge(const SoftmaxState& part) {
        if (part.m == neg_inf()) return make_float2(1.f, 0.f);
        const float mn = fmaxf(m, part.m);
        const float a = exp2f(m - mn), w = exp2f(part.m - mn);
        l = l * a + part.l * w;
        m = mn;
        return make_float2(a, w);
    }
    // merge for a partial whose maximum this state's already covers (a
    // state started at {the group's maximum, 0}, which must be finite): the
    // partial's weight alone, one exp2, and the running output is not
    // rescaled (merge's .x would be exactly 1).
    __device__ __forceinline__ float merge_below(const SoftmaxState& part) {
        const float w = exp2f(part.m - m);
        l += part.l * w;
        return w;
    }
    // Adds an attention sink (gpt-oss: one learned logit per q head) of
    // log2-domain value sink to the denominator: one more term exp2(sink -
    // m) in l and none in the output. Returns the factor that rescales the
    // output accumulated so far, as rescale does (0 for an empty state,
    // whose output is 0: it ends as out 0 with lse = the sink). sink = -inf
    // (no sink) changes nothing. Only a row's complete state takes its sink:
    // a split's partial never does, so a split row counts it once.
    __device__ __forceinline__ float add_sink(float sink) {
        if (sink == neg_inf()) return 1.f;
        const float mn = fmaxf(m, sink);
        const float alpha = exp2f(m - mn);
        l = l * alpha + exp2f(sink - mn);
        m = mn;
        return alpha;
    }
    __device__ __forceinline__ bool empty() const { return !(l > 0.f); }
    // The ending: the factor that normalises the output, and the lse.
    __device__ __forceinline__ float inv_l() const { return empty() ? 0.f : 1.f / l; }
    __device__ __forceinline__ float lse2() const { return empty() ? neg_inf() : m + log2f(l); }
    __device__ __forceinline__ float lse() const { return empty() ? neg_inf() : (m + log2f(l)) * kLn2; }
};

// The running output after merge returned aw: o * aw.x + aw.y * v.
template <int N>
__device__ __forceinline__ void merge_out(float (&o)[N], float2 aw, const float (&v)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = o[i] * aw.x + aw.y * v[i];
}

// W consecutive values to dst: a 16-bit pair as one packed register, a float
// pair as one float2, anything else as store_f's vector accesses.
template <typename OT, int W>
__device__ __forceinline__ void store_out(OT* dst, const float (&v)[W]) {
    if constexpr (W == 2 && sizeof(OT) == 2) {
        *reinterpret_cast<uint32_t*>(dst) = pack2<OT>(v[0], v[1]);
    } else if constexpr (W == 2 && sizeof(OT) == 4) {
        *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
    } else {
        store_f<OT, W>(dst, v);
    }
}

// The epilogue of every kernel that finishes a row's state:
// write_state(st).to<OT, LOG2>(out, lse, ...) stores the output normalised
// by l (0 for an empty state) as OT, and the lse: natural log (out and lse
// of the launch contract) or, LOG2, the log2 domain (a partial state a merge
// reads again); -inf for an empty state. lse: where this thread writes the
// row's lse, or nullptr. The thread's slice of the row is one run of N dims
// (o), or J pieces of W consecutive dims, piece j at out + j * STRIDE holding
// get(j, 0 .. W-1) (an mma fragment's column pairs: W = 2, STRIDE = 8).
// write_state(st) takes the normalising factor before the caller's
// addresses are computed (the division is a subroutine call in SASS, and an
// address held across it may spill).
struct StateWriter {
    SoftmaxState st;  // the ending state (the sink added)
    float inv;
    template <typename OT, bool LOG2, int J, int W, int STRIDE, class Get>
    __device__ __forceinline__ void to(OT* out, float* lse, Get get) const {
#pragma unroll
        for (int j = 0; j < J; ++j) {
            float v[W];
#pragma unroll
            for (int e = 0; e < W; ++e) v[e] = get(j, e) * inv;
            store_out<OT, W>(out + j * STRIDE, v);
        }
        if (lse != nullptr) *lse = LOG2 ? st.lse2() : st.lse();
    }
    template <typename OT, bool LOG2, int N>
    __device__ __forceinline__ void to(OT* out, float* lse, const float (&o)[N]) const {
        to<OT, LOG2, 1, N, N>(out, lse, [&](int, int e) { return o[e]; });
    }
};
//
// write_state(st, sink) ends a row's complete state with its attention sink
// (log2 domain, sink_log2; -inf: none): the output is normalised by the
// denominator with the sink term and the lse is the log of that whole
// denominator. Partial states (splits, cascade items) end without one.
__device__ __forceinline__ StateWriter write_state(SoftmaxState st, float sink = neg_inf()) {
    const float alpha = st.add_sink(sink);
    return StateWriter{st, alpha * st.inv_l()};
}

// The attention sink of q head qh in the log2 domain: sinks (float32
// [num_q_heads], natural log, not multiplied by the softmax scale) or 0 for
// none, which gives -inf (write_state's "no sink").
__device__ __forceinline__ float sink_log2(uint64_t sinks, int qh) {
    return sinks == 0 ? neg_inf() : __ldg(reinterpret_cast<const float*>(sinks) + qh) * kLog2e;
}

// Maximum and sum over the four threads that hold one row of an mma tile.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// A row's maximum or sum over this thread's columns, as a tree: M values
// get(0..M-1) (each already a pair of the row's columns), folded in halves.
// A running fmaxf or sum is a chain of dependent instructions as long as the
// row, which the softmax waits out before its first exp2.
template <int W, int N, class Op>
__device__ __forceinline__ float fold_halves(float (&t)[N], Op op) {  // t[0] = op over t[0, 2W)
#pragma unroll
    for (int j = 0; j < W; ++j) t[j] = op(t[j], t[j + W]);
    if constexpr (W > 1)
        return fold_halves<W / 2>(t, op);
    else
        return t[0];
}
template <int M, class Get, class Op>
__device__ __forceinline__ float tree_reduce(Get get, Op op) {
    static_assert(M >= 2 && (M & (M - 1)) == 0, "a power of two");
    float t[M];
#pragma unroll
    for (int j = 0; j < M; ++j) t[j] = get(j);
    return fold_halves<M / 2>(t, op);
}
struct MaxOp {
    __device__ __forceinline__ float operator()(float x, float y) const { return fmaxf(x, y); }
};
struct AddOp {
    __device__ __forceinline__ float operator()(float x, float y) const { return x + y; }
};

// 2^x with the MUFU instruction alone; results below 2^-126 flush to zero,
// which a softmax weight that small is anyway. (exp2f adds a range check and
// two multiplies for subnormal results.)
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- the paged cache ---------------------------------------------------------
// The one reader of the paged cache (kvp_paged_kv_params), shared by every
// kernel that touches it: the decode, prefill (sm_80 and sm_90a) and cascade
// tiles, the f32 kernels and the KV write's scatter. Block-table lookups of
// one sequence for one kv head: a token's element offset in the caches, or
// -1 when its table column is past max_blocks_per_seq or its block is out of
// range (offset alone: a (block, offset) pair's element offset), and for an
// e4m3 cache the index of its scales (scale_index). load_block and offset are
// split (issue the table load, use it later) so the load latency hides
// behind other work; load_block reads only columns < max_blocks_per_seq, so
// it may run before the sequence length is known.
struct PagedRows {
    const int32_t* table;
    int block_size, shift, max_blocks, num_blocks;
    int64_t block_stride, token_stride, head_off;
    int kvh, num_kv_heads;
    bool tensor_scale;  // e4m3 with one scale for the cache: every scale index is 0
    const float *k_scale, *v_scale;  // e4m3 only

    // Table row b (unused where no table is read: the KV write), kv head kvh.
    __device__ __forceinline__ void init(const kvp_paged_kv_params& kv, int b, int kvh_) {
        table = reinterpret_cast<const int32_t*>(kv.block_table) + (int64_t)b * kv.block_table_stride;
        block_size = kv.block_size;
        shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
        max_blocks = kv.max_blocks_per_seq;
        num_blocks = kv.num_blocks;
        block_stride = kv.block_stride;
        token_stride = kv.token_stride;
        head_off = (int64_t)kvh_ * kv.head_stride;
        kvh = kvh_;
        num_kv_heads = kv.num_kv_heads;
        tensor_scale = kv.scale_kind == KVP_KV_SCALE_TENSOR;
        k_scale = reinterpret_cast<const float*>(kv.k_scale);
        v_scale = reinterpret_cast<const float*>(kv.v_scale);
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
    // The float32 scale index of (blk, off) for this kv head in an e4m3
    // cache (KVP_KV_SCALE_*), or -1 where offset is -1.
    __device__ __forceinline__ int64_t scale_index(int blk, int off) const {
        if ((unsigned)blk >= (unsigned)num_blocks) return -1;
        return tensor_scale ? 0 : ((int64_t)blk * block_size + off) * num_kv_heads + kvh;
    }
};

// The lookups of table row b for kv head kvh.
__device__ __forceinline__ PagedRows paged_rows(const kvp_paged_kv_params& kv, int b, int kvh) {
    PagedRows rr;
    rr.init(kv, b, kvh);
    return rr;
}

// Swizzled byte offset of 16-byte chunk c of row r in a [rows][CPR] tile:
// ldmatrix's 8 row addresses of one chunk column land in 8 different banks.
template <int CPR>
__device__ __forceinline__ uint32_t swz(int r, int c) {
    return (uint32_t)(r * CPR + (c ^ (r & 7))) * 16u;
}

// The same for a raw e4m3 tile of D-byte rows (D / 16 chunks a row; at D 64
// two rows share a 128-byte line, so the chunk is XORed with the line).
template <int D>
__device__ __forceinline__ uint32_t swz8(int r, int c) {
    constexpr int CPR = D / 16;
    const int f = CPR >= 8 ? (r & 7) : ((r >> 1) & (CPR - 1));
    return (uint32_t)(r * D + 16 * (c ^ f));
}

// One K/V tile of a sm_80 tile (decode, prefill, cascade) from the paged
// cache into the K and V tiles of stage sk ([rows][CPR] 16-byte chunks,
// swizzled; V's VDELTA bytes after K's), through its tokens' element
// offsets offs (-1: unreadable, the chunk zero-filled): CHUNKS chunks of
// each per thread, copy(dst, src, n) a cp.async of 16 bytes with the
// caller's cache policy, where n says whether to read src: 16-bit caches
// pass the bytes to read (16 or 0), e4m3 a sign (negative: none); a chunk
// that reads nothing gets zeros, and its src is the cache's base.
//
// 16-bit caches: chunk c = tid + i * NT of the tile, each address in full.
// An e4m3 cache (T = uint8_t) lands raw, swizzled by swz8, and is where
// the gather's instructions weigh (a tile of half the bytes, the same
// work a chunk): thread tid copies chunk col of rows r0, r0 + NT / CPR,
// ... (gather_kv_first; a warp still reads whole rows), so that the
// chunks' shared addresses differ by constants, from kt, its first chunk
// in stage sk, which a GatherCursor keeps in a register of its own stage
// to stage. Computed from the stage's base instead, ptxas 13.0 splits it
// into a uniform register plus a per-thread one, and pairs that LDGSTS
// address form with an unset cache-policy register when the copy carries
// an L2 hint: an illegal instruction on sm_90a (bench/sass_check.sh fails
// on that form).
template <typename T, int CPR>
__device__ __forceinline__ uint32_t gather_kv_chunk(int r, int col) {
    return sizeof(T) == 1 ? swz8<CPR * 16>(r, col) : swz<CPR>(r, col);
}
template <typename T, int CPR, int NT>
__device__ __forceinline__ uint32_t gather_kv_first(int tid) {
    static_assert(NT % CPR == 0, "whole rows per round");
    return gather_kv_chunk<T, CPR>((int)((unsigned)tid / CPR), (int)((unsigned)tid % CPR));
}

// gather_kv_tile's kt, stage after stage (e4m3; unused for 16-bit caches):
// the first is a shuffle's result, which ptxas cannot take apart, and each
// next one a select of it. All 32 lanes of the warp must make it; next()
// once per gather, the stages in turn.
template <typename T, int CPR, int NT, int STAGES, int STAGE_BYTES>
struct GatherCursor {
    uint32_t first = 0, cur = 0;
    __device__ __forceinline__ GatherCursor(uint32_t s_kv, int tid) {
        if constexpr (sizeof(T) == 1) {
            first = __shfl_sync(0xffffffffu, s_kv + gather_kv_first<T, CPR, NT>(tid), tid & 31);
            cur = first;
        }
    }
    __device__ __forceinline__ void next() {
        if constexpr (sizeof(T) == 1) cur = cur == first + (STAGES - 1) * STAGE_BYTES ? first : cur + STAGE_BYTES;
    }
};

template <typename T, int CPR, int CHUNKS, int NT, int VDELTA, class Copy>
__device__ __forceinline__ void gather_kv_tile(uint32_t sk, uint32_t kt, const int64_t* offs, const T* kc,
                                               const T* vc, int tid, Copy copy) {
    constexpr int VEC = 16 / (int)sizeof(T);
    if constexpr (sizeof(T) == 1) {
        constexpr int STEP = NT / CPR;  // rows between a thread's chunks
        const int col = (int)((unsigned)tid % CPR), r0 = (int)((unsigned)tid / CPR);
        const uint32_t first = gather_kv_chunk<T, CPR>(r0, col);
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const int r = r0 + i * STEP;
            const int64_t o = offs[r];
            // A constant where STEP is a multiple of the swizzle's period.
            const uint32_t dst = kt + (gather_kv_chunk<T, CPR>(r, col) - first);
            const int sign = (int)(o >> 32);  // negative: unreadable
            const int64_t src = sign < 0 ? 0 : o + col * VEC;
            copy(dst, kc + src, sign);
            copy(dst + VDELTA, vc + src, sign);
        }
    } else {
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const int c = tid + i * NT;
            const int r = c / CPR, col = c % CPR;
            const int64_t o = offs[r];
            const uint32_t dst = gather_kv_chunk<T, CPR>(r, col);
            const int bytes = o >= 0 ? 16 : 0;
            const int64_t src = o >= 0 ? o + col * VEC : 0;
            copy(sk + dst, kc + src, bytes);
            copy(sk + VDELTA + dst, vc + src, bytes);
        }
    }
}

// 4-byte async copy global->shared (a scale); src_bytes == 0 writes zeros.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// The scales of a raw e4m3 tile of TILE rows: K's at sks, V's at svs, row r's
// scale index soffs[r] (-1: zero). Threads [0, TILE) copy K's, [TILE, 2 TILE)
// V's.
template <int TILE, typename I>
__device__ __forceinline__ void gather_kv_scales(uint32_t sks, uint32_t svs, const I* soffs, const PagedRows& rr, int tid) {
    if (tid >= 2 * TILE) return;
    const bool v = tid >= TILE;
    const int r = v ? tid - TILE : tid;
    const int64_t o = soffs[r];
    const float* base = v ? rr.v_scale : rr.k_scale;
    cp_async4((v ? svs : sks) + r * 4, base + (o >= 0 ? o : 0), o >= 0 ? 4 : 0);
}

// ---- a bf16 query for the e4m3 mainloops (f16) ---------------------------------
// The largest magnitude of 8 bf16 values (one 16-byte chunk).
__device__ __forceinline__ float bf16x8_amax(uint4 v) {
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i)
        m = fmaxf(m, fmaxf(fabsf(__uint_as_float(u[i] << 16)), fabsf(__uint_as_float(u[i] & 0xffff0000u))));
    return m;
}

// 8 bf16 values times mul as 8 f16 values.
__device__ __forceinline__ uint4 bf16x8_to_f16(uint4 v, float mul) {
    uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
        u[i] = pack2<f16>(__uint_as_float(u[i] << 16) * mul, __uint_as_float(u[i] & 0xffff0000u) * mul);
    return make_uint4(u[0], u[1], u[2], u[3]);
}

// The power of two 2^sh that brings the largest magnitude of a 4-warp
// block's query (each thread's own largest, m) into [2^14, 2^15), f16's
// range: returns 2^sh and sets unscale to 2^-sh, which the scores take back.
// Reduces through red[4] of shared memory with one __syncthreads; every
// thread of the block calls it.
__device__ __forceinline__ float q_f16_scale(float m, float* red, int warp, int lane, float& unscale) {
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    int e = 0;
    if (m > 0.f) frexpf(m, &e);                 // m in [2^(e-1), 2^e)
    const int sh = max(-120, min(120, 15 - e));  // m * 2^sh in [2^14, 2^15)
    unscale = exp2f((float)-sh);
    return exp2f((float)sh);
}

template <class X>
struct IsBF16 {
    static constexpr bool value = false;
};
template <>
struct IsBF16<bf16> {
    static constexpr bool value = true;
};

// A compile-time bool as a value (a lambda's two instantiations).
template <bool B>
struct BoolC {
    static constexpr bool value = B;
};

// Cond<B, X, Y>::type: X if B, else Y.
template <bool B, class X, class Y>
struct Cond {
    using type = X;
};
template <class X, class Y>
struct Cond<false, X, Y> {
    using type = Y;
};

// ---- 1. KV write -----------------------------------------------------------
template <typename T, int D>
__device__ __forceinline__ void kv_write(const kvp_kv_write_params& p) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr int CPR = D / VEC;  // 16-byte chunks per row
    griddep_wait();
    griddep_launch_dependents();
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t rows = (int64_t)p.num_tokens * p.kv.num_kv_heads;
    if (idx >= rows * CPR) return;
    const int c = (int)(idx % CPR);
    const int64_t row = idx / CPR;
    const int h = (int)(row % p.kv.num_kv_heads);
    const int64_t t = row / p.kv.num_kv_heads;
    const int slot = __ldg(reinterpret_cast<const int32_t*>(p.slot_mapping) + t);
    if (slot < 0) return;
    const int blk = slot / p.kv.block_size;
    const int off = slot - blk * p.kv.block_size;
    const int64_t base = paged_rows(p.kv, 0, h).offset(blk, off);  // no table: the slot names the block
    if (base < 0) return;
    const int64_t dst = base + c * VEC;
    const T* k = reinterpret_cast<const T*>(p.key) + t * p.key_token_stride + h * p.key_head_stride + c * VEC;
    const T* v = reinterpret_cast<const T*>(p.value) + t * p.value_token_stride + h * p.value_head_stride + c * VEC;
    const uint4 kv = __ldg(reinterpret_cast<const uint4*>(k));
    const uint4 vv = __ldg(reinterpret_cast<const uint4*>(v));
    *reinterpret_cast<uint4*>(reinterpret_cast<T*>(p.kv.k_cache) + dst) = kv;
    *reinterpret_cast<uint4*>(reinterpret_cast<T*>(p.kv.v_cache) + dst) = vv;
}

// KV write into an e4m3 cache: the same scatter, quantising on the way. The
// CPR threads of one (token, head) row (a power of two <= 32, so a row never
// straddles a warp) hold 8 elements each; with per-(token, head) scales
// they reduce the row's largest magnitude and the row's first thread stores
// its scale, amax / 448; with one scale for the cache they divide by it.
// Elements saturate to +-448.
template <typename T, int D>
__device__ __forceinline__ void kv_write_e4m3(const kvp_kv_write_params& p) {
    constexpr int CPR = D / 8;  // 16-byte chunks of a 16-bit row
    static_assert(CPR <= 32 && (CPR & (CPR - 1)) == 0, "a row's threads share a warp");
    griddep_wait();
    griddep_launch_dependents();
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t rows = (int64_t)p.num_tokens * p.kv.num_kv_heads;
    if (idx >= rows * CPR) return;  // whole rows: rows * CPR is a multiple of CPR
    const int c = (int)(idx % CPR);
    const int64_t row = idx / CPR;
    const int h = (int)(row % p.kv.num_kv_heads);
    const int64_t t = row / p.kv.num_kv_heads;
    const int slot = __ldg(reinterpret_cast<const int32_t*>(p.slot_mapping) + t);
    if (slot < 0) return;  // the row's threads agree on everything up to here
    const int blk = slot / p.kv.block_size;
    const int off = slot - blk * p.kv.block_size;
    const PagedRows rr = paged_rows(p.kv, 0, h);
    const int64_t base = rr.offset(blk, off);
    if (base < 0) return;
    float k[8], v[8];
    load_f<T, 8>(reinterpret_cast<const T*>(p.key) + t * p.key_token_stride + h * p.key_head_stride + c * 8, k);
    load_f<T, 8>(reinterpret_cast<const T*>(p.value) + t * p.value_token_stride + h * p.value_head_stride + c * 8, v);
    float ks, vs;
    const int64_t si = rr.scale_index(blk, off);
    if (rr.tensor_scale) {
        ks = __ldg(rr.k_scale);
        vs = __ldg(rr.v_scale);
    } else {
        float ka = 0.f, va = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) ka = fmaxf(ka, fabsf(k[i])), va = fmaxf(va, fabsf(v[i]));
        const unsigned lane = threadIdx.x & 31u;
        const unsigned mask = CPR == 32 ? 0xffffffffu : ((1u << CPR) - 1u) << (lane & ~(unsigned)(CPR - 1));
#pragma unroll
        for (int o = CPR / 2; o > 0; o >>= 1) {
            ka = fmaxf(ka, __shfl_xor_sync(mask, ka, o));
            va = fmaxf(va, __shfl_xor_sync(mask, va, o));
        }
        ks = e4m3_row_scale(ka);
        vs = e4m3_row_scale(va);
        if (c == 0) {
            const_cast<float*>(rr.k_scale)[si] = ks;
            const_cast<float*>(rr.v_scale)[si] = vs;
        }
    }
    *reinterpret_cast<uint2*>(reinterpret_cast<uint8_t*>(p.kv.k_cache) + base + c * 8) = quant8(k, ks);
    *reinterpret_cast<uint2*>(reinterpret_cast<uint8_t*>(p.kv.v_cache) + base + c * 8) = quant8(v, vs);
}

// ---- split combine (decode workspace -> out, lse) --------------------------
// Workspace lse is in the log2 domain; empty splits hold lse = -inf and zeros.
// Partial rows are loaded unconditionally, U at a time, the first batch before
// the lse math, so a row costs about one L2 round trip per 32 splits (a serial,
// branch-dependent loop over 32 splits cost 64). Loads bypass L1 (ld.cg):
// the partials were written by other blocks.
__device__ __forceinline__ float2 ldcg2(const float* p) { return __ldcg(reinterpret_cast<const float2*>(p)); }
__device__ __forceinline__ float4 ldcg4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }

template <int E>
__device__ __forceinline__ void load_cg(const float* src, float (&v)[E]) {
    if constexpr (E == 2) {
        const float2 a = ldcg2(src);
        v[0] = a.x, v[1] = a.y;
    } else {
#pragma unroll
        for (int i = 0; i < E; i += 4) {
            const float4 a = ldcg4(src + i);
            v[i] = a.x, v[i + 1] = a.y, v[i + 2] = a.z, v[i + 3] = a.w;
        }
    }
}

// Merges the num_splits partial states of one (sequence b, q head) row into
// out/lse row orow. Called by one whole warp. U = partial rows loaded per batch; the
// batch is clamped to the last split, so U is picked to fit S (loads of a
// duplicate row cost a full L2 access each: S = 4 with U = 16 wastes 12;
// predicating the loads instead made the compiler serialise them).
template <typename T, int D, int U>
__device__ __forceinline__ void combine_row_u(const kvp_decode_params& p, int b, int64_t orow, int qh, int lane) {
    constexpr int E = D / 32;  // floats per lane of one partial row
    const int64_t rows = (int64_t)p.batch * kvp_decode_q_len(p.q_len) * p.num_q_heads;
    const int64_t row = (int64_t)b * p.num_q_heads + qh;
    const float* part_o = reinterpret_cast<const float*>(p.workspace) + row * D + lane * E;
    const float* part_lse = reinterpret_cast<const float*>(p.workspace) + (int64_t)p.num_splits * rows * D + row;
    const int S = p.num_splits;
    const int64_t split_stride = rows * D;

    float acc[E];
#pragma unroll
    for (int i = 0; i < E; ++i) acc[i] = 0.f;
    SoftmaxState st;
    st.init();
    float mu = 0.f;                      // exp2 offset of the current round
    for (int s0 = 0; s0 < S; s0 += 32) {  // 32 splits per round, online rescale across rounds
        const int n = min(32, S - s0);
        const float ls = lane < n ? __ldcg(part_lse + (int64_t)(s0 + lane) * rows) : neg_inf();
        for (int u0 = 0; u0 < n; u0 += U) {
            float v[U][E];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int s = s0 + min(u0 + u, n - 1);  // clamped: stays inside the workspace
                load_cg<E>(part_o + s * split_stride, v[u]);
            }
            // A round of up to 32 partial states (one a lane) is merged as a
            // batch, the online softmax's rescale over their largest lse then
            // one exp2 a lane: SoftmaxState::merge folds one state at a time,
            // which here would serialise 32 exp2 pairs per round.
            if (u0 == 0) {
                const float alpha = st.rescale(warp_max(ls), mu);
#pragma unroll
                for (int i = 0; i < E; ++i) acc[i] *= alpha;
                st.l *= alpha;
            }
            const float wl = exp2f(ls - mu);
            if (u0 == 0) st.l += warp_sum(wl);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float w = __shfl_sync(0xffffffffu, wl, (u0 + u) & 31);
                if (u0 + u >= n) w = 0.f;  // a clamped duplicate
#pragma unroll
                for (int i = 0; i < E; ++i) acc[i] += w * v[u][i];
            }
        }
    }
    // The splits' partials hold no sink: the row's one sink joins here.
    const StateWriter end = write_state(st, sink_log2(p.sinks, qh));
    T* out = reinterpret_cast<T*>(p.out) + orow * p.out_batch_stride + qh * p.out_head_stride + lane * E;
    end.to<T, false>(out, p.lse != 0 && lane == 0 ? reinterpret_cast<float*>(p.lse) + orow * p.num_q_heads + qh : nullptr,
                     acc);
}

template <typename T, int D>
__device__ __forceinline__ void combine_row(const kvp_decode_params& p, int b, int64_t orow, int qh, int lane) {
    constexpr int UMAX = 256 / (D / 32 * 4) < 16 ? 256 / (D / 32 * 4) : 16;  // 256 bytes per lane
    if (p.num_splits <= 4)
        combine_row_u<T, D, 4>(p, b, orow, qh, lane);
    else if (p.num_splits <= 8)
        combine_row_u<T, D, 8>(p, b, orow, qh, lane);
    else
        combine_row_u<T, D, UMAX>(p, b, orow, qh, lane);
}

// One warp per (row of q, q head); a row is a sequence's new token. With
// q_indptr (q_len 1), row b is sequence b's, at q_indptr[b] in out, and a
// sequence with another count is not this launch's.
template <typename T, int D>
__device__ __forceinline__ void decode_combine(const kvp_decode_params& p) {
    griddep_wait();
    griddep_launch_dependents();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t rows = (int64_t)p.batch * kvp_decode_q_len(p.q_len) * p.num_q_heads;
    const int64_t row = (int64_t)blockIdx.x * (KVP_COMBINE_THREADS / 32) + warp;
    if (row >= rows) return;
    const int b = (int)(row / p.num_q_heads);
    int64_t orow = b;
    if (p.q_indptr != 0) {
        const int32_t* qi = reinterpret_cast<const int32_t*>(p.q_indptr);
        orow = qi[b];
        if (qi[b + 1] - orow != 1 || (uint64_t)orow >= (uint64_t)p.q_rows) return;
    }
    combine_row<T, D>(p, b, orow, (int)(row - (int64_t)b * p.num_q_heads), lane);
}

// ---- 3. merge of attention states ------------------------------------------
template <typename T, int D>
__device__ __forceinline__ void merge_states(const kvp_merge_params& p) {
    constexpr int E = D / 32;
    griddep_wait();
    griddep_launch_dependents();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t rows = (int64_t)p.num_tokens * p.num_heads;
    const int64_t row = (int64_t)blockIdx.x * (KVP_MERGE_THREADS / 32) + warp;
    if (row >= rows) return;
    const int64_t t = row / p.num_heads;
    const int h = (int)(row - t * p.num_heads);
    const int n = p.num_states;

    // Constant indices only: a run-time index into the params would copy
    // them to local memory. The lse inputs (natural log) in the log2 domain.
    float s[KVP_MERGE_MAX_STATES];
    float m = neg_inf();
#pragma unroll
    for (int i = 0; i < KVP_MERGE_MAX_STATES; ++i) {
        s[i] = neg_inf();
        if (i < n) s[i] = reinterpret_cast<const float*>(p.s[i])[t * p.s_token_stride + h * p.s_head_stride] * kLog2e;
        m = fmaxf(m, s[i]);
    }
    float acc[E];
#pragma unroll
    for (int i = 0; i < E; ++i) acc[i] = 0.f;
    // The largest lse first: every state's weight is taken against it.
    SoftmaxState st{m, 0.f};
#pragma unroll
    for (int i = 0; i < KVP_MERGE_MAX_STATES; ++i) {
        if (i >= n || m == neg_inf()) break;  // all states empty: out 0, lse -inf
        const float w = st.merge_below(SoftmaxState{s[i], 1.f});
        if (w == 0.f) continue;
        float v[E];
        load_f<T, E>(reinterpret_cast<const T*>(p.v[i]) + t * p.v_token_stride + h * p.v_head_stride + lane * E, v);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] += w * v[e];
    }
    // out/out_lse may alias v[0]/s[0]: every lane has finished reading
    // before any lane writes.
    __syncwarp();
    write_state(st, sink_log2(p.sinks, (int)h)).to<T, false>(reinterpret_cast<T*>(p.out) + t * p.out_token_stride + h * p.out_head_stride + lane * E,
                          p.out_lse != 0 && lane == 0 ? reinterpret_cast<float*>(p.out_lse) + t * p.out_lse_token_stride +
                                                            h * p.out_lse_head_stride
                                                      : nullptr,
                          acc);
}

// One token of the float32 kernels (one warp per query row, E dims a lane):
// the token's K/V through the block table, scale*q.k in the log2 domain (sl
// = scale * log2 e), and the online-softmax update of the row's state and
// output o. A token whose block is out of range is
// skipped.
template <int E>
__device__ __forceinline__ void f32_attend_token(const PagedRows& rr, const float* kc, const float* vc, int lane,
                                                 const float (&q)[E], float sl, int tok, SoftmaxState& st,
                                                 float (&o)[E]) {
    int off;
    const int blk = rr.load_block(tok, off);
    const int64_t base = rr.offset(blk, off);
    if (base < 0) return;
    float kv[E], vv[E];
    load_f<float, E>(kc + base + lane * E, kv);
    load_f<float, E>(vc + base + lane * E, vv);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) s += q[i] * kv[i];
    s = warp_sum(s) * sl;
    float shift;
    const float alpha = st.rescale(s, shift);
    const float pe = exp2f(s - shift);
    st.accumulate(alpha, pe);
#pragma unroll
    for (int i = 0; i < E; ++i) o[i] = o[i] * alpha + pe * vv[i];
}

// One query row of the float32 kernels, a warp's: its E dims a lane of q
// (read from qp + lane * E), its state and unnormalised output o, both
// empty until attend() takes tokens [t0, t1) through f32_attend_token.
template <int E>
struct F32Row {
    float q[E];
    SoftmaxState st;
    float o[E];
    __device__ __forceinline__ F32Row(const float* qp, int lane) {
        load_f<float, E>(qp + lane * E, q);
        st.init();
#pragma unroll
        for (int i = 0; i < E; ++i) o[i] = 0.f;
    }
    __device__ __forceinline__ void attend(const PagedRows& rr, const float* kc, const float* vc, int lane, float sl,
                                           int t0, int t1) {
        for (int tok = t0; tok < t1; ++tok) f32_attend_token<E>(rr, kc, vc, lane, q, sl, tok, st, o);
    }
};

}  // namespace kvp
