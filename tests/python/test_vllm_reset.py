"""kvplug.vllm's reset_cache with transfers in flight, and loads the manager
could not serve, on the CPU without vLLM (the stand-in vLLM modules of
test_vllm_hybrid).

vLLM resets the offloading manager between scheduler steps, copies still
running on the workers (pause_generation(clear_cache=True)). The manager's
calls carry keys, not job ids, so a completion that arrives after the reset
names a key that may have been stored or loaded again since; and the host
store's own reset frees pinned and pending slots, which a copy of before the
reset may still read or write. These tests hold the manager to the
invariants that matter to vLLM: a block is HIT only once its newest copy has
finished, a load's slot is never evicted or handed out before its own
completion, and no slot under an old copy goes to a new one. Where a test
lets the manager either accept or refuse a store offered during the reset's
drain, both are correct answers to vLLM; what follows from each is checked."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_vllm_hybrid import _kv_caches, h, vl  # noqa: E402,F401  (vl: the stand-in fixture)


def _store(m, keys, ctx):
    out = m.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    m.complete_store(keys, ctx)
    return out.store_spec.block_ids.tolist()


def _reset_with_a_load_and_a_store_in_flight(vl):
    """A two-slot manager reset while load L1 reads k1's slot and store J
    writes k2's (the two slots); returns (m, ctx, [k1, k2, k3, k4])."""
    m = vl.kv.KvplugOffloadingManager(2)
    ctx = vl.ReqContext(req_id="a")
    ks = [vl.make_offload_key(h(i), 0) for i in (1, 2, 3, 4)]
    _store(m, ks[:1], ctx)
    l1 = m.prepare_load(ks[:1], ctx)
    j = m.prepare_store(ks[1:2], ctx)
    assert set(l1.block_ids.tolist()) | set(j.store_spec.block_ids.tolist()) == {0, 1}
    m.reset_cache()
    return m, ctx, ks


def _assert_store_empty(m):
    s = m.store_stats()
    assert (s.resident, s.pending, s.pinned) == (0, 0, 0)


def test_store_completing_after_reset_never_commits_a_later_store(vl):
    # Store J1 copies k1 into its slot when reset_cache() comes. A request
    # then offers k0 and k1 again (J2, if the manager takes it, copies k1
    # into another slot), and only then does J1's completion arrive,
    # carrying the key k1 alone. It must not make k1 readable: J2's copy has
    # not finished (or there is no J2).
    m = vl.kv.KvplugOffloadingManager(4)
    ctx, other = vl.ReqContext(req_id="a"), vl.ReqContext(req_id="b")
    k0, k1 = vl.make_offload_key(h(0), 0), vl.make_offload_key(h(1), 0)
    j1 = m.prepare_store([k1], ctx)
    m.reset_cache()
    j2 = m.prepare_store([k0, k1], other)
    m.complete_store(j1.keys_to_store, ctx)  # J1 finishes
    j2_pending = j2 is not None and k1 in j2.keys_to_store
    want = vl.LookupResult.HIT_PENDING if j2_pending else vl.LookupResult.MISS
    assert m.lookup(k1, other) == want
    assert m.prepare_load([k1], other).block_ids.tolist() == [-1]
    assert m.counters()["stale_completions"] == 1
    # The newest copy's own completion makes k1 readable, from its own slot.
    if not j2_pending:
        j2 = m.prepare_store([k0, k1], other)
        assert j2.keys_to_store == [k0, k1]
        assert m.lookup(k1, other) == vl.LookupResult.HIT_PENDING
    m.complete_store(j2.keys_to_store, other)
    assert m.lookup(k1, other) == vl.LookupResult.HIT
    slot = j2.store_spec.block_ids.tolist()[j2.keys_to_store.index(k1)]
    assert m.prepare_load([k1], other).block_ids.tolist() == [slot]
    assert m.counters()["errors"] == 0
    m.shutdown()


def test_load_completing_after_reset_never_drops_a_later_loads_pin(vl):
    # Load L1 reads k1's slot when reset_cache() comes. k1 is offered again
    # (if the manager takes it, it is stored and loaded by L2), and then L1's
    # completion arrives, carrying the key k1 alone. It must not release a
    # pin of L2: k1 would become evictable and its slot go to another store
    # while L2 still reads it.
    m = vl.kv.KvplugOffloadingManager(2)
    ctx = vl.ReqContext(req_id="a")
    k1, k2, k3 = (vl.make_offload_key(h(i), 0) for i in (1, 2, 3))
    _store(m, [k1], ctx)
    m.prepare_load([k1], ctx)  # L1
    m.reset_cache()
    again = m.prepare_store([k1], ctx)
    l2 = None
    if again is not None and again.keys_to_store == [k1]:
        m.complete_store([k1], ctx)
        l2 = m.prepare_load([k1], ctx)
    m.complete_load([k1], ctx)  # L1 finishes
    if l2 is None:  # refused while L1 ran: stored and loaded now
        _store(m, [k1], ctx)
        l2 = m.prepare_load([k1], ctx)
    assert l2.block_ids.tolist() != [-1]
    # L2 holds k1's slot until its own completion: two more blocks do not fit.
    assert m.prepare_store([k2, k3], ctx) is None
    assert m.counters()["stale_completions"] == 1
    m.complete_load([k1], ctx)  # L2 finishes
    out = m.prepare_store([k2, k3], ctx)
    assert out is not None and out.evicted_keys == [k1]
    assert m.counters()["errors"] == 0
    m.shutdown()


def test_reset_hands_out_no_slot_an_old_transfer_still_uses(vl):
    # At the reset, load L1 reads k1's slot and store J writes k2's. Until
    # both have completed, no new store gets either slot; here they are the
    # only two, so stores are refused. Every lookup misses meanwhile, though
    # the host store still holds k1. Their completions (J's a failure) count
    # as stale and, the last one in, the host store is reset.
    m, ctx, (k1, k2, k3, k4) = _reset_with_a_load_and_a_store_in_flight(vl)
    out = m.prepare_store([k3], ctx)
    assert out is None or not set(out.store_spec.block_ids.tolist()) & {0, 1}
    assert m.lookup(k1, ctx) == vl.LookupResult.MISS
    assert m.prepare_load([k1], ctx).block_ids.tolist() == [-1]
    m.complete_load([k1], ctx)  # L1 finishes: J still writes its slot
    assert m.prepare_store([k3], ctx) is None
    m.complete_store([k2], ctx, success=False)  # J finishes
    _assert_store_empty(m)
    out = m.prepare_store([k3, k4], ctx)
    assert sorted(out.store_spec.block_ids.tolist()) == [0, 1] and out.evicted_keys == []
    c = m.counters()
    assert (c["resets"], c["reset_inflight"], c["stale_completions"]) == (1, 2, 2)
    assert c["stores_refused"] == 2 and c["stores_failed"] == 0 and c["errors"] == 0
    m.shutdown()


def test_second_reset_while_draining_waits_for_the_first_ones_transfers(vl):
    m = vl.kv.KvplugOffloadingManager(1)
    ctx = vl.ReqContext(req_id="a")
    k1 = vl.make_offload_key(h(1), 0)
    m.prepare_store([k1], ctx)
    m.reset_cache()
    m.reset_cache()
    assert m.prepare_store([k1], ctx) is None
    m.complete_store([k1], ctx)
    assert m.prepare_store([k1], ctx).store_spec.block_ids.tolist() == [0]
    c = m.counters()
    assert (c["resets"], c["reset_inflight"], c["stale_completions"]) == (2, 1, 1)
    m.shutdown()


def test_reset_with_nothing_in_flight_empties_the_store_at_once(vl):
    m = vl.kv.KvplugOffloadingManager(2)
    ctx = vl.ReqContext(req_id="a")
    k1, k2 = vl.make_offload_key(h(1), 0), vl.make_offload_key(h(2), 0)
    _store(m, [k1, k2], ctx)
    m.reset_cache()
    assert m.store_stats().resident == 0
    assert m.lookup(k1, ctx) == vl.LookupResult.MISS
    assert _store(m, [k2], ctx) == [0]
    assert m.counters()["reset_inflight"] == 0
    m.shutdown()


def test_schedule_end_after_reset_ends_the_drain(vl):
    # vLLM's OffloadingConnector drops the completions of the transfers in
    # flight at a reset and has its workers wait for them before any later
    # transfer; it calls on_schedule_end every step. The first step after
    # the reset ends the drain: stores go on, without those completions.
    m, ctx, (_, _, k3, k4) = _reset_with_a_load_and_a_store_in_flight(vl)
    assert m.prepare_store([k3], ctx) is None
    m.on_schedule_end(None)
    _assert_store_empty(m)
    assert _store(m, [k3, k4], ctx) == [0, 1]
    m.on_schedule_end(None)  # nothing to end: changes nothing
    assert m.lookup(k3, ctx) == vl.LookupResult.HIT
    c = m.counters()
    assert (c["reset_inflight"], c["stale_completions"], c["errors"]) == (2, 0, 0)
    m.shutdown()


def _worker(vl):
    tensors, caches = _kv_caches(vl)
    return tensors, vl.kv.KvplugOffloadingWorker(caches, blocks_per_chunk=1, num_slots=4, pin_memory=False)


def test_worker_fails_a_load_with_blocks_the_manager_could_not_serve(vl):
    # Host slot -1 is a block the manager could not pin (a miss, a key
    # collision, a reset between lookup and load, a fault). The copy skips
    # it; the transfer must report failure, or vLLM runs attention over GPU
    # blocks that were never filled instead of recomputing them.
    tensors, w = _worker(vl)
    want = [t.clone() for t in tensors]
    gpu = vl.GPULoadStoreSpec([3, 4], group_sizes=(1, 1), block_indices=(0, 0))
    assert w.submit_store(1, gpu, types.SimpleNamespace(block_ids=np.array([0, 1], np.int32)))
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    for t in tensors:
        t.zero_()
    # Nothing served.
    assert w.submit_load(2, types.SimpleNamespace(block_ids=np.array([-1, -1], np.int32)), gpu)
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, False)]
    assert not any(t.any() for t in tensors)
    # The full group's block served, the window group's not: the served one
    # is copied all the same, the transfer failed; finished through wait().
    assert w.submit_load(3, types.SimpleNamespace(block_ids=np.array([0, -1], np.int32)), gpu)
    w.wait({3})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(3, False)]
    assert torch.equal(tensors[0][3], want[0][3]) and not tensors[2][4].any()
    # Everything served.
    assert w.submit_load(4, types.SimpleNamespace(block_ids=np.array([0, 1], np.int32)), gpu)
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(4, True)]
    assert all(torch.equal(tensors[t][3], want[t][3]) for t in (0, 1)) and torch.equal(tensors[2][4], want[2][4])
    w.shutdown()


def test_reset_between_lookup_and_load_fails_the_load(vl):
    # The manager's spec for a block dropped between lookup and
    # prepare_load is slot -1; the worker turns it into a failed transfer.
    m = vl.kv.KvplugOffloadingManager(4)
    ctx = vl.ReqContext(req_id="a")
    k1 = vl.make_offload_key(h(1), 0)
    _store(m, [k1], ctx)
    assert m.lookup(k1, ctx) == vl.LookupResult.HIT
    m.reset_cache()
    spec = m.prepare_load([k1], ctx)
    assert spec.block_ids.tolist() == [-1] and m.counters()["load_misses"] == 1
    _, w = _worker(vl)
    assert w.submit_load(7, spec, vl.GPULoadStoreSpec([5], group_sizes=(1, 0), block_indices=(0, 0)))
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(7, False)]
    w.shutdown()
    m.shutdown()
