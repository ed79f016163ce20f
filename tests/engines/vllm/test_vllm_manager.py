"""kvplug.vllm's OffloadingManager called directly with vLLM's types, for the
bad input the issue names: keys never stored, a store of a block already
stored or being loaded, a lookup after reset, and faults under the manager.
Every case is a result in vLLM's terms (MISS, skip, None), counted; none
raises into the scheduler."""

from __future__ import annotations

import numpy as np
import pytest

from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, make_offload_key

import kvplug.vllm as kv

CTX = ReqContext(req_id="r")


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "little"), 0)


def keys(*ids: int):
    return [key(i) for i in ids]


@pytest.fixture
def m():
    mgr = kv.KvplugOffloadingManager(4, enable_events=True)
    yield mgr
    mgr.shutdown()


def store(m, *ids):
    out = m.prepare_store(keys(*ids), CTX)
    m.complete_store(out.keys_to_store, CTX)
    return out


def test_keys_never_stored_miss(m):
    assert m.lookup(key(9), CTX) == LookupResult.MISS
    spec = m.prepare_load(keys(9), CTX)  # the scheduler would not; the worker skips -1
    assert list(spec.block_ids) == [-1]
    m.complete_load(keys(9), CTX)
    c = m.counters()
    assert c["lookup_misses"] == 1 and c["load_misses"] == 1 and c["stale_completions"] == 1 and c["errors"] == 0


def test_store_of_stored_pending_or_loading_block_is_skipped(m):
    first = m.prepare_store(keys(1, 2), CTX)
    assert first.keys_to_store == keys(1, 2) and list(first.store_spec.block_ids) == [0, 1]
    assert m.lookup(key(1), CTX) == LookupResult.HIT_PENDING
    again = m.prepare_store(keys(1, 2, 3), CTX)  # 1 and 2 are being stored
    assert again.keys_to_store == keys(3)
    m.complete_store(keys(1, 2, 3), CTX)
    assert m.lookup(key(1), CTX) == LookupResult.HIT
    spec = m.prepare_load(keys(1), CTX)  # 1 is being loaded
    assert list(spec.block_ids) == [0]
    out = m.prepare_store(keys(1, 4), CTX)
    assert out.keys_to_store == keys(4) and out.evicted_keys == []
    m.complete_store(keys(4), CTX)
    # Full, and 1 is pinned by its load: 2 and 3 are evicted (LRU), never 1.
    out = m.prepare_store(keys(5, 6), CTX)
    assert out.evicted_keys == keys(2, 3)
    m.complete_store(keys(5, 6), CTX)
    assert m.lookup(key(1), CTX) == LookupResult.HIT
    m.complete_load(keys(1), CTX)
    assert m.counters()["stores_skipped_present"] == 3


def test_lookup_after_reset_misses(m):
    store(m, 1, 2)
    m.prepare_load(keys(1), CTX)
    m.reset_cache()
    assert m.lookup(key(1), CTX) == LookupResult.MISS
    m.complete_load(keys(1), CTX)  # a load of before the reset: stale
    m.complete_store(keys(2), CTX)
    assert m.store_stats().resident == 0
    out = m.prepare_store(keys(1), CTX)  # storable again, from slot 0
    assert list(out.store_spec.block_ids) == [0]
    c = m.counters()
    assert c["resets"] == 1 and c["stale_completions"] == 1 and c["errors"] == 0


def test_refused_store_is_none_and_changes_nothing(m):
    store(m, 1, 2, 3, 4)
    for k in keys(1, 2, 3, 4):
        m.prepare_load([k], CTX)
    before = m.store_stats()
    assert m.prepare_store(keys(7), CTX) is None
    after = m.store_stats()
    assert (after.resident, after.pending, after.pinned) == (before.resident, before.pending, before.pinned)
    assert m.counters()["stores_refused"] == 1


def test_failed_store_frees_its_slots(m):
    out = m.prepare_store(keys(1, 2), CTX)
    m.complete_store(out.keys_to_store, CTX, success=False)
    assert m.lookup(key(1), CTX) == LookupResult.MISS
    assert m.store_stats().pending == 0
    assert m.counters()["stores_failed"] == 2


def test_events_and_touch_order(m):
    store(m, 1, 2, 3, 4)
    m.touch(keys(1, 2), CTX)  # 3 is now least recently used, then 4
    out = m.prepare_store(keys(5), CTX)
    assert out.evicted_keys == keys(3)
    events = list(m.take_events())
    assert [(e.removed, e.medium) for e in events] == [(False, Medium.CPU), (True, Medium.CPU)]
    assert events[0].keys == keys(1, 2, 3, 4) and events[1].keys == keys(3)
    assert list(m.take_events()) == []


def test_a_fault_under_the_manager_is_a_miss_not_an_exception(m):
    store(m, 1)
    m._store.close()  # every call into the store now fails
    assert m.lookup(key(1), CTX) == LookupResult.MISS
    assert m.prepare_store(keys(2), CTX) is None
    spec = m.prepare_load(keys(1), CTX)
    assert list(spec.block_ids) == [-1]
    m.touch(keys(1), CTX)
    m.complete_store(keys(2), CTX)
    m.reset_cache()
    assert m.counters()["errors"] >= 4
    m._store = None


def test_zero_slots_refuses_everything():
    m = kv.KvplugOffloadingManager(0)
    assert m.lookup(key(1), CTX) == LookupResult.MISS
    assert m.prepare_store(keys(1), CTX) is None
    assert m.prepare_store([], CTX).keys_to_store == []


def test_plan_rows_matches_vllms_chunk_geometry():
    # Group of 5 GPU blocks starting at logical block 3, chunks of 2 blocks:
    # the first chunk (slot 7) starts one row in.
    rows = kv.plan_rows([10, 11, 12, 13, 14], [5], [3], [7, 8, 9], 2)
    gpu, host = rows[0]
    assert gpu.tolist() == [10, 11, 12, 13, 14]
    assert host.tolist() == [15, 16, 17, 18, 19]
    # Two groups, one of them empty, and a slot the store could not pin.
    rows = kv.plan_rows([1, 2, 3], [2, 0, 1], [0, 0, 4], [5, -1], 2)
    assert [r[1].tolist() for r in rows] == [[10, 11], [], [-1]]
    with pytest.raises(ValueError):
        kv.plan_rows([1, 2], [2], [0], [5, 6, 7], 1)  # a host chunk left over
    assert np.array_equal(kv.plan_rows([], [0], [0], [], 1)[0][0], [])
