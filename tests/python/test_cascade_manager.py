"""Planning shared-prefix attention from a kvplug.Manager without a GPU: the
host-only plan (kvp_manager_cascade_plan with no workspaces) finds the
sharing the manager's prefix cache and forks made, and bad arguments raise
(the device plans are compared with cascade.plan in
tests/gpu/test_cascade_manager_torch.py)."""

from __future__ import annotations

from typing import Iterator, List, Tuple

import numpy as np
import pytest

import kvplug
from kvplug import attn, cascade

BS = 16
SYSTEM = 512  # tokens: 32 whole blocks


@pytest.fixture
def shared() -> Iterator[Tuple[kvplug.Manager, List[int]]]:
    """8 sequences admitted with one 512-token system prompt and their own
    user turns (prefix cache on), each grown by one decode token."""
    rng = np.random.default_rng(5)
    system = rng.integers(0, 32000, SYSTEM, dtype=np.int32)
    with kvplug.Manager(1024, BS, prefix_cache=True) as m:
        ids = list(range(1, 9))
        for i in ids:
            turn = rng.integers(0, 32000, 20 + 9 * i, dtype=np.int32)
            matched = m.admit([i], [np.concatenate([system, turn])])
            assert matched.tolist() == ([0] if i == 1 else [SYSTEM])
        m.grow(ids, 1)
        yield m, ids


def host_plan(m: kvplug.Manager, ids, max_blocks: int = 64, **kw) -> cascade.CascadePlan:
    return cascade.plan_from_manager(m, ids, max_blocks, 32, 8, 128, attn.DTYPE_F16, **kw)


def test_host_plan_finds_the_system_prompt(shared):
    m, ids = shared
    p = host_plan(m, ids, decode_route=False)
    lens = m.describe(ids).seq_lens
    assert p.route == cascade.ROUTE_CASCADE
    assert p.batch == len(ids)
    # The system prompt's 512 tokens are read once instead of 8 times; the
    # user turns share nothing.
    assert p.saved_tokens == (len(ids) - 1) * SYSTEM
    assert p.total_tokens == int(lens.sum())
    assert p.num_items > 0
    assert "route=cascade" in repr(p)
    # Whether the cascade pays is the planner's cost model's call; the
    # sharing it found is the same either way.
    q = host_plan(m, ids)
    assert (q.saved_tokens, q.total_tokens) == (p.saved_tokens, p.total_tokens)
    assert q.route in (cascade.ROUTE_CASCADE, cascade.ROUTE_DECODE)


def test_host_plan_is_independent_of_order_and_width(shared):
    m, ids = shared
    a = host_plan(m, ids)
    b = host_plan(m, np.array(ids[::-1], np.int64), max_blocks=512)
    assert (a.saved_tokens, a.total_tokens, a.route) == (b.saved_tokens, b.total_tokens, b.route)


def test_forks_share_all_but_their_tails():
    with kvplug.Manager(1024, BS) as m:
        m.add(1, 4000)
        m.fork(1, [2, 3, 4])
        m.grow([1, 2, 3, 4], 1)
        p = host_plan(m, [1, 2, 3, 4], max_blocks=300, decode_route=False)
        assert p.route == cascade.ROUTE_CASCADE
        whole = 4000 // BS * BS  # the forked partial block is copied, not shared
        assert p.saved_tokens == 3 * whole
        assert p.total_tokens == 4 * 4001


def test_no_sharing_is_the_decode_route():
    with kvplug.Manager(1024, BS) as m:
        for i in range(1, 6):
            m.add(i, 300 + i)
        p = host_plan(m, [1, 2, 3, 4, 5])
        assert p.route == cascade.ROUTE_DECODE
        assert p.saved_tokens == 0 and p.total_tokens == sum(300 + i for i in range(1, 6))
        assert p.num_items == 0


def test_host_plan_with_varlen_queries(shared):
    """New prompts or chunks (several query rows) mixed with decode rows:
    the rows are counted, and a shared run ends before a member's first
    query token, so a chunk that reaches into the system prompt shares less."""
    m, ids = shared
    lens = m.describe(ids).seq_lens
    q = [1] * len(ids)
    q[0], q[3] = 40, 7
    qo = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    p = host_plan(m, ids, qo_indptr_host=qo, decode_route=False)
    assert p.total_q == int(qo[-1]) and p.max_q_len == 40
    assert p.route == cascade.ROUTE_CASCADE and p.total_tokens == int(lens.sum())
    assert 0 < p.saved_tokens <= (len(ids) - 1) * SYSTEM
    d = host_plan(m, ids)
    assert d.total_q == len(ids) and d.max_q_len == 1
    q[1] = int(lens[1]) + 1  # more query rows than the sequence has tokens
    bad = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    with pytest.raises(kvplug.InvalidArgumentError, match="query tokens"):
        host_plan(m, ids, qo_indptr_host=bad)
    with pytest.raises(kvplug.InvalidArgumentError, match="qo_indptr_host"):
        host_plan(m, ids, qo_indptr_host=qo[:-1])
    with pytest.raises(kvplug.InvalidArgumentError, match="device array"):
        host_plan(m, ids, qo_indptr_host=qo, qo_indptr=object())


def test_empty_batch():
    with kvplug.Manager(16, BS) as m:
        p = host_plan(m, np.zeros(0, np.int64))
        assert p.batch == 0 and p.route == cascade.ROUTE_DECODE and p.total_tokens == 0


def test_host_plan_cannot_be_updated(shared):
    m, ids = shared
    p = host_plan(m, ids)
    with pytest.raises(kvplug.InvalidArgumentError, match="no host workspace"):
        p.update(m.describe(ids).seq_lens)


def test_errors(shared):
    m, ids = shared
    with pytest.raises(kvplug.UnknownSequenceError):
        host_plan(m, ids + [99])
    with pytest.raises(kvplug.BufferTooSmallError, match="max_blocks_per_seq"):
        host_plan(m, ids, max_blocks=8)
    with pytest.raises(kvplug.InvalidArgumentError):
        host_plan(m, ids, max_blocks=0)
    with pytest.raises(kvplug.UnsupportedError):
        cascade.plan_from_manager(m, ids, 64, 32, 8, 128, attn.DTYPE_F32)
    with pytest.raises(kvplug.UnsupportedError):
        cascade.plan_from_manager(m, ids, 64, 32, 8, 96, attn.DTYPE_F16)
    with pytest.raises(kvplug.InvalidArgumentError):
        cascade.plan_from_manager(m, ids, 64, 32, 7, 128, attn.DTYPE_F16)
    with pytest.raises(kvplug.InvalidArgumentError, match="headroom"):
        host_plan(m, ids, headroom=-1)
    with pytest.raises(kvplug.InvalidArgumentError, match="seq_lens"):
        host_plan(m, ids, seq_lens=object())
    with pytest.raises(kvplug.InvalidArgumentError, match="Manager"):
        cascade.plan_from_manager(object(), ids, 64, 32, 8, 128, attn.DTYPE_F16)
    with pytest.raises(kvplug.InvalidArgumentError):
        host_plan(m, ids, max_blocks=2**31)


def test_closed_manager():
    m = kvplug.Manager(16, BS)
    m.add(1, 10)
    m.close()
    with pytest.raises(kvplug.InvalidHandleError):
        host_plan(m, [1])


def test_failed_plan_changes_nothing(shared):
    m, ids = shared
    before = m.describe(ids, max_blocks=64)
    with pytest.raises(kvplug.UnknownSequenceError):
        host_plan(m, ids + [99])
    after = m.describe(ids, max_blocks=64)
    assert np.array_equal(before.block_table, after.block_table)
    assert np.array_equal(before.seq_lens, after.seq_lens)
    m.check()


def _demo():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "demo.py"
    spec = importlib.util.spec_from_file_location("kvplug_demo_kv_reads", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("cache", [False, True])
def test_demo_counts_the_kv_reads_sharing_saves(cache):
    """bench/demo.py's multi-tenant trace: with the prefix cache on, the
    tenants' requests hold the same system-prompt blocks and shared-prefix
    attention reads fewer KV bytes than plain decode; with it off, every
    request holds its own copy and nothing is saved."""
    demo = _demo()
    cfg = demo.Config(steps=300, num_blocks=8000, arrival_rate=0.25, output_len=(20, 200),
                      prompt_len=(1050, 4500), progress_every=0)
    e = demo.PrefixEngine(cfg, cache)
    try:
        e.run(demo.PrefixWorkload(cfg), lambda line: None)
        mt = e.metrics
        plain, shared, planned = np.array(mt.kv_plain), np.array(mt.kv_shared), np.array(mt.kv_planned)
        assert len(plain) > 250 and plain.min() > 0
        assert (shared <= planned).all() and (planned <= plain).all()
        if cache:
            assert shared.sum() < 0.95 * plain.sum()
        else:
            assert mt.cascade_steps == 0 and (shared == plain).all()
        assert "shared-prefix" in demo.kv_reads(e)
    finally:
        e.close()
