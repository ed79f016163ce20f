"""cmd/kvindex routing a fleet of vLLM engines by vLLM's own KV events:
its ZmqEventPublisher and event types, its own block hashes (bytes or
int), no snapshots (kvindex_fleet says what is checked)."""

from __future__ import annotations

import pytest

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from kvindex_fleet import run_fleet


@pytest.mark.parametrize("as_int", [False, True], ids=["bytes-hashes", "int-hashes"])
def test_kvindex_routes_vllm_publishers(tmp_path, as_int):
    run_fleet((ZmqEventPublisher, KVEventBatch, BlockStored, BlockRemoved), "vllm", as_int, tmp_path)
