// kvplug CUDA kernels: KV write, paged decode attention (split-KV + combine),
// merge of attention states. One translation unit, compiled into
// kvplug.fatbin; the launch contract (params structs, names, grids, shared
// memory, workspace) is kernels/kvplug_kernels.h.
#include <stdint.h>

#include "kvplug_kernels.h"
#include "kvp_common.cuh"
#include "kvp_decode.cuh"
#include "kvp_prefill.cuh"

// ---------------------------------------------------------------------------
// The host side mirrors these layouts field for field (core/attn/params.go,
// kernels/kernel_abi.py): freeze them. KVP_LAYOUT(T, size, (f, o)(f, o)...)
// asserts sizeof(T) == size and, one static_assert each, offsetof(T, f) == o
// for every (f, o) of the list (KVP_LAYOUT_A and _B take the pairs in turn;
// KVP_LAYOUT_A_END or _B_END closes the list). The offset asserts sit in a
// namespace of their own, where S names T.
#define KVP_CAT(a, b) KVP_CAT_(a, b)
#define KVP_CAT_(a, b) a##b
#define KVP_LAYOUT(T, size, FIELDS)            \
    namespace kvp_layout_##T {                 \
    using S = T;                               \
    KVP_CAT(KVP_LAYOUT_A FIELDS, _END)         \
    }                                          \
    static_assert(sizeof(T) == (size), #T " size")
#define KVP_LAYOUT_A(f, o) static_assert(offsetof(S, f) == (o), "offset of " #f); KVP_LAYOUT_B
#define KVP_LAYOUT_B(f, o) static_assert(offsetof(S, f) == (o), "offset of " #f); KVP_LAYOUT_A
#define KVP_LAYOUT_A_END
#define KVP_LAYOUT_B_END

KVP_LAYOUT(kvp_paged_kv_params, 96, (v_cache, 8)(block_table, 16)(k_scale, 24)(v_scale, 32)(block_stride, 40)
           (token_stride, 48)(head_stride, 56)(block_table_stride, 64)(num_kv_heads, 72)(block_size, 76)(num_blocks, 80)
           (max_blocks_per_seq, 84)(dtype, 88)(scale_kind, 92));
KVP_LAYOUT(kvp_kv_write_params, 160, (kv, 0)(key, 96)(slot_mapping, 112)(key_token_stride, 120)(value_head_stride, 144)
           (num_tokens, 152)(reserved, 156));
KVP_LAYOUT(kvp_decode_params, 216, (kv, 0)(q, 96)(seq_lens, 104)(workspace, 128)(q_batch_stride, 136)
           (out_head_stride, 160)(batch, 168)(num_splits, 176)(scale, 180)(q_len, 184)(q_rows, 188)(q_indptr, 192)
           (sinks, 200)(window_left, 208)(reserved, 212));
KVP_LAYOUT(kvp_merge_params, 232, (s, 64)(out, 128)(out_lse, 136)(v_token_stride, 144)(out_lse_head_stride, 200)
           (num_states, 208)(reserved, 220)(sinks, 224));

KVP_LAYOUT(kvp_prefill_plan_params, 56, (work, 16)(batch, 24)(max_items, 36)(tile_q, 40)(skip_decode, 48));
KVP_LAYOUT(kvp_prefill_params, 208, (kv, 0)(q, 96)(work, 120)(q_token_stride, 128)(out_head_stride, 152)
           (num_q_heads, 160)(window_left, 164)(scale, 168)(num_splits, 172)(part_out, 176)(part_lse, 184)(total_q, 192)
           (reserved, 196)(sinks, 200));
static_assert(kvp::PrefillCfg<64>::SMEM == 59392, "prefill smem h64 (header formula)");
static_assert(kvp::PrefillCfg<128>::SMEM == 83456, "prefill smem h128 (header formula)");
static_assert(kvp::PrefillCfg<256>::SMEM == 165376, "prefill smem h256 (header formula)");
static_assert(kvp::DecodeCfg<64>::SMEM == 70144, "smem h64 (header formula)");
static_assert(kvp::DecodeCfg<128>::SMEM == 104448, "smem h128 (header formula)");
static_assert(kvp::DecodeCfg<256>::SMEM == 140800, "smem h256 (header formula)");
#define KVP_DECODE_E4M3_SMEM(D) kvp::DecodeCfg<D, kvp::DecodeStages<D>::value, true>::SMEM
static_assert(KVP_DECODE_E4M3_SMEM(64) == 39936, "e4m3 smem h64 (header formula)");
static_assert(KVP_DECODE_E4M3_SMEM(128) == 57088, "e4m3 smem h128 (header formula)");
static_assert(KVP_DECODE_E4M3_SMEM(256) == 76288, "e4m3 smem h256 (header formula)");
// The e4m3 decode at head_dim 128 holds 4 blocks per SM: 57088 + 1024 bytes
// of shared memory each of sm_90's 228 KB, and 128 registers a thread.
#define KVP_DECODE_E4M3_MIN_BLOCKS(D) ((D) == 128 ? 4 : 1)
static_assert(4 * (KVP_DECODE_E4M3_SMEM(128) + 1024) <= 228 * 1024, "four e4m3 decode blocks per SM");
static_assert(kvp::TileCfg<64, 1, true>::SMEM == 38416, "e4m3 prefill smem h64 (header formula)");
static_assert(kvp::TileCfg<128, 1, true>::SMEM == 53264, "e4m3 prefill smem h128 (header formula)");
static_assert(kvp::TileCfg<256, 1, true>::SMEM == 102416, "e4m3 prefill smem h256 (header formula)");

// ---------------------------------------------------------------------------
// Instantiations: every kernel for every (dtype, head_dim). KVP_KERNEL
// defines NAME_<dt>_h<D>(PARAMS), which runs FN<T, D>, with
// __launch_bounds__(the rest).
#define KVP_KERNEL(NAME, PARAMS, FN, DT, T, D, ...)                                             \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__) NAME##_##DT##_h##D(const PARAMS p) { \
        FN<T, D>(p);                                                                           \
    }

#define KVP_INSTANTIATE(DT, T, D)                                                                       \
    KVP_KERNEL(kvp_kv_write, kvp_kv_write_params, kvp::kv_write, DT, T, D, KVP_KV_WRITE_THREADS)         \
    KVP_KERNEL(kvp_paged_decode, kvp_decode_params, kvp::paged_decode, DT, T, D, KVP_DECODE_THREADS)    \
    KVP_KERNEL(kvp_paged_decode_combine, kvp_decode_params, kvp::decode_combine, DT, T, D,               \
               KVP_COMBINE_THREADS)                                                                     \
    KVP_KERNEL(kvp_merge_states, kvp_merge_params, kvp::merge_states, DT, T, D, KVP_MERGE_THREADS)      \
    KVP_KERNEL(kvp_paged_prefill, kvp_prefill_params, kvp::paged_prefill, DT, T, D, KVP_PREFILL_THREADS)

KVP_INSTANTIATE(f32, float, 64)
KVP_INSTANTIATE(f32, float, 128)
KVP_INSTANTIATE(f32, float, 256)
KVP_INSTANTIATE(f16, kvp::f16, 64)
KVP_INSTANTIATE(f16, kvp::f16, 128)
KVP_INSTANTIATE(f16, kvp::f16, 256)
KVP_INSTANTIATE(bf16, kvp::bf16, 64)
KVP_INSTANTIATE(bf16, kvp::bf16, 128)
KVP_INSTANTIATE(bf16, kvp::bf16, 256)

// Over an e4m3 cache: the KV write that quantises, the decode and the sm_80
// prefill that read it (their combine and merge are the 16-bit ones).
#define KVP_E4M3_INSTANTIATE(DT, T, D)                                                                    \
    KVP_KERNEL(kvp_kv_write, kvp_kv_write_params, kvp::kv_write_e4m3, DT##_e4m3, T, D, KVP_KV_WRITE_THREADS) \
    KVP_KERNEL(kvp_paged_decode, kvp_decode_params, kvp::paged_decode_e4m3, DT##_e4m3, T, D, KVP_DECODE_THREADS,  \
               KVP_DECODE_E4M3_MIN_BLOCKS(D))                                                                  \
    KVP_KERNEL(kvp_paged_prefill, kvp_prefill_params, kvp::paged_prefill_e4m3, DT##_e4m3, T, D, KVP_PREFILL_THREADS)

KVP_E4M3_INSTANTIATE(f16, kvp::f16, 64)
KVP_E4M3_INSTANTIATE(f16, kvp::f16, 128)
KVP_E4M3_INSTANTIATE(f16, kvp::f16, 256)
KVP_E4M3_INSTANTIATE(bf16, kvp::bf16, 64)
KVP_E4M3_INSTANTIATE(bf16, kvp::bf16, 128)
KVP_E4M3_INSTANTIATE(bf16, kvp::bf16, 256)

// Hopper prefill (kvp_prefill_sm90.cuh): real code only in the sm_90a pass.
#include "kvp_prefill_sm90.cuh"

// Every 16-bit (dtype, head_dim) instantiation of a kernel family M.
#define KVP_FOR_16BIT(M)                                                                       \
    M(f16, kvp::f16, 64) M(f16, kvp::f16, 128) M(f16, kvp::f16, 256) M(bf16, kvp::bf16, 64)    \
        M(bf16, kvp::bf16, 128) M(bf16, kvp::bf16, 256)

// A kernel on Hopper's mainloop: one block of KVP_PREFILL_SM90_THREADS per SM.
#define KVP_SM90_KERNEL(NAME, PARAMS, FN, DT, T, D) \
    KVP_KERNEL(NAME, PARAMS, FN, DT, T, D, KVP_PREFILL_SM90_THREADS, 1)

#define KVP_PREFILL_SM90_INSTANTIATE(DT, T, D)                                                 \
    static_assert(kvp::Sm90Cfg<T, D>::SMEM == 0 + 1024 + 2 * 128 * D + 8 * kvp::Sm90Cfg<T, D>::TN * D + \
                      16 * kvp::Sm90Cfg<T, D>::TN + 128, "kvp_prefill_sm90_smem_bytes");             \
    KVP_SM90_KERNEL(kvp_paged_prefill_sm90, kvp_prefill_params, kvp::paged_prefill_sm90, DT, T, D)

KVP_FOR_16BIT(KVP_PREFILL_SM90_INSTANTIATE)

static_assert(kvp::Sm90Cfg<kvp::f16, 64, true>::SMEM == 111360, "kvp_prefill_sm90_smem_bytes_e4m3 h64");
static_assert(kvp::Sm90Cfg<kvp::f16, 128, true>::SMEM == 217856, "kvp_prefill_sm90_smem_bytes_e4m3 h128");
static_assert(kvp::Sm90Cfg<kvp::f16, 256, true>::SMEM == 232160, "kvp_prefill_sm90_smem_bytes_e4m3 h256");
#define KVP_PREFILL_SM90_E4M3_INSTANTIATE(DT, T, D)                                                      \
    KVP_SM90_KERNEL(kvp_paged_prefill_sm90, kvp_prefill_params, kvp::paged_prefill_sm90_e4m3, DT##_e4m3, T, D)

KVP_FOR_16BIT(KVP_PREFILL_SM90_E4M3_INSTANTIATE)

// FP8 Q/K/V on the Hopper mainloop (KVP_PREFILL_FP8_QKV plans), head_dim 128.
static_assert(kvp::Sm90Cfg<kvp::f16, 128, false, true>::SMEM == 122112, "kvp_prefill_sm90_smem_bytes_fp8 h128");
KVP_SM90_KERNEL(kvp_paged_prefill_sm90, kvp_prefill_params, kvp::paged_prefill_sm90_fp8, f16_e4m3_qkv, kvp::f16, 128)
KVP_SM90_KERNEL(kvp_paged_prefill_sm90, kvp_prefill_params, kvp::paged_prefill_sm90_fp8, bf16_e4m3_qkv, kvp::bf16, 128)

// The plan kernel depends on neither dtype nor head_dim.
extern "C" __global__ void __launch_bounds__(KVP_PREFILL_PLAN_THREADS) kvp_prefill_plan(const kvp_prefill_plan_params p) {
    kvp::prefill_plan(p);
}

// ---------------------------------------------------------------------------
// Shared-prefix (cascade) attention: 16-bit q; the cache 16-bit or e4m3.
#include "kvp_cascade.cuh"

KVP_LAYOUT(kvp_cascade_params, 240, (kv, 0)(q, 96)(seq_lens, 104)(work, 128)(part_lse, 144)(q_batch_stride, 152)
           (out_head_stride, 176)(num_q_heads, 184)(items_off, 188)(qrows_off, 192)(max_batch, 204)(scale, 208)
           (rowseq_off, 212)(max_rows, 220)(skip_shared, 224)(reserved, 228)(sinks, 232));
static_assert(kvp::CascadeCfg<64>::SMEM == 70144, "cascade smem h64 (header formula)");
static_assert(kvp::CascadeCfg<128>::SMEM == 104448, "cascade smem h128 (header formula)");
static_assert(kvp::CascadeCfg<256>::SMEM == 165376, "cascade smem h256 (header formula)");

#define KVP_CASCADE_INSTANTIATE(DT, T, D)                                                             \
    KVP_KERNEL(kvp_cascade, kvp_cascade_params, kvp::cascade_attn, DT, T, D, KVP_CASCADE_THREADS)     \
    KVP_KERNEL(kvp_cascade_merge, kvp_cascade_params, kvp::cascade_merge, DT, T, D, KVP_CASCADE_MERGE_THREADS)

KVP_FOR_16BIT(KVP_CASCADE_INSTANTIATE)

// Over an e4m3 cache: the attention kernel (the merge is the 16-bit one).
static_assert(kvp::CascadeCfg<64, true>::SMEM == 46608, "cascade e4m3 smem h64 (header formula)");
static_assert(kvp::CascadeCfg<128, true>::SMEM == 69648, "cascade e4m3 smem h128 (header formula)");
static_assert(kvp::CascadeCfg<256, true>::SMEM == 102416, "cascade e4m3 smem h256 (header formula)");
#define KVP_CASCADE_E4M3_INSTANTIATE(DT, T, D) \
    KVP_KERNEL(kvp_cascade, kvp_cascade_params, kvp::cascade_attn_e4m3, DT##_e4m3, T, D, KVP_CASCADE_THREADS)

KVP_FOR_16BIT(KVP_CASCADE_E4M3_INSTANTIATE)

// The shared items on Hopper (real code only in the sm_90a pass).
#define KVP_CASCADE_SM90_INSTANTIATE(DT, T, D)                                                 \
    KVP_SM90_KERNEL(kvp_cascade_sm90, kvp_cascade_params, kvp::cascade_shared_sm90, DT, T, D)

KVP_FOR_16BIT(KVP_CASCADE_SM90_INSTANTIATE)

#define KVP_CASCADE_SM90_E4M3_INSTANTIATE(DT, T, D) \
    KVP_SM90_KERNEL(kvp_cascade_sm90, kvp_cascade_params, kvp::cascade_shared_sm90_e4m3, DT##_e4m3, T, D)

KVP_FOR_16BIT(KVP_CASCADE_SM90_E4M3_INSTANTIATE)

// ---------------------------------------------------------------------------
// Tier copy (dtype-blind).
#include "kvp_tier_copy.cuh"

KVP_LAYOUT(kvp_tier_copy_params, 4080, (chunk_bytes, 24)(num_layers, 48)(n_demote, 60)(num_slots, 72)(ops, 80));

extern "C" __global__ void __launch_bounds__(KVP_TIER_COPY_THREADS) kvp_tier_copy(const __grid_constant__ kvp_tier_copy_params p) {
    kvp::tier_copy(p);
}
