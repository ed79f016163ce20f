"""The prefix cache's scheduler calls beside SGLang's RadixCache and vLLM's
KVCacheManager, on the same inputs, in one run (bench/RESULTS.md, "Prefix
cache").

    KVPLUG_LIBRARY=<libkvplug.so> PYTHONPATH=bindings/python \\
        .peer/prefix-venv/bin/python bench/prefix_peers.py [--quick] [--repeat 3]
            [--only decode,admit,trace] [--systems kvplug,c,sglang,vllm]

The peers are not part of kvplug: install them in an ignored folder
(.peer/ is git-ignored), e.g.

    python3 -m venv .peer/prefix-venv
    .peer/prefix-venv/bin/pip install vllm==0.32.0
    .peer/prefix-venv/bin/pip install --no-deps sglang==0.5.23
    .peer/prefix-venv/bin/pip install orjson IPython gguf

(sglang's own dependencies pin another torch than vLLM's; the radix cache
needs only the three packages above besides what vLLM brings.) A peer that
cannot be imported is reported and skipped. "kvplug from C" runs
bench/step_cost.c, compiled here against the same library, in a
subprocess of this run.

What each system does, timed from the engine's side of the call (host
time only; no GPU is involved anywhere):

decode step: 256 running sequences of 1000-4000 tokens each get one token:
  kvplug       Manager.grow_tokens(ids, tokens) + describe_into(ids, table,
               lens, slots) (block table, lengths, slots), arrays reused
  SGLang       TokenToKVPoolAllocator.alloc(256) and the write of the new
               slots into ReqToTokenPool.req_to_token (its block table, one
               row per request, token-granular), seq_lens += 1: the decode
               preparation of its scheduler (page 1)
  vLLM         per request: Request.append_output_token_ids (hashes a block
               when it fills) and KVCacheManager.allocate_slots(req, 1); then
               the new block ids into a numpy block table and the slot
               mapping from it, as its model runner's BlockTable does
admission: one 4096-token prompt whose first 2048 tokens are cached, block
  size 16 and 64; match, hold the hit, allocate the rest, cache its full
  blocks:
  kvplug       Manager.admit([id], [int32 array])
  SGLang       match_prefix, inc_lock_ref, alloc of the rest, the
               req_to_token row, insert of the prompt (what
               cache_unfinished_req does after the prefill) and the lock
               moved to the new last node; page 1, and page = block size
               with PagedTokenToKVPoolAllocator
  vLLM         Request(...) (its block hasher hashes the prompt),
               get_computed_blocks, allocate_slots (caches the new full
               blocks); sha256, vLLM's default prefix hash
  SGLang's RadixKey of the prompt is built outside the timing (a request
  holds its tokens already). Between calls, untimed: kvplug and SGLang
  keep 128 sequences, then release them and evict what they cached, so
  each call finds free blocks; vLLM's request is freed after each call
  (its freed blocks keep their hashes until handed out again).
multi-tenant trace: 5000 requests, each a system prompt (100 of 1000-4000
  tokens, Zipf 1.1 popularity) and a user turn of 50-500 tokens, with
  20-200 output tokens; at most 64 running, a pool of 32768 blocks of 16
  tokens. Each step admits waiting requests in order while they fit (at
  most 8192 prompt tokens a step), decodes one token for every running
  request, and retires the finished ones (their blocks stay cached; kvplug's
  decode step ends with Manager.mark_computed, the engine's mark of the
  step's forward pass). Host time is the time spent in the cache's calls
  (admission, decode step, retirement, eviction); the trace and token lists are built outside it.

Timing: the decode step and admission run --repeat rounds (default 3); in
each round every system makes its calls in one block (the order rotating
from round to round), and the median of each block is reported, then the
median and range over the rounds. The trace runs the systems in lockstep,
one scheduler step of each in turn.
"""

from __future__ import annotations

import argparse
import array
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

import kvplug

ROOT = Path(__file__).resolve().parent.parent
NSEQ = 256
PLEN, CACHED, ROUND = 4096, 2048, 128


def median_us(ns: list) -> float:
    return statistics.median(ns) / 1e3


# ----------------------------------------------------------------- kvplug


class KvplugDecode:
    """The decode step through kvplug's Python package."""

    def __init__(self, steps: int, lens: np.ndarray) -> None:
        bs = 16
        rng = np.random.default_rng(2)
        self.m = kvplug.Manager(int((lens.sum() + NSEQ * (steps + bs)) // bs) + NSEQ, bs, prefix_cache=True)
        self.ids = np.arange(NSEQ, dtype=np.int64)
        for i in range(NSEQ):
            self.m.admit([i], [rng.integers(0, 100_000, int(lens[i]), dtype=np.int32)])
        width = (int(lens.max()) + steps) // bs + 2
        self.table = np.empty((NSEQ, width), np.int32)
        self.seq_lens = np.empty(NSEQ, np.int32)
        self.slots = np.empty(NSEQ, np.int32)
        self.toks = np.empty(NSEQ, np.int32)

    def close(self) -> None:
        self.m.close()

    def step(self, step: int) -> int:
        self.toks[:] = step
        t0 = time.perf_counter_ns()
        self.m.grow_tokens(self.ids, self.toks)
        k = self.m.describe_into(self.ids, self.table, self.seq_lens, self.slots)
        t = time.perf_counter_ns() - t0
        assert k == NSEQ
        return t


class KvplugAdmit:
    """Admission with a prefix hit through kvplug's Python package."""

    def __init__(self, bs: int) -> None:
        rng = np.random.default_rng(1)
        self.base = rng.integers(0, 100_000, PLEN, dtype=np.int32)
        self.m = kvplug.Manager((ROUND + 4) * (PLEN // bs), bs, prefix_cache=True)
        self.live: list = []
        self.fresh()

    def close(self) -> None:
        self.m.close()

    def fresh(self) -> None:
        m, base = self.m, self.base
        m.clear_prefix_cache()
        m.admit([-1], [base[: CACHED + 1]])
        m.mark_computed()  # its forward pass ran: the blocks stay cached
        m.remove([-1])
        m.pin(base[:CACHED])

    def admit(self, i: int) -> int:
        self.base[CACHED] = i
        t0 = time.perf_counter_ns()
        got = self.m.admit([i], [self.base])
        t = time.perf_counter_ns() - t0
        assert got[0] == CACHED, got
        self.live.append(i)
        if len(self.live) == ROUND:
            self.m.mark_computed()
            self.m.remove(self.live)
            self.live = []
            self.fresh()
        return t


class KvplugTrace:
    name = "kvplug Python"

    def __init__(self, num_blocks: int, bs: int) -> None:
        self.m = kvplug.Manager(num_blocks, bs, prefix_cache=True)
        self.bs = bs
        self.table = np.empty((64, 8192 // bs + 2), np.int32)
        self.lens = np.empty(64, np.int32)
        self.slots = np.empty(64, np.int32)

    def admit(self, rid: int, prompt: np.ndarray) -> bool:
        return len(self.m.admit([rid], [prompt])) == 1

    def decode(self, rids: np.ndarray, toks: np.ndarray) -> None:
        n = len(rids)
        self.m.grow_tokens(rids, toks)
        self.m.describe_into(rids, self.table[:n], self.lens[:n], self.slots[:n])
        self.m.mark_computed()  # the step's forward pass: its blocks stay cached when requests finish

    def finish(self, rid: int) -> None:
        self.m.remove([rid])


def c_driver() -> Path:
    lib = Path(kvplug.library_path()).resolve()
    exe = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvplug_step_cost_{os.getpid()}"
    cc = os.environ.get("CC", "cc")
    subprocess.run(
        [cc, "-O2", "-std=c99", "-Wall", "-Wextra", "-I", str(ROOT / "include"), str(ROOT / "bench" / "step_cost.c"),
         "-o", str(exe), str(lib), f"-Wl,-rpath,{lib.parent}"],
        check=True,
    )
    return exe


def c_median(exe: Path, *args: str) -> float:
    out = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True).stdout
    return float(out.split("median ")[1].split(" us")[0])


# ----------------------------------------------------------------- SGLang


def sglang_modules():
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    return dict(
        Paged=PagedTokenToKVPoolAllocator,
        Token=TokenToKVPoolAllocator,
        EvictParams=EvictParams,
        InsertParams=InsertParams,
        MatchPrefixParams=MatchPrefixParams,
        CacheInitParams=CacheInitParams,
        ReqToTokenPool=ReqToTokenPool,
        RadixCache=RadixCache,
        RadixKey=RadixKey,
    )


class SGLang:
    """SGLang's radix cache with its token (page 1) or paged allocator and
    its request-to-token table, driven as its scheduler drives them."""

    def __init__(self, size_tokens: int, page: int, max_reqs: int, max_ctx: int) -> None:
        import torch

        S = self.S = sglang_modules()
        self.torch = torch
        self.page = page
        if page == 1:
            self.alloc = S["Token"](size_tokens, torch.float16, "cpu", None, False)
        else:
            self.alloc = S["Paged"](size_tokens, page, torch.float16, "cpu", None, False)
        self.rtp = S["ReqToTokenPool"](max_reqs, max_ctx, "cpu", False)
        self.cache = S["RadixCache"](S["CacheInitParams"](disable=False, req_to_token_pool=self.rtp,
                                                          token_to_kv_pool_allocator=self.alloc, page_size=page))
        self.reqs: dict = {}  # rid -> [row, last_node, tokens (list), kv length]

    def key(self, tokens) -> object:
        return self.S["RadixKey"](array.array("q", tokens))

    def _alloc(self, n: int):
        out = self.alloc.alloc(n)
        if out is None:
            self.cache.evict(self.S["EvictParams"](num_tokens=n - self.alloc.available_size() + self.page))
            out = self.alloc.alloc(n)
        return out

    def admit_key(self, rid: int, key, tokens) -> bool:
        """Admission of a prompt given as a RadixKey (and its tokens as a list
        for the finish-time insert)."""
        S, cache = self.S, self.cache
        res = cache.match_prefix(S["MatchPrefixParams"](key=key))
        node = res.last_device_node
        prefix = cache.path_device_indices(node)
        n_prefix = len(prefix)
        cache.inc_lock_ref(node)
        rest = len(key) - n_prefix
        if self.page > 1:
            rest = -(-rest // self.page) * self.page
        new = self._alloc(rest)
        if new is None:
            cache.dec_lock_ref(node)
            return False
        row = self.rtp.free_slots.pop()
        kv = self.torch.cat((prefix, new[: len(key) - n_prefix]))
        self.rtp.write((row, slice(0, len(key))), kv.to(self.torch.int32))
        # The prefill is done: cache the prompt (cache_unfinished_req) and
        # move the lock to the new last node; slots of blocks found cached
        # meanwhile go back.
        aligned = len(key) // self.page * self.page
        ins = cache.insert(S["InsertParams"](key=key[:aligned] if self.page > 1 else key, value=kv[:aligned]))
        if ins.prefix_len > n_prefix:
            self.alloc.free(kv[n_prefix:ins.prefix_len])
        new_node = ins.last_device_node
        cache.inc_lock_ref(new_node)
        cache.dec_lock_ref(node)
        self.reqs[rid] = [row, new_node, tokens, len(key), new[len(key) - n_prefix:], max(ins.prefix_len, aligned)]
        return True

    def admit(self, rid: int, prompt: np.ndarray) -> bool:
        tokens = prompt.tolist()
        return self.admit_key(rid, self.key(tokens), tokens)

    def decode(self, rids, toks) -> None:
        torch = self.torch
        n = len(rids)
        out = self._alloc(n)
        rows = torch.tensor([self.reqs[r][0] for r in rids])
        lens = torch.tensor([self.reqs[r][3] for r in rids])
        self.rtp.write((rows, lens), out.to(torch.int32))
        for r, t in zip(rids, toks.tolist()):
            q = self.reqs[r]
            q[2].append(t)
            q[3] += 1

    def finish(self, rid: int) -> None:
        """cache_finished_req: insert the whole sequence, free the slots of
        blocks found cached, unlock, release the row."""
        torch = self.torch
        row, node, tokens, n, _, inserted = self.reqs.pop(rid)
        kv = self.rtp.req_to_token[row, :n].to(torch.int64)
        key = self.key(tokens[:n])
        ins = self.cache.insert(self.S["InsertParams"](key=key, value=kv))
        if ins.prefix_len > inserted:
            self.alloc.free(kv[inserted:ins.prefix_len])
        self.cache.dec_lock_ref(node)
        self.rtp.free_slots.append(row)

    def release(self, rid: int) -> None:
        """Admission benchmark: let the sequence go without caching more."""
        row, node, tokens, n, extra, _ = self.reqs.pop(rid)
        self.cache.dec_lock_ref(node)
        if len(extra):
            self.alloc.free(extra)
        self.rtp.free_slots.append(row)


class SGLangDecode:
    """SGLang's decode preparation: a slot per running request from the
    token allocator, written into each request's req_to_token row."""

    def __init__(self, steps: int, lens: np.ndarray) -> None:
        import torch

        self.torch = torch
        rng = np.random.default_rng(2)
        total = int(lens.sum()) + NSEQ * (steps + 1)
        self.s = SGLang(total + 1024, 1, NSEQ + 1, int(lens.max()) + steps + 1)
        for i in range(NSEQ):
            assert self.s.admit(i, rng.integers(0, 100_000, int(lens[i]), dtype=np.int32))
        self.rows = torch.tensor([self.s.reqs[i][0] for i in range(NSEQ)])
        self.seq_lens = torch.tensor([self.s.reqs[i][3] for i in range(NSEQ)])

    def step(self, step: int) -> int:
        s, torch = self.s, self.torch
        t0 = time.perf_counter_ns()
        out = s.alloc.alloc(NSEQ)
        s.rtp.write((self.rows, self.seq_lens), out.to(torch.int32))
        self.seq_lens += 1
        return time.perf_counter_ns() - t0


class SGLangAdmit:
    """Admission with a prefix hit into SGLang's radix cache (page 1, or
    page = block size with the paged allocator). The prompt's RadixKey is
    built outside the timing (the request holds its tokens already)."""

    def __init__(self, page: int) -> None:
        rng = np.random.default_rng(1)
        self.base = rng.integers(0, 100_000, PLEN, dtype=np.int32).tolist()
        self.s = SGLang((ROUND + 4) * PLEN, page, ROUND + 4, PLEN + 64)
        base = self.base
        # Sequence -1 holds the system prompt for the whole run.
        assert self.s.admit_key(-1, self.s.key(base[: CACHED + 1]), base[: CACHED + 1])
        self.live: list = []

    def admit(self, i: int) -> int:
        s, base = self.s, self.base
        base[CACHED] = i
        key = s.key(base)
        t0 = time.perf_counter_ns()
        ok = s.admit_key(i, key, base)
        t = time.perf_counter_ns() - t0
        assert ok
        self.live.append(i)
        if len(self.live) == ROUND:
            for r in self.live:
                s.release(r)
            self.live = []
            # Evict what the round cached, so every call finds free slots.
            s.cache.evict(s.S["EvictParams"](num_tokens=ROUND * PLEN))
        return t


# ----------------------------------------------------------------- vLLM


class VLLM:
    def __init__(self, num_blocks: int, bs: int, max_len: int) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(bs, hash_fn)
        self.Request, self.SamplingParams = Request, SamplingParams
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=torch.float16)
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.m = KVCacheManager(cfg, max_model_len=max_len, scheduler_block_size=bs, hash_block_size=bs,
                                enable_caching=True)
        self.bs = bs
        self.reqs: dict = {}
        self.max_blocks = max_len // bs + 2
        self.table = np.zeros((512, self.max_blocks), np.int32)
        self.nblocks = np.zeros(512, np.int32)
        self.rows: dict = {}
        self.free_rows = list(range(511, -1, -1))

    def request(self, rid: int, tokens: list, max_tokens: int = 4096):
        return self.Request(str(rid), tokens, self.SamplingParams(max_tokens=max_tokens), None,
                            block_hasher=self.hasher)

    def admit_req(self, req) -> bool:
        m = self.m
        blocks, hit, *_ = m.get_computed_blocks(req)
        self.hit = hit
        got = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        if got is None:
            return False
        req.num_computed_tokens = req.num_tokens
        self.reqs[req.request_id] = req
        row = self.rows[req.request_id] = self.free_rows.pop()
        ids = m.get_block_ids(req.request_id)[0]
        self.table[row, : len(ids)] = ids
        self.nblocks[row] = len(ids)
        return True

    def admit(self, rid: int, prompt: np.ndarray) -> bool:
        return self.admit_req(self.request(rid, prompt.tolist()))

    def decode(self, rids, toks) -> None:
        m, bs = self.m, self.bs
        rows = np.empty(len(rids), np.int64)
        pos = np.empty(len(rids), np.int64)
        for k, (r, t) in enumerate(zip(rids.tolist(), toks.tolist())):
            req = self.reqs[str(r)]
            req.append_output_token_ids(t)
            new = m.allocate_slots(req, 1)
            assert new is not None, "out of blocks"
            row = self.rows[req.request_id]
            ids = new.get_block_ids()[0]
            if ids:
                nb = self.nblocks[row]
                self.table[row, nb: nb + len(ids)] = ids
                self.nblocks[row] = nb + len(ids)
            rows[k] = row
            pos[k] = req.num_computed_tokens
            req.num_computed_tokens += 1
        # The slot mapping, as BlockTable.compute_slot_mapping does.
        self.slot_mapping = self.table[rows, pos // bs].astype(np.int64) * bs + pos % bs

    def finish(self, rid: int) -> None:
        req = self.reqs.pop(str(rid))
        self.m.free(req)
        self.free_rows.append(self.rows.pop(req.request_id))


class VLLMDecode:
    def __init__(self, steps: int, lens: np.ndarray) -> None:
        bs = 16
        rng = np.random.default_rng(2)
        self.v = VLLM(int((lens.sum() + NSEQ * (steps + bs)) // bs) + NSEQ, bs, int(lens.max()) + steps + bs)
        for i in range(NSEQ):
            assert self.v.admit(i, rng.integers(0, 100_000, int(lens[i]), dtype=np.int32))
        self.ids = np.arange(NSEQ, dtype=np.int64)
        self.toks = np.empty(NSEQ, np.int32)

    def step(self, step: int) -> int:
        self.toks[:] = step
        t0 = time.perf_counter_ns()
        self.v.decode(self.ids, self.toks)
        return time.perf_counter_ns() - t0


class VLLMAdmit:
    """vLLM frees a finished request's blocks to its free queue with their
    hashes and evicts them when it hands them out again, so no untimed
    eviction is needed for each call to find blocks. The timing includes
    Request(...), whose block hasher hashes the prompt (vLLM's admission
    does that when the request arrives)."""

    def __init__(self, bs: int) -> None:
        rng = np.random.default_rng(1)
        self.base = rng.integers(0, 100_000, PLEN, dtype=np.int32).tolist()
        self.v = VLLM((ROUND + 4) * (PLEN // bs), bs, PLEN + bs)
        assert self.v.admit_req(self.v.request(-1, self.base[: CACHED + 1]))  # held for the run

    def admit(self, i: int) -> int:
        v = self.v
        self.base[CACHED] = i
        toks = list(self.base)
        t0 = time.perf_counter_ns()
        ok = v.admit_req(v.request(i, toks))
        t = time.perf_counter_ns() - t0
        assert ok and v.hit == CACHED, v.hit
        v.finish(i)
        return t


# ----------------------------------------------------------------- trace


def make_trace(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sys_prompts = [rng.integers(0, 100_000, int(rng.integers(1000, 4001)), dtype=np.int32) for _ in range(100)]
    ranks = np.arange(1, 101, dtype=np.float64)
    p = ranks ** -1.1
    p /= p.sum()
    which = rng.choice(100, size=n, p=p)
    reqs = []
    for i in range(n):
        user = rng.integers(0, 100_000, int(rng.integers(50, 501)), dtype=np.int32)
        reqs.append((np.concatenate((sys_prompts[which[i]], user)), int(rng.integers(20, 201))))
    return reqs


class TraceRun:
    """One system's scheduler state on the trace."""

    def __init__(self, sysobj, reqs) -> None:
        self.sys, self.reqs = sysobj, reqs
        self.waiting = list(range(len(reqs)))[::-1]
        self.running: list = []
        self.left: dict = {}
        self.host = 0
        self.steps = 0

    def done(self) -> bool:
        return not self.waiting and not self.running

    def step(self, max_running: int = 64, budget: int = 8192) -> None:
        pc = time.perf_counter_ns
        s = self.sys
        self.steps += 1
        used = 0
        while self.waiting and len(self.running) < max_running:
            rid = self.waiting[-1]
            prompt, out = self.reqs[rid]
            if self.running and used + len(prompt) > budget:
                break
            t0 = pc()
            ok = s.admit(rid, prompt)
            self.host += pc() - t0
            if not ok:
                break
            self.waiting.pop()
            used += len(prompt)
            self.running.append(rid)
            self.left[rid] = out
        if not self.running:
            raise SystemExit(f"{s.name}: a request does not fit an empty pool")
        rids = np.array(self.running, dtype=np.int64)
        toks = (rids * 7 + self.steps).astype(np.int32) % 100_000
        t0 = pc()
        s.decode(rids, toks)
        self.host += pc() - t0
        still = []
        for rid in self.running:
            self.left[rid] -= 1
            if self.left[rid] == 0:
                t0 = pc()
                s.finish(rid)
                self.host += pc() - t0
            else:
                still.append(rid)
        self.running = still


def run_traces(systems, reqs) -> list:
    """Drives the systems through the trace in lockstep (one scheduler
    step of each in turn), so the machine's load falls on all alike.
    Returns (host seconds, steps) per system."""
    runs = [TraceRun(s, reqs) for s in systems]
    while not all(r.done() for r in runs):
        for r in runs:
            if not r.done():
                r.step()
    return [(r.host / 1e9, r.steps) for r in runs]


class SGLangTrace(SGLang):
    name = "SGLang page 1"


class VLLMTrace(VLLM):
    name = "vLLM"


def in_turn(objs: dict, calls: int, method: str, first: int) -> dict:
    """Median microseconds of each object's timed call: each object makes
    its calls in one block, starting with object number first (main
    rotates it every round, so a slow spell of the machine does not fall
    on one system each time). Taking turns call by call instead left each
    system's data evicted by the others' (vLLM's 3 ms decode step most),
    which doubled or tripled kvplug's and SGLang's times; a real engine's
    own work between its calls does the same, but it does so to every
    system alike. The first 5 calls of a block are not counted."""
    names = list(objs)
    names = names[first % len(names):] + names[: first % len(names)]
    t = {}
    for k in names:
        t[k] = [getattr(objs[k], method)(i) for i in range(calls)][5:]
        if hasattr(objs[k], "close"):
            objs[k].close()
    return {k: median_us(t[k]) for k in objs}


# ----------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small counts, to check the script")
    ap.add_argument("--only", default="", help="comma-separated: decode,admit,trace")
    ap.add_argument("--systems", default="kvplug,c,sglang,vllm")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the decode and admission measurements")
    a = ap.parse_args()
    steps = 20 if a.quick else 200  # decode steps a round
    n_admit = 50 if a.quick else 300  # admissions a round
    n_trace = 200 if a.quick else 5000
    only = set(a.only.split(",")) if a.only else {"decode", "admit", "trace"}
    systems = set(a.systems.split(","))
    versions = {"kvplug": kvplug.version_string()}
    have = {}
    if "sglang" in systems:
        try:
            import sglang

            sglang_modules()
            versions["sglang"] = sglang.__version__
            have["sglang"] = True
        except Exception as e:  # noqa: BLE001
            print(f"SGLang not available: {e!r}")
    if "vllm" in systems:
        try:
            import vllm

            versions["vllm"] = vllm.__version__
            VLLM(16, 16, 64)
            have["vllm"] = True
        except Exception as e:  # noqa: BLE001
            print(f"vLLM not available: {e!r}")
    import torch

    versions["torch"] = torch.__version__
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; {platform.machine()}, nproc {os.cpu_count()}, "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; Python {platform.python_version()}, "
          f"numpy {np.__version__}; " + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    exe = c_driver() if "c" in systems else None
    results: dict = {}

    def record(work, system, value):
        results.setdefault((work, system), []).append(value)

    lens = np.random.default_rng(2).integers(1000, 4000, NSEQ)
    for r in range(a.repeat):
        if "decode" in only:
            w = "decode step, 256 seqs of 1000-4000 tokens (us)"
            objs = {}
            if "kvplug" in systems:
                objs["kvplug Python"] = KvplugDecode(steps, lens)
            if have.get("sglang"):
                objs["SGLang page 1"] = SGLangDecode(steps, lens)
            if have.get("vllm"):
                objs["vLLM"] = VLLMDecode(steps, lens)
            for k, v in in_turn(objs, steps, "step", r).items():
                record(w, k, v)
            del objs
            if exe:
                record(w, "kvplug C", c_median(exe, "decode", str(steps)))
        if "admit" in only:
            for bs in (16, 64):
                w = f"admit 4096 tokens, 2048 cached, block size {bs} (us)"
                objs = {}
                if "kvplug" in systems:
                    objs["kvplug Python"] = KvplugAdmit(bs)
                if have.get("sglang"):
                    objs["SGLang page 1"] = SGLangAdmit(1)
                    objs[f"SGLang page {bs}"] = SGLangAdmit(bs)
                if have.get("vllm"):
                    objs["vLLM"] = VLLMAdmit(bs)
                for k, v in in_turn(objs, n_admit, "admit", r).items():
                    record(w, k.replace(f"page {bs}", "page = block size"), v)
                del objs
                if exe:
                    record(w, "kvplug C", c_median(exe, "admit", str(bs), str(max(n_admit, 1000))))
        for (w, k), v in results.items():
            if len(v) == r + 1:
                print(f"round {r}: {w:<52} {k:<26} {v[-1]:10.1f}", flush=True)
    if "trace" in only:
        reqs = make_trace(n_trace)
        w = f"multi-tenant trace, {n_trace} requests, host time (s)"
        objs = []
        if "kvplug" in systems:
            objs.append(KvplugTrace(32768, 16))
        if have.get("sglang"):
            objs.append(SGLangTrace(32768 * 16, 1, 64 + 1, 8192))
        if have.get("vllm"):
            objs.append(VLLMTrace(32768, 16, 8192))
        for o, (sec, st) in zip(objs, run_traces(objs, reqs)):
            if hasattr(o, "m") and hasattr(o.m, "close"):
                o.m.close()
            record(w, o.name, sec)
            print(f"{w:<52} {o.name:<26} {sec:10.2f} ({st} steps)", flush=True)
    print("\nsummary (median of the rounds; range in brackets):")
    for (w, k), v in results.items():
        v = sorted(v)
        rng_txt = f" [{v[0]:.1f}-{v[-1]:.1f}]" if len(v) > 1 else ""
        print(f"{w:<52} {k:<26} {statistics.median(v):10.2f}{rng_txt}")
    print(f"load at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
