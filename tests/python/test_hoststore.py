"""kvplug.hoststore.HostStore: the standalone host store through the ABI
(include/kvplug.h, "standalone host store"): reserve, complete, pin, read
and write by key, the engine's bad input as misses and stale counts, the
all-or-nothing refusal, reset."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from conftest import row_segments

import kvplug
from kvplug.hoststore import ABSENT, PENDING, RESIDENT, HostStore, key64

SLOT = 48


def test_store_and_read_back():
    with HostStore(num_slots=4, slot_bytes=SLOT) as hs:
        keys = [key64(b"a"), key64(b"b"), key64(b"c")]
        slots, evicted = hs.reserve(keys)
        assert list(slots) == [0, 1, 2] and len(evicted) == 0
        st, sl = hs.state(keys)
        assert list(st) == [PENDING] * 3 and list(sl) == [0, 1, 2]
        data = np.arange(3 * SLOT, dtype=np.uint8).reshape(3, SLOT)
        ptrs, lens = row_segments(data)
        hs.write(slots, ptrs, lens)
        assert hs.complete(keys) == 3
        assert hs.lookup_prefix(keys + [key64(b"zz")]) == 3
        pinned, n = hs.pin(keys[::-1])
        assert n == 3 and list(pinned) == [2, 1, 0]
        out = np.zeros_like(data)
        optrs, olens = row_segments(out)
        hs.read(pinned[::-1], optrs, olens)
        np.testing.assert_array_equal(out, data)
        np.testing.assert_array_equal(hs.memory()[:3], data)
        assert hs.unpin(keys) == 3
        s = hs.stats()
        assert (s.reserves, s.commits, s.resident, s.pinned, s.pending) == (3, 3, 3, 0, 0)


def test_two_segments_per_key():
    # SGLang's page_first MHA pages: a K part and a V part at two addresses.
    with HostStore(num_slots=2, slot_bytes=2 * SLOT) as hs:
        k = np.arange(2 * SLOT, dtype=np.uint8).reshape(2, SLOT)
        v = (255 - k).copy()
        slots, _ = hs.reserve([1, 2])
        ptrs, lens = row_segments(k, v)
        hs.write(slots, ptrs, lens)
        hs.complete([1, 2])
        mem = hs.memory()
        np.testing.assert_array_equal(mem[slots[1], :SLOT], k[1])
        np.testing.assert_array_equal(mem[slots[1], SLOT:], v[1])


def test_bad_input_is_a_miss_or_stale():
    with HostStore(num_slots=2, slot_bytes=8) as hs:
        # Keys never stored: pin misses, complete and unpin are stale.
        slots, n = hs.pin([7, 8])
        assert n == 0 and list(slots) == [-1, -1]
        assert hs.complete([7]) == 0 and hs.unpin([8]) == 0
        # A store of a block already stored (or being stored): skipped.
        s1, _ = hs.reserve([1])
        s2, _ = hs.reserve([1, 1])
        assert s1[0] == 0 and list(s2) == [-1, -1]
        hs.complete([1])
        s3, _ = hs.reserve([1])
        assert list(s3) == [-1]
        # Being loaded (pinned): not evicted; a batch that needs it is refused.
        hs.pin([1])
        hs.reserve([2])
        assert hs.try_reserve([3]) is None
        with pytest.raises(kvplug.OutOfBlocksError):
            hs.reserve([3])
        s = hs.stats()
        assert s.stale == 2 and s.skipped_present == 3 and s.refused_full == 2 and s.misses == 2
        # Lookup after reset: misses, and the old completions are stale.
        assert hs.reset() == 2
        assert hs.lookup_prefix([1]) == 0
        assert hs.unpin([1]) == 0 and hs.complete([2]) == 0
        st, _ = hs.state([1, 2])
        assert list(st) == [ABSENT, ABSENT]
        assert hs.stats().resets == 1


def test_eviction_spares_the_batch_and_reports_evicted():
    with HostStore(num_slots=4) as hs:  # bookkeeping only
        assert hs.memory() is None
        hs.reserve([1, 2])
        hs.complete([1, 2])
        hs.touch([1])  # 2 is the LRU block
        slots, evicted = hs.reserve([2, 3, 4, 5])
        assert list(slots) == [-1, 2, 3, 0] and list(evicted) == [1]
        st, _ = hs.state([2])
        assert st[0] == RESIDENT
        with pytest.raises(kvplug.UnsupportedError):
            hs.write([2], [[0]], [[0]])


def test_write_checks_before_copying():
    with HostStore(num_slots=2, slot_bytes=16) as hs:
        buf = np.zeros((1, 16), np.uint8)
        ptrs, lens = row_segments(buf)
        with pytest.raises(kvplug.NotFoundError):  # slot 0 is free, not pending
            hs.write([0], ptrs, lens)
        hs.reserve([9])
        with pytest.raises(kvplug.InvalidArgumentError, match="total"):
            hs.write([0], ptrs, lens - 1)
        with pytest.raises(kvplug.InvalidArgumentError, match="out of range"):
            hs.write([5], ptrs, lens)
        with pytest.raises(kvplug.NotFoundError):  # pending, not resident
            hs.read([0], ptrs, lens)
        with pytest.raises(kvplug.InvalidArgumentError):
            HostStore(num_slots=0)
        with pytest.raises(kvplug.InvalidArgumentError):
            HostStore(num_slots=4, slot_bytes=-1)


def test_handle_checks():
    hs = HostStore(num_slots=1)
    h = hs._h
    hs.close()
    hs.close()
    from kvplug._lib import C
    n = ctypes.c_int32()
    assert C.kvp_host_store_reset(h, ctypes.byref(n)) == kvplug.Status.INVALID_HANDLE
    keys = np.array([1], np.uint64)
    assert C.kvp_host_store_touch(None, 1, keys.ctypes.data) == kvplug.Status.INVALID_HANDLE


def test_key64():
    assert key64(b"x") == key64("x") != key64(b"y")
    assert 0 <= key64(b"\x00" * 32) < 2**64
