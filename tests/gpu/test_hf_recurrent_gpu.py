"""kvplug.hf serving a Qwen3-Next-shaped hybrid on the GPU: Gated DeltaNet
(linear-attention) layers with their conv and recurrent states in the state
blocks of kvplug's recurrent layer groups, and full-attention layers on
kvplug's kernels (kv_write into group 0's slots, paged prefill and decode
through its block table), against transformers' own forward teacher-forced
on the tokens the kvplug run produced, in float16 and bfloat16; every logit
row within the dtype's tolerance, through chunked prefill, prefix hits
through checkpoints, preemption and forks. The harness is
tests/python/test_hf_correctness.py's, the model tests/python/test_hf_recurrent.py's.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_hf_recurrent_gpu.py

Skips only on a machine with no NVIDIA device, and fails under
KVPLUG_REQUIRE_GPU=1 (tests/gpu/gputest.py).
"""

import pathlib
import sys

import pytest
from gputest import cuda_torch  # noqa: E402

torch = cuda_torch()

import kvplug.hf as kvhf  # noqa: E402

_py = pathlib.Path(__file__).resolve().parents[1] / "python"
sys.path.insert(0, str(_py))
import test_hf_correctness as H  # noqa: E402
import test_hf_recurrent as R  # noqa: E402

DEV = "cuda"
# The hybrid models' bounds: those have 4 and 6 layers, this one 8, of which the 6 linear ones compute in
# float32 from 16-bit inputs as transformers does.
from test_hf_hybrid_gpu import TOL  # noqa: E402
# A page of K and V per layer (2 x 16 x 2 x 64 x 2 bytes) holds a layer's state (4864 bytes in 16 bits).
BLOCK = 16


def gpu_qwen3_next(dtype):
    """tiny_qwen3_next at head_dim 64 (a kernel size), linear heads of 16
    and a dense MLP: with experts, a 16-bit rounding difference between
    the two runs can flip a token's top experts, which changes its logits
    by far more than rounding, for reasons unrelated to the cache."""
    return R.tiny_qwen3_next(dtype=dtype, device=DEV, experts=0, head_dim=64, hidden_size=256, intermediate_size=512,
                             linear_key_head_dim=16, linear_value_head_dim=16, initializer_range=0.05)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("num_blocks", [80, 28], ids=["hits", "preemption"])
def test_recurrent_engine_on_kernels_matches_transformers(num_blocks, dtype):
    model = gpu_qwen3_next(dtype)
    assert kvhf.PagedKVCache.min_block_size(kvhf.ModelShape.of(model.config), dtype) <= BLOCK
    eng_mod = H.load_engine()
    reqs = H.make_requests(eng_mod, model.config.vocab_size)
    engine, rec = H.run_engine(model, dtype, DEV, reqs, num_blocks=num_blocks, block_size=BLOCK, backend="kernels")
    assert engine.runner.backend == "kernels" and engine.cache.recurrent_groups
    assert all(r.finished is not None for r in reqs)
    if num_blocks == 80:
        assert rec.prefix_hits >= 3, rec.prefix_hits
    else:
        assert engine.preemptions >= 1
    assert engine.cache.stats["forks"] == 4 and engine.cache.stats["state_copies"] > 0
    atol, rtol = TOL[dtype]
    count, worst = H.compare(model, engine, rec, reqs, atol=atol, rtol=rtol)
    assert count > 200
    print(f"{dtype} {num_blocks} blocks: {count} rows, worst error {worst:.2f} of the bound")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_state_pages_round_trip_on_the_gpu(dtype):
    """load_states and store_states over CUDA pages: what a layer stores
    in a block is what it loads back, and a block copy moves every slot's
    state."""
    model = gpu_qwen3_next(dtype)
    with kvhf.PagedKVCache.for_model(kvhf.prepare_model(model), 16, BLOCK) as cache:
        blocks = torch.tensor([3, 7], device=DEV)
        r = cache.shape.recurrent
        conv = torch.randn(2, r.conv_dim, r.conv_kernel - 1, device=DEV).to(dtype)
        rec = torch.randn(2, r.num_v_heads, r.head_k_dim, r.head_v_dim, device=DEV)
        cache.store_states(0, blocks, conv, rec)
        got_conv, got_rec = cache.load_states(0, blocks)
        assert torch.equal(got_conv, conv) and torch.equal(got_rec, rec)
        cache.copy_blocks([(7, 9), (9, 11)])  # in order: 11 receives 7's state through 9
        got_conv, got_rec = cache.load_states(0, torch.tensor([11], device=DEV))
        assert torch.equal(got_conv[0], conv[1]) and torch.equal(got_rec[0], rec[1])
