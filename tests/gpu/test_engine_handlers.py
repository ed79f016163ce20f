"""The worker-side handlers of kvplug.vllm and kvplug.sglang with plain torch
tensors laid out as each engine lays out its KV cache; no engine is needed.

vLLM: kvplug.vllm.BlockCopier and plan_rows move blocks between vLLM's
canonical KV views (one byte view [num_blocks, page] per tensor, rows of
one allocation, layer-outermost or block-outermost "packed") and host rows,
in chunks of one or two blocks, in the direction and geometry of vLLM's
GPULoadStoreSpec (group sizes, a first block inside a chunk).

SGLang: kvplug.sglang.PageStore moves pages between SGLang's host pool
layouts (page_first [2, size, layers, heads, dim] and layer_first [2,
layers, size, heads, dim], described per page as SGLang's
get_page_buffer_meta does) and kvplug's host store.

Each runs on the CPU, and on CUDA (device KV tensors, pinned host memory,
copies on a side stream) wherever the machine has an NVIDIA device; a device
torch cannot use fails the module, as does KVPLUG_REQUIRE_GPU=1 on a machine
without one (tests/gpu/gputest.py):

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_engine_handlers.py
"""

from __future__ import annotations

import numpy as np
import pytest

from gputest import cuda_usable, import_torch  # noqa: E402  (tests/gpu)

torch = import_torch()
CUDA = cuda_usable(torch)

from kvplug.sglang import PageStore, _segments  # noqa: E402
from kvplug.sharedstore import key128, keys128  # noqa: E402
from kvplug.vllm import BlockCopier, plan_rows  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def vllm_kv(device, num_blocks=16, layers=3, block_size=4, heads=2, head_size=8, packed=False):
    """vLLM's KV cache: one allocation, each layer a [num_blocks, 2,
    block_size, heads, head_size] float16 view; and the canonical byte
    views the OffloadingConnector's worker builds from it (one per layer, or
    one over all layers when packed, block-outermost)."""
    page = 2 * block_size * heads * head_size * 2
    backing = torch.randn(num_blocks * layers * page // 2, device=device).to(torch.float16).view(torch.int8)
    views = []
    if packed:
        views.append(backing.view(num_blocks, layers * page))
    else:
        for i in range(layers):
            chunk = backing[i * num_blocks * page:(i + 1) * num_blocks * page]
            views.append(chunk.view(num_blocks, page))
    return backing, views


def host_rows(views, rows, pin):
    return [torch.zeros((rows, v.shape[1]), dtype=torch.int8, pin_memory=pin) for v in views]


ENGINES = [("cpu", "torch")] + ([("cuda", "torch"), ("cuda", "kvplug")] if CUDA else [])


@pytest.mark.parametrize("device,copy", ENGINES, ids=[f"{d}-{c}" for d, c in ENGINES])
@pytest.mark.parametrize("packed", [False, True], ids=["layer-outermost", "packed"])
@pytest.mark.parametrize("bpc", [1, 2])
def test_vllm_store_then_load_into_other_blocks(device, copy, packed, bpc):
    backing, views = vllm_kv(device, packed=packed)
    slots = 8
    copier = BlockCopier.for_views(views, slots * bpc, [list(range(len(views)))], pin_memory=device == "cuda",
                                   use_library=copy == "kvplug")
    assert (copier.tier_copier is not None) == (copy == "kvplug")
    host = copier.host_tensors
    # Store GPU blocks 3..7 (logical blocks 1..5 of a request) into slots.
    gpu = [3, 4, 5, 6, 7]
    first = 1
    nchunks = -(-(len(gpu) + first % bpc) // bpc)
    slot_ids = list(range(2, 2 + nchunks))
    stored = plan_rows(gpu, [len(gpu)], [first], slot_ids, bpc)
    nbytes = copier.transfer(1, stored, store=True)
    copier.wait({1})
    assert [j for j, _, _ in copier.finished()] == [1]
    assert nbytes == len(gpu) * sum(v.shape[1] for v in views)
    want = [v[gpu].cpu().clone() for v in views]
    # Load them back into GPU blocks 10..14.
    dst = [10, 11, 12, 13, 14]
    rows = plan_rows(dst, [len(dst)], [first], slot_ids, bpc)
    copier.transfer(2, rows, store=False)
    deadline = 0
    while not copier.finished():
        deadline += 1
        if device == "cuda":
            torch.cuda.synchronize()
        assert deadline < 1000
    for v, w in zip(views, want):
        assert torch.equal(v[dst].cpu(), w)
    host_rows = torch.from_numpy(stored[0][1])
    for h, w in zip(host, want):  # the host rows hold the stored pages
        assert torch.equal(h[host_rows], w)
    # Other blocks untouched.
    before = backing.clone()
    rows = plan_rows([0], [1], [0], [-1], bpc)  # a slot the store could not pin: skipped
    copier.transfer(3, rows, store=False)
    copier.wait({3})
    assert torch.equal(backing, before)
    copier.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_two_groups_share_one_transfer(device):
    # Hybrid models: group 0 uses layers 0-1, group 1 layer 2.
    _, views = vllm_kv(device, layers=3)
    host = host_rows(views, 6, device == "cuda")
    copier = BlockCopier(views, host, [[0, 1], [2]])
    rows = plan_rows([1, 2, 5], [2, 1], [0, 0], [0, 1, 2], 1)
    copier.transfer(7, rows, store=True)
    copier.wait({7})
    copier.finished()
    assert torch.equal(host[0][0].cpu(), views[0][1].cpu()) and torch.equal(host[1][1].cpu(), views[1][2].cpu())
    assert torch.equal(host[2][2].cpu(), views[2][5].cpu())
    assert not host[2][0].any() and not host[0][2].any()  # only each group's tensors


def sglang_host_pool(layout, size=64, layers=2, heads=2, dim=8, page=4, pin=False):
    shape = (2, size, layers, heads, dim) if layout == "page_first" else (2, layers, size, heads, dim)
    buf = torch.randn(shape).to(torch.float16)
    if pin:
        buf = buf.pin_memory()
    item = 2

    def meta(indices):
        """SGLang's get_page_buffer_meta for MHA host pools (per page, its
        K and V segments: one each for page_first, one per layer for
        layer_first)."""
        base = buf.data_ptr()
        v_off = layers * size * heads * dim * item
        ptrs = []
        for i in range(0, len(indices), page):
            idx = int(indices[i])
            if layout == "page_first":
                k = base + idx * layers * heads * dim * item
                ptrs += [k, k + v_off]
                sz = layers * page * heads * dim * item
            else:
                for layer in range(layers):
                    k = base + idx * heads * dim * item + layer * size * heads * dim * item
                    ptrs += [k, k + v_off]
                sz = page * heads * dim * item
        return ptrs, [sz] * len(ptrs)

    return buf, meta


def page_of(buf, layout, idx, page=4):
    return buf[:, idx:idx + page] if layout == "page_first" else buf[:, :, idx:idx + page]


@pytest.mark.parametrize("pin", [False] + ([True] if CUDA else []))
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_sglang_pages_through_the_host_store(layout, pin):
    buf, meta = sglang_host_pool(layout, pin=pin)
    ptrs, sizes = meta(torch.arange(4))
    page_bytes = sum(sizes)
    store = PageStore(page_bytes, host_bytes=8 * page_bytes)
    keys = keys128([key128(k) for k in ("p11", "p12", "p13")])
    src = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 20, 21, 22, 23])
    ok = store.put(keys, *_segments(*meta(src), 3))
    assert ok.all()
    want = [page_of(buf, layout, i).clone() for i in (0, 8, 20)]
    dst = torch.tensor([40, 41, 42, 43, 48, 49, 50, 51, 32, 33, 34, 35])
    found = store.get(keys, *_segments(*meta(dst), 3))
    assert found.all()
    for i, w in zip((40, 48, 32), want):
        assert torch.equal(page_of(buf, layout, i), w)
    store.close()
