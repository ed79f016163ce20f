// The sm_90a inline-PTX helpers of the Hopper mainloop (kvp_prefill_sm90.cuh):
// mbarriers, named barriers, cp.async and shared-memory accesses by address,
// proxy fences, register reallocation (setmaxnreg), and wgmma (its fence,
// groups, shared-memory descriptors, and the m64nNk16 products of
// kvp_wgmma.cuh, which kernels/gen_wgmma.py writes). Only PTX wrappers live
// here; the mainloop's layout and scheduling stay in kvp_prefill_sm90.cuh.
#pragma once

#include <stdint.h>

#include "kvp_common.cuh"
#include "kvp_wgmma.cuh"

namespace kvp {

// ---- mbarriers, named barriers, copies ------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// n arrivals at once (sm_90).
__device__ __forceinline__ void mbar_arrive_n(uint32_t bar, uint32_t n) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(n) : "memory");
}
// Arrives on bar when every cp.async this thread issued before has landed
// (the barrier's expected count includes these arrivals).
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Named barriers 2 and 3 of the two consumer warpgroups (256 threads each:
// one warpgroup syncs, the other arrives); 0 is __syncthreads, 1 the producer's.
__device__ __forceinline__ void turn_wait(int c) {
#ifndef KVP_SM90_NO_PINGPONG
    if (c == 0)
        asm volatile("bar.sync 2, 256;\n" ::: "memory");
    else
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void turn_pass(int c) {  // hands the turn to the other warpgroup
#ifndef KVP_SM90_NO_PINGPONG
    if (c == 0)
        asm volatile("bar.arrive 3, 256;\n" ::: "memory");
    else
        asm volatile("bar.arrive 2, 256;\n" ::: "memory");
#endif
}
// The suspend-time hint lets the hardware park a waiting warp until the phase
// completes (up to 10 ms a try) instead of returning at once: a spinning
// producer otherwise spends the issue slots the consumers need (in an ncu
// profile, a quarter of the kernel's instructions were such retries).
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
    uint32_t done = 0;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\nselp.u32 %0, 1, 0, "
            "p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity), "r"(10000000)
            : "memory");
    } while (!done);
}
// cp.async of 16 bytes, all of them read (no zero fill).
__device__ __forceinline__ void cp_async16_full(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void st_shared_s64(uint32_t a, int64_t v) {
    asm volatile("st.shared.s64 [%0], %1;\n" ::"r"(a), "l"(v) : "memory");
}
__device__ __forceinline__ int64_t ld_shared_s64(uint32_t a) {
    int64_t v;
    asm volatile("ld.shared.s64 %0, [%1];\n" : "=l"(v) : "r"(a) : "memory");
    return v;
}
// Writes by the generic proxy (cp.async, st.shared) become visible to wgmma's
// reads (the async proxy) only after this fence in the writing thread.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
#endif

// Keeps the compiler from moving accesses of accumulator registers across the
// asynchronous wgmma that owns them.
template <int N>
__device__ __forceinline__ void pin_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma shared-memory descriptor, 128-byte swizzle. K-major operands (Q, K):
// 8-row groups 1024 bytes apart (sbo), lbo unused. MN-major (V): lbo = bytes
// between 128-byte column blocks, sbo = bytes between 8-token groups.
__device__ __forceinline__ uint64_t gmma_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// A descriptor for bytes further on in shared memory: the start-address field
// is the low 14 bits (address / 16), and no tile reaches past 256 KiB, so an
// add carries nothing into the next field. The consumers build each operand's
// descriptor once and step it by constants.
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// Ends the barrier initialisation: the mbarriers are visible to the other
// threads (and the async proxy) after this fence and a block barrier.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Register reallocation of a warpgroup (warp-uniform, every warp of it).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
// Named barrier 1: the producer warpgroup's 128 threads. producer_sync_or
// also returns whether any of them passed a nonzero x (bar.red.or).
__device__ __forceinline__ void producer_sync() { asm volatile("bar.sync 1, 128;\n" ::: "memory"); }
__device__ __forceinline__ int producer_sync_or(int x) {
    int any;
    asm volatile(
        "{\n.reg .pred p, q;\nsetp.ne.b32 q, %1, 0;\nbar.red.or.pred p, 1, 128, q;\nselp.u32 %0, 1, 0, "
        "p;\n}\n"
        : "=r"(any)
        : "r"(x)
        : "memory");
    return any;
}

}  // namespace kvp
