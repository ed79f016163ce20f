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
// The host side mirrors these layouts field for field: freeze them.
#define KVP_OFF(T, f, o) static_assert(offsetof(T, f) == (o), #T "." #f " offset")
static_assert(sizeof(kvp_kv_write_params) == 112, "kvp_kv_write_params size");
KVP_OFF(kvp_kv_write_params, slot_mapping, 32);
KVP_OFF(kvp_kv_write_params, key_token_stride, 40);
KVP_OFF(kvp_kv_write_params, cache_head_stride, 88);
KVP_OFF(kvp_kv_write_params, num_tokens, 96);
KVP_OFF(kvp_kv_write_params, num_blocks, 108);
static_assert(sizeof(kvp_decode_params) == 176, "kvp_decode_params size");
KVP_OFF(kvp_decode_params, q_indptr, 168);
KVP_OFF(kvp_decode_params, q_len, 160);
KVP_OFF(kvp_decode_params, workspace, 56);
KVP_OFF(kvp_decode_params, q_batch_stride, 64);
KVP_OFF(kvp_decode_params, block_table_stride, 120);
KVP_OFF(kvp_decode_params, batch, 128);
KVP_OFF(kvp_decode_params, num_blocks, 144);
KVP_OFF(kvp_decode_params, num_splits, 152);
KVP_OFF(kvp_decode_params, scale, 156);
static_assert(sizeof(kvp_merge_params) == 224, "kvp_merge_params size");
KVP_OFF(kvp_merge_params, s, 64);
KVP_OFF(kvp_merge_params, out, 128);
KVP_OFF(kvp_merge_params, out_lse, 136);
KVP_OFF(kvp_merge_params, v_token_stride, 144);
KVP_OFF(kvp_merge_params, out_lse_head_stride, 200);
KVP_OFF(kvp_merge_params, num_states, 208);
KVP_OFF(kvp_merge_params, reserved, 220);

static_assert(sizeof(kvp_prefill_plan_params) == 56, "kvp_prefill_plan_params size");
KVP_OFF(kvp_prefill_plan_params, skip_decode, 48);
KVP_OFF(kvp_prefill_plan_params, tile_q, 40);
KVP_OFF(kvp_prefill_plan_params, work, 16);
KVP_OFF(kvp_prefill_plan_params, batch, 24);
KVP_OFF(kvp_prefill_plan_params, max_items, 36);
static_assert(sizeof(kvp_prefill_params) == 176, "kvp_prefill_params size");
KVP_OFF(kvp_prefill_params, total_q, 168);
KVP_OFF(kvp_prefill_params, num_splits, 148);
KVP_OFF(kvp_prefill_params, part_lse, 160);
KVP_OFF(kvp_prefill_params, work, 48);
KVP_OFF(kvp_prefill_params, q_token_stride, 56);
KVP_OFF(kvp_prefill_params, block_table_stride, 112);
KVP_OFF(kvp_prefill_params, num_q_heads, 120);
KVP_OFF(kvp_prefill_params, window_left, 140);
KVP_OFF(kvp_prefill_params, scale, 144);
static_assert(kvp::PrefillCfg<64>::SMEM == 59392, "prefill smem h64 (header formula)");
static_assert(kvp::PrefillCfg<128>::SMEM == 83456, "prefill smem h128 (header formula)");
static_assert(kvp::PrefillCfg<256>::SMEM == 165376, "prefill smem h256 (header formula)");
static_assert(kvp::DecodeCfg<64>::SMEM == 70144, "smem h64 (header formula)");
static_assert(kvp::DecodeCfg<128>::SMEM == 104448, "smem h128 (header formula)");
static_assert(kvp::DecodeCfg<256>::SMEM == 140800, "smem h256 (header formula)");

// ---------------------------------------------------------------------------
// Instantiations: every kernel for every (dtype, head_dim).
#define KVP_INSTANTIATE(DT, T, D)                                                              \
    extern "C" __global__ void __launch_bounds__(KVP_KV_WRITE_THREADS)                         \
        kvp_kv_write_##DT##_h##D(const kvp_kv_write_params p) {                                \
        kvp::kv_write<T, D>(p);                                                                \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(KVP_DECODE_THREADS)                           \
        kvp_paged_decode_##DT##_h##D(const kvp_decode_params p) {                              \
        kvp::paged_decode<T, D>(p);                                                            \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(KVP_COMBINE_THREADS)                          \
        kvp_paged_decode_combine_##DT##_h##D(const kvp_decode_params p) {                      \
        kvp::decode_combine<T, D>(p);                                                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(KVP_MERGE_THREADS)                            \
        kvp_merge_states_##DT##_h##D(const kvp_merge_params p) {                               \
        kvp::merge_states<T, D>(p);                                                            \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(KVP_PREFILL_THREADS)                          \
        kvp_paged_prefill_##DT##_h##D(const kvp_prefill_params p) {                            \
        kvp::paged_prefill<T, D>(p);                                                           \
    }

KVP_INSTANTIATE(f32, float, 64)
KVP_INSTANTIATE(f32, float, 128)
KVP_INSTANTIATE(f32, float, 256)
KVP_INSTANTIATE(f16, kvp::f16, 64)
KVP_INSTANTIATE(f16, kvp::f16, 128)
KVP_INSTANTIATE(f16, kvp::f16, 256)
KVP_INSTANTIATE(bf16, kvp::bf16, 64)
KVP_INSTANTIATE(bf16, kvp::bf16, 128)
KVP_INSTANTIATE(bf16, kvp::bf16, 256)

// Hopper prefill (kvp_prefill_sm90.cuh): real code only in the sm_90a pass.
#include "kvp_prefill_sm90.cuh"

// Every 16-bit (dtype, head_dim) instantiation of a kernel family M.
#define KVP_FOR_16BIT(M)                                                                       \
    M(f16, kvp::f16, 64) M(f16, kvp::f16, 128) M(f16, kvp::f16, 256) M(bf16, kvp::bf16, 64)    \
        M(bf16, kvp::bf16, 128) M(bf16, kvp::bf16, 256)

// A kernel on Hopper's mainloop: NAME_<dt>_h<D>(PARAMS) runs FN<T, D>.
#define KVP_SM90_KERNEL(NAME, PARAMS, FN, DT, T, D)                                            \
    extern "C" __global__ void __launch_bounds__(KVP_PREFILL_SM90_THREADS, 1)                  \
        NAME##_##DT##_h##D(const PARAMS p) {                                                   \
        FN<T, D>(p);                                                                           \
    }

#define KVP_PREFILL_SM90_INSTANTIATE(DT, T, D)                                                 \
    static_assert(kvp::Sm90Cfg<T, D>::SMEM == 0 + 1024 + 2 * 128 * D + 8 * kvp::Sm90Cfg<T, D>::TN * D + \
                      16 * kvp::Sm90Cfg<T, D>::TN + 128, "kvp_prefill_sm90_smem_bytes");             \
    KVP_SM90_KERNEL(kvp_paged_prefill_sm90, kvp_prefill_params, kvp::paged_prefill_sm90, DT, T, D)

KVP_FOR_16BIT(KVP_PREFILL_SM90_INSTANTIATE)

// The plan kernel depends on neither dtype nor head_dim.
extern "C" __global__ void __launch_bounds__(KVP_PREFILL_PLAN_THREADS) kvp_prefill_plan(const kvp_prefill_plan_params p) {
    kvp::prefill_plan(p);
}

// ---------------------------------------------------------------------------
// Shared-prefix (cascade) attention: 16-bit types only.
#include "kvp_cascade.cuh"

static_assert(sizeof(kvp_cascade_params) == 208, "kvp_cascade_params size");
KVP_OFF(kvp_cascade_params, skip_shared, 200);
KVP_OFF(kvp_cascade_params, part_lse, 72);
KVP_OFF(kvp_cascade_params, q_batch_stride, 80);
KVP_OFF(kvp_cascade_params, block_table_stride, 136);
KVP_OFF(kvp_cascade_params, num_q_heads, 144);
KVP_OFF(kvp_cascade_params, items_off, 164);
KVP_OFF(kvp_cascade_params, max_batch, 180);
KVP_OFF(kvp_cascade_params, qrows_off, 168);
KVP_OFF(kvp_cascade_params, scale, 184);
KVP_OFF(kvp_cascade_params, rowseq_off, 188);
KVP_OFF(kvp_cascade_params, max_rows, 196);
static_assert(kvp::CascadeCfg<64>::SMEM == 70144, "cascade smem h64 (header formula)");
static_assert(kvp::CascadeCfg<128>::SMEM == 104448, "cascade smem h128 (header formula)");
static_assert(kvp::CascadeCfg<256>::SMEM == 165376, "cascade smem h256 (header formula)");

#define KVP_CASCADE_INSTANTIATE(DT, T, D)                                                      \
    extern "C" __global__ void __launch_bounds__(KVP_CASCADE_THREADS)                          \
        kvp_cascade_##DT##_h##D(const kvp_cascade_params p) {                                  \
        kvp::cascade_attn<T, D>(p);                                                            \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(KVP_CASCADE_MERGE_THREADS)                    \
        kvp_cascade_merge_##DT##_h##D(const kvp_cascade_params p) {                            \
        kvp::cascade_merge<T, D>(p);                                                           \
    }

KVP_FOR_16BIT(KVP_CASCADE_INSTANTIATE)

// The shared items on Hopper (real code only in the sm_90a pass).
#define KVP_CASCADE_SM90_INSTANTIATE(DT, T, D)                                                 \
    KVP_SM90_KERNEL(kvp_cascade_sm90, kvp_cascade_params, kvp::cascade_shared_sm90, DT, T, D)

KVP_FOR_16BIT(KVP_CASCADE_SM90_INSTANTIATE)

// ---------------------------------------------------------------------------
// Tier copy (dtype-blind).
#include "kvp_tier_copy.cuh"

static_assert(sizeof(kvp_tier_copy_params) == 4080, "kvp_tier_copy_params size");
KVP_OFF(kvp_tier_copy_params, chunk_bytes, 24);
KVP_OFF(kvp_tier_copy_params, num_layers, 48);
KVP_OFF(kvp_tier_copy_params, n_demote, 60);
KVP_OFF(kvp_tier_copy_params, num_slots, 72);
KVP_OFF(kvp_tier_copy_params, ops, 80);

extern "C" __global__ void __launch_bounds__(KVP_TIER_COPY_THREADS) kvp_tier_copy(const __grid_constant__ kvp_tier_copy_params p) {
    kvp::tier_copy(p);
}
