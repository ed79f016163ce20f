"""cmd/kvindex routing a fleet of SGLang engines by SGLang's own KV events:
its ZmqEventPublisher and event types (vLLM's wire format), its own
integer block hashes, no snapshots (kvindex_fleet says what is checked)."""

from __future__ import annotations

from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from kvindex_fleet import run_fleet


def test_kvindex_routes_sglang_publishers(tmp_path):
    run_fleet((ZmqEventPublisher, KVEventBatch, BlockStored, BlockRemoved), "sglang", True, tmp_path)
