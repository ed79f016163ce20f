"""bench/hf_bench.py's kvplug-shared system on the CPU: workload t at a
tiny scale with kvplug-host (the host tier alone) and kvplug-shared (the
same with a shared tier below it, on a redis-server that hf_bench starts
for the run and stops after it). Skipped when neither valkey-server nor
redis-server is installed (CI installs redis-server)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import sys

import pytest
from conftest import server_binary

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_hf_correctness as H  # noqa: E402  (the harness: load_script)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bench():
    return H.load_script("bench/hf_bench.py")


def _gone(pid: int, address: str) -> bool:
    """The process is no longer running and nothing answers at address."""
    try:
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        pass
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return False
    except OSError:
        return True


@pytest.mark.parametrize("write_through", [0, 8], ids=["demote", "write-through"])
def test_workload_t_host_tier_and_shared_tier(tmp_path, capsys, write_through):
    """The host tier holds about a fifth of the working set (--host-cache-gb,
    both systems), so histories also leave it between turns: kvplug-host
    recomputes them, kvplug-shared reads them back from the shared tier.
    Greedy float32 answers are the same in both systems. write_through:
    the host tier's stores are write-through, with kvplug-host's slack in
    both systems."""
    binary = server_binary()
    B = _bench()
    out = tmp_path / "t.json"
    B.main(["--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--workloads", "t", "--scale", "0.05",
            "--t-turns", "3", "--t-first", "64", "--t-user", "12", "24", "--t-output", "4", "8", "--t-rate", "1e6",
            "--t-think-scale", "0", "--max-batch", "4", "--step-tokens", "128", "--chunk", "64", "--block-size", "8",
            "--host-cache-gb", "0.00015", "--write-through", str(write_through), "--systems", "kvplug-host,kvplug-shared",
            "--redis-server", binary, "--quiet", "--json", str(out)])
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert set(res) == {"t/kvplug-host", "t/kvplug-shared"}, sorted(res)
    host, shared = res["t/kvplug-host"], res["t/kvplug-shared"]
    for r in (host, shared):
        assert r["finished"] == r["requests"] == 9 and len(r["ttft_next"]) == 6, r
        assert len(r["output_digests"]) == 9
        # Both host tiers are smaller than the working set: blocks were evicted from them.
        assert r["tier"]["host_evictions"] > 0 and r["tier"]["host_slots"] < r["working_set_blocks"], r["tier"]
    if write_through:
        slack = B.kvhf.PagedKVCache.default_write_through_slack(host["num_blocks"], write_through)
        assert host["tier"]["write_through_slack"] == shared["tier"]["write_through_slack"] == slack > 0
        assert host["tier"]["write_through_stored"] > 0 and shared["tier"]["write_through_stored"] > 0
    else:
        assert host["tier"]["write_through_stored"] == shared["tier"]["write_through_stored"] == 0
    # kvplug-host has no shared tier.
    assert "shared_server" not in host
    assert not any(v for k, v in host["tier"].items() if k.startswith("shared_")), host["tier"]
    # kvplug-shared stored blocks on its server and read blocks back from it.
    t, sv = shared["tier"], shared["shared_server"]
    assert t["shared_puts_done"] > 0 and t["shared_bytes_written"] > 0, t
    assert t["shared_fetched"] > 0 and t["shared_bytes_read"] > 0 and t["shared_match_tokens"] > 0, t
    assert t["shared_timeouts"] == t["shared_errors"] == t["shared_corrupt"] == t["shared_puts_failed"] == 0, t
    assert sv["binary"] == binary and sv["keys"] > 0 and sv["evicted_keys"] == 0, sv
    assert sv["maxmemory"] == 2 * shared["working_set_blocks"] * t["slot_bytes"] + (1 << 30), sv
    # The same answers, request for request.
    assert shared["output_digests"] == host["output_digests"]
    # The server that hf_bench started is gone.
    assert _gone(sv["pid"], sv["address"]), sv
    assert f"shared tier {sv['address']}: " in text and "kvplug-shared vs kvplug-host" in text, text
    assert f"{t['shared_puts_done']} of {t['shared_puts_queued']} blocks queued" in text, text
    assert "kvplug-shared/kvplug-host" in text, text


def test_throwaway_server_stops_when_the_run_fails(monkeypatch):
    """run_shared stops the server it started when the run raises."""
    binary = server_binary()
    B = _bench()
    seen = {}

    def failing_run(system, model, reqs, args, dtype, conv=None, shared=None):
        seen.update(shared, system=system)
        assert B.RS.redis_command(shared["address"], "PING") == "PONG"
        raise RuntimeError("the run failed")

    monkeypatch.setattr(B, "run_loop", failing_run)
    monkeypatch.setattr(B, "run_sizes", lambda *a: (None, 64, 4096, 10))
    args = argparse.Namespace(shared_tier=None, shared_tier_namespace=None, shared_timeout_ms=1000, model="m",
                              block_size=8, redis_server=binary, redis_maxmemory_gb=0.0, quiet=True)
    with pytest.raises(RuntimeError, match="the run failed"):
        B.run_shared(None, [], args, B.torch.float32)
    assert seen["system"] == "kvplug-shared" and seen["put_queue"] == 256
    assert seen["maxmemory"] == 2 * 10 * 4096 + (1 << 30) == B.shared_maxmemory(args, 4096, 10)
    assert seen["namespace"].startswith("hf_bench.m.float32.bs8.") and len(seen["namespace"]) <= 64
    assert _gone(seen["pid"], seen["address"]), seen


def test_shared_tier_flag_needs_the_kvplug_shared_system():
    """--shared-tier is kvplug-shared's server: without that system it is
    refused before the model is built."""
    B = _bench()
    with pytest.raises(SystemExit, match="name kvplug-shared in --systems"):
        B.main(["--workloads", "t", "--systems", "kvplug-host,kvplug", "--shared-tier", "127.0.0.1:1"])
    with pytest.raises(SystemExit, match="--redis-server no-such-server-binary not found"):
        B.main(["--workloads", "t", "--systems", "kvplug-shared", "--redis-server", "no-such-server-binary"])
