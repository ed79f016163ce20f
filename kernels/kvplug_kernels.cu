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
static_assert(sizeof(kvp_paged_kv_params) == 96, "kvp_paged_kv_params size");
KVP_OFF(kvp_paged_kv_params, v_cache, 8);
KVP_OFF(kvp_paged_kv_params, block_table, 16);
KVP_OFF(kvp_paged_kv_params, k_scale, 24);
KVP_OFF(kvp_paged_kv_params, v_scale, 32);
KVP_OFF(kvp_paged_kv_params, block_stride, 40);
KVP_OFF(kvp_paged_kv_params, token_stride, 48);
KVP_OFF(kvp_paged_kv_params, head_stride, 56);
KVP_OFF(kvp_paged_kv_params, block_table_stride, 64);
KVP_OFF(kvp_paged_kv_params, num_kv_heads, 72);
KVP_OFF(kvp_paged_kv_params, block_size, 76);
KVP_OFF(kvp_paged_kv_params, num_blocks, 80);
KVP_OFF(kvp_paged_kv_params, max_blocks_per_seq, 84);
KVP_OFF(kvp_paged_kv_params, dtype, 88);
KVP_OFF(kvp_paged_kv_params, reserved, 92);
static_assert(sizeof(kvp_kv_write_params) == 160, "kvp_kv_write_params size");
KVP_OFF(kvp_kv_write_params, kv, 0);
KVP_OFF(kvp_kv_write_params, key, 96);
KVP_OFF(kvp_kv_write_params, slot_mapping, 112);
KVP_OFF(kvp_kv_write_params, key_token_stride, 120);
KVP_OFF(kvp_kv_write_params, value_head_stride, 144);
KVP_OFF(kvp_kv_write_params, num_tokens, 152);
KVP_OFF(kvp_kv_write_params, reserved, 156);
static_assert(sizeof(kvp_decode_params) == 200, "kvp_decode_params size");
KVP_OFF(kvp_decode_params, kv, 0);
KVP_OFF(kvp_decode_params, q, 96);
KVP_OFF(kvp_decode_params, seq_lens, 104);
KVP_OFF(kvp_decode_params, workspace, 128);
KVP_OFF(kvp_decode_params, q_batch_stride, 136);
KVP_OFF(kvp_decode_params, out_head_stride, 160);
KVP_OFF(kvp_decode_params, batch, 168);
KVP_OFF(kvp_decode_params, num_splits, 176);
KVP_OFF(kvp_decode_params, scale, 180);
KVP_OFF(kvp_decode_params, q_len, 184);
KVP_OFF(kvp_decode_params, q_rows, 188);
KVP_OFF(kvp_decode_params, q_indptr, 192);
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
static_assert(sizeof(kvp_prefill_params) == 200, "kvp_prefill_params size");
KVP_OFF(kvp_prefill_params, kv, 0);
KVP_OFF(kvp_prefill_params, q, 96);
KVP_OFF(kvp_prefill_params, work, 120);
KVP_OFF(kvp_prefill_params, q_token_stride, 128);
KVP_OFF(kvp_prefill_params, out_head_stride, 152);
KVP_OFF(kvp_prefill_params, num_q_heads, 160);
KVP_OFF(kvp_prefill_params, window_left, 164);
KVP_OFF(kvp_prefill_params, scale, 168);
KVP_OFF(kvp_prefill_params, num_splits, 172);
KVP_OFF(kvp_prefill_params, part_out, 176);
KVP_OFF(kvp_prefill_params, part_lse, 184);
KVP_OFF(kvp_prefill_params, total_q, 192);
KVP_OFF(kvp_prefill_params, reserved, 196);
static_assert(kvp::PrefillCfg<64>::SMEM == 59392, "prefill smem h64 (header formula)");
static_assert(kvp::PrefillCfg<128>::SMEM == 83456, "prefill smem h128 (header formula)");
static_assert(kvp::PrefillCfg<256>::SMEM == 165376, "prefill smem h256 (header formula)");
static_assert(kvp::DecodeCfg<64>::SMEM == 70144, "smem h64 (header formula)");
static_assert(kvp::DecodeCfg<128>::SMEM == 104448, "smem h128 (header formula)");
static_assert(kvp::DecodeCfg<256>::SMEM == 140800, "smem h256 (header formula)");

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

// The plan kernel depends on neither dtype nor head_dim.
extern "C" __global__ void __launch_bounds__(KVP_PREFILL_PLAN_THREADS) kvp_prefill_plan(const kvp_prefill_plan_params p) {
    kvp::prefill_plan(p);
}

// ---------------------------------------------------------------------------
// Shared-prefix (cascade) attention: 16-bit types only.
#include "kvp_cascade.cuh"

static_assert(sizeof(kvp_cascade_params) == 232, "kvp_cascade_params size");
KVP_OFF(kvp_cascade_params, kv, 0);
KVP_OFF(kvp_cascade_params, q, 96);
KVP_OFF(kvp_cascade_params, seq_lens, 104);
KVP_OFF(kvp_cascade_params, work, 128);
KVP_OFF(kvp_cascade_params, part_lse, 144);
KVP_OFF(kvp_cascade_params, q_batch_stride, 152);
KVP_OFF(kvp_cascade_params, out_head_stride, 176);
KVP_OFF(kvp_cascade_params, num_q_heads, 184);
KVP_OFF(kvp_cascade_params, items_off, 188);
KVP_OFF(kvp_cascade_params, qrows_off, 192);
KVP_OFF(kvp_cascade_params, max_batch, 204);
KVP_OFF(kvp_cascade_params, scale, 208);
KVP_OFF(kvp_cascade_params, rowseq_off, 212);
KVP_OFF(kvp_cascade_params, max_rows, 220);
KVP_OFF(kvp_cascade_params, skip_shared, 224);
KVP_OFF(kvp_cascade_params, reserved, 228);
static_assert(kvp::CascadeCfg<64>::SMEM == 70144, "cascade smem h64 (header formula)");
static_assert(kvp::CascadeCfg<128>::SMEM == 104448, "cascade smem h128 (header formula)");
static_assert(kvp::CascadeCfg<256>::SMEM == 165376, "cascade smem h256 (header formula)");

#define KVP_CASCADE_INSTANTIATE(DT, T, D)                                                             \
    KVP_KERNEL(kvp_cascade, kvp_cascade_params, kvp::cascade_attn, DT, T, D, KVP_CASCADE_THREADS)     \
    KVP_KERNEL(kvp_cascade_merge, kvp_cascade_params, kvp::cascade_merge, DT, T, D, KVP_CASCADE_MERGE_THREADS)

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
