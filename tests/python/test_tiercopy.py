"""kvplug.TierCopier's store engine: the option, its flag at the ABI and
its refusals on the CPU; kvplug.hf's tier_copier="copy-engine"; on a GPU,
both engines' host slots byte for byte and a copy-engine HostTier on
torch's default stream."""

from __future__ import annotations

import ctypes
import pathlib
import re

import numpy as np
import pytest

import kvplug
from conftest import require
from kvplug import _capi, _lib, tiercopy
from kvplug._lib import C

torch = require("torch")
from kvplug.hf import tier_copy  # noqa: E402  (after torch)

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "kvplug.h"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_store_engine_names_and_flag():
    """store_engine maps to kvp_kv_layers.flags (the header's value); any
    other name is refused before a tensor is looked at."""
    (flag,) = re.findall(r"#define KVP_TIER_COPY_STORE_COPY_ENGINE (\d+)", HEADER.read_text())
    assert tiercopy.STORE_COPY_ENGINE == int(flag)
    assert tiercopy._store_flags("kernel") == 0 and tiercopy._store_flags("copy-engine") == int(flag)
    for bad in ("copy", "", None, 1):
        with pytest.raises(kvplug.InvalidArgumentError, match="store_engine"):
            tiercopy._store_flags(bad)
    with pytest.raises(kvplug.InvalidArgumentError, match="store_engine"):
        kvplug.TierCopier([object()], store_engine="dma")


def _create(flags: int = 0, reserved: int = 0, struct_size: int = 0) -> int:
    """kvp_tier_copier_create on a valid 2-layer layout (fake device
    addresses) over 4 host slots; the status (a copier made is destroyed)."""
    k = (ctypes.c_uint64 * 2)(0x10000, 0x20000)
    v = (ctypes.c_uint64 * 2)(0x30000, 0x40000)
    lay = _capi.KVLayersStruct()
    lay.struct_size = struct_size or ctypes.sizeof(_capi.KVLayersStruct)
    lay.num_layers, lay.num_blocks = 2, 4
    lay.k, lay.v = ctypes.cast(k, ctypes.c_void_p), ctypes.cast(v, ctypes.c_void_p)
    lay.block_bytes = lay.k_block_stride = lay.v_block_stride = 64
    lay.flags, lay.reserved = flags, reserved
    host = np.zeros((4, 256 + 64), np.uint8)
    base = host.ctypes.data + (-host.ctypes.data) % 64  # 16-byte aligned rows of 256 bytes inside it
    out = ctypes.c_void_p()
    st = C.kvp_tier_copier_create(ctypes.byref(lay), base, 256, 3, ctypes.byref(out))
    if out.value:
        C.kvp_tier_copier_destroy(out.value)
    return int(st)


def test_create_flag_refusals():
    """Unknown flags and a non-zero reserved word are INVALID_ARGUMENT
    before any device is asked; the copy-engine flag gets the good layout's
    answer (no kernels or no device on the CPU; a copier, or UNSUPPORTED
    on a driver older than 12.8, on a GPU); a 56-byte (0.3) struct has
    none."""
    S = _lib.Status
    assert _create(flags=2) == S.INVALID_ARGUMENT
    assert _create(flags=tiercopy.STORE_COPY_ENGINE | 4) == S.INVALID_ARGUMENT
    assert _create(reserved=1) == S.INVALID_ARGUMENT
    plain = _create()
    if torch.cuda.is_available():  # UNSUPPORTED: a library built without its kernels
        assert plain in (S.OK, S.UNSUPPORTED)
        assert _create(flags=tiercopy.STORE_COPY_ENGINE) in (S.OK, S.UNSUPPORTED)
    else:
        assert plain in (S.NO_DEVICE, S.UNSUPPORTED)
        assert _create(flags=tiercopy.STORE_COPY_ENGINE) in (S.NO_DEVICE, S.UNSUPPORTED)
    assert _create(flags=7, struct_size=56) == plain  # flags lie past a 56-byte struct: not read


def test_make_copier_copy_engine(monkeypatch):
    """tier_copier="copy-engine" is the library's copier with store_engine
    "copy-engine" on a CUDA cache and refused on a CPU one; "auto" keeps
    the kernel."""
    made = []

    class Fake:
        def __init__(self, k, v, *, manager, **kw):
            made.append(kw)

    class FakeCache:
        device = torch.device("cuda")
        manager = object()
        kv = torch.zeros(2, 2, 3, 4, 1, 1)
        fp8 = False
        write_through = 0  # demotions ahead of need: "auto" keeps the kernel's stores

    monkeypatch.setattr(kvplug, "TierCopier", Fake)
    tier_copy.make_copier(FakeCache(), "copy-engine")
    tier_copy.make_copier(FakeCache(), "auto")
    assert made == [{"store_engine": "copy-engine"}, {}]
    FakeCache.device = torch.device("cpu")
    with pytest.raises(kvplug.InvalidArgumentError, match="copy-engine"):
        tier_copy.make_copier(FakeCache(), "copy-engine")
    with pytest.raises(kvplug.InvalidArgumentError, match="copy-engine"):
        tier_copy.make_copier(FakeCache(), "dma")


def _caches(layers=3, blocks=40, block=(16, 2, 64)):
    g = torch.Generator(device="cuda").manual_seed(7)
    mk = lambda: torch.randint(-128, 127, (blocks, *block), dtype=torch.int8, device="cuda", generator=g).view(torch.bfloat16)
    return [mk() for _ in range(layers)], [mk() for _ in range(layers)]


@cuda
def test_engines_store_the_same_bytes():
    """Both store engines fill the slots with the blocks' K and V at the
    layout's offsets, byte for byte; the copy engines refuse torch's
    default stream and take a created one."""
    k, v = _caches()
    nbytes = k[0][0].numel() * 2
    slot = len(k) * 2 * nbytes
    blocks = np.array([5, 0, 39, 17, 8], np.int32)
    slots = np.array([4, 0, 2, 1, 3], np.int32)
    hosts = {}
    for engine in ("kernel", "copy-engine"):
        host = np.zeros((5, slot), np.uint8)
        with kvplug.TierCopier(k, v, host=host, store_engine=engine) as cp:
            s = torch.cuda.Stream()
            if engine == "copy-engine":
                with pytest.raises(kvplug.InvalidArgumentError, match="legacy default stream"):
                    cp.run(demote=(blocks, slots), stream=torch.cuda.default_stream())
            cp.run(demote=(blocks, slots), stream=s)
            s.synchronize()
        hosts[engine] = host
    for b, sl in zip(blocks, slots):
        for layer in range(len(k)):
            for t, cache in enumerate((k, v)):
                want = cache[layer][b].contiguous().view(torch.uint8).cpu().numpy().ravel()
                off = (layer * 2 + t) * nbytes
                assert np.array_equal(hosts["kernel"][sl, off:off + nbytes], want)
    assert np.array_equal(hosts["kernel"], hosts["copy-engine"])


@cuda
def test_host_tier_copy_engine_on_the_default_stream():
    """A HostTier whose copier stores by the copy engines, stepping on
    torch's default stream without overlap, runs the stores on its side
    stream and orders the step's stream after them: write-through stores
    land byte for byte."""
    k, v = _caches(blocks=64)
    nbytes = k[0][0].numel() * 2
    slot = len(k) * 2 * nbytes
    with kvplug.Manager(64, 4, prefix_cache=True, host_tier_slots=64, host_block_bytes=slot, demote_ahead=0,
                        write_through=32) as m:
        cp = kvplug.TierCopier(k, v, manager=m, store_engine="copy-engine")
        tier = tier_copy.HostTier(m, k[0], cp, slot, overlap=False)
        ids = np.arange(4, dtype=np.int64)
        m.admit(ids, [list(range(1 + 100 * i, 1 + 100 * i + 17)) for i in range(4)])
        m.mark_computed()
        with torch.cuda.stream(torch.cuda.default_stream()):
            batch = tier.step()
        assert batch is not None and len(batch.demote_blocks) == 16
        tier.drain()
        host = m.host_tier_memory()
        for b, sl in zip(batch.demote_blocks, batch.demote_slots):
            for layer in range(len(k)):
                for t, cache in enumerate((k, v)):
                    want = cache[layer][b].contiguous().view(torch.uint8).cpu().numpy().ravel()
                    off = (layer * 2 + t) * nbytes
                    assert np.array_equal(host[sl, off:off + nbytes], want)
        tier.close()
        m.remove(ids)
