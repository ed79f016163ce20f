// Batched copies between paged KV blocks in GPU memory and slots of a host
// KV tier (pinned, mapped host memory), for every layer's K and V of each
// block in one launch.
//
// One block of threads copies one part (KVP_TIER_COPY_CTA_BYTES) of one
// (op, layer, K-or-V) chunk. Each thread issues all of its 16-byte loads
// before its stores, so that a warp keeps UNROLL loads in flight: reads
// from host memory cross the PCIe/C2C link with microseconds of latency,
// and only many outstanding requests fill the link.
//
// The op list rides in the parameter struct (constant bank), so a launch
// needs no device-side staging and can be captured in a graph.
#pragma once

#include "kvp_common.cuh"

namespace kvp {

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 v;
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ void st_stream16(void* p, const uint4& v) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ void tier_copy(const kvp_tier_copy_params& p) {
    constexpr int NT = KVP_TIER_COPY_THREADS;
    constexpr int UNROLL = KVP_TIER_COPY_CTA_BYTES / (NT * 16);
    int64_t u = blockIdx.x;
    const int part = (int)(u % p.parts);
    u /= p.parts;
    const int t = (int)(u % p.kv);
    u /= p.kv;
    const int layer = (int)(u % p.num_layers);
    const int op = (int)(u / p.num_layers);
    if (op >= p.n_ops) return;
    const int blk = p.ops[op][0], slot = p.ops[op][1];
    // Memory safety only: the launcher rejects such ops before launching.
    if (blk < 0 || blk >= p.num_blocks || slot < 0 || slot >= p.num_slots) return;

    const uint64_t base = reinterpret_cast<const uint64_t*>(p.layers)[2 * layer + t];
    uint8_t* dev = reinterpret_cast<uint8_t*>(base) + (int64_t)blk * (t ? p.v_block_stride : p.k_block_stride);
    uint8_t* host = reinterpret_cast<uint8_t*>(p.host) + (int64_t)slot * p.slot_bytes +
                    (int64_t)(layer * p.kv + t) * p.chunk_bytes;
    const bool demote = op < p.n_demote;
    const uint8_t* src = demote ? dev : host;
    uint8_t* dst = demote ? host : dev;

    const int64_t start = (int64_t)part * KVP_TIER_COPY_CTA_BYTES + threadIdx.x * 16;
    uint4 r[UNROLL];
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {
        const int64_t off = start + (int64_t)i * NT * 16;
        if (off < p.chunk_bytes) r[i] = ld_stream16(src + off);
    }
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {
        const int64_t off = start + (int64_t)i * NT * 16;
        if (off < p.chunk_bytes) st_stream16(dst + off, r[i]);
    }
}

}  // namespace kvp
