"""kvplug.hf with the host KV tier over layer groups on the CPU: the
multi-turn conversations of test_hf_tier.py on the tiny gpt-oss and Gemma 3
of test_hf_hybrid.py, on pools too small to keep their histories, so that
every group's blocks are demoted between turns and reloaded by the next
turn (the window groups only the blocks the hit point's query reads). Every
logit row is checked against transformers, the greedy outputs against a
pool that holds everything, and the engine must have copied every demotion
the manager queued: a node brings its window and full companions with it,
more copies than the blocks a flush wants free."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import kvplug
import kvplug.hf as kvhf
from kvplug.hf import tier_copy

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import test_hf_correctness as H  # noqa: E402
import test_hf_hybrid as HY  # noqa: E402
import test_hf_tier as T  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("kind, num_blocks", [("gemma-3", 96), ("gpt-oss", 32)])
def test_hybrid_histories_come_back_from_the_host_tier(kind, num_blocks):
    model = HY.tiny_hybrid(kind)
    sh = kvhf.ModelShape.of(model.config)
    full = sh.layer_types.count("full_attention")
    *_, big, _, _ = T.run_conversations(model, num_blocks=400)
    engine, rec, reqs, outs, s, _ = T.run_conversations(model, num_blocks=num_blocks, host_slots=256)
    # A slot is one group's layers of a block: as many layers as the full group.
    assert s["slot_bytes"] == tier_copy.block_bytes(full, T.BS, sh.num_kv_heads, sh.head_dim, torch.float32) < \
        tier_copy.block_bytes(sh.num_layers, T.BS, sh.num_kv_heads, sh.head_dim, torch.float32)
    assert s["demotions_completed"] > 0 and s["host_hit_tokens"] >= 3 * T.BS, s
    assert s["reloads_completed"] == s["reloads"] > 0 and s["demotions_failed"] == 0 and s["in_flight"] == 0, s
    # Every demotion the manager queued reached the copier (none left out of the engine's arrays), every
    # reload too: a slot no copy wrote would be served to the next turn.
    assert s["demote_bytes"] == s["demotions_queued"] * s["slot_bytes"], s
    assert s["reload_bytes"] == s["reloads"] * s["slot_bytes"], s
    count, _ = H.compare(model, engine, rec, reqs, atol=5e-5, rtol=5e-5)
    assert count > 200
    assert outs == big


def test_hybrid_tier_arguments():
    model = kvhf.prepare_model(HY.tiny_hybrid("gemma-3"))
    sh = kvhf.ModelShape.of(model.config)
    with kvhf.PagedKVCache.for_model(model, 64, 4, host_tier_slots=8) as cache:
        assert len(cache.groups) == 6 and cache.num_slots == 1
        assert not cache.demote_evicted  # groups demote ahead of need only
        assert cache.manager.host_tier_memory().shape == (8, cache.block_bytes)
        assert cache.block_bytes == tier_copy.block_bytes(1, 4, sh.num_kv_heads, sh.head_dim, torch.float32)
    # One table for every layer: a slot holds every layer, and demote_evicted is the default again.
    with kvhf.PagedKVCache.for_model(model, 64, 4, host_tier_slots=8, layer_groups=False) as cache:
        assert len(cache.groups) == 1 and cache.demote_evicted
        assert cache.block_bytes == tier_copy.block_bytes(6, 4, sh.num_kv_heads, sh.head_dim, torch.float32)
    for bad in (dict(demote_evicted=True), dict(write_through=4)):
        with pytest.raises(kvplug.InvalidArgumentError, match="layer groups"):
            kvhf.PagedKVCache.for_model(model, 64, 4, host_tier_slots=8, **bad)
    # host_slots_for counts the slots of the layout the cache takes.
    one = tier_copy.block_bytes(1, 4, sh.num_kv_heads, sh.head_dim, torch.float32)
    assert kvhf.PagedKVCache.host_slots_for(1.0, sh, 4, torch.float32) == 2**30 // one
    assert kvhf.PagedKVCache.host_slots_for(1.0, sh, 4, torch.float32, layer_groups=False) == 2**30 // (6 * one)
