"""kvplug.hf on the GPU: the engine of examples/hf_engine.py on kvplug's
kernels (kv_write, paged_decode, prefill_plan/paged_prefill, decode steps
replayed from CUDA graphs) against transformers itself (its DynamicCache and
SDPA), teacher-forced on the tokens the kvplug run produced, in float16 and
bfloat16, for Llama, Mistral (sliding window) and Qwen2 shapes; every logit
row within the dtype's tolerance, through prefix hits, chunk boundaries,
preemption and forks. The harness is tests/python/test_hf_correctness.py's.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_hf_torch.py

Skips only on a machine with no NVIDIA device, and fails under
KVPLUG_REQUIRE_GPU=1 (tests/gpu/gputest.py); torch and transformers are required.
"""

import importlib.util
import pathlib
import sys

import pytest
from gputest import cuda_torch  # noqa: E402  (tests/gpu: skips only where there is no NVIDIA device)

torch = cuda_torch()

import kvplug  # noqa: E402
import kvplug.hf as kvhf  # noqa: E402

_path = pathlib.Path(__file__).resolve().parents[1] / "python" / "test_hf_correctness.py"
_spec = importlib.util.spec_from_file_location("hf_harness", _path)
H = importlib.util.module_from_spec(_spec)
sys.modules["hf_harness"] = H
_spec.loader.exec_module(H)

DEV = "cuda"
# |kvplug - transformers| <= ATOL + RTOL * max|row|: both sides round K/V, scores and
# outputs to the dtype at different points, and the differences go through 2 layers.
TOL = {torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 5e-2)}
# head_dim 64 (the kernels take 64, 128, 256); larger init so logits spread over O(1-10).
SHAPE = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, initializer_range=0.08)


# Mistral runs without the cascade only: the shared-prefix kernels take no window, so a model with a
# sliding window is never planned for them.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind,cascade", [(k, c) for k in ("llama", "mistral", "qwen2") for c in ("off", "auto", "forced")
                                          if k != "mistral" or c == "off"])
def test_engine_on_kernels_matches_transformers(kind, dtype, cascade):
    """The engine loop on the kernels, every logit row against transformers.
    cascade auto: shared-prefix attention where the cost model says it pays;
    forced: every decode, prefill and mixed step on the cascade route."""
    over = dict(SHAPE)
    if kind != "mistral":
        over.pop("head_dim")  # Llama and Qwen2 derive it: 512 / 8 = 64
    model = H.tiny_model(kind, dtype=dtype, device=DEV, **over)
    eng_mod = H.load_engine()
    reqs = H.make_requests(eng_mod, model.config.vocab_size)
    engine, rec = H.run_engine(model, dtype, DEV, reqs, num_blocks=30, backend="kernels",
                               # cascade: graphs for Llama, eager plans for Qwen2
                               cuda_graphs=(kind == "llama") if cascade != "off" else (kind != "mistral"),
                               cascade=cascade != "off", cascade_auto_route=cascade != "forced")
    assert engine.runner.backend == "kernels"
    assert all(r.finished is not None for r in reqs)
    assert rec.prefix_hits >= 3 and rec.chunk_starts_inside_block >= 1
    assert engine.preemptions >= 1 and engine.cache.stats["forks"] == 4
    atol, rtol = TOL[dtype]
    count, worst = H.compare(model, engine, rec, reqs, atol=atol, rtol=rtol)
    assert count > 200
    print(f"{kind} {dtype} cascade {cascade}: {count} rows, worst error {worst:.2f} of the bound, "
          f"{engine.runner.graph_steps} graph steps")


# Decode tests feed every run the same tokens (teacher forcing): a run that fed back its own
# argmax would follow a different sequence from the first near tie that bf16 rounding flips, and
# its logits would then differ by far more than rounding for reasons unrelated to attention.
FORCED = torch.randint(0, SHAPE["vocab_size"], (16, 8), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("cascade", ["off", "forced", "auto"])
def test_cuda_graph_decode_replays_match_eager(cascade):
    """Decode steps replayed from graphs (padded to the graph's batch) give
    the eager kernels' logits (plain decode, no cascade), step after step,
    as the batch shrinks, while the GPU runs behind the host; the prompts
    share a 48-token prefix, so the cascade plans find sharing. forced:
    every replay is the cascade graph;
    auto: the plan's route picks the cascade or the paged_decode graph."""
    dtype = torch.bfloat16
    over = dict(SHAPE)
    over.pop("head_dim")
    model = kvhf.prepare_model(H.tiny_model("llama", dtype=dtype, device=DEV, **over))
    outs = {}
    shared = list(range(100, 148))
    for graphs in (False, True):
        with kvhf.PagedKVCache.for_model(model, 64, 16) as cache:
            runner = kvhf.Runner(model, cache, max_batch=8, max_step_tokens=512, max_model_len=256,
                                 cuda_graphs=graphs, graph_sizes=[2, 4, 8], cascade=cascade != "off" and graphs)
            runner.cascade_auto_route = cascade == "auto"
            for i in range(5):
                cache.add(i, shared + list(range(1 + i, 40 + 7 * i)))
            lg = runner.step(cache.schedule([(i, 512) for i in range(5)]))
            seq = []
            live = list(range(5))
            for step in range(12):
                for sid, t in zip(live, FORCED[step]):
                    cache.append(sid, t)
                if step == 6:
                    cache.remove([live.pop()])  # 4 sequences: another graph
                # The GPU lags the host by a busy wait, and nothing waits for a step's results before the next
                # one is scheduled: a step must not rewrite the pinned inputs the last step's copies read.
                torch.cuda._sleep(20_000_000)
                lg = runner.step(cache.schedule([(sid, 1) for sid in live]))
                seq.append(lg.clone())
            outs[graphs] = (seq, runner.graph_steps, runner.graph_decode_steps)
    assert outs[True][1] == 12 and outs[False][1] == 0
    if cascade == "forced":
        assert outs[True][2] == 0, "forced: no replay of the paged_decode graph"
    if cascade == "off":
        assert outs[True][2] == 0
    # Plain decode replayed matches eager decode to rounding; cascade merges partial states, so its bf16
    # rounding differs (through 2 layers) as much as it does from transformers: the engine test's bound.
    atol, rtol = TOL[dtype] if cascade != "off" else (1e-2, 1e-2)
    for a, b in zip(outs[False][0], outs[True][0]):
        err, bound = (a - b).abs().max().item(), atol + rtol * b.abs().max().item()
        assert err <= bound, f"graph vs eager: {err:.3e} > {bound:.3e}"


def test_generate_on_kernels_matches_transformers_greedy_prefix():
    """Greedy generation on the kernels agrees with transformers' generate
    for the first tokens (later ones may diverge on a rounding tie)."""
    dtype = torch.float16
    over = dict(SHAPE)
    over.pop("head_dim")
    model = H.tiny_model("llama", dtype=dtype, device=DEV, **over)
    prompts = [list(range(5, 60)), [7] * 33]
    want = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device=DEV), attention_mask=torch.ones(1, len(p), dtype=torch.long, device=DEV),
                             max_new_tokens=4, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    got = kvhf.generate(H.twin(model), prompts, max_new_tokens=4)
    assert [g[:2] for g in got] == [w[:2] for w in want]


def test_cascade_route_matches_decode():
    """The smallest reproduction, no graph: five sequences sharing a
    48-token prefix (3 blocks), ten decode steps eagerly, the cascade route
    forced (decode_route=False) against paged_decode, the same tokens fed to
    both; the lengths cross block boundaries on the way."""
    over = dict(SHAPE)
    over.pop("head_dim")
    model = kvhf.prepare_model(H.tiny_model("llama", dtype=torch.bfloat16, device=DEV, **over))
    shared = list(range(100, 148))
    orig = kvhf.runner.kvplug.cascade.plan

    def forced(*a, **k):
        k["decode_route"] = False
        return orig(*a, **k)

    outs = {}
    for cascade in (False, True):
        with kvhf.PagedKVCache.for_model(model, 64, 16) as cache:
            runner = kvhf.Runner(model, cache, max_batch=8, max_step_tokens=512, max_model_len=256, cascade=cascade)
            for i in range(5):
                cache.add(i, shared + list(range(1 + i, 40 + 7 * i)))
            lg = runner.step(cache.schedule([(i, 512) for i in range(5)]))
            seq = []
            kvhf.runner.kvplug.cascade.plan = forced
            try:
                for step in range(10):
                    for sid, t in zip(range(5), FORCED[step]):
                        cache.append(sid, t)
                    lg = runner.step(cache.schedule([(sid, 1) for sid in range(5)]))
                    seq.append(lg.clone())
            finally:
                kvhf.runner.kvplug.cascade.plan = orig
            outs[cascade] = seq
    atol, rtol = TOL[torch.bfloat16]
    errs = [(a - b).abs().max().item() for a, b in zip(outs[False], outs[True])]
    bounds = [atol + rtol * b.abs().max().item() for b in outs[False]]
    assert all(e <= b for e, b in zip(errs, bounds)), f"per-step max |cascade - decode|: {[round(e, 3) for e in errs]}"


def test_auto_backend_takes_torch_for_a_head_size_the_kernels_lack():
    """head_dim 32 (the engine's tiny models): backend "auto" runs on the torch path
    instead of failing in the kernels' workspace sizing; "kernels" is refused up front."""
    model = kvhf.prepare_model(H.tiny_model("llama", dtype=torch.bfloat16, device=DEV, vocab_size=128, hidden_size=128,
                                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2))
    assert model.config.hidden_size // model.config.num_attention_heads == 32
    cache = kvhf.PagedKVCache.for_model(model, num_blocks=8, block_size=16)
    try:
        assert cache.device == next(model.parameters()).device  # "cuda" named as the model's device
        assert kvhf.Runner(model, cache, max_batch=2).backend == "torch"
        with pytest.raises(kvplug.InvalidArgumentError, match="head_dim"):
            kvhf.Runner(model, cache, backend="kernels")
    finally:
        cache.close()
