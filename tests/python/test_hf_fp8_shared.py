"""An FP8 (torch.float8_e4m3fn) kvplug.hf cache with the shared tier, on the
CPU: instance A serves multi-turn conversations of a tiny random bf16 Llama
with write-through into its host tier and a redis-server (the valkey_server
fixture); instance B, a second cache on the same server and namespace,
serves each conversation's next turn (a moved session) and reads its history
from the shared tier. The server holds each block as its e4m3 K/V followed
by its float32 per-(token, kv head) scales; B's reloaded blocks hold A's
bytes and scales, and B answers as A does when it serves the same turns
itself. A bf16 instance on the same namespace finds the keys but refuses the
values (their layout fingerprint and length are another layout's): it reads
nothing, counts them corrupt, recomputes, and leaves the FP8 values as they
were."""

from __future__ import annotations

import pathlib
import socket
import struct
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch

import kvplug.hf as kvhf

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import test_hf_correctness as H  # noqa: E402
from test_hf_tier import Conversations  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 8
NS = "pytest-tiny-llama.bf16.kv-e4m3.bs8"
# The shared tier's value header (core/kvtier/valkey): magic, version, flags, hash, fingerprint, length, xxh3.
HEADER = 48


# -- the server, over RESP (binary-safe: the values are K/V bytes) -------------------------------------


def _reply(f: Any) -> Any:
    head = f.readline().rstrip(b"\r\n")
    kind, rest = head[:1], head[1:]
    if kind == b"+":
        return rest.decode()
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else f.read(n + 2)[:n]
    if kind == b"*":
        return [_reply(f) for _ in range(max(int(rest), 0))]
    raise OSError(f"redis reply {head!r}")


def redis(addr: str, *commands: Tuple[bytes, ...]) -> List[Any]:
    """The replies to the commands, pipelined on one connection."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as c:
        c.sendall(b"".join(b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)
                           for words in commands))
        f = c.makefile("rb")
        return [_reply(f) for _ in commands]


def namespace_values(addr: str, ns: str) -> Dict[bytes, bytes]:
    """Every value the shared tier stored under ns (kvplug:<ns>:<hash>), by key."""
    keys = redis(addr, (b"KEYS", f"kvplug:{ns}:*".encode()))[0]
    return dict(zip(keys, redis(addr, *[(b"GET", k) for k in keys]))) if keys else {}


def parse_value(v: bytes) -> Tuple[int, int, bytes]:
    """(fingerprint, payload length, payload) of a shared tier value, its fixed fields checked."""
    assert v[:4] == b"KVPB" and struct.unpack_from("<HH", v, 4) == (2, 0), v[:8]
    fingerprint, length = struct.unpack_from("<QQ", v, 24)
    assert len(v) == HEADER + length, (len(v), length)
    return fingerprint, length, v[HEADER:]


# -- one instance ------------------------------------------------------------------------------------


class Instance:
    """A PagedKVCache (host tier with write-through, the shared tier), a
    Runner and examples/hf_engine.py's Engine over a model's twin. Records,
    by request id, the block table of each request's first step and every
    logit row it computed. addr None: no tiers."""

    def __init__(self, model: Any, addr: Optional[str], kv_dtype: Optional[torch.dtype]) -> None:
        self.E = H.load_engine()
        kvmodel = H.twin(model)
        tier = dict(host_tier_slots=160, write_through=8, shared_tier=addr, shared_tier_namespace=NS,
                    shared_tier_timeout_ms=5000) if addr else {}
        self.cache = kvhf.PagedKVCache.for_model(kvmodel, 160, BS, kv_dtype=kv_dtype, **tier)
        runner = kvhf.Runner(kvmodel, self.cache, max_batch=3, max_step_tokens=64 + 3, max_model_len=320)
        cfg = self.E.EngineConfig(max_batch=3, step_tokens=64, chunk=32, progress_every=0)
        self.engine = self.E.Engine(runner, cfg, on_logits=self._seen)
        self.tables: Dict[int, np.ndarray] = {}
        self.cached: Dict[int, int] = {}
        self.rows: Dict[Tuple[int, int], torch.Tensor] = {}

    def _seen(self, batch: kvhf.Batch, logits: torch.Tensor) -> None:
        qo = batch.qo_indptr()
        for i, sid in enumerate(batch.seq_ids.tolist()):
            rid = self.engine.req_of[sid].rid
            if rid not in self.tables:
                self.tables[rid] = batch.block_table[i].copy()
                self.cached[rid] = int(batch.cached_tokens[i])
            s = int(batch.starts[i])
            for r in range(int(batch.q_lens[i])):
                self.rows[(rid, s + r)] = logits[qo[i] + r].detach().clone()

    def serve_one_at_a_time(self, prompts: List[List[int]], max_new: List[int], rid0: int) -> List[List[int]]:
        """Each prompt alone (as a moved turn arrives), the shared tier's stores settled before the next."""
        outs = []
        for c, (p, n) in enumerate(zip(prompts, max_new)):
            if self.cache.tier is not None:
                self.settle()
            req = self.E.Request(rid0 + c, 0.0, list(p), n)
            self.engine.run([req], log=lambda s: None)
            outs.append(req.outputs[req.seq_ids[0]])
        if self.cache.tier is not None:
            self.settle()
        return outs

    def settle(self, timeout: float = 30.0) -> Any:
        """Runs the tier's copies until no computed block waits for
        write-through, then waits until the shared tier's store thread has
        settled every queued block; returns the tier stats."""
        tier, m = self.cache.tier, self.cache.manager
        while True:
            tier.step(None)
            tier.drain()
            if m.tier_stats().write_through_queue == 0:
                break
        deadline = time.monotonic() + timeout
        while True:
            s = m.tier_stats()
            settled = s.shared_puts_done + s.shared_puts_present + s.shared_puts_failed
            if s.shared_queue_len == 0 and settled >= s.shared_puts_queued:
                return s
            assert time.monotonic() < deadline, f"the shared tier's stores did not settle: {s}"
            time.sleep(0.002)

    def block_bytes_of(self, blocks: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
        """The e4m3 bytes [layers, 2, n, block_size, kv_heads, head_dim] and scales [layers, 2, n, block_size,
        kv_heads] of the blocks."""
        idx = torch.from_numpy(blocks.astype(np.int64))
        return self.cache.kv.view(torch.uint8)[:, :, idx].clone(), self.cache.scales[:, :, idx].clone()

    def payload_of(self, block: int) -> bytes:
        """The block as a host slot holds it (TorchTierCopier): every layer's e4m3 K and V, then their scales."""
        kv = self.cache.kv.view(torch.uint8)[:, :, block].contiguous().numpy().tobytes()
        return kv + self.cache.scales[:, :, block].contiguous().numpy().tobytes()

    def close(self) -> None:
        self.cache.close()


def test_fp8_blocks_and_scales_move_through_the_shared_tier(valkey_server):
    model = H.tiny_model("llama", dtype=torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    E = H.load_engine()
    conv = Conversations(E, model.config.vocab_size, n=3, turns=2, seed=3)
    rng = np.random.default_rng(11)
    a = Instance(model, valkey_server, fp8)
    b = c = None
    try:
        assert a.cache.fp8 and a.cache.scales is not None
        # 1. A serves two turns of each conversation; its write-through copies reach the shared tier.
        first = conv.first()
        reqs = list(first)

        def follow_up(req: Any, now: float) -> Any:
            nxt = conv.follow_up(req, now)
            if nxt is not None:
                reqs.append(nxt)
            return nxt

        a.engine.run(first, log=lambda s: None, follow_up=follow_up)
        assert len(reqs) == 6 and all(r.finished is not None for r in reqs)
        sa = a.settle()
        assert sa.shared_puts_done > 0 and sa.shared_puts_failed == sa.shared_puts_dropped == 0, sa
        assert sa.write_through_lost == 0 and sa.shared_hits == 0, sa
        # Each conversation's next turn: its last turn's prompt and answer, then new user tokens. The history
        # blocks A computed are those holding every token but the answer's last, which was never fed back.
        last = sorted((r for r in reqs if r.rid % 2 == 1), key=lambda r: r.rid)
        prompts = [r.prompt + r.outputs[r.seq_ids[0]] + rng.integers(1, model.config.vocab_size, 13).tolist()
                   for r in last]
        hist = [(len(r.prompt) + len(r.outputs[r.seq_ids[0]]) - 1) // BS for r in last]
        max_new = [6, 7, 5]
        assert min(hist) >= 5, hist

        # The server holds exactly those blocks (turn 1's are a prefix of turn 2's), each as one FP8 layout's
        # value: the payload is a host slot's, block_bytes long (e4m3 K/V, then float32 scales).
        stored = namespace_values(valkey_server, NS)
        assert len(stored) == sum(hist) == sa.shared_puts_done, (len(stored), hist, sa.shared_puts_done)
        parsed = {k: parse_value(v) for k, v in stored.items()}
        assert {p[1] for p in parsed.values()} == {a.cache.block_bytes}
        # layers x K, V x block size x kv heads x (head_dim e4m3 bytes + a float32 scale)
        assert a.cache.block_bytes == 2 * 2 * BS * 2 * (16 + 4)
        assert len({p[0] for p in parsed.values()}) == 1

        # 2. B, a second instance on the server, serves the next turns: each history comes from the shared tier.
        b = Instance(model, valkey_server, fp8)
        out_b = b.serve_one_at_a_time(prompts, max_new, 100)
        sb = b.cache.manager.tier_stats()
        assert [b.cached[100 + i] for i in range(3)] == [n * BS for n in hist], (b.cached, hist)
        assert sb.shared_fetched == sum(hist) and sb.shared_hit_tokens + sb.shared_match_tokens == sum(hist) * BS, sb
        assert sb.shared_corrupt == sb.shared_fetch_misses == sb.shared_errors == sb.shared_timeouts == 0, sb
        assert sb.shared_bytes_read == sum(hist) * (HEADER + a.cache.block_bytes), sb
        # The values B read are as A stored them; B's stores of the next turns' new blocks are removed, so that
        # A, serving the same turns below, finds only its own blocks (on its GPU) and computes the rest as B did.
        now = namespace_values(valkey_server, NS)
        assert all(now[k] == v for k, v in stored.items())
        extra = sorted(set(now) - set(stored))
        assert extra, "B stored its turns' new blocks"
        assert redis(valkey_server, *[(b"UNLINK", k) for k in extra]) == [1] * len(extra)

        # 3. A serves the same turns itself, from its GPU prefix cache.
        out_a = a.serve_one_at_a_time(prompts, max_new, 100)
        assert [a.cached[100 + i] for i in range(3)] == [n * BS for n in hist], (a.cached, hist)
        assert a.cache.manager.tier_stats().shared_hits == 0
        assert out_b == out_a and all(len(o) == n for o, n in zip(out_a, max_new)), (out_b, out_a)
        # Every logit row of the turns (the same positions computed on each) is A's, bit for bit.
        rows_a = {k: v for k, v in a.rows.items() if k[0] >= 100}
        assert set(b.rows) == set(rows_a) and len(rows_a) > 3 * 13
        bad = [k for k in rows_a if not torch.equal(b.rows[k], rows_a[k])]
        assert not bad, bad[:5]

        # B's reloaded history blocks hold A's e4m3 bytes and A's scales, block for block by token position; the
        # server's values are exactly A's blocks (payload = e4m3 K/V, then scales).
        want_payloads = set()
        for i, n in enumerate(hist):
            ta, tb = a.tables[100 + i][:n], b.tables[100 + i][:n]
            assert (ta >= 0).all() and (tb >= 0).all() and len(set(tb.tolist())) == n
            kv_a, sc_a = a.block_bytes_of(ta)
            kv_b, sc_b = b.block_bytes_of(tb)
            assert (sc_b > 0).all() and kv_b.any(), "B's blocks were loaded (the CPU cache starts zeroed)"
            assert torch.equal(kv_b, kv_a), f"conversation {i}: the e4m3 bytes differ"
            assert torch.equal(sc_b, sc_a), f"conversation {i}: the scales differ"
            want_payloads.update(a.payload_of(int(blk)) for blk in ta)
        assert {p[2] for p in parsed.values()} == want_payloads

        # 4. A bf16 cache of the same model on the same namespace: the keys are the same (the namespace and the
        # tokens' chained hashes), but the values carry the FP8 layout's fingerprint (of namespace, block size and
        # block bytes) and length. EXISTS finds them; each read of them is refused as corrupt (the lookup of
        # match_tiers and that of the admission read them both); nothing is fetched and the prompt is computed,
        # answering as the same bf16 cache without tiers; its stores find the keys present (A stored every full
        # block of that turn in step 3) and leave the FP8 values as they were.
        b.close()
        b = None
        before = namespace_values(valkey_server, NS)
        c = Instance(model, valkey_server, None)
        assert c.cache.block_bytes == 2 * 2 * BS * 2 * 16 * 2 != a.cache.block_bytes
        out_c = c.serve_one_at_a_time(prompts[:1], max_new[:1], 200)
        sc = c.cache.manager.tier_stats()
        assert c.cached[200] == 0, c.cached
        assert sc.shared_fetched == 0 and sc.shared_hit_tokens + sc.shared_match_tokens == 0, sc
        assert sc.shared_hits >= (len(prompts[0]) - 1) // BS and sc.shared_misses == 0, sc
        assert sc.shared_corrupt == sc.shared_fetch_misses == sc.shared_hits, sc
        assert sc.shared_bytes_read == sc.shared_corrupt * (HEADER + a.cache.block_bytes), sc  # the FP8 values
        assert sc.shared_errors == sc.shared_timeouts == 0, sc
        computed = (len(prompts[0]) + max_new[0] - 1) // BS
        assert sc.shared_puts_present == computed and sc.shared_puts_done == 0, sc
        assert namespace_values(valkey_server, NS) == before
        plain = Instance(model, None, None)
        try:
            assert plain.cache.tier is None
            assert plain.serve_one_at_a_time(prompts[:1], max_new[:1], 200) == out_c
        finally:
            plain.close()
    finally:
        for inst in (a, b, c):
            if inst is not None:
                inst.close()
