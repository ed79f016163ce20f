"""bench/moved_sessions.py on the CPU: two instances (two processes) of a
tiny random-weight Llama share a redis-server that the script starts;
sessions served by A move to B, which must read their histories from the
shared tier and answer as A and a recomputing B do. Skipped when neither
valkey-server nor redis-server is installed (CI installs redis-server)."""

from __future__ import annotations

import copy
import json
import pathlib
import sys

import pytest
from conftest import server_binary

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_hf_correctness as H  # noqa: E402  (the harness: load_script)


def _script():
    return H.load_script("bench/moved_sessions.py")


@pytest.mark.parametrize("cluster", [0, 3], ids=["server", "cluster3"])
def test_moved_sessions_read_the_shared_tier(tmp_path, capsys, cluster):
    """cluster: a cluster of 3 primaries that the script starts, the
    histories' blocks spread over its nodes."""
    binary = server_binary()
    MS = _script()
    out = tmp_path / "moved.json"
    res = MS.main(["--model", "tiny-llama", "--devices", "cpu,cpu", "--dtype", "float32", "--cpu-threads", "1",
                   "--sessions", "3", "--turns-on-a", "2", "--t-first", "40", "--t-user", "8", "20",
                   "--t-output", "4", "8", "--block-size", "8", "--chunk", "32", "--step-tokens", "64", "--max-batch", "4",
                   "--warmup-tokens", "16", "--warmup-output", "2", "--redis-server", binary, "--json", str(out),
                   "--redis-cluster", str(cluster)])
    text = capsys.readouterr().out
    assert "moved vs recompute" in text and "check shared_read: ok" in text, text
    assert ("a cluster of 3 primaries" in text) == bool(cluster), text
    assert json.loads(out.read_text())["checks"] == res["checks"]
    assert all(c["ok"] for c in res["checks"].values()), res["checks"]
    moved, rec, stayed = (res["runs"][k] for k in ("moved", "recompute", "stayed"))
    assert len(moved) == len(rec) == len(stayed) == 3
    assert res["tier"]["B_moved"]["shared_hits"] > 0 and res["tier"]["B_moved"]["shared_bytes_read"] > 0
    assert res["history"]["flush"]["tier"]["shared_puts_done"] > 0
    for m, r, s, h in zip(moved, rec, stayed, res["history_tokens"]):
        full = (h - 1) // 8 * 8  # the history's blocks that A computed whole
        assert m["shared_hit_tokens"] == m["hit_tokens"] == full, m
        assert r["hit_tokens"] == 0 and s["hit_tokens"] == full and s["shared_hit_tokens"] == 0
        assert m["tokens"] and m["tokens"] == r["tokens"] == s["tokens"]
    # The checks catch an answer that differs.
    bad = copy.deepcopy(res)
    bad["runs"]["moved"][1]["tokens"][0] += 1
    checks = MS.report(bad, MS.parse(["--dtype", "float32", "--block-size", "8", "--turns-on-a", "2"]))
    assert not checks["moved_equals_stayed"]["ok"] and not checks["moved_equals_recompute"]["ok"]
    assert checks["shared_read"]["ok"]
    # In 16-bit types the recompute baseline's agreement is reported unless --strict-recompute.
    checks = MS.report(bad, MS.parse(["--dtype", "bfloat16", "--block-size", "8", "--turns-on-a", "2"]))
    assert checks["moved_equals_recompute"]["ok"] and not checks["moved_equals_stayed"]["ok"]
    checks = MS.report(bad, MS.parse(["--dtype", "bfloat16", "--strict-recompute", "--block-size", "8", "--turns-on-a", "2"]))
    assert not checks["moved_equals_recompute"]["ok"]
