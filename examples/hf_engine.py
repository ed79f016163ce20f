#!/usr/bin/env python3
"""A continuous-batching engine for a transformers model on kvplug.

The loop an engine developer starts from: requests arrive over time; each
step the scheduler grows every decoding sequence by one token, fills the
rest of the step's token budget with prompt chunks (running prompts first,
then waiting requests, each admitted on its longest cached prefix), and runs
the batch through kvplug.hf.Runner (decode-only steps replay CUDA graphs on
the GPU). When the pool runs out of blocks the newest running sequence is
preempted: its blocks are freed, its tokens kept, and it waits first in line
to be re-admitted (the prefix cache usually still holds most of it). A
request with n > 1 samples n continuations: its sequence is forked once its
prompt is computed, the children sharing the prompt's blocks.

    python examples/hf_engine.py                       # tiny random Llama, CPU or GPU
    python examples/hf_engine.py --model llama3-8b --requests 256 --rate 8 --cuda-graphs --cascade

Nothing is downloaded: the model has random weights from a config made in
code (--model picks a shape), and prompts are random token ids with a shared
system prompt. The summary: output tokens/s, TTFT and TPOT percentiles,
prefix-cache hit rate, preemptions, KV memory; with --host-cache-gb, the host
KV tier's hit rates, demotions and reloads and its load bandwidth.

    python examples/hf_engine.py --num-blocks 64 --host-cache-gb 0.05   # a small pool over a host tier
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import importlib
import sys
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

import kvplug


class _Lazy:
    """A module imported on its first attribute read: torch (and kvplug.hf,
    which imports it) take seconds to import, and `--help` or a bad flag
    should not wait for them."""

    def __init__(self, name: str) -> None:
        self.__dict__["_name"] = name

    def __getattr__(self, attr: str) -> Any:
        mod = importlib.import_module(self.__dict__["_name"])
        return getattr(mod, attr)


torch: Any = _Lazy("torch")
kvhf: Any = _Lazy("kvplug.hf")


def tier_lines(s: Dict[str, Any]) -> List[str]:
    return kvhf.tier_copy.summary_lines(s)


# -- requests ------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    rid: int
    arrival: float  # seconds after the start
    prompt: List[int]
    max_new_tokens: int
    n: int = 1  # parallel samples (forks)
    temperature: float = 0.0
    # filled in by the engine
    seq_ids: List[int] = dataclasses.field(default_factory=list)
    admitted: Optional[float] = None  # when its first sequence was admitted: arrival..admitted is its wait in line
    first_token: Optional[float] = None
    finished: Optional[float] = None
    outputs: Dict[int, List[int]] = dataclasses.field(default_factory=dict)  # seq id -> its tokens
    # Its admissions' host tier loads (kvplug.hf.tier_copy.LoadRecord: time, whether they overlapped a step).
    loads: List[Any] = dataclasses.field(default_factory=list)
    error: Optional[str] = None  # why the engine refused it (the pool can never hold it), if it did

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs.values())


@dataclasses.dataclass
class Workload:
    """Poisson arrivals; every prompt is `system` shared tokens (0: none)
    plus its own random tokens."""

    requests: int = 32
    rate: float = 0.0  # requests per second; 0: all arrive at the start
    system: int = 256
    own: tuple = (16, 64)  # own prompt tokens, uniform inclusive
    output: tuple = (16, 64)  # output tokens, uniform inclusive
    n: int = 1  # samples per request
    temperature: float = 0.0  # > 0 samples (needed for forks to differ)
    vocab: int = 32000
    seed: int = 0

    def make(self) -> List[Request]:
        rng = np.random.default_rng(self.seed)
        system = rng.integers(1, self.vocab, self.system).tolist()
        t, out = 0.0, []
        for i in range(self.requests):
            if self.rate > 0:
                t += float(rng.exponential(1.0 / self.rate))
            own = rng.integers(1, self.vocab, int(rng.integers(self.own[0], self.own[1] + 1))).tolist()
            out.append(Request(i, t, system + own, int(rng.integers(self.output[0], self.output[1] + 1)), self.n,
                               self.temperature))
        return out


# -- the engine -------------------------------------------------------------------


@dataclasses.dataclass
class EngineConfig:
    max_batch: int = 64  # sequences per step
    step_tokens: int = 2048  # tokens per step (decode tokens + prompt chunks)
    chunk: int = 512  # at most this many prompt tokens of one sequence per step
    eos: Optional[int] = None
    seed: int = 0
    progress_every: float = 2.0  # seconds between progress lines (0: none)


class Engine:
    """The scheduler over one PagedKVCache and its Runner."""

    def __init__(self, runner: kvhf.Runner, cfg: EngineConfig,
                 on_logits: Optional[Callable[[kvhf.Batch, torch.Tensor], None]] = None) -> None:
        self.runner, self.cache, self.cfg = runner, runner.cache, cfg
        self.on_logits = on_logits  # sees every step's logits, one row per new token (tests use it)
        self.waiting: Deque[int] = collections.deque()  # sequence ids, first in line first
        self.running: List[int] = []  # live sequences, admission order (the newest is preempted first)
        self.req_of: Dict[int, Request] = {}
        self.next_sid = 0
        self.gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        self.steps = self.preemptions = self.prefill_tokens = 0
        self.step_times: List[float] = []
        self.host_times: List[float] = []  # scheduling + manager calls, per step
        self.batch_sizes: List[int] = []  # sequences per step
        self.step_tokens: List[int] = []  # tokens per step (== sequences: a decode-only step)
        self.peak_blocks = 0
        self.just_finished: List[Request] = []  # requests the last step finished

    def submit(self, req: Request) -> None:
        """Queues a request; a prompt the pool can never hold raises
        PromptTooLongError, and nothing of the request is kept."""
        self.cache.add(self.next_sid, req.prompt)
        self.waiting.append(self._new_sid(req))

    def _new_sid(self, req: Request) -> int:
        sid = self.next_sid
        self.next_sid += 1
        req.seq_ids.append(sid)
        req.outputs[sid] = []
        self.req_of[sid] = req
        return sid

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- one step ---------------------------------------------------------------

    def _plan(self) -> Tuple[List[tuple], int]:
        """(seq_id, tokens) for this step: decode tokens, then prompt chunks;
        and how many of them, at the end, are waiting sequences to admit."""
        cfg, seqs, running = self.cfg, self.cache.seqs, self.running
        cap, budget = cfg.max_batch, cfg.step_tokens
        pending = [len(s.tokens) - s.computed for s in map(seqs.__getitem__, running)]
        plan = [(sid, 1) for sid, p in zip(running, pending) if p == 1][:cap]
        budget -= len(plan)
        if budget > 0 and len(plan) < cap:
            for sid, p in zip(running, pending):  # prompts mid-way through their chunks
                if p > 1 and budget > 0 and len(plan) < cap:
                    n = min(p, cfg.chunk, budget)
                    plan.append((sid, n))
                    budget -= n
        growing = len(plan)
        # Admission only where the step has room (a full decode batch skips the seat count over the running list).
        if self.waiting and budget > 0 and len(plan) < cap:
            # A prompt that will fork into n samples takes n of the batch's seats, so that
            # its children find room in the decode steps after its last chunk.
            seats = sum(self._seats(sid) for sid in running)
            for sid in self.waiting:  # new and preempted sequences, first in line first
                seats += self._seats(sid)
                if budget <= 0 or len(plan) >= cap or (seats > cap and running):
                    break
                n = min(seqs[sid].pending, cfg.chunk, budget)
                plan.append((sid, n))
                budget -= n
        return plan, len(plan) - growing

    def _seats(self, sid: int) -> int:
        """Batch rows sid will need: n for a request's prompt before it forks, else 1."""
        req = self.req_of[sid]
        return req.n if req.n > 1 and len(req.seq_ids) == 1 else 1

    def _schedule(self, now: Callable[[], float]) -> Optional[kvhf.Batch]:
        while True:
            plan, admits = self._plan()
            if not plan:
                return None
            try:
                batch = self.cache.schedule(plan)
            except kvplug.OutOfBlocksError:
                if not self.running:
                    raise
                self._preempt(self.running[-1])
                continue
            for sid, err in batch.refused:  # a request the pool can never hold: it ends, without output
                self._refuse(sid, err, now)
            if batch.refused and len(batch) == 0 and not self.running:
                continue  # the refused were all there was to admit: plan again without them
            if admits:  # only the plan's tail came from the waiting line
                # Admitted: in the batch, or live and loading its host tier blocks beside this step (early loads).
                admitted = set(batch.seq_ids.tolist()).union(batch.deferred)
                for sid, _ in plan[len(plan) - admits:]:
                    if sid in admitted:
                        self.waiting.remove(sid)
                        self.running.append(sid)
                        req = self.req_of[sid]
                        if req.admitted is None:
                            req.admitted = now()
            for rec in batch.loads:
                self.req_of[rec.seq_id].loads.append(rec)
            if len(batch) == 0 and not self.running:
                first = self.waiting[0]
                raise kvplug.OutOfBlocksError(
                    f"hf_engine: the pool ({self.cache.num_blocks} blocks) cannot hold sequence {first} "
                    f"({len(self.cache.seqs[first].tokens)} tokens)", kvplug.Status.OUT_OF_BLOCKS)
            return batch if len(batch) else None

    def _refuse(self, sid: int, err: Exception, now: Callable[[], float]) -> None:
        """Ends the request of sid, which the cache refused for good (its
        error is logged and kept in Request.error), and retires its sequences."""
        req = self.req_of[sid]
        print(f"hf_engine: request {req.rid} refused: {err}", file=sys.stderr)
        req.error = str(err)
        self._retire([s for s in req.seq_ids if s in self.cache.seqs], now)

    def _retire(self, seq_ids: List[int], now: Callable[[], float]) -> None:
        """Removes sequences from the cache and the lines; a request whose
        sequences are all gone is finished."""
        self.cache.remove(seq_ids)
        # Usually running; waiting if a fork preempted it after its token was sampled (or refused).
        # One pass over each list, not a search and a removal per sequence.
        gone = set(seq_ids)
        before = len(self.running)
        self.running = [s for s in self.running if s not in gone]
        if before - len(self.running) < len(gone):
            self.waiting = collections.deque(s for s in self.waiting if s not in gone)
        seqs = self.cache.seqs
        for s in seq_ids:
            req = self.req_of[s]
            if req.finished is None and all(x not in seqs for x in req.seq_ids):
                req.finished = now()
                self.just_finished.append(req)

    def _preempt(self, sid: int) -> None:
        self.cache.preempt(sid)
        self.running.remove(sid)
        self.waiting.appendleft(sid)
        self.preemptions += 1

    def _fork(self, sid: int, children: List[int], finished: List[int]) -> None:
        """Forks sid, preempting the newest other running sequences while the
        pool cannot hold the children's copied last blocks."""
        while True:
            try:
                self.cache.fork(sid, children)
                return
            except kvplug.OutOfBlocksError:
                victims = [v for v in self.running if v != sid and v not in finished]
                if not victims:
                    raise
                self._preempt(victims[-1])  # its row this step is dropped: re-admission recomputes it

    def _sample(self, logits: torch.Tensor, batch: kvhf.Batch) -> Tuple[List[int], List[int], Dict[int, List[int]]]:
        """Samples on the logits' device, one transfer to the host: each
        sequence whose last token was computed gets 1 token, or n for a
        request about to fork. Greedy rows take the argmax. Returns the
        sampled sequences, the (first) token of each, and the n tokens of
        each sequence about to fork."""
        seqs, req_of = self.cache.seqs, self.req_of
        rows: List[int] = []
        sids: List[int] = []
        ks: List[int] = []
        temps: List[float] = []
        for row, sid in enumerate(batch.seq_ids.tolist()):
            s = seqs[sid]
            if len(s.tokens) != s.computed:
                continue  # a prompt chunk before the last: nothing to sample
            req = req_of[sid]
            fork_now = req.n > 1 and len(req.seq_ids) == 1 and not req.outputs[sid]
            rows.append(row)
            sids.append(sid)
            ks.append(req.n if fork_now else 1)
            temps.append(req.temperature)
        if not sids:
            return [], [], {}
        dev = logits.device
        # A decode step samples every row: no gather (and no index upload) needed.
        picked = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=dev)]
        kmax = max(ks)
        out = picked.argmax(-1, keepdim=True).expand(-1, kmax)
        # Decided on the host (in float32, as on the device): testing the device tensor would wait for the
        # GPU before the sampling kernels launch.
        temps32 = np.array(temps, np.float32)
        if (temps32 > 0).any():
            if self.gen.device != dev:
                self.gen = torch.Generator(device=dev).manual_seed(self.cfg.seed)
            temp = torch.from_numpy(temps32).to(dev)
            probs = torch.softmax(picked / temp.clamp_min(1e-6)[:, None], -1)
            drawn = torch.multinomial(probs, kmax, replacement=True, generator=self.gen)
            out = torch.where((temp > 0)[:, None], drawn, out)
        # The step's one transfer to the host (Runner.to_host: no copy engine, so that it does not wait
        # behind the host tier's stores).
        if kmax == 1:
            return sids, self.runner.to_host(out.reshape(-1)), {}
        toks = self.runner.to_host(out)
        forks = {sid: t[:k] for sid, t, k in zip(sids, toks, ks) if k > 1}
        return sids, [t[0] for t in toks], forks

    def step(self, now: Callable[[], float]) -> int:
        """Runs one step; returns the tokens it computed (0: nothing to run)."""
        t0 = time.perf_counter()
        self.just_finished = []
        batch = self._schedule(now)
        if batch is None:
            return 0
        t1 = time.perf_counter()
        logits = self.runner.step(batch, all_logits=self.on_logits is not None)
        if self.on_logits is not None:
            self.on_logits(batch, logits)
            logits = logits[torch.from_numpy(batch.qo_indptr()[1:].astype(np.int64) - 1).to(logits.device)]
        sids, toks, forks = self._sample(logits, batch)  # waits for the GPU
        t2 = time.perf_counter()
        finished: List[int] = []
        forked: List[Tuple[int, int]] = []  # (sequence, token) of this step's forks' sequences that go on
        eos, req_of = self.cfg.eos, self.req_of
        for sid, tok in zip(sids, toks):
            req = req_of[sid]
            if forks and sid in forks:  # parallel sampling: the children share the prompt's blocks
                if not self.cache.seqs[sid].live:
                    # An earlier fork of this step preempted it: its samples are dropped (it is left out of
                    # the append below too) and it forks after re-admission recomputes its last token.
                    continue
                children = [self._new_sid(req) for _ in range(req.n - 1)]
                self._fork(sid, children, finished)
                at = self.running.index(sid) + 1
                self.running[at:at] = children
                if req.first_token is None:
                    req.first_token = now()
                for s, t in zip(req.seq_ids, forks[sid]):
                    req.outputs[s].append(t)
                    if len(req.outputs[s]) >= req.max_new_tokens or t == eos:
                        finished.append(s)
                    else:
                        forked.append((s, t))
                continue
            if req.first_token is None:
                req.first_token = now()
            out = req.outputs[sid]
            out.append(tok)
            if len(out) >= req.max_new_tokens or tok == eos:
                finished.append(sid)
        # The sampled tokens of the sequences that go on enter the cache in one call after the loop: a fork in
        # the loop copies only its own parent's tokens and a preemption keeps a sequence's tokens, so the
        # order does not matter.
        if finished or forks:
            skip = set(finished).union(forks)
            grow = [(s, t) for s, t in zip(sids, toks) if s not in skip]
            grow += forked
            if grow:
                self.cache.append_tokens(*zip(*grow))
        else:
            self.cache.append_tokens(sids, toks)
        if finished:
            self._retire(finished, now)
        t3 = time.perf_counter()
        self.steps += 1
        self.prefill_tokens += int(batch.q_lens[batch.q_lens > 1].sum())
        self.step_times.append(t3 - t0)
        self.batch_sizes.append(len(batch))
        self.step_tokens.append(batch.num_tokens)
        self.host_times.append((t1 - t0) + (t3 - t2) + self.runner.last_prep)
        self.peak_blocks = max(self.peak_blocks, self.cache.manager.stats().used_blocks)
        return batch.num_tokens

    # -- the loop -----------------------------------------------------------------

    def run(self, requests: List[Request], log: Callable[[str], None] = print, time_limit: float = 0.0,
            follow_up: Optional[Callable[[Request, float], Optional[Request]]] = None) -> float:
        """Serves requests as they arrive (arrival times relative to the
        start); returns the wall time. time_limit > 0 stops the loop after
        that many seconds, unfinished requests left as they are.
        follow_up(req, now), called as each request finishes, may return the
        next request of its conversation, appended to `requests`: it arrives
        at its own arrival time when that is later than now (a user's think
        time), else now (its arrival set to now)."""
        pending = sorted(requests, key=lambda r: r.arrival)
        start = time.perf_counter()
        now = lambda: time.perf_counter() - start  # noqa: E731
        last_log = 0.0
        while pending or not self.idle:
            if time_limit and now() > time_limit:
                log(f"time limit of {time_limit:.0f} s reached: stopping with {len(self.running)} running, "
                    f"{len(self.waiting) + len(pending)} waiting")
                break
            while pending and pending[0].arrival <= now():
                self.submit(pending.pop(0))
            if self.idle:
                time.sleep(max(0.0, min(pending[0].arrival - now(), 0.05)))
                continue
            self.step(now)
            if follow_up is not None:
                for req in self.just_finished:
                    t = now()
                    nxt = follow_up(req, t)
                    if nxt is None:
                        continue
                    requests.append(nxt)
                    if nxt.arrival > t:  # the user thinks first
                        pending.insert(bisect.bisect_right([r.arrival for r in pending], nxt.arrival), nxt)
                    else:
                        nxt.arrival = t
                        self.submit(nxt)
            if self.cfg.progress_every and now() - last_log >= self.cfg.progress_every:
                last_log = now()
                log(self.progress(requests, now()))
        return now()

    def progress(self, requests: List[Request], t: float) -> str:
        done = sum(r.finished is not None for r in requests)
        toks = sum(r.output_tokens for r in requests)
        s = self.cache.manager.stats()
        return (f"[{t:6.1f}s] step {self.steps:5d}  running {len(self.running):3d}  waiting {len(self.waiting):3d}  "
                f"done {done}/{len(requests)}  out {toks / max(t, 1e-9):7.1f} tok/s  "
                f"blocks {s.used_blocks}/{s.num_blocks}  preempted {self.preemptions}")


def summary(engine: Engine, requests: List[Request], wall: float) -> List[str]:
    done = [r for r in requests if r.finished is not None]
    out = sum(r.output_tokens for r in requests)
    ttft = np.array([r.first_token - r.arrival for r in done]) * 1e3
    tpot = np.array([(r.finished - r.first_token) / max(r.output_tokens / r.n - 1, 1) for r in done]) * 1e3
    pct = lambda a: " / ".join(f"{np.percentile(a, q):.1f}" for q in (50, 90, 99)) if len(a) else "-"  # noqa: E731
    c = engine.cache
    cached, prompt = c.stats["cached_tokens"], c.stats["prompt_tokens"]
    block_bytes = c.nbytes // c.num_blocks
    host = np.array(engine.host_times)
    stepv = np.array(engine.step_times)
    return [
        f"requests: {len(done)}/{len(requests)} finished in {wall:.1f} s; {engine.steps} steps "
        f"({engine.runner.graph_steps} decode steps replayed from CUDA graphs), {engine.preemptions} preemptions, "
        f"{c.stats['forks']} forks",
        f"throughput: {out / wall:.1f} output tokens/s ({out} tokens); prefill computed {engine.prefill_tokens} tokens",
        f"TTFT ms p50 / p90 / p99: {pct(ttft)}",
        f"TPOT ms p50 / p90 / p99: {pct(tpot)}",
        # The cache's own count of admissions: the manager's prefix stats count the match that sizes each
        # admission's chunk too, so their hit and query tokens hold every prompt twice.
        f"prefix cache: hit rate {cached / prompt if prompt else 0.0:.1%} of prompt tokens at admission "
        f"({cached} of {prompt})",
        f"KV memory: pool {c.nbytes / 2**20:.1f} MiB ({c.num_blocks} blocks x {c.block_size} tokens), "
        f"peak used {engine.peak_blocks} blocks = {engine.peak_blocks * block_bytes / 2**20:.1f} MiB",
        f"host side (schedule + manager + sampling): {host.sum() / max(stepv.sum(), 1e-9):.1%} of step time, "
        f"p50 {np.percentile(host, 50) * 1e3:.2f} ms per step" if len(host) else "host side: no steps",
    ] + (tier_lines(t) if (t := c.tier_summary()) is not None else []) + load_lines(requests)


def load_lines(requests: List[Request]) -> List[str]:
    """Per request, the host tier loads of its admissions: how many joined a
    step after their loads ran beside one (early loads), and their times."""
    recs = [x for r in requests for x in r.loads]
    if not recs:
        return []
    ms = np.array([x.seconds for x in recs if x.seconds is not None]) * 1e3
    over = sum(x.overlapped for x in recs)
    hidden = sum(bool(x.hidden) for x in recs)
    times = (f"; per admission p50 / p99 {np.percentile(ms, 50):.2f} / {np.percentile(ms, 99):.2f} ms, "
             f"{np.mean([x.bytes for x in recs]) / 2**20:.2f} MiB on average") if len(ms) else ""
    return [f"host tier loads by admission: {len(recs)} ({sum(1 for r in requests if r.loads)} requests); "
            f"{sum(x.deferred for x in recs)} joined the step after their admission, {over} with their loads beside a "
            f"step's forward pass ({hidden} landed before the next step began){times}"]


# -- models (random weights, shapes of real ones) ----------------------------------------


# The shapes make_model builds (named here for --help, which imports neither torch nor transformers).
MODELS = ("tiny-llama", "tiny-mistral", "tiny-qwen2", "llama3-8b")


def make_model(name: str, dtype: torch.dtype, device: str, seed: int = 0):
    """A causal LM with random weights; nothing is downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shapes = {
        "tiny-llama": (LlamaConfig, LlamaForCausalLM, dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)),
        "tiny-mistral": (MistralConfig, MistralForCausalLM, dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                                                 num_hidden_layers=4, num_attention_heads=8,
                                                                 num_key_value_heads=2, head_dim=32, sliding_window=4096)),
        "tiny-qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)),
        # Llama-3-8B's shape (random weights: 16 GB in bf16).
        "llama3-8b": (LlamaConfig, LlamaForCausalLM, dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                                          rope_theta=500000.0, max_position_embeddings=8192)),
    }
    assert tuple(shapes) == MODELS, "MODELS names make_model's shapes"
    if name not in shapes:
        raise SystemExit(f"--model must be one of {', '.join(shapes)}")
    cfg_cls, model_cls, kw = shapes[name]
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the weights in the target dtype (no fp32 copy of an 8B model)
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    # Explicit random weights (norms at 1, biases 0): the same on every run whatever transformers' own init does.
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()  # biases
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def add_tier_args(ap: argparse.ArgumentParser) -> None:
    """The KV tier flags (examples/hf_engine.py and bench/hf_bench.py)."""
    ap.add_argument("--host-cache-gb", type=float, default=0.0,
                    help="host KV tier size in GiB (0: none): cached blocks the GPU pool evicts are demoted there "
                    "and reloaded on a prefix hit")
    ap.add_argument("--demote-ahead", type=int, default=None,
                    help="blocks the host tier keeps free or being demoted (default: one step's allocations, "
                    "2 x step tokens / block size + max batch, at most a quarter of the pool)")
    ap.add_argument("--demote-overlap", action="store_true",
                    help="demotions on a side CUDA stream, overlapping the step (default: the step's stream; "
                    "write-through stores always go on a side stream)")
    ap.add_argument("--no-demote-evicted", dest="demote_evicted", action="store_false",
                    help="drop the cached blocks a step's allocations evict instead of demoting them in the step's "
                    "copies (demoting them is the default without --demote-overlap)")
    ap.add_argument("--write-through", type=int, default=0, metavar="N",
                    help="copy up to N computed blocks a step to the host tier while they stay on the GPU, instead "
                    "of demoting (moving) blocks ahead of need (0: demote; with N, --demote-ahead defaults to 0)")
    ap.add_argument("--write-through-slack", type=int, default=None, metavar="S",
                    help="with --write-through: store nothing while the GPU pool has more than S free blocks (no "
                    "cached block can be evicted then; the computed blocks wait and are stored, oldest first, once "
                    "the free blocks fall to S); 0 stores every step (default: max(2 x N, a quarter of the pool), "
                    "kvplug.hf's PagedKVCache.default_write_through_slack)")
    ap.add_argument("--no-early-loads", dest="early_loads", action="store_false",
                    help="load a prompt's host tier blocks in the copies of the step that computes it, ahead of its "
                    "forward pass (default: a prompt admitted beside other work joins the next step, its loads "
                    "running on a side stream beside this step's forward pass)")
    ap.add_argument("--tier-copier", default="auto", choices=["auto", "copy-engine", "torch"],
                    help="how blocks move between the GPU pool and the host tier: auto (on a GPU the library's "
                    "TierCopier: reloads by its batched copy kernel, stores too, except write-through's, which go by "
                    "the copy engines where the driver has them), copy-engine (stores through the GPU's copy "
                    "engines, reloads by the kernel: no SMs taken from the step's kernels), torch (torch's copies)")
    ap.add_argument("--shared-tier", default=None, metavar="HOST:PORT",
                    help="a shared (Valkey/Redis) KV tier, passed to kvplug.Manager (needs a binding that has it)")
    ap.add_argument("--shared-tier-namespace", default=None, metavar="NAME",
                    help="the model's name in the shared tier: instances of one namespace serve each other's blocks "
                    "(default: the shape, dtype, block size and weight seed of this random-weight model)")


def tier_kwargs(args: argparse.Namespace, shape: kvhf.ModelShape, num_blocks: int, dtype: torch.dtype,
                host_cache_gb: Optional[float] = None) -> dict:
    """PagedKVCache's tier arguments from the flags ({} without a tier);
    dtype is the cache's K/V dtype (an FP8 one's slots hold its scales)."""
    gb = args.host_cache_gb if host_cache_gb is None else host_cache_gb
    kw: dict = {}
    if gb > 0:
        slots = kvhf.PagedKVCache.host_slots_for(gb, shape, args.block_size, dtype)
        if slots < 1:
            sys.exit(f"--host-cache-gb {gb} holds no block of this model ({shape}, block size {args.block_size})")
        ahead = args.demote_ahead
        if ahead is None:
            ahead = 0 if args.write_through else kvhf.PagedKVCache.default_demote_ahead(
                num_blocks, args.block_size, args.step_tokens, args.max_batch)
        kw.update(host_tier_slots=slots, demote_ahead=min(ahead, num_blocks))
        if args.write_through:
            kw["write_through"] = min(args.write_through, num_blocks)
            if getattr(args, "write_through_slack", None) is not None:
                kw["write_through_slack"] = min(args.write_through_slack, num_blocks)
        if args.demote_overlap:
            kw["tier_overlap"] = True
        if not args.demote_evicted:
            kw["demote_evicted"] = False
        if args.tier_copier != "auto":
            kw["tier_copier"] = args.tier_copier
        if not getattr(args, "early_loads", True):
            kw["early_loads"] = False
    if args.write_through and gb <= 0:
        sys.exit("--write-through needs --host-cache-gb > 0: it copies blocks to the host tier")
    if getattr(args, "write_through_slack", None) and not args.write_through:
        sys.exit("--write-through-slack needs --write-through N: it holds back write-through stores")
    if args.shared_tier:
        if gb <= 0:
            sys.exit("--shared-tier needs --host-cache-gb > 0: blocks fetched from the shared tier land in the host tier")
        if not kvhf.tier_copy.manager_takes("shared_tier"):
            sys.exit(f"--shared-tier {args.shared_tier}: this kvplug binding has no shared tier "
                     "(kvplug.Manager takes no shared_tier argument)")
        # Random weights: the model is its shape, dtype and seed; the blocks' layout adds the block size.
        ns = args.shared_tier_namespace or (f"{getattr(args, 'model', 'model')}.{str(dtype).replace('torch.', '')}"
                                            f".bs{args.block_size}.seed{getattr(args, 'seed', 0)}")
        kw.update(shared_tier=args.shared_tier, shared_tier_namespace=ns)
    return kw


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama", choices=MODELS,
                    help="the shape of the random-weight model (default: %(default)s)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when torch sees a GPU)")
    ap.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second (0: all at once)")
    ap.add_argument("--system", type=int, default=256, help="shared system-prompt tokens (0: none)")
    ap.add_argument("--own", type=int, nargs=2, default=[16, 64], help="own prompt tokens, min max")
    ap.add_argument("--output", type=int, nargs=2, default=[16, 64], help="output tokens, min max")
    ap.add_argument("--n", type=int, default=1, help="parallel samples per request (forks)")
    ap.add_argument("--temperature", type=float, default=None, help="default 0 (greedy), 1.0 with --n > 1")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: the workload's peak)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--step-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--cuda-graphs", action="store_true", help="replay decode steps from CUDA graphs (GPU)")
    ap.add_argument("--cascade", action="store_true", help="shared-prefix decode attention (kvplug.cascade; GPU)")
    ap.add_argument("--backend", default="auto", choices=["auto", "kernels", "torch"])
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"],
                    help="fp8: K/V in FP8 e4m3 with one scale per token and kv head; the pool gets the blocks that the "
                         "memory of a 16-bit pool of --num-blocks blocks holds (about twice as many)")
    ap.add_argument("--fp8-prefill", default="hopper", choices=["sm80", "hopper", "fp8"],
                    help="with --kv-dtype fp8, how prefill reads the cache: hopper (the default: the wgmma mainloop, widened to "
                         "16 bits, where the GPU has it), sm80 (the sm_80 mainloop), fp8 (FP8 Q/K/V on Hopper, head_dim 128)")
    add_tier_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"

    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    model = kvhf.prepare_model(make_model(args.model, dtype, args.device, args.seed))
    temp = args.temperature if args.temperature is not None else (1.0 if args.n > 1 else 0.0)
    wl = Workload(args.requests, args.rate, args.system, tuple(args.own), tuple(args.output), args.n, temp,
                  model.config.vocab_size, args.seed)
    requests = wl.make()
    max_len = args.system + args.own[1] + args.output[1]
    per_seq = -(-max_len // args.block_size)
    num_blocks = args.num_blocks or per_seq * min(args.max_batch, args.requests * args.n) + per_seq
    if num_blocks < per_seq:
        sys.exit(f"--num-blocks {num_blocks} cannot hold one request of {max_len} tokens ({per_seq} blocks)")
    shape = kvhf.ModelShape.of(model.config)
    kv_dtype = None
    if args.kv_dtype == "fp8":
        kv_dtype = torch.float8_e4m3fn
        # A 16-bit block's bytes hold 2 * head_dim / (head_dim + 4) e4m3 blocks with their float32 scales.
        num_blocks = num_blocks * 2 * shape.head_dim // (shape.head_dim + 4)
    tier = tier_kwargs(args, shape, num_blocks, kv_dtype or dtype)  # FP8 slots: half the bytes, and the scales
    cache = kvhf.PagedKVCache(shape, num_blocks, args.block_size, dtype=dtype, device=args.device, kv_dtype=kv_dtype,
                              fp8_prefill=args.fp8_prefill if kv_dtype is not None else None, **tier)
    runner = kvhf.Runner(model, cache, backend=args.backend, max_batch=args.max_batch,
                         max_step_tokens=args.step_tokens + args.max_batch, max_model_len=max_len,
                         cuda_graphs=args.cuda_graphs, cascade=args.cascade)
    cfg = EngineConfig(args.max_batch, args.step_tokens, args.chunk, seed=args.seed,
                       progress_every=0 if args.quiet else 2.0)
    print(f"kvplug {kvplug.version_string()} + transformers: {args.model} ({dtype}, {args.device}, {runner.backend}"
          + (", FP8 KV" if kv_dtype is not None else "") + "), "
          f"{len(requests)} requests x {args.n}, system prompt {args.system}, pool {num_blocks} blocks"
          + (f", host tier {tier['host_tier_slots']} slots, demote ahead {tier['demote_ahead']}" if tier else "")
          + (f", shared tier {args.shared_tier}" if args.shared_tier else ""))
    engine = Engine(runner, cfg)
    wall = engine.run(requests)
    for line in summary(engine, requests, wall):
        print("  " + line)
    cache.close()


if __name__ == "__main__":
    main()
