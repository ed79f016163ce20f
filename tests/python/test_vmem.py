"""The virtual-contiguous KV cache through the Python package.

test_host_*: the host backend (numpy over mapped memory); runs anywhere the
library loads. test_cuda_*: the CUDA backend on a GPU: torch writes K and V
into the virtual tensors and unmodified torch SDPA over them matches a
float64 reference; skipped without torch or a GPU.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python python3 -m pytest -q tests/gpu/test_vmem_torch.py
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

import kvplug
from kvplug.vmem import VirtualKVCache

# ---------------------------------------------------------------------------
# host backend
# ---------------------------------------------------------------------------

PAGE = mmap.PAGESIZE


def host_cache(**kw) -> VirtualKVCache:
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", max_batch=4, max_context=300,
                budget_bytes=64 << 20, backend="host", background=False)
    args.update(kw)
    return VirtualKVCache(**args)


def test_host_layout_and_strides():
    with host_cache() as vc:
        tok = 2 * 8  # elements per token
        slot_elems = -(-300 * tok * 4 // PAGE) * PAGE // 4  # padded to whole pages
        assert vc.strides == (slot_elems, tok, 8, 1)
        k = vc.k(0)
        assert k.shape == (4, 300, 2, 8) and k.dtype == np.float32
        assert k.strides == tuple(4 * s for s in vc.strides)
        ptrs = {p for layer in range(2) for p in vc.layer_ptrs(layer)}
        assert len(ptrs) == 4
        assert vc.stats()["tensor_bytes"] == 4 * slot_elems * 4


def test_host_write_read_and_no_aliasing():
    rng = np.random.default_rng(1)
    with host_cache() as vc:
        slots = [vc.alloc() for _ in range(3)]
        ctx = [100, 64, 250]
        vc.step(np.array(slots, np.int32), np.array(ctx, np.int32))
        data = {}
        for layer in range(2):
            for which, t in enumerate((vc.k(layer), vc.v(layer))):
                for s, n in zip(slots, ctx):
                    x = rng.standard_normal((n, 2, 8)).astype(np.float32)
                    t[s, :n] = x
                    data[layer, which, s] = x
        # Growing maps more pages; what was written stays.
        vc.step(slots, [300, 65, 251])
        for (layer, which, s), x in data.items():
            t = vc.k(layer) if which == 0 else vc.v(layer)
            np.testing.assert_array_equal(t[s, : len(x)], x)
        st = vc.stats()
        assert st["active_slots"] == 3 and st["steps"] == 2
        assert st["mapped_bytes"] % (4 * PAGE) == 0 and st["map_calls"] == st["mapped_bytes"] // PAGE


def test_host_out_of_memory_changes_nothing():
    unit = 4 * PAGE  # one page in each of the 4 tensors
    tpp = PAGE // 64  # tokens per page (64-byte tokens)
    with host_cache(budget_bytes=3 * unit) as vc:
        a, b = vc.alloc(), vc.alloc()
        vc.step([a], [tpp])
        before = vc.stats()
        with pytest.raises(kvplug.OutOfMemoryError):
            vc.step([a, b], [2 * tpp, 2 * tpp])
        after = vc.stats()
        assert {k: after[k] for k in ("mapped_bytes", "map_calls", "held_bytes")} == {
            k: before[k] for k in ("mapped_bytes", "map_calls", "held_bytes")
        }
        assert after["out_of_memory"] == 1
        vc.step([a, b], [2 * tpp, tpp])


def test_host_slot_reuse_and_errors():
    with host_cache() as vc:
        a, b = vc.alloc(), vc.alloc()
        vc.step([a, b], [10, 200])
        vc.free(a)
        vc.free(b)
        assert vc.alloc() == b  # the freed slot with the most pages
        calls = vc.stats()["map_calls"]
        vc.step([b], [200])
        assert vc.stats()["map_calls"] == calls
        with pytest.raises(kvplug.NotFoundError):
            vc.free(a)
        with pytest.raises(kvplug.InvalidArgumentError):
            vc.free(99)
        with pytest.raises(kvplug.InvalidArgumentError):
            vc.step([b, b], [1, 1])
        with pytest.raises(kvplug.InvalidArgumentError):
            vc.step([b], [301])
        with pytest.raises(kvplug.NotFoundError):
            vc.step([a], [1])
        with pytest.raises(ValueError):
            vc.step([b], [1, 2])
        with pytest.raises(kvplug.InvalidArgumentError):
            vc.layer_ptrs(2)
        vc.step([], [])
        vc.trim()
    with pytest.raises(kvplug.InvalidHandleError):
        vc.alloc()
    with pytest.raises(kvplug.InvalidArgumentError):
        VirtualKVCache(0, 2, 8, "float32", 4, 300, 1 << 20, backend="host")
    with pytest.raises(TypeError):
        host_cache(dtype="complex64")


# ---------------------------------------------------------------------------
# CUDA backend
# ---------------------------------------------------------------------------

try:
    import torch
except ImportError:
    torch = None
needs_gpu = pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs torch and a CUDA GPU")


def rel_err(out, ref) -> float:
    out = out.double().cpu()
    return float((out - ref).norm() / ref.norm())


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [("float16", 3e-3), ("bfloat16", 2e-2)])
def test_cuda_sdpa_over_virtual_tensors(dtype, tol):
    import torch.nn.functional as F

    tdt = getattr(torch, dtype)
    layers, hkv, hq, d = 2, 4, 8, 128  # GQA: 2 query heads per KV head
    gen = torch.Generator().manual_seed(7)
    with VirtualKVCache(layers, hkv, d, dtype, max_batch=4, max_context=8192, budget_bytes=1 << 30,
                        backend="cuda", device=0) as vc:
        # The tensors exist before anything is mapped.
        ks = [vc.k(i) for i in range(layers)]
        vs = [vc.v(i) for i in range(layers)]
        assert ks[0].is_cuda and ks[0].dtype == tdt and ks[0].shape == (4, 8192, hkv, d)
        assert ks[0].stride() == vc.strides and ks[0].data_ptr() == vc.layer_ptrs(0)[0]
        page_tokens = vc.stats()["page_size"] // (hkv * d * 2)
        slots = [vc.alloc() for _ in range(3)]
        ctx = [page_tokens - 7, page_tokens + 1, 2 * page_tokens + 100]  # around page boundaries
        vc.step(slots, ctx)
        host = {}
        for layer in range(layers):
            for which, t in ((0, ks[layer]), (1, vs[layer])):
                for s, n in zip(slots, ctx):
                    x = torch.randn(n, hkv, d, generator=gen).to(tdt)
                    t[s, :n].copy_(x.cuda())
                    host[layer, which, s] = x
        torch.cuda.synchronize()
        # Every slot reads back its own data: no aliasing between slots.
        for (layer, which, s), x in host.items():
            t = ks[layer] if which == 0 else vs[layer]
            assert torch.equal(t[s, : len(x)].cpu(), x), (layer, which, s)

        # Unmodified SDPA over the virtual tensors (strided views, no copies
        # by the caller), against float64 on the CPU from the host copies.
        for layer in range(layers):
            for s, n in zip(slots, ctx):
                q = torch.randn(1, hq, 4, d, generator=gen).to(tdt)
                kv = ks[layer][s, :n].unsqueeze(0).transpose(1, 2)  # [1, hkv, n, d]
                vv = vs[layer][s, :n].unsqueeze(0).transpose(1, 2)
                out = F.scaled_dot_product_attention(q.cuda(), kv, vv, enable_gqa=True)
                kr = host[layer, 0, s].double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
                vr = host[layer, 1, s].double().transpose(0, 1).repeat_interleave(hq // hkv, 0)
                att = torch.softmax(q[0].double() @ kr.transpose(1, 2) / d**0.5, -1)
                ref = (att @ vr).unsqueeze(0)
                assert torch.isfinite(out).all()
                assert rel_err(out, ref) < tol, (layer, s, rel_err(out, ref))

        # Growing across a page boundary keeps the data and maps the rest.
        grow = [n + page_tokens for n in ctx]
        vc.step(slots, grow)
        for layer in range(layers):
            for s, n, m in zip(slots, ctx, grow):
                ks[layer][s, n:m].fill_(1.5)
        torch.cuda.synchronize()
        for (layer, which, s), x in host.items():
            t = ks[layer] if which == 0 else vs[layer]
            assert torch.equal(t[s, : len(x)].cpu(), x)
        for layer in range(layers):
            for s, n, m in zip(slots, ctx, grow):
                assert bool((ks[layer][s, n:m] == 1.5).all())
        st = vc.stats()
        assert st["mapped_bytes"] >= sum(-(-m // page_tokens) for m in grow) * 2 * layers * st["page_size"]
        assert st["background_errors"] == 0


@needs_gpu
def test_cuda_slot_reuse_and_trim():
    with VirtualKVCache(4, 8, 128, "bfloat16", max_batch=8, max_context=8192, budget_bytes=2 << 30,
                        backend="cuda") as vc:
        a = vc.alloc()
        vc.step([a], [5000])
        vc.k(3)[a, :5000].fill_(2.0)
        vc.free(a)
        b = vc.alloc()
        assert b == a
        calls = vc.stats()["map_calls"]
        vc.step([b], [5000])
        assert vc.stats()["map_calls"] == calls
        assert bool((vc.k(3)[b, :5000] == 2.0).all())  # the same physical pages
        vc.free(b)
        vc.trim()
        st = vc.stats()
        assert st["held_bytes"] == 0 and st["mapped_bytes"] == 0


# ---------------------------------------------------------------------------
# long contexts, and caches dropped without close()
# ---------------------------------------------------------------------------

import gc  # noqa: E402
import os  # noqa: E402
import warnings  # noqa: E402

from kvplug import _lib  # noqa: E402


def _kernel_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _page_files() -> int:
    """Open host-backend page files (one per live host cache)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "kvplug-vmem" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def test_host_long_context_maps_in_ranges():
    # 40000 tokens of 4 KiB: 40000 pages in each of K and V, more than the
    # kernel's default cap on a process's mappings if each were its own.
    before = _kernel_mappings()
    with VirtualKVCache(1, 8, 256, "float16", 1, 40000, 1 << 30, backend="host") as vc:
        s = vc.alloc()
        vc.step([s], [40000])
        assert vc.stats()["mapped_bytes"] == 2 * 40000 * 8 * 256 * 2
        assert _kernel_mappings() - before < 16
        k = vc.k(0)
        k[s, 39999] = 1.5
        k[s, 0] = -2.0
        assert k[s, 39999, 7, 255] == 1.5 and k[s, 0, 0, 0] == -2.0
        del k


def _dropped_cache(step: bool) -> None:
    vc = VirtualKVCache(1, 8, 256, "float16", 1, 40000, 1 << 30, backend="host")
    s = vc.alloc()
    if step:
        vc.step([s], [40000])


def test_dropped_caches_are_closed_and_say_so():
    gc.collect()
    handles, files = _lib.live_handles(), _page_files()
    with pytest.warns(ResourceWarning, match="1 slot still allocated") as record:
        for _ in range(10):
            _dropped_cache(step=True)
    gc.collect()
    assert len([w for w in record if issubclass(w.category, ResourceWarning)]) == 10
    assert _lib.live_handles() == handles
    assert _page_files() == files


def test_dropped_cache_logs_on_the_kvplug_logger(caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        with caplog.at_level("WARNING", logger="kvplug"):
            _dropped_cache(step=False)
            gc.collect()
    assert any("collected with 1 slot still" in r.getMessage() for r in caplog.records if r.name == "kvplug")


def test_close_is_explicit_and_silent():
    handles = _lib.live_handles()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        vc = host_cache()
        vc.alloc()
        assert _lib.live_handles() == handles + 1
        vc.close()
        vc.close()
        del vc
        gc.collect()
    assert _lib.live_handles() == handles


def test_a_view_keeps_its_cache_open():
    gc.collect()
    handles = _lib.live_handles()
    vc = host_cache()
    s = vc.alloc()
    vc.step([s], [100])
    k = vc.k(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del vc
        gc.collect()
        assert _lib.live_handles() == handles + 1  # the array's memory stays mapped
        k[s, :100] = 3.0
        assert float(k[s, :100].sum()) == 3.0 * 100 * 2 * 8
        del k
        gc.collect()
    assert _lib.live_handles() == handles


def test_manager_destroy_leaves_a_cache_alone():
    # kvp_manager_destroy given a kvp_vcache * must not touch it.
    with host_cache() as vc:
        handles = _lib.live_handles()
        _lib.fn("kvp_manager_destroy", None, [ctypes.c_void_p])(vc.handle)
        assert _lib.live_handles() == handles
        s = vc.alloc()
        vc.step([s], [10])
        vc.k(0)[s, :10] = 1.0
