"""kvplug.hf's host KV tier on the GPU: multi-turn conversations whose
histories are demoted to pinned host memory and reloaded (torch copies on
the step's stream, completed on a polled CUDA event), on kvplug's kernels
with decode steps replayed from CUDA graphs; every logit row against
transformers, the greedy outputs against a pool that holds everything. The
harness is tests/python/test_hf_tier.py's.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_hf_tier.py

Skips only on a machine with no NVIDIA device, and fails under
KVPLUG_REQUIRE_GPU=1 (tests/gpu/gputest.py).
"""

import pathlib
import sys

import numpy as np
import pytest
from gputest import cpu_test_module, cuda_torch  # noqa: E402  (tests/gpu: skips only where there is no NVIDIA device)

torch = cuda_torch()

import kvplug  # noqa: E402
import kvplug.hf as kvhf  # noqa: E402
from kvplug.hf import tier_copy  # noqa: E402

_here = pathlib.Path(__file__).resolve().parents[1] / "python"
sys.path.insert(0, str(_here))
import test_hf_correctness as H  # noqa: E402  (tests/python: the tiny models and the engine)

T = cpu_test_module("test_hf_tier")  # tests/python/test_hf_tier.py (this module has its name)
DEV = "cuda"
TOL = {torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 5e-2)}
SHAPE = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
             initializer_range=0.08)


@pytest.mark.parametrize("graphs,overlap", [(False, False), (True, False), (True, True)],
                         ids=["eager", "graphs", "graphs-overlap"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_conversations_on_kernels_with_the_host_tier(dtype, graphs, overlap):
    """overlap: demotions on a side stream."""
    model = H.tiny_model("llama", dtype=dtype, device=DEV, **SHAPE)
    engine, rec, reqs, outs, s, _ = T.run_conversations(model, num_blocks=24, host_slots=64, demote_ahead=6,
                                                        backend="kernels", cuda_graphs=graphs, tier_overlap=overlap)
    assert s["pinned"] and s["copier"] in ("TorchTierCopier", "TierCopier"), s
    assert s["reloads_completed"] > 0 and s["host_hit_tokens"] >= 3 * T.BS and s["in_flight"] == 0, s
    assert s["load_gbps"] > 0 and s["reload_seconds"] > 0
    atol, rtol = TOL[dtype]
    count, _ = H.compare(model, engine, rec, reqs, atol=atol, rtol=rtol)
    assert count > 100
    if dtype == torch.float16:
        # Greedy tokens equal a run whose pool holds everything. Not in bf16:
        # the small pool recomputes some prefixes (evicted without demotion)
        # in other chunks than the big pool computed them, and bf16's
        # rounding of those K/V flips near-tied argmaxes of the random model
        # (every row's logits still match transformers above).
        big = T.run_conversations(model, num_blocks=256, backend="kernels", cuda_graphs=graphs)
        assert outs == big[3]


@pytest.mark.parametrize("copier", ["auto", "torch"])
def test_fp8_conversations_with_the_host_tier(copier):
    """An FP8 cache on the kernels with the host tier: histories leave the
    GPU and come back with their scales (the library's copier or the torch
    one), and every row's logits equal the same FP8 run's with a pool that
    holds everything, to the kernels' rounding (the reloaded bytes and
    scales are the demoted ones; prefixes recomputed in other chunks are
    quantised from the same K/V)."""
    fp8 = torch.float8_e4m3fn
    model = H.tiny_model("llama", dtype=torch.float16, device=DEV, **SHAPE)
    engine, rec, reqs, outs, s, _ = T.run_conversations(model, num_blocks=24, host_slots=64, demote_ahead=6,
                                                        backend="kernels", kv_dtype=fp8, tier_copier=copier)
    assert s["copier"] == ("TierCopier" if copier == "auto" else "TorchTierCopier"), s
    assert s["reloads_completed"] > 0 and s["host_hit_tokens"] >= 3 * T.BS and s["in_flight"] == 0, s
    big = T.run_conversations(model, num_blocks=256, backend="kernels", kv_dtype=fp8)
    assert outs == big[3]


@pytest.mark.parametrize("copier", ["auto", "copy-engine", "torch"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_write_through_on_kernels_keeps_gpu_hits(graphs, copier):
    """Write-through on the kernels in fp16, its stores on a side stream by
    each copier (the library's copy kernel, the copy engines, torch): the
    host tier serves the histories the GPU evicted, every logit row is
    transformers', the greedy outputs equal a pool that holds everything,
    and the GPU prefix cache hits at least what it hits with no tier (the
    blocks are copied out, never moved)."""
    model = H.tiny_model("llama", dtype=torch.float16, device=DEV, **SHAPE)
    engine, rec, reqs, outs, s, lines = T.run_conversations(model, num_blocks=24, host_slots=64, write_through=8,
                                                            backend="kernels", cuda_graphs=graphs,
                                                            tier_copier=copier)
    assert s["copier"] == ("TorchTierCopier" if copier == "torch" else "TierCopier"), s
    assert s["write_through_stored"] > 0 and s["demotions_queued"] == 0, s
    assert s["reloads_completed"] == s["reloads"] > 0 and s["in_flight"] == 0, s
    assert s["host_hit_tokens"] >= 3 * T.BS, s
    atol, rtol = TOL[torch.float16]
    count, _ = H.compare(model, engine, rec, reqs, atol=atol, rtol=rtol)
    assert count > 100
    big = T.run_conversations(model, num_blocks=256, backend="kernels", cuda_graphs=graphs)
    assert outs == big[3]
    _, _, _, _, none, plain_lines = T.run_conversations(model, num_blocks=24, backend="kernels", cuda_graphs=graphs)
    assert none is None
    assert s["cached_tokens"] - s["host_hit_tokens"] >= T.matched_tokens(plain_lines), (s, plain_lines)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_early_loads_on_a_side_stream(graphs):
    """Early loads (the default) against --no-early-loads on the kernels in
    fp16: the same greedy outputs, every logit row transformers'; the loads
    of prompts deferred to the next step ran on a stream other than the
    step's (the legacy default stream, 0), beside a forward pass, and the
    loads with early loads off on the step's own."""
    model = H.tiny_model("llama", dtype=torch.float16, device=DEV, **SHAPE)
    main = torch.cuda.current_stream().cuda_stream
    kw = dict(num_blocks=24, host_slots=64, demote_ahead=6, backend="kernels", cuda_graphs=graphs)
    engine, rec, reqs, outs, s, _ = T.run_conversations(model, **kw)
    _, _, off_reqs, off_outs, off_s, _ = T.run_conversations(model, early_loads=False, **kw)
    loads = [x for r in reqs for x in r.loads]
    deferred = [x for x in loads if x.deferred]
    assert deferred and any(x.overlapped for x in deferred), loads
    assert all(x.stream not in (0, main) for x in deferred if x.overlapped), loads
    assert all(x.seconds is not None and x.seconds > 0 and x.bytes > 0 for x in loads), loads
    off = [x for r in off_reqs for x in r.loads]
    assert off and all(x.stream == main and not x.deferred and not x.overlapped for x in off), off
    assert s["reloads_completed"] == s["reloads"] > 0 and s["in_flight"] == 0 and s["load_gbps"] > 0, s
    assert s["reload_bytes"] == off_s["reload_bytes"]
    atol, rtol = TOL[torch.float16]
    count, _ = H.compare(model, engine, rec, reqs, atol=atol, rtol=rtol)
    assert count > 100
    assert outs == off_outs


def test_early_loads_run_beside_the_step():
    """A deferred prompt's loads run while the step's stream is busy (a
    50M-cycle sleep standing in for its forward pass): they land before the
    step's stream is done, and the next step's stream waits for them on the
    device, not the host."""
    shape = kvhf.ModelShape(4, 8, 2, 64)
    bs = 16
    with kvhf.PagedKVCache(shape, 64, bs, dtype=torch.float16, device=DEV, host_tier_slots=32, demote_ahead=64,
                           demote_evicted=False) as cache:
        tier = cache.tier
        cache.kv.copy_(torch.randn(cache.kv.shape, device=DEV))
        hist = list(range(1, 4 * bs + 2))  # four full blocks and a token
        cache.manager.admit([9], [hist])
        tier.step()  # the admission's step: its blocks are not demoted before their K/V exists
        tier.drain()
        blocks = cache.manager.describe([9]).block_table[0, :4].tolist()
        want = cache.kv[:, :, blocks].clone()
        cache.manager.mark_computed()
        cache.manager.remove([9])
        tier.step()  # demote_ahead covers the pool: the four blocks go to the host tier
        tier.drain()
        assert cache.manager.match_tiers([hist])[0] == (0, 4 * bs)
        cache.add(0, [7, 8, 9])
        cache.commit(cache.schedule([(0, 3)]))  # a running sequence (its K/V does not matter here)
        cache.append(0, 10)
        cache.add(1, hist[:-1] + [3])
        torch.cuda.synchronize()
        batch = cache.schedule([(0, 1), (1, 64)])
        assert batch.deferred == [1] and len(tier.fresh) == 1
        load = tier.fresh[0]
        assert load.record.stream not in (0, torch.cuda.current_stream().cuda_stream) and load.record.overlapped
        torch.cuda._sleep(50_000_000)  # the step's forward pass
        step_done = torch.cuda.Event()
        step_done.record()
        load.event.synchronize()
        assert not step_done.query(), "the loads waited for the step"
        torch.cuda.synchronize()
        table = cache.manager.describe([1]).block_table[0, :4].tolist()
        assert torch.equal(cache.kv[:, :, table], want)
        # The next step's stream waits for them on the device: no host wait in join_loads.
        cache.schedule([(1, 64)])
        assert len(tier.to_join) == 1
        tier.step(torch.cuda.current_stream())
        assert not tier.to_join and load.record.hidden is True
        cache.remove([0, 1])


def test_copies_complete_on_their_event():
    """A step's batch stays in flight until its event has completed; poll
    completes it without waiting, and the bytes round-trip through the
    pinned host slots."""
    shape = kvhf.ModelShape(4, 8, 2, 64)
    with kvhf.PagedKVCache(shape, 64, 16, dtype=torch.float16, device=DEV, host_tier_slots=32, demote_ahead=64,
                           tier_copier="torch", demote_evicted=False) as cache:
        tier = cache.tier
        assert tier.copier.pinned and tier.copier.host.is_pinned()
        cache.kv.copy_(torch.randn(cache.kv.shape, device=DEV))
        toks = np.arange(1, 16 * 5 + 2, dtype=np.int32)  # five full blocks
        cache.manager.admit([1], [toks])
        # The admission's step: a flush never demotes blocks allocated since
        # the previous one (their K/V is written by this step's forward).
        tier.step(torch.cuda.current_stream())
        tier.drain()
        blocks = cache.manager.describe([1]).block_table[0, :5].tolist()
        want = cache.kv[:, :, blocks].clone()
        cache.manager.mark_computed()  # the step's forward pass ran
        cache.manager.remove([1])
        torch.cuda._sleep(50_000_000)  # keeps the stream busy: the copies cannot have finished at once
        b = tier.step(torch.cuda.current_stream())
        assert len(b.demote_blocks) == 5 and len(tier.in_flight) == 1
        assert cache.manager.match_tiers([toks])[0].host_tokens == 0  # not committed yet
        torch.cuda.synchronize()
        assert tier.poll() == 1 and not tier.in_flight
        assert cache.manager.match_tiers([toks])[0].host_tokens == 80
        cache.kv.zero_()
        got = cache.manager.admit([2], [toks])
        assert got.tolist() == [80]
        b = tier.step()
        assert len(b.reload_blocks) == 5
        tier.drain()
        table = cache.manager.describe([2]).block_table[0, :5].tolist()
        assert torch.equal(cache.kv[:, :, table], want)
        assert tier.reload_bytes == 5 * cache.block_bytes and tier.reload_seconds > 0
        cache.manager.remove([2])


def test_load_bandwidth_against_a_pinned_copy():
    """Reloads of 64 blocks of a Llama-3-8B-shaped layout (2 MiB each) go at
    a fair share of a plain pinned host-to-device copy of the same bytes."""
    shape = kvhf.ModelShape(32, 32, 8, 128)
    with kvhf.PagedKVCache(shape, 160, 16, dtype=torch.bfloat16, device=DEV, host_tier_slots=160, demote_ahead=160,
                           tier_copier="torch") as cache:
        cp = cache.tier.copier
        n = 64
        slots = np.random.default_rng(0).permutation(160)[:n].astype(np.int32)  # scattered: many short runs
        blocks = np.arange(n, dtype=np.int32)
        none = np.empty(0, np.int32)
        batch = kvplug.CopyBatch(1, none, none, slots, blocks)
        cp.run(batch, torch.cuda.current_stream())
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            cp.run(batch, torch.cuda.current_stream())
        e1.record()
        e1.synchronize()
        gbps = 5 * n * cache.block_bytes / (e0.elapsed_time(e1) * 1e-3) / 1e9
        h = torch.empty(n * cache.block_bytes, dtype=torch.uint8, pin_memory=True)
        d = torch.empty_like(h, device=DEV)
        d.copy_(h, non_blocking=True)
        e0.record()
        for _ in range(5):
            d.copy_(h, non_blocking=True)
        e1.record()
        e1.synchronize()
        ceiling = 5 * h.numel() / (e0.elapsed_time(e1) * 1e-3) / 1e9
        print(f"reloads {gbps:.1f} GB/s, pinned copy {ceiling:.1f} GB/s ({gbps / ceiling:.0%})")
        assert gbps > 0.5 * ceiling


def test_host_readback_matches_tolist():
    """kvplug.hf.HostReadback (the runner's to_host: a kernel writes the ids
    into pinned memory, no device-to-host copy) returns what tolist does:
    int64 and int32, 1-D and 2-D, past its capacity (it grows), with a
    store-sized copy in flight on a side stream; a float tensor falls back
    to tolist."""
    rb = kvhf.HostReadback(DEV, capacity=4)
    assert rb.aliased and rb.device.index is not None, (rb.aliased, rb.device)
    side = torch.cuda.Stream()
    big = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    pinned = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    gen = torch.Generator(device=DEV).manual_seed(3)
    for shape, dtype in [((3,), torch.int64), ((4,), torch.int32), ((9,), torch.int64), ((5, 3), torch.int64),
                         ((1,), torch.int64)]:
        t = torch.randint(0, 1 << 30, shape, generator=gen, device=DEV, dtype=dtype)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pinned.copy_(big, non_blocking=True)
        assert rb.tolist(t) == t.tolist(), (shape, dtype)
    assert rb.host.numel() >= 15
    f = torch.rand(3, device=DEV)
    assert rb.tolist(f) == f.tolist()
    flags = torch.tensor([True, False], device=DEV)  # bools stay bools (tolist)
    assert rb.tolist(flags) == [True, False] and isinstance(rb.tolist(flags)[0], bool)
    torch.cuda.synchronize()


def test_host_readback_asks_the_driver():
    """HostReadback writes only through addresses the driver says the device
    maps: pinned memory at its own address, pageable memory not at all."""
    from kvplug.hf import readback

    torch.cuda.init()
    pinned = torch.empty(16, dtype=torch.int64, pin_memory=True)
    pageable = torch.empty(16, dtype=torch.int64)
    with torch.cuda.device(DEV):
        assert readback._device_address(pinned.data_ptr()) == pinned.data_ptr()
        assert readback._device_address(pageable.data_ptr()) == 0
