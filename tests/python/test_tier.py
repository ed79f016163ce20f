"""The host KV tier through the Python API: the test plays the engine, with
a numpy array as the GPU pool's K/V, copying blocks into and out of the
host slots as flush_copies' batches ask."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import kvplug

BS, BLOCKS, SLOTS, BYTES = 4, 8, 16, 64


@pytest.fixture
def tm():
    with kvplug.Manager(BLOCKS, BS, prefix_cache=True, host_tier_slots=SLOTS, host_block_bytes=BYTES,
                        demote_ahead=BLOCKS) as m:
        yield m


def kv_of(i: int) -> np.ndarray:
    return np.full(BYTES, 0xA0 + i, np.uint8)


def run_copies(m: kvplug.Manager, gpu: np.ndarray) -> kvplug.CopyBatch:
    """One step's copies, as an engine does them; completes the batch."""
    batch = m.flush_copies()
    host = m.host_tier_memory()
    host[batch.demote_slots] = gpu[batch.demote_blocks]
    gpu[batch.reload_blocks] = host[batch.reload_slots]
    if batch.ticket:
        m.complete_copies(batch.ticket)
    return batch


def test_demotion_and_reload(tm):
    gpu = np.zeros((BLOCKS, BYTES), np.uint8)  # the fake GPU K/V pool
    conv = np.arange(100, 117, dtype=np.int32)  # four full blocks and one token
    assert tm.admit([1], [conv]).tolist() == [0]
    # The step: its flush_copies (nothing to copy), then its forward pass
    # writes the blocks. flush_copies never demotes a block allocated since
    # the previous flush (its K/V is not written yet), so the step runs
    # between the admission and the removal, as in an engine.
    assert run_copies(tm, gpu).ticket == 0
    table = tm.describe([1]).block_table[0]
    for i in range(4):
        gpu[table[i]] = kv_of(i)
    tm.mark_computed()  # the forward pass ran: its blocks are computed
    tm.remove([1])

    batch = run_copies(tm, gpu)
    assert batch.ticket != 0 and len(batch.demote_blocks) == 4 and len(batch.reload_blocks) == 0
    assert sorted(batch.demote_blocks.tolist()) == sorted(table[:4].tolist())
    assert tm.match_tiers([conv, conv[:5]]) == [kvplug.TierMatch(0, 16), kvplug.TierMatch(0, 4)]
    s = tm.tier_stats()
    assert (s.demotions_completed, s.host_resident, s.in_flight, s.host_slots) == (4, 4, 0, SLOTS)

    gpu[:] = 0  # the GPU K/V is gone
    assert tm.admit([2], [conv]).tolist() == [16]  # matched in the host tier
    batch = run_copies(tm, gpu)
    assert len(batch.demote_blocks) == 0 and len(batch.reload_blocks) == 4
    table = tm.describe([2]).block_table[0]
    for i in range(4):
        assert (gpu[table[i]] == kv_of(i)).all(), i
    s = tm.tier_stats()
    assert (s.reloads, s.reloads_completed, s.host_hit_tokens, s.host_pinned) == (4, 4, 16, 0)
    tm.check()
    assert run_copies(tm, gpu).ticket == 0  # nothing left to copy


def test_copies_in_flight_hold_their_blocks(tm):
    conv = np.arange(17, dtype=np.int32)
    tm.admit([1], [conv])
    assert tm.flush_copies().ticket == 0  # the step (see test_demotion_and_reload)
    tm.mark_computed()
    tm.remove([1])
    batch = tm.flush_copies()
    assert len(batch.demote_blocks) == 4
    assert tm.stats().free_blocks == BLOCKS - 4  # the blocks under the copies are not free
    assert tm.match_tiers([conv]) == [kvplug.TierMatch(0, 0)]  # nor matchable yet
    tm.complete_copies(batch.ticket, failed=True)
    s = tm.tier_stats()
    assert (s.demotions_failed, s.host_resident) == (4, 0) and tm.stats().free_blocks == BLOCKS
    with pytest.raises(kvplug.NotFoundError):
        tm.complete_copies(batch.ticket)


def test_refusals():
    with pytest.raises(kvplug.InvalidArgumentError, match="prefix cache"):
        kvplug.Manager(8, 4, host_tier_slots=4, host_block_bytes=16)
    with pytest.raises(kvplug.InvalidArgumentError, match="host_block_bytes"):
        kvplug.Manager(8, 4, prefix_cache=True, host_tier_slots=4)
    with pytest.raises(kvplug.InvalidArgumentError, match="demote_ahead"):
        kvplug.Manager(8, 4, prefix_cache=True, host_tier_slots=4, host_block_bytes=16, demote_ahead=9)
    with kvplug.Manager(8, 4, prefix_cache=True) as m:
        with pytest.raises(kvplug.InvalidArgumentError, match="no host tier"):
            m.flush_copies()
        with pytest.raises(kvplug.InvalidArgumentError, match="no host tier"):
            m.host_tier_memory()
        with pytest.raises(kvplug.InvalidArgumentError):
            m.complete_copies(1)
        assert m.tier_stats() == kvplug.TierStats(*([0] * 21))
        assert m.match_tiers([np.arange(9, dtype=np.int32)]) == [kvplug.TierMatch(0, 0)]


def test_flush_grows_its_arrays_past_demote_ahead():
    # Reloads beyond the first array's room: BUFFER_TOO_SMALL is handled.
    with kvplug.Manager(128, 1, prefix_cache=True, host_tier_slots=128, host_block_bytes=8, demote_ahead=128) as m:
        conv = np.arange(101, dtype=np.int32)
        m.admit([1], [conv])
        assert m.flush_copies().ticket == 0  # the step (see test_demotion_and_reload)
        m.mark_computed()
        m.remove([1])
        b = m.flush_copies()
        assert len(b.demote_blocks) == 101  # token mode: every token is a full block
        m.complete_copies(b.ticket)
        assert m.admit([2], [conv]).tolist() == [100]
        b = m.flush_copies()
        assert len(b.reload_blocks) == 100 and b.ticket
        m.complete_copies(b.ticket)
        m.check()


def test_kv_events_carry_the_medium():
    # A demotion committed to the host tier is a "CPU" stored event with its
    # GPU event's hash, parent and tokens; a host eviction a "CPU" removal.
    with kvplug.Manager(BLOCKS, BS, prefix_cache=True, kv_events=True, host_tier_slots=3, host_block_bytes=BYTES,
                        demote_ahead=BLOCKS) as m:
        gpu = np.zeros((BLOCKS, BYTES), np.uint8)
        a = np.arange(100, 109, dtype=np.int32)  # two full blocks and one token
        m.admit([1], [a])
        assert run_copies(m, gpu).ticket == 0  # the step (see test_demotion_and_reload)
        m.mark_computed()
        m.remove([1])
        stored = m.drain_events()
        assert [(e.kind, e.medium) for e in stored] == [("stored", "GPU")] * 2
        run_copies(m, gpu)
        evs = m.drain_events()
        assert [(e.kind, e.medium) for e in evs] == [("removed", "GPU"), ("stored", "CPU"), ("stored", "CPU")]
        for ev, want in zip(evs[1:], stored):  # parents first, as the GPU's
            assert (ev.hash, ev.parent, ev.tokens, ev.adapter) == (want.hash, want.parent, want.tokens, want.adapter)

        b = np.arange(200, 209, dtype=np.int32)  # two more blocks: one host slot left, the LRU goes
        m.admit([2], [b])
        assert run_copies(m, gpu).ticket == 0  # the step
        m.mark_computed()
        m.remove([2])
        m.drain_events()
        run_copies(m, gpu)
        evs = m.drain_events()
        assert [(e.kind, e.medium) for e in evs] == [("removed", "GPU"), ("removed", "CPU"), ("stored", "CPU"), ("stored", "CPU")]
        assert evs[1].hashes == (stored[1].hash,)  # a's second block: committed first, least recently used
        assert m.tier_stats().host_resident == 3
        m.clear_prefix_cache()
        evs = m.drain_events()
        assert evs[0] == kvplug.KVEvent("cleared") and [e.medium for e in evs[1:]] == ["CPU"] * 3


def test_demote_evicted_demotes_what_allocations_evict():
    """demote_evicted: an allocation that evicts cached blocks gets them at
    once; their demotions come in the next flush_copies batch, which the
    engine copies before the step writes the new owner's K/V (the fake
    mirrors the step's stream order: copies, then the forward's writes)."""
    with kvplug.Manager(BLOCKS, BS, prefix_cache=True, host_tier_slots=SLOTS, host_block_bytes=BYTES,
                        demote_evicted=True) as m:
        assert m.demote_evicted
        gpu = np.zeros((BLOCKS, BYTES), np.uint8)
        conv = np.arange(100, 117, dtype=np.int32)  # four full blocks and one token
        assert m.admit([1], [conv]).tolist() == [0]
        assert run_copies(m, gpu).ticket == 0  # the step: nothing to copy (demote_ahead 0)
        old = m.describe([1]).block_table[0][:4].copy()
        for i in range(4):
            gpu[old[i]] = kv_of(i)  # the step's forward pass
        m.mark_computed()
        m.remove([1])

        other = np.arange(500, 500 + BLOCKS * BS, dtype=np.int32)  # needs every block: evicts the 4 cached
        assert m.admit([2], [other]).tolist() == [0]
        table = m.describe([2]).block_table[0]
        assert set(old.tolist()) <= set(table.tolist())  # the evicted blocks serve the allocation at once
        s = m.tier_stats()
        assert (s.evicted_undemoted, s.in_flight, s.demotions_queued) == (0, 4, 0)
        batch = run_copies(m, gpu)  # the copies first, on the step's stream...
        assert sorted(batch.demote_blocks.tolist()) == sorted(old.tolist()) and len(batch.reload_blocks) == 0
        gpu[table] = 0xEE  # ...then the forward pass writes the new owner's K/V
        s = m.tier_stats()
        assert (s.demotions_completed, s.host_resident, s.in_flight, s.evicted_undemoted) == (4, 4, 0, 0)
        assert m.stats().used_blocks == BLOCKS  # completion frees nothing on the GPU
        m.check()

        m.mark_computed()
        m.remove([2])
        assert m.match_tiers([conv]) == [kvplug.TierMatch(0, 16)]
        assert m.admit([3], [conv]).tolist() == [16]
        run_copies(m, gpu)
        table = m.describe([3]).block_table[0]
        for i in range(4):
            assert (gpu[table[i]] == kv_of(i)).all(), i
        m.check()

    with pytest.raises(kvplug.InvalidArgumentError):
        kvplug.Manager(BLOCKS, BS, prefix_cache=True, demote_evicted=True)  # no host tier


def test_engine_memory():
    """host_tier_memory: the slots are the engine's array; demotions land
    in it and it outlives the manager; a wrong size or layout is refused."""
    mem = np.zeros((SLOTS, BYTES), np.uint8)
    m = kvplug.Manager(BLOCKS, BS, prefix_cache=True, host_tier_slots=SLOTS, host_block_bytes=BYTES,
                       demote_ahead=BLOCKS, host_tier_memory=mem)
    host = m.host_tier_memory()
    assert np.shares_memory(host, mem)
    gpu = np.zeros((BLOCKS, BYTES), np.uint8)
    conv = np.arange(500, 517, dtype=np.int32)
    m.admit([1], [conv])
    run_copies(m, gpu)  # the admission's step
    table = m.describe([1]).block_table[0]
    for i in range(4):
        gpu[table[i]] = kv_of(i)
    m.mark_computed()
    m.remove([1])
    batch = run_copies(m, gpu)
    assert len(batch.demote_blocks) == 4
    assert sorted(mem[batch.demote_slots, 0].tolist()) == [0xA0, 0xA1, 0xA2, 0xA3]
    m.close()
    assert sorted(mem[batch.demote_slots, 0].tolist()) == [0xA0, 0xA1, 0xA2, 0xA3]  # the engine's still
    for bad in (np.zeros((SLOTS, BYTES - 1), np.uint8), np.zeros((BYTES, SLOTS), np.uint8).T, [0] * (SLOTS * BYTES)):
        with pytest.raises(kvplug.InvalidArgumentError):
            kvplug.Manager(BLOCKS, BS, prefix_cache=True, host_tier_slots=SLOTS, host_block_bytes=BYTES,
                           host_tier_memory=bad)
    with pytest.raises(kvplug.InvalidArgumentError):  # no host tier
        kvplug.Manager(BLOCKS, BS, prefix_cache=True, host_tier_memory=np.zeros(0, np.uint8))


def kv_for(tokens: np.ndarray, i: int) -> np.ndarray:
    """The K/V bytes of block i of a prompt: a digest of the tokens up to its end."""
    d = hashlib.blake2b(np.ascontiguousarray(tokens[:(i + 1) * BS], np.int32).tobytes(), digest_size=16).digest()
    return np.resize(np.frombuffer(d, np.uint8), BYTES)


def test_write_through_keeps_every_gpu_hit():
    """write_through copies computed blocks to the host tier and leaves them
    on the GPU: beside a manager without a tier, driven by the same
    conversations, the GPU matches the same tokens at every admission, and
    the tier adds host hits for what the GPU evicted; the copies carry the
    blocks' bytes."""
    rng = np.random.default_rng(11)
    plain = kvplug.Manager(BLOCKS * 2, BS, prefix_cache=True)
    tiered = kvplug.Manager(BLOCKS * 2, BS, prefix_cache=True, host_tier_slots=8 * BLOCKS, host_block_bytes=BYTES,
                            write_through=3)
    gpu = np.zeros((BLOCKS * 2, BYTES), np.uint8)
    host = tiered.host_tier_memory()
    convs = [np.zeros(0, np.int32) for _ in range(6)]
    host_hits = 0
    for sid in range(1, 200):
        c = int(rng.integers(len(convs)))
        p = np.concatenate([convs[c], rng.integers(0, 50, int(rng.integers(1, 3 * BS)), dtype=np.int32)])
        if len(p) > BLOCKS * BS:
            p = p[-BS:]
        a = plain.admit([sid], [p])
        before = tiered.tier_stats().host_hit_tokens
        b = tiered.admit([sid], [p])
        assert len(a) == len(b)
        if not len(a):
            continue
        gained = tiered.tier_stats().host_hit_tokens - before
        assert b[0] - gained == a[0], (sid, a, b, gained)  # the GPU's match, exactly as without the tier
        host_hits += gained
        batch = tiered.flush_copies()  # the step: its copies (demote list: the write-through stores)...
        host[batch.demote_slots] = gpu[batch.demote_blocks]
        gpu[batch.reload_blocks] = host[batch.reload_slots]
        if batch.ticket:
            tiered.complete_copies(batch.ticket)
        table = tiered.describe([sid]).block_table[0]
        for i in range(int(b[0]) // BS):  # ...every matched block holds its prefix's K/V...
            assert (gpu[table[i]] == kv_for(p, i)).all(), (sid, i)
        for i in range(int(b[0]) // BS, len(p) // BS):  # ...then the forward pass writes the rest
            gpu[table[i]] = kv_for(p, i)
        plain.mark_computed()
        tiered.mark_computed()
        plain.remove([sid])
        tiered.remove([sid])
        convs[c] = p
        assert plain.prefix_stats().hit_tokens == tiered.prefix_stats().hit_tokens
    st = tiered.tier_stats()
    assert host_hits > 0 and st.write_through_stored > 0 and st.demotions_queued == 0, st
    tiered.check()
    plain.close()
    tiered.close()
    with pytest.raises(kvplug.InvalidArgumentError, match="write_through"):
        kvplug.Manager(8, 4, prefix_cache=True, write_through=1)  # no host tier
    with pytest.raises(kvplug.InvalidArgumentError, match="write_through"):
        kvplug.Manager(8, 4, prefix_cache=True, host_tier_slots=4, host_block_bytes=16, write_through=9)


def test_write_through_slack_waits_while_the_pool_has_room():
    """write_through_slack: no store while the pool has more free blocks
    than the slack (the computed blocks queue up), then write_through a
    flush, oldest first, once allocations bring the free blocks to it;
    nothing is lost when the slack covers a step's allocations."""
    wt, slack = 2, 6
    with kvplug.Manager(24, BS, prefix_cache=True, host_tier_slots=96, host_block_bytes=16,
                        write_through=wt, write_through_slack=slack) as m:
        computed, stored, started = [], [], False
        for sid in range(1, 21):
            m.admit([sid], [np.arange(100 * sid, 100 * sid + 2 * BS + 1, dtype=np.int32)])  # 2 full blocks + 1 token
            free, queued = m.stats().free_blocks, m.tier_stats().write_through_queue
            batch = m.flush_copies()
            if batch.ticket:
                m.complete_copies(batch.ticket)
            stored += batch.demote_blocks.tolist()
            st = m.tier_stats()
            if free > slack:
                assert len(batch.demote_blocks) == 0 and st.write_through_stored == 0, (sid, free, st)
                assert st.write_through_queue == queued == 2 * (sid - 1), (sid, st)
            else:
                assert len(batch.demote_blocks) == min(wt, queued), (sid, free, queued)
                started = True
            computed += m.describe([sid]).block_table[0][:2].tolist()
            m.mark_computed()
            m.remove([sid])
        st = m.tier_stats()
        assert started and st.write_through_lost == 0 and st.write_through_stored == len(stored) > 0, st
        assert stored == computed[:len(stored)]  # oldest first
        m.check()
    for kw in (dict(write_through_slack=1), dict(write_through=1, write_through_slack=25),
               dict(write_through=1, write_through_slack=-1)):
        with pytest.raises(kvplug.InvalidArgumentError, match="write_through_slack"):
            kvplug.Manager(24, BS, prefix_cache=True, host_tier_slots=4, host_block_bytes=16, **kw)
    with pytest.raises(kvplug.InvalidArgumentError, match="write_through_slack"):
        kvplug.Manager(24, BS, prefix_cache=True, write_through_slack=1)  # no host tier


def test_copy_ops_packing():
    """TierCopier's op packing (the arrays kvp_tier_copier_run takes) on
    the CPU: flush_copies' int32 arrays as they are, other integer
    sequences range-checked, mismatched or out-of-range ops refused."""
    from kvplug import tiercopy

    blocks, slots = np.arange(16, dtype=np.int32), np.arange(100, 116, dtype=np.int32)
    arr, n = tiercopy._ops(blocks, slots, "demote")
    view = np.frombuffer(arr, np.int32).reshape(-1, 2)
    assert n == 16 and (view[:, 0] == blocks).all() and (view[:, 1] == slots).all()
    arr, n = tiercopy._ops([1, 2], [3, 4], "reload")
    assert n == 2 and np.frombuffer(arr, np.int32).reshape(-1, 2).tolist() == [[1, 3], [2, 4]]
    assert tiercopy._ops((), (), "reload")[1] == 0
    for b, s in (([2**31], [0]), ([0], [-(2**31) - 1]), ([1, 2], [1]), ([[1]], [[1]])):
        with pytest.raises(kvplug.InvalidArgumentError):
            tiercopy._ops(b, s, "demote")


def test_write_through_flush_sizes_its_arrays_once():
    """A write-through batch is larger than demote_ahead: flush_copies
    grows its arrays to what the library asked for and starts there next
    time, and returns every store either way."""
    with kvplug.Manager(64, 4, prefix_cache=True, host_tier_slots=64, host_block_bytes=16, demote_ahead=0,
                        write_through=32) as m:
        ids = np.arange(4, dtype=np.int64)
        m.admit(ids, [list(range(1 + 100 * i, 1 + 100 * i + 17)) for i in range(4)])
        m.mark_computed()
        batch = m.flush_copies()
        assert len(batch.demote_blocks) == 16 and len(batch.demote_slots) == 16  # four full blocks each
        assert m._flush_caps[0] >= 16
        m.complete_copies(batch.ticket)
        assert m.tier_stats().write_through_stored == 16
        m.remove(ids)
