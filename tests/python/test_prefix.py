"""The prefix cache through the Python API: admit, grow_tokens, match, pin,
priorities, stats, events and clear."""

from __future__ import annotations

import numpy as np
import pytest

import kvplug
from kvplug import Keys, MMItem

BS = 4


@pytest.fixture
def cm():
    with kvplug.Manager(32, BS, prefix_cache=True, kv_events=True) as m:
        yield m


def rand_tokens(rng, n):
    return rng.integers(0, 50_000, n, dtype=np.int32)


def test_admit_shares_a_cached_prefix(cm):
    rng = np.random.default_rng(1)
    system = rand_tokens(rng, 2 * BS)
    a = np.concatenate([system, rand_tokens(rng, 3)])
    b = np.concatenate([system, rand_tokens(rng, 5)])
    matched = cm.admit([1, 2], [a, b])
    assert matched.tolist() == [0, 2 * BS]  # b shares what a cached in the same call
    t = cm.describe([1, 2]).block_table
    assert t[0, :2].tolist() == t[1, :2].tolist() and t[0, 2] != t[1, 2]
    # Only b's unmatched tokens are new: their slots.
    assert len(cm.describe([2]).slot_mapping) == len(b) - 2 * BS
    assert cm.stats().shared_blocks == 2
    cm.check()


def test_tenants_and_adapters_are_isolated(cm):
    rng = np.random.default_rng(2)
    p = rand_tokens(rng, 3 * BS + 1)
    cm.admit([1], [p], Keys(salt=b"alice"))
    assert cm.match([p, p, p, p], [Keys(salt=b"alice"), Keys(salt=b"bob"), None, Keys(salt=b"alice", adapter=7)]) == [
        kvplug.Match(3 * BS, -1, 0),
        kvplug.Match(0, -1, 0),
        kvplug.Match(0, -1, 0),
        kvplug.Match(0, -1, 0),
    ]
    # Multimodal content is part of the identity.
    img = MMItem(0, 2, bytes(range(16)))
    other = MMItem(0, 2, bytes(16))
    cm.admit([2], [p], Keys(mm=[img]))
    assert cm.match([p], Keys(mm=[img]))[0].matched_tokens == 3 * BS
    assert cm.match([p], Keys(mm=[other]))[0].matched_tokens == 0


def test_removed_sequences_stay_cached_until_evicted():
    rng = np.random.default_rng(3)
    with kvplug.Manager(8, BS, prefix_cache=True) as m:
        p = rand_tokens(rng, 6 * BS + 1)
        m.admit([1], [p])
        m.mark_computed()  # the step's forward pass ran
        m.remove([1])
        st = m.stats()
        assert (st.cached_blocks, st.free_blocks) == (6, 2)
        # 5 blocks: the 2 free and 3 evicted, the deepest first.
        assert m.admit([2], [rand_tokens(rng, 5 * BS)]).tolist() == [0]
        assert m.prefix_stats().evictions == 3
        assert m.match([p])[0].matched_tokens == 3 * BS
        # Nothing left to evict: the next prompt is not admitted.
        assert m.admit([3, 4], [rand_tokens(rng, 4 * BS), [1]]).size == 0
        m.check()


def test_decode_caches_blocks_as_they_fill(cm):
    rng = np.random.default_rng(4)
    prompt = rand_tokens(rng, 6)
    cm.admit([1], [prompt])
    out = list(prompt)
    for _ in range(10):
        tok = int(rng.integers(0, 50_000))
        cm.grow_tokens([1], [[tok]])
        out.append(tok)
    assert cm.prefix_stats().cached_blocks == len(out) // BS
    follow_up = out + [1, 2, 3]
    assert cm.admit([2], [follow_up]).tolist() == [len(out) // BS * BS]
    cm.check()


def test_pins_priorities_and_clear(cm):
    rng = np.random.default_rng(5)
    system = rand_tokens(rng, 2 * BS)
    cm.admit([1], [np.concatenate([system, [1]])])
    with pytest.raises(kvplug.NotFoundError):
        cm.pin(system)  # no forward pass has computed the blocks yet
    cm.mark_computed()
    pin, n = cm.pin(system)
    assert n == 2
    assert cm.set_priority(system, 10) == 2
    with pytest.raises(kvplug.NotFoundError):
        cm.pin(rand_tokens(rng, BS))
    with pytest.raises(kvplug.InvalidArgumentError):
        cm.clear_prefix_cache()  # sequence 1 holds the blocks
    cm.remove([1])
    assert cm.prefix_stats().pinned_blocks == 2
    cm.unpin(pin)
    with pytest.raises(kvplug.NotFoundError):
        cm.unpin(pin)
    assert cm.clear_prefix_cache() == 2
    assert cm.stats().free_blocks == 32
    st = cm.prefix_stats()
    assert st.queries == 1 and st.cached_blocks == 0
    cm.reset_prefix_stats()
    assert cm.prefix_stats().queries == 0


def test_events_replay_to_the_cached_set(cm):
    rng = np.random.default_rng(6)
    cached = set()

    def replay():
        for ev in cm.drain_events(max_events=3):  # small batches: several calls
            if ev.kind == "stored":
                assert ev.parent == bytes(16) or ev.parent in cached
                assert len(ev.tokens) == BS
                cached.add(ev.hash)
            elif ev.kind == "removed":
                for h in ev.hashes:
                    cached.remove(h)
            else:
                cached.clear()

    live = []
    for i in range(40):
        sid = 100 + i
        n = cm.admit([sid], [np.concatenate([np.arange(8, dtype=np.int32), rand_tokens(rng, int(rng.integers(1, 12)))])])
        if n.size:
            live.append(sid)
            if i % 5 == 0:  # aborted before its forward pass: its blocks leave the cache
                cm.remove([live.pop()])
        cm.mark_computed()  # the step's forward pass
        if len(live) > 3 or not n.size:
            cm.remove([live.pop(0)])
        while True:
            before = len(cached), cm.prefix_stats().pending_events
            replay()
            if cm.prefix_stats().pending_events == 0:
                break
            assert (len(cached), cm.prefix_stats().pending_events) != before
    assert len(cached) == cm.prefix_stats().cached_blocks
    assert cm.prefix_stats().evictions > 0
    assert cm.prefix_stats().dropped_uncomputed > 0
    cm.check()


def test_removed_before_its_forward_pass_matches_nothing():
    # The computed-K/V contract: a request admitted and removed before its
    # forward pass (preempted, aborted) leaves nothing a later prompt
    # matches; one admitted later in the same step that shares the filler's
    # blocks makes the filler's removal an InUseError; after mark_computed
    # the blocks stay cached.
    m = kvplug.Manager(64, 16, prefix_cache=True)
    P = list(range(100, 180))
    assert m.admit([1], [P]).tolist() == [0]
    m.remove([1])
    assert m.admit([2], [P]).tolist() == [0]
    assert m.admit([3], [P]).tolist() == [64]  # same step: shares 2's blocks
    with pytest.raises(kvplug.InUseError, match="sequence 3"):
        m.remove([2])
    st = m.prefix_stats()
    assert (st.uncomputed_blocks, st.dropped_uncomputed) == (5, 5)
    m.mark_computed()
    m.remove([2, 3])
    assert m.admit([4], [P]).tolist() == [64]
    assert issubclass(kvplug.InUseError, kvplug.KvplugError)
    m.check()
    m.close()


def test_stored_event_hashes_follow_hash_md(cm):
    xxhash = pytest.importorskip("xxhash")
    from test_hash_vectors import block_inputs

    assert xxhash
    tokens = list(range(1000, 1000 + 3 * BS + 1))
    cm.admit([1], [tokens], Keys(salt=b"s", adapter=5))
    want = [h for _, h in block_inputs(tokens, BS, adapter=5, salt=b"s")]
    got = [ev.hash for ev in cm.drain_events()]
    assert got == want


def test_bad_input_changes_nothing(cm):
    cm.admit([1], [[1, 2, 3, 4, 5]])
    before = (cm.stats(), cm.prefix_stats())
    with pytest.raises(kvplug.InvalidArgumentError):
        cm.admit([2], [[]])
    with pytest.raises(kvplug.DuplicateSequenceError):
        cm.admit([1], [[1, 2]])
    with pytest.raises(kvplug.DuplicateSequenceError):
        cm.admit([3, 3], [[1], [2]])
    with pytest.raises(kvplug.InvalidArgumentError):
        cm.admit([2], [[1, 2]], Keys(salt=b"x" * 2000))
    with pytest.raises(kvplug.InvalidArgumentError):
        cm.admit([2], [[1, 2]], Keys(mm=[MMItem(1, 0, bytes(16))]))
    with pytest.raises(kvplug.InvalidArgumentError):
        cm.admit([2], [[1, 2]], Keys(mm=[MMItem(3, 1, bytes(16)), MMItem(1, 1, bytes(16))]))
    with pytest.raises(kvplug.InvalidArgumentError):
        cm.add_mm_items(1, [MMItem(0, 2, bytes(16))])  # inside a filled block
    with pytest.raises(kvplug.UnknownSequenceError):
        cm.add_mm_items(9, [MMItem(8, 2, bytes(16))])
    with pytest.raises(kvplug.InvalidArgumentError):
        cm.admit([2], [[1, 2]], [None, None])
    with pytest.raises(kvplug.UnknownSequenceError):
        cm.grow_tokens([9], [[1]])
    with pytest.raises(kvplug.OutOfBlocksError):
        cm.grow_tokens([1], [list(range(200))])
    assert (cm.stats(), cm.prefix_stats()) == before
    cm.check()


def test_without_the_cache_admit_is_add():
    with kvplug.Manager(16, BS) as m:
        assert m.admit([1, 2], [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]).tolist() == [0, 0]
        assert m.match([[1, 2, 3, 4, 5]]) == [kvplug.Match(0, -1, 0)]
        with pytest.raises(kvplug.InvalidArgumentError):
            m.pin([1, 2, 3, 4])
        with pytest.raises(kvplug.InvalidArgumentError):
            m.drain_events()
        assert m.prefix_stats().cached_blocks == 0


def test_chunked_prefill_through_an_image():
    # The header's flow: match the whole prompt, admit a first chunk that
    # ends inside the image, grow_tokens the rest.
    P = list(range(48)) + [-1] * 32 + list(range(100, 110))  # image placeholders at [48, 80)
    img = Keys(mm=[MMItem(48, 32, b"\x11" * 16)])
    other = Keys(mm=[MMItem(48, 32, b"\x22" * 16)])
    with kvplug.Manager(64, 16, prefix_cache=True) as m:
        assert m.match([P], img)[0].matched_tokens == 0
        m.admit([1], [P[:40]], img)
        m.grow_tokens([1], [P[40:]])
        assert m.match([P])[0].matched_tokens == 48  # text only: never the image's blocks
        assert m.match([P], img)[0].matched_tokens == 80
        assert m.match([P], other)[0].matched_tokens == 48
        # Another image, chunked the same way, caches its own image blocks.
        before = m.prefix_stats()
        m.admit([2], [P[:40]], other)
        m.grow_tokens([2], [P[40:]])
        after = m.prefix_stats()
        # Block 2 ([32, 48), text) is an honest duplicate: the 40-token chunk
        # could match only two blocks. Blocks 3 and 4 hold the other image.
        assert (after.inserts - before.inserts, after.dedups - before.dedups) == (2, 1)
        assert m.match([P], other)[0].matched_tokens == 80
        m.check()


def test_items_added_after_admission():
    P = list(range(20)) + [-1] * 8 + list(range(30, 36))  # image at [20, 28)
    img = MMItem(20, 8, b"\x33" * 16)
    with kvplug.Manager(32, BS, prefix_cache=True) as m:
        m.admit([1], [P[:18]])  # the image is not known yet
        m.add_mm_items(1, [img])
        m.grow_tokens([1], [P[18:]])
        assert m.match([P], Keys(mm=[img]))[0].matched_tokens == 32
        assert m.match([P])[0].matched_tokens == 20
        with pytest.raises(kvplug.InvalidArgumentError):
            m.add_mm_items(1, [MMItem(30, 1, b"\x44" * 16)])  # inside a filled block now
        m.check()


def test_drain_makes_progress_whatever_a_block_holds():
    # One block of 2048 tokens with 1100 one-token images: far more entries
    # than the drain's first buffers hold.
    items = [MMItem(i, 1, i.to_bytes(16, "little")) for i in range(1100)]
    with kvplug.Manager(4, 2048, prefix_cache=True, kv_events=True) as m:
        m.admit([1], [list(range(2049))], Keys(mm=items))
        evs = m.drain_events()
        assert len(evs) == 1 and evs[0].kind == "stored"
        assert len(evs[0].tokens) == 2048 and evs[0].tokens[-1] == 2047
        assert evs[0].mm == tuple((i, i.to_bytes(16, "little")) for i in range(1100))
        assert m.drain_events() == []
        assert m.prefix_stats().pending_events == 0


def test_prompt_forms_agree():
    # Lists, int32 and int64 arrays, a 2-D batch and (when installed) torch
    # tensors are the same prompts.
    rng = np.random.default_rng(7)
    p = rand_tokens(rng, 3 * BS + 2)
    q = rand_tokens(rng, 3 * BS + 2)
    forms = [[p.tolist(), q.tolist()], [p, q], [p.astype(np.int64), q.astype(np.int64)], np.stack([p, q])]
    try:
        import torch

        forms.append([torch.from_numpy(p), torch.from_numpy(q)])
        forms.append(torch.from_numpy(np.stack([p, q]).astype(np.int64)))
    except ImportError:
        pass
    with kvplug.Manager(64, BS, prefix_cache=True) as m:
        m.admit([1, 2], [p, q])
        for i, f in enumerate(forms):
            assert [x.matched_tokens for x in m.match(f)] == [3 * BS, 3 * BS], i
            ids = [10 + 2 * i, 11 + 2 * i]
            assert m.admit(ids, f).tolist() == [3 * BS, 3 * BS], i
        with pytest.raises(kvplug.InvalidArgumentError):
            m.match([[1.5, 2.0]])
        with pytest.raises(kvplug.InvalidArgumentError):
            m.match([np.array([2**40])])
        with pytest.raises(kvplug.InvalidArgumentError):
            m.match([np.zeros((2, 2), np.int32)])
        m.check()


def test_decode_step_forms_and_no_per_step_allocation():
    import tracemalloc

    rng = np.random.default_rng(8)
    n = 512  # an array of the batch (2 KiB) would stand out of the call's small objects
    with kvplug.Manager(8192, BS, prefix_cache=True) as m:
        ids = np.arange(n, dtype=np.int64)
        m.admit(ids, [rand_tokens(rng, 5) for _ in range(n)])
        toks = np.arange(n, dtype=np.int32)
        m.grow_tokens(ids, toks)  # one token each, int32 in place
        m.grow_tokens(ids, toks.tolist())  # a list of ints
        m.grow_tokens(ids, np.stack([toks, toks], axis=1))  # two each, a row per sequence
        m.grow_tokens(ids, [[1], [], [2, 3]] + [[4]] * (n - 3))
        lens = m.describe(ids).seq_lens.tolist()
        assert lens[:4] == [10, 9, 11, 10] and set(lens[3:]) == {10}
        with pytest.raises(kvplug.InvalidArgumentError):
            m.grow_tokens(ids, toks[:3])
        # A step over arrays it reuses allocates none.
        table = np.empty((n, 16), np.int32)
        sl, slots = np.empty(n, np.int32), np.empty(n, np.int32)
        m.grow_tokens(ids, toks)
        m.describe_into(ids, table, sl, slots)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(20):
                m.grow_tokens(ids, toks)
                m.describe_into(ids, table, sl, slots)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak - base < 4 * n, f"a decode step allocated {peak - base} bytes at once"
        # The tokens went in: every sequence's blocks up to its length are cached.
        assert m.prefix_stats().cached_blocks >= sum(lens) // BS
        m.check()


def test_keys_are_built_once_and_frozen():
    rng = np.random.default_rng(9)
    items = [MMItem(2, 3, bytearray(b"\x05" * 16))]
    k = Keys(mm=items, salt=bytearray(b"t"))
    items.append(MMItem(9, 1, bytes(16)))  # the Keys keeps its own copy
    assert isinstance(k.mm, tuple) and len(k.mm) == 1 and k.salt == b"t"
    assert k == Keys(mm=(MMItem(2, 3, b"\x05" * 16),), salt=b"t") and hash(k) == hash(Keys(mm=(MMItem(2, 3, b"\x05" * 16),), salt=b"t"))
    p = rand_tokens(rng, 3 * BS + 1)
    with kvplug.Manager(64, BS, prefix_cache=True) as m:
        m.admit([1], [p], k)
        c = k._c
        assert c is not None
        for i in range(3):
            assert m.match([p], k)[0].matched_tokens == 3 * BS
            assert m.match([p, p], [k, None])[1].matched_tokens == 0
        assert k._c is c  # built once
        with pytest.raises(kvplug.InvalidArgumentError):
            m.match([p], Keys(mm=[MMItem(0, 1, b"short")]))
        with pytest.raises(kvplug.InvalidArgumentError):
            m.match([p], Keys(mm=[(0, 1)]))


def test_match_room_charges_only_the_hit_nothing_holds(cm):
    # A 2-block system prompt cached by sequence 1 (3 blocks): while 1 runs,
    # a prompt sharing the system prompt may have every free block; once 1
    # is gone, the free and evictable blocks less the 2 its hit would take
    # out of the evictable ones. admit agrees at the edge. A query: the
    # prefix stats do not move.
    rng = np.random.default_rng(7)
    system = rand_tokens(rng, 2 * BS)
    cm.admit([1], [np.concatenate([system, rand_tokens(rng, BS)])])
    cm.mark_computed()
    prompt = np.concatenate([system, rand_tokens(rng, 1)])
    before = cm.prefix_stats()
    assert cm.match_room([prompt]) == [cm.stats().free_blocks] == [29]
    assert cm.prefix_stats() == before
    cm.remove([1])
    ps = cm.prefix_stats()
    assert ps.evictable_blocks == 3
    assert cm.match_room([prompt, rand_tokens(rng, 3)]) == [32 - 2, 32]
    fits = np.concatenate([system, rand_tokens(rng, 30 * BS)])  # 32 blocks: the hit and the room
    assert cm.admit([2], [fits]).tolist() == [2 * BS]
    assert cm.match_room([prompt]) == [0]
    assert cm.match_room([]) == []


def test_match_room_is_unsupported_with_layer_groups():
    from kvplug import LayerGroup as G
    with kvplug.Manager(16, BS, prefix_cache=True, layer_groups=[G.full_attention(), G.sliding_window(8)]) as m:
        with pytest.raises(kvplug.UnsupportedError, match="layer groups"):
            m.match_room([[1, 2, 3]])
