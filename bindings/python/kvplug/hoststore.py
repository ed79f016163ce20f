"""The standalone host store (include/kvplug.h, "standalone host store"):
the host tier's slot pool, keyed by 64-bit keys, for an engine that keeps
its own GPU block manager (kvplug.vllm, kvplug.sglang).

    with kvplug.HostStore(num_slots=1024, slot_bytes=block_bytes) as hs:
        slots, evicted = hs.reserve(keys)        # -1: held already
        hs.write(slots[slots >= 0], ptrs, lens)  # or the engine copies
        hs.complete(keys)                        # now readable
        slots, n = hs.pin(keys)                  # -1: a miss
        hs.read(slots, ptrs, lens)
        hs.unpin(keys)

Keys are what the caller makes them; key64() derives one from an engine's
block hash (bytes or str). A reserve batch that cannot fit as a whole is
refused with nothing changed (try_reserve returns None; reserve raises
OutOfBlocksError); complete and unpin of keys the store no longer holds
(after reset(), or never stored) are counted as stale, not raised.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
from typing import Any, Iterable, Optional, Tuple, Union

import numpy as np

from . import _lib
from ._arrays import addr as _addr
from ._capi import HostStoreConfig, HostStoreStatsStruct
from ._lib import C

__all__ = ["HostStore", "HostStoreStats", "key64", "keys_array", "ABSENT", "PENDING", "RESIDENT"]

ABSENT, PENDING, RESIDENT = 0, 1, 2  # KVP_HOST_KEY_*

_vp, _i32 = ctypes.c_void_p, ctypes.c_int32


def key64(data: Union[bytes, bytearray, memoryview, str]) -> int:
    """A 64-bit key of an engine's block hash (bytes, or a str such as a hex
    digest): the first 8 bytes of its BLAKE2b digest, little-endian. Equal
    hashes give equal keys; distinct hashes collide with probability 2^-64
    a pair."""
    if isinstance(data, str):
        data = data.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def keys_array(keys: Iterable[int]) -> np.ndarray:
    """keys as a C-contiguous uint64 array (used in place when it is one)."""
    try:
        if isinstance(keys, np.ndarray):
            return np.ascontiguousarray(keys, dtype=np.uint64)
        return np.fromiter(keys, dtype=np.uint64)
    except TypeError:
        raise _lib.ArgumentTypeError(f"HostStore: keys must be an iterable of 64-bit integers: got {type(keys).__name__}",
                                     _lib.Status.INVALID_ARGUMENT) from None
    except (ValueError, OverflowError) as e:
        raise _lib.InvalidArgumentError(f"HostStore: keys must be 64-bit unsigned integers: {e}",
                                        _lib.Status.INVALID_ARGUMENT) from None


@dataclasses.dataclass(frozen=True)
class HostStoreStats:
    """struct kvp_host_store_stats: counters since creation, then gauges."""

    reserves: int
    commits: int
    aborts: int
    refused_full: int
    skipped_present: int
    evictions: int
    hits: int
    misses: int
    stale: int
    resets: int
    num_slots: int
    resident: int
    pending: int
    pinned: int


_STATS = [f.name for f in dataclasses.fields(HostStoreStats)]


def _segments(n: int, ptrs: Any, lens: Any) -> Tuple[np.ndarray, np.ndarray, int]:
    """ptrs and lens of n keys as [n, segs] uint64 and int64 arrays."""
    p = np.ascontiguousarray(ptrs, dtype=np.uint64)
    ln = np.ascontiguousarray(lens, dtype=np.int64)
    if p.ndim == 1:
        p = p.reshape(n, -1)
    if ln.ndim == 1:
        ln = ln.reshape(n, -1)
    if p.shape != ln.shape or p.shape[0] != n:
        raise _lib.InvalidArgumentError(
            f"HostStore: ptrs {p.shape} and lens {ln.shape} must both be [n={n}, segs]", _lib.Status.INVALID_ARGUMENT)
    return p, ln, int(p.shape[1])


class HostStore(_lib.Owner):
    """A kvp_host_store: num_slots slots of slot_bytes bytes (0: bookkeeping
    only, the memory is the engine's). See the module docstring."""

    _destroy = "kvp_host_store_destroy"

    def __init__(self, num_slots: int, slot_bytes: int = 0) -> None:
        cfg = HostStoreConfig(ctypes.sizeof(HostStoreConfig),
                              _lib.checked_int(num_slots, "HostStore: num_slots", "int32"), 0,
                              _lib.checked_int(slot_bytes, "HostStore: slot_bytes", "int64"))
        out = _vp()
        _lib.check(C.kvp_host_store_create(ctypes.byref(cfg), ctypes.byref(out)))
        self._own(out.value, C.kvp_host_store_destroy, out.value)
        self.num_slots = int(num_slots)
        self.slot_bytes = int(slot_bytes)

    def __repr__(self) -> str:
        return "HostStore(closed)" if self._h is None else f"HostStore(num_slots={self.num_slots}, slot_bytes={self.slot_bytes})"

    def _count(self, fn: Any, keys: Iterable[int], *args: Any) -> int:
        """fn(handle, n, keys, *args, &count) for a call by key that returns
        a count; 0 without calling for no keys."""
        k = keys_array(keys)
        if not len(k):
            return 0
        n = _i32()
        _lib.check(fn(self._h, len(k), _addr(k), *args, ctypes.byref(n)))
        return n.value

    def state(self, keys: Iterable[int]) -> Tuple[np.ndarray, np.ndarray]:
        """(states, slots) of keys: ABSENT, PENDING or RESIDENT, and the
        slot (-1 when absent). Touches and counts nothing."""
        k = keys_array(keys)
        st = np.empty(len(k), np.int32)
        sl = np.empty(len(k), np.int32)
        if len(k):
            _lib.check(C.kvp_host_store_state(self._h, len(k), _addr(k), _addr(st), _addr(sl)))
        return st, sl

    def lookup_prefix(self, keys: Iterable[int]) -> int:
        """How many keys, from the first, are resident (marked recently used)."""
        return self._count(C.kvp_host_store_lookup_prefix, keys)

    def try_reserve(self, keys: Iterable[int]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """(slots, evicted keys), or None when the batch does not fit (nothing
        changed; counted in refused_full). slots[i] is -1 for a key held
        already or repeated."""
        k = keys_array(keys)
        slots = np.empty(len(k), np.int32)
        if not len(k):
            return slots, np.empty(0, np.uint64)
        ev = np.empty(len(k), np.uint64)
        ne = _i32()
        st = C.kvp_host_store_reserve(self._h, len(k), _addr(k), _addr(slots), _addr(ev), ctypes.byref(ne))
        if st == _lib.Status.OUT_OF_BLOCKS:
            return None
        _lib.check(st)
        return slots, ev[: ne.value].copy()

    def reserve(self, keys: Iterable[int]) -> Tuple[np.ndarray, np.ndarray]:
        """try_reserve that raises OutOfBlocksError when the batch does not fit."""
        k = keys_array(keys)
        slots = np.empty(len(k), np.int32)
        if not len(k):
            return slots, np.empty(0, np.uint64)
        ev = np.empty(len(k), np.uint64)
        ne = _i32()
        _lib.check(C.kvp_host_store_reserve(self._h, len(k), _addr(k), _addr(slots), _addr(ev), ctypes.byref(ne)))
        return slots, ev[: ne.value].copy()

    def complete(self, keys: Iterable[int], failed: bool = False) -> int:
        """Commits (or, failed, gives back) the pending keys; returns how many
        were pending (the rest count as stale)."""
        return self._count(C.kvp_host_store_complete, keys, 1 if failed else 0)

    def pin(self, keys: Iterable[int]) -> Tuple[np.ndarray, int]:
        """Pins the resident keys for a copy out of them: (slots, how many),
        slots[i] -1 for a miss."""
        k = keys_array(keys)
        slots = np.empty(len(k), np.int32)
        if not len(k):
            return slots, 0
        n = _i32()
        _lib.check(C.kvp_host_store_pin(self._h, len(k), _addr(k), _addr(slots), ctypes.byref(n)))
        return slots, n.value

    def unpin(self, keys: Iterable[int]) -> int:
        """Drops one pin of each pinned key; returns how many."""
        return self._count(C.kvp_host_store_unpin, keys)

    def touch(self, keys: Iterable[int]) -> None:
        """Marks the resident keys recently used, the first most recently."""
        k = keys_array(keys)
        if len(k):
            _lib.check(C.kvp_host_store_touch(self._h, len(k), _addr(k)))

    def reset(self) -> int:
        """Drops every block (no copy may still use one); returns how many."""
        n = _i32()
        _lib.check(C.kvp_host_store_reset(self._h, ctypes.byref(n)))
        return n.value

    def stats(self) -> HostStoreStats:
        s = HostStoreStatsStruct()
        s.struct_size = ctypes.sizeof(s)
        _lib.check(C.kvp_host_store_stats_get(self._h, ctypes.byref(s)))
        return HostStoreStats(*(getattr(s, f) for f in _STATS))

    def memory(self) -> Optional[np.ndarray]:
        """The slots' memory as a uint8 [num_slots, slot_bytes] array viewing
        the library's allocation, or None without memory. The array, and
        every array or tensor made from it, keeps the memory alive: a store
        closed while one exists frees it when the last is gone."""
        base, nb, ns = _vp(), ctypes.c_int64(), _i32()
        _lib.check(C.kvp_host_store_memory(self._h, ctypes.byref(base), ctypes.byref(nb), ctypes.byref(ns)))
        if not base.value:
            return None
        buf = (ctypes.c_uint8 * (nb.value * ns.value)).from_address(base.value)
        buf._kvplug_lease = self._lease()  # type: ignore[attr-defined]  # numpy's base: see _lib.Lease
        return np.frombuffer(buf, dtype=np.uint8).reshape(ns.value, nb.value)

    def write(self, slots: Any, ptrs: Any, lens: Any) -> None:
        """Copies into pending slots: slot slots[i] receives the concatenation
        of ptrs[i, :] (addresses) of lengths lens[i, :], totalling slot_bytes."""
        s = np.ascontiguousarray(slots, dtype=np.int32)
        if not len(s):
            return
        p, ln, segs = _segments(len(s), ptrs, lens)
        _lib.check(C.kvp_host_store_write(self._h, len(s), _addr(s), segs, _addr(p), _addr(ln)))

    def read(self, slots: Any, ptrs: Any, lens: Any) -> None:
        """Copies out of resident (pinned) slots, the converse of write."""
        s = np.ascontiguousarray(slots, dtype=np.int32)
        if not len(s):
            return
        p, ln, segs = _segments(len(s), ptrs, lens)
        _lib.check(C.kvp_host_store_read(self._h, len(s), _addr(s), segs, _addr(p), _addr(ln)))
