"""The standalone shared store (include/kvplug.h, "standalone shared
store"): blocks in a Valkey or Redis server that instances share, keyed by
64-bit keys (kvplug.hoststore.key64), for kvplug.sglang.

    with kvplug.SharedStore("127.0.0.1:6379", "llama3-8b", fingerprint=fp) as ss:
        ss.put(keys, ptrs, lens)          # ptrs/lens: [n, segs] per key
        found = ss.exists(keys)           # bool array
        found = ss.get(keys, ptrs, lens)  # copies into the segments

A server that is down, slow or restarting never raises: calls return
misses or store nothing within op_timeout_ms, counted in stats(); after a
failure the server is skipped for a backoff window. A value that fails its
checks (short, corrupt, another fingerprint's) is a miss counted in corrupt.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Iterable

import numpy as np

from . import _lib
from ._capi import SharedStoreConfig, SharedStoreStatsStruct
from ._lib import C
from .hoststore import _segments, keys_array

__all__ = ["SharedStore", "SharedStoreStats"]

_vp, _i32 = ctypes.c_void_p, ctypes.c_int32


@dataclasses.dataclass(frozen=True)
class SharedStoreStats:
    """struct kvp_shared_store_stats."""

    hits: int
    misses: int
    stores: int
    corrupt: int
    timeouts: int
    errors: int
    skipped: int
    bytes_read: int
    bytes_written: int
    available: bool


class SharedStore(_lib.Owner):
    """A kvp_shared_store: a client of one server (see the module docstring).
    key_space names the keys' space (kvplug:<key_space>:<key>); fingerprint
    is the model and KV layout's, so that another layout's values are
    misses; block_bytes (0: any) the payload size every block must have."""

    _destroy = "kvp_shared_store_destroy"

    def __init__(self, address: str, key_space: str, *, fingerprint: int = 0, block_bytes: int = 0,
                 dial_timeout_ms: int = 0, op_timeout_ms: int = 0, ttl_ms: int = 0, backoff_ms: int = 0,
                 max_backoff_ms: int = 0) -> None:
        i32 = lambda v, what: _lib.checked_int(v, f"SharedStore: {what}", "int32")  # noqa: E731
        self._address = address.encode()
        self._key_space = key_space.encode()
        cfg = SharedStoreConfig(
            ctypes.sizeof(SharedStoreConfig), self._address, self._key_space,
            _lib.checked_int(fingerprint, "SharedStore: fingerprint", "uint64"),
            _lib.checked_int(block_bytes, "SharedStore: block_bytes", "int64"),
            i32(dial_timeout_ms, "dial_timeout_ms"), i32(op_timeout_ms, "op_timeout_ms"), i32(ttl_ms, "ttl_ms"),
            i32(backoff_ms, "backoff_ms"), i32(max_backoff_ms, "max_backoff_ms"), 0,
        )
        out = _vp()
        _lib.check(C.kvp_shared_store_create(ctypes.byref(cfg), ctypes.byref(out)))
        self._own(out.value, C.kvp_shared_store_destroy, out.value)
        self.address = address
        self.key_space = key_space

    def __repr__(self) -> str:
        return "SharedStore(closed)" if self._h is None else f"SharedStore({self.address!r}, {self.key_space!r})"

    def exists(self, keys: Iterable[int]) -> np.ndarray:
        """Which keys the server holds (bool array); all False on a fault."""
        k = keys_array(keys)
        found = np.zeros(len(k), np.int32)
        if len(k):
            _lib.check(C.kvp_shared_store_exists(self._h, len(k), k.ctypes.data, found.ctypes.data))
        return found.astype(bool)

    def prefix(self, keys: Iterable[int]) -> int:
        """How many keys, from the first, the server holds."""
        found = self.exists(keys)
        miss = np.flatnonzero(~found)
        return int(miss[0]) if len(miss) else len(found)

    def put(self, keys: Iterable[int], ptrs: Any, lens: Any) -> int:
        """Stores key i's payload, the concatenation of its segments (ptrs[i, :]
        addresses of lens[i, :] bytes); returns how many the server accepted."""
        k = keys_array(keys)
        if not len(k):
            return 0
        p, ln, segs = _segments(len(k), ptrs, lens)
        n = _i32()
        _lib.check(C.kvp_shared_store_put(self._h, len(k), k.ctypes.data, segs, p.ctypes.data, ln.ctypes.data,
                                          ctypes.byref(n)))
        return n.value

    def get(self, keys: Iterable[int], ptrs: Any, lens: Any) -> np.ndarray:
        """Fetches key i's payload into its segments; found[i] (bool) says
        whether it was found whole and copied (else its segments are untouched)."""
        k = keys_array(keys)
        found = np.zeros(len(k), np.int32)
        if not len(k):
            return found.astype(bool)
        p, ln, segs = _segments(len(k), ptrs, lens)
        _lib.check(C.kvp_shared_store_get(self._h, len(k), k.ctypes.data, segs, p.ctypes.data, ln.ctypes.data,
                                          found.ctypes.data))
        return found.astype(bool)

    def stats(self) -> SharedStoreStats:
        s = SharedStoreStatsStruct()
        s.struct_size = ctypes.sizeof(s)
        _lib.check(C.kvp_shared_store_stats_get(self._h, ctypes.byref(s)))
        return SharedStoreStats(s.hits, s.misses, s.stores, s.corrupt, s.timeouts, s.errors, s.skipped,
                                s.bytes_read, s.bytes_written, bool(s.available))
