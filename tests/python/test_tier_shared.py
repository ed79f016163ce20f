"""The shared KV tier through the Python API: engine processes that share
one Valkey/Redis server (the valkey_server fixture starts a redis-server).
Each process plays its engine, with a numpy array as the GPU pool's K/V,
copying blocks into and out of its host slots as flush_copies asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvplug

BS, BLOCKS, SLOTS, BYTES = 4, 8, 16, 64
NS = "pytest-model.u8.bs4"

# One engine process: argv is the role, the server and the namespace; it
# prints its tier stats (and what it saw) as JSON.
ENGINE = textwrap.dedent(
    """
    import dataclasses, json, sys
    import numpy as np
    import kvplug

    role, addr, ns = sys.argv[1:4]
    BS, BLOCKS, SLOTS, BYTES = 4, 8, 16, 64
    conv = np.arange(100, 117, dtype=np.int32)  # four full blocks and one token
    gpu = np.zeros((BLOCKS, BYTES), np.uint8)

    def kv_of(i):
        return np.full(BYTES, 0xA0 + i, np.uint8)

    def run_copies(m):
        batch = m.flush_copies()
        host = m.host_tier_memory()
        host[batch.demote_slots] = gpu[batch.demote_blocks]
        gpu[batch.reload_blocks] = host[batch.reload_slots]
        if batch.ticket:
            m.complete_copies(batch.ticket)
        return batch

    out = {}
    m = kvplug.Manager(BLOCKS, BS, prefix_cache=True, host_tier_slots=SLOTS, host_block_bytes=BYTES,
                       demote_ahead=BLOCKS, shared_tier=addr, shared_tier_namespace=ns,
                       shared_tier_timeout_ms=5000)
    with m:
        if role == "compute":
            out["matched"] = m.admit([1], [conv]).tolist()
            run_copies(m)  # the step's flush (nothing to copy): the blocks are written after it
            table = m.describe([1]).block_table[0]
            for i in range(4):
                gpu[table[i]] = kv_of(i)  # the engine computes the prompt's K/V
            m.mark_computed()
            m.remove([1])
            out["demoted"] = len(run_copies(m).demote_blocks)  # completes: stores queued
        else:
            if role == "match":
                out["match"] = [list(t) for t in m.match_tiers([conv])]
            out["matched"] = m.admit([1], [conv]).tolist()
            out["reloads"] = len(run_copies(m).reload_blocks)
            table = m.describe([1]).block_table[0]
            out["kv_ok"] = all(bool((gpu[table[i]] == kv_of(i)).all()) for i in range(4))
            m.check()
        stats = m.tier_stats()
    out["stats"] = dataclasses.asdict(stats)
    print(json.dumps(out))
    """
)


def engine(role: str, addr: str, ns: str = NS) -> dict:
    p = subprocess.run([sys.executable, "-c", ENGINE, role, addr, ns], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ))
    assert p.returncode == 0, f"engine {role} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return json.loads(p.stdout)


def test_two_processes_share_blocks(valkey_server):
    a = engine("compute", valkey_server)
    assert a["matched"] == [0] and a["demoted"] == 4
    st = a["stats"]
    assert st["shared_puts_queued"] == 4 and st["shared_misses"] == 4 and st["shared_errors"] == 0
    # Process 1 has exited: close() wrote its stores out. Process 2 matches
    # the prompt per tier (fetched into its host tier) and admits it with
    # the four blocks reloaded, holding process 1's K/V.
    b = engine("match", valkey_server)
    assert b["match"] == [[0, 16]]
    assert b["matched"] == [16] and b["reloads"] == 4 and b["kv_ok"]
    st = b["stats"]
    assert (st["shared_fetched"], st["shared_match_tokens"], st["shared_hits"], st["host_hit_tokens"]) == (4, 16, 4, 16)
    assert st["shared_corrupt"] + st["shared_errors"] + st["shared_timeouts"] == 0 and st["shared_available"]
    # Process 3 admits straight away: the admission fetches.
    c = engine("admit", valkey_server)
    assert c["matched"] == [16] and c["reloads"] == 4 and c["kv_ok"]
    assert (c["stats"]["shared_fetched"], c["stats"]["shared_hit_tokens"]) == (4, 16)
    # Another model's namespace shares nothing.
    d = engine("admit", valkey_server, ns="another-model.u8.bs4")
    assert d["matched"] == [0] and d["stats"]["shared_fetched"] == 0


def test_a_lacking_prompt_is_not_asked_again_at_once(valkey_server):
    """A prompt the server lacks, matched again at once (as a waiting
    prompt is every step): the second match makes no round trip, counted in
    shared_remembered."""
    with kvplug.Manager(BLOCKS, BS, prefix_cache=True, host_tier_slots=SLOTS, host_block_bytes=BYTES,
                        demote_ahead=BLOCKS, shared_tier=valkey_server, shared_tier_namespace=NS,
                        shared_tier_timeout_ms=5000) as m:
        conv = np.arange(300, 317, dtype=np.int32)
        for _ in range(2):
            assert m.match_tiers([conv]) == [kvplug.TierMatch(0, 0)]
        s = m.tier_stats()
        assert (s.shared_lookups, s.shared_remembered, s.shared_misses) == (1, 1, 4), s


def test_server_down_is_skipped_and_counted():
    with kvplug.Manager(BLOCKS, BS, prefix_cache=True, host_tier_slots=SLOTS, host_block_bytes=BYTES,
                        demote_ahead=BLOCKS, shared_tier="127.0.0.1:1", shared_tier_namespace=NS,
                        shared_tier_timeout_ms=100) as m:
        conv = np.arange(100, 117, dtype=np.int32)
        start = time.monotonic()
        assert m.admit([1], [conv]).tolist() == [0]  # computed, not an error
        assert m.match_tiers([np.arange(9, dtype=np.int32)]) == [kvplug.TierMatch(0, 0)]
        assert time.monotonic() - start < 2
        s = m.tier_stats()
        assert s.shared_errors + s.shared_timeouts == 1 and s.shared_skipped == 1 and not s.shared_available
        assert s.shared_misses == 4 + 2


def test_refusals():
    tier = dict(prefix_cache=True, host_tier_slots=SLOTS, host_block_bytes=BYTES)
    with pytest.raises(kvplug.InvalidArgumentError, match="needs a host tier"):
        kvplug.Manager(BLOCKS, BS, prefix_cache=True, shared_tier="127.0.0.1:1", shared_tier_namespace=NS)
    with pytest.raises(kvplug.InvalidArgumentError, match="namespace"):
        kvplug.Manager(BLOCKS, BS, shared_tier="127.0.0.1:1", **tier)
    with pytest.raises(kvplug.InvalidArgumentError, match="namespace"):
        kvplug.Manager(BLOCKS, BS, shared_tier="127.0.0.1:1", shared_tier_namespace="meta-llama/Llama-3", **tier)
    with pytest.raises(kvplug.InvalidArgumentError, match="shared_tier_addr"):
        kvplug.Manager(BLOCKS, BS, shared_tier_namespace=NS, **tier)
    with pytest.raises(kvplug.InvalidArgumentError, match="timeout"):
        kvplug.Manager(BLOCKS, BS, shared_tier="127.0.0.1:1", shared_tier_namespace=NS, shared_tier_timeout_ms=-1,
                       **tier)
    with pytest.raises(kvplug.InvalidArgumentError, match="put queue"):
        kvplug.Manager(BLOCKS, BS, shared_tier="127.0.0.1:1", shared_tier_namespace=NS,
                       shared_tier_put_queue=(1 << 20) + 1, **tier)
    with pytest.raises(TypeError):
        kvplug.Manager(BLOCKS, BS, shared_tier=6379, shared_tier_namespace=NS, **tier)
    with pytest.raises(ValueError):
        kvplug.Manager(BLOCKS, BS, shared_tier="127.0.0.1:1\x00", shared_tier_namespace=NS, **tier)
    # Without a shared tier its stats are zero.
    with kvplug.Manager(BLOCKS, BS, **tier) as m:
        s = m.tier_stats()
        assert s.shared_lookups == s.shared_puts_queued == 0 and s.shared_available is False
