"""kvplug.vllm with a hybrid model inside vLLM's own scheduler (harness.py
with sliding_window): a full-attention group and a sliding-window group
over one pool of GPU blocks, the OffloadingConnector offloading each
group's chunks under its own key (block hash + group index) into kvplug's
one slot pool, and a returning prompt loading the full group's chunks and
the window group's last ones back; the fake forward pass checks every
full-attention context token and every window token in reach."""

from __future__ import annotations

import pytest

from harness import Engine, evict_gpu, prompt, write_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama-hybrid"))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_hybrid_prefix_reloads_both_groups(model_dir, async_scheduling):
    e = Engine(model_dir, num_gpu_blocks=24, host_blocks=64, sliding_window=8, async_scheduling=async_scheduling)
    a = prompt(61, 22)  # 5 full blocks of 4 tokens
    e.add(a, max_tokens=2)
    e.run()
    c = e.manager.counters()
    assert c["stores_completed"] >= 5 and c["errors"] == 0, c
    evict_gpu(e, [62, 63, 64], 30)
    before, checked, window = e.manager.counters(), e.checked_tokens, e.checked_window_tokens
    rid = e.add(a + [7, 8, 9, 10, 11], max_tokens=2)
    e.run()
    after = e.manager.counters()
    assert rid in e.finished
    assert after["lookup_hits"] > before["lookup_hits"]
    # The full group's 5 chunks and the window group's 2 (8 tokens).
    assert after["loads_prepared"] - before["loads_prepared"] >= 7
    assert after["load_misses"] == 0 and after["errors"] == 0 and after["key_collisions"] == 0
    # Both groups' context came back right: the full group's 16+ tokens
    # and the window group's last tokens before the hit point.
    assert e.checked_tokens - checked >= 16
    assert e.checked_window_tokens - window >= 7
    s = e.manager.store_stats()
    assert s.pinned == 0 and s.pending == 0


def test_hybrid_events_carry_each_group(model_dir):
    e = Engine(model_dir, num_gpu_blocks=24, host_blocks=64, sliding_window=8)
    e.add(prompt(71, 18), max_tokens=1)
    e.run()
    stored = [ev for ev in e.events if type(ev).__name__ == "BlockStored" and getattr(ev, "medium", None) == "CPU"]
    assert {getattr(ev, "group_idx", None) for ev in stored} >= {0, 1}, stored
