"""kvplug.hf's early loads on the CPU: a prompt whose prefix continues in the
host tier, admitted beside other work, joins the step after its admission
while its blocks load (on a GPU, on a side stream beside that step's forward
pass; here, copies that a stub holds back until a step waits for them). The
conversations of test_hf_tier.py give the same greedy outputs with and
without early loads, every logit row is transformers', each deferred
sequence joins the very next step, no forward pass reads a block whose load
it has not waited for, and a prompt sharing a prefix with one being loaded
makes its step wait. tests/gpu/test_hf_tier.py runs them on a GPU."""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

import kvplug
import kvplug.hf as kvhf
from kvplug.hf import tier_copy

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import test_hf_correctness as H  # noqa: E402
import test_hf_tier as T  # noqa: E402

TIER = dict(num_blocks=24, host_slots=64, demote_ahead=6)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return H.tiny_model("llama")


@pytest.fixture(scope="module")
def without(model):
    return T.run_conversations(model, early_loads=False, **TIER)


def _loads(reqs) -> List[tier_copy.LoadRecord]:
    return [x for r in reqs for x in r.loads]


def test_same_outputs_with_and_without_early_loads(model, without):
    engine, rec, reqs, outs, s, lines = T.run_conversations(model, **TIER)
    assert engine.cache.early_loads is True  # the default with a host tier
    loads = _loads(reqs)
    assert sum(x.deferred for x in loads) >= 3, loads
    assert all(x.blocks > 0 and x.bytes == x.blocks * s["slot_bytes"] and x.seconds is not None for x in loads)
    assert not any(x.overlapped for x in loads)  # nothing overlaps on the CPU
    assert s["reloads_completed"] == s["reloads"] > 0 and s["in_flight"] == 0 and s["host_pinned"] == 0, s
    count, _ = H.compare(model, engine, rec, reqs, atol=2e-5, rtol=2e-5)
    assert count > 100
    assert outs == without[3]
    # Off: every load runs in the copies of the step that computes its prompt.
    off = _loads(without[2])
    assert off and not any(x.deferred for x in off) and without[0].cache.early_loads is False
    assert without[4]["reload_bytes"] == s["reload_bytes"]
    assert any(line.startswith("host tier loads by admission:") for line in lines)


def test_write_through_same_outputs_with_and_without_early_loads(model):
    kw = dict(num_blocks=24, host_slots=64, write_through=8)
    _, _, reqs, outs, s, _ = T.run_conversations(model, **kw)
    assert any(x.deferred for x in _loads(reqs)) and s["write_through_stored"] > 0, s
    assert outs == T.run_conversations(model, early_loads=False, **kw)[3]


class HeldLoads(tier_copy.TorchTierCopier):
    """Reloads issued by a schedule (early loads) land only when a step's
    stream waits for them (HostTier.join_loads): until then their blocks
    hold NaN, as a side stream's blocks could hold anything. The host slots
    are read at issue (the manager may reuse them once the batch is
    complete). Logs what happened in order."""

    def __init__(self, cache: Any, log: List[tuple]) -> None:
        super().__init__(cache.kv, cache.manager.host_tier_memory())
        self.log = log
        self.scheduling = False
        self.held: Dict[int, torch.Tensor] = {}  # GPU block -> the K/V its load brings

    def run(self, batch, stream=None):
        empty = np.empty(0, np.int32)
        if not self.scheduling or not len(batch.reload_blocks):
            self.log.append(("step copies", batch.reload_blocks.tolist()))
            return super().run(batch, stream)
        super().run(batch._replace(reload_slots=empty, reload_blocks=empty), stream)
        for b, s in zip(batch.reload_blocks.tolist(), batch.reload_slots.tolist()):
            self.held[b] = self.host[s].clone()
            self.kv[:, :, b] = float("nan")
        self.log.append(("issue", batch.reload_blocks.tolist()))

    def land(self, blocks) -> None:
        for b in blocks:
            if b in self.held:
                self.kv[:, :, b] = self.held.pop(b)
        self.log.append(("land", list(blocks)))


def run_held(model, *, joins: bool = True, **kw):
    """The conversations with HeldLoads: returns run_conversations' answer,
    the log, and per step the sequences it ran and those it deferred.
    joins=False: a step's wait lands nothing (a broken join)."""
    log: List[tuple] = []
    steps: List[tuple] = []
    made: List[HeldLoads] = []

    def copier(cache):
        # The cache makes its copier before its tier: the schedule is hooked here, the tier's joins at the first
        # step (before any load: the first turns hit nothing in the host tier).
        cp = HeldLoads(cache, log)
        made.append(cp)
        schedule = cache.schedule

        def scheduled(requests):
            cp.scheduling = True
            try:
                return schedule(requests)
            finally:
                cp.scheduling = False

        cache.schedule = scheduled
        return cp

    def on_step(cache, batch):
        tier, cp = cache.tier, made[0]
        if not getattr(tier, "_held_hooks", False):
            tier._held_hooks = True
            join = tier.join_loads

            def join_loads(stream=None):
                if joins:
                    for f in tier.to_join:
                        cp.land(f.blocks.tolist())
                join(stream)

            tier.join_loads = join_loads
        # Runner.step makes the step's stream wait for its loads (HostTier.join_loads) just after this hook,
        # before the forward pass: land them here, then check what the forward pass reads.
        tier.join_loads()
        tables = batch.group_tables if batch.group_tables is not None else [batch.block_table]
        read = set(np.concatenate([t.ravel() for t in tables]).tolist()) - {-1}
        pending = read & set(cp.held)
        log.append(("forward", sorted(read)))
        assert not pending, f"step {len(steps)} reads blocks {sorted(pending)} before their loads landed"
        steps.append((batch.seq_ids.tolist(), list(batch.deferred)))

    res = T.run_conversations(model, tier_copier=copier, on_step=on_step, **kw)
    return res, log, steps


def test_deferred_prompts_join_the_next_step_and_never_read_unloaded_blocks(model, without):
    (engine, rec, reqs, outs, s, _), log, steps = run_held(model, **TIER)
    deferred = [(k, sid) for k, (_, d) in enumerate(steps) for sid in d]
    assert len(deferred) >= 3, steps
    for k, sid in deferred:
        assert sid not in steps[k][0], "a deferred sequence is not in its admission's step"
        assert sid in steps[k + 1][0], f"sequence {sid}, admitted in step {k}, runs in step {k + 1}"
        assert all(sid not in ran for ran, _ in steps[:k]), "its first step"
    assert any(e[0] == "issue" for e in log) and any(e[0] == "land" and e[1] for e in log)
    # Every issued load landed, and before the first forward pass that read its blocks.
    issued = [b for e in log if e[0] == "issue" for b in e[1]]
    landed = [b for e in log if e[0] == "land" for b in e[1]]
    assert sorted(issued) == sorted(landed)
    count, _ = H.compare(model, engine, rec, reqs, atol=2e-5, rtol=2e-5)
    assert count > 100
    assert outs == without[3]


def test_the_held_loads_check_can_fail(model):
    """With a join that lands nothing, the next step reads NaN blocks: the
    check above fires."""
    with pytest.raises(AssertionError, match="before their loads landed"):
        run_held(model, joins=False, **TIER)


def _warm(cache, runner, ref_model, prompt: List[int], sid: int) -> None:
    """Computes prompt as sequence sid, retires it, and demotes its blocks to
    the host tier."""
    cache.add(sid, prompt)
    runner.step(cache.schedule([(sid, len(prompt))]))
    cache.remove([sid])
    cache.tier.step()  # demote_ahead covers the pool: every cached block goes to the host tier
    assert cache.manager.match_tiers([prompt])[0].gpu_tokens == 0


def test_a_prompt_reading_blocks_being_loaded_waits_for_them(model):
    """A and B share a history that the host tier holds; X decodes. A is
    admitted first and deferred (its loads start), B matches A's reloaded
    blocks on the GPU: B runs in this step, which waits for A's loads
    (join_now), and A joins the next one. Every row is transformers'."""
    kvmodel = H.twin(model)
    bs = 8
    rng = np.random.default_rng(3)
    vocab = model.config.vocab_size
    hist = rng.integers(1, vocab, 4 * bs).tolist()
    a, b, x = hist + rng.integers(1, vocab, 5).tolist(), hist + rng.integers(1, vocab, 7).tolist(), \
        rng.integers(1, vocab, 12).tolist()
    with kvhf.PagedKVCache.for_model(kvmodel, 32, bs, host_tier_slots=32, demote_ahead=32,
                                     demote_evicted=False) as cache:
        runner = kvhf.Runner(kvmodel, cache, max_batch=4, max_step_tokens=128, max_model_len=64)
        _warm(cache, runner, model, hist + [1], 9)
        cache.add(0, x)
        runner.step(cache.schedule([(0, len(x))]))
        cache.append(0, 5)
        cache.add(1, a)
        cache.add(2, b)
        batch = cache.schedule([(0, 1), (1, 64), (2, 64)])
        assert batch.seq_ids.tolist() == [0, 2] and batch.deferred == [1]
        assert batch.q_lens.tolist() == [1, len(b) - 4 * bs] and batch.cached_tokens.tolist() == [0, 4 * bs]
        rec_a, = batch.loads
        assert rec_a.seq_id == 1 and rec_a.deferred and rec_a.blocks == 4 and not rec_a.overlapped
        tier = cache.tier
        assert not tier.fresh and len(tier.to_join) == 1  # B reads A's loads: this step waits for them
        assert cache.seqs[1].live and cache.seqs[1].computed == 4 * bs and cache.seqs[1].pending == len(a) - 4 * bs
        got_b = runner.step(batch, all_logits=True)
        assert not tier.to_join
        cache.append(0, 6)
        cache.append(2, 7)
        batch = cache.schedule([(0, 1), (2, 1), (1, 64)])
        assert batch.seq_ids.tolist() == [0, 2, 1] and batch.q_lens.tolist() == [1, 1, len(a) - 4 * bs]
        assert batch.starts.tolist()[2] == 4 * bs and not batch.deferred and not batch.loads
        got_a = runner.step(batch, all_logits=True)[2:]
        want_b = H.reference_logits(model, b, len(b))[4 * bs:]
        want_a = H.reference_logits(model, a, len(a))[4 * bs:]
        assert torch.allclose(got_b[1:], want_b, atol=2e-5, rtol=2e-5)
        assert torch.allclose(got_a, want_a, atol=2e-5, rtol=2e-5)
        # The slot the manager gave A's first token at admission is where the joining step wrote it.
        assert batch.slot_mapping[2] == batch.block_table[2, 4] * bs
        cache.remove([0, 1, 2])
        cache.manager.check()


def test_a_lone_prompt_and_the_off_switch_run_their_loads_in_the_step(model):
    """With nothing else in its step, a prompt with host tier blocks is not
    deferred (nothing to overlap); early_loads=False never defers; block
    size 1 turns it off."""
    kvmodel = H.twin(model)
    bs = 8
    hist = list(range(3, 3 + 3 * bs))
    for early in (None, False):
        with kvhf.PagedKVCache.for_model(kvmodel, 32, bs, host_tier_slots=32, demote_ahead=32,
                                         demote_evicted=False, early_loads=early) as cache:
            assert cache.early_loads is (early is None)
            runner = kvhf.Runner(kvmodel, cache, max_batch=4, max_step_tokens=128, max_model_len=64)
            _warm(cache, runner, model, hist + [1], 9)
            cache.add(0, [5, 6, 7])
            runner.step(cache.schedule([(0, 3)]))
            cache.append(0, 8)
            cache.add(1, hist + [2, 3])
            cache.add(2, hist + [4])
            batch = cache.schedule([(1, 64)] if early is None else [(0, 1), (2, 64)])
            assert not batch.deferred and batch.loads and not batch.loads[0].deferred
            assert cache.tier.pending_records  # the step's copies load them
            runner.step(batch)
            assert not cache.tier.pending_records and batch.loads[0].seconds is not None
            cache.remove(list(cache.seqs))
    shape = kvhf.ModelShape(2, 4, 2, 8)
    with kvhf.PagedKVCache(shape, 16, 1, dtype=torch.float32, host_tier_slots=4) as cache:
        assert cache.early_loads is False


def test_flags():
    E = H.load_engine()
    ap = argparse.ArgumentParser()
    E.add_tier_args(ap)
    for flag in ("--block-size", "--step-tokens", "--max-batch"):
        ap.add_argument(flag, type=int, default=16)
    shape = kvhf.ModelShape(4, 8, 2, 32)
    assert "early_loads" not in E.tier_kwargs(ap.parse_args(["--host-cache-gb", "0.5"]), shape, 1000, torch.float32)
    kw = E.tier_kwargs(ap.parse_args(["--host-cache-gb", "0.5", "--no-early-loads"]), shape, 1000, torch.float32)
    assert kw["early_loads"] is False


def test_bench_takes_the_flag_and_reports_loads(tmp_path):
    B = H.load_script("bench/hf_bench.py")
    saved = tmp_path / "none.json"
    saved.write_text("{}")
    B.main(["--no-early-loads", "--replot", str(saved), str(tmp_path / "none.png")])  # parses, then only replots
    recs = [tier_copy.LoadRecord(1, 4, 4 << 20, deferred=True, overlapped=True, seconds=0.002, hidden=True),
            tier_copy.LoadRecord(2, 2, 2 << 20, deferred=False, seconds=0.001)]
    st = B.load_stats(recs)
    assert (st["admissions"], st["deferred"], st["overlapped"], st["hidden"]) == (2, 1, 1, 1)
    assert st["ms_p50"] == pytest.approx(1.5) and st["mib_mean"] == pytest.approx(3.0)
    assert "1/2 beside a step's forward pass (1 landed" in B.load_text({"loads": st})


def test_bench_summary_in_both_orders(tmp_path):
    B = H.load_script("bench/hf_bench.py")
    saved = tmp_path / "none.json"
    saved.write_text("{}")
    B.main(["--both-orders", "--replot", str(saved), str(tmp_path / "none.png")])  # parses, then only replots
    res = {"c/kvplug": {"out_tokens": 100, "wall": 1.0}, "c/kvplug-host": {"out_tokens": 120, "wall": 1.0},
           "c/kvplug-host@2": {"out_tokens": 90, "wall": 1.0}, "c/kvplug@2": {"out_tokens": 120, "wall": 1.0}}
    one = B.summary_lines("c", ["kvplug", "kvplug-host"], res)[0]
    assert "kvplug-host/kvplug 1.200x" in one and "reversed" not in one, one
    both = B.summary_lines("c", ["kvplug", "kvplug-host"], res, both_orders=True)[0]
    # 1.2 in the first order, 0.75 in the second: their geometric mean is sqrt(0.9).
    assert "1.200x (reversed 0.750x, geometric mean 0.949x)" in both, both


@pytest.mark.parametrize("num_blocks", [16, 20])
def test_early_loads_cost_no_preemption(model, num_blocks, monkeypatch):
    # A deferred admission holds its hit and one token until its next step: admitted only where its first chunk's
    # blocks could be found too, and those blocks kept from the admissions after it, it does not make these
    # conversations preempt more than without early loads. (Not an invariant: the reservation lasts one schedule,
    # and other pools and batches differ by a preemption either way.)
    kw = dict(num_blocks=num_blocks, host_slots=64, demote_ahead=6)
    base = T.run_conversations(model, early_loads=False, **kw)
    engine, _, reqs, outs, s, _ = T.run_conversations(model, early_loads=True, **kw)
    assert sum(bool(x.deferred) for x in _loads(reqs)) > 0
    assert engine.preemptions == base[0].preemptions, (engine.preemptions, base[0].preemptions)
    assert outs == base[3]
    if num_blocks == 20:
        # The check can fail: without the chunk's fit test the same run preempts more.
        monkeypatch.setattr(kvhf.PagedKVCache, "_room", lambda *a: 1 << 30)
        unchecked = T.run_conversations(model, early_loads=True, **kw)[0]
        assert unchecked.preemptions > base[0].preemptions, (unchecked.preemptions, base[0].preemptions)


def _two_admissions(unchecked: bool, monkeypatch) -> tuple:
    """One schedule admitting A (a host tier hit, deferred) and then B, on a
    pool where A's chunk and B do not both fit: (the batch, the next step's
    batch or the OutOfBlocksError it raised)."""
    if unchecked:
        monkeypatch.setattr(kvhf.PagedKVCache, "_room", lambda *a: 1 << 30)
    shape = kvhf.ModelShape(1, 2, 1, 8)
    with kvhf.PagedKVCache(shape, 12, 4, dtype=torch.float32, host_tier_slots=32, demote_ahead=0) as c:

        def step(reqs):
            b = c.schedule(reqs)
            c.tier.step(None)
            c.commit(b)
            return b

        hist = list(range(100, 108))
        for sid, toks in ((1, hist), (2, list(range(200, 240))), (3, list(range(300, 348)))):
            c.add(sid, toks)
            step([(sid, len(toks))])
            c.remove([sid])  # the last one evicts the pool: hist's blocks live on in the host tier only
        assert c.manager.match_tiers([hist + [1]], None)[0].host_tokens == 8
        c.add(4, [1, 2, 3, 4])
        step([(4, 4)])
        c.append(4, 5)
        c.add(5, hist + list(range(500, 528)))  # A: 36 tokens, its first 8 in the host tier
        c.add(6, list(range(600, 624)))  # B: 24 tokens
        first = step([(4, 1), (5, 36), (6, 24)])
        c.append(4, 6)
        reqs = [(4, 1)]
        for sid, n in ((5, 36), (6, 24)):
            st = c.state(sid)
            if st.live:
                if st.computed >= len(st.tokens):  # its prompt ran whole: a decode token
                    c.append(sid, 7)
                    n = 1
                reqs.append((sid, n))
        try:
            nxt = c.schedule(reqs)
        except kvplug.OutOfBlocksError as e:
            nxt = e
        c.remove([i for i in (4, 5, 6) if c.state(i).live])
        return first, nxt


def test_a_deferred_chunk_keeps_its_blocks_from_later_admissions(monkeypatch):
    # A deferred admission holds its hit and one token; the blocks its chunk still needs are kept from the
    # admissions after it in the same schedule, so B waits and the next step grows A without a preemption.
    first, nxt = _two_admissions(False, monkeypatch)
    assert first.deferred == [5] and first.not_admitted == [6], (first.deferred, first.not_admitted)
    assert not isinstance(nxt, Exception) and 5 in nxt.seq_ids.tolist(), nxt


def test_the_reserved_chunk_check_can_fail(monkeypatch):
    # Without the check, B takes A's blocks and the next step cannot grow A: a running sequence would be preempted.
    first, nxt = _two_admissions(True, monkeypatch)
    assert first.deferred == [5] and 6 not in first.not_admitted, (first.deferred, first.not_admitted)
    assert isinstance(nxt, kvplug.OutOfBlocksError), nxt


def _sharers(room) -> tuple:
    """A (deferred: its 16-token history reloads from the host tier) and B,
    which shares that history, in one schedule beside a decoding sequence,
    on a pool of 15 blocks of 4 where both chunks fit: (the schedule's batch,
    the next one's or the OutOfBlocksError it raised). room, if given,
    replaces PagedKVCache._room."""
    shape = kvhf.ModelShape(1, 2, 1, 8)
    with kvhf.PagedKVCache(shape, 15, 4, dtype=torch.float32, host_tier_slots=32, demote_ahead=15,
                           demote_evicted=False) as c:
        if room is not None:
            c._room = room.__get__(c)

        def step(reqs):
            b = c.schedule(reqs)
            c.tier.step(None)
            c.commit(b)
            return b

        hist = list(range(100, 116))
        c.add(1, hist + [9])
        step([(1, 17)])
        c.remove([1])
        c.tier.step(None)
        assert c.manager.match_tiers([hist + [1]])[0].host_tokens == 16
        c.add(2, list(range(200, 228)))
        step([(2, 28)])
        c.append(2, 5)
        c.add(3, hist + [31, 32, 33, 34])  # A
        c.add(4, hist + [41, 42, 43, 44])  # B
        first = step([(2, 1), (3, 20), (4, 20)])
        c.append(2, 6)
        reqs = [(2, 1), (3, 20)] + ([(4, 1)] if c.state(4).live else [(4, 20)])
        if c.state(4).live:
            c.append(4, 7)
        try:
            nxt = c.schedule(reqs)
        except kvplug.OutOfBlocksError as e:
            nxt = e
        return first, nxt


def test_a_prompt_sharing_a_deferred_prefix_is_admitted_beside_it():
    # B's GPU hit is the history A's admission reloads, which A holds: the
    # room of B's chunk does not charge those blocks again (match_room), so B
    # runs in the same step as A's deferral, and the next step fits.
    first, nxt = _sharers(None)
    assert first.deferred == [3] and 4 in first.seq_ids.tolist() and first.not_admitted == []
    assert not isinstance(nxt, Exception) and sorted(nxt.seq_ids.tolist()) == [2, 3, 4]
    # The check can fail: charging the whole hit (free + evictable less its blocks) leaves B out.
    first, _ = _sharers(lambda self, s: (self.manager.stats().free_blocks + self.manager.prefix_stats().evictable_blocks
                                         - self.manager.match_tiers([s.tokens], s.keys)[0].gpu_tokens // self.block_size))
    assert first.deferred == [3] and first.not_admitted == [4]
