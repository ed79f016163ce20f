#!/usr/bin/env python3
"""Serving benchmark of a transformers model on kvplug (issue 14, item 4).

A Llama-3-8B-shaped model (random bf16 weights, nothing downloaded) serves
three workloads, all requests arriving at the start:
  a: N requests sharing a 2048-token system prompt, each with 50-500 own
     tokens and 128-512 output tokens;
  b: the same with no shared prompt;
  c: P prompts (50-500 tokens) each sampled S ways (forks), 128-512 outputs.
These systems serve each (--systems):
  kvplug      the continuous-batching loop of examples/hf_engine.py on
              kvplug.hf (kvplug's manager, prefix cache and kernels; decode
              steps replayed from CUDA graphs);
  kvplug-cascade  the same with Runner(cascade=True): decode steps read
              each shared prefix block once (shared-prefix attention, routed
              to plain decode where the library's cost model says sharing
              does not pay);
  kvplug-fp8  kvplug over an FP8 (e4m3) KV cache with per-token-head scales,
              with the blocks that the kvplug system's pool memory holds
              (about twice as many; prefill on the mainloop --fp8-prefill
              picks: Hopper's, widened, by default);
  flashinfer  the same loop and manager with FlashInfer's attention
              (BatchPrefillWithPagedKVCacheWrapper for prefill and mixed
              steps, BatchDecodeWithPagedKVCacheWrapper for decode, in CUDA
              graphs too) over the same paged cache; K/V written by kvplug's
              kv_write in both;
  hf          transformers' own batched generate (SDPA, DynamicCache, left
              padding, static batches of --hf-batch), on --hf-requests of the
              workload's requests.
Output tokens/s, TTFT and TPOT percentiles, prefix hit rate, preemptions and
the host share of step time (scheduling, manager calls, planning, sampling
bookkeeping) per run, then the kvplug/flashinfer ratios.

Workload m (issue 23, host KV tier): 128 conversations x 6 turns (--m-*),
each turn adding 200-500 user tokens and 128-256 output tokens, turn k+1
arriving when turn k finished (its TTFT counts from then), turns of all
conversations interleaved; the GPU pool is --m-pool-frac (a quarter) of the
working set, so histories are evicted between turns. Its systems:
  kvplug-host  kvplug with the host KV tier (--host-cache-gb, default the
               whole working set; --demote-ahead; --demote-overlap puts
               the demotions on a side stream): evicted histories are
               demoted to pinned host memory and reloaded on the next turn,
               beside the step running then (early loads; --no-early-loads:
               in the copies of the step that computes the turn); it
               never has a shared tier;
  kvplug-shared  kvplug-host's configuration with a shared (Valkey/Redis)
               tier below the host tier: the blocks the host tier commits
               are stored there too, and an admission whose prefix goes on
               past the GPU and host tiers fetches the blocks the server
               holds into the host tier (kvplug.hf's match_tiers) instead
               of computing them. Its server is --shared-tier HOST:PORT,
               or else a throwaway one that each kvplug-shared run starts
               (--redis-server, default redis-server; valkey-server works
               too) with a maxmemory of twice the working set's blocks
               plus 1 GiB (--redis-maxmemory-gb) and stops after it. Each
               run stores under a fresh namespace (--shared-tier-namespace,
               default the model, dtype and block size, plus a random
               suffix), so it starts from an empty shared tier; on a server
               of the caller's, the run's keys are deleted after it. Round
               trips are bounded by --shared-timeout-ms; the store queue
               holds the working set's blocks (at least 256). With
               --write-through its write-through slack is kvplug-host's
               (kvplug.hf's default with a shared tier is 0, storing
               every step; --write-through-slack sets both);
  kvplug       without a tier: evicted histories are recomputed;
  kvplug-all   a GPU pool that holds the whole working set (the upper bound).
It reports TTFT p50/p99 (all turns and turns 2+), output tokens/s, the host
tier's hit rates, demotions, reloads and skips, and its load bandwidth
against a 1 GiB pinned host->device torch copy timed in the same run, and
per admission the time of its loads and whether they ran beside a step;
for kvplug-shared also the shared tier's: blocks found there and read,
tokens matched there, bytes read and written, blocks stored and stores
not made, timeouts, errors and corrupt values, and its server's keys,
peak memory and evicted keys.
kvplug-host on a, b, c measures the tier enabled but unused.
Each run of the serving loop (every system but hf) records a digest of
every finished request's output tokens (JSON "output_digests", by request
id), so that runs can be compared answer for answer.

Workload t (issue 34): sessions whose users think between turns (ThinkTime:
open-loop arrivals, a long first context, lognormal think times), the same
systems (kvplug-host, kvplug and kvplug-all by default; kvplug-shared when
named), TTFT by turn index and a plot of it (--plot).

    python bench/hf_bench.py                             # the issue's full scale
    python bench/hf_bench.py --scale 0.125 --out-scale 0.25 --hf-requests 16
    python bench/hf_bench.py --model tiny-llama --device cpu --systems kvplug --scale 0.02   # a smoke run
    python bench/hf_bench.py --workloads m                          # host tier, recompute, upper bound
    python bench/hf_bench.py --workloads a,b,c --systems kvplug,kvplug-host --host-cache-gb 32   # tier unused
    python bench/hf_bench.py --workloads a,b,c --systems kvplug,kvplug-host --both-orders   # ratios in both orders
    python bench/hf_bench.py --workloads t --write-through 512 --plot t.png   # users who think between turns
    python bench/hf_bench.py --workloads t --write-through 512 --systems kvplug,kvplug-host,kvplug-shared,kvplug-all \
        --plot t.png   # the same with the shared tier below the host tier (a redis-server the runs start)
    python bench/hf_bench.py --model tiny-llama --device cpu --dtype float32 --workloads m --scale 0.03 \
        --m-turns 3 --m-user 20 40 --m-output 8 16 --max-batch 8 --step-tokens 256 --chunk 128   # a smoke run

FlashInfer comes from the bundle of ../shared/peers/flashinfer-bundle.sh
(PYTHONPATH, FLASHINFER_* as that script says); it compiles its kernels on
first use (about 30 s for fa2 prefill and decode).
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import importlib.util
import json
import math
import os
import pathlib
import re
import secrets
import shutil
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

import kvplug
import kvplug.hf as kvhf

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_engine():
    spec = importlib.util.spec_from_file_location("hf_engine", ROOT / "examples" / "hf_engine.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hf_engine"] = mod
    spec.loader.exec_module(mod)
    return mod


E = _load_engine()


def _load_bench_module(name: str):
    """bench/<name>.py as the module `name`, or the one already loaded from
    that file (bench/moved_sessions.py imports it too, from this folder)."""
    path = ROOT / "bench" / f"{name}.py"
    mod = sys.modules.get(name)
    if mod is not None and pathlib.Path(getattr(mod, "__file__", "") or "").resolve() == path:
        return mod
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


RS = _load_bench_module("redis_server")  # the throwaway server of kvplug-shared


# -- workloads ---------------------------------------------------------------------


def workload(name: str, args, vocab: int) -> List[Any]:
    rng = np.random.default_rng({"a": 1, "b": 2, "c": 3}[name])
    o_lo, o_hi = (max(1, int(x * args.out_scale)) for x in args.output)
    reqs = []
    if name in ("a", "b"):
        n = max(1, int(round(args.requests * args.scale)))
        system = rng.integers(1, vocab, args.system).tolist() if name == "a" else None
        for i in range(n):
            own = rng.integers(1, vocab, int(rng.integers(args.own[0], args.own[1] + 1))).tolist()
            # b: a prompt of the same length with nothing shared
            prompt = (system + own) if system is not None else rng.integers(1, vocab, args.system + len(own)).tolist()
            reqs.append(E.Request(i, 0.0, prompt, int(rng.integers(o_lo, o_hi + 1))))
    else:
        p = max(1, int(round(args.prompts_c * args.scale))) if args.scale < 1 else args.prompts_c
        for i in range(p):
            prompt = rng.integers(1, vocab, int(rng.integers(args.own[0], args.own[1] + 1))).tolist()
            reqs.append(E.Request(i, 0.0, prompt, int(rng.integers(o_lo, o_hi + 1)), n=args.samples_c, temperature=1.0))
    return reqs


class MultiTurn:
    """Workload m: conversations of several turns. Turn k's prompt is turn
    k-1's prompt and outputs plus 200-500 new user tokens, with 128-256
    output tokens; every conversation's first turn arrives at the start and
    each later turn when its previous one finished (Engine.run's follow_up),
    at the back of the waiting line: turn k of the conversations runs
    roughly before turn k+1, so that a GPU pool smaller than the working set
    (every conversation's full history) evicts histories between turns.
    Its TTFT is from that arrival to the turn's first output token."""

    def __init__(self, args, vocab: int) -> None:
        rng = np.random.default_rng(4)
        n = max(1, int(round(args.m_convs * args.scale)))
        turns = args.m_turns
        o_lo, o_hi = (max(1, int(x * args.out_scale)) for x in args.m_output)
        u_lo, u_hi = args.m_user
        self.users = [[rng.integers(1, vocab, int(rng.integers(u_lo, u_hi + 1))).tolist() for _ in range(turns)]
                      for _ in range(n)]
        self.outs = [[int(rng.integers(o_lo, o_hi + 1)) for _ in range(turns)] for _ in range(n)]
        self.order = rng.permutation(n).tolist()  # the first turns' order in the waiting line
        self.turns = turns
        self.lens = [sum(map(len, u)) + sum(o) for u, o in zip(self.users, self.outs)]  # full histories
        self.max_len = max(self.lens)
        self.of: Dict[int, Any] = {}  # rid -> (conversation, turn)

    def __len__(self) -> int:
        return len(self.users) * self.turns

    def working_set_blocks(self, block_size: int) -> int:
        return sum(-(-n // block_size) for n in self.lens)

    def _request(self, conv: int, turn: int, prompt: List[int], arrival: float) -> Any:
        rid = conv * self.turns + turn
        self.of[rid] = (conv, turn)
        return E.Request(rid, arrival, prompt, self.outs[conv][turn])

    def first(self) -> List[Any]:
        self.of = {}
        return [self._request(c, 0, list(self.users[c][0]), 0.0) for c in self.order]

    def follow_up(self, req: Any, now: float) -> Optional[Any]:
        conv, turn = self.of[req.rid]
        if turn + 1 >= self.turns:
            return None
        prompt = req.prompt + req.outputs[req.seq_ids[0]] + self.users[conv][turn + 1]
        return self._request(conv, turn + 1, prompt, now)


class ThinkTime(MultiTurn):
    """Workload t: sessions of users who think between turns (issue 34).
    Sessions arrive open-loop (Poisson, --t-rate a second); a session's
    first turn brings --t-first tokens of context (a repository, a
    document), each later turn --t-user new tokens on top of the history
    and the answers (--t-output tokens); the next turn comes a think time
    after the previous one finished, drawn from a lognormal with median
    --t-think-median and p99 --t-think-p99 seconds (public coding-agent
    traces: 5 s and 81 s), times --t-think-scale. The GPU pool is
    --t-pool-frac of the working set (every session's full history), so
    histories leave the GPU while their users think; the host tier
    (kvplug-host) holds them all."""

    def __init__(self, args, vocab: int) -> None:
        rng = np.random.default_rng(5)
        n = max(1, int(round(args.t_sessions * args.scale)))
        turns = args.t_turns
        o_lo, o_hi = (max(1, int(x * args.out_scale)) for x in args.t_output)
        u_lo, u_hi = args.t_user
        self.users = [[rng.integers(1, vocab, args.t_first if k == 0 else int(rng.integers(u_lo, u_hi + 1))).tolist()
                       for k in range(turns)] for _ in range(n)]
        self.outs = [[int(rng.integers(o_lo, o_hi + 1)) for _ in range(turns)] for _ in range(n)]
        self.order = list(range(n))
        self.turns = turns
        self.lens = [sum(map(len, u)) + sum(o) for u, o in zip(self.users, self.outs)]
        self.max_len = max(self.lens)
        self.of = {}
        self.pool_frac = args.t_pool_frac
        # Arrivals: Poisson; think times: lognormal (median m, p99 p: sigma = ln(p / m) / z_0.99).
        self.starts = np.cumsum(rng.exponential(1.0 / args.t_rate, n)) - 1.0 / args.t_rate
        mu, sigma = math.log(args.t_think_median), math.log(args.t_think_p99 / args.t_think_median) / 2.3263
        self.think = (np.exp(rng.normal(mu, sigma, (n, turns))) * args.t_think_scale).tolist()

    def first(self) -> List[Any]:
        self.of = {}
        return [self._request(c, 0, list(self.users[c][0]), float(self.starts[c])) for c in self.order]

    def follow_up(self, req: Any, now: float) -> Optional[Any]:
        conv, turn = self.of[req.rid]
        if turn + 1 >= self.turns:
            return None
        prompt = req.prompt + req.outputs[req.seq_ids[0]] + self.users[conv][turn + 1]
        return self._request(conv, turn + 1, prompt, now + self.think[conv][turn])


def fresh(reqs: List[Any]) -> List[Any]:
    """The same requests with the engine's fields reset."""
    return [E.Request(r.rid, r.arrival, list(r.prompt), r.max_new_tokens, r.n, r.temperature) for r in reqs]


# -- FlashInfer over the same paged cache -----------------------------------------------


def _paged(batch: kvhf.Batch, bs: int):
    """FlashInfer's paged-KV description of a batch (CPU int32 tensors)."""
    lens = batch.seq_lens.astype(np.int64)
    nblk = (lens + bs - 1) // bs
    indptr = np.zeros(len(lens) + 1, np.int32)
    np.cumsum(nblk, out=indptr[1:])
    mask = np.arange(batch.block_table.shape[1])[None, :] < nblk[:, None]
    indices = batch.block_table[mask].astype(np.int32)
    last = ((lens - 1) % bs + 1).astype(np.int32)
    return torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last)


class _FIDecodeGraph:
    """A decode step for up to `size` sequences in a CUDA graph with
    FlashInfer's decode wrapper in graph mode (planned before each replay);
    padding rows read block 0 with length 1 and write nothing."""

    def __init__(self, runner: "FlashInferRunner", size: int, pool: Any) -> None:
        fi, c, dev = runner.fi, runner.cache, runner.cache.device
        self.runner, self.size = runner, size
        self.ids = torch.zeros((1, size), dtype=torch.long, device=dev)
        self.pos = torch.zeros((1, size), dtype=torch.long, device=dev)
        self.slots = torch.full((size,), -1, dtype=torch.int32, device=dev)
        self.w = fi.BatchDecodeWithPagedKVCacheWrapper(
            runner.fi_ws, "NHD", use_cuda_graph=True, use_tensor_cores=runner.fi_tensor_cores,
            paged_kv_indptr_buffer=torch.empty(size + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.empty(size * runner.max_blocks, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.empty(size, dtype=torch.int32, device=dev))
        self._plan(torch.arange(size + 1, dtype=torch.int32), torch.zeros(size, dtype=torch.int32),
                   torch.ones(size, dtype=torch.int32))
        ctx = kvhf.StepContext(c, "custom", self.slots, torch.zeros((size, 1), dtype=torch.int32, device=dev),
                               torch.ones(size, dtype=torch.int32, device=dev), np.arange(size + 1, dtype=np.int32),
                               np.ones(size, np.int32), True, custom=runner.attend_with(lambda: self.w))
        model = runner.model
        s = torch.cuda.Stream(device=dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2):
                model(input_ids=self.ids, position_ids=self.pos, use_cache=False, kvplug_batch=ctx)
        torch.cuda.current_stream(dev).wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model(input_ids=self.ids, position_ids=self.pos, use_cache=False, kvplug_batch=ctx).logits[0]

    def _plan(self, indptr, indices, last) -> None:
        r = self.runner
        sh = r.cache.shape
        self.w.plan(indptr, indices, last, sh.num_q_heads, sh.num_kv_heads, sh.head_dim, r.cache.block_size,
                    pos_encoding_mode="NONE", q_data_type=r.cache.dtype, kv_data_type=r.cache.dtype,
                    sm_scale=1.0 / math.sqrt(sh.head_dim))

    def load(self, batch: kvhf.Batch) -> None:
        n, pad = len(batch), self.size - len(batch)
        host = torch.from_numpy
        self.ids[0, :n].copy_(host(batch.input_ids), non_blocking=True)
        self.pos[0, :n].copy_(host(batch.seq_lens.astype(np.int64) - 1), non_blocking=True)
        self.slots.fill_(-1)
        self.slots[:n].copy_(host(batch.slot_mapping), non_blocking=True)
        indptr, indices, last = _paged(batch, self.runner.cache.block_size)
        if pad:
            top = int(indptr[-1])
            indptr = torch.cat([indptr, top + torch.arange(1, pad + 1, dtype=torch.int32)])
            indices = torch.cat([indices, torch.zeros(pad, dtype=torch.int32)])
            last = torch.cat([last, torch.ones(pad, dtype=torch.int32)])
        self._plan(indptr, indices, last)

    def replay(self, n: int) -> torch.Tensor:
        self.graph.replay()
        return self.logits[:n]


class FlashInferRunner(kvhf.Runner):
    """kvhf.Runner with FlashInfer's attention: the same cache, manager,
    block tables and slots; one FlashInfer plan per step."""

    def __init__(self, model, cache, *, prefill_backend: str = "fa2", tensor_cores: bool = True, **kw) -> None:
        import flashinfer

        self.fi = flashinfer
        self.fi_tensor_cores = tensor_cores
        self.fi_ws = torch.zeros(256 << 20, dtype=torch.uint8, device=cache.device)
        self.fi_prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.fi_ws, "NHD", backend=prefill_backend)
        self.fi_decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.fi_ws, "NHD", use_tensor_cores=tensor_cores)
        if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
            raise ValueError("the FlashInfer runner of this benchmark plans without a window")
        super().__init__(model, cache, backend="kernels", **kw)
        self._warm_prefill()

    def _warm_prefill(self) -> None:
        """One prefill call over block 0 before the timed run, so that the
        prefill backend's JIT compile (about 2 minutes for fa3) is setup,
        not the first step's time."""
        sh, c = self.cache.shape, self.cache
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=self.device)  # noqa: E731
        self.fi_prefill.plan(i32([0, 1]), i32([0, 1]), i32([0]), i32([1]), sh.num_q_heads, sh.num_kv_heads,
                             sh.head_dim, c.block_size, causal=True, q_data_type=c.dtype, kv_data_type=c.dtype)
        q = torch.zeros((1, sh.num_q_heads, sh.head_dim), dtype=c.dtype, device=self.device)
        self.fi_prefill.run(q, (c.k_cache(0), c.v_cache(0)))
        torch.cuda.synchronize(self.device)

    def attend_with(self, wrapper):
        cache = self.cache

        def attend(ctx, layer, q, k, v, scale, window_left):
            kc, vc = cache.k_cache(layer), cache.v_cache(layer)
            kvplug.attn.kv_write(k, v, kc, vc, ctx.slots)
            return wrapper().run(q.contiguous(), (kc, vc))

        return attend

    def capture(self, sizes=None) -> None:
        if sizes is None:
            sizes = [s for s in (1, 2, 4, 8) if s <= self.max_batch] + list(range(16, self.max_batch + 1, 16))
        pool = None
        with torch.no_grad():
            for s in sorted({int(x) for x in sizes if 0 < int(x) <= self.max_batch}, reverse=True):
                g = _FIDecodeGraph(self, s, pool)
                pool = g.graph.pool()
                self.graphs[s] = g
        torch.cuda.synchronize(self.device)

    def _context(self, batch: kvhf.Batch) -> kvhf.StepContext:
        sh, c = self.cache.shape, self.cache
        dev = self.device
        meta = torch.from_numpy(np.concatenate([batch.slot_mapping, batch.seq_lens]).astype(np.int32)).pin_memory()
        meta_d = meta.to(dev, non_blocking=True)
        T = batch.num_tokens
        indptr, indices, last = _paged(batch, c.block_size)
        scale = 1.0 / math.sqrt(sh.head_dim)
        if batch.is_decode:
            w = self.fi_decode
            w.plan(indptr, indices, last, sh.num_q_heads, sh.num_kv_heads, sh.head_dim, c.block_size,
                   pos_encoding_mode="NONE", q_data_type=c.dtype, kv_data_type=c.dtype, sm_scale=scale)
        else:
            w = self.fi_prefill
            w.plan(torch.from_numpy(batch.qo_indptr()), indptr, indices, last, sh.num_q_heads, sh.num_kv_heads,
                   sh.head_dim, c.block_size, causal=True, sm_scale=scale, q_data_type=c.dtype, kv_data_type=c.dtype)
        return kvhf.StepContext(c, "custom", meta_d[:T], torch.empty(0, device=dev), meta_d[T:], batch.qo_indptr(),
                                batch.seq_lens, batch.is_decode, custom=self.attend_with(lambda: w))


# -- transformers' own generate ------------------------------------------------------------


class _Times:
    """A generate streamer that notes when the first new tokens came out."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: Optional[float] = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(model, reqs: List[Any], batch: int, device: str, time_limit: float) -> Dict[str, Any]:
    model.set_attn_implementation("sdpa")
    t0 = time.perf_counter()
    out_tokens, ttft, tpot, done = 0, [], [], 0
    order = sorted(reqs, key=lambda r: len(r.prompt))  # similar lengths together: less padding
    per = max(1, batch // max(1, reqs[0].n))
    for i in range(0, len(order), per):
        if time_limit and time.perf_counter() - t0 > time_limit:
            break
        group = order[i:i + per]
        L = max(len(r.prompt) for r in group)
        ids = torch.zeros((len(group), L), dtype=torch.long)
        mask = torch.zeros((len(group), L), dtype=torch.long)
        for j, r in enumerate(group):  # left padding, as decoder-only generation needs
            ids[j, L - len(r.prompt):] = torch.tensor(r.prompt)
            mask[j, L - len(r.prompt):] = 1
        new = max(r.max_new_tokens for r in group)
        st = _Times()
        sample = group[0].temperature > 0
        with torch.no_grad():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                           do_sample=sample, temperature=1.0 if sample else None, top_k=0 if sample else None,
                           top_p=1.0 if sample else None, num_return_sequences=group[0].n, pad_token_id=0,
                           streamer=st)
        torch.cuda.synchronize() if device.startswith("cuda") else None
        end = time.perf_counter()
        for r in group:  # only the tokens a request asked for count as output
            out_tokens += r.max_new_tokens * r.n
            ttft.append(st.first - t0)
            tpot.append((end - st.first) / max(new - 1, 1))
            done += 1
    wall = time.perf_counter() - t0
    return {"wall": wall, "out_tokens": out_tokens, "finished": done, "requests": len(reqs),
            "ttft": ttft, "tpot": tpot}


# -- a run ----------------------------------------------------------------------------------


def pct(a, q) -> float:
    return float(np.percentile(a, q)) * 1e3 if len(a) else float("nan")


def fmt(v: float, spec: str) -> str:
    """v formatted by spec, or "-" in its width when v is nan (a figure the
    run has no sample of: no full-batch step, no finished request)."""
    if not math.isnan(v):
        return format(v, spec)
    width = re.match(r"\d*", spec).group()
    return format("-", ">" + width) if width else "-"


KV_GB_MAX = 40.0  # the default pool's ceiling (GiB): the issue's measurements used 40 GiB


def device_free_bytes(device: str) -> int:
    """Memory a KV pool may take on `device`: 90% of the GPU's free memory
    (after the model's weights), or half the RAM the kernel reports
    available on the CPU."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(0.9 * free)
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return avail // 2


def default_pool_blocks(args, block_bytes: int, ws: int) -> int:
    """The pool without --kv-gb or --num-blocks: the workload's working set
    (every sequence at its longest at once: no run needs more), at most
    KV_GB_MAX GiB and at most what the device has free."""
    cap = min(int(KV_GB_MAX * 2**30), device_free_bytes(args.device)) // block_bytes
    return min(ws + args.max_batch, cap)


def copy_ceiling(device: str, gib: float = 1.0, reps: int = 5) -> Optional[Dict[str, float]]:
    """GB/s of one large pinned host -> device (and device -> host) copy:
    the link's ceiling for the host tier's loads (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    n = int(gib * 2**30)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(n, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d_gbps", d, h), ("d2h_gbps", h, d)):
        dst.copy_(src, non_blocking=True)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        out[name] = reps * n / (e0.elapsed_time(e1) * 1e-3) / 1e9
    del h, d
    torch.cuda.empty_cache()
    return out


def working_set_blocks(reqs: List[Any], block_size: int) -> int:
    return sum(r.n * -(-(len(r.prompt) + r.max_new_tokens) // block_size) for r in reqs)


def run_sizes(model, reqs, args, dtype, conv: Optional[MultiTurn] = None):
    """A run's model shape, longest sequence, bytes of a block of K/V (all
    layers, K and V) and working set in blocks."""
    shape = kvhf.ModelShape.of(model.config)
    bs = args.block_size
    max_len = conv.max_len if conv is not None else max(len(r.prompt) + r.max_new_tokens for r in reqs)
    block_bytes = kvhf.tier_copy.block_bytes(shape.num_layers, bs, shape.num_kv_heads, shape.head_dim, dtype)
    ws = conv.working_set_blocks(bs) if conv is not None else working_set_blocks(reqs, bs)
    return shape, max_len, block_bytes, ws


def output_digest(req: Any) -> str:
    """A digest of a request's output tokens, its sequences in order."""
    h = hashlib.sha256()
    for sid in req.seq_ids:
        h.update(np.asarray(req.outputs.get(sid, []), dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:32]


def run_loop(system: str, model, reqs, args, dtype, conv: Optional[MultiTurn] = None,
             shared: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One system on one workload. kvplug-host: kvplug with the host KV tier
    (--host-cache-gb, default: the workload's whole working set), without a
    shared tier; kvplug-shared: the same with the shared tier of `shared`
    (run_shared's address, namespace, timeout and store queue) below it;
    kvplug-all: kvplug with a GPU pool that holds the working set (the upper
    bound). Workload m (conv): the pool defaults to --m-pool-frac of the
    working set."""
    kvhf.prepare_model(model)
    shape, max_len, block_bytes, ws = run_sizes(model, reqs, args, dtype, conv)
    bs = args.block_size
    if system == "kvplug-all":
        num_blocks = ws + (len(conv.users) if conv is not None else 0) + args.max_batch
    elif args.num_blocks:
        num_blocks = args.num_blocks
    elif conv is not None:
        num_blocks = int(math.ceil(getattr(conv, "pool_frac", args.m_pool_frac) * ws))
    elif args.kv_gb is not None:
        num_blocks = int(args.kv_gb * 2**30 // block_bytes)
    else:
        num_blocks = default_pool_blocks(args, block_bytes, ws)
    kv_dtype = None
    if system == "kvplug-fp8":
        # FP8 K/V with per-token-head scales: the blocks the same memory holds.
        kv_dtype = torch.float8_e4m3fn
        num_blocks = num_blocks * 2 * shape.head_dim // (shape.head_dim + 4)
    num_blocks = max(num_blocks, -(-max_len // bs) + 1)
    tier: Dict[str, Any] = {}
    if system in ("kvplug-host", "kvplug-shared"):
        if (system == "kvplug-shared") != (shared is not None):
            raise ValueError("run_loop: kvplug-shared runs with a shared tier (run_shared), no other system does")
        gb = args.host_cache_gb or 1.05 * ws * block_bytes / 2**30
        targs = copy.copy(args)  # --shared-tier is kvplug-shared's server: kvplug-host has none
        targs.shared_tier = shared["address"] if shared else None
        targs.shared_tier_namespace = shared["namespace"] if shared else None
        tier = E.tier_kwargs(targs, shape, num_blocks, dtype, host_cache_gb=gb)
        if shared:
            tier.update(shared_tier_timeout_ms=shared["timeout_ms"], shared_tier_put_queue=shared["put_queue"])
            if tier.get("write_through") and "write_through_slack" not in tier:
                # kvplug.hf stores every step by default with a shared tier (other instances read the blocks
                # there); here the slack stays kvplug-host's, so that the two differ by the shared tier alone.
                tier["write_through_slack"] = kvhf.PagedKVCache.default_write_through_slack(num_blocks, tier["write_through"])
    cache = kvhf.PagedKVCache.for_model(model, num_blocks, bs, kv_dtype=kv_dtype,
                                        fp8_prefill=args.fp8_prefill if kv_dtype is not None else None, **tier)
    t0 = time.perf_counter()
    kw = dict(max_batch=args.max_batch, max_step_tokens=args.step_tokens + args.max_batch, max_model_len=max_len,
              cuda_graphs=args.cuda_graphs and args.device.startswith("cuda"))
    if system in ("kvplug", "kvplug-cascade", "kvplug-host", "kvplug-shared", "kvplug-all", "kvplug-fp8"):
        # An FP8 cache decodes with shared-prefix attention only where its shared items run on Hopper's
        # mainloop (the cache's hopper_prefill: --fp8-prefill hopper or fp8); on the sm_80 tiles they are
        # slower than plain decode.
        cascade = (system == "kvplug-cascade" or args.cascade and cache.hopper_prefill) and args.device.startswith("cuda")
        runner = kvhf.Runner(model, cache, backend="auto", cascade=cascade, **kw)
    else:
        runner = FlashInferRunner(model, cache, prefill_backend=args.fi_prefill_backend, **kw)
    setup = time.perf_counter() - t0
    engine = E.Engine(runner, E.EngineConfig(args.max_batch, args.step_tokens, args.chunk, seed=0,
                                             progress_every=0 if args.quiet else 10.0))
    wall = engine.run(reqs, log=lambda s: print("    " + s, flush=True), time_limit=args.time_limit,
                      follow_up=conv.follow_up if conv is not None else None)
    done = [r for r in reqs if r.finished is not None]
    ps = cache.manager.prefix_stats()
    host = np.array(engine.host_times)
    steps = np.array(engine.step_times)
    big = [h / s for h, s, n in zip(engine.host_times, engine.step_times, engine.batch_sizes) if n >= args.max_batch * 0.9]
    res = {
        "wall": wall, "setup": setup, "out_tokens": sum(r.output_tokens for r in reqs), "finished": len(done),
        "requests": len(reqs), "ttft": [r.first_token - r.arrival for r in done],
        "tpot": [(r.finished - r.first_token) / max(r.output_tokens / r.n - 1, 1) for r in done],
        "hit_rate": ps.hit_rate, "preemptions": engine.preemptions, "steps": engine.steps,
        "graph_steps": runner.graph_steps, "graph_decode_steps": runner.graph_decode_steps, "host_share": float(host.sum() / max(steps.sum(), 1e-9)),
        "host_share_full_batch": float(np.mean(big)) if big else float("nan"),
        "peak_blocks": engine.peak_blocks, "num_blocks": num_blocks, "working_set_blocks": ws,
        "prompt_tokens": cache.stats["prompt_tokens"], "cached_tokens": cache.stats["cached_tokens"],
        "prefill_tokens": engine.prefill_tokens,
        "output_digests": {str(r.rid): output_digest(r) for r in done},
    }
    if conv is not None:
        res["requests"] = len(conv)
        res["ttft_next"] = [r.first_token - r.arrival for r in done if conv.of[r.rid][1] > 0]
        res["ttft_by_turn"] = [[r.first_token - r.arrival for r in done if conv.of[r.rid][1] == k] for k in range(conv.turns)]
        # TTFT = the wait in line (arrival to admission: seats, step tokens or GPU blocks) + the service
        # (admission to first token: reloads, prefill chunks).
        res["queue_by_turn"] = [[r.admitted - r.arrival for r in done if conv.of[r.rid][1] == k] for k in range(conv.turns)]
    if cache.tier is not None:
        res["tier"] = cache.tier_summary()
        res["tier"]["early_loads"] = cache.early_loads
        loads = [x for r in done for x in r.loads]
        if loads:
            res["loads"] = load_stats(loads)
    # Where the time goes: decode-only steps (graph replays) against steps that carry prompt tokens.
    decode = np.array(engine.step_tokens) == np.array(engine.batch_sizes)
    full = decode & (np.array(engine.batch_sizes) >= args.max_batch * 0.9)
    res.update({
        "decode_steps": int(decode.sum()), "decode_time": float(steps[decode].sum()),
        "other_time": float(steps[~decode].sum()),
        "decode_step_ms_full_batch": float(np.median(steps[full]) * 1e3) if full.any() else float("nan"),
        "host_ms_full_batch": float(np.median(host[full]) * 1e3) if full.any() else float("nan"),
    })
    cache.close()
    del runner, engine, cache
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def shared_put_queue(blocks: int) -> int:
    """The shared tier's store queue for a run of `blocks` blocks: all of
    them (the library's default of 256 would drop most of a burst of
    stores), within the queue's bounds."""
    return min(2**20, max(256, blocks))


def shared_maxmemory(args, block_bytes: int, ws: int) -> int:
    """The throwaway server's maxmemory: --redis-maxmemory-gb, or twice the
    working set's blocks (room for every one with the allocator's rounding
    and the values' headers) plus 1 GiB (the buffers of a history's read)."""
    if args.redis_maxmemory_gb:
        return int(args.redis_maxmemory_gb * 2**30)
    return 2 * ws * block_bytes + (1 << 30)


def run_shared(model, reqs, args, dtype, conv: Optional[MultiTurn] = None) -> Dict[str, Any]:
    """kvplug-shared: run_loop's kvplug-host with a shared tier below the
    host tier, on --shared-tier HOST:PORT or on a throwaway server started
    for this run (--redis-server) and stopped after it, failed or not. The
    run stores under a fresh namespace, so it starts from an empty shared
    tier; on the caller's server its keys are deleted afterwards. Adds
    "shared_server" to run_loop's results: the address and namespace, and
    for a server of its own its binary, version, pid, maxmemory and, after
    the run (the cache closed, its queued stores written), its keys, used
    and peak memory and evicted keys."""
    _, _, block_bytes, ws = run_sizes(model, reqs, args, dtype, conv)
    base = args.shared_tier_namespace or f"hf_bench.{args.model}.{str(dtype).replace('torch.', '')}.bs{args.block_size}"
    info: Dict[str, Any] = {"namespace": f"{base[:55]}.{secrets.token_hex(4)}", "timeout_ms": args.shared_timeout_ms,
                            "put_queue": shared_put_queue(ws)}
    server = None
    try:
        if args.shared_tier:
            info["address"] = args.shared_tier
        else:
            maxmem = shared_maxmemory(args, block_bytes, ws)
            server = RS.RedisServer(args.redis_server, maxmem, [])
            info.update(address=server.address, binary=server.binary, version=server.version, pid=server.proc.pid,
                        maxmemory=maxmem)
        if not args.quiet:
            print(f"    kvplug-shared: shared tier on {info['address']}"
                  + (f" ({pathlib.Path(server.binary).name} {server.version} started for this run, maxmemory "
                     f"{size(info['maxmemory'])})" if server is not None else "")
                  + f", namespace {info['namespace']}", flush=True)
        res = run_loop("kvplug-shared", model, reqs, args, dtype, conv, shared=info)
        res["shared_server"] = info
        try:  # the server's figures and the clean-up: a failure here loses no result
            if server is not None:
                figures = server.info()
                info.update({k: int(figures.get(k) or 0) for k in ("used_memory", "used_memory_peak", "evicted_keys")})
                info["keys"] = server.command("DBSIZE")
            else:
                info["deleted_keys"] = RS.drop_namespace([info["address"]], info["namespace"])
        except Exception as e:  # noqa: BLE001
            info["server_error"] = f"{type(e).__name__}: {e}"
            print(f"    kvplug-shared: reading or cleaning the server after the run failed: {info['server_error']}",
                  flush=True)
        return res
    finally:
        if server is not None:
            server.stop()


def size(n: float) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 2**k:
            return f"{n / 2**k:.2f} {unit}"
    return f"{int(n)} B"


def shared_text(r: Dict[str, Any]) -> str:
    """kvplug-shared's shared tier figures (kvplug.hf's tier_summary: the
    manager's shared_* counters, which kvplug.hf.tier_copy.summary_lines
    lists) and its server's, or "" for a run without a shared tier.
    kvplug.hf reads the shared tier in match_tiers, before an admission:
    the tokens a match found in blocks its own fetch read are
    shared_match_tokens, an admission's shared_hit_tokens. Fetched blocks
    are not held for the admission: those that leave the host tier before
    it are fetched, and counted, again."""
    sv, t = r.get("shared_server"), r.get("tier")
    if not sv or not t:
        return ""
    text = (f"  | shared tier {sv['address']}: {t['shared_hits']} blocks found in {t['shared_lookups']} lookups "
            f"({t['shared_remembered']} prompts not looked up: lacked within the last second), "
            f"{t['shared_fetched']} read into the host tier ({t['shared_fetch_misses']} missed on read), "
            f"{size(t['shared_bytes_read'])} read, tokens matched there {t['shared_match_tokens']} (match_tiers) + "
            f"{t['shared_hit_tokens']} (admissions); "
            f"stored {t['shared_puts_done']} of {t['shared_puts_queued']} blocks queued ({t['shared_puts_present']} there "
            f"already, {t['shared_puts_failed']} failed, {t['shared_queue_len']} waiting; {t['shared_puts_dropped']} not "
            f"queued: queue full), {size(t['shared_bytes_written'])} written; failures: {t['shared_timeouts']} timeouts, "
            f"{t['shared_errors']} errors, {t['shared_corrupt']} corrupt, {t['shared_skipped']} calls skipped")
    if "keys" in sv:
        text += (f"; server {sv['keys']} keys, {size(sv['used_memory_peak'])} peak of {size(sv['maxmemory'])}, "
                 f"{sv['evicted_keys']} evicted")
    return text


def load_stats(loads: List[Any]) -> Dict[str, Any]:
    """The host tier loads of the admissions (kvplug.hf.tier_copy.LoadRecord):
    how many joined the step after their admission, overlapped a step's
    forward pass and had landed when their step began, and their times."""
    secs = [x.seconds for x in loads if x.seconds is not None]
    return {"admissions": len(loads), "deferred": sum(x.deferred for x in loads),
            "overlapped": sum(x.overlapped for x in loads), "hidden": sum(bool(x.hidden) for x in loads),
            "ms_p50": pct(secs, 50), "ms_p99": pct(secs, 99), "ms_sum": float(sum(secs)) * 1e3,
            "mib_mean": float(np.mean([x.bytes for x in loads]) / 2**20)}


def load_text(r: Dict[str, Any]) -> str:
    ld = r.get("loads")
    if not ld:
        return ""
    return (f", loads per admission p50 / p99 {fmt(ld['ms_p50'], '.1f')} / {fmt(ld['ms_p99'], '.1f')} ms "
            f"({ld['mib_mean']:.0f} MiB), {ld['overlapped']}/{ld['admissions']} beside a step's forward pass "
            f"({ld['hidden']} landed before it ended)")


def multi_turn_summary(wl: str, systems: List[str], results: Dict[str, Dict[str, Any]],
                       ceiling: Optional[Dict[str, float]], plot: str) -> None:
    """The multi-turn workloads' (m, t) table: TTFT p50 / p99 over all turns
    and turns 2+, output tokens/s, the tier's loads and hits; per turn index
    (turn 1 apart) for t; the ratios to recompute; a PNG of TTFT by turn."""
    print(f"multi-turn ({wl}): TTFT p50 / p99 ms (turns 2+), output tokens/s, loads vs the pinned copy ceiling:")
    for system in systems:
        r = results.get(f"{wl}/{system}")
        if r is None:
            continue
        t = r.get("tier")
        load = ""
        if t:
            load = f"  loads {t['reload_bytes'] / 2**30:.2f} GiB at {t['load_gbps']:.1f} GB/s"
            load += f" = {t['load_gbps'] / ceiling['h2d_gbps']:.0%} of {ceiling['h2d_gbps']:.1f}" if ceiling else ""
            load += f", hit host {t['host_hit_rate']:.1%} GPU {t['gpu_hit_rate']:.1%}" + load_text(r) + shared_text(r)
        tpot = pct(r["tpot"], 50)
        print(f"  {system:13s} {fmt(pct(r['ttft'], 50), '8.1f')} / {fmt(pct(r['ttft'], 99), '8.1f')} "
              f"({fmt(pct(r['ttft_next'], 50), '.1f')} / {fmt(pct(r['ttft_next'], 99), '.1f')})  "
              f"TPOT p50 {fmt(tpot, '.1f')}  {r['out_tokens'] / max(r['wall'], 1e-9):8.1f} tok/s, prefix hit "
              f"{r['cached_tokens'] / max(r['prompt_tokens'], 1):.1%}" + load)
        if wl == "t":
            print("      TTFT p50 / p99 ms by turn: " + "  ".join(
                f"{k + 1}: {fmt(pct(v, 50), '.0f')} / {fmt(pct(v, 99), '.0f')}" for k, v in enumerate(r["ttft_by_turn"])))
            if "queue_by_turn" in r:
                print("      of which waiting for admission, p50 / p99 ms by turn: " + "  ".join(
                    f"{k + 1}: {fmt(pct(v, 50), '.0f')} / {fmt(pct(v, 99), '.0f')}" for k, v in enumerate(r["queue_by_turn"])))
    base, top = results.get(f"{wl}/kvplug"), results.get(f"{wl}/kvplug-all")
    for name in ("kvplug-host", "kvplug-shared"):
        h = results.get(f"{wl}/{name}")
        if h and base:
            print(f"  {name} vs kvplug (recompute): TTFT p50 {fmt(pct(base['ttft'], 50) / max(pct(h['ttft'], 50), 1e-9), '.2f')}x "
                  f"lower (turns 2+ {fmt(pct(base['ttft_next'], 50) / max(pct(h['ttft_next'], 50), 1e-9), '.2f')}x), "
                  f"output tokens/s {h['out_tokens'] / h['wall'] / max(base['out_tokens'] / base['wall'], 1e-9):.2f}x")
        if h and top:
            print(f"  {name} vs kvplug-all (the upper bound): turns 2+ TTFT p50 "
                  f"{fmt(pct(h['ttft_next'], 50) / max(pct(top['ttft_next'], 50), 1e-9), '.2f')}x")
    h, sh = results.get(f"{wl}/kvplug-host"), results.get(f"{wl}/kvplug-shared")
    if h and sh:
        print(f"  kvplug-shared vs kvplug-host (the shared tier below the host tier): TTFT p50 "
              f"{fmt(pct(sh['ttft'], 50) / max(pct(h['ttft'], 50), 1e-9), '.2f')}x (turns 2+ "
              f"{fmt(pct(sh['ttft_next'], 50) / max(pct(h['ttft_next'], 50), 1e-9), '.2f')}x), output tokens/s "
              f"{sh['out_tokens'] / sh['wall'] / max(h['out_tokens'] / h['wall'], 1e-9):.2f}x, prefill tokens "
              f"{sh['prefill_tokens']} against {h['prefill_tokens']}")
    if ceiling:
        results[f"{wl}/ceiling"] = ceiling
    if plot and wl == "t":
        plot_ttft_by_turn(plot, {s: results[f"{wl}/{s}"] for s in systems if f"{wl}/{s}" in results})


def plot_ttft_by_turn(path: str, runs: Dict[str, Dict[str, Any]]) -> None:
    """A PNG of TTFT p50 (solid) and p99 (dashed) by turn, a colour per
    system (`python bench/hf_bench.py --replot out.json fig.png` redraws it
    from a run's --json)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"  plot {path}: matplotlib is not installed; no plot written")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, (system, r) in enumerate(runs.items()):
        turns = list(range(1, len(r["ttft_by_turn"]) + 1))
        c = f"C{k}"
        ax.plot(turns, [pct(v, 50) for v in r["ttft_by_turn"]], color=c, marker="o", label=f"{system} p50")
        ax.plot(turns, [pct(v, 99) for v in r["ttft_by_turn"]], color=c, linestyle="--", label=f"{system} p99")
        ax.set_xticks(turns)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_yscale("log")
    ax.set_title("workload t: TTFT by turn")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"  plot: {path}")


RATIOS = (("kvplug", "flashinfer", ".2f"), ("kvplug-cascade", "flashinfer", ".2f"), ("kvplug", "hf", ".1f"),
          ("kvplug-host", "kvplug", ".3f"), ("kvplug-shared", "kvplug", ".3f"), ("kvplug-shared", "kvplug-host", ".3f"),
          ("kvplug-fp8", "kvplug", ".3f"))


def summary_lines(wl: str, systems: List[str], results: Dict[str, Any], both_orders: bool = False) -> List[str]:
    """The summary of one workload: output tokens/s of each system and the
    ratios of RATIOS it has; with both orders, each ratio in the first
    order, the second (the systems reversed) and their geometric mean."""
    def row(suffix: str) -> Dict[str, float]:
        return {s: results[f"{wl}/{s}{suffix}"]["out_tokens"] / results[f"{wl}/{s}{suffix}"]["wall"]
                for s in systems if f"{wl}/{s}{suffix}" in results}

    first, second = row(""), row("@2") if both_orders else {}
    text = f"  {wl}: " + "  ".join(f"{s} {v:.0f}" for s, v in first.items())
    if second:
        text += "  | reversed: " + "  ".join(f"{s} {v:.0f}" for s, v in second.items())
    for a, b, f in RATIOS:
        if a in first and b in first:
            r1 = first[a] / first[b]
            text += f"  {a}/{b} {r1:{f}}x"
            if a in second and b in second:
                r2 = second[a] / second[b]
                text += f" (reversed {r2:{f}}x, geometric mean {math.sqrt(r1 * r2):{f}}x)"
    return [text]


def tier_text(r: Dict[str, Any], ceiling: Optional[Dict[str, float]]) -> str:
    t = r.get("tier")
    if not t:
        return ""
    of = f" = {t['load_gbps'] / ceiling['h2d_gbps']:.0%} of the pinned copy's {ceiling['h2d_gbps']:.1f}" if ceiling else ""
    return (f"  | host tier {t['host_bytes'] / 2**30:.1f} GiB: hit host {t['host_hit_rate']:.1%} GPU "
            f"{t['gpu_hit_rate']:.1%}, demotions {t['demotions_completed']}, reloads {t['reloads_completed']}, skipped "
            f"{t['skipped_full']} full / {t['skipped_present']} present / {t['evicted_undemoted']} undemoted, "
            + (f"stores {t.get('write_through_stored', 0)} (lost {t.get('write_through_lost', 0)}), "
               if t.get("write_through") else "")
            + f"schedules that waited for copies {t.get('tier_waits', 0)}, "
            f"loads {t['reload_bytes'] / 2**30:.2f} GiB at {t['load_gbps']:.1f} GB/s{of}" + load_text(r))


def line(system: str, wl: str, r: Dict[str, Any], ceiling: Optional[Dict[str, float]] = None) -> str:
    tps = r["out_tokens"] / max(r["wall"], 1e-9)
    extra = ""
    if "ttft_next" in r:
        extra += (f"  turns 2+ TTFT p50 {fmt(pct(r['ttft_next'], 50), '.1f')} p99 {fmt(pct(r['ttft_next'], 99), '.1f')} ms"
                  f"  pool {r['num_blocks']} blocks ({r['num_blocks'] / max(r['working_set_blocks'], 1):.2f} of the "
                  f"working set), prefill {r['prefill_tokens']} tokens")
    if "hit_rate" in r:
        extra += (f"  hit {r['hit_rate']:5.1%}  preempt {r['preemptions']:4d}  host {r['host_share']:5.1%}"
                  f" (full batch {fmt(r['host_share_full_batch'], '.1%')})  graphs {r['graph_steps']}/{r['steps']}"
                  f" ({r['graph_decode_steps']} routed to paged_decode)"
                  f"  decode steps {r['decode_steps']} {r['decode_time']:.1f} s, others {r['other_time']:.1f} s,"
                  + (f" full-batch decode step p50 {r['decode_step_ms_full_batch']:.1f} ms"
                     f" (host {r['host_ms_full_batch']:.2f} ms)" if not math.isnan(r["decode_step_ms_full_batch"])
                     else " no full-batch decode step"))
    extra += tier_text(r, ceiling) + shared_text(r)
    return (f"  {wl}  {system:13s} {r['finished']:4d}/{r['requests']:<4d} {r['wall']:7.1f} s  {tps:9.1f} tok/s  "
            f"TTFT p50 {fmt(pct(r['ttft'], 50), '8.1f')} p99 {fmt(pct(r['ttft'], 99), '8.1f')} ms  "
            f"TPOT p50 {fmt(pct(r['tpot'], 50), '6.1f')} p99 {fmt(pct(r['tpot'], 99), '6.1f')} ms" + extra)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workloads", default="a,b,c", help="a, b, c and m (multi-turn), comma separated")
    ap.add_argument("--systems", default=None,
                    help="kvplug, kvplug-host, kvplug-shared, kvplug-all, kvplug-cascade, kvplug-fp8, flashinfer, hf "
                    "(default: kvplug,flashinfer,hf for a, b, c; kvplug-host,kvplug,kvplug-all for m and t)")
    ap.add_argument("--requests", type=int, default=512, help="requests of a and b (times --scale)")
    ap.add_argument("--prompts-c", type=int, default=16, help="prompts of c (times --scale when < 1)")
    ap.add_argument("--samples-c", type=int, default=32, help="samples per prompt of c")
    ap.add_argument("--scale", type=float, default=1.0, help="scales the request counts")
    ap.add_argument("--system", type=int, default=2048, help="shared system-prompt tokens of a")
    ap.add_argument("--own", type=int, nargs=2, default=[50, 500])
    ap.add_argument("--output", type=int, nargs=2, default=[128, 512])
    ap.add_argument("--out-scale", type=float, default=1.0, help="scales the output lengths")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--step-tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--fp8-prefill", default="hopper", choices=["sm80", "hopper", "fp8"],
                    help="kvplug-fp8's prefill over its FP8 cache: sm80, hopper (widened on wgmma) or fp8 (FP8 Q/K/V)")
    ap.add_argument("--kv-gb", type=float, default=None,
                    help="KV pool size (GiB) unless --num-blocks (default: the workload's working set, at most "
                    f"{KV_GB_MAX:.0f} GiB and at most 90%% of the GPU's free memory, or half the available RAM on the CPU)")
    ap.add_argument("--num-blocks", type=int, default=0)
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    ap.add_argument("--cascade", action="store_true",
                    help="the kvplug system decodes with shared-prefix (cascade) attention too "
                    "(or name kvplug-cascade in --systems to measure both)")
    ap.add_argument("--fi-prefill-backend", default="fa2", help="FlashInfer prefill backend (fa3 compiles for ~2 min)")
    ap.add_argument("--hf-requests", type=int, default=64, help="requests (c: prompts) transformers' generate serves")
    ap.add_argument("--hf-batch", type=int, default=64, help="sequences per generate call")
    ap.add_argument("--m-convs", type=int, default=128, help="conversations of m (times --scale)")
    ap.add_argument("--m-turns", type=int, default=6, help="turns per conversation of m")
    ap.add_argument("--m-user", type=int, nargs=2, default=[200, 500], help="new user tokens per turn of m, min max")
    ap.add_argument("--m-output", type=int, nargs=2, default=[128, 256],
                    help="output tokens per turn of m, min max (times --out-scale)")
    ap.add_argument("--m-pool-frac", type=float, default=0.25,
                    help="m's GPU pool (kvplug, kvplug-host) as a fraction of its working set, unless --num-blocks")
    ap.add_argument("--t-sessions", type=int, default=64, help="sessions of t (times --scale)")
    ap.add_argument("--t-rate", type=float, default=2.0, help="sessions of t arriving a second (Poisson)")
    ap.add_argument("--t-turns", type=int, default=6, help="turns per session of t")
    ap.add_argument("--t-first", type=int, default=8192, help="context tokens of t's first turn")
    ap.add_argument("--t-user", type=int, nargs=2, default=[1024, 2048], help="new user tokens per later turn of t")
    ap.add_argument("--t-output", type=int, nargs=2, default=[128, 256],
                    help="output tokens per turn of t, min max (times --out-scale)")
    ap.add_argument("--t-think-median", type=float, default=5.0, help="median think time of t between turns (s)")
    ap.add_argument("--t-think-p99", type=float, default=80.0, help="p99 think time of t (s)")
    ap.add_argument("--t-think-scale", type=float, default=1.0, help="scales t's think times")
    ap.add_argument("--t-pool-frac", type=float, default=0.25,
                    help="t's GPU pool (kvplug, kvplug-host) as a fraction of its working set, unless --num-blocks")
    ap.add_argument("--plot", default="", help="t: write a PNG of TTFT by turn here (needs matplotlib)")
    ap.add_argument("--replot", nargs=2, metavar=("JSON", "PNG"), default=None,
                    help="redraw the plot of workload t from a run's --json, and exit")
    E.add_tier_args(ap)  # --host-cache-gb (kvplug-host, kvplug-shared; default: the working set), --demote-ahead, ...
    ap._option_string_actions["--shared-tier"].help = (
        "the kvplug-shared system's Valkey/Redis server (default: a throwaway one each kvplug-shared run starts, "
        "--redis-server); kvplug-host never has a shared tier")
    ap._option_string_actions["--shared-tier-namespace"].help = (
        "kvplug-shared's namespace in the shared tier, before the random suffix each run adds (default: the model, "
        "dtype and block size)")
    ap.add_argument("--redis-server", default="redis-server", metavar="BIN",
                    help="kvplug-shared without --shared-tier: the server binary each run starts and stops "
                    "(redis-server or valkey-server)")
    ap.add_argument("--redis-maxmemory-gb", type=float, default=0.0,
                    help="that server's maxmemory (default: twice the working set's blocks, plus 1 GiB)")
    ap.add_argument("--shared-timeout-ms", type=int, default=30000,
                    help="kvplug-shared: bound on each round trip to the server, transfer included (a history's "
                    "blocks are read in one)")
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds per run (0: none); unfinished requests are left out")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--both-orders", action="store_true",
                    help="run each workload's systems in the given order, then again in the reverse order (the "
                         "second runs' results keyed SYSTEM@2), and give each ratio in both orders and their "
                         "geometric mean: whichever system runs a workload first pays its warm-up")
    args = ap.parse_args(argv)
    if args.replot:
        saved = json.loads(pathlib.Path(args.replot[0]).read_text())
        plot_ttft_by_turn(args.replot[1], {k.split("/", 1)[1]: v for k, v in saved.items()
                                           if k.startswith("t/") and "ttft_by_turn" in v})
        return

    systems_of = {wl: (args.systems or ("kvplug-host,kvplug,kvplug-all" if wl in ("m", "t") else "kvplug,flashinfer,hf"))
                  .split(",") for wl in args.workloads.split(",")}
    named = {s for v in systems_of.values() for s in v}
    # Before the model is built and any run.
    if args.shared_tier and "kvplug-shared" not in named:
        raise SystemExit("--shared-tier is the kvplug-shared system's server (kvplug-host never has a shared tier): "
                         "name kvplug-shared in --systems")
    if "kvplug-shared" in named:
        if not kvhf.tier_copy.manager_takes("shared_tier"):
            raise SystemExit("kvplug-shared: this kvplug binding has no shared tier (kvplug.Manager takes no shared_tier)")
        if not args.shared_tier and shutil.which(args.redis_server) is None:
            raise SystemExit(f"kvplug-shared: --redis-server {args.redis_server} not found (install redis-server or "
                             "valkey-server, or pass its path, or --shared-tier HOST:PORT for a running server)")
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = E.make_model(args.model, dtype, args.device)
    vocab = model.config.vocab_size
    print(f"kvplug {kvplug.version_string()}, torch {torch.__version__}, {args.model} {args.dtype} on {args.device} "
          f"({time.perf_counter() - t0:.1f} s to build), "
          f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}", flush=True)
    ceiling = None
    if named & {"kvplug-host", "kvplug-shared"}:
        ceiling = copy_ceiling(args.device)
        if ceiling:
            print(f"pinned copy ceiling (1 GiB, torch): host->device {ceiling['h2d_gbps']:.1f} GB/s, "
                  f"device->host {ceiling['d2h_gbps']:.1f} GB/s", flush=True)
    results: Dict[str, Dict[str, Any]] = {}
    for wl in args.workloads.split(","):
        conv = None
        if wl in ("m", "t"):
            conv = MultiTurn(args, vocab) if wl == "m" else ThinkTime(args, vocab)
            bs = args.block_size
            print(f"workload {wl}: {len(conv.users)} conversations x {conv.turns} turns, histories up to {conv.max_len} "
                  f"tokens, working set {sum(conv.lens)} tokens = {conv.working_set_blocks(bs)} blocks of {bs}"
                  + (f"; sessions arriving {args.t_rate}/s, think times median {args.t_think_median * args.t_think_scale:.1f} s, "
                     f"p99 {args.t_think_p99 * args.t_think_scale:.1f} s" if wl == "t" else ""), flush=True)
        else:
            reqs = workload(wl, args, vocab)
            toks = sum(len(r.prompt) for r in reqs)
            print(f"workload {wl}: {len(reqs)} requests x {reqs[0].n}, {toks} prompt tokens, "
                  f"{sum(r.max_new_tokens * r.n for r in reqs)} output tokens", flush=True)
        order = list(systems_of[wl]) + (list(reversed(systems_of[wl])) if args.both_orders else [])
        for k, system in enumerate(order):
            key = f"{wl}/{system}" + ("@2" if k >= len(systems_of[wl]) else "")
            t1 = time.perf_counter()
            if system == "hf":
                if conv is not None:
                    raise SystemExit(f"the hf system does not serve workload {wl}")
                sub = fresh(reqs[:args.hf_requests])
                r = run_hf(model, sub, args.hf_batch, args.device, args.time_limit)
            elif system == "kvplug-shared":
                r = run_shared(model, conv.first() if conv is not None else fresh(reqs), args, dtype, conv)
            elif system in ("kvplug", "kvplug-cascade", "kvplug-host", "kvplug-all", "kvplug-fp8", "flashinfer"):
                r = run_loop(system, model, conv.first() if conv is not None else fresh(reqs), args, dtype, conv)
            else:
                raise SystemExit(f"unknown system {system!r}: kvplug, kvplug-host, kvplug-shared, kvplug-all, "
                                 "kvplug-cascade, kvplug-fp8, flashinfer or hf")
            results[key] = r
            print(line(system, wl, r, ceiling) + f"  [{time.perf_counter() - t1:.0f} s]", flush=True)
    for mt in ("m", "t"):
        if mt not in systems_of:
            continue
        multi_turn_summary(mt, systems_of[mt], results, ceiling, args.plot if mt == "t" else "")
    print("summary (output tokens/s; kvplug / flashinfer):")
    for wl in args.workloads.split(","):
        for line_ in summary_lines(wl, systems_of[wl], results, args.both_orders):
            print(line_)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
