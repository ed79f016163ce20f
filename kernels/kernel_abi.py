"""Python mirror of kernels/kvplug_kernels.h for the scripts that launch the
kernels straight from the fatbin (bench/decode_bench.py): the parameter
structs as numpy dtypes, whose sizes are asserted against the header's, and
the dynamic shared-memory formula."""

import numpy as np


def _struct(fields, size):
    names, formats, offsets, off = [], [], [], 0
    for n, f in fields:
        names.append(n)
        formats.append(f)
        offsets.append(off)
        off += np.dtype(f).itemsize
    assert off == size, (off, size)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": size})


# kvp_kv_write_params
KV_WRITE = _struct([(n, "<u8") for n in ("key", "value", "k_cache", "v_cache", "slot_mapping")]
                   + [(n, "<i8") for n in ("key_token_stride", "key_head_stride", "value_token_stride",
                                           "value_head_stride", "cache_block_stride", "cache_token_stride",
                                           "cache_head_stride")]
                   + [(n, "<i4") for n in ("num_tokens", "num_kv_heads", "block_size", "num_blocks")], 112)
# kvp_decode_params
DECODE = _struct([(n, "<u8") for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "out", "lse",
                                       "workspace")]
                 + [(n, "<i8") for n in ("q_batch_stride", "q_head_stride", "out_batch_stride", "out_head_stride",
                                         "cache_block_stride", "cache_token_stride", "cache_head_stride",
                                         "block_table_stride")]
                 + [(n, "<i4") for n in ("batch", "num_q_heads", "num_kv_heads", "block_size", "num_blocks",
                                         "max_blocks_per_seq", "num_splits")]
                 + [("scale", "<f4"), ("q_len", "<i4"), ("q_rows", "<i4"), ("q_indptr", "<u8")], 176)
# kvp_merge_params
MERGE = _struct([(f"v{i}", "<u8") for i in range(8)] + [(f"s{i}", "<u8") for i in range(8)]
                + [(n, "<u8") for n in ("out", "out_lse")]
                + [(n, "<i8") for n in ("v_token_stride", "v_head_stride", "s_token_stride", "s_head_stride",
                                        "out_token_stride", "out_head_stride", "out_lse_token_stride",
                                        "out_lse_head_stride")]
                + [(n, "<i4") for n in ("num_states", "num_tokens", "num_heads", "reserved")], 224)


def cdiv(a, b):
    return (a + b - 1) // b


def decode_smem(dtype_bytes, head_dim):
    """kvp_decode_smem_bytes() of kvplug_kernels.h."""
    if dtype_bytes == 4:
        return 0
    stages = 4 if head_dim <= 64 else (3 if head_dim <= 128 else 2)
    return stages * 64 * head_dim * 4 + 16 * head_dim * 2 + (stages + 1) * 64 * 8
