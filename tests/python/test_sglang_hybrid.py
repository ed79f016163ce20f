"""kvplug.sglang's HiCache backend with a hybrid model's pools, on the CPU
without SGLang: SGLang's storage types (hicache_storage's PoolName,
PoolTransfer, PoolHitPolicy, PoolTransferResult, the HiCacheStorage base)
are stood in for by a small module of the same names and fields, and the
host pools by two that describe their pages as SGLang's do through
get_page_buffer_meta: a page-first KV pool (a K and a V segment per page of
page_size tokens) and a Mamba state pool (page_size 1; a temporal and a conv
segment per state), as Qwen3-Next's HiCache registers them.

What SGLang's hybrid storage path does with a backend (its
HybridCacheController): KV pages go through batch_set_v1 / batch_get_v1,
the side pool's pages through batch_set_v2 / batch_get_v2 with a
PoolTransfer per pool (a Mamba state under the key of the page it ends), and
a prefetch asks batch_exists_v2 with the side pool's hit policy
(TRAILING_PAGES: the last len(keys) pages of a prefix must be there), then
restores at the longest of restorable_prefix_pages.

make test-engines runs the backend inside SGLang itself
(tests/engines/sglang); these tests need no engine."""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvplug.sglang as ks  # noqa: E402
from conftest import free_port  # noqa: E402


def _standin() -> types.ModuleType:
    """sglang.srt.mem_cache.hicache_storage, the names kvplug.sglang uses."""
    m = types.ModuleType("sglang.srt.mem_cache.hicache_storage")

    class PoolName(str, enum.Enum):
        KV = "kv"
        MAMBA = "mamba"
        SWA = "swa"

        def __str__(self) -> str:
            return self.value

    class PoolHitPolicy(str, enum.Enum):
        ALL_PAGES = "all_pages"
        TRAILING_PAGES = "trailing_pages"

    @dataclass
    class PoolTransfer:
        name: Any
        host_indices: Optional[Any] = None
        device_indices: Optional[Any] = None
        keys: Optional[List[str]] = None
        hit_policy: Any = PoolHitPolicy.ALL_PAGES

    @dataclass
    class PoolTransferResult:
        kv_hit_pages: int
        extra_pool_hit_pages: dict
        restorable_prefix_pages: Optional[List[int]] = None

        @classmethod
        def empty(cls):
            return cls(0, {})

    @dataclass
    class HiCacheStorageConfig:
        tp_rank: int = 0
        tp_size: int = 1
        pp_rank: int = 0
        pp_size: int = 1
        attn_cp_rank: int = 0
        attn_cp_size: int = 1
        dcp_rank: int = 0
        dcp_size: int = 1
        is_mla_model: bool = False
        model_name: Optional[str] = "tiny-qwen3-next"
        extra_config: Optional[dict] = None

    @dataclass
    class HiCacheStorageExtraInfo:
        prefix_keys: Optional[List[str]] = None
        extra_info: Optional[dict] = None

    class HiCacheStorage:
        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool, host_pool_name):
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool

    for obj in (PoolName, PoolHitPolicy, PoolTransfer, PoolTransferResult, HiCacheStorageConfig,
                HiCacheStorageExtraInfo, HiCacheStorage):
        setattr(m, obj.__name__, obj)
    return m


@pytest.fixture
def sg(monkeypatch):
    """The stand-in module, with kvplug.sglang's backend class built on it."""
    mod = _standin()
    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.delitem(vars(ks), "KvplugHiCacheStorage", raising=False)
    mod.Backend = ks.KvplugHiCacheStorage
    backends = []

    def make(**extra):
        be = mod.Backend(mod.HiCacheStorageConfig(extra_config=extra))
        backends.append(be)
        return be

    mod.make = make
    yield mod
    for be in backends:
        be.close()
    vars(ks).pop("KvplugHiCacheStorage", None)


class _Slots:
    """Host pool slots handed out in order, as SGLang's host pools do."""

    _next = 0

    def alloc(self, n: int) -> torch.Tensor:
        idx = torch.arange(self._next, self._next + n, dtype=torch.int64)
        self._next += n
        return idx


class KVPool(_Slots):
    """A page-first host KV pool: size token slots of tok_bytes each for K
    and for V; a page is page_size consecutive slots (SGLang's
    MHATokenToKVPoolHost, page_first: a K and a V segment per page)."""

    layout = "page_first"
    dtype = torch.bfloat16

    def __init__(self, size: int, page_size: int, tok_bytes: int) -> None:
        self.size, self.page_size, self.tok_bytes = size, page_size, tok_bytes
        self.buf = torch.zeros((2, size, tok_bytes), dtype=torch.uint8)

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for i in indices.tolist()[::self.page_size]:
            for kv in (0, 1):
                ptrs.append(self.buf[kv, i].data_ptr())
                sizes.append(self.page_size * self.tok_bytes)
        return ptrs, sizes

    def page(self, start: int) -> torch.Tensor:
        return self.buf[:, start:start + self.page_size].clone()


class MambaPool(_Slots):
    """A Mamba state host pool (SGLang's MambaPoolHost, page_first): slot
    s holds one request's temporal and conv states, a page of one slot."""

    layout = "page_first"
    dtype = torch.float32
    page_size = 1

    def __init__(self, size: int, temporal_bytes: int, conv_bytes: int) -> None:
        self.size = size
        self.temporal = torch.zeros((size, temporal_bytes), dtype=torch.uint8)
        self.conv = torch.zeros((size, conv_bytes), dtype=torch.uint8)

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for i in indices.tolist():
            ptrs += [self.temporal[i].data_ptr(), self.conv[i].data_ptr()]
            sizes += [self.temporal.shape[1], self.conv.shape[1]]
        return ptrs, sizes

    def state(self, slot: int) -> tuple:
        return self.temporal[slot].clone(), self.conv[slot].clone()


PAGE = 4


def hybrid(sg, **extra):
    """A backend with a KV pool (64 tokens, pages of 4 tokens x 64 bytes K
    and V: 512-byte pages) and a Mamba pool (4 states of 768 + 256 bytes)."""
    be = sg.make(**extra)
    kv, mamba = KVPool(64, PAGE, 64), MambaPool(4, 768, 256)
    be.register_mem_pool_host(kv)
    be.register_mem_host_pool_v2(kv, sg.PoolName.KV)
    be.register_mem_host_pool_v2(mamba, sg.PoolName.MAMBA)
    return be, kv, mamba


def fill(pool, idx: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    if isinstance(pool, MambaPool):
        for s in idx.tolist():
            pool.temporal[s] = torch.randint(0, 256, pool.temporal[s].shape, generator=g, dtype=torch.uint8)
            pool.conv[s] = torch.randint(0, 256, pool.conv[s].shape, generator=g, dtype=torch.uint8)
    else:
        for s in idx.tolist():
            pool.buf[:, s] = torch.randint(0, 256, pool.buf[:, s].shape, generator=g, dtype=torch.uint8)


def keys(n: int, tag: str = "p") -> List[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_sglang_hybrid_pools_share_the_local_budget(sg):
    # kvplug_host_bytes is the local tier of every pool together, split as
    # SGLang split its own host pools: the KV pool holds 16 pages of 512
    # bytes (8 KiB), the Mamba pool 4 states of 1 KiB (4 KiB), so the KV
    # pages get two thirds of 48 KiB and the states one third.
    budget = 48 << 10
    be, kv, mamba = hybrid(sg, kvplug_host_bytes=budget)
    assert be.batch_exists(keys(1)) == 0  # the first call assembles the tiers
    stores = be._stores
    used = {name: s.host.num_slots * s.host.slot_bytes for name, s in stores.items()}
    assert sum(used.values()) <= budget
    assert used["kv"] == 32 << 10 and stores["kv"].host.slot_bytes == 512
    assert used["mamba"] == 16 << 10 and stores["mamba"].host.slot_bytes == 1024


def test_sglang_hybrid_round_trip_restores_at_a_state(sg):
    # Qwen3-Next's path: a prompt of 4 pages stored by two backups, the
    # state stored where each ends (pages 2 and 4); a later prompt with the
    # prefix restores where both the KV pages and a state are.
    be, kv, mamba = hybrid(sg, kvplug_host_bytes=1 << 20)
    k = keys(4)
    idx = kv.alloc(4 * PAGE)
    fill(kv, idx, 1)
    states = mamba.alloc(2)
    fill(mamba, states, 2)
    assert be.batch_set_v1(k, idx) == [True] * 4
    set_v2 = be.batch_set_v2([sg.PoolTransfer(name=sg.PoolName.MAMBA, host_indices=states, keys=[k[1], k[3]])])
    assert set_v2 == {"mamba": [True, True]}

    trailing = [sg.PoolTransfer(name=sg.PoolName.MAMBA, keys=[k[3]], hit_policy=sg.PoolHitPolicy.TRAILING_PAGES)]
    r = be.batch_exists_v2(k + ["p4", "p5"], trailing)
    assert r.kv_hit_pages == 4 and r.restorable_prefix_pages == [2, 4]
    assert r.extra_pool_hit_pages == {"kv": 4, "mamba": 4}
    # Three KV pages and no state at page 3: the hit stops at page 2.
    r = be.batch_exists_v2(k[:3] + ["q3"], trailing)
    assert r.kv_hit_pages == 2 and r.restorable_prefix_pages == [2]

    # The restore: KV pages and the state into new host slots, bytes equal.
    idx2, slot2 = kv.alloc(4 * PAGE), mamba.alloc(1)
    assert be.batch_get_v1(k, idx2) == [True] * 4
    got = be.batch_get_v2([sg.PoolTransfer(name=sg.PoolName.MAMBA, host_indices=slot2, keys=[k[3]])])
    assert got == {"mamba": [True]}
    for a, b in zip(idx.tolist()[::PAGE], idx2.tolist()[::PAGE]):
        assert torch.equal(kv.page(a), kv.page(b))
    for a, b in zip(mamba.state(int(states[1])), mamba.state(int(slot2[0]))):
        assert torch.equal(a, b)
    c = be.counters()
    assert c["errors"] == 0 and c["bad_transfers"] == 0


def test_sglang_swa_window_of_two_pages(sg):
    # A sliding-window pool whose window spans two pages: a prefix is
    # restorable where its last two pages' window pages are there.
    be = sg.make(kvplug_host_bytes=1 << 20)
    kv, swa = KVPool(64, PAGE, 64), KVPool(64, PAGE, 32)
    be.register_mem_pool_host(kv)
    be.register_mem_host_pool_v2(swa, sg.PoolName.SWA)
    k = keys(4)
    assert be.batch_set_v1(k, kv.alloc(4 * PAGE)) == [True] * 4
    assert be.batch_set_v2([sg.PoolTransfer(name=sg.PoolName.SWA, host_indices=swa.alloc(2 * PAGE),
                                            keys=k[1:3])]) == {"swa": [True, True]}
    window = [sg.PoolTransfer(name=sg.PoolName.SWA, keys=k[2:4], hit_policy=sg.PoolHitPolicy.TRAILING_PAGES)]
    r = be.batch_exists_v2(k, window)
    assert r.kv_hit_pages == 3 and r.restorable_prefix_pages == [3]
    # ALL_PAGES (a pool every page needs): page 0 lacks it, nothing restores.
    r = be.batch_exists_v2(k, [sg.PoolTransfer(name=sg.PoolName.SWA, hit_policy=sg.PoolHitPolicy.ALL_PAGES)])
    assert r.kv_hit_pages == 0 and r.restorable_prefix_pages == []


def test_sglang_hybrid_hits_locally_while_the_server_is_down(sg):
    # With a server and a local tier, the states are kept locally as the KV
    # pages are: a server that is down does not cut a local hybrid hit.
    be, kv, mamba = hybrid(sg, kvplug_host_bytes=1 << 20, kvplug_valkey=f"127.0.0.1:{free_port()}",
                           kvplug_op_timeout_ms=100)
    k = keys(2)
    idx, state = kv.alloc(2 * PAGE), mamba.alloc(1)
    fill(kv, idx, 3)
    fill(mamba, state, 4)
    assert be.batch_set_v1(k, idx) == [True, True]
    assert be.batch_set_v2([sg.PoolTransfer(name=sg.PoolName.MAMBA, host_indices=state, keys=[k[1]])]) == {
        "mamba": [True]}
    r = be.batch_exists_v2(k, [sg.PoolTransfer(name=sg.PoolName.MAMBA, keys=[k[1]],
                                                hit_policy=sg.PoolHitPolicy.TRAILING_PAGES)])
    assert r.kv_hit_pages == 2 and r.restorable_prefix_pages == [2]
    slot = mamba.alloc(1)
    assert be.batch_get_v2([sg.PoolTransfer(name=sg.PoolName.MAMBA, host_indices=slot, keys=[k[1]])]) == {
        "mamba": [True]}
    assert all(torch.equal(a, b) for a, b in zip(mamba.state(int(state[0])), mamba.state(int(slot[0]))))
    assert be.counters()["errors"] == 0


def test_sglang_v2_transfer_not_a_page_per_key_is_refused(sg):
    # Two Mamba slots for one key would store two states' bytes under one
    # key: refused and counted, nothing stored, no exception into SGLang.
    be, kv, mamba = hybrid(sg, kvplug_host_bytes=1 << 20)
    out = be.batch_set_v2([sg.PoolTransfer(name=sg.PoolName.MAMBA, host_indices=mamba.alloc(2), keys=["p0"]),
                           sg.PoolTransfer(name=sg.PoolName.KV, host_indices=None, keys=["p0"])])
    assert out == {"mamba": [False], "kv": [False]}
    c = be.counters()
    assert c["bad_transfers"] == 2 and c["errors"] == 0
    assert not be._pool_has("mamba", ["p0"]).any()


def test_sglang_side_pool_of_an_unregistered_name_is_false(sg):
    be, kv, mamba = hybrid(sg, kvplug_host_bytes=1 << 20)
    out = be.batch_get_v2([sg.PoolTransfer(name=sg.PoolName.SWA, host_indices=torch.arange(PAGE), keys=["p0"])])
    assert out == {"swa": [False]}
    assert be.counters()["errors"] == 1
    r = be.batch_exists_v2(["p0"], [sg.PoolTransfer(name=sg.PoolName.SWA, hit_policy=sg.PoolHitPolicy.ALL_PAGES)])
    assert r.kv_hit_pages == 0 and np.array_equal(r.restorable_prefix_pages, [])


def test_sglang_side_pool_of_its_own_page_size(sg):
    # A side pool whose page is not the KV pool's (window pages of 2 token
    # slots beside KV pages of 4): as SGLang sizes a side pool's transfer
    # (its HybridCacheController and HiCacheFile), a key holds one page of
    # that pool, pool.page_size host slots. The local budget is split by
    # the pools' bytes, the round trip restores each side page's bytes, and
    # a transfer sized by the KV pool's page is refused, counted, nothing
    # stored under its keys.
    be = sg.make(kvplug_host_bytes=24 << 10)
    kv, swa = KVPool(64, PAGE, 64), KVPool(64, 2, 32)
    be.register_mem_pool_host(kv)
    be.register_mem_host_pool_v2(kv, sg.PoolName.KV)
    be.register_mem_host_pool_v2(swa, sg.PoolName.SWA)
    assert be.batch_exists(keys(1)) == 0
    s = be._stores
    # KV: 16 pages of 512 bytes (8 KiB); SWA: 32 pages of 128 bytes (4 KiB).
    assert s["kv"].host.slot_bytes == 512 and s["swa"].host.slot_bytes == 128
    assert s["kv"].host.num_slots * 512 == 16 << 10 and s["swa"].host.num_slots * 128 == 8 << 10
    k = keys(4)
    idx = kv.alloc(4 * PAGE)
    fill(kv, idx, 5)
    assert be.batch_set_v1(k, idx) == [True] * 4
    win = swa.alloc(2 * 2)  # the last two pages' window pages
    fill(swa, win, 6)
    assert be.batch_set_v2([sg.PoolTransfer(name=sg.PoolName.SWA, host_indices=win, keys=k[2:4])]) == {
        "swa": [True, True]}
    trailing = [sg.PoolTransfer(name=sg.PoolName.SWA, keys=k[2:4], hit_policy=sg.PoolHitPolicy.TRAILING_PAGES)]
    r = be.batch_exists_v2(k, trailing)
    assert r.kv_hit_pages == 4 and r.restorable_prefix_pages == [4]
    win2 = swa.alloc(2 * 2)
    assert be.batch_get_v2([sg.PoolTransfer(name=sg.PoolName.SWA, host_indices=win2, keys=k[2:4])]) == {
        "swa": [True, True]}
    for a, b in zip(win.tolist()[::2], win2.tolist()[::2]):
        assert torch.equal(swa.page(a), swa.page(b))
    # Sized by the KV pool's page (4 slots a key): refused, not half-stored.
    bad = be.batch_set_v2([sg.PoolTransfer(name=sg.PoolName.SWA, host_indices=swa.alloc(2 * PAGE), keys=["q0", "q1"])])
    assert bad == {"swa": [False, False]}
    assert not be._pool_has("swa", ["q0", "q1"]).any()
    c = be.counters()
    assert c["bad_transfers"] == 1 and c["errors"] == 0


def test_sglang_fp8_kv_pool_round_trip_at_half_the_page(sg):
    # SGLang's FP8 KV cache (--kv-cache-dtype fp8_e4m3): the host pool holds
    # e4m3 bytes, one per element, with the per-tensor scales left in the
    # layers; a page is half a bf16 page. Its pages come back bit for bit,
    # and its slots are sized to its pages: the same budget holds twice the
    # pages of a bf16 pool of the same model.
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    if e4m3 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    budget = 16 << 10
    slots = {}
    for dtype, tok_bytes in ((torch.bfloat16, 64), (e4m3, 32)):
        be = sg.make(kvplug_host_bytes=budget)
        kv = KVPool(64, PAGE, tok_bytes)
        kv.dtype = dtype
        be.register_mem_pool_host(kv)
        k = keys(3, tag=str(dtype))
        idx = kv.alloc(3 * PAGE)
        fill(kv, idx, 7)
        kv.buf[0, idx[0], :4] = 0x7F  # e4m3fn's NaN encoding: bytes, never values
        assert be.batch_set_v1(k, idx) == [True] * 3
        idx2 = kv.alloc(3 * PAGE)
        assert be.batch_get_v1(k, idx2) == [True] * 3
        for a, b in zip(idx.tolist()[::PAGE], idx2.tolist()[::PAGE]):
            assert torch.equal(kv.page(a), kv.page(b))
        store = be._stores["kv"]
        assert store.host.slot_bytes == 2 * PAGE * tok_bytes
        slots[dtype] = store.host.num_slots
    assert slots[e4m3] == 2 * slots[torch.bfloat16]


def test_sglang_batch_set_of_a_strided_page_stores_its_bytes(sg):
    """A page given as a strided view is stored from its contiguous copy,
    kept alive until the store has read it: the page read back is the view's
    bytes (a freed copy would give heap bytes, and still answer True)."""
    be = sg.make(kvplug_host_bytes=1 << 20)
    be.register_mem_pool_host(KVPool(64, PAGE, 64))  # 512-byte pages
    base = torch.randint(0, 256, (512, 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    value = base[:, 0]
    assert not value.is_contiguous()
    assert be.batch_set(["k0"], [value]) is True
    assert be.set("k1", base[:, 1]) is True
    for key, want in (("k0", value), ("k1", base[:, 1])):
        out = torch.zeros(512, dtype=torch.uint8)
        assert be.batch_get([key], [out])[0] is not None, key
        assert torch.equal(out, want), (key, out[:24].tolist(), want[:24].tolist())
