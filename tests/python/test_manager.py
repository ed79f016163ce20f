"""The manager's normal path through the Python API."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import ids

import kvplug


def test_version():
    major, minor, patch = kvplug.version()
    assert major == 0
    assert kvplug.version_string() == f"{major}.{minor}.{patch}"


def test_step(mgr):
    mgr.grow([1, 2, 3], [1, 1, 3])
    table, lens, slots = mgr.describe([1, 2, 3])
    assert lens.tolist() == [11, 5, 4]
    assert table.dtype == np.int32 and table.shape == (3, 3)
    assert (table[1, 2:] == -1).all() and (table[2, 1:] == -1).all()
    slot = lambda i, p: table[i, p // 4] * 4 + p % 4  # noqa: E731
    assert slots.tolist() == [slot(0, 10), slot(1, 4), slot(2, 1), slot(2, 2), slot(2, 3)]
    mgr.check()


def test_prompt_tokens_are_new_until_grow(mgr):
    _, _, slots = mgr.describe([1, 3])
    assert len(slots) == 11
    mgr.grow([1, 3], 0)
    assert len(mgr.describe([1, 3]).slot_mapping) == 0


def test_describe_with_out_returns_views(mgr):
    table = np.full((8, 6), 99, np.int32)
    lens = np.zeros(8, np.int32)
    slots = np.zeros(32, np.int32)
    t, l, s = mgr.describe([3, 1], out=(table, lens, slots))
    assert t.base is table and l.base is lens and s.base is slots
    assert t.shape == (2, 6) and l.tolist() == [1, 10] and len(s) == 11
    assert (table[2:] == 99).all(), "rows past the batch were written"
    assert t[0, 0] * 4 == s[0]


def test_describe_into_flat_table_and_skips(mgr):
    flat = np.zeros(3 * 5, np.int32)
    assert mgr.describe_into([1, 2, 3], flat, max_blocks=5) == 15
    assert flat.reshape(3, 5)[0, 3:].tolist() == [-1, -1]
    assert mgr.describe_into([1, 2, 3]) == 15  # counts slots with no buffers at all
    empty = np.zeros(0, np.int32)
    mgr.grow([1, 2, 3], 0)
    assert mgr.describe_into([1, 2, 3], None, None, empty) == 0


def test_describe_repeated_ids_allowed(mgr):
    assert mgr.describe([2, 2]).seq_lens.tolist() == [4, 4]


def test_fork(mgr):
    copies = mgr.fork(1, [10, 11])
    table, lens, _ = mgr.describe([1, 10, 11])
    assert lens.tolist() == [10, 10, 10]
    assert copies == [(int(table[0, 2]), int(table[1, 2])), (int(table[0, 2]), int(table[2, 2]))]
    assert (table[1:, :2] == table[0, :2]).all()
    assert mgr.stats().shared_blocks == 2
    assert mgr.fork(2, np.array([20], np.int64)) == []  # full blocks only: nothing to copy
    mgr.check()


def test_remove_and_stats(mgr):
    s = mgr.stats()
    assert isinstance(s, kvplug.ManagerStats)
    assert (s.num_blocks, s.block_size, s.used_blocks, s.free_blocks) == (16, 4, 5, 11)
    assert (s.num_seqs, s.num_tokens, s.allocated_slots, s.internal_waste) == (3, 15, 20, 5)
    assert s.fragmentation == pytest.approx(0.25)
    mgr.remove(ids(1, 3))
    mgr.remove(2)
    s = mgr.stats()
    assert (s.free_blocks, s.used_blocks, s.num_seqs, s.peak_used_blocks) == (16, 0, 0, 5)
    assert s.fragmentation == 0.0


def test_grow_with_int_and_numpy_scalar_counts(mgr):
    mgr.grow(ids(1, 2), np.int32(2))
    mgr.grow(ids(1, 2), 2)
    mgr.grow(ids(1, 2), np.array([1, 0], np.int64))  # converted
    assert mgr.describe([1, 2]).seq_lens.tolist() == [15, 8]


def test_grow_fill_cache_follows_batch_size_and_value():
    with kvplug.Manager(4096, 1) as m:
        batch = np.arange(600, dtype=np.int64)
        for i in batch:
            m.add(int(i), 1)
        m.grow(batch[:3], 1)
        m.grow(batch, 2)  # larger than the cached fill array
        m.grow(batch[:3], 1)
        assert m.describe(batch[:4]).seq_lens.tolist() == [5, 5, 5, 3]


def test_ids_of_every_kind(mgr):
    for seq_ids in ([1, 2], (1, 2), range(1, 3), ids(1, 2), np.array([1, 2], np.int32), np.array([1, 2], np.uint8)):
        assert mgr.describe(seq_ids).seq_lens.tolist() == [10, 4]


def test_context_manager_closes():
    with kvplug.Manager(4) as m:
        assert not m.closed and "handle=" in repr(m)
    assert m.closed and "closed" in repr(m)


def test_large_int64_ids():
    with kvplug.Manager(8, 4) as m:
        big, neg = 2**63 - 1, -(2**63)
        m.add(big, 3)
        m.add(neg, 3)
        m.grow([big, neg], 1)
        assert m.describe([neg, big]).seq_lens.tolist() == [4, 4]
        with pytest.raises(kvplug.InvalidArgumentError):
            m.add(2**63, 1)
        with pytest.raises(kvplug.InvalidArgumentError):
            m.grow([2**64], 1)


def test_token_mode_contiguous_runs():
    with kvplug.Manager(64, 1) as m:
        m.add(1, 5)
        m.grow([1], 7)
        table, lens, slots = m.describe([1])
        row = table[0, : lens[0]]
        assert (np.diff(row) == 1).all(), "token mode should hand out one contiguous run"
        assert slots.tolist() == row[5:].tolist()


def test_threads_share_a_manager():
    m = kvplug.Manager(4 * 8 * 16, 4)
    errors = []

    def worker(t):
        try:
            for r in range(50):
                batch = np.arange(8, dtype=np.int64) + t * 10_000 + r * 10
                for i in batch:
                    m.add(int(i), 3)
                table = np.empty((8, 4), np.int32)
                lens = np.empty(8, np.int32)
                slots = np.empty(8, np.int32)
                for _ in range(4):
                    m.grow(batch, 1)
                    assert m.describe_into(batch, table, lens, slots) == 8
                assert (lens == 7).all()
                try:
                    m.remove([-1 - t])
                except kvplug.UnknownSequenceError as e:
                    assert str(e) == f"remove: sequence {-1 - t} is not live"  # this thread's own message
                m.remove(batch)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    m.check()
    assert m.stats().free_blocks == m.stats().num_blocks
    m.close()
