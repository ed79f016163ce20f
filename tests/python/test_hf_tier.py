"""kvplug.hf with the host KV tier on the CPU: multi-turn conversations
through the engine of examples/hf_engine.py with a GPU pool too small to
keep their histories, so that a history is demoted to the host tier between
turns and reloaded by the next turn. Every logit row is checked against
transformers (the harness of test_hf_correctness.py), the greedy outputs
against runs with a pool that holds everything and without the tier; the
copier, the flags, the summaries and bench/hf_bench.py's workload m are
checked too. tests/gpu/test_hf_tier.py runs the conversations on the
kernels with pinned copies."""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch

import kvplug
import kvplug.hf as kvhf
from kvplug.hf import tier_copy

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import test_hf_correctness as H  # noqa: E402

BS = 8


class Conversations:
    """n conversations of `turns` turns: turn k's prompt is turn k-1's
    prompt and outputs plus new user tokens; a turn arrives when the one
    before it finished (Engine.run's follow_up)."""

    def __init__(self, eng_mod, vocab: int, n: int = 4, turns: int = 3, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.E = eng_mod
        self.turns = turns
        self.users = [[rng.integers(1, vocab, int(rng.integers(18, 30))).tolist() for _ in range(turns)] for _ in range(n)]
        self.outs = [[int(rng.integers(6, 12)) for _ in range(turns)] for _ in range(n)]
        self.of: Dict[int, Tuple[int, int]] = {}

    def first(self) -> List[Any]:
        return [self._req(c, 0, list(self.users[c][0]), 0.0) for c in range(len(self.users))]

    def _req(self, c: int, t: int, prompt: List[int], arrival: float) -> Any:
        rid = c * self.turns + t
        self.of[rid] = (c, t)
        return self.E.Request(rid, arrival, prompt, self.outs[c][t])

    def follow_up(self, req: Any, now: float) -> Optional[Any]:
        c, t = self.of[req.rid]
        if t + 1 >= self.turns:
            return None
        return self._req(c, t + 1, req.prompt + req.outputs[req.seq_ids[0]] + self.users[c][t + 1], now)

    def max_len(self) -> int:
        return max(sum(map(len, u)) + sum(o) for u, o in zip(self.users, self.outs))


def run_conversations(model, *, num_blocks: int, host_slots: int = 0, demote_ahead: Optional[int] = None,
                      backend: str = "auto", cuda_graphs: bool = False, tier_copier: Any = None,
                      tier_overlap: bool = False, max_batch: int = 2,
                      step_tokens: int = 48, chunk: int = 24, write_through: int = 0, kv_dtype: Any = None,
                      early_loads: Optional[bool] = None, on_step: Any = None, write_through_slack: Optional[int] = None):
    """Runs the conversations (the model's device and dtype); returns (engine, recorder, requests, outputs by
    rid, tier summary or None, the engine's summary lines). on_step(cache, batch), if given, sees each batch
    before its forward pass."""
    E = H.load_engine()
    kvmodel = H.twin(model)
    conv = Conversations(E, model.config.vocab_size)
    tier = dict(host_tier_slots=host_slots, demote_ahead=demote_ahead, tier_copier=tier_copier,
                tier_overlap=tier_overlap, write_through=write_through, write_through_slack=write_through_slack,
                early_loads=early_loads) if host_slots else {}
    cache = kvhf.PagedKVCache.for_model(kvmodel, num_blocks, BS, kv_dtype=kv_dtype, **tier)
    runner = kvhf.Runner(kvmodel, cache, backend=backend, max_batch=max_batch, max_step_tokens=step_tokens + max_batch,
                         max_model_len=conv.max_len(), cuda_graphs=cuda_graphs)
    if on_step is not None:
        step = runner.step

        def watched(batch, all_logits=False):
            on_step(cache, batch)
            return step(batch, all_logits)

        runner.step = watched
    rec = H.Recorder()
    cfg = E.EngineConfig(max_batch=max_batch, step_tokens=step_tokens, chunk=chunk, progress_every=0)
    engine = E.Engine(runner, cfg, on_logits=lambda b, lg: rec(b, lg, BS))
    reqs = conv.first()
    engine.run(reqs, log=lambda s: None, follow_up=conv.follow_up)
    assert len(reqs) == len(conv.users) * conv.turns and all(r.finished is not None for r in reqs)
    cache.manager.check()
    summary = cache.tier_summary()
    lines = E.summary(engine, reqs, 1.0)
    cache.close()
    outs = {r.rid: r.outputs[r.seq_ids[0]] for r in reqs}
    return engine, rec, reqs, outs, summary, lines


def matched_tokens(lines: List[str]) -> int:
    """The prompt tokens matched at admission, from the engine summary's
    "prefix cache:" line (the GPU's and the host tier's together)."""
    return int([line for line in lines if line.startswith("prefix cache:")][0].split("(")[1].split(" of ")[0])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return H.tiny_model("llama")


@pytest.fixture(scope="module")
def big_pool(model):
    return run_conversations(model, num_blocks=256)


def test_evicted_history_is_served_from_the_host_tier(model, big_pool):
    engine, rec, reqs, outs, s, lines = run_conversations(model, num_blocks=24, host_slots=64,
                                                          demote_ahead=6)
    # The history of later turns came back from host memory, not recomputed.
    assert s["demotions_completed"] > 0 and s["reloads_completed"] > 0, s
    assert s["host_hit_tokens"] >= 3 * BS, s
    assert s["host_hit_rate"] > 0 and s["in_flight"] == 0 and s["host_pinned"] == 0
    assert s["reloads_completed"] == s["reloads"] and s["demotions_failed"] == 0
    # Every logit row, reloaded blocks included, is transformers' row.
    count, _ = H.compare(model, engine, rec, reqs, atol=2e-5, rtol=2e-5)
    assert count > 100
    # Greedy outputs: the same as with a pool that holds everything, and as recomputing without the tier.
    assert outs == big_pool[3]
    _, _, _, recompute, none, _ = run_conversations(model, num_blocks=24)
    assert none is None and outs == recompute
    assert any(line.startswith("host tier:") for line in lines)
    assert any(line.startswith("host tier loads:") for line in lines)


def test_write_through_serves_the_history_and_keeps_gpu_hits(model, big_pool):
    """write_through: blocks are copied to the host tier as they are computed and stay on the GPU; the
    histories the GPU evicted come back from the host, every logit row is transformers', and the GPU
    prefix cache hits what it hits with no tier at all."""
    engine, rec, reqs, outs, s, lines = run_conversations(model, num_blocks=24, host_slots=64, write_through=8)
    assert s["write_through_stored"] > 0 and s["demotions_queued"] == 0 and s["reloads_completed"] > 0, s
    assert s["host_hit_tokens"] >= 3 * BS, s
    count, _ = H.compare(model, engine, rec, reqs, atol=2e-5, rtol=2e-5)
    assert count > 100
    assert outs == big_pool[3]
    _, _, _, _, none, plain_lines = run_conversations(model, num_blocks=24)
    gpu_hits = [line for line in lines if line.startswith("prefix cache:")]
    assert any(line.startswith("host tier write-through:") for line in lines)
    # The GPU's hits are never below the run without the tier (the host adds to them).
    assert s["prompt_tokens"] and s["cached_tokens"] - s["host_hit_tokens"] >= matched_tokens(plain_lines), (
        gpu_hits, plain_lines)


def test_write_through_stores_nothing_while_the_pool_holds_everything(model, big_pool):
    """With the default write_through_slack (a quarter of the pool here), a pool that holds every
    conversation never gets near the slack: no store is handed out, nothing is lost, the computed blocks
    wait in the queue, and the outputs are those without a tier. A slack of 0 stores as before."""
    _, _, _, outs, s, lines = run_conversations(model, num_blocks=256, host_slots=64, write_through=8)
    assert s["write_through_slack"] == 64 and s["write_through"] == 8, s
    assert s["write_through_stored"] == 0 and s["write_through_lost"] == 0 and s["demotions_queued"] == 0, s
    assert s["write_through_queue"] > 0 and s["host_hit_tokens"] == 0, s
    assert outs == big_pool[3]
    assert any(line.startswith("host tier write-through:") and "slack 64" in line for line in lines), lines
    _, _, _, outs0, s0, _ = run_conversations(model, num_blocks=256, host_slots=64, write_through=8, write_through_slack=0)
    assert s0["write_through_slack"] == 0 and s0["write_through_stored"] > 0, s0
    assert outs0 == big_pool[3]


def test_a_lost_reload_is_caught(model):
    """The check above can fail: a copier that drops its reloads leaves the
    reused blocks with other K/V, and the rows differ from transformers."""

    class DropReloads(tier_copy.TorchTierCopier):
        def run(self, batch, stream=None):
            super().run(batch._replace(reload_slots=batch.reload_slots[:0], reload_blocks=batch.reload_blocks[:0]), stream)

    def copier(cache):
        return DropReloads(cache.kv, cache.manager.host_tier_memory())

    engine, rec, reqs, _, s, _ = run_conversations(model, num_blocks=24, host_slots=64,
                                                   demote_ahead=6, tier_copier=copier)
    assert s["reloads"] > 0 and s["copier"] == "DropReloads"
    with pytest.raises(AssertionError, match="transformers"):
        H.compare(model, engine, rec, reqs, atol=2e-5, rtol=2e-5)


def test_fp8_histories_come_back_with_their_scales():
    """An FP8 cache's blocks go to the host tier and come back with their
    scales (each slot: the e4m3 K/V, then the float32 scales): the greedy
    outputs equal those of the same FP8 cache in a pool that holds
    everything, where nothing left the GPU."""
    bf = H.tiny_model("llama", dtype=torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    _, _, _, want, none, _ = run_conversations(bf, num_blocks=256, kv_dtype=fp8)
    assert none is None
    _, _, _, outs, s, _ = run_conversations(bf, num_blocks=24, host_slots=64, demote_ahead=6, kv_dtype=fp8)
    assert s["reloads_completed"] > 0 and s["host_hit_tokens"] >= 3 * BS, s
    assert outs == want


def test_torch_copier_round_trip():
    """Demotions then reloads through unordered, non-contiguous host slots
    bring every layer's K and V of each block back."""
    shape = kvhf.ModelShape(3, 4, 2, 8)
    with kvhf.PagedKVCache(shape, 16, 4, dtype=torch.bfloat16, host_tier_slots=12, demote_ahead=4) as cache:
        assert cache.block_bytes == 3 * 2 * 4 * 2 * 8 * 2
        host = cache.manager.host_tier_memory()
        assert host.shape == (12, cache.block_bytes)
        cp = tier_copy.TorchTierCopier(cache.kv, host)
        cache.kv.copy_(torch.randn(cache.kv.shape))
        want = cache.kv.clone()
        blocks = np.array([5, 1, 9, 2, 14], np.int32)
        slots = np.array([7, 3, 4, 11, 0], np.int32)
        none = np.empty(0, np.int32)
        cp.run(kvplug.CopyBatch(1, blocks, slots, none, none))
        for b, s in zip(blocks, slots):
            assert torch.equal(cp.host[s], want[:, :, b])
        cache.kv.zero_()
        back = np.array([0, 3, 6, 12, 8], np.int32)  # slot i -> another block
        cp.run(kvplug.CopyBatch(2, none, none, slots, back))
        for b, nb in zip(blocks, back):
            assert torch.equal(cache.kv[:, :, nb], want[:, :, b])
        assert cache.kv[:, :, 1].abs().sum() == 0  # nothing else written
        cp.close()
    with pytest.raises(ValueError, match="bytes"):
        tier_copy.TorchTierCopier(torch.zeros(2, 2, 4, 4, 1, 8), np.zeros((3, 10), np.uint8))
    # FP8: a slot is the e4m3 K/V, then the scales; both come back.
    with kvhf.PagedKVCache(shape, 16, 4, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, host_tier_slots=12,
                           demote_ahead=4) as cache:
        assert cache.block_bytes == 3 * 2 * 4 * 2 * 8 + 3 * 2 * 4 * 2 * 4
        host = cache.manager.host_tier_memory()
        with pytest.raises(kvplug.InvalidArgumentError, match="scales"):
            tier_copy.TorchTierCopier(cache.kv, host)
        cp = tier_copy.TorchTierCopier(cache.kv, host, scales=cache.scales)
        cache.kv.view(torch.uint8).copy_(torch.randint(0, 120, cache.kv.shape, dtype=torch.uint8))
        cache.scales.copy_(torch.rand(cache.scales.shape))
        want, want_s = cache.kv.view(torch.uint8).clone(), cache.scales.clone()
        cp.run(kvplug.CopyBatch(1, blocks, slots, none, none))
        kv_bytes = 3 * 2 * 4 * 2 * 8
        for b, s in zip(blocks, slots):
            assert torch.equal(torch.from_numpy(host[s, kv_bytes:].copy()).view(torch.float32), want_s[:, :, b].flatten())
        cache.kv.view(torch.uint8).zero_()
        cache.scales.zero_()
        cp.run(kvplug.CopyBatch(2, none, none, slots, back))
        for b, nb in zip(blocks, back):
            assert torch.equal(cache.kv.view(torch.uint8)[:, :, nb], want[:, :, b])
            assert torch.equal(cache.scales[:, :, nb], want_s[:, :, b])
        cp.close()


def test_cache_tier_arguments():
    shape = kvhf.ModelShape(2, 4, 2, 16)
    bb = 2 * 2 * 8 * 2 * 16 * 4  # layers x K,V x block x kv heads x head_dim x float32
    assert kvhf.PagedKVCache.host_slots_for(1.0, shape, 8, torch.float32) == 2**30 // bb
    assert kvhf.PagedKVCache.default_demote_ahead(1000, 16, 256, 8) == 2 * 16 + 8
    assert kvhf.PagedKVCache.default_demote_ahead(40, 16, 8192, 256) == 10  # a quarter of the pool at most
    assert kvhf.PagedKVCache.default_demote_ahead(100) == 12
    with kvhf.PagedKVCache(shape, 32, 8, dtype=torch.float32, host_tier_slots=5) as c:
        assert c.tier is not None and c.manager.tier_stats().host_slots == 5
        assert c.block_bytes == bb and c.manager.host_tier_memory().shape == (5, bb)
        assert set(c.tier_summary()) >= {"host_hit_rate", "gpu_hit_rate", "load_gbps", "reload_bytes", "demotions_completed",
                                         "skipped_full", "skipped_present", "evicted_undemoted", "host_bytes"}
    with kvhf.PagedKVCache(shape, 32, 8, dtype=torch.float32) as c:
        assert c.tier is None and c.tier_summary() is None
    with pytest.raises(ValueError, match="prefix cache"):
        kvhf.PagedKVCache(shape, 32, 8, host_tier_slots=5, prefix_cache=False)
    with pytest.raises(ValueError, match="tier_copier"):
        kvhf.PagedKVCache(shape, 32, 8, host_tier_slots=5, tier_copier="fast")
    # The shared tier: the namespace is the model's identity there, so it is required; a server that is not up
    # is not an error (its calls are counted misses).
    with pytest.raises(ValueError, match="shared_tier_namespace"):
        kvhf.PagedKVCache(shape, 32, 8, host_tier_slots=5, shared_tier="127.0.0.1:6379")
    with pytest.raises(ValueError, match="host tier"):
        kvhf.PagedKVCache(shape, 32, 8, shared_tier="127.0.0.1:6379", shared_tier_namespace="m")
    with pytest.raises(ValueError, match="need shared_tier"):
        kvhf.PagedKVCache(shape, 32, 8, host_tier_slots=5, shared_tier_namespace="m")
    with pytest.raises(ValueError, match="shared_tier_\\* arguments, not write_through"):
        kvhf.PagedKVCache(shape, 32, 8, host_tier_slots=5, shared_tier="127.0.0.1:6379", shared_tier_namespace="m",
                          shared_tier_options={"write_through": 4})
    with kvhf.PagedKVCache(shape, 32, 8, dtype=torch.float32, host_tier_slots=5, write_through=4,
                           shared_tier="127.0.0.1:1", shared_tier_namespace="m", shared_tier_timeout_ms=20,
                           shared_tier_put_queue=8, shared_tier_options={"shared_tier_tls": False}) as c:
        assert c.manager.tier_stats().host_slots == 5
        assert c.write_through_slack == 0  # the stores feed the shared tier: none waits
    # write_through_slack: by default max(2 x write_through, a quarter of the pool), at most the pool.
    assert kvhf.PagedKVCache.default_write_through_slack(32, 4) == 8
    assert kvhf.PagedKVCache.default_write_through_slack(1000, 8) == 250
    assert kvhf.PagedKVCache.default_write_through_slack(32, 12) == 24
    assert kvhf.PagedKVCache.default_write_through_slack(10, 8) == 10
    assert kvhf.PagedKVCache.default_write_through_slack(1000, 0) == 0
    for n, wt, slack, want in ((32, 4, None, 8), (100, 4, None, 25), (32, 20, None, 32), (32, 4, 0, 0), (32, 4, 3, 3),
                               (32, 0, None, 0)):
        with kvhf.PagedKVCache(shape, n, 8, dtype=torch.float32, host_tier_slots=5, write_through=wt,
                               write_through_slack=slack) as c:
            assert c.write_through_slack == want, (n, wt, slack, c.write_through_slack)
            assert c.tier_summary()["write_through_slack"] == want
    with kvhf.PagedKVCache(shape, 32, 8, dtype=torch.float32) as c:
        assert c.write_through_slack == 0
    with pytest.raises(ValueError, match="write_through_slack needs write_through"):
        kvhf.PagedKVCache(shape, 32, 8, host_tier_slots=5, write_through_slack=4)
    with pytest.raises(ValueError, match="host tier"):
        kvhf.PagedKVCache(shape, 32, 8, write_through_slack=4)
    with pytest.raises(ValueError, match="write_through_slack"):
        kvhf.PagedKVCache(shape, 32, 8, host_tier_slots=5, write_through=4, write_through_slack=33)


def test_library_copier_is_used_on_cuda_caches(monkeypatch):
    """kvplug.TierCopier replaces the torch copier on CUDA caches, with the
    cache's per-layer K and V; tier_copier="torch" keeps the torch one;
    CPU caches use torch."""
    made = []

    class Fake:
        def __init__(self, k, v, *, manager):
            made.append((k, v, manager))

        def run(self, batch, stream):
            pass

    class FakeCache:
        device = torch.device("cuda")
        manager = object()
        kv = torch.arange(2 * 2 * 3 * 4).view(2, 2, 3, 4, 1, 1)  # [layers, K/V, blocks, bs, heads, dim]
        fp8 = False
        write_through = 0  # demotions ahead of need: the kernel's stores

    monkeypatch.setattr(kvplug, "TierCopier", Fake)
    assert isinstance(tier_copy.make_copier(FakeCache()), Fake)
    (k, v, m), = made
    assert m is FakeCache.manager and len(k) == len(v) == 2
    assert all(torch.equal(k[i], FakeCache.kv[i, 0]) and torch.equal(v[i], FakeCache.kv[i, 1]) for i in range(2))
    shape = kvhf.ModelShape(1, 2, 1, 8)
    with kvhf.PagedKVCache(shape, 8, 4, dtype=torch.float32, host_tier_slots=2) as c:
        assert isinstance(c.tier.copier, tier_copy.TorchTierCopier)


def test_engine_flags():
    E = H.load_engine()
    import argparse

    ap = argparse.ArgumentParser()
    E.add_tier_args(ap)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--step-tokens", type=int, default=2048)
    ap.add_argument("--max-batch", type=int, default=64)
    shape = kvhf.ModelShape(4, 8, 2, 32)
    args = ap.parse_args([])
    assert (args.host_cache_gb, args.demote_ahead, args.shared_tier) == (0.0, None, None)
    assert E.tier_kwargs(args, shape, 1000, torch.float32) == {}
    args = ap.parse_args(["--host-cache-gb", "0.5", "--demote-ahead", "40"])
    bb = 4 * 2 * 16 * 2 * 32 * 4
    assert E.tier_kwargs(args, shape, 1000, torch.float32) == {"host_tier_slots": 2**29 // bb, "demote_ahead": 40}
    args = ap.parse_args(["--host-cache-gb", "0.5"])
    assert E.tier_kwargs(args, shape, 1000, torch.float32)["demote_ahead"] == 250  # 2 x 2048 / 16 + 64, pool / 4
    args = ap.parse_args(["--host-cache-gb", "0.5", "--demote-overlap"])
    assert E.tier_kwargs(args, shape, 1000, torch.float32)["tier_overlap"] is True
    with pytest.raises(SystemExit, match="host-cache-gb"):
        E.tier_kwargs(ap.parse_args(["--shared-tier", "127.0.0.1:6379"]), shape, 1000, torch.float32)
    kw = E.tier_kwargs(ap.parse_args(["--host-cache-gb", "1", "--shared-tier", "h:1"]), shape, 1000, torch.float32)
    assert kw["shared_tier"] == "h:1" and kw["shared_tier_namespace"] == "model.float32.bs16.seed0", kw
    kw = E.tier_kwargs(ap.parse_args(["--host-cache-gb", "1", "--shared-tier", "h:1", "--shared-tier-namespace", "m7"]),
                       shape, 1000, torch.float32)
    assert kw["shared_tier_namespace"] == "m7", kw
    kw = E.tier_kwargs(ap.parse_args(["--host-cache-gb", "0.5", "--write-through", "8"]), shape, 1000, torch.float32)
    assert kw["write_through"] == 8 and "write_through_slack" not in kw, kw  # PagedKVCache's default
    kw = E.tier_kwargs(ap.parse_args(["--host-cache-gb", "0.5", "--write-through", "8", "--write-through-slack", "0"]),
                       shape, 1000, torch.float32)
    assert kw["write_through_slack"] == 0, kw
    kw = E.tier_kwargs(ap.parse_args(["--host-cache-gb", "0.5", "--write-through", "8", "--write-through-slack", "2000"]),
                       shape, 1000, torch.float32)
    assert kw["write_through_slack"] == 1000, kw  # at most the pool
    with pytest.raises(SystemExit, match="write-through-slack"):
        E.tier_kwargs(ap.parse_args(["--host-cache-gb", "0.5", "--write-through-slack", "4"]), shape, 1000, torch.float32)


def test_engine_main_with_the_host_tier(capsys):
    E = H.load_engine()
    E.main(["--requests", "6", "--rate", "0", "--system", "64", "--own", "8", "16", "--output", "4", "8",
            "--num-blocks", "12", "--host-cache-gb", "0.01", "--max-batch", "4", "--step-tokens", "128", "--quiet"])
    out = capsys.readouterr().out
    assert "host tier" in out and "6/6 finished" in out, out
    assert "host tier loads:" in out and "GB/s" in out, out


def _bench():
    return H.load_script("bench/hf_bench.py")


def test_bench_multi_turn_workload():
    """Workload m's conversations: each turn's prompt continues the one
    before it, and the working set counts the full histories."""
    B = _bench()
    import argparse

    args = argparse.Namespace(m_convs=128, m_turns=6, m_user=[200, 500], m_output=[128, 256], scale=1.0, out_scale=1.0)
    conv = B.MultiTurn(args, 1000)
    assert len(conv.users) == 128 and len(conv) == 768
    assert all(200 <= len(u) <= 500 for us in conv.users for u in us)
    assert all(128 <= o <= 256 for os_ in conv.outs for o in os_)
    first = conv.first()
    assert sorted(r.rid // 6 for r in first) == list(range(128)) and [r.rid for r in first] != sorted(r.rid for r in first)
    r = first[0]
    r.seq_ids.append(0)
    r.outputs[0] = list(range(r.max_new_tokens))
    nxt = conv.follow_up(r, 1.5)
    c = r.rid // 6
    assert nxt.prompt == r.prompt + r.outputs[0] + conv.users[c][1] and nxt.arrival == 1.5
    assert nxt.max_new_tokens == conv.outs[c][1]
    assert conv.max_len == max(conv.lens) and conv.working_set_blocks(16) == sum(-(-n // 16) for n in conv.lens)
    small = B.MultiTurn(argparse.Namespace(**{**vars(args), "scale": 0.05, "out_scale": 0.5}), 1000)
    assert len(small.users) == 6 and all(64 <= o <= 128 for os_ in small.outs for o in os_)


def test_bench_smoke(tmp_path, capsys):
    """bench/hf_bench.py --workloads m at a tiny scale on the CPU: the three
    systems run every turn; the tier's figures are reported."""
    B = _bench()
    out = tmp_path / "m.json"
    B.main(["--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--workloads", "m", "--scale", "0.03",
            "--m-turns", "3", "--m-user", "12", "24", "--m-output", "4", "8", "--max-batch", "4", "--step-tokens",
            "128", "--chunk", "64", "--quiet", "--json", str(out)])
    text = capsys.readouterr().out
    assert "multi-turn (m)" in text and "kvplug-host vs kvplug" in text, text
    res = json.loads(out.read_text())
    assert set(res) == {"m/kvplug-host", "m/kvplug", "m/kvplug-all"}
    for r in res.values():
        assert r["finished"] == r["requests"] == 12 and len(r["ttft"]) == 12 and len(r["ttft_next"]) == 8
    t = res["m/kvplug-host"]["tier"]
    assert t["host_hit_tokens"] > 0 and t["reloads_completed"] > 0, t
    assert "tier" not in res["m/kvplug"]
    assert res["m/kvplug-all"]["num_blocks"] >= res["m/kvplug-all"]["working_set_blocks"]
    assert res["m/kvplug"]["num_blocks"] < res["m/kvplug"]["working_set_blocks"]


class _Held:
    """A batch in flight whose copies land only when someone waits for it
    (HostTier.drain): poll never completes it."""

    def __init__(self, ticket: int, demote_bytes: int) -> None:
        self.ticket, self.reload_bytes, self.demote_bytes, self.loads = ticket, 0, demote_bytes, []
        self.d0 = self.d1 = self  # the stores' timing "events": they took no time
        self.waited = False

    def elapsed_time(self, end) -> float:
        return 0.0

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.waited = True


def run_held_stores(model, waits: bool = True, **kw):
    """The conversations in write-through, each batch's copies held in flight
    until a schedule waits for them, as a side stream's stores can still be
    running when the next step allocates (a store holds its GPU block until
    its batch completes). waits=False: the schedule never waits."""
    held: List[_Held] = []

    def on_step(cache, batch):
        tier = cache.tier
        if not getattr(tier, "_held", False):
            tier._held = True

            def landed(ticket, demote_bytes=0):
                h = _Held(ticket, demote_bytes)
                held.append(h)
                tier.in_flight.append(h)

            tier._landed = landed
            if not waits:
                cache._wait_for_copies = lambda: False

    res = run_conversations(model, on_step=on_step, **kw)
    return res, held


def test_stores_in_flight_cost_no_preemption(model, big_pool):
    kw = dict(num_blocks=16, host_slots=64, write_through=8, write_through_slack=0)
    engine0, _, _, outs0, s0, _ = run_conversations(model, **kw)
    (engine, rec, reqs, outs, s, _), held = run_held_stores(model, **kw)
    # Stores held their blocks past the steps that followed them: the schedules that found the pool short waited
    # for them (completing them gave the blocks back) rather than preempting.
    assert s["tier_waits"] > 0 and any(h.waited for h in held), s
    assert engine.preemptions == engine0.preemptions, (engine.preemptions, engine0.preemptions)
    assert s["write_through_stored"] > 0 and s["in_flight"] == 0, s
    assert outs == outs0 == big_pool[3]
    count, _ = H.compare(model, engine, rec, reqs, atol=2e-5, rtol=2e-5)
    assert count > 100


def test_the_held_stores_check_can_fail(model):
    # Without the wait, the same held stores cost preemptions (or the pool cannot run a sequence at all).
    kw = dict(num_blocks=16, host_slots=64, write_through=8, write_through_slack=0)
    engine0 = run_conversations(model, **kw)[0]
    try:
        (engine, *_), _ = run_held_stores(model, waits=False, **kw)
    except kvplug.OutOfBlocksError:
        return
    assert engine.preemptions > engine0.preemptions, (engine.preemptions, engine0.preemptions)


def test_a_schedule_waits_only_for_copies_that_hold_blocks():
    # Reloads hold blocks of the live sequences loading them: a pool found short waits (on the GPU, a host-device
    # synchronisation) only for batches with stores or demotions, whose blocks completing gives back.
    shape = kvhf.ModelShape(1, 2, 1, 8)
    with kvhf.PagedKVCache(shape, 8, 4, dtype=torch.float32, host_tier_slots=16, demote_ahead=0, write_through=8,
                           write_through_slack=0) as c:
        reloads = _Held(0, 0)
        c.tier.in_flight.append(reloads)
        assert not c._wait_for_copies() and not reloads.waited and c.stats["tier_waits"] == 0
        c.tier.in_flight.clear()
        # A real batch of stores (write-through of a computed prompt), held in flight: waited for and completed.
        held: List[_Held] = []

        def landed(ticket, demote_bytes=0):
            held.append(_Held(ticket, demote_bytes))
            c.tier.in_flight.append(held[-1])

        c.tier._landed = landed
        c.add(1, list(range(1, 9)))
        b = c.schedule([(1, 8)])
        c.tier.step(None)
        c.commit(b)
        c.tier.step(None)  # the step after the forward pass stores its blocks
        assert held and held[-1].demote_bytes > 0, held
        assert c._wait_for_copies() and held[-1].waited and c.stats["tier_waits"] == 1
        assert not c.tier.in_flight


def test_a_failed_reload_stops_the_schedules_until_recovered():
    # A batch of reloads that fails leaves its GPU blocks cached without their K/V: the cache refuses to schedule
    # (never serving them to a prompt) until recover_from_failed_reloads preempts the live sequences and clears the
    # GPU prefix cache. The host tier's copy is intact: the re-admission hits it and reloads again.
    shape = kvhf.ModelShape(1, 2, 1, 8)
    fail = {"next": False}

    def copier(cache):
        inner = tier_copy.make_copier(cache)

        class Failing:
            def run(self, batch, stream=None):
                if fail["next"] and len(batch.reload_blocks):
                    fail["next"] = False
                    raise RuntimeError("copy failed")
                inner.run(batch, stream)

            def close(self):
                inner.close()

        return Failing()

    with kvhf.PagedKVCache(shape, 12, 4, dtype=torch.float32, host_tier_slots=32, demote_ahead=12,
                           tier_copier=copier, early_loads=False) as c:
        hist = list(range(100, 116))
        c.add(1, hist + [9])
        b = c.schedule([(1, 17)])
        c.tier.step(None)
        c.commit(b)
        c.remove([1])
        c.tier.step(None)  # demotes the history
        assert c.manager.match_tiers([hist + [1]])[0].host_tokens == 16
        c.add(2, hist + [7, 8])
        b = c.schedule([(2, 18)])
        assert b.cached_tokens.tolist() == [16]
        fail["next"] = True
        with pytest.raises(RuntimeError, match="copy failed"):
            c.tier.step(None)  # the step's reloads
        assert c.tier.reloads_failed
        with pytest.raises(kvplug.InternalError, match="recover_from_failed_reloads"):
            c.schedule([(2, 2)])
        assert c.recover_from_failed_reloads() == [2]
        assert not c.state(2).live and c.stats["reload_recoveries"] == 1
        tm = c.manager.match_tiers([hist + [1]])[0]
        assert tm.gpu_tokens == 0 and tm.host_tokens == 16  # the blocks it failed to load are no GPU hit
        b = c.schedule([(2, 18)])
        assert b.cached_tokens.tolist() == [16]
        c.tier.step(None)  # reloads again, and lands
        c.commit(b)
        assert not c.tier.reloads_failed and c.manager.tier_stats().reloads_failed > 0


def test_readback_on_the_cpu(model):
    """HostReadback is for CUDA devices; a CPU runner's to_host is tolist.
    A step records no autograd graph (the runner's steps run without grad,
    whatever the caller's mode): its logits and the cache need no grad."""
    with pytest.raises(ValueError, match="a CUDA device"):
        kvhf.HostReadback("cpu")
    # Pageable memory: no device address (nor where the driver is absent), so no write through one.
    from kvplug.hf import readback
    assert readback._device_address(torch.empty(4, dtype=torch.int64).data_ptr()) == 0
    kvmodel = H.twin(model)
    with kvhf.PagedKVCache.for_model(kvmodel, 8, BS) as cache:
        runner = kvhf.Runner(kvmodel, cache, max_batch=2, max_step_tokens=16, max_model_len=64)
        t = torch.tensor([[3, 1], [4, 1]])
        assert runner.to_host(t) == [[3, 1], [4, 1]]
        assert torch.is_grad_enabled()
        cache.add(0, list(range(1, 11)))
        logits = runner.step(cache.schedule([(0, 10)]))
        assert logits.shape[0] == 1 and not logits.requires_grad and not cache.kv.requires_grad
