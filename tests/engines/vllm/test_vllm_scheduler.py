"""kvplug.vllm driven by vLLM's own scheduler-side classes (see harness.py):
the OffloadingConnector loads kvplug's spec from spec_name and
spec_module_path, offloads the blocks of finished requests into kvplug's
host store, and when a returning prompt's blocks are gone from the GPU
prefix cache, loads them back through kvplug's worker into other GPU
blocks; the fake forward pass checks every context token's K and V."""

from __future__ import annotations

import pytest

import kvplug.vllm as kv
from harness import Engine, evict_gpu, prompt, write_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def test_spec_loads_through_vllms_factory(model_dir):
    e = Engine(model_dir)
    assert type(e.manager).__name__ == "KvplugOffloadingManager"
    assert isinstance(e.manager, kv.KvplugOffloadingManager)
    assert isinstance(e.spec_worker, kv.KvplugOffloadingWorker)
    assert e.manager.num_slots == 32


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_offloaded_prefix_reloads_after_gpu_eviction(model_dir, async_scheduling):
    e = Engine(model_dir, num_gpu_blocks=12, async_scheduling=async_scheduling)
    a = prompt(1, 22)  # 5 full blocks of 4 tokens
    e.add(a, max_tokens=2)
    e.run()
    c = e.manager.counters()
    assert c["stores_completed"] >= 5, c
    evict_gpu(e, [2, 3, 4], 30)
    # The conversation returns: its prefix is no longer in the GPU prefix
    # cache, so the connector looks it up in kvplug's store and loads it.
    before = e.manager.counters()
    rid = e.add(a + [7, 8, 9, 10, 11], max_tokens=2)
    checked = e.checked_tokens
    e.run()
    after = e.manager.counters()
    assert after["lookup_hits"] > before["lookup_hits"]
    assert after["loads_prepared"] - before["loads_prepared"] >= 4
    assert after["load_misses"] == 0 and after["errors"] == 0
    assert rid in e.finished
    # The fake forward pass checked the loaded context tokens' K and V.
    assert e.checked_tokens - checked >= 16
    s = e.manager.store_stats()
    assert s.pinned == 0 and s.pending == 0


def test_blocks_per_chunk_two(model_dir):
    e = Engine(model_dir, num_gpu_blocks=12, blocks_per_chunk=2, host_blocks=16)
    a = prompt(5, 26)
    e.add(a, max_tokens=1)
    e.run()
    evict_gpu(e, [6, 7, 8], 30)
    before = e.manager.counters()
    e.add(a + [1, 2, 3], max_tokens=1)
    e.run()
    after = e.manager.counters()
    assert after["loads_prepared"] - before["loads_prepared"] >= 2  # chunks of 2 blocks
    assert after["errors"] == 0


def test_events_carry_the_cpu_medium(model_dir):
    e = Engine(model_dir, num_gpu_blocks=8, host_blocks=4)
    e.add(prompt(11, 18), max_tokens=1)
    e.run()
    e.add(prompt(12, 18), max_tokens=1)
    e.run()
    cpu = [ev for ev in e.events if getattr(ev, "medium", None) == "CPU"]
    stored = [ev for ev in cpu if type(ev).__name__ == "BlockStored"]
    removed = [ev for ev in cpu if type(ev).__name__ == "BlockRemoved"]
    assert stored, [type(ev).__name__ for ev in e.events]
    # 4 host slots: the second prompt's stores evicted the first's blocks.
    assert removed and e.manager.counters()["evictions"] > 0


def test_host_store_full_refuses_and_the_engine_goes_on(model_dir):
    # 2 host slots: a request's 4 blocks never fit; every store is refused,
    # counted, and the requests finish as without offloading.
    e = Engine(model_dir, num_gpu_blocks=12, host_blocks=2)
    a = prompt(21, 17)
    e.add(a, max_tokens=2)
    e.run()
    c = e.manager.counters()
    assert c["stores_refused"] > 0 and c["errors"] == 0
    evict_gpu(e, [22, 23, 24], 30)
    rid = e.add(a + [5], max_tokens=2)
    e.run()
    assert rid in e.finished


def test_reset_then_lookups_miss(model_dir):
    e = Engine(model_dir, num_gpu_blocks=12)
    a = prompt(31, 22)
    e.add(a, max_tokens=1)
    e.run()
    assert e.manager.store_stats().resident >= 5
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    assert e.manager.store_stats().resident == 0
    before = e.manager.counters()
    rid = e.add(a + [3], max_tokens=1)
    e.run()
    after = e.manager.counters()
    assert after["lookup_hits"] == before["lookup_hits"]
    assert after["loads_prepared"] == before["loads_prepared"]
    assert rid in e.finished and after["errors"] == 0


def test_connector_stats_carry_kvplug_counters(model_dir):
    e = Engine(model_dir)
    e.add(prompt(41, 13), max_tokens=1)
    e.run()
    data = {}
    for s in e.connector_stats:  # serialized OffloadingConnectorStats
        for name, values in s["data"].items():
            data[name] = data.get(name, 0) + sum(v if not isinstance(v, list) else len(v) for v in values.values())
    assert data["kvplug:stores_completed"] >= 3 and "kvplug:host_usage_perc" in data
    # The worker's own transfer stats: 3 blocks of 2 layers' pages.
    assert data["vllm:kv_offload_store_bytes"] == 3 * 2 * e.page_bytes


def test_the_check_catches_a_bad_load(model_dir):
    # The harness is only as good as its check: bytes changed in the host
    # rows after the store must fail the returning request's forward pass.
    e = Engine(model_dir, num_gpu_blocks=12)
    a = prompt(51, 22)
    e.add(a, max_tokens=1)
    e.run()
    for t in e.spec_worker.copier.host_tensors:
        t.add_(1)
    evict_gpu(e, [52, 53, 54], 30)
    e.add(a + [1], max_tokens=1)
    with pytest.raises(AssertionError, match="the KV of context token"):
        e.run()
