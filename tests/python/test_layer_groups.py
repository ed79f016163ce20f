"""Layer groups (hybrid models) through the Python bindings: a table per
group in one call, window groups that give blocks back as sequences grow,
recurrent states copied on fork, and bad groups refused with nothing
created."""

from __future__ import annotations

import numpy as np
import pytest

import kvplug
from kvplug import LayerGroup as G, _lib

BS = 4


def hybrid(num_blocks: int = 64, window: int = 6) -> kvplug.Manager:
    return kvplug.Manager(num_blocks, BS, layer_groups=[G.full_attention(), G.sliding_window(window),
                                                        G.recurrent(96)], block_bytes=128, max_model_len=1024)


def test_tables_slots_and_window_drops():
    w = 6
    with hybrid(window=w) as m:
        m.add(1, 10)
        full, win, state = m.describe_groups([1])
        assert (full.block_table >= 0).all() and (win.block_table >= 0).all()
        assert not set(full.block_table.ravel()) & set(win.block_table.ravel())
        assert state.block_table.shape[1] == 3 and state.block_table[0, 0] >= 0 and (state.block_table[0, 1:] == -1).all()
        assert len(state.slot_mapping) == 0
        for d in (full, win):  # every prompt token's slot, through the group's own table
            pos = np.arange(10)
            np.testing.assert_array_equal(d.slot_mapping, d.block_table[0, pos // BS] * BS + pos % BS)
        free0 = m.stats().free_blocks
        for length in range(10, 41):
            m.grow([1], 1)
            full, win, _ = m.describe_groups([1])
            keep = max(0, length - w + 1) // BS  # the first block the next query reads
            assert (win.block_table[0, :keep] == -1).all()
            assert (win.block_table[0, keep:] >= 0).all()
            assert (full.block_table[0] >= 0).all()
            assert win.slot_mapping[0] == win.block_table[0, length // BS] * BS + length % BS
        gb = m.group_blocks()
        assert gb[0] == 11 and gb[1] <= 3 and gb[2] == 1
        assert m.stats().free_blocks == free0 - (11 - 3) - (gb[1] - 3)
        # describe() is group 0's table.
        np.testing.assert_array_equal(m.describe([1]).block_table, full.block_table)
        m.remove([1])
        assert m.stats().free_blocks == 64
        m.check()


def test_fork_copies_partial_blocks_and_states():
    with hybrid() as m:
        m.add(1, 9)
        parent = m.describe_groups([1])
        copies = m.fork(1, [2, 3])
        # Per child: the partial last block of each attention group, and the state.
        assert len(copies) == 6
        srcs = sorted(s for s, _ in copies)
        assert srcs == sorted([parent[0].block_table[0, 2], parent[1].block_table[0, 2], parent[2].block_table[0, 0]] * 2)
        child = m.describe_groups([2])
        assert child[0].block_table[0, 0] == parent[0].block_table[0, 0]  # full blocks shared
        assert child[2].block_table[0, 0] != parent[2].block_table[0, 0]  # its own state
        assert len({d for _, d in copies}) == 6
        m.remove([1, 2, 3])
        assert m.group_blocks() == [0, 0, 0]


@pytest.mark.parametrize("groups, extra, error", [
    ([G.sliding_window(4), G.full_attention()], {}, kvplug.InvalidArgumentError),
    ([G.full_attention(), G.sliding_window(2048)], {"max_model_len": 2048}, kvplug.InvalidArgumentError),
    ([G.full_attention(), G.recurrent(4096)], {"block_bytes": 1024}, kvplug.InvalidArgumentError),
    ([G.full_attention(), G.recurrent(64)], {}, kvplug.InvalidArgumentError),
    ([G.full_attention(), G(7)], {}, kvplug.InvalidArgumentError),
    ([G.full_attention()] * 65, {}, kvplug.InvalidArgumentError),
    ([G.full_attention(), G.recurrent(64)], {"prefix_cache": True, "block_bytes": 64}, kvplug.InvalidArgumentError),
    ([G.full_attention(), G.recurrent(64, 2)], {"block_bytes": 64}, kvplug.InvalidArgumentError),
    # The host tier holds window groups, but not with demote_evicted in this version.
    ([G.full_attention(), G.sliding_window(8)], {"prefix_cache": True, "host_tier_slots": 4, "host_block_bytes": 64,
                                                 "demote_evicted": True}, kvplug.UnsupportedError),
])
def test_bad_groups_create_nothing(groups, extra, error):
    before = _lib.live_handles()
    with pytest.raises(error):
        kvplug.Manager(64, BS, layer_groups=groups, **extra)
    assert _lib.live_handles() == before


def test_layer_groups_type_errors():
    with pytest.raises(kvplug.ArgumentTypeError):
        kvplug.Manager(8, BS, layer_groups=[(0, 0, 0)])
    with pytest.raises(kvplug.ArgumentTypeError):
        kvplug.Manager(8, BS, layer_groups="full")


def test_one_group_is_the_plain_manager():
    with kvplug.Manager(8, BS) as m:
        assert m.layer_groups == (G.full_attention(),)
        m.add(1, 5)
        (d,) = m.describe_groups([1])
        np.testing.assert_array_equal(d.block_table, m.describe([1]).block_table)
        assert m.group_blocks() == [2]


def test_prefix_cache_groups_admit_and_match():
    """A window model's next turn hits its history: group 0's blocks, and the
    window blocks its query reads, the ones before them at -1."""
    w = 8
    rng = np.random.default_rng(8)
    with kvplug.Manager(64, BS, prefix_cache=True,
                        layer_groups=[G.full_attention(), G.sliding_window(w)]) as m:
        prompt = rng.integers(0, 30000, 30).tolist()
        m.admit([1], [prompt])
        m.grow_tokens([1], [5])  # the window slides past the prompt's first blocks
        m.mark_computed()
        full1, win1 = m.describe_groups([1])
        assert win1.block_table[0, 0] == -1
        m.remove([1])
        nxt = prompt + [5] + rng.integers(0, 30000, 7).tolist()
        assert m.match([nxt])[0].matched_tokens == 28
        assert list(m.admit([2], [nxt])) == [28]
        full2, win2 = m.describe_groups([2])
        h = 28 // BS
        keep = (28 - w + 1) // BS
        np.testing.assert_array_equal(full2.block_table[0, :h], full1.block_table[0, :h])
        assert (win2.block_table[0, :keep] == -1).all()
        np.testing.assert_array_equal(win2.block_table[0, keep:h], win1.block_table[0, keep:h])
        # Only the unmatched tokens are new, in both groups.
        assert len(full2.slot_mapping) == len(nxt) - 28 == len(win2.slot_mapping)
        m.check()


def test_recurrent_checkpoints_through_take_copies():
    """A recurrent model: the next turn hits up to the last checkpoint, and
    take_copies gives the copies that carry the state there (the
    checkpoint's, then the hit's), in order."""
    rng = np.random.default_rng(9)
    with kvplug.Manager(64, BS, prefix_cache=True, block_bytes=128,
                        layer_groups=[G.full_attention(), G.recurrent(96, checkpoint_every=2)]) as m:
        assert m.take_copies() == []  # the engine takes copies: checkpoints from now on
        prompt = rng.integers(0, 30000, 16).tolist()  # ends at block 4: a checkpoint
        m.admit([1], [prompt])
        state1 = int(m.describe_groups([1])[1].block_table[0, 0])
        m.mark_computed()
        (ckpt,) = m.take_copies()
        assert ckpt[0] == state1 and ckpt[1] != state1
        m.remove([1])
        nxt = prompt + [1, 2, 3]
        assert list(m.admit([2], [nxt])) == [16]
        state2 = int(m.describe_groups([2])[1].block_table[0, 0])
        assert m.take_copies() == [(ckpt[1], state2)]
        m.check()


def test_describe_groups_into_reuses_the_callers_arrays():
    with hybrid() as m:
        m.add(1, 10)
        m.add(2, 3)
        ids = np.array([1, 2], np.int64)
        tables = [np.full((2, 4), 7, np.int32) for _ in range(3)]
        lens = np.zeros(2, np.int32)
        slots = [np.full(16, 7, np.int32) for _ in range(3)]
        n = m.describe_groups_into(ids, tables, lens, slots)
        want = m.describe_groups(ids, max_blocks=4)
        assert n == 13 and list(lens) == [10, 3]
        for g in range(3):
            np.testing.assert_array_equal(tables[g], want[g].block_table)
        np.testing.assert_array_equal(slots[0][:n], want[0].slot_mapping)
        np.testing.assert_array_equal(slots[1][:n], want[1].slot_mapping)
        assert (slots[2] == 7).all()  # a recurrent group has no slots
        # Too small: nothing written.
        small = [np.full((2, 2), 5, np.int32) for _ in range(3)]
        with pytest.raises(kvplug.BufferTooSmallError):
            m.describe_groups_into(ids, small)
        assert all((t == 5).all() for t in small)
        with pytest.raises(kvplug.InvalidArgumentError):
            m.describe_groups_into(ids, tables[:2])
        with pytest.raises(kvplug.InvalidArgumentError):
            m.describe_groups_into(ids, [tables[0], np.zeros((2, 5), np.int32), None])
        # Only some groups.
        assert m.describe_groups_into(ids, [None, tables[1], None]) == 13


def mirror_hit(sets, groups, prompt, bs=BS):
    """The hit a router predicts from every group's events (kvplug.h, "KV
    events of layer groups"): the largest h, at most group 0's prefix, at
    which every window group holds the blocks its query reads and every
    recurrent group a checkpoint."""
    hashes = chain_hashes(prompt[: (len(prompt) - 1) // bs * bs], bs)
    h = 0
    while h < len(hashes) and hashes[h] in sets.get(0, ()):
        h += 1

    # The largest such h at which every group holds what the header's rule asks.
    def holds(h):
        for g, grp in enumerate(groups):
            got = sets.get(g, ())
            if grp.kind == G.SLIDING_WINDOW and any(hashes[j] not in got for j in range(max(0, h * bs - grp.window + 1) // bs, h)):
                return False
            if grp.kind == G.RECURRENT and h > 0 and hashes[h - 1] not in got:
                return False
        return True

    while h > 0 and not holds(h):
        h -= 1
    return h * bs


def chain_hashes(tokens, bs):
    """core/prefix/HASH.md's chained block hashes of a prompt without keys."""
    import struct

    xxhash = pytest.importorskip("xxhash")
    parent, out = bytes(16), []
    for i in range(len(tokens) // bs):
        blk = tokens[i * bs : (i + 1) * bs]
        b = bytes([1]) + parent + struct.pack("<I%di" % len(blk), len(blk), *blk) + struct.pack("<QI", 0, 0)
        b += struct.pack("<I", 0)
        parent = xxhash.xxh3_128_digest(b)
        out.append(parent)
    return out


def apply_events(sets, evs):
    for e in evs:
        if e.kind == "stored":
            assert e.hash not in sets.setdefault(e.group, set()), (e.group, e.hash)
            sets[e.group].add(e.hash)
        elif e.kind == "removed":
            for h in e.hashes:
                sets.setdefault(e.group, set()).remove(h)
        else:
            sets.clear()


def test_group_events_predict_hits():
    """Every group's KV events (drain_group_events, each with its group):
    window blocks evicted alone and recurrent checkpoints are announced, and
    a mirror of every group's blocks predicts each prompt's hit exactly,
    where group 0's events alone overestimate it; drain_events gives group
    0's alone."""
    rng = np.random.default_rng(21)
    groups = [G.full_attention(), G.sliding_window(8), G.recurrent(64, checkpoint_every=2)]
    with kvplug.Manager(48, BS, prefix_cache=True, kv_events=True, block_bytes=64, layer_groups=groups) as m:
        assert m.take_copies() == []  # checkpoints from now on
        sets = {}
        convs = []
        cut = 0
        for i in range(12):
            head = convs[rng.integers(len(convs))] if convs and rng.integers(2) else []
            p = (head + rng.integers(0, 30000, 4 * int(rng.integers(2, 7))).tolist())[:60]
            if len(m.admit([i], [p])) == 0:
                continue
            m.mark_computed()
            m.take_copies()
            for _ in range(int(rng.integers(0, 9))):  # decode: the window slides
                m.grow_tokens([i], [int(rng.integers(0, 30000))])
                m.mark_computed()
                m.take_copies()
            convs.append(p)
            m.remove([i])
            evs = m.drain_group_events(max_events=int(rng.integers(1, 8)))
            while evs:
                assert all(e.group in (0, 1, 2) and (e.kind != "cleared" or e.group == 0) for e in evs)
                apply_events(sets, evs)
                evs = m.drain_group_events(max_events=int(rng.integers(1, 8)))
            assert len(sets.get(0, ())) == m.prefix_stats().cached_blocks
            for c in convs:
                for q in (c + [1, 2, 3], c[: len(c) // 2] + [7]):
                    hit = mirror_hit(sets, groups, q)
                    assert hit == m.match([q])[0].matched_tokens
                    cut += hit < mirror_hit({0: sets.get(0, set())}, [groups[0]], q)
        assert cut > 0, "no hit was cut by a window or a checkpoint: the run tests nothing"
        assert sets.get(1) and sets.get(2)
    with kvplug.Manager(32, BS, prefix_cache=True, kv_events=True, layer_groups=groups[:2]) as m:
        m.admit([1], [list(range(9))])
        evs = m.drain_events()
        assert [(e.kind, e.group) for e in evs] == [("stored", 0), ("stored", 0)]
        assert m.drain_group_events() == []  # group 1's were passed over, and are gone
    with kvplug.Manager(32, BS, prefix_cache=True, kv_events=True) as m:  # no groups: the same events
        m.admit([1], [list(range(9))])
        assert [(e.kind, e.group) for e in m.drain_group_events()] == [("stored", 0), ("stored", 0)]
