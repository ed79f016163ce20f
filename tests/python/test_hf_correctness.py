"""kvplug.hf against transformers itself: the same model (random weights from
a small Llama / Mistral / Qwen2 config built in code) run by transformers
with its own DynamicCache and SDPA, teacher-forced on the tokens the kvplug
run produced; every logit row kvplug computed must match transformers' row
at that position, through prefix-cache hits, chunk boundaries inside
blocks, mixed prefill/decode steps, preemption with re-admission, and forks.

On the CPU the attention is the torch reference path over the paged cache
(gather through the block table and slots, then softmax attention): the same manager,
block-table and slot logic the kernels use. tests/gpu/test_hf_torch.py runs
this harness with the kernels. torch and transformers are required: a
missing one fails the run (make test installs both)."""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
import transformers
from transformers import DynamicCache

import kvplug
import kvplug.hf as kvhf

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_script(rel: str):
    """The project's script at ROOT/rel (examples/, bench/) as a module of
    its file's name, loaded once (the script is what is tested)."""
    name = pathlib.Path(rel).stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def load_engine():
    """examples/hf_engine.py as a module."""
    return load_script("examples/hf_engine.py")


def tiny_model(kind: str, dtype=torch.float32, device="cpu", seed=0, **over):
    """A 2-layer model of the given family, GQA 4:2, head_dim 16."""
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024)
    common.update(over)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**{"head_dim": 16, "sliding_window": 24, **common})
        cls = transformers.MistralForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if kind == "qwen2":  # q/k/v biases are zero at init: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias):
                    p.normal_(0, 0.5)
    return model.to(device=device, dtype=dtype)


def twin(ref_model):
    """The same weights, switched to attn_implementation='kvplug'."""
    return kvhf.prepare_model(copy.deepcopy(ref_model))


@torch.no_grad()
def reference_logits(model, tokens: List[int], split: int) -> torch.Tensor:
    """transformers' logits for every position of `tokens`: the first `split`
    tokens in one forward pass, the rest one at a time through its
    DynamicCache (teacher forcing)."""
    dev = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([tokens], device=dev)
    out = [model(input_ids=ids[:, :split], past_key_values=cache, use_cache=True).logits[0].float()]
    for p in range(split, len(tokens)):
        out.append(model(input_ids=ids[:, p:p + 1], past_key_values=cache, use_cache=True).logits[0].float())
    return torch.cat(out)


class Recorder:
    """Keeps every logit row the engine computes, by (sequence, position)."""

    def __init__(self) -> None:
        self.rows: Dict[Tuple[int, int], List[torch.Tensor]] = {}
        self.steps = {"mixed": 0, "decode": 0, "prefill": 0}
        self.prefix_hits = 0
        self.chunk_starts_inside_block = 0

    def __call__(self, batch: kvhf.Batch, logits: torch.Tensor, block_size: int) -> None:
        assert logits.shape[0] == batch.num_tokens
        qo = batch.qo_indptr()
        for i, sid in enumerate(batch.seq_ids.tolist()):
            s, n = int(batch.starts[i]), int(batch.q_lens[i])
            for r in range(n):
                self.rows.setdefault((sid, s + r), []).append(logits[qo[i] + r].detach().cpu())
            if batch.cached_tokens[i] > 0:
                self.prefix_hits += 1
            if n > 1 and s % block_size:
                self.chunk_starts_inside_block += 1
        kinds = set((batch.q_lens > 1).tolist())
        self.steps["mixed" if kinds == {True, False} else "prefill" if kinds == {True} else "decode"] += 1


def run_engine(model, dtype, device, requests, *, num_blocks, block_size=8, chunk=13, step_tokens=40, max_batch=8,
               backend="auto", cuda_graphs=False, cascade=False, cascade_auto_route=True, seed=0):
    eng_mod = load_engine()
    kvmodel = twin(model)
    max_len = max(len(r.prompt) + r.max_new_tokens for r in requests)
    cache = kvhf.PagedKVCache.for_model(kvmodel, num_blocks, block_size)
    runner = kvhf.Runner(kvmodel, cache, backend=backend, max_batch=max_batch, max_step_tokens=step_tokens + max_batch,
                         max_model_len=max_len, cuda_graphs=cuda_graphs, cascade=cascade)
    runner.cascade_auto_route = cascade_auto_route
    rec = Recorder()
    cfg = eng_mod.EngineConfig(max_batch=max_batch, step_tokens=step_tokens, chunk=chunk, seed=seed, progress_every=0)
    engine = eng_mod.Engine(runner, cfg, on_logits=lambda b, lg: rec(b, lg, block_size))
    engine.run(requests, log=lambda s: None)
    cache.manager.check()
    stats = cache.manager.stats()
    assert stats.num_seqs == 0 and not cache.seqs, "every sequence retired"
    cache.close()
    return engine, rec


def make_requests(eng_mod, vocab: int, seed: int = 0):
    """Requests sharing a 40-token system prompt (two share a longer one),
    some sampled 3 ways, all arriving at once."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, vocab, 40).tolist()
    longer = system + rng.integers(1, vocab, 21).tolist()
    reqs = []
    for i in range(8):
        base = longer if i in (5, 6) else system
        own = rng.integers(1, vocab, int(rng.integers(3, 30))).tolist()
        n = 3 if i in (1, 4) else 1
        reqs.append(eng_mod.Request(i, 0.0, base + own, int(rng.integers(4, 12)), n=n, temperature=1.0))
    return reqs


def compare(model, engine, rec, requests, atol: float, rtol: float) -> Tuple[int, float]:
    """Every recorded row against transformers' teacher-forced logits of the
    sequence's final tokens. Returns (rows compared, worst error / bound)."""
    worst, count = 0.0, 0
    for req in requests:
        for sid in req.seq_ids:
            toks = req.prompt + req.outputs[sid]
            positions = sorted(p for (s, p) in rec.rows if s == sid)
            if not positions:
                continue
            ref = reference_logits(model, toks, len(req.prompt))
            for p in positions:
                for row in rec.rows[(sid, p)]:
                    want = ref[p].cpu()
                    err = (row - want).abs().max().item()
                    bound = atol + rtol * want.abs().max().item()
                    assert err <= bound, (f"request {req.rid} sequence {sid} position {p}: max |kvplug - transformers| "
                                          f"= {err:.3e} > {bound:.3e}")
                    worst = max(worst, err / bound)
                    count += 1
    return count, worst


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_engine_matches_transformers_fp32(kind):
    """Prefix hits, chunks starting inside blocks, mixed steps, preemption
    (a pool of 30 blocks of 8 for ~20 sequences) and forks."""
    model = tiny_model(kind)
    eng_mod = load_engine()
    reqs = make_requests(eng_mod, model.config.vocab_size)
    engine, rec = run_engine(model, torch.float32, "cpu", reqs, num_blocks=30)
    # The run went through every path the comparison is about.
    assert all(r.finished is not None for r in reqs)
    assert rec.prefix_hits >= 3, rec.prefix_hits
    assert rec.chunk_starts_inside_block >= 1
    assert rec.steps["mixed"] >= 1 and rec.steps["decode"] >= 1, rec.steps
    assert engine.preemptions >= 1, "the pool is small enough to preempt"
    assert engine.cache.stats["forks"] == 4  # two requests sampled 3 ways
    count, worst = compare(model, engine, rec, reqs, atol=2e-5, rtol=2e-5)
    assert count > 200


def test_sliding_window_is_applied():
    """Mistral with a 24-token window over ~80-token sequences: the
    comparison above passes only with the window; without it (the same
    weights, window off on the kvplug side) rows past the window differ."""
    model = tiny_model("mistral", sliding_window=24)
    kvmodel = twin(model)
    kvmodel.config.sliding_window = None  # kvplug side attends to everything
    toks = np.random.default_rng(3).integers(1, 97, 60).tolist()
    with kvhf.PagedKVCache.for_model(kvmodel, 16, 8) as cache:
        runner = kvhf.Runner(kvmodel, cache, max_batch=1, max_step_tokens=64, max_model_len=64)
        cache.add(0, toks)
        got = runner.step(cache.schedule([(0, 60)]), all_logits=True)
    ref = reference_logits(model, toks, 60)
    assert torch.allclose(got[:24], ref[:24], atol=2e-5, rtol=2e-5)  # inside the window: the same
    assert (got[30:] - ref[30:]).abs().max() > 1e-3  # past it: the window matters


def test_generate_matches_transformers_generate():
    model = tiny_model("llama")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3] * 21, list(range(40, 75))]
    want = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=10, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    got = kvhf.generate(twin(model), prompts, max_new_tokens=10, chunk=16)
    assert got == want


def test_generate_preempts_when_the_pool_is_small():
    model = tiny_model("llama")
    prompts = [list(range(1, 30)), list(range(30, 60)), list(range(2, 33))]
    want = kvhf.generate(twin(model), prompts, max_new_tokens=12)
    # 3 sequences of up to 43 tokens need 18 blocks of 8; 9 forces preemption and recomputation.
    with kvhf.PagedKVCache.for_model(model, 9, 8) as cache:
        got = kvhf.generate(twin(model), prompts, max_new_tokens=12, cache=cache)
        assert cache.stats["preempted"] >= 1
        assert cache.manager.stats().num_seqs == 0
    assert got == want


def test_forks_never_outgrow_the_batch():
    """Prompts sampled n ways count n seats when admitted: 4 prompts x 8
    samples with room for 12 rows per step run every step within 12 rows
    (a step past the Runner's max_batch is an error) and all finish."""
    eng_mod = load_engine()
    model = tiny_model("llama")
    rng = np.random.default_rng(3)
    reqs = [eng_mod.Request(i, 0.0, rng.integers(1, 97, int(rng.integers(5, 20))).tolist(), 6, n=8, temperature=1.0)
            for i in range(4)]
    engine, rec = run_engine(model, torch.float32, "cpu", reqs, num_blocks=128, max_batch=12)
    assert max(engine.batch_sizes) <= 12
    assert max(engine.batch_sizes) >= 8, "a forked prompt's samples decode together"
    for r in reqs:
        assert r.finished is not None and len(r.seq_ids) == 8
        assert all(len(r.outputs[s]) == 6 for s in r.seq_ids)


def test_a_fork_preempting_another_fork_of_the_same_step():
    """Six prompts sampled 8 ways finish their prompts in one step while the
    pool (48 blocks of 8) cannot hold every fork's copied last block: a fork
    preempts a sequence that was about to fork in the same step. That one's
    samples are dropped and it forks after re-admission; every row still
    matches transformers."""
    eng_mod = load_engine()
    model = tiny_model("llama")
    rng = np.random.default_rng(5)
    reqs = [eng_mod.Request(i, 0.0, rng.integers(1, 97, 30).tolist(), 12, n=8, temperature=1.0) for i in range(6)]
    engine, rec = run_engine(model, torch.float32, "cpu", reqs, num_blocks=48, max_batch=64, step_tokens=256, chunk=64)
    assert engine.preemptions >= 1
    for r in reqs:
        assert r.finished is not None and len(r.seq_ids) == 8
        assert all(len(r.outputs[s]) == 12 for s in r.seq_ids)
    count, _ = compare(model, engine, rec, reqs, atol=2e-5, rtol=2e-5)
    assert count > 500


def test_same_step_prefix_sharing():
    """Two prompts with the same 32-token prefix admitted in one step: the
    second starts on the first's blocks, whose K/V this same step writes
    (every layer writes before it attends)."""
    model = tiny_model("llama")
    kvmodel = twin(model)
    rng = np.random.default_rng(1)
    shared = rng.integers(1, 97, 32).tolist()
    a, b = shared + [1, 2, 3], shared + [4, 5]
    with kvhf.PagedKVCache.for_model(kvmodel, 32, 8) as cache:
        runner = kvhf.Runner(kvmodel, cache, max_batch=2, max_step_tokens=64, max_model_len=64)
        cache.add(0, a)
        cache.add(1, b)
        batch = cache.schedule([(0, 64), (1, 64)])
        assert batch.cached_tokens.tolist() == [0, 32]
        assert batch.q_lens.tolist() == [35, 2]
        got = runner.step(batch, all_logits=True)
    ref_b = reference_logits(model, b, len(b))
    assert torch.allclose(got[35:], ref_b[32:], atol=2e-5, rtol=2e-5)


def test_detects_a_corrupted_cache():
    """The comparison can fail: a block of K overwritten between steps makes
    the next rows differ."""
    model = tiny_model("llama")
    kvmodel = twin(model)
    toks = list(range(10, 50))
    with kvhf.PagedKVCache.for_model(kvmodel, 16, 8) as cache:
        runner = kvhf.Runner(kvmodel, cache, max_batch=1, max_step_tokens=64, max_model_len=64)
        cache.add(0, toks[:30])
        runner.step(cache.schedule([(0, 30)]))
        cache.append(0, toks[30])
        batch = cache.schedule([(0, 1)])
        cache.kv[0, 0, int(batch.block_table[0, 1])] += 1.0  # the second block's K, layer 0
        got = runner.step(batch, all_logits=True)
    ref = reference_logits(model, toks[:31], 30)
    assert (got[0] - ref[30]).abs().max() > 1e-3


def test_errors_are_clear():
    model = tiny_model("llama")
    kvmodel = twin(model)
    with pytest.raises(RuntimeError, match="without kvplug_batch"):
        kvmodel(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    with kvhf.PagedKVCache.for_model(kvmodel, 8, 8) as cache:
        with pytest.raises(ValueError, match="prepare_model"):
            kvhf.Runner(model, cache)
        with pytest.raises(ValueError, match="CUDA cache"):
            kvhf.Runner(kvmodel, cache, backend="kernels")
        runner = kvhf.Runner(kvmodel, cache, max_batch=2, max_step_tokens=16, max_model_len=64)
        with pytest.raises(kvplug.UnknownSequenceError):
            cache.schedule([(5, 1)])
        cache.add(0, [1, 2, 3, 4])
        with pytest.raises(kvplug.DuplicateSequenceError):
            cache.add(0, [1])
        with pytest.raises(kvplug.InvalidArgumentError, match="fork"):
            cache.fork(0, [1])  # not computed yet
        runner.step(cache.schedule([(0, 4)]))
        with pytest.raises(kvplug.InvalidArgumentError, match="pending"):
            cache.schedule([(0, 1)])  # nothing appended
        cache.add(1, list(range(40)))
        with pytest.raises(ValueError, match="up to 16"):
            runner.step(cache.schedule([(1, 40)]))
        with pytest.raises(ValueError, match="float16"):
            kvhf.Runner(kvmodel, kvhf.PagedKVCache(kvhf.ModelShape.of(kvmodel.config), 4, 8, dtype=torch.float16))
        other = kvhf.ModelShape(3, 4, 2, 16)
        with kvhf.PagedKVCache(other, 4, 8, dtype=torch.float32) as c2:
            with pytest.raises(ValueError, match="made for"):
                kvhf.Runner(kvmodel, c2)


def test_import_kvplug_does_not_import_torch_or_transformers():
    import subprocess

    code = "import sys, kvplug; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def fp8_against_16bit(device: str, backend: str = "auto", cascade: bool = False, fp8_prefill: Optional[str] = None,
                      head_dim: int = 64) -> Tuple[float, float, float]:
    """Teacher-forced logits of a bf16 tiny Llama over an FP8 cache
    (kv_dtype torch.float8_e4m3fn) against the same model over a bf16 cache:
    (max relative error, mean relative error, argmax agreement), over a
    prefill of 40 tokens in two chunks and 12 decode steps. cascade: both
    runs on kvplug.cascade's kernels, every step kept on the cascade route;
    fp8_prefill: the FP8 cache's prefill mode (PagedKVCache)."""
    model = twin(tiny_model("llama", dtype=torch.bfloat16, device=device, head_dim=head_dim, num_attention_heads=4,
                            hidden_size=4 * head_dim))
    toks = np.random.default_rng(7).integers(1, 97, 52).tolist()
    runs = []
    for kv_dtype in (None, torch.float8_e4m3fn):
        with kvhf.PagedKVCache.for_model(model, 16, 16, kv_dtype=kv_dtype,
                                         fp8_prefill=fp8_prefill if kv_dtype is not None else None) as cache:
            runner = kvhf.Runner(model, cache, max_batch=1, max_step_tokens=64, max_model_len=64, backend=backend,
                                 cascade=cascade)
            runner.cascade_auto_route = not cascade
            cache.add(0, toks[:40])
            rows = [runner.step(cache.schedule([(0, 24)]), all_logits=True),
                    runner.step(cache.schedule([(0, 16)]), all_logits=True)]
            for t in toks[40:]:
                cache.append(0, t)
                rows.append(runner.step(cache.schedule([(0, 1)]), all_logits=True))
            runs.append(torch.cat([r.float().cpu() for r in rows]))
    ref, got = runs
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return rel.max().item(), rel.mean().item(), agree


def test_fp8_cache_logits_stay_close():
    """FP8 K/V (the torch path's quantisation, as kv_write's) changes the
    logits by FP8's rounding only: small relative error, the same argmax
    almost everywhere."""
    worst, mean, agree = fp8_against_16bit("cpu")
    assert worst < 0.1 and mean < 0.05, (worst, mean)
    assert agree >= 0.9, agree


def test_fp8_cache_misuse():
    model = tiny_model("llama")  # float32: no FP8 cache
    with pytest.raises(kvplug.InvalidArgumentError, match="float16 and bfloat16"):
        kvhf.PagedKVCache.for_model(model, 16, 8, kv_dtype=torch.float8_e4m3fn)
    bf = tiny_model("llama", dtype=torch.bfloat16)
    with pytest.raises(kvplug.InvalidArgumentError, match="kv_dtype"):
        kvhf.PagedKVCache.for_model(bf, 16, 8, kv_dtype=torch.float16)
    with pytest.raises(kvplug.InvalidArgumentError, match="fp8_prefill must be"):
        kvhf.PagedKVCache.for_model(bf, 16, 8, kv_dtype=torch.float8_e4m3fn, fp8_prefill="fast")
    with pytest.raises(kvplug.InvalidArgumentError, match="is for FP8 caches"):
        kvhf.PagedKVCache.for_model(bf, 16, 8, fp8_prefill="hopper")
    with pytest.raises(kvplug.UnsupportedError, match="head_dim 128"):  # the tiny model's head_dim is not 128
        kvhf.PagedKVCache.for_model(bf, 16, 8, kv_dtype=torch.float8_e4m3fn, fp8_prefill="fp8")
    with pytest.raises(kvplug.InvalidArgumentError, match="is for FP8 caches"):
        kvhf.PagedKVCache.for_model(bf, 16, 8, fp8_prefill="sm80")


def test_fp8_prefill_mainloop_choice():
    """An FP8 cache plans prefill and shared-prefix work for the device's
    mainloop (Hopper's where there is one) unless fp8_prefill="sm80" says
    otherwise; a 16-bit cache always does and carries no fp8_prefill."""
    bf = tiny_model("llama", dtype=torch.bfloat16)
    with kvhf.PagedKVCache.for_model(bf, 16, 8, kv_dtype=torch.float8_e4m3fn) as c:
        assert (c.fp8_prefill, c.hopper_prefill) == ("hopper", True)
    with kvhf.PagedKVCache.for_model(bf, 16, 8, kv_dtype=torch.float8_e4m3fn, fp8_prefill="sm80") as c:
        assert (c.fp8_prefill, c.hopper_prefill) == ("sm80", False)
    with kvhf.PagedKVCache.for_model(bf, 16, 8) as c:
        assert (c.fp8_prefill, c.hopper_prefill) == (None, True)
