"""The C ABI called raw through ctypes, for the scenario runner and the
property test: every export with its C signature (pointers as integers, so
NULL and foreign pointers pass as given), C memory the tests own, and the
header structs' layouts taken from the bindings' ctypes copies (which
test_abi_mirror.py checks against the header)."""

from __future__ import annotations

import ctypes
from typing import Dict, Tuple

from kvplug import _lib, attn, cascade, events, manager, prefix, vmem

vp, i32, i64, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64

SIGNATURES = {
    "kvp_manager_create": [vp, vp],
    "kvp_manager_add": [vp, i64, i32],
    "kvp_manager_grow": [vp, vp, vp, i32],
    "kvp_manager_grow_tokens": [vp, vp, vp, i32, vp],
    "kvp_manager_fork": [vp, i64, vp, i32, vp, i32, vp],
    "kvp_manager_remove": [vp, vp, i32],
    "kvp_manager_mark_computed": [vp],
    "kvp_manager_describe": [vp, vp, i32, vp, i32, vp, vp, i32, vp],
    "kvp_manager_stats_get": [vp, vp],
    "kvp_manager_check": [vp],
    "kvp_manager_admit": [vp, vp, i32, vp, vp, vp, vp, vp],
    "kvp_manager_match": [vp, i32, vp, vp, vp, i32, vp],
    "kvp_manager_pin": [vp, vp, i32, vp, vp, vp],
    "kvp_manager_unpin": [vp, u64],
    "kvp_manager_set_priority": [vp, vp, i32, vp, i32, vp],
    "kvp_manager_prefix_stats": [vp, vp],
    "kvp_manager_prefix_stats_reset": [vp],
    "kvp_manager_clear_prefix_cache": [vp, vp],
    "kvp_manager_drain_events": [vp, vp, i32, vp, i32, vp, i32, vp, i32, vp],
    "kvp_manager_next_event_size": [vp, vp, vp, vp],
    "kvp_manager_add_mm_items": [vp, i64, vp, i32],
    "kvp_vcache_create": [vp, vp],
    "kvp_vcache_layer_ptrs": [vp, i32, vp, vp],
    "kvp_vcache_strides": [vp, vp],
    "kvp_vcache_alloc_slot": [vp, vp],
    "kvp_vcache_free_slot": [vp, i32],
    "kvp_vcache_step": [vp, vp, vp, i32],
    "kvp_vcache_trim": [vp],
    "kvp_vcache_stats_get": [vp, vp],
    "kvp_attn_workspace_size": [i32, i32, i32, i32, vp],
    "kvp_prefill_workspace_size": [i32, i32, i32, i32, i32, vp],
    "kvp_attn_num_splits": [i32, i32, i32, i32, i32, i32, vp],
    "kvp_kv_write": [vp, u64],
    "kvp_paged_decode": [vp, u64],
    "kvp_merge_states": [vp, u64],
    "kvp_prefill_plan": [vp, vp, u64],
    "kvp_paged_prefill": [vp, vp, u64],
    "kvp_live_handles": [vp],
    "kvp_cascade_workspace_size": [i32, i32, i32, i32, vp, vp],
    "kvp_cascade_plan": [vp, vp, u64],
    "kvp_cascade_update": [vp, vp, i32, vp],
    "kvp_paged_cascade": [vp, vp, u64],
    "kvp_event_publisher_create": [vp, vp, vp],
    "kvp_event_publisher_flush": [vp],
    "kvp_event_publisher_resync": [vp],
    "kvp_event_publisher_stats_get": [vp, vp],
    "kvp_cuda_available": [vp],
}
DESTROYS = ("kvp_manager_destroy", "kvp_vcache_destroy", "kvp_event_publisher_destroy")


def call(name: str, *args) -> int:
    """Calls export `name` (without checking its status) and returns it."""
    if name in DESTROYS:
        _lib.fn(name, None, [vp])(*args)
        return 0
    return int(_lib.fn(name, ctypes.c_int, SIGNATURES[name])(*args))


def last_error() -> str:
    return _lib.last_error()


def status_name(st: int) -> str:
    try:
        return "KVP_OK" if st == 0 else "KVP_ERR_" + _lib.Status(st).name
    except ValueError:
        return f"kvp_status({st})"


STRUCTS = {
    "kvp_manager_config": manager.ManagerConfig,
    "kvp_manager_stats": manager.ManagerStatsStruct,
    "kvp_prefix_stats": prefix.PrefixStatsStruct,
    "kvp_prefix_keys": prefix.PrefixKeysStruct,
    "kvp_prefix_match": prefix.PrefixMatchStruct,
    "kvp_block_mm": prefix.BlockMMStruct,
    "kvp_kv_event": prefix.KVEventStruct,
    "kvp_vcache_config": vmem.VCacheConfig,
    "kvp_vcache_stats": vmem.VCacheStats,
    "kvp_kv_write_args": attn._KVWriteArgs,
    "kvp_paged_decode_args": attn._PagedDecodeArgs,
    "kvp_merge_states_args": attn._MergeStatesArgs,
    "kvp_prefill_plan_args": attn._PrefillPlanArgs,
    "kvp_attn_plan": attn._AttnPlan,
    "kvp_paged_prefill_args": attn._PagedPrefillArgs,
    "kvp_cascade_plan_args": cascade._CascadePlanArgs,
    "kvp_event_publisher_config": events.EventPublisherConfig,
    "kvp_event_publisher_stats": events.EventPublisherStatsStruct,
}

# kvp_manager_config's first released size: through block_size.
FIRST_MANAGER_CONFIG = manager.ManagerConfig.block_size.offset + 4


def layout(name: str) -> Tuple[int, Dict[str, Tuple[int, int]]]:
    """(sizeof, {field: (offset, size)}) of a header struct."""
    cls = STRUCTS[name]
    return ctypes.sizeof(cls), {f[0]: (getattr(cls, f[0]).offset, getattr(cls, f[0]).size) for f in cls._fields_}


class Memory:
    """C memory for one call's arguments, kept alive until released."""

    def __init__(self) -> None:
        self.bufs = []

    def alloc(self, n: int) -> int:
        b = ctypes.create_string_buffer(max(n, 1))
        self.bufs.append(b)
        return ctypes.addressof(b)

    def array(self, values, elem: int) -> int:
        p = self.alloc(elem * max(len(values), 1))
        ct = i32 if elem == 4 else i64
        arr = (ct * max(len(values), 1)).from_address(p)
        for i, v in enumerate(values):
            arr[i] = v
        return p

    def release(self) -> None:
        self.bufs.clear()


def put(p: int, off: int, size: int, value: int) -> None:
    ct = {4: i32, 8: i64}[size]
    ct.from_address(p + off).value = ct(value).value


def get(p: int, off: int, size: int) -> int:
    return {4: i32, 8: i64}[size].from_address(p + off).value


def read_i32s(p: int, n: int):
    return [i32.from_address(p + 4 * i).value for i in range(n)]
