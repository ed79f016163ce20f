"""PagedKVCache's scheduling paths against one another: a decode step (every
request one token of a live sequence) takes a bulk path, anything else the
checked per-sequence loop; both must give the same Batch and the same errors,
and append_tokens must do what append does for each sequence. A hybrid
model's Batch holds every layer group's arrays as the manager describes
them. No model needed: only the manager and the token bookkeeping are
exercised."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvplug
import kvplug.hf as kvhf

SHAPE = kvhf.ModelShape(1, 2, 1, 8)
FIELDS = ("seq_ids", "starts", "q_lens", "input_ids", "block_table", "seq_lens", "slot_mapping", "cached_tokens")


def _cache(num_blocks: int = 256) -> kvhf.PagedKVCache:
    return kvhf.PagedKVCache(SHAPE, num_blocks, 4, dtype=torch.float32)


def _prefilled(cache: kvhf.PagedKVCache, n: int, rng: np.random.Generator) -> list:
    """n live sequences with every prompt token computed and one sampled token appended."""
    ids = list(range(10, 10 + n))
    for sid in ids:
        cache.add(sid, rng.integers(1, 500, int(rng.integers(1, 12))).tolist())
    cache.commit(cache.schedule([(sid, 64) for sid in ids]))
    cache.append_tokens(ids, rng.integers(1, 500, n).tolist())
    return ids


def _same(a: kvhf.Batch, b: kvhf.Batch) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f
    assert a.not_admitted == b.not_admitted


def test_decode_step_matches_the_checked_loop():
    rng = np.random.default_rng(0)
    with _cache() as c1, _cache() as c2:
        ids = _prefilled(c1, 9, np.random.default_rng(1))
        assert _prefilled(c2, 9, np.random.default_rng(1)) == ids
        for _ in range(11):  # across block boundaries (block_size 4)
            order = rng.permutation(ids).tolist()
            fast = c1.schedule([(sid, 1) for sid in order])
            # np.int64 counts of 1 are decode too; a count of 2 with one token pending takes one token
            # through the checked loop: the same batch.
            slow = c2.schedule([(np.int64(sid), 2 if k == 0 else 1) for k, sid in enumerate(order)])
            _same(fast, slow)
            assert fast.is_decode
            for c, b in ((c1, fast), (c2, slow)):
                c.commit(b)
            toks = rng.integers(1, 500, len(ids)).tolist()
            c1.append_tokens(order, [toks[ids.index(s)] for s in order])
            for sid, t in zip(ids, toks):
                c2.append(sid, t)
            assert all(c1.seqs[s].tokens == c2.seqs[s].tokens for s in ids)


def test_decode_step_errors():
    with _cache() as cache:
        ids = _prefilled(cache, 3, np.random.default_rng(2))
        with pytest.raises(kvplug.UnknownSequenceError):
            cache.schedule([(ids[0], 1), (999, 1)])
        with pytest.raises(kvplug.DuplicateSequenceError):
            cache.schedule([(ids[0], 1), (ids[0], 1)])
        with pytest.raises(kvplug.InvalidArgumentError, match="scheduled for 0"):
            cache.schedule([(ids[0], 1), (ids[1], 0)])
        b = cache.schedule([(sid, 1) for sid in ids])
        cache.commit(b)
        with pytest.raises(kvplug.InvalidArgumentError, match="pending"):
            cache.schedule([(sid, 1) for sid in ids])  # nothing appended
        # A failed schedule grows nothing: the manager still agrees with the token state.
        cache.append_tokens(ids, [1, 2, 3])
        b = cache.schedule([(sid, 1) for sid in ids])
        assert b.seq_lens.tolist() == [len(cache.seqs[s].tokens) for s in ids]


def test_append_tokens_is_all_or_none():
    with _cache() as cache:
        cache.add(1, [5, 6])
        cache.add(2, [7])
        with pytest.raises(kvplug.UnknownSequenceError):
            cache.append_tokens([1, 3], [8, 9])
        with pytest.raises(kvplug.InvalidArgumentError):
            cache.append_tokens([1, 2], [8])
        with pytest.raises(ValueError):
            cache.append_tokens([1, 2], [8, "x"])
        assert cache.seqs[1].tokens == [5, 6] and cache.seqs[2].tokens == [7]
        cache.append_tokens(np.array([2, 1]), np.array([4, 3]))
        assert cache.seqs[1].tokens == [5, 6, 3] and cache.seqs[2].tokens == [7, 4]
        assert all(type(t) is int for t in cache.seqs[1].tokens)


def test_mixed_step_rows_go_as_one_array():
    """Decode rows with prompt chunks and an admission: the checked loop, whose grow passes int32 views."""
    with _cache() as cache:
        ids = _prefilled(cache, 4, np.random.default_rng(3))
        cache.add(50, list(range(1, 30)))
        cache.commit(cache.schedule([(50, 5)]))
        cache.add(60, list(range(100, 110)))
        b = cache.schedule([(ids[0], 1), (50, 7), (ids[1], 1), (60, 4)])
        assert b.seq_ids.tolist() == [ids[0], 50, ids[1], 60]
        assert b.q_lens.tolist() == [1, 7, 1, 4]
        assert b.input_ids[1:8].tolist() == list(range(6, 13))
        assert b.input_ids[-4:].tolist() == [100, 101, 102, 103]
        assert len(b.slot_mapping) == 13 and len(set(b.slot_mapping.tolist())) == 13


# Hybrid shapes without a model: Gemma 3's (five window layers to a full one: six groups) and Qwen3-Next's
# (linear-attention layers: recurrent groups, whose mappings are empty).
GEMMA3 = kvhf.ModelShape(6, 4, 2, 16, layer_types=("sliding_attention",) * 5 + ("full_attention",), sliding_window=8)
QWEN3_NEXT = kvhf.ModelShape(4, 4, 2, 16, layer_types=("linear_attention",) * 3 + ("full_attention",),
                             recurrent=kvhf.RecurrentShape(64, 4, 4, 8, 8))


def _same_as_manager(cache: kvhf.PagedKVCache, b: kvhf.Batch) -> None:
    """A grouped Batch holds what Manager.describe_groups reports for its sequences."""
    want = cache.manager.describe_groups(b.seq_ids)
    assert len(b.group_tables) == len(b.group_slots) == len(want) == len(cache.groups)
    assert b.block_table is b.group_tables[0] and b.slot_mapping is b.group_slots[0]
    for g, d in enumerate(want):
        for got, ref in ((b.group_tables[g], d.block_table), (b.seq_lens, d.seq_lens), (b.group_slots[g], d.slot_mapping)):
            assert got.dtype == ref.dtype and got.shape == ref.shape and np.array_equal(got, ref), g


@pytest.mark.parametrize("shape", [GEMMA3, QWEN3_NEXT], ids=["gemma-3", "qwen3-next"])
def test_grouped_batch_matches_describe_groups(shape):
    rng = np.random.default_rng(4)
    with kvhf.PagedKVCache(shape, 256, 8, dtype=torch.float32) as cache:
        assert len(cache.groups) == (6 if shape is GEMMA3 else 4)
        assert bool(cache.recurrent_groups) == (shape is QWEN3_NEXT)
        system = rng.integers(1, 500, 32).tolist()  # a recurrent checkpoint at its end: the second chunk's
        for sid in range(3):
            cache.add(sid, system + rng.integers(1, 500, 10 + 7 * sid).tolist())
        for step in range(30):
            if step == 12:  # an admission on the cached system prompt, among decode rows
                cache.add(9, system + [7, 8, 9])
            live = [sid for sid in cache.seqs if cache.seqs[sid].pending]
            b = cache.schedule([(sid, 16) for sid in live])
            _same_as_manager(cache, b)
            if step == 12:
                assert b.cached_tokens[b.seq_ids.tolist().index(9)] == 32, "the admission hit the system prompt"
            if shape is QWEN3_NEXT:
                assert all(len(b.group_slots[g]) == 0 for g in cache.recurrent_groups)
                assert all(len(b.group_slots[g]) == b.num_tokens for g in range(len(cache.groups))
                           if g not in cache.recurrent_groups)
            cache.commit(b)
            cache.manager.take_copies()  # the checkpoints' copies, which Runner.step performs
            done = [sid for sid in b.seq_ids.tolist() if not cache.seqs[sid].pending]
            if done:
                cache.append_tokens(done, rng.integers(1, 500, len(done)).tolist())
        assert cache.seqs[9].live


def test_grouped_schedule_reports_a_disagreeing_manager():
    """A manager that holds more than the schedule says (grown behind the cache's back) is described at
    its own size and reported, not cut to the schedule's buffers."""
    with kvhf.PagedKVCache(GEMMA3, 64, 4, dtype=torch.float32) as cache:
        cache.add(1, list(range(1, 8)))
        cache.commit(cache.schedule([(1, 8)]))
        cache.append(1, 9)
        cache.manager.grow_tokens(np.array([1], np.int64), [[5, 6]])  # two tokens the cache does not know of
        with pytest.raises(kvplug.InternalError, match=r"manager lengths \[10\] disagree with the schedule \[8\]"):
            cache.schedule([(1, 1)])


@pytest.mark.parametrize("tier", [False, True])
def test_a_prompt_longer_than_the_pool_is_refused_at_add(tier):
    # A 60-token prompt in a pool of 12 blocks of 4 tokens can never be held.
    # It is refused when added, so a schedule never meets it after growing
    # the live sequences and admitting others (which would leave the cache
    # and the manager out of step), and the other requests go on.
    extra = dict(host_tier_slots=32, demote_ahead=0) if tier else {}
    with kvhf.PagedKVCache(SHAPE, 12, 4, dtype=torch.float32, **extra) as c:
        c.add(1, [1, 2, 3, 4])
        b = c.schedule([(1, 4)])
        if tier:
            c.tier.step(None)
        c.commit(b)
        c.append(1, 5)
        c.add(2, list(range(10, 18)))
        with pytest.raises(kvplug.PromptTooLongError, match="longer than the whole pool"):
            c.add(3, list(range(100, 160)))
        assert 3 not in c.seqs
        c.add(3, list(range(100, 148)))  # 48 tokens: the whole pool, which it may hold alone
        b = c.schedule([(1, 1), (2, 8)])
        assert list(b.seq_ids) == [1, 2] and list(b.seq_lens) == [5, 8]
        assert list(c.manager.describe([1, 2]).seq_lens) == [5, 8]
