"""Python mirror of kernels/kvplug_kernels.h for the scripts that launch the
kernels straight from the fatbin (bench/decode_bench.py): every parameter
struct of the header as a numpy dtype, field for field (offsets and sizes
checked against the header by tests/python/test_kernel_abi_mirror.py), and
the dynamic shared-memory formula.

The paged-KV descriptor (kvp_paged_kv_params) is the nested field `kv` of
the structs that embed it: pack it with paged_kv() and assign it, e.g.
``p["kv"] = paged_kv(k_cache=..., ...)``, or set ``p["kv"]["block_size"]``."""

import numpy as np

ABI_VERSION = 9  # KVP_KERNELS_ABI_VERSION


def _struct(fields, size):
    """fields: (name, numpy format or nested dtype) in order, packed with no
    padding (the header's structs have none); size: the header's sizeof."""
    names, formats, offsets, off = [], [], [], 0
    for n, f in fields:
        f = np.dtype(f)
        names.append(n)
        formats.append(f)
        offsets.append(off)
        off += f.itemsize
    assert off == size, (off, size)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": size})


def _u64(*names):
    return [(n, "<u8") for n in names]


def _i64(*names):
    return [(n, "<i8") for n in names]


def _i32(*names):
    return [(n, "<i4") for n in names]


# kvp_paged_kv_params
PAGED_KV = _struct(_u64("k_cache", "v_cache", "block_table", "k_scale", "v_scale")
                   + _i64("block_stride", "token_stride", "head_stride", "block_table_stride")
                   + _i32("num_kv_heads", "block_size", "num_blocks", "max_blocks_per_seq", "dtype", "scale_kind"), 96)
# kvp_kv_write_params
KV_WRITE = _struct([("kv", PAGED_KV)] + _u64("key", "value", "slot_mapping")
                   + _i64("key_token_stride", "key_head_stride", "value_token_stride", "value_head_stride")
                   + _i32("num_tokens", "reserved"), 160)
# kvp_decode_params
DECODE = _struct([("kv", PAGED_KV)] + _u64("q", "seq_lens", "out", "lse", "workspace")
                 + _i64("q_batch_stride", "q_head_stride", "out_batch_stride", "out_head_stride")
                 + _i32("batch", "num_q_heads", "num_splits") + [("scale", "<f4")] + _i32("q_len", "q_rows")
                 + _u64("q_indptr", "sinks") + _i32("window_left", "reserved"), 216)
# kvp_merge_params
MERGE_MAX_STATES = 8  # KVP_MERGE_MAX_STATES
MERGE = _struct([("v", ("<u8", (MERGE_MAX_STATES,))), ("s", ("<u8", (MERGE_MAX_STATES,)))] + _u64("out", "out_lse")
                + _i64("v_token_stride", "v_head_stride", "s_token_stride", "s_head_stride", "out_token_stride",
                       "out_head_stride", "out_lse_token_stride", "out_lse_head_stride")
                + _i32("num_states", "num_tokens", "num_heads", "reserved") + _u64("sinks"), 232)
# kvp_prefill_plan_params
PREFILL_PLAN = _struct(_u64("qo_indptr", "kv_lens", "work")
                       + _i32("batch", "group", "total_q", "max_items", "tile_q", "num_splits", "skip_decode",
                              "reserved"), 56)
# kvp_prefill_params
PREFILL = _struct([("kv", PAGED_KV)] + _u64("q", "out", "lse", "work")
                  + _i64("q_token_stride", "q_head_stride", "out_token_stride", "out_head_stride")
                  + _i32("num_q_heads", "window_left") + [("scale", "<f4")] + _i32("num_splits")
                  + _u64("part_out", "part_lse") + _i32("total_q", "reserved") + _u64("sinks"), 208)
# kvp_cascade_params
CASCADE = _struct([("kv", PAGED_KV)] + _u64("q", "seq_lens", "out", "lse", "work", "part_out", "part_lse")
                  + _i64("q_batch_stride", "q_head_stride", "out_batch_stride", "out_head_stride")
                  + _i32("num_q_heads", "items_off", "qrows_off", "seg_start_off", "segs_off", "max_batch")
                  + [("scale", "<f4")] + _i32("rowseq_off", "qstart_off", "max_rows", "skip_shared", "reserved")
                  + _u64("sinks"), 240)
# kvp_tier_copy_params
TIER_COPY_OPS = 500  # KVP_TIER_COPY_OPS
TIER_COPY = _struct(_u64("layers", "host") + _i64("slot_bytes", "chunk_bytes", "k_block_stride", "v_block_stride")
                    + _i32("num_layers", "kv", "n_ops", "n_demote", "parts", "num_blocks", "num_slots", "reserved")
                    + [("ops", ("<i4", (TIER_COPY_OPS, 2)))], 4080)

# The header's struct of each mirror.
STRUCTS = {
    "kvp_paged_kv_params": PAGED_KV,
    "kvp_kv_write_params": KV_WRITE,
    "kvp_decode_params": DECODE,
    "kvp_merge_params": MERGE,
    "kvp_prefill_plan_params": PREFILL_PLAN,
    "kvp_prefill_params": PREFILL,
    "kvp_cascade_params": CASCADE,
    "kvp_tier_copy_params": TIER_COPY,
}

DTYPE_F16, DTYPE_BF16, DTYPE_F32 = 1, 2, 3  # kvp_dtype codes (include/kvplug.h)


def paged_kv(**fields):
    """One kvp_paged_kv_params (a numpy scalar of PAGED_KV) with the given
    fields set and the others (scales, reserved) zero."""
    kv = np.zeros((), dtype=PAGED_KV)
    for k, v in fields.items():
        kv[k] = v
    return kv


def cdiv(a, b):
    return (a + b - 1) // b


def decode_smem(dtype_bytes, head_dim):
    """kvp_decode_smem_bytes() of kvplug_kernels.h."""
    if dtype_bytes == 4:
        return 0
    stages = 4 if head_dim <= 64 else (3 if head_dim <= 128 else 2)
    return stages * 64 * head_dim * 4 + 16 * head_dim * 2 + (stages + 1) * 64 * 8
