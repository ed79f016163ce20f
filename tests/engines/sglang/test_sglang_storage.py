"""kvplug.sglang driven by SGLang's own storage path (see harness.py):
SGLang's StorageBackendFactory loads the backend from the dynamic-backend
config, its HiCacheController's backup thread stores pages through
batch_set_v1 and its prefetch threads find them with batch_exists and load
them with batch_get_v1 into new host pages, which must then hold the bytes
that were stored. The same flows run against SGLang's built-in file backend
(HiCacheFile) as the reference."""

from __future__ import annotations

import pytest
import torch

from harness import KVPLUG, Instance

import kvplug.sglang as ks


def tokens(seed: int, n: int):
    return [100 + (seed * 7919 + i * 31) % 30000 for i in range(n)]


@pytest.fixture
def instances():
    made = []

    def make(*a, **kw):
        inst = Instance(*a, **kw)
        made.append(inst)
        return inst

    yield make
    for inst in made:
        inst.close()


def round_trip(inst: Instance, seed: int, n: int = 24):
    t = tokens(seed, n)
    idx = inst.fill(t, seed)
    want = inst.pages(idx)
    assert inst.backup(t, idx) == n
    loaded, idx2 = inst.prefetch(t + [1, 2])
    assert loaded == n
    got = inst.pages(idx2)
    assert len(got) == len(want)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    return t


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_loaded_by_sglangs_factory_and_round_trips_local(instances, layout):
    inst = instances(extra={**KVPLUG, "kvplug_host_bytes": 1 << 20}, layout=layout)
    assert type(inst.backend).__name__ == "KvplugHiCacheStorage"
    assert inst.ctl.page_get_func.__name__ == "_page_get_zero_copy"  # interface_v1
    round_trip(inst, 1)
    c = inst.backend.counters()
    assert c["host_stored"] == 6 and c["host_hits"] == 6 and c["errors"] == 0


def test_round_trip_through_valkey(instances, valkey):
    inst = instances(extra={**KVPLUG, "kvplug_valkey": valkey})
    round_trip(inst, 2)
    c = inst.backend.counters()
    assert c["shared_stored"] == 6 and c["shared_hits"] == 6


def test_a_page_stored_by_one_instance_loads_in_another(instances, valkey):
    # Two instances of one model share a Valkey: B never computed the
    # prompt, A did; B's prefetch finds A's pages and fills its own local
    # tier on the way.
    cfg = {**KVPLUG, "kvplug_valkey": valkey, "kvplug_host_bytes": 1 << 20}
    a = instances(extra=cfg)
    b = instances(extra=cfg)
    t = tokens(3, 16)
    idx = a.fill(t, 3)
    want = a.pages(idx)
    assert a.backup(t, idx) == 16
    loaded, idx2 = b.prefetch(t)
    assert loaded == 16
    assert all(torch.equal(x, y) for x, y in zip(want, b.pages(idx2)))
    c = b.backend.counters()
    assert c["shared_hits"] == 4 and c["host_filled"] == 4
    loaded, _ = b.prefetch(t)  # now from B's local tier
    assert loaded == 16 and b.backend.counters()["host_hits"] == 4


def test_same_outcome_as_sglangs_file_backend(instances, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    ref = instances(backend="file")
    ours = instances(extra={**KVPLUG, "kvplug_host_bytes": 1 << 20})
    for inst in (ref, ours):
        t = tokens(4, 20)
        idx = inst.fill(t, 4)
        assert inst.backup(t, idx) == 20
        # A longer prompt: the stored prefix hits, the rest misses.
        assert inst.prefetch(t + tokens(5, 8))[0] == 20
        # A prompt never stored, and one that diverges after 2 pages.
        assert inst.prefetch(tokens(6, 16))[0] == 0
        assert inst.prefetch(t[:8] + tokens(7, 12))[0] == 8


def test_store_of_a_stored_page_and_keys_never_stored(instances):
    inst = instances(extra={**KVPLUG, "kvplug_host_bytes": 1 << 20})
    t = tokens(8, 12)
    idx = inst.fill(t, 8)
    assert inst.backup(t, idx) == 12
    assert inst.backup(t, idx) == 12  # again: present, no copy
    c = inst.backend.counters()
    assert c["host_stored"] == 3 and c["host_present"] == 3
    be = inst.backend
    assert be.batch_exists(["never", "stored"]) == 0 and not be.exists("never")
    assert be.batch_get_v1(["never"], inst.host.alloc(4)) == [False]


def test_valkey_down_is_a_miss_and_a_skip(instances):
    from conftest import free_port

    extra = {**KVPLUG, "kvplug_valkey": f"127.0.0.1:{free_port()}", "kvplug_op_timeout_ms": 100}
    inst = instances(extra=extra)
    t = tokens(9, 12)
    idx = inst.fill(t, 9)
    assert inst.backup(t, idx) == 0  # nothing took the pages: SGLang stops that backup
    assert inst.prefetch(t)[0] == 0
    c = inst.backend.counters()
    assert c["shared_skipped"] == 3 and c["errors"] == 0
    s = inst.backend._kv().shared.stats()
    assert s.errors + s.timeouts >= 1


def test_valkey_down_with_a_local_tier_still_serves(instances):
    from conftest import free_port

    extra = {**KVPLUG, "kvplug_valkey": f"127.0.0.1:{free_port()}", "kvplug_host_bytes": 1 << 20,
             "kvplug_op_timeout_ms": 100}
    inst = instances(extra=extra)
    round_trip(inst, 10)
    assert inst.backend.counters()["shared_skipped"] == 6


def test_local_tier_full_skips_and_lookup_after_clear_misses(instances):
    inst = instances(extra={**KVPLUG, "kvplug_host_bytes": 2 * 512})  # 2 pages of 512 bytes
    t = tokens(11, 16)  # 4 pages: the batch does not fit
    idx = inst.fill(t, 11)
    assert inst.backup(t, idx) == 0
    assert inst.backend.counters()["host_full"] == 4
    t = tokens(12, 8)
    idx = inst.fill(t, 12)
    assert inst.backup(t, idx) == 8
    assert inst.prefetch(t)[0] == 8
    assert inst.backend.clear()
    assert inst.prefetch(t)[0] == 0


def test_generic_interface_and_faults_never_raise(instances):
    inst = instances(extra={**KVPLUG, "kvplug_host_bytes": 1 << 20})
    be = inst.backend
    pages = [inst.host.get_dummy_flat_data_page().normal_() for _ in range(3)]
    assert be.batch_set(["a", "b", "c"], pages)
    out = [inst.host.get_dummy_flat_data_page() for _ in range(3)]
    got = be.batch_get(["a", "x", "c"], out)
    assert got[0] is out[0] and got[1] is None and torch.equal(out[2], pages[2])
    assert be.set("d", pages[0]) and torch.equal(be.get("d", out[1]), pages[0])
    # Bad input: a wrong-sized page, a non-tensor; a closed store.
    assert be.batch_set(["e"], [torch.zeros(3)]) is False
    assert be.batch_get(["a"], [torch.zeros(3)]) == [None]
    be._kv().host.close()
    assert be.batch_exists(["a"]) == 0 and be.batch_set_v1(["a"], inst.host.alloc(4)) == [False]
    assert be.counters()["errors"] >= 3


def test_page_store_without_sglang():
    # The logic under the backend, with plain buffers.
    import numpy as np

    from kvplug.sharedstore import key128, keys128

    ps = ks.PageStore(16, host_bytes=64)
    data = np.arange(32, dtype=np.uint8).reshape(2, 16)
    ptrs = (data.ctypes.data + np.arange(2, dtype=np.uint64) * 16).reshape(2, 1)
    lens = np.full((2, 1), 16, np.int64)
    keys = keys128([key128("5"), key128("6")])
    assert ps.put(keys, ptrs, lens).all()
    out = np.zeros_like(data)
    optrs = (out.ctypes.data + np.arange(2, dtype=np.uint64) * 16).reshape(2, 1)
    assert ps.get(keys, optrs, lens).all() and (out == data).all()
    assert ps.exists_prefix(keys128([key128("5"), key128("7"), key128("6")])) == 1
    with pytest.raises(ValueError):
        ks.PageStore(16, host_bytes=8)
    ps.close()


def test_multi_pool_v2_methods(instances):
    # A hybrid model's side pool (here a second MHA host pool standing in
    # for SGLang's SWA pool) registered through register_mem_host_pool_v2,
    # stored and found with SGLang's PoolTransfer and hit policies.
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    inst = instances(extra={**KVPLUG, "kvplug_host_bytes": 1 << 20})
    side = instances(extra={**KVPLUG, "kvplug_host_bytes": 1 << 20}).host
    be = inst.backend
    be.register_mem_host_pool_v2(side, PoolName.SWA)
    t = tokens(13, 16)
    keys = inst.hashes(t)
    idx = inst.fill(t, 13)
    assert be.batch_set_v1(keys, idx) == [True] * 4
    sidx = side.alloc(8)
    g = torch.Generator().manual_seed(5)
    for s in (0, 4):
        page = side.get_dummy_flat_data_page()
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
        side.set_from_flat_data_page(int(sidx[s]), page)
    want = [side.get_data_page(int(sidx[s]), flat=True).clone() for s in (0, 4)]
    res = be.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=sidx, keys=keys[2:4])])
    assert res == {"swa": [True, True]}
    # Trailing pages: prefixes of 3 and 4 pages have their last page's state.
    r = be.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=keys[3:4],
                                               hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert r.kv_hit_pages == 4 and r.restorable_prefix_pages == [3, 4]
    # All pages: the side pool lacks pages 0-1, so nothing is restorable.
    r = be.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert r.kv_hit_pages == 0
    out = side.alloc(8)
    got = be.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=out, keys=keys[2:4])])
    assert got == {"swa": [True, True]}
    assert all(torch.equal(side.get_data_page(int(out[s]), flat=True), w) for s, w in zip((0, 4), want))
