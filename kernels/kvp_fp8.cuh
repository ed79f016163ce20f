// The FP8 (e4m3) cache format: conversions between e4m3 and float, the
// conversion of four e4m3 values into f16, and the per-row quantisation of
// the KV write. A kernel that reads an e4m3 cache copies its raw tiles
// (cp.async) into shared memory, reads its mma fragments from them with
// ldmatrix (pairs of e4m3 bytes as b16 elements) and converts them in
// registers, exactly (every e4m3 value is exact in f16; one cvt converts two),
// for an f16 mainloop; the scales are applied in fp32, to the scores (K) and
// to the probabilities (V). A pass through shared memory that widened the
// tiles to 16 bits first cost more shared-memory bandwidth than the 16-bit
// kernel's whole mainloop (ncu: MIO-bound at 31% of DRAM bandwidth).
//
// e4m3: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities, largest
// finite 448 (0x7e), NaN 0x7f. Every e4m3 value is exact in f16 and bf16.
//
// sm_89 and newer convert with one cvt per pair; sm_80/86 (and any build with
// KVP_FP8_SOFT, which the tests use to run the fallback on a newer GPU) take
// the bit-level path below, which gives the same values.
#pragma once

#include <stdint.h>

namespace kvp {

constexpr float kE4M3Max = 448.f;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(KVP_FP8_SOFT)
#define KVP_FP8_HW 1
#else
#define KVP_FP8_HW 0
#endif

// Four e4m3 values (byte i of w is element i) as two f16x2 words (elements
// 0,1 in lo, 2,3 in hi; element 2i in the low half): exact with the sm_89
// cvt; the software path gives each value times 2^-8 (exact too, e4m3
// subnormals included), which e4m3x4_f16 multiplies back.
__device__ __forceinline__ void e4m3x4_raw(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if KVP_FP8_HW
    asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, a;\n\tcvt.rn.f16x2.e4m3x2 %1, b;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
#else
    // Byte b -> f16 bits (b & 0x80) << 8 | (b & 0x7f) << 7: the e4m3 exponent
    // and mantissa land in the f16 fields, worth 2^-8 of the e4m3 value.
    const uint32_t w2 = w >> 16;
    lo = ((w & 0x80u) << 8) | ((w & 0x7fu) << 7) | ((w & 0x8000u) << 16) | ((w & 0x7f00u) << 15);
    hi = ((w2 & 0x80u) << 8) | ((w2 & 0x7fu) << 7) | ((w2 & 0x8000u) << 16) | ((w2 & 0x7f00u) << 15);
#endif
}

__device__ __forceinline__ float2 f16x2_to_float2(uint32_t h) {
    float a, b;
    asm("{\n\t.reg .b16 l, u;\n\tmov.b32 {l, u}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, u;\n\t}"
        : "=f"(a), "=f"(b)
        : "r"(h));
    return make_float2(a, b);
}

// Four e4m3 values as two f16x2 words (as e4m3x4_raw), exact on every path.
__device__ __forceinline__ void e4m3x4_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
    e4m3x4_raw(w, lo, hi);
#if !KVP_FP8_HW
    // Times 256 (f16 0x5c00), exact: the software path's bias.
    asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(lo) : "r"(0x5c005c00u));
    asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(hi) : "r"(0x5c005c00u));
#endif
}

// x as e4m3, rounded to nearest even and saturated to +-448 (NaN stays NaN).
__device__ __forceinline__ uint32_t f32_to_e4m3(float x) {
    const uint32_t sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fabsf(x);
    if (a != a) return 0x7fu;
    if (a >= kE4M3Max) return sign | 0x7eu;
    if (a < 0.015625f) {  // below 2^-6: a subnormal step of 2^-9 (8 steps reach 2^-6, the smallest normal)
        return sign | (uint32_t)__float2int_rn(a * 512.f);
    }
    uint32_t u = __float_as_uint(a);
    u += 0x7ffffu + ((u >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, ties to even
    const uint32_t e = (u >> 23) - 120u;  // rebias 127 -> 7
    const uint32_t m = (u >> 20) & 7u;
    if (e > 15u || (e == 15u && m == 7u)) return sign | 0x7eu;
    return sign | (e << 3) | m;
}

// Two floats as two e4m3 bytes, lo in the low byte.
__device__ __forceinline__ uint32_t pack_e4m3x2(float lo, float hi) {
#if KVP_FP8_HW
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return f32_to_e4m3(lo) | (f32_to_e4m3(hi) << 8);
#endif
}

// Eight floats divided by s as eight e4m3 bytes (element i in byte i).
__device__ __forceinline__ uint2 quant8(const float (&x)[8], float s) {
    uint32_t b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) b[i] = pack_e4m3x2(x[2 * i] / s, x[2 * i + 1] / s);
    return make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
}

// The scale of a token-head row whose largest magnitude is amax: amax maps to
// 448. A zero row keeps scale 1 (its elements quantise to 0 either way), so
// no scale is ever 0 and a reader never divides by one.
__device__ __forceinline__ float e4m3_row_scale(float amax) { return amax > 0.f ? amax / kE4M3Max : 1.f; }

}  // namespace kvp
