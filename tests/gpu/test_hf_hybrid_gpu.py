"""kvplug.hf serving hybrid models on the GPU: gpt-oss (sliding-window and
full layers, learned attention sinks) and Gemma 3 (five window layers per
global one) shapes with random weights, on kvplug's manager with layer
groups and its kernels (kv_write into each group's slots, windowed prefill
and decode through each group's block table, sinks), against transformers'
own forward teacher-forced on the tokens the kvplug run produced, in float16
and bfloat16; every logit row within the dtype's tolerance, through prefix
hits, chunked prefill, preemption and forks. The harness is
tests/python/test_hf_correctness.py's, the models tests/python/test_hf_hybrid.py's.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_hf_hybrid_gpu.py

Skips only on a machine with no NVIDIA device, and fails under
KVPLUG_REQUIRE_GPU=1 (tests/gpu/gputest.py).
"""

import pathlib
import sys

import pytest
from gputest import cpu_test_module, cuda_torch  # noqa: E402

torch = cuda_torch()

import kvplug.hf as kvhf  # noqa: E402

_py = pathlib.Path(__file__).resolve().parents[1] / "python"
sys.path.insert(0, str(_py))
import test_hf_correctness as H  # noqa: E402
import test_hf_hybrid as HY  # noqa: E402
T = cpu_test_module("test_hf_tier")

DEV = "cuda"
# tests/gpu/test_hf_torch.py's bounds for its 2-layer models, doubled: these have 4 and 6 layers, and the
# two runs' rounding differences grow with every layer they go through.
TOL = {torch.float16: (4e-2, 4e-2), torch.bfloat16: (1.6e-1, 1e-1)}


def gpu_hybrid(kind, dtype):
    """tiny_hybrid at head_dim 64 (a kernel size) and logits of O(1-10).
    gpt-oss with one expert: with several, a 16-bit rounding difference
    between the two runs can flip a token's top-2 experts, which changes
    its logits by far more than rounding, for reasons unrelated to
    attention."""
    return HY.tiny_hybrid(kind, dtype=dtype, device=DEV, window=24, experts=1, head_dim=64, hidden_size=256,
                          initializer_range=0.08)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind, num_blocks, graphs", [("gpt-oss", 36, False), ("gemma-3", 84, False),
                                                       ("gemma-3", 84, True)])
def test_hybrid_engine_on_kernels_matches_transformers(kind, num_blocks, dtype, graphs):
    """graphs: decode steps replay CUDA graphs, each layer group's table
    and the windows in the captured decode kernels (gpt-oss is not
    captured: transformers' MoE layer copies from the host in its forward
    pass, which test_a_model_that_cannot_be_captured_is_refused_clearly
    stands for)."""
    model = gpu_hybrid(kind, dtype)
    eng_mod = H.load_engine()
    reqs = H.make_requests(eng_mod, model.config.vocab_size)
    engine, rec = H.run_engine(model, dtype, DEV, reqs, num_blocks=num_blocks, backend="kernels", cuda_graphs=graphs)
    assert engine.runner.backend == "kernels" and len(engine.cache.groups) > 1
    if graphs:
        assert engine.runner.graphs and engine.runner.graph_steps > 0, "no decode step replayed a graph"
    assert all(r.finished is not None for r in reqs)
    assert rec.prefix_hits >= 3 and engine.preemptions >= 1
    atol, rtol = TOL[dtype]
    count, worst = H.compare(model, engine, rec, reqs, atol=atol, rtol=rtol)
    assert count > 200
    print(f"{kind} {dtype}: {count} rows, worst error {worst:.2f} of the bound")


@pytest.mark.parametrize("kind, num_blocks, graphs", [("gpt-oss", 28, False), ("gemma-3", 60, False),
                                                       ("gemma-3", 60, True)])
def test_hybrid_histories_come_back_from_the_host_tier_on_kernels(kind, num_blocks, graphs):
    """The host tier over layer groups on the GPU (tests/python/test_hf_hybrid_tier.py's conversations):
    each group's blocks demoted to pinned host slots by the library's batched copier and reloaded into
    their group's blocks; every logit row against transformers, the greedy outputs against a pool that
    holds everything, every queued copy run."""
    model = gpu_hybrid(kind, torch.float16)
    *_, big, _, _ = T.run_conversations(model, num_blocks=400, backend="kernels", cuda_graphs=graphs)
    engine, rec, reqs, outs, s, _ = T.run_conversations(model, num_blocks=num_blocks, host_slots=256,
                                                        backend="kernels", cuda_graphs=graphs)
    assert len(engine.cache.groups) > 1 and s["pinned"] and s["copier"] == "TierCopier", s
    assert s["demotions_completed"] > 0 and s["host_hit_tokens"] >= 3 * T.BS, s
    assert s["reloads_completed"] == s["reloads"] > 0 and s["demotions_failed"] == 0 and s["in_flight"] == 0, s
    assert s["demote_bytes"] == s["demotions_queued"] * s["slot_bytes"], s
    assert s["reload_bytes"] == s["reloads"] * s["slot_bytes"], s
    atol, rtol = TOL[torch.float16]
    count, worst = H.compare(model, engine, rec, reqs, atol=atol, rtol=rtol)
    assert count > 200
    assert outs == big
    print(f"{kind} host tier: {count} rows, worst error {worst:.2f} of the bound, {s['reloads']} reloads")


def test_a_model_that_cannot_be_captured_is_refused_clearly(monkeypatch):
    """A model whose forward pass cannot be captured (transformers' gpt-oss
    MoE copies from the host in 5.23) fails with kvplug's
    InvalidArgumentError naming cuda_graphs=False, torch's error chained."""
    import kvplug
    import kvplug.hf.runner as R

    def refuse(*args, **kwargs):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    monkeypatch.setattr(R, "_DecodeGraph", refuse)
    kvmodel = H.twin(gpu_hybrid("gemma-3", torch.float16))
    cache = kvhf.PagedKVCache.for_model(kvmodel, 84, 8)
    try:
        with pytest.raises(kvplug.InvalidArgumentError, match="cuda_graphs=False") as e:
            kvhf.Runner(kvmodel, cache, backend="kernels", max_batch=8, max_step_tokens=48, max_model_len=128,
                        cuda_graphs=True)
        assert isinstance(e.value.__cause__, RuntimeError)
    finally:
        cache.close()
