#!/usr/bin/env python3
"""Sessions that move between two engine instances through a shared KV tier
(issue 34, items 4 and 6).

Two kvplug.hf instances, A and B, each in its own process on its own device
(--devices, default cuda:0,cuda:1), serve the same random-weight model
(examples/hf_engine.py's make_model, the same seed, so the same weights;
Llama-3-8B's shape by default). Each has a host KV tier with write-through
(every computed block is copied to host memory while it stays on the GPU)
and, below it, a shared tier: one Valkey/Redis server that this script
starts (--redis-server; --redis-cluster N starts a cluster of N primaries
instead; --shared-tier HOST:PORT uses a running server).

Sessions are bench/hf_bench.py's workload t without the think times: a
long first context (--t-first tokens), then --t-user new user tokens a
turn, each turn answered with --t-output tokens (greedy; the timed turn
with at most --moved-output). Instance A serves turns 1..--turns-on-a of
every session (all sessions at once, as an engine would); its
write-through copies reach the shared tier, and the script waits for
them to settle (the user thinks). Then each session's next turn goes, one
at a time, as a load balancer would send it:
  moved      to B, whose admission reads the session's history from the
             shared tier into its host tier and reloads it (no recompute);
  recompute  to a fresh B without the shared tier (nor a host tier): the
             history is computed again (the baseline);
  stayed     back to A (the history in A's GPU prefix cache, or its host
             tier with --pool-frac < 1), after the blocks B stored for
             the moved turns were deleted from the server.
Each instance serves a warm-up prompt before it is timed. Reported: TTFT
p50/p99/mean of the turn per way, moved vs recompute (the issue's target:
p50 at least 3x lower), the shared tier's figures (blocks and bytes A
stored, B's hits, misses and bytes read, the stores' settling time) and
the server's memory; --json writes all of it with every turn's TTFT, hits
and answer.

Checks (printed after the summary; exit status 1 when one fails):
  - shared_read: B read from the shared tier (shared hits > 0), in every
    moved turn;
  - moved_hits_history: every moved turn hit its history's full blocks;
  - moved_equals_stayed: the moved answer equals the stayed one, token for
    token, in every session whose two admissions hit alike: B computes the
    same tokens over the bytes A computed, so a difference is a K/V
    transfer fault;
  - moved_equals_recompute: the moved answer equals the recompute
    baseline's. Asserted in float32 (the CPU); in 16-bit types the
    recomputed K/V comes from other kernels than A's (prefill against A's
    decode steps), so a random-weight model's greedy answer may part after
    a near tie: the agreement is reported, and asserted with
    --strict-recompute.

The instances are two processes of this script (--worker), driven over a
local connection.

    # two GPUs (one instance on each), redis-server on PATH:
    python bench/moved_sessions.py --json moved.json
    python bench/moved_sessions.py --redis-server /path/to/redis-server --sessions 8 --t-first 16384
    # a CPU smoke run (tests/python/test_moved_sessions.py runs a smaller one):
    python bench/moved_sessions.py --model tiny-llama --devices cpu,cpu --dtype float32 --sessions 3 \\
        --t-first 96 --t-user 16 32 --t-output 6 10 --chunk 64 --step-tokens 128 --max-batch 8
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import math
import os
import pathlib
import secrets
import shlex
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Client, Listener
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
AUTHKEY_ENV = "KVPLUG_MOVED_SESSIONS_AUTHKEY"


# bench/hf_bench.py (its workload t, figures, and examples/hf_engine.py as .E): this script's folder is on
# sys.path when it runs as a script, not when a test loads it as a module.
sys.path.insert(0, str(ROOT / "bench"))
import hf_bench as H  # noqa: E402
from redis_server import RedisCluster, RedisServer, delete_keys, drop_namespace, namespace_keys  # noqa: E402  (the throwaway servers)
E = H.E
torch = H.torch
kvplug = H.kvplug
kvhf = H.kvhf
size = H.size


# -- one instance (in a worker process) -----------------------------------------------


def make_cache(model: Any, num_blocks: int, block_size: int, tier: Dict[str, Any], shared: Dict[str, Any]) -> Any:
    """PagedKVCache.for_model with the tier arguments and, with a shared
    tier, its namespace, timeout and put queue (shared)."""
    kw = {**tier, **shared} if tier.get("shared_tier") else tier
    return kvhf.PagedKVCache.for_model(model, num_blocks, block_size, **kw)


class Instance:
    """One engine instance: the model on its device, and (open) a
    PagedKVCache with a host tier, a Runner and examples/hf_engine.py's
    Engine over them."""

    def __init__(self, role: str, device: str, args: argparse.Namespace) -> None:
        self.role, self.device, self.args = role, device, args
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        else:
            # Two instances on one host's cores: torch's default (every core each) makes them contend.
            torch.set_num_threads(args.cpu_threads or max(1, (os.cpu_count() or 2) // 2))
        self.dtype = getattr(torch, args.dtype)
        t0 = time.perf_counter()
        self.model = kvhf.prepare_model(E.make_model(args.model, self.dtype, device, args.seed))
        self.build_s = time.perf_counter() - t0
        self.shape = kvhf.ModelShape.of(self.model.config)
        self.cache: Any = None
        self.engine: Any = None
        self.mode = ""
        self.rid = 0
        self.match_s = 0.0

    def log(self, msg: str) -> None:
        if not self.args.quiet:
            print(f"[{self.role}{' ' + self.mode if self.mode else ''}] {msg}", flush=True)

    def info(self) -> Dict[str, Any]:
        a = self.args
        name = torch.cuda.get_device_name(torch.device(self.device)) if self.device.startswith("cuda") else "cpu"
        return {"vocab": int(self.model.config.vocab_size), "device": self.device, "device_name": name,
                "build_s": self.build_s, "pid": os.getpid(),
                "block_bytes": kvhf.tier_copy.block_bytes(self.shape.num_layers, a.block_size, self.shape.num_kv_heads,
                                                          self.shape.head_dim, self.dtype),
                "shape": [self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim]}

    def open(self, mode: str, num_blocks: int, host_gb: float, max_len: int, shared_addr: Optional[str],
             shared: Dict[str, Any]) -> Dict[str, Any]:
        """A fresh cache (a host tier of host_gb GiB with write-through, 0:
        none; the shared tier at shared_addr unless None), runner and
        engine; serves one warm-up prompt (its own random tokens) before
        anything is timed."""
        self.close()
        a = self.args
        self.mode = mode
        targs = copy.copy(a)
        targs.shared_tier = shared_addr
        tier = E.tier_kwargs(targs, self.shape, num_blocks, self.dtype, host_cache_gb=host_gb) if host_gb > 0 else {}
        t0 = time.perf_counter()
        self.cache = make_cache(self.model, num_blocks, a.block_size, tier, shared)
        runner = kvhf.Runner(self.model, self.cache, backend="auto", max_batch=a.max_batch,
                             max_step_tokens=a.step_tokens + a.max_batch, max_model_len=max_len,
                             cuda_graphs=a.cuda_graphs and self.device.startswith("cuda"))
        cfg = E.EngineConfig(a.max_batch, a.step_tokens, a.chunk, seed=0, progress_every=0 if a.quiet else a.progress_every)
        self.engine = E.Engine(runner, cfg)
        if self.cache.tier is not None:
            self._time_matches(self.cache.manager)
        setup = time.perf_counter() - t0
        # The warm-up prompt is the same on every instance: B's first one is read from the shared tier, where
        # A's stored it. With a tier it is served again with the GPU prefix cache cleared: a host tier reload.
        prompt = np.random.default_rng([a.seed, 1]).integers(1, self.model.config.vocab_size, a.warmup_tokens).tolist()
        warm = []
        for again in range(2 if self.cache.tier is not None else 1):
            if again:
                self.settle(a.store_timeout)
                self.cache.manager.clear_prefix_cache()
            c0 = self.cache.stats["cached_tokens"]
            warm.append(E.Request(self._rid(), 0.0, list(prompt), a.warmup_output))
            self.engine.run(warm[-1:], log=self.log)
            self._sync()
            warm[-1].hit = self.cache.stats["cached_tokens"] - c0
        if self.cache.tier is not None:
            self.settle(a.store_timeout)
        self.log(f"pool {num_blocks} blocks, host tier {tier.get('host_tier_slots', 0)} slots ({size(host_gb * 2**30)}), "
                 f"write-through {tier.get('write_through', 0)}, shared tier {shared_addr or 'none'}; setup {setup:.1f} s; "
                 f"warm-up {a.warmup_tokens} tokens: " + ", ".join(
                     f"TTFT {(w.first_token - w.arrival) * 1e3:.1f} ms (hit {w.hit})" for w in warm))
        return {"setup_s": setup, "tier_kwargs": dict(tier), "warmup": [[w.first_token - w.arrival, w.hit] for w in warm]}

    def _time_matches(self, m: Any) -> None:
        """Counts the seconds spent in the manager's match_tiers (self.match_s):
        an admission's shared-tier fetch happens there (PagedKVCache.schedule)."""
        orig = m.match_tiers

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.match_s += time.perf_counter() - t

        m.match_tiers = timed

    def _rid(self) -> int:
        self.rid += 1
        return self.rid

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(torch.device(self.device))

    def history(self, users: List[List[List[int]]], outs: List[List[int]], turns: int) -> Dict[str, Any]:
        """Serves turns 1..turns of every session (all first turns at once,
        each next turn as its previous one finishes); returns each session's
        next turn's prompt (history and its new user tokens) and the turns'
        TTFTs."""
        of: Dict[int, Tuple[int, int]] = {}
        nxt: Dict[int, List[int]] = {}
        reqs = []
        for c in range(len(users)):
            r = E.Request(self._rid(), 0.0, list(users[c][0]), outs[c][0])
            of[r.rid] = (c, 0)
            reqs.append(r)

        def follow_up(req: Any, now: float) -> Optional[Any]:
            c, t = of[req.rid]
            prompt = req.prompt + req.outputs[req.seq_ids[0]] + users[c][t + 1]
            if t + 1 >= turns:
                nxt[c] = prompt
                return None
            r = E.Request(self._rid(), now, prompt, outs[c][t + 1])
            of[r.rid] = (c, t + 1)
            return r

        wall = self.engine.run(reqs, log=self.log, follow_up=follow_up)
        self._sync()
        done = [r for r in reqs if r.finished is not None]
        ttft = [[r.first_token - r.arrival for r in done if of[r.rid][1] == k] for k in range(turns)]
        out = sum(r.output_tokens for r in reqs)
        self.log(f"served turns 1-{turns} of {len(users)} sessions in {wall:.1f} s ({len(done)} requests, {out} output "
                 f"tokens; TTFT p50 by turn: " + ", ".join(f"{H.pct(v, 50):.0f} ms" for v in ttft) + ")")
        return {"prompts": [nxt[c] for c in range(len(users))], "wall": wall, "ttft_by_turn": ttft}

    def settle(self, timeout: float) -> Tuple[float, float]:
        """Runs the host tier's copies until no computed block waits for
        write-through (as the engine's next steps would), then waits for the
        shared tier's store thread to settle every queued block; returns the
        seconds of both."""
        t0 = time.perf_counter()
        tier, m = self.cache.tier, self.cache.manager
        stream = torch.cuda.current_stream(torch.device(self.device)) if self.device.startswith("cuda") else None
        while True:
            tier.step(stream)
            tier.drain()
            if m.tier_stats().write_through_queue == 0:
                break
        copied = time.perf_counter() - t0
        while True:
            s = m.tier_stats()
            settled = s.shared_puts_done + s.shared_puts_present + s.shared_puts_failed
            if s.shared_queue_len == 0 and settled >= s.shared_puts_queued:
                break
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"the shared tier's stores did not settle in {timeout:.0f} s: queue {s.shared_queue_len}, "
                                   f"{settled} of {s.shared_puts_queued} settled")
            time.sleep(0.002)
        return copied, time.perf_counter() - t0

    def flush_shared(self, timeout: float) -> Dict[str, Any]:
        copied, wait = self.settle(timeout)
        st = self.tier_stats()
        self.log(f"write-through flushed in {copied * 1e3:.0f} ms, shared stores settled in {wait:.2f} s: "
                 f"{st['shared_puts_done']} stored, {st['shared_puts_present']} present, {st['shared_puts_failed']} failed, "
                 f"{st['shared_puts_dropped']} dropped, {size(st['shared_bytes_written'])} written")
        return {"copy_s": copied, "settle_s": wait, "tier": st}

    def serve(self, prompts: List[List[int]], max_new: List[int]) -> List[Dict[str, Any]]:
        """Serves one turn per session, one at a time (each arriving alone,
        the last one's stores to the shared tier settled, as while a user
        thinks), recording its TTFT, hits and answer."""
        recs = []
        m, cs = self.cache.manager, self.cache.stats
        for i, (p, n) in enumerate(zip(prompts, max_new)):
            if self.cache.tier is not None:
                self.settle(self.args.store_timeout)
            s0, c0, f0 = m.tier_stats(), cs["cached_tokens"], self.match_s
            req = E.Request(self._rid(), 0.0, list(p), int(n))
            self.engine.run([req], log=self.log)
            self._sync()
            s1 = m.tier_stats()
            rec = {
                "session": i, "prompt_tokens": len(p), "ttft": req.first_token - req.arrival,
                "latency": req.finished - req.arrival, "tokens": list(req.outputs[req.seq_ids[0]]),
                "hit_tokens": cs["cached_tokens"] - c0,
                "host_hit_tokens": s1.host_hit_tokens - s0.host_hit_tokens,
                "shared_hit_tokens": (s1.shared_hit_tokens + s1.shared_match_tokens)
                - (s0.shared_hit_tokens + s0.shared_match_tokens),
                "shared_hits": s1.shared_hits - s0.shared_hits,
                "shared_bytes_read": s1.shared_bytes_read - s0.shared_bytes_read,
                "match_s": self.match_s - f0,  # in match_tiers: the shared tier's fetch, the host tier's lookup
            }
            recs.append(rec)
            self.log(f"session {i + 1}/{len(prompts)}: prompt {len(p)} tokens, hit {rec['hit_tokens']} (host "
                     f"{rec['host_hit_tokens']}, shared {rec['shared_hit_tokens']}), TTFT {rec['ttft'] * 1e3:.1f} ms "
                     f"(match/fetch {rec['match_s'] * 1e3:.1f} ms), "
                     f"{len(rec['tokens'])} tokens in {rec['latency']:.2f} s")
        return recs

    def tier_stats(self) -> Dict[str, Any]:
        summary = self.cache.tier_summary() if self.cache is not None else None
        return {k: v for k, v in (summary or {}).items() if not isinstance(v, float) or math.isfinite(v)}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.cache = self.engine = None
        self.mode = ""
        gc.collect()  # the runner's CUDA graphs and workspaces
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def worker_main(role: str, device: str, address: str) -> None:
    """A worker process: connects to the coordinator, builds its Instance
    and runs its calls, ("method", args) -> ("ok", result) or ("error", text)."""
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    conn.send(role)
    args = conn.recv()
    try:
        inst = Instance(role, device, args)
        conn.send(("ok", inst.info()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "quit":
            inst.close()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(inst, msg[0])(*msg[1], **msg[2])))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


# -- the coordinator --------------------------------------------------------------------


class Worker:
    """The coordinator's end of a worker process."""

    def __init__(self, role: str, proc: subprocess.Popen) -> None:
        self.role, self.proc, self.conn = role, proc, None

    def send(self, method: str, *args: Any, **kw: Any) -> None:
        self.conn.send((method, args, kw))

    def recv(self) -> Any:
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"instance {self.role} exited (status {self.proc.poll()})") from None
        if status != "ok":
            raise RuntimeError(f"instance {self.role} failed:\n{value}")
        return value

    def call(self, method: str, *args: Any, **kw: Any) -> Any:
        self.send(method, *args, **kw)
        return self.recv()


def start_workers(devices: List[str], args: argparse.Namespace) -> Tuple[List[Worker], Listener]:
    key = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    env = dict(os.environ, **{AUTHKEY_ENV: key.hex()})
    # The workers import the kvplug this process imported.
    pkg = str(pathlib.Path(kvplug.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, env.get("PYTHONPATH")) if p)
    workers = []
    for role, dev in zip("AB", devices):
        proc = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", role, "--devices", dev,
                                 "--connect", f"127.0.0.1:{listener.address[1]}"], env=env)
        workers.append(Worker(role, proc))
    by_role = {w.role: w for w in workers}
    for _ in workers:
        conn = listener.accept()
        by_role[conn.recv()].conn = conn
    for w in workers:
        w.conn.send(args)
    return workers, listener


def stop_workers(workers: List[Worker], graceful: bool) -> None:
    """Asks each worker to close its instance and exit (graceful), or ends
    it (after a failure, when it may be in the middle of a call)."""
    for w in workers:
        if w.proc.poll() is not None:
            continue
        if not graceful or w.conn is None:
            w.proc.terminate()
            continue
        try:
            w.call("quit")
        except (RuntimeError, OSError):
            w.proc.terminate()
    for w in workers:
        try:
            w.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def sessions(args: argparse.Namespace, vocab: int) -> Any:
    """Workload t's sessions (bench/hf_bench.py ThinkTime), turns-on-a + 1
    turns each, arriving at once, no think time."""
    ns = argparse.Namespace(t_sessions=args.sessions, scale=1.0, t_turns=args.turns_on_a + 1, t_output=args.t_output,
                            out_scale=1.0, t_user=args.t_user, t_first=args.t_first, t_rate=1.0, t_think_median=1.0,
                            t_think_p99=10.0, t_think_scale=0.0, t_pool_frac=1.0)
    return H.ThinkTime(ns, vocab)


def common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def ttft_figures(recs: List[Dict[str, Any]]) -> Dict[str, float]:
    t = [r["ttft"] for r in recs]
    return {"p50_ms": H.pct(t, 50), "p99_ms": H.pct(t, 99), "mean_ms": float(np.mean(t)) * 1e3 if t else float("nan")}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """The benchmark; returns its results (what --json writes)."""
    devices = args.devices.split(",")
    if len(devices) != 2:
        raise SystemExit(f"--devices names two devices, A's and B's: got {args.devices!r}")
    if devices[0] == devices[1] and devices[0].startswith("cuda"):
        print(f"note: both instances on {devices[0]}: they share one GPU's memory and time", flush=True)
    t_start = time.perf_counter()
    server: Any = None  # RedisServer or RedisCluster
    workers: List[Worker] = []
    listener = None
    res: Dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "connect")}}
    ok = False
    try:
        workers, listener = start_workers(devices, args)
        a, b = workers
        info = {w.role: w.recv() for w in workers}  # both build their model at once
        vocab = info["A"]["vocab"]
        bb = info["A"]["block_bytes"]
        conv = sessions(args, vocab)
        bs, k = args.block_size, args.turns_on_a
        ws = conv.working_set_blocks(bs)
        max_len = max(conv.max_len, args.warmup_tokens + args.warmup_output) + bs
        extra = len(conv.users) + args.max_batch + -(-(args.warmup_tokens + args.warmup_output) // bs) + 1
        pool_b = ws + extra
        pool_a = max(int(math.ceil(args.pool_frac * ws)), -(-max_len // bs) + 1) + extra if args.pool_frac < 1 else pool_b
        host_gb = args.host_cache_gb or 1.05 * pool_b * bb / 2**30
        if args.shared_tier:
            addr = args.shared_tier
        else:
            maxmem = H.shared_maxmemory(args, bb, pool_b)
            if args.redis_cluster:
                server = RedisCluster(args.redis_server, args.redis_cluster, maxmem, shlex.split(args.redis_args))
            else:
                server = RedisServer(args.redis_server, maxmem, shlex.split(args.redis_args))
            addr = server.address
            print(f"{pathlib.Path(server.binary).name} {server.version} on {addr}"
                  + (f", a cluster of {args.redis_cluster} primaries" if args.redis_cluster else "")
                  + f", maxmemory {size(maxmem)}", flush=True)
        nodes = server.nodes if isinstance(server, RedisCluster) else [addr]
        namespace = f"ms.{args.model}.{args.dtype}.bs{bs}.s{args.seed}.{secrets.token_hex(4)}"
        shared = {"shared_tier_namespace": namespace, "shared_tier_timeout_ms": args.shared_timeout_ms,
                  "shared_tier_put_queue": H.shared_put_queue(pool_b)}
        hist_lens = [len(u[0]) + sum(map(len, u[1:k])) + sum(o[:k]) for u, o in zip(conv.users, conv.outs)]
        print(f"kvplug {kvplug.version_string()}, torch {torch.__version__}: {args.model} {args.dtype}, "
              f"A on {info['A']['device']} ({info['A']['device_name']}), B on {info['B']['device']} "
              f"({info['B']['device_name']}); models built in {info['A']['build_s']:.1f} / {info['B']['build_s']:.1f} s",
              flush=True)
        print(f"{len(conv.users)} sessions: turns 1-{k} on A, turn {k + 1} moved to B; histories "
              f"{min(hist_lens)}-{max(hist_lens)} tokens (p50 {int(np.median(hist_lens))}), block {size(bb)}, "
              f"pools A {pool_a} / B {pool_b} blocks, host tiers {size(host_gb * 2**30)} each, shared namespace {namespace}",
              flush=True)
        res.update({"info": info, "namespace": namespace, "server": addr, "history_tokens": hist_lens,
                    "pool_blocks": {"A": pool_a, "B": pool_b}, "host_gb": host_gb, "block_bytes": bb})
        # 1. A serves the sessions' first turns; its write-through copies reach the shared tier.
        a.call("open", "", pool_a, host_gb, max_len, addr, shared)
        b.send("open", "moved", pool_b, host_gb, max_len, addr, shared)  # B gets ready meanwhile
        hist = a.call("history", conv.users, conv.outs, k)
        flush = a.call("flush_shared", args.store_timeout)
        b.recv()
        prompts = hist["prompts"]
        max_new = [min(conv.outs[c][k], args.moved_output) if args.moved_output else conv.outs[c][k]
                   for c in range(len(prompts))]
        res["history"] = {"wall": hist["wall"], "ttft_by_turn": hist["ttft_by_turn"], "flush": flush}
        # 2. Moved: B reads each history from the shared tier.
        runs: Dict[str, List[Dict[str, Any]]] = {}
        before = namespace_keys(nodes, namespace)
        runs["moved"] = b.call("serve", prompts, max_new)
        moved_tier = b.call("tier_stats")
        # B stored its moved turns' new blocks (their user tokens and answers): they go, so that the stayed
        # run below finds in the shared tier only what A stored, as before the move.
        b.call("flush_shared", args.store_timeout)
        delete_keys({n: sorted(set(ks) - set(before[n])) for n, ks in namespace_keys(nodes, namespace).items()})
        # 3. Recompute: a fresh B without the tiers (whose write-through copies would only slow it down).
        b.call("open", "recompute", pool_b, 0.0, max_len, None, {})
        runs["recompute"] = b.call("serve", prompts, max_new)
        b.call("close")
        # 4. Stayed: A serves the turn itself.
        if args.stayed:
            a.call("log", "serving the same turns itself (stayed)")
            runs["stayed"] = a.call("serve", prompts, max_new)
        a_tier = a.call("tier_stats")
        res.update({"runs": runs, "tier": {"A": a_tier, "B_moved": moved_tier}})
        if server is not None:
            inf = server.info()
            res["server_info"] = {key: inf.get(key) for key in ("used_memory", "used_memory_peak", "maxmemory", "evicted_keys",
                                                                 "keyspace_hits", "keyspace_misses", "total_net_input_bytes",
                                                                 "total_net_output_bytes")}
            res["server_info"]["keys"] = server.command("DBSIZE")
        else:  # a server of the caller's: this run's blocks go
            print(f"deleted this run's {drop_namespace(nodes, namespace)} keys (kvplug:{namespace}:*) from {addr}", flush=True)
        ok = True
    finally:
        stop_workers(workers, graceful=ok)
        if listener is not None:
            listener.close()
        if server is not None:
            server.stop()
    res["wall"] = time.perf_counter() - t_start
    res["checks"] = report(res, args)
    return res


def report(res: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """Prints the summary table; returns the checks (name -> (ok, text))."""
    runs = res["runs"]
    fig = {name: ttft_figures(r) for name, r in runs.items()}
    res["ttft"] = fig
    print(f"summary: TTFT of the moved turn (turn {args.turns_on_a + 1}), {len(runs['moved'])} sessions one at a time")
    print(f"  {'way':10s} {'p50 ms':>9s} {'p99 ms':>9s} {'mean ms':>9s}  {'hit (of prompt tokens)':>24s}  shared hit")
    for name, r in runs.items():
        f = fig[name]
        hit, tot = sum(x["hit_tokens"] for x in r), sum(x["prompt_tokens"] for x in r)
        sh = sum(x["shared_hit_tokens"] for x in r)
        print(f"  {name:10s} {H.fmt(f['p50_ms'], '9.1f')} {H.fmt(f['p99_ms'], '9.1f')} {H.fmt(f['mean_ms'], '9.1f')}  "
              f"{hit:>12d} / {tot:<9d} {hit / max(tot, 1):5.1%}  {sh} tokens")
    mv, rc = fig["moved"], fig["recompute"]
    ratio = {"p50": rc["p50_ms"] / max(mv["p50_ms"], 1e-9), "p99": rc["p99_ms"] / max(mv["p99_ms"], 1e-9),
             "mean": rc["mean_ms"] / max(mv["mean_ms"], 1e-9)}
    res["moved_vs_recompute"] = ratio
    print(f"  moved vs recompute: TTFT p50 {ratio['p50']:.2f}x lower, p99 {ratio['p99']:.2f}x, mean {ratio['mean']:.2f}x "
          f"(issue 34's target: p50 >= 3x) -> {'met' if ratio['p50'] >= 3 else 'not met'}")
    if "stayed" in fig:
        st = fig["stayed"]
        print(f"  moved vs stayed: TTFT p50 {mv['p50_ms'] / max(st['p50_ms'], 1e-9):.2f}x the stayed one's")
    fetch = [r["match_s"] for r in runs["moved"]]
    read = sum(r["shared_bytes_read"] for r in runs["moved"])
    print(f"  moved turns' fetch from the shared tier (in match_tiers): p50 {H.pct(fetch, 50):.1f} ms, p99 "
          f"{H.pct(fetch, 99):.1f} ms, {read / max(sum(fetch), 1e-9) / 1e9:.2f} GB/s ({size(read)} read)")
    fl = res["history"]["flush"]
    ta, tb = fl["tier"], res["tier"]["B_moved"]  # A's as its stores settled, before the stayed run
    print(f"  shared tier: A stored {ta.get('shared_puts_done', 0)} blocks ({size(ta.get('shared_bytes_written', 0))}; "
          f"{ta.get('shared_puts_present', 0)} present, {ta.get('shared_puts_failed', 0)} failed, "
          f"{ta.get('shared_puts_dropped', 0)} dropped; write-through stored {ta.get('write_through_stored', 0)}, lost "
          f"{ta.get('write_through_lost', 0)}), stores settled {fl['settle_s']:.2f} s after A's last turn; "
          f"B hits {tb.get('shared_hits', 0)} blocks, fetched {tb.get('shared_fetched', 0)}, "
          f"{size(tb.get('shared_bytes_read', 0))} read, misses {tb.get('shared_misses', 0)}, "
          f"errors {tb.get('shared_errors', 0)} timeouts {tb.get('shared_timeouts', 0)} corrupt {tb.get('shared_corrupt', 0)}")
    si = res.get("server_info")
    if si:
        print(f"  server: {si['keys']} keys, used memory {size(int(si['used_memory'] or 0))} (peak "
              f"{size(int(si['used_memory_peak'] or 0))}), evicted keys {si['evicted_keys']}")
    # The checks.
    checks: Dict[str, Any] = {}
    moved = runs["moved"]
    shared_hits = sum(r["shared_hits"] for r in moved)
    missed = [r["session"] for r in moved if r["shared_hit_tokens"] <= 0]
    checks["shared_read"] = (shared_hits > 0 and not missed,
                             f"B's shared hits in the moved turns: {shared_hits} blocks; moved turns without one: "
                             f"{missed or 'none'}")
    # A computed every token of a history but the last answer token: its full blocks are what B can hit.
    short = [r["session"] for r, h in zip(moved, res["history_tokens"])
             if r["hit_tokens"] < (h - 1) // args.block_size * args.block_size]
    checks["moved_hits_history"] = (not short, f"moved turns hitting less than their history's full blocks: {short or 'none'}")
    if "stayed" in runs:
        same_hit = [(m, s) for m, s in zip(moved, runs["stayed"]) if m["hit_tokens"] == s["hit_tokens"]]
        bad = [m["session"] for m, s in same_hit if m["tokens"] != s["tokens"]]
        checks["moved_equals_stayed"] = (bool(same_hit) and not bad,
                                         f"{len(same_hit) - len(bad)} of {len(same_hit)} sessions with equal hits answer alike"
                                         + (f"; differ: {bad}" if bad else ""))
    rec = runs["recompute"]
    agree = [common_prefix(m["tokens"], r["tokens"]) for m, r in zip(moved, rec)]
    equal = sum(m["tokens"] == r["tokens"] for m, r in zip(moved, rec))
    first = sum(bool(m["tokens"]) and m["tokens"][:1] == r["tokens"][:1] for m, r in zip(moved, rec))
    text = (f"{equal} of {len(moved)} answers equal, first tokens {first} of {len(moved)}, common prefix "
            f"{sum(agree)} of {sum(len(m['tokens']) for m in moved)} tokens")
    strict = args.strict_recompute or args.dtype == "float32"
    checks["moved_equals_recompute"] = (equal == len(moved) if strict else True,
                                        text + ("" if strict else " (reported; --strict-recompute asserts it)"))
    for name, (ok, text) in checks.items():
        print(f"  check {name}: {'ok' if ok else 'FAILED'}: {text}")
    print(f"  [{res['wall']:.0f} s in all]")
    return {k: {"ok": bool(ok), "text": t} for k, (ok, t) in checks.items()}


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b", choices=E.MODELS, help="the random-weight model's shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--devices", default=None, help="A's and B's devices (default: cuda:0,cuda:1 with two GPUs, else cpu,cpu)")
    ap.add_argument("--seed", type=int, default=0, help="the weights' seed (the same on both instances)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns-on-a", type=int, default=2, help="turns A serves before the session moves")
    ap.add_argument("--t-first", type=int, default=8192, help="context tokens of a session's first turn")
    ap.add_argument("--t-user", type=int, nargs=2, default=[1024, 2048], help="new user tokens of each later turn, min max")
    ap.add_argument("--t-output", type=int, nargs=2, default=[128, 256], help="output tokens a turn, min max")
    ap.add_argument("--moved-output", type=int, default=64,
                    help="at most this many output tokens of the moved turn (0: the workload's)")
    ap.add_argument("--no-stayed", dest="stayed", action="store_false", help="skip the stayed run (A serves the turn itself)")
    ap.add_argument("--strict-recompute", action="store_true",
                    help="assert that the moved answers equal the recompute baseline's in 16-bit types too (always in float32)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--step-tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=8192, help="prompt tokens of one sequence a step")
    ap.add_argument("--pool-frac", type=float, default=1.0,
                    help="A's GPU pool as a fraction of the working set (< 1: stayed turns hit A's host tier)")
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    ap.add_argument("--warmup-tokens", type=int, default=None,
                    help="the warm-up prompt's tokens (default: --chunk, at most 2048)")
    ap.add_argument("--warmup-output", type=int, default=8)
    E.add_tier_args(ap)  # --host-cache-gb (default: the working set), --write-through, --shared-tier (a running server)
    ap.set_defaults(write_through=512, write_through_slack=0)  # every computed block stored: settle waits for them
    ap.add_argument("--shared-timeout-ms", type=int, default=30000,
                    help="bound on each round trip to the server, transfer included (a moved history's blocks in one)")
    ap.add_argument("--store-timeout", type=float, default=600.0, help="seconds to wait for A's stores to settle")
    ap.add_argument("--redis-server", default="redis-server", help="the server binary to start (redis-server or valkey-server)")
    ap.add_argument("--redis-maxmemory-gb", type=float, default=0.0,
                    help="its maxmemory (default: twice the working set's blocks, plus 1 GiB)")
    ap.add_argument("--redis-args", default="", help='more redis-server arguments, e.g. "--io-threads 4"')
    ap.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                    help="start a cluster of N primaries instead of one server (the client reads their shares "
                    "of a fetch concurrently; maxmemory split among them)")
    ap.add_argument("--cpu-threads", type=int, default=0, help="torch threads of each instance on the CPU (0: half the cores)")
    ap.add_argument("--progress-every", type=float, default=10.0, help="seconds between the engines' progress lines")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--connect", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.devices is None:
        args.devices = "cuda:0,cuda:1" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu,cpu"
    if args.warmup_tokens is None:
        args.warmup_tokens = min(args.chunk, 2048)
    if args.write_through <= 0:
        ap.error("--write-through must be > 0: A's computed blocks reach the shared tier through it")
    if args.turns_on_a < 1:
        ap.error("--turns-on-a must be >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse(argv)
    if args.worker:
        worker_main(args.worker, args.devices, args.connect)
        return {}
    res = run(args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))
    failed = [k for k, c in res["checks"].items() if not c["ok"]]
    if failed:
        raise SystemExit(f"moved_sessions: checks failed: {', '.join(failed)}")
    return res


if __name__ == "__main__":
    main()
