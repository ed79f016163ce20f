#!/usr/bin/env python3
"""A synthetic serving trace driven through kvplug's Python API.

Requests arrive as a Poisson process with prompts of 50-2000 tokens and
outputs of 20-500 tokens. Each step the scheduler admits waiting requests
(prefill, within a token budget), grows every running request by its one
decode token, describes the batch's block table, lengths and slots (what
the attention kernels would read), and retires finished requests. When the
pool runs out of blocks, it preempts the newest running request (removes
it, requeues it first in line, to be recomputed) and retries: the manager's
all-or-none grow makes that safe.

    python bench/demo.py [--seed 0] [--steps 2000] [--quiet]

The run is deterministic for a seed (all but the timings). Its summary: the
requests served, the steps, blocks used and peak, fragmentation (the empty
slots in partially filled last blocks), the cost of a step's kvplug calls
(grow + describe) in microseconds, and the KV bytes a decode step reads with
plain decode and with shared-prefix attention: each step the decoding
batch's sharing is planned from the manager's block tables
(kvplug.cascade.plan_from_manager, host only, so no GPU is needed) for a
Llama-3.1-8B-shaped model. The prefix-cache comparison that follows (a
multi-tenant trace: requests start with one of 100 system prompts) reports
the same, where sequences of a tenant share their system prompt's blocks.

Parts other features add to: `Workload` (what arrives), `Engine.admit`
(how a request gets its blocks), and `SECTIONS` (the summary's sections).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from typing import Callable, Deque, Dict, List, Optional

import numpy as np

import kvplug
from kvplug import attn, cascade

# The model whose decode reads are counted: Llama-3.1-8B's attention shape.
# The planner needs the heads (whether a shared run pays for its partial
# states depends on them); bytes are K and V of every layer.
KV_MODEL = "Llama-3.1-8B shape: 32 layers, 32 q / 8 kv heads of 128, bf16"
KV_LAYERS, KV_Q_HEADS, KV_HEADS, KV_HEAD_DIM, KV_DTYPE_BYTES = 32, 32, 8, 128, 2
KV_TOKEN_BYTES = 2 * KV_HEADS * KV_HEAD_DIM * KV_DTYPE_BYTES * KV_LAYERS  # 128 KiB


@dataclasses.dataclass
class Config:
    seed: int = 0
    steps: int = 4000  # the step budget
    arrival_rate: float = 0.3  # mean requests arriving per step (Poisson)
    prompt_len: tuple = (50, 2000)  # uniform, inclusive
    output_len: tuple = (20, 500)  # uniform, inclusive
    num_blocks: int = 6000
    block_size: int = 16
    max_running: int = 256  # the batch limit
    prefill_budget: int = 8192  # prompt tokens admitted per step at most
    progress_every: int = 500  # steps between progress lines (0: none)


@dataclasses.dataclass
class Request:
    rid: int
    arrival: int
    prompt_len: int
    output_len: int
    generated: int = 0  # output tokens produced so far (kept across preemption)
    preempted: int = 0

    @property
    def context_len(self) -> int:
        """Tokens to (re)compute on admission: the prompt and any output so far."""
        return self.prompt_len + self.generated


class Workload:
    """Poisson arrivals with uniform prompt and output lengths."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.next_id = 0

    def arrivals(self, step: int) -> List[Request]:
        out = []
        for _ in range(int(self.rng.poisson(self.cfg.arrival_rate))):
            p = int(self.rng.integers(self.cfg.prompt_len[0], self.cfg.prompt_len[1] + 1))
            o = int(self.rng.integers(self.cfg.output_len[0], self.cfg.output_len[1] + 1))
            out.append(Request(self.next_id, step, p, o))
            self.next_id += 1
        return out


@dataclasses.dataclass
class Metrics:
    arrived: int = 0
    served: int = 0
    preemptions: int = 0
    admitted: int = 0
    tokens_generated: int = 0
    step_us: List[float] = dataclasses.field(default_factory=list)
    used_blocks: List[int] = dataclasses.field(default_factory=list)
    waste: List[int] = dataclasses.field(default_factory=list)
    allocated_slots: List[int] = dataclasses.field(default_factory=list)
    running: List[int] = dataclasses.field(default_factory=list)
    latency_steps: List[int] = dataclasses.field(default_factory=list)
    # Per step with decoding requests: KV tokens (per kv head, all of the
    # batch) plain decode reads; those shared-prefix attention reads (each
    # shared run once); those the step reads as planned (the planner takes
    # the cascade route only where its cost model predicts it faster); the
    # planning call's cost.
    kv_plain: List[int] = dataclasses.field(default_factory=list)
    kv_shared: List[int] = dataclasses.field(default_factory=list)
    kv_planned: List[int] = dataclasses.field(default_factory=list)
    cascade_steps: int = 0
    plan_us: List[float] = dataclasses.field(default_factory=list)


class Engine:
    """The scheduler loop over one kvplug.Manager."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.m = self.new_manager()
        self.waiting: Deque[Request] = collections.deque()
        self.running: Dict[int, Request] = {}  # insertion order = admission order
        self.metrics = Metrics()
        # Buffers the step's describe writes into, allocated once, as an engine would.
        max_len = cfg.prompt_len[1] + cfg.output_len[1]
        self.max_blocks = -(-max_len // cfg.block_size)
        self.table = np.empty((cfg.max_running, self.max_blocks), np.int32)
        self.lens = np.empty(cfg.max_running, np.int32)
        self.slots = np.empty(cfg.prefill_budget + cfg.output_len[1] + cfg.max_running, np.int32)

    def new_manager(self) -> kvplug.Manager:
        return kvplug.Manager(self.cfg.num_blocks, self.cfg.block_size)

    # -- the stages of a step -------------------------------------------------

    def grow_decoding(self, ids: np.ndarray) -> None:
        """Grows the decoding requests by their one new token each."""
        self.m.grow(ids, 1)

    def admit(self, req: Request) -> bool:
        """Gives req its blocks; False when the pool is too full (nothing changed)."""
        try:
            self.m.add(req.rid, req.context_len)
        except kvplug.OutOfBlocksError:
            return False
        return True

    def admit_waiting(self) -> List[int]:
        budget = self.cfg.prefill_budget
        new: List[int] = []
        while self.waiting and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            if req.context_len > budget and new:
                break
            if not self.admit(req):
                break
            self.waiting.popleft()
            self.running[req.rid] = req
            budget -= req.context_len
            new.append(req.rid)
            self.metrics.admitted += 1
        return new

    def plan_decode_reads(self, ids: np.ndarray) -> None:
        """Plans the decoding batch's shared-prefix attention from the
        manager's block tables (host only: the summary, no workspaces) and
        records the KV tokens a step reads with and without it. A plan on
        the decode route (sharing predicted not to pay) reads what plain
        decode reads."""
        t0 = time.perf_counter()
        p = cascade.plan_from_manager(self.m, ids, self.max_blocks, KV_Q_HEADS, KV_HEADS, KV_HEAD_DIM, attn.DTYPE_BF16)
        self.metrics.plan_us.append((time.perf_counter() - t0) * 1e6)
        cascaded = p.route == cascade.ROUTE_CASCADE
        mt = self.metrics
        mt.kv_plain.append(p.total_tokens)
        mt.kv_shared.append(p.total_tokens - p.saved_tokens)
        mt.kv_planned.append(p.total_tokens - p.saved_tokens if cascaded else p.total_tokens)
        mt.cascade_steps += int(cascaded)

    def preempt_newest(self, decoding: List[int]) -> None:
        rid = next(reversed(self.running))
        req = self.running.pop(rid)
        self.m.remove(rid)
        req.preempted += 1
        self.waiting.appendleft(req)
        self.metrics.preemptions += 1
        if rid in decoding:
            decoding.remove(rid)

    def step(self, step: int) -> None:
        new = self.admit_waiting()
        new_set = set(new)
        decoding = [rid for rid in self.running if rid not in new_set]
        # Timed: the step's kvplug calls, not the Python bookkeeping around them.
        cost = 0.0
        ids = np.array(decoding, np.int64)
        while decoding:
            t0 = time.perf_counter()
            try:
                self.grow_decoding(ids)
                cost += time.perf_counter() - t0
                break
            except kvplug.OutOfBlocksError:
                cost += time.perf_counter() - t0
                self.preempt_newest(decoding)
                ids = np.array(decoding, np.int64)
        batch = np.fromiter(self.running, np.int64, len(self.running))
        if len(batch):
            t0 = time.perf_counter()
            self.m.describe_into(batch, self.table, self.lens, self.slots)
            cost += time.perf_counter() - t0
        self.metrics.step_us.append(cost * 1e6)
        if decoding:
            self.plan_decode_reads(ids)

        # The model would run here and sample a token for each decoding request;
        # then the step is marked computed, before its finished requests go.
        t0 = time.perf_counter()
        self.m.mark_computed()
        self.metrics.step_us[-1] += (time.perf_counter() - t0) * 1e6
        finished = []
        for rid in decoding:
            req = self.running[rid]
            req.generated += 1
            self.metrics.tokens_generated += 1
            if req.generated >= req.output_len:
                finished.append(rid)
        if finished:
            self.m.remove(finished)
            for rid in finished:
                req = self.running.pop(rid)
                self.metrics.served += 1
                self.metrics.latency_steps.append(step - req.arrival)

        s = self.m.stats()
        mt = self.metrics
        mt.used_blocks.append(s.used_blocks)
        mt.waste.append(s.internal_waste)
        mt.allocated_slots.append(s.allocated_slots)
        mt.running.append(len(self.running))

    def run(self, workload: Workload, log: Callable[[str], None]) -> None:
        for step in range(self.cfg.steps):
            arrivals = workload.arrivals(step)
            self.metrics.arrived += len(arrivals)
            self.waiting.extend(arrivals)
            self.step(step)
            every = self.cfg.progress_every
            if every and (step + 1) % every == 0:
                s = self.m.stats()
                log(
                    f"step {step + 1:5d}: running {len(self.running):3d}, waiting {len(self.waiting):4d}, "
                    f"served {self.metrics.served:4d}, blocks {s.used_blocks:5d}/{s.num_blocks} "
                    f"(peak {s.peak_used_blocks}), fragmentation {s.fragmentation:6.2%}, "
                    f"preemptions {self.metrics.preemptions}"
                )
        self.m.check()

    def close(self) -> None:
        self.m.close()


# -- the prefix cache ------------------------------------------------------------


@dataclasses.dataclass
class PrefixRequest(Request):
    tokens: List[int] = dataclasses.field(default_factory=list)  # prompt, then outputs so far


class PrefixWorkload(Workload):
    """Multi-tenant chat: each request is one of 100 system prompts of
    1000-4000 tokens (Zipf popularity) followed by a user turn of 50-500
    tokens."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.systems = [
            self.rng.integers(0, 32000, int(self.rng.integers(1000, 4001)), dtype=np.int32).tolist() for _ in range(100)
        ]

    def arrivals(self, step: int) -> List[Request]:
        out: List[Request] = []
        for _ in range(int(self.rng.poisson(self.cfg.arrival_rate))):
            z = int(self.rng.zipf(1.1))
            system = self.systems[(z - 1) % len(self.systems)]
            turn = self.rng.integers(0, 32000, int(self.rng.integers(50, 501)), dtype=np.int32).tolist()
            o = int(self.rng.integers(self.cfg.output_len[0], self.cfg.output_len[1] + 1))
            out.append(PrefixRequest(self.next_id, step, len(system) + len(turn), o, tokens=system + turn))
            self.next_id += 1
        return out


class PrefixEngine(Engine):
    """The scheduler loop with token-aware calls: admit by prompt tokens,
    decode with grow_tokens; the prefix cache is on or off."""

    def __init__(self, cfg: Config, cache: bool) -> None:
        self.cache = cache
        self.prefill_computed = 0  # prompt tokens the model had to compute
        self.rng = np.random.default_rng(cfg.seed + 1)
        super().__init__(cfg)

    def new_manager(self) -> kvplug.Manager:
        return kvplug.Manager(self.cfg.num_blocks, self.cfg.block_size, prefix_cache=self.cache)

    def admit(self, req: Request) -> bool:
        assert isinstance(req, PrefixRequest)
        matched = self.m.admit([req.rid], [req.tokens])
        if not matched.size:
            return False
        self.prefill_computed += len(req.tokens) - int(matched[0])
        return True

    def grow_decoding(self, ids: np.ndarray) -> None:
        toks = self.rng.integers(0, 32000, len(ids)).tolist()
        self.m.grow_tokens(ids, [[t] for t in toks])
        for rid, t in zip(ids.tolist(), toks):
            self.running[rid].tokens.append(t)


def prefix_cache_demo(cfg: Config, log: Callable[[str], None]) -> None:
    """The same multi-tenant trace with the prefix cache off and on."""
    pcfg = dataclasses.replace(cfg, steps=min(cfg.steps, 1500), num_blocks=max(cfg.num_blocks, 8000),
                               arrival_rate=0.25, output_len=(20, 200), prompt_len=(1050, 4500), progress_every=0)
    log(
        f"prefix cache: 100 system prompts of 1000-4000 tokens (Zipf 1.1) + user turns of 50-500 tokens, "
        f"{pcfg.steps} steps, {pcfg.num_blocks} blocks of {pcfg.block_size}"
    )
    runs = {}
    for cache in (False, True):
        e = PrefixEngine(pcfg, cache)
        try:
            e.run(PrefixWorkload(pcfg), log)
            mt = e.metrics
            runs[cache] = (e, np.mean(mt.used_blocks), mt.served, e.prefill_computed, e.m.prefix_stats(), e.m.stats())
        finally:
            e.close()
    for cache, (e, used, served, computed, ps, st) in runs.items():
        name = "on " if cache else "off"
        hit = f"hit rate {ps.hit_rate:.1%} of prompt tokens, " if cache else ""
        log(
            f"  cache {name}: {served} requests served, {e.metrics.preemptions} preemptions; {hit}"
            f"prefill computed {computed} tokens; KV blocks referenced mean {used:.0f} "
            f"({used / pcfg.num_blocks:.1%} of the pool)" + (f", {st.cached_blocks} cached idle blocks at the end" if cache else "")
        )
    off, on = runs[False], runs[True]
    log(
        f"  sharing: {on[1] / off[1]:.2f}x the KV memory per step, {on[3] / max(off[3], 1):.2f}x the prefill compute, "
        f"{on[2] / max(off[2], 1):.2f}x the requests served"
    )
    # Shared-prefix attention reads a block that several sequences hold once
    # for all of them: with the cache on, a tenant's requests hold the same
    # system-prompt blocks; with it off, each holds its own copy.
    log(f"  decode KV reads ({_bytes(KV_TOKEN_BYTES)} a token), planned from each step's block tables "
        f"(the cascade route where the planner predicts it faster):")
    for cache, (e, *_rest) in runs.items():
        log(f"    cache {'on ' if cache else 'off'}: {kv_reads(e)}")


# -- the summary ------------------------------------------------------------------


def section_trace(e: Engine) -> List[str]:
    mt, cfg = e.metrics, e.cfg
    lat = np.array(mt.latency_steps) if mt.latency_steps else np.zeros(1)
    return [
        f"requests: {mt.arrived} arrived, {mt.served} served, {len(e.running)} running and "
        f"{len(e.waiting)} waiting at the end; {mt.preemptions} preemptions",
        f"steps: {cfg.steps}; {mt.tokens_generated} tokens generated; mean batch {np.mean(mt.running):.1f}; "
        + (f"request latency p50 {np.percentile(lat, 50):.0f} / p99 {np.percentile(lat, 99):.0f} steps"
           if mt.latency_steps else
           f"no request finished (outputs are {cfg.output_len[0]}-{cfg.output_len[1]} tokens): run more steps"),
    ]


def section_blocks(e: Engine) -> List[str]:
    mt = e.metrics
    s = e.m.stats()
    used = np.array(mt.used_blocks)
    waste = np.array(mt.waste, dtype=np.float64)
    slots = np.array(mt.allocated_slots, dtype=np.float64)
    frag = waste.sum() / slots.sum() if slots.sum() else 0.0
    return [
        f"blocks: {s.num_blocks} x {s.block_size} tokens; used mean {used.mean():.0f} "
        f"({used.mean() / s.num_blocks:.1%}), peak {s.peak_used_blocks} ({s.peak_used_blocks / s.num_blocks:.1%})",
        f"fragmentation (empty slots in partially filled last blocks): mean {frag:.2%} of allocated slots, "
        f"{waste.mean():.0f} slots per step",
    ]


def section_step_cost(e: Engine) -> List[str]:
    t = np.array(e.metrics.step_us)
    return [
        f"step cost (grow + describe through ctypes, mean batch {np.mean(e.metrics.running):.0f}): "
        f"mean {t.mean():.1f} us, p50 {np.percentile(t, 50):.1f} us, p99 {np.percentile(t, 99):.1f} us"
    ]


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.0f} KiB"


def kv_reads(e: Engine) -> str:
    """The KV bytes a decode step read with plain decode and with
    shared-prefix attention (mean over the steps that decoded), the ratio,
    the totals, and how often the planner took the cascade route (with the
    bytes the steps read as planned)."""
    mt = e.metrics
    if not mt.kv_plain:
        return "no decode step ran"
    plain = np.array(mt.kv_plain, dtype=np.float64) * KV_TOKEN_BYTES
    shared = np.array(mt.kv_shared, dtype=np.float64) * KV_TOKEN_BYTES
    planned = np.array(mt.kv_planned, dtype=np.float64) * KV_TOKEN_BYTES
    total = plain.sum() or 1.0
    why = "; no shared run in any batch" if shared.sum() == plain.sum() else ""
    return (f"plain {_bytes(plain.mean())}, shared-prefix {_bytes(shared.mean())} a step "
            f"({shared.sum() / total:.2f}x{why}); in all {_bytes(plain.sum())} -> {_bytes(shared.sum())} "
            f"over {len(plain)} steps; cascade route on {mt.cascade_steps / len(plain):.0%} "
            f"(as planned: {planned.sum() / total:.2f}x)")


def section_kv_reads(e: Engine) -> List[str]:
    lines = [f"decode KV reads, {KV_MODEL} ({_bytes(KV_TOKEN_BYTES)} a token):", f"  {kv_reads(e)}"]
    if e.metrics.plan_us:
        t = np.array(e.metrics.plan_us)
        lines.append(f"  planned each step from the manager's block tables (host only, through ctypes): "
                     f"mean {t.mean():.1f} us, p99 {np.percentile(t, 99):.1f} us")
    return lines


# Each section turns a finished run into summary lines.
SECTIONS: List[Callable[[Engine], List[str]]] = [section_trace, section_blocks, section_step_cost, section_kv_reads]


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=Config.seed)
    ap.add_argument("--steps", type=int, default=Config.steps)
    ap.add_argument("--num-blocks", type=int, default=Config.num_blocks)
    ap.add_argument("--block-size", type=int, default=Config.block_size)
    ap.add_argument("--arrival-rate", type=float, default=Config.arrival_rate)
    ap.add_argument("--quiet", action="store_true", help="summary only")
    ap.add_argument("--no-prefix", action="store_true", help="skip the prefix-cache comparison")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1: got {args.steps}")
    if args.arrival_rate < 0:
        ap.error(f"--arrival-rate must be >= 0: got {args.arrival_rate}")
    if args.block_size >= 1:
        # Requests are admitted in arrival order: one the whole pool cannot
        # hold would wait at the head of the queue for ever, and nothing
        # behind it would be served.
        longest = Config.prompt_len[1] + Config.output_len[1]
        need = -(-longest // args.block_size)
        if args.num_blocks < need:
            ap.error(
                f"--num-blocks {args.num_blocks} cannot serve this workload: its longest requests reach {longest} "
                f"tokens, {need} blocks of {args.block_size}, and the pool holds {max(args.num_blocks, 0) * args.block_size} "
                f"tokens; use --num-blocks {need} or more"
            )
    cfg = Config(
        seed=args.seed,
        steps=args.steps,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        arrival_rate=args.arrival_rate,
        progress_every=0 if args.quiet else Config.progress_every,
    )
    print(
        f"kvplug {kvplug.version_string()} demo: seed {cfg.seed}, {cfg.steps} steps, "
        f"{cfg.arrival_rate} arrivals/step, prompts {cfg.prompt_len[0]}-{cfg.prompt_len[1]}, "
        f"outputs {cfg.output_len[0]}-{cfg.output_len[1]} tokens"
    )
    t0 = time.perf_counter()
    try:
        engine = Engine(cfg)
    except kvplug.KvplugError as e:  # a configuration kvplug refuses, said plainly
        print(f"demo: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        engine.run(Workload(cfg), print)
        print(f"summary ({time.perf_counter() - t0:.1f} s):")
        for section in SECTIONS:
            for line in section(engine):
                print("  " + line)
    finally:
        engine.close()
    if not args.no_prefix:
        t0 = time.perf_counter()
        prefix_cache_demo(cfg, print)
        print(f"  ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
