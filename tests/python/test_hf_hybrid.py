"""kvplug.hf serving hybrid models -- gpt-oss (alternating sliding-window and
full attention layers, learned attention sinks, mixture of experts) and
Gemma 3 (five sliding-window layers per global one) -- from small configs
built in code with random weights, on kvplug's manager with layer groups:
every logit row the engine computes (prefix hits, chunked prefill,
preemption, forks, decode) matches transformers' own forward, teacher
forced, and the window layers hold fewer blocks than the full ones.
tests/gpu/test_hf_hybrid_gpu.py runs the same harness on the kernels."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
import torch
import transformers

import kvplug
import kvplug.hf as kvhf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_hf_correctness as H  # noqa: E402


def tiny_hybrid(kind: str, dtype=torch.float32, device="cpu", seed=0, window=12, experts=4, **over):
    """A 4-layer gpt-oss (sliding, full, sliding, full; sinks drawn so that
    they matter) or a 6-layer Gemma 3 (five sliding, one full), GQA 4:2,
    head_dim 16, with a window of `window` tokens; gpt-oss with `experts`
    experts, two a token (one when there is one); over: config fields."""
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=1024, sliding_window=window)
    common.update(over)
    if kind == "gpt-oss":
        # YaRN's factor 32 over gpt-oss's 4096 original positions: max_position_embeddings to match.
        cfg = transformers.GptOssConfig(num_hidden_layers=4, num_local_experts=experts, num_experts_per_tok=min(2, experts),
                                        **{**common, "max_position_embeddings": 131072})
        cls = transformers.GptOssForCausalLM
    elif kind == "gemma-3":
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=6, query_pre_attn_scalar=16, **common)
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if kind == "gpt-oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2)
    return model.to(device=device, dtype=dtype)


@pytest.mark.parametrize("kind, num_blocks", [("gpt-oss", 36), ("gemma-3", 84)])
def test_hybrid_engine_matches_transformers(kind, num_blocks):
    model = tiny_hybrid(kind)
    eng_mod = H.load_engine()
    reqs = H.make_requests(eng_mod, model.config.vocab_size)
    engine, rec = H.run_engine(model, torch.float32, "cpu", reqs, num_blocks=num_blocks)
    assert all(r.finished is not None for r in reqs)
    assert rec.prefix_hits >= 3, rec.prefix_hits
    assert rec.steps["mixed"] >= 1 and rec.steps["decode"] >= 1, rec.steps
    assert engine.preemptions >= 1, "the pool is small enough to preempt"
    count, worst = H.compare(model, engine, rec, reqs, atol=5e-5, rtol=5e-5)
    assert count > 200


@pytest.mark.parametrize("kind, groups", [("gpt-oss", 2), ("gemma-3", 6)])
def test_hybrid_cache_groups_the_layers(kind, groups):
    model = kvhf.prepare_model(tiny_hybrid(kind, window=8))
    with kvhf.PagedKVCache.for_model(model, 64, 4) as cache:
        assert len(cache.groups) == groups and cache.kv.shape[0] == model.config.num_hidden_layers // groups
        types = model.config.layer_types
        assert all(types[l] == "full_attention" for l in cache.groups[0])
        assert all(types[l] == "sliding_attention" for g in cache.groups[1:] for l in g)
        runner = kvhf.Runner(model, cache, max_batch=1, max_step_tokens=64, max_model_len=128)
        toks = np.random.default_rng(1).integers(1, 97, 40).tolist()
        cache.add(0, toks)
        runner.step(cache.schedule([(0, 40)]))
        for _ in range(12):
            cache.append(0, 5)
            b = runner.step(cache.schedule([(0, 1)]))
        held = cache.manager.group_blocks()
        # 52 tokens: 13 blocks in the full group; a window of 8 reads at most 3 blocks of 4.
        assert held[0] == 13 and all(h <= 3 for h in held[1:]), held
    with kvhf.PagedKVCache.for_model(model, 64, 4, layer_groups=False) as cache:
        assert len(cache.groups) == 1 and cache.kv.shape[0] == model.config.num_hidden_layers


def test_sinks_matter():
    """The comparison above depends on gpt-oss's sinks: sinks of -1e4 (none)
    on the kvplug side give other logits."""
    model = tiny_hybrid("gpt-oss", window=8)
    toks = np.random.default_rng(2).integers(1, 97, 40).tolist()
    ref = H.reference_logits(model, toks, 40)

    def run(mutate):
        kvmodel = H.twin(model)
        mutate(kvmodel)
        with kvhf.PagedKVCache.for_model(kvmodel, 64, 4) as cache:
            runner = kvhf.Runner(kvmodel, cache, max_batch=1, max_step_tokens=64, max_model_len=64)
            cache.add(0, toks)
            return runner.step(cache.schedule([(0, 40)]), all_logits=True)

    assert torch.allclose(run(lambda m: None), ref, atol=5e-5, rtol=5e-5)

    def no_sinks(m):
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
    assert (run(no_sinks) - ref).abs().max() > 1e-3



def test_a_prompt_the_groups_can_never_hold_is_refused_not_raised():
    # Gemma 3 (one full and five window groups), 64 blocks of 4, window 8: a sequence decoded to 60 tokens holds 30
    # blocks while live, but its re-admission asks every group for the whole prompt (16 blocks x 6), which the
    # manager refuses for good. The schedule has grown the live sequence by then: it leaves the refused one out
    # (Batch.refused, with the error) instead of raising, so the cache and the manager stay in step.
    km = H.twin(tiny_hybrid("gemma-3", window=8))
    rng = np.random.default_rng(0)
    with kvhf.PagedKVCache.for_model(km, 64, 4) as c:
        r = kvhf.Runner(km, c, max_batch=4, max_step_tokens=256, max_model_len=256)
        c.add(0, rng.integers(1, 97, 20).tolist())
        c.add(1, rng.integers(1, 97, 8).tolist())
        r.step(c.schedule([(0, 20), (1, 8)]))
        for _ in range(40):
            c.append(0, 3)
            c.append(1, 4)
            r.step(c.schedule([(0, 1), (1, 1)]))
        c.append(0, 3)
        c.append(1, 4)
        c.preempt(0)
        b = c.schedule([(1, 1), (0, 1)])
        assert b.seq_ids.tolist() == [1] and [s for s, _ in b.refused] == [0] and b.not_admitted == []
        assert isinstance(b.refused[0][1], kvplug.InvalidArgumentError) and not c.state(0).live
        r.step(b)
        c.append(1, 5)
        c.remove([0])
        b = c.schedule([(1, 1)])  # the manager and the cache agree: the live sequence goes on
        assert b.seq_ids.tolist() == [1] and b.seq_lens.tolist() == [50]


def test_the_engine_ends_a_request_the_groups_can_never_hold():
    # The only request of the run is one the manager refuses for good (30 blocks x 6 groups of a 64-block pool):
    # the engine ends it with Request.error and returns, instead of failing on an empty waiting line.
    E = H.load_engine()
    km = H.twin(tiny_hybrid("gemma-3", window=8))
    prompt = np.random.default_rng(0).integers(1, 97, 120).tolist()
    with kvhf.PagedKVCache.for_model(km, 64, 4) as c:
        r = kvhf.Runner(km, c, max_batch=4, max_step_tokens=256, max_model_len=256)
        engine = E.Engine(r, E.EngineConfig(max_batch=4, step_tokens=256, chunk=128, progress_every=0))
        req = E.Request(0, 0.0, prompt, 4)
        engine.run([req], log=lambda s: None)
        assert req.error and "never" in req.error and not any(req.outputs.values()) and req.finished is not None
        assert not c.seqs and c.manager.stats().num_seqs == 0
