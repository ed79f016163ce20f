"""kvplug.sharedstore.SharedStore against a throwaway redis-server (or
valkey-server): put, exists and get with one or two segments per key, a
value of another fingerprint or size as a miss, and a server that is down
as misses and skipped stores within the op timeout, never an exception."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import free_port, row_segments

import kvplug
from kvplug.sharedstore import SharedStore, key128, keys128, keys64


def K(*ids):
    return [key128(str(i)) for i in ids]


def test_put_exists_get(valkey_server):
    with SharedStore(valkey_server, "t1", fingerprint=11) as ss:
        data = np.random.default_rng(0).integers(0, 255, (3, 64), dtype=np.uint8)
        p, ln = row_segments(data)
        assert ss.put(K(1, 2, 3), p, ln) == 3
        assert list(ss.exists(K(1, 2, 4, 3))) == [True, True, False, True]
        assert ss.prefix(K(1, 2, 4, 3)) == 2
        out = np.zeros_like(data)
        op, oln = row_segments(out)
        assert list(ss.get(K(1, 2, 3), op, oln)) == [True] * 3
        np.testing.assert_array_equal(out, data)
        s = ss.stats()
        assert s.stores == 3 and s.hits >= 6 and s.available


def test_two_segments_and_foreign_values(valkey_server):
    k = np.full((2, 16), 7, np.uint8)
    v = np.full((2, 16), 9, np.uint8)
    ptrs, lens = row_segments(k, v)
    with SharedStore(valkey_server, "t2", fingerprint=1) as a, SharedStore(valkey_server, "t2", fingerprint=2) as b:
        assert a.put(K(10, 11), ptrs, lens) == 2
        ok, ov = np.zeros_like(k), np.zeros_like(v)
        optrs, _ = row_segments(ok, ov)
        assert list(a.get(K(10, 11), optrs, lens)) == [True, True]
        assert (ok == 7).all() and (ov == 9).all()
        # Another fingerprint's reader: a miss counted corrupt, buffers untouched.
        ok[:] = 0
        assert list(b.get(K(10), optrs[:1], lens[:1])) == [False]
        assert (ok == 0).all() and b.stats().corrupt == 1
        # A payload of another size than the buffers: a miss.
        assert list(a.get(K(10), optrs[:1, :1], lens[:1, :1])) == [False]


def test_server_down_is_misses_not_errors():
    addr = f"127.0.0.1:{free_port()}"
    with SharedStore(addr, "t3", op_timeout_ms=100, backoff_ms=200) as ss:
        buf = np.zeros((2, 8), np.uint8)
        p, ln = row_segments(buf)
        t0 = time.monotonic()
        assert ss.put(K(1, 2), p, ln) == 0
        assert list(ss.exists(K(1, 2))) == [False, False]
        assert list(ss.get(K(1, 2), p, ln)) == [False, False]
        assert time.monotonic() - t0 < 1.0
        s = ss.stats()
        assert s.stores == 0 and s.misses >= 4 and (s.errors + s.timeouts) >= 1 and s.skipped >= 1


def test_config_checks():
    with pytest.raises(kvplug.InvalidArgumentError):
        SharedStore("127.0.0.1:1", "bad space")
    with pytest.raises(kvplug.InvalidArgumentError):
        SharedStore("127.0.0.1:1", "ok", op_timeout_ms=-1)
    with pytest.raises(kvplug.InvalidArgumentError):
        SharedStore("", "ok")


def test_keys():
    k = keys128(K(1, 2))
    assert k.shape == (2, 16) and bytes(k[1]) == key128("2")
    assert keys64(k)[0] == int.from_bytes(key128("1")[:8], "little")
    assert keys128([]).shape == (0, 16)
