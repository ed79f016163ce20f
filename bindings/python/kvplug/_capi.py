"""include/kvplug.h in ctypes: every struct the package passes, and every
function with its signature, in one table (FUNCTIONS), as the C++ wrapper's
function tables (bindings/cpp/kvplug.hpp) have them.

Nothing here loads the library: kvplug._lib binds FUNCTIONS once, when it
loads it, into kvplug._lib.C (C.kvp_manager_add(...)). Pointer arguments are
c_void_p: a caller passes an address (int), a ctypes array, ctypes.byref(...)
or None. tests/python/test_abi_mirror.py checks every struct against the
header (size and every field's offset) and tests/python/test_capi.py every
function name against its prototypes.
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Tuple

_vp = ctypes.c_void_p
_int = ctypes.c_int  # kvp_status
_i32, _i64, _u32, _u64, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_float
_u8 = ctypes.c_uint8
_size = ctypes.c_size_t

MERGE_MAX_STATES = 8  # KVP_MERGE_MAX_STATES


def _ints(ctype: Any, *names: str) -> List[Tuple[str, Any]]:
    return [(n, ctype) for n in names]


def _tensor(name: str, *strides: str) -> List[Tuple[str, Any]]:
    """A device address and its strides in elements: name, name_<s>_stride."""
    return [(name, _u64)] + [(f"{name}_{s}_stride", _i64) for s in strides]


# The paged caches and the block table of the attention structs (K and V
# share the strides).
_CACHES = [("k_cache", _u64), ("v_cache", _u64)] + _ints(_i64, "cache_block_stride", "cache_token_stride",
                                                          "cache_head_stride")
_TABLE = [("block_table", _u64), ("block_table_stride", _i64)]


# --------------------------------------------------------------------------
# Paged KV manager
# --------------------------------------------------------------------------


class ManagerConfig(ctypes.Structure):
    """struct kvp_manager_config (append-only, like the C struct)."""

    _fields_ = [
        ("struct_size", _size),
        ("num_blocks", _i32),
        ("block_size", _i32),
        ("enable_prefix_cache", _i32),
        ("enable_kv_events", _i32),
        ("max_pending_events", _i32),
        ("host_tier_slots", _i32),
        ("demote_ahead", _i32),
        ("demote_evicted", _i32),
        ("host_block_bytes", _i64),
        ("shared_tier_addr", ctypes.c_char_p),
        ("shared_tier_namespace", ctypes.c_char_p),
        ("shared_tier_timeout_ms", _i32),
        ("shared_tier_put_queue", _i32),
        ("host_tier_memory", _vp),
        ("shared_tier_username", ctypes.c_char_p),
        ("shared_tier_password_env", ctypes.c_char_p),
        ("shared_tier_password_file", ctypes.c_char_p),
        ("shared_tier_tls_ca_file", ctypes.c_char_p),
        ("shared_tier_tls_cert_file", ctypes.c_char_p),
        ("shared_tier_tls_key_file", ctypes.c_char_p),
        ("shared_tier_tls_server_name", ctypes.c_char_p),
        ("shared_tier_mac_keys_env", ctypes.c_char_p),
        ("shared_tier_mac_keys_file", ctypes.c_char_p),
        ("shared_tier_tls", _i32),
        ("shared_tier_reserved", _i32),
        ("write_through", _i32),
        ("write_through_slack", _i32),
        ("layer_groups", _vp),
        ("num_layer_groups", _i32),
        ("max_model_len", _i32),
        ("block_bytes", _i64),
    ]


class LayerGroupStruct(ctypes.Structure):
    """struct kvp_layer_group."""

    _fields_ = [("kind", _i32), ("window", _i32), ("state_bytes", _i64), ("checkpoint_every", _i32), ("reserved", _i32)]


class BlockCopy(ctypes.Structure):
    """struct kvp_block_copy."""

    _fields_ = [("src", _i32), ("dst", _i32)]


class ManagerStatsStruct(ctypes.Structure):
    """struct kvp_manager_stats."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i32, "num_blocks", "block_size", "free_blocks", "used_blocks", "peak_used_blocks", "cached_blocks",
        "shared_blocks", "num_seqs",
    ) + _ints(_i64, "num_tokens", "allocated_slots", "internal_waste") + [("fragmentation", ctypes.c_double)]


# --------------------------------------------------------------------------
# Prefix cache
# --------------------------------------------------------------------------


class MMItemStruct(ctypes.Structure):
    """struct kvp_mm_item."""

    _fields_ = [("offset", _i32), ("length", _i32), ("hash", _u8 * 16)]


class PrefixKeysStruct(ctypes.Structure):
    """struct kvp_prefix_keys."""

    _fields_ = [
        ("adapter", _u64),
        ("mm", ctypes.POINTER(MMItemStruct)),
        ("num_mm", _i32),
        ("salt_len", _i32),
        ("salt", ctypes.POINTER(_u8)),
    ]


class PrefixMatchStruct(ctypes.Structure):
    """struct kvp_prefix_match."""

    _fields_ = [("matched_tokens", _i32), ("partial_block", _i32), ("partial_tokens", _i32)]


class BlockMatchStruct(ctypes.Structure):
    """struct kvp_block_match."""

    _fields_ = [("matched_tokens", _i32), ("block_tokens", _i32)]


class PrefixStatsStruct(ctypes.Structure):
    """struct kvp_prefix_stats."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i64, "queries", "query_tokens", "hit_tokens", "partial_tokens", "inserts", "dedups", "evictions",
        "events_dropped",
    ) + _ints(_i32, "cached_blocks", "locked_blocks", "pinned_blocks", "evictable_blocks", "pending_events",
              "uncomputed_blocks") + _ints(_i64, "dropped_uncomputed")


class BlockMMStruct(ctypes.Structure):
    """struct kvp_block_mm."""

    _fields_ = [("offset", _i32), ("hash", _u8 * 16)]


class KVEventStruct(ctypes.Structure):
    """struct kvp_kv_event."""

    _fields_ = [
        ("kind", _i32),
        ("block_size", _i32),
        ("adapter", _u64),
        ("hash", _u8 * 16),
        ("parent", _u8 * 16),
    ] + _ints(_i32, "tokens_offset", "mm_offset", "num_mm", "hashes_offset", "num_hashes", "medium")


class KVGroupEventStruct(ctypes.Structure):
    """struct kvp_kv_group_event: a kvp_kv_event and its layer group."""

    _fields_ = [("event", KVEventStruct)] + _ints(_i32, "group", "reserved")


# --------------------------------------------------------------------------
# Host KV tier
# --------------------------------------------------------------------------


class TierCopyStruct(ctypes.Structure):
    """struct kvp_tier_copy."""

    _fields_ = [("block", _i32), ("slot", _i32)]


class TierMatchStruct(ctypes.Structure):
    """struct kvp_tier_match."""

    _fields_ = [("gpu_tokens", _i32), ("host_tokens", _i32)]


class TierStatsStruct(ctypes.Structure):
    """struct kvp_tier_stats."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i64, "demotions_queued", "demotions_completed", "demotions_failed", "skipped_full", "skipped_present",
        "evicted_undemoted", "reloads", "reloads_completed", "reloads_failed", "host_hit_tokens", "match_queries",
        "match_gpu_tokens", "match_host_tokens", "host_evictions", "host_hits", "host_misses",
    ) + _ints(_i32, "in_flight", "host_slots", "host_resident", "host_reserved", "host_pinned", "reserved") + _ints(
        _i64, "shared_lookups", "shared_hits", "shared_misses", "shared_fetched", "shared_fetch_misses",
        "shared_hit_tokens", "shared_match_tokens", "shared_puts_queued", "shared_puts_done", "shared_puts_present",
        "shared_puts_failed", "shared_puts_dropped", "shared_corrupt", "shared_timeouts", "shared_errors",
        "shared_skipped", "shared_bytes_read", "shared_bytes_written",
    ) + _ints(_i32, "shared_queue_len", "shared_available") + _ints(
        _i64, "shared_auth_failures", "shared_tls_failures", "shared_mac_failures",
        "shared_redirects", "shared_map_reads") + _ints(_i32, "shared_cluster", "shared_primaries") + _ints(
        _i64, "write_through_stored", "write_through_lost") + _ints(_i32, "write_through_queue", "reserved2") + _ints(
        _i64, "shared_remembered")


class PagedKV(ctypes.Structure):
    """struct kvp_paged_kv: one layer's paged cache and block table."""

    _fields_ = [("struct_size", _size)] + _ints(_i32, "dtype", "num_kv_heads", "num_blocks", "block_size") + _ints(
        _u64, "k_cache", "v_cache",
    ) + _ints(_i64, "block_stride", "token_stride", "head_stride") + _TABLE + _ints(
        _i32, "max_blocks_per_seq", "head_dim",
    ) + _ints(_u64, "k_scale", "v_scale") + _ints(_i32, "scale_kind", "reserved")


class KVLayersStruct(ctypes.Structure):
    """struct kvp_kv_layers."""

    _fields_ = [("struct_size", _size)] + _ints(_i32, "num_layers", "num_blocks") + _ints(
        _vp, "k", "v") + _ints(_i64, "block_bytes", "k_block_stride", "v_block_stride") + [
        ("kv", ctypes.POINTER(ctypes.POINTER(PagedKV))),  # appended in 0.4: per-layer descriptors; NULL: the fields above
    ] + _ints(_i32, "flags", "reserved")  # appended in 0.7: KVP_TIER_COPY_STORE_COPY_ENGINE


# --------------------------------------------------------------------------
# KV event publisher
# --------------------------------------------------------------------------


class EventPublisherConfig(ctypes.Structure):
    """struct kvp_event_publisher_config."""

    _fields_ = [("struct_size", _size)] + _ints(ctypes.c_char_p, "endpoint", "replay_endpoint", "topic", "medium") + _ints(
        _i32, "bind_mode", "event_format", "hash_format", "data_parallel_rank", "buffer_steps", "hwm",
        "max_batch_events", "flush_interval_us",
    ) + [("buffer_bytes", _i64)]


class EventPublisherStatsStruct(ctypes.Structure):
    """struct kvp_event_publisher_stats."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i64, "batches", "events", "bytes", "dropped_sends", "replay_requests", "replay_batches", "snapshots",
        "source_errors", "buffered_batches", "buffered_bytes",
    ) + _ints(_i32, "subscribers", "pub_port", "replay_port", "reserved")


# --------------------------------------------------------------------------
# Attention kernels
# --------------------------------------------------------------------------


class KVWriteArgs(ctypes.Structure):
    """struct kvp_kv_write_args."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i32, "dtype", "head_dim", "num_tokens", "num_kv_heads", "num_blocks", "block_size",
    ) + _tensor("key", "token", "head") + _tensor("value", "token", "head") + _CACHES + [
        ("slot_mapping", _u64),
        ("kv", ctypes.POINTER(PagedKV)),  # appended in 0.4; NULL: the fields above
    ]


class PagedDecodeArgs(ctypes.Structure):
    """struct kvp_paged_decode_args."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i32, "dtype", "head_dim", "batch", "num_q_heads", "num_kv_heads", "num_blocks", "block_size",
        "max_blocks_per_seq",
    ) + _tensor("q", "batch", "head") + _CACHES + _TABLE + [("seq_lens", _u64)] + _tensor("out", "batch", "head") + _ints(_u64, "lse", "workspace", "workspace_bytes") + [
        ("scale", _f32),
    ] + _ints(_i32, "num_splits", "max_seq_len", "q_len") + [
        ("kv", ctypes.POINTER(PagedKV)),  # appended in 0.4; NULL: the fields above
        ("sinks", _u64),  # appended in 0.6: float32 [num_q_heads] device pointer; 0 = none
        ("window_size", _i32),  # appended in 0.6: 0 = no window; w > 0: positions [pos - w + 1, pos]
        ("reserved", _i32),
    ]


class MergeStatesArgs(ctypes.Structure):
    """struct kvp_merge_states_args."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i32, "dtype", "head_dim", "num_states", "num_tokens", "num_heads", "reserved",
    ) + [("v", _u64 * MERGE_MAX_STATES), ("s", _u64 * MERGE_MAX_STATES)] + _ints(
        _i64, "v_token_stride", "v_head_stride", "s_token_stride", "s_head_stride",
    ) + _tensor("out", "token", "head") + _tensor("out_lse", "token", "head")


class PrefillPlanArgs(ctypes.Structure):
    """struct kvp_prefill_plan_args."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i32, "dtype", "head_dim", "num_q_heads", "num_kv_heads", "batch", "window_size", "flags", "reserved",
    ) + _ints(ctypes.POINTER(_i32), "qo_indptr_host", "kv_lens_host") + _ints(
        _u64, "qo_indptr", "kv_lens", "workspace", "workspace_bytes",
    )


class AttnPlan(ctypes.Structure):
    """struct kvp_attn_plan."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i32, "kind", "route", "dtype", "head_dim", "num_q_heads", "num_kv_heads", "window_left", "batch", "total_q",
        "max_q_len", "max_kv_len", "num_items", "grid", "num_splits",
    ) + _ints(_u64, "workspace", "workspace_bytes", "kv_lens") + [("state", _u64 * 6)]  # opaque plan state


class PagedPrefillArgs(ctypes.Structure):
    """struct kvp_paged_prefill_args."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i32, "num_blocks", "block_size", "max_blocks_per_seq", "reserved",
    ) + _tensor("q", "token", "head") + _CACHES + _TABLE + _tensor("out", "token", "head") + [
        ("lse", _u64),
        ("scale", _f32),
        ("reserved2", _i32),
        ("kv", ctypes.POINTER(PagedKV)),  # appended in 0.4; NULL: the fields above
        ("sinks", _u64),  # appended in 0.6: float32 [num_q_heads] device pointer; 0 = none
    ]


# --------------------------------------------------------------------------
# Shared-prefix attention
# --------------------------------------------------------------------------


class CascadePlanArgs(ctypes.Structure):
    """struct kvp_cascade_plan_args."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i32, "dtype", "head_dim", "num_q_heads", "num_kv_heads", "batch", "max_batch", "block_size",
        "max_blocks_per_seq",
    ) + [("block_table_stride", _i64)] + _ints(ctypes.POINTER(_i32), "block_table_host", "seq_lens_host") + [
        ("seq_lens", _u64),
        ("host_workspace", _vp),
    ] + _ints(_u64, "host_workspace_bytes", "workspace", "workspace_bytes") + _ints(_i32, "flags", "headroom") + [
        # Appended after the first release (first released size: 112 bytes).
        ("qo_indptr_host", ctypes.POINTER(_i32)),
        ("qo_indptr", _u64),
        ("max_tokens", _i32),
        ("reserved", _i32),
    ]


# --------------------------------------------------------------------------
# Virtual-contiguous KV cache
# --------------------------------------------------------------------------


class VCacheConfig(ctypes.Structure):
    """struct kvp_vcache_config."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i32, "backend", "device", "num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "max_batch", "max_context",
    ) + _ints(_i64, "page_size", "budget_bytes", "reclaim_below_bytes") + _ints(_i32, "lookahead_tokens", "no_background")


class VCacheStats(ctypes.Structure):
    """struct kvp_vcache_stats."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i64, "page_size", "budget_bytes", "tensor_bytes", "mapped_bytes", "held_bytes",
    ) + _ints(_i32, "active_slots", "reusable_slots") + _ints(
        _i64, "steps", "map_calls", "unmap_calls", "create_calls", "release_calls", "out_of_memory", "step_map_ns",
        "step_wait_ns", "background_map_ns", "background_errors",
    )


# --------------------------------------------------------------------------
# Functions: name -> (restype, argtypes), in the header's order
# --------------------------------------------------------------------------


def _sigs(restype: Any, *rows: Tuple[str, List[Any]]) -> Dict[str, Tuple[Any, List[Any]]]:
    return {name: (restype, argtypes) for name, argtypes in rows}


FUNCTIONS: Dict[str, Tuple[Any, List[Any]]] = {
    "kvp_version": (_u32, []),
    "kvp_version_string": (ctypes.c_char_p, []),
    "kvp_last_error": (ctypes.c_char_p, []),
    "kvp_status_string": (ctypes.c_char_p, [_int]),
    "kvp_manager_destroy": (None, [_vp]),
    "kvp_event_publisher_destroy": (None, [_vp]),
    "kvp_vcache_destroy": (None, [_vp]),
    "kvp_tier_copier_destroy": (None, [_vp]),
}
FUNCTIONS.update(_sigs(
    _int,
    # common
    ("kvp_set_logger", [_vp, _vp, _int]),
    ("kvp_set_log_level", [_int]),
    ("kvp_live_handles", [_vp]),
    # paged KV manager
    ("kvp_manager_create", [_vp, _vp]),
    ("kvp_manager_add", [_vp, _i64, _i32]),
    ("kvp_manager_grow", [_vp, _vp, _vp, _i32]),
    ("kvp_manager_fork", [_vp, _i64, _vp, _i32, _vp, _i32, _vp]),
    ("kvp_manager_remove", [_vp, _vp, _i32]),
    ("kvp_manager_mark_computed", [_vp]),
    ("kvp_manager_describe", [_vp, _vp, _i32, _vp, _i32, _vp, _vp, _i32, _vp]),
    ("kvp_manager_stats_get", [_vp, _vp]),
    ("kvp_manager_check", [_vp]),
    ("kvp_manager_describe_groups", [_vp, _vp, _i32, _i32, _vp, _i32, _vp, _vp, _i32, _vp]),
    ("kvp_manager_group_blocks", [_vp, _vp, _i32, _vp]),
    ("kvp_manager_take_copies", [_vp, _vp, _i32, _vp, _vp]),
    # prefix cache
    ("kvp_manager_admit", [_vp, _vp, _i32, _vp, _vp, _vp, _vp, _vp]),
    ("kvp_manager_grow_tokens", [_vp, _vp, _vp, _i32, _vp]),
    ("kvp_manager_add_mm_items", [_vp, _i64, _vp, _i32]),
    ("kvp_manager_match", [_vp, _i32, _vp, _vp, _vp, _i32, _vp]),
    ("kvp_manager_match_blocks", [_vp, _i32, _vp, _vp, _vp, _vp]),
    ("kvp_manager_match_room", [_vp, _i32, _vp, _vp, _vp, _vp]),
    ("kvp_manager_pin", [_vp, _vp, _i32, _vp, _vp, _vp]),
    ("kvp_manager_unpin", [_vp, _u64]),
    ("kvp_manager_set_priority", [_vp, _vp, _i32, _vp, _i32, _vp]),
    ("kvp_manager_prefix_stats", [_vp, _vp]),
    ("kvp_manager_prefix_stats_reset", [_vp]),
    ("kvp_manager_clear_prefix_cache", [_vp, _vp]),
    ("kvp_manager_drain_events", [_vp, _vp, _i32, _vp, _i32, _vp, _i32, _vp, _i32, _vp]),
    ("kvp_manager_next_event_size", [_vp, _vp, _vp, _vp]),
    ("kvp_manager_drain_group_events", [_vp, _vp, _i32, _vp, _i32, _vp, _i32, _vp, _i32, _vp]),
    ("kvp_manager_next_group_event_size", [_vp, _vp, _vp, _vp]),
    # host KV tier
    ("kvp_manager_flush_copies", [_vp, _vp, _i32, _vp, _vp, _i32, _vp, _vp]),
    ("kvp_manager_complete_copies", [_vp, _u64, _i32]),
    ("kvp_manager_match_tiers", [_vp, _i32, _vp, _vp, _vp, _vp]),
    ("kvp_manager_tier_stats", [_vp, _vp]),
    ("kvp_manager_host_tier_memory", [_vp, _vp, _vp, _vp]),
    # tier copy
    ("kvp_tier_copier_create", [_vp, _vp, _i64, _i32, _vp]),
    ("kvp_tier_copier_run", [_vp, _vp, _i32, _vp, _i32, _vp]),
    # KV event publisher
    ("kvp_event_publisher_create", [_vp, _vp, _vp]),
    ("kvp_event_publisher_flush", [_vp]),
    ("kvp_event_publisher_resync", [_vp]),
    ("kvp_event_publisher_stats_get", [_vp, _vp]),
    # attention kernels
    ("kvp_cuda_available", [_vp]),
    ("kvp_attn_prepare", []),
    ("kvp_attn_workspace_size", [_i32, _i32, _i32, _i32, _vp]),
    ("kvp_attn_num_splits", [_i32, _i32, _i32, _i32, _i32, _i32, _vp]),
    ("kvp_kv_write", [_vp, _u64]),
    ("kvp_paged_decode", [_vp, _u64]),
    ("kvp_merge_states", [_vp, _u64]),
    ("kvp_prefill_workspace_size", [_i32, _i32, _i32, _i32, _i32, _vp]),
    ("kvp_prefill_plan", [_vp, _vp, _u64]),
    ("kvp_paged_prefill", [_vp, _vp, _u64]),
    # shared-prefix attention
    ("kvp_cascade_workspace_size", [_i32, _i32, _i32, _i32, _vp, _vp]),
    ("kvp_cascade_prefill_workspace_size", [_i32, _i32, _i32, _i32, _i32, _vp, _vp]),
    ("kvp_cascade_plan", [_vp, _vp, _u64]),
    ("kvp_cascade_update", [_vp, _vp, _i32, _vp]),
    ("kvp_paged_cascade", [_vp, _vp, _u64]),
    ("kvp_manager_cascade_plan", [_vp, _vp, _i32, _vp, _vp, _u64]),
    # virtual-contiguous KV cache
    ("kvp_vcache_create", [_vp, _vp]),
    ("kvp_vcache_layer_ptrs", [_vp, _i32, _vp, _vp]),
    ("kvp_vcache_strides", [_vp, _vp]),
    ("kvp_vcache_alloc_slot", [_vp, _vp]),
    ("kvp_vcache_free_slot", [_vp, _i32]),
    ("kvp_vcache_step", [_vp, _vp, _vp, _i32]),
    ("kvp_vcache_trim", [_vp]),
    ("kvp_vcache_stats_get", [_vp, _vp]),
))


# --------------------------------------------------------------------------
# Standalone host store and shared store (kvplug.hoststore, kvplug.sharedstore)
# --------------------------------------------------------------------------


class HostStoreConfig(ctypes.Structure):
    """struct kvp_host_store_config."""

    _fields_ = [("struct_size", _size), ("num_slots", _i32), ("reserved", _i32), ("slot_bytes", _i64)]


class HostStoreStatsStruct(ctypes.Structure):
    """struct kvp_host_store_stats."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i64, "reserves", "commits", "aborts", "refused_full", "skipped_present", "evictions", "hits", "misses",
        "stale", "resets",
    ) + _ints(_i32, "num_slots", "resident", "pending", "pinned")


class SharedStoreConfig(ctypes.Structure):
    """struct kvp_shared_store_config."""

    _fields_ = [
        ("struct_size", _size),
        ("address", ctypes.c_char_p),
        ("key_space", ctypes.c_char_p),
        ("fingerprint", _u64),
        ("block_bytes", _i64),
    ] + _ints(_i32, "dial_timeout_ms", "op_timeout_ms", "ttl_ms", "backoff_ms", "max_backoff_ms", "reserved") + _ints(
        ctypes.c_char_p, "username", "password_env", "password_file", "tls_ca_file", "tls_cert_file", "tls_key_file",
        "tls_server_name", "mac_keys_env", "mac_keys_file") + _ints(_i32, "tls", "reserved2")


class SharedStoreStatsStruct(ctypes.Structure):
    """struct kvp_shared_store_stats."""

    _fields_ = [("struct_size", _size)] + _ints(
        _i64, "hits", "misses", "stores", "corrupt", "timeouts", "errors", "skipped", "bytes_read", "bytes_written",
    ) + _ints(_i32, "available", "reserved") + _ints(_i64, "auth_failures", "tls_failures", "mac_failures",
                                                    "redirects", "map_reads") + _ints(_i32, "cluster", "primaries")


FUNCTIONS.update({
    "kvp_host_store_destroy": (None, [_vp]),
    "kvp_shared_store_destroy": (None, [_vp]),
})
FUNCTIONS.update(_sigs(
    _int,
    ("kvp_host_store_create", [_vp, _vp]),
    ("kvp_host_store_state", [_vp, _i32, _vp, _vp, _vp]),
    ("kvp_host_store_lookup_prefix", [_vp, _i32, _vp, _vp]),
    ("kvp_host_store_reserve", [_vp, _i32, _vp, _vp, _vp, _vp]),
    ("kvp_host_store_complete", [_vp, _i32, _vp, _i32, _vp]),
    ("kvp_host_store_pin", [_vp, _i32, _vp, _vp, _vp]),
    ("kvp_host_store_unpin", [_vp, _i32, _vp, _vp]),
    ("kvp_host_store_touch", [_vp, _i32, _vp]),
    ("kvp_host_store_reset", [_vp, _vp]),
    ("kvp_host_store_stats_get", [_vp, _vp]),
    ("kvp_host_store_memory", [_vp, _vp, _vp, _vp]),
    ("kvp_host_store_write", [_vp, _i32, _vp, _i32, _vp, _vp]),
    ("kvp_host_store_read", [_vp, _i32, _vp, _i32, _vp, _vp]),
    ("kvp_shared_store_create", [_vp, _vp]),
    ("kvp_shared_store_exists", [_vp, _i32, _vp, _vp]),
    ("kvp_shared_store_put", [_vp, _i32, _vp, _i32, _vp, _vp, _vp]),
    ("kvp_shared_store_get", [_vp, _i32, _vp, _i32, _vp, _vp, _vp]),
    ("kvp_shared_store_stats_get", [_vp, _vp]),
))
