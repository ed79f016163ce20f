"""Runs a transformers decoder over a PagedKVCache: one forward pass per
scheduled Batch (prefill chunks, decode steps, or both mixed), optional CUDA
graphs for decode steps, and `generate` for a batch of prompts.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import kvplug

from . import recurrent
from .attention import NAME, StepContext, register
from .cache import Batch, ModelShape, PagedKVCache
from .readback import HostReadback

__all__ = ["Runner", "prepare_model", "generate"]


def prepare_model(model: Any) -> Any:
    """Registers the "kvplug" attention and switches `model` to it (eval
    mode), and its linear-attention layers (Qwen3-Next) to states in the
    cache's blocks (kvplug.hf.recurrent). Returns the model."""
    register()
    cfg = model.config
    if "linear_attention" in (getattr(cfg, "layer_types", None) or ()):
        ModelShape.of(cfg)  # raises for linear-attention layers it does not serve
        recurrent.prepare_linear_attention(model)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:  # older transformers: the config field is what the attention layers read
        cfg._attn_implementation = NAME
    return model.eval()


# The head sizes kvplug's attention kernels are built for (the header's
# kvp_paged_decode_args.head_dim); the torch path takes any.
KERNEL_HEAD_DIMS = (64, 128, 256)


def _backend_for(cache: PagedKVCache, backend: str) -> str:
    if backend not in ("auto", "kernels", "torch"):
        raise kvplug.InvalidArgumentError(f"kvplug.hf: backend must be 'auto', 'kernels' or 'torch', not {backend!r}")
    gpu_ok = cache.device.type == "cuda" and cache.dtype in (torch.float16, torch.bfloat16)
    if backend == "kernels" and not gpu_ok:
        raise kvplug.InvalidArgumentError(f"kvplug.hf: the kernels need a CUDA cache of float16 or bfloat16; this one is {cache.dtype} "
                                          f"on {cache.device} (use backend='torch')")
    if cache.shape.head_dim not in KERNEL_HEAD_DIMS:
        if backend == "kernels":
            raise kvplug.InvalidArgumentError(f"kvplug.hf: the kernels take head_dim {', '.join(map(str, KERNEL_HEAD_DIMS))}; "
                                              f"this model's is {cache.shape.head_dim} (use backend='torch')")
        gpu_ok = False
    if backend == "auto":
        return "kernels" if gpu_ok else "torch"
    return backend


class _DecodeGraph:
    """A decode step for up to `size` sequences captured in a CUDA graph.
    Static inputs are overwritten before each replay from two pinned host
    buffers (two copies per step); rows past the batch are padding (slot -1:
    nothing written). Without cascade, attention is paged_decode (padding
    rows: length 0). With cascade, two graphs share the static inputs: one
    runs kvplug.cascade's shared-prefix decode, planned before each replay
    into the runner's workspaces, the other paged_decode; the plan's route
    (the library's cost model) picks which one replays (padding rows: one
    token of block 0, no sharing, which both read harmlessly)."""

    # A batch that only grew keeps its plan and route this many steps, then
    # plans again so that the route follows the tails' growth.
    REPLAN_EVERY = 16

    def __init__(self, runner: "Runner", size: int, pool: Any, cascade: bool) -> None:
        c, dev = runner.cache, runner.cache.device
        self.runner, self.size, self.cascade = runner, size, cascade
        mb = runner.max_blocks
        self.mb = mb
        # int64 [ids | positions] and int32 [slots | lens | table | each further layer group's slots and
        # table] staging buffers and their device twins
        extra = len(c.groups) - 1
        n32 = 2 * size + size * mb + extra * (size + size * mb)
        self.h64 = torch.zeros(2 * size, dtype=torch.long).pin_memory()
        self.h32 = torch.zeros(n32, dtype=torch.int32).pin_memory()
        self.d64 = torch.zeros(2 * size, dtype=torch.long, device=dev)
        self.d32 = torch.zeros(n32, dtype=torch.int32, device=dev)
        self.ids, self.pos = self.d64[:size].view(1, size), self.d64[size:].view(1, size)
        self.slots, self.lens = self.d32[:size], self.d32[size:2 * size]
        self.table = self.d32[2 * size:2 * size + size * mb].view(size, mb)
        self.h_slots, self.h_lens = self.h32[:size], self.h32[size:2 * size]
        self.h_table = self.h32[2 * size:2 * size + size * mb].view(size, mb)
        # Layer groups: group g's slots and table, after group 0's.
        self.g_slots, self.g_tables, self.hg_slots, self.hg_tables = [], [], [], []
        at = 2 * size + size * mb
        for _ in range(extra):
            for buf, sl, tb in ((self.d32, self.g_slots, self.g_tables), (self.h32, self.hg_slots, self.hg_tables)):
                sl.append(buf[at:at + size])
                tb.append(buf[at + size:at + size + size * mb].view(size, mb))
            at += size + size * mb
        self.plan: Any = None
        self.plan_ids: Optional[np.ndarray] = None
        self.plan_age = 0
        self.route_decode = not cascade  # the replay this step: paged_decode's graph
        sh = c.shape
        splits = kvplug.attn.num_splits(c.kv_dtype, sh.head_dim, size, sh.num_q_heads, sh.num_kv_heads, runner.max_model_len)
        self.ctx = StepContext(c, "kernels", self.slots, self.table, self.lens, np.arange(size + 1, dtype=np.int32),
                               np.ones(size, np.int32), True, decode_ws=runner.decode_ws, num_splits=splits)
        if extra:
            self.ctx.group_tables = [self.table] + self.g_tables
            self.ctx.group_slots = [self.slots] + self.g_slots
            for t in self.hg_slots + self.hg_tables:
                t.fill_(-1)
        self.h_slots.fill_(-1)
        if cascade:
            # A capture needs a cascade-route plan: every row holds blocks 0 and 1 and one token of block 2.
            k = min(3, mb)
            self.h_table.fill_(-1)
            self.h_table[:, :k] = torch.arange(k, dtype=torch.int32)
            self.h_lens.fill_((k - 1) * c.block_size + 1)
            self.d32.copy_(self.h32)
            plain = dataclasses.replace(self.ctx, plans={})
            self.ctx.cascade_plan = self._plan_now(decode_route=False)
            runner._cascade_owner = None  # the capture's plan is no step's
        else:
            self.d32.copy_(self.h32)
        self.graph, self.logits = self._capture(self.ctx, pool)
        if cascade:
            self.graph_decode, self.logits_decode = self._capture(plain, self.graph.pool())

    def _capture(self, ctx: StepContext, pool: Any) -> Tuple[Any, torch.Tensor]:
        model, dev = self.runner.model, self.runner.cache.device
        s = torch.cuda.Stream(device=dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):  # warm-up outside the graph (lazy inits, autotuning)
            for _ in range(2):
                model(input_ids=self.ids, position_ids=self.pos, use_cache=False, kvplug_batch=ctx)
        torch.cuda.current_stream(dev).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = model(input_ids=self.ids, position_ids=self.pos, use_cache=False, kvplug_batch=ctx).logits[0]
        return graph, logits

    def _plan_now(self, decode_route: bool = True) -> Any:
        r, sh = self.runner, self.runner.cache.shape
        return kvplug.cascade.plan(self.h_table, self.h_lens, self.lens, sh.num_q_heads, sh.num_kv_heads, sh.head_dim,
                                   r.cache.dtype, r.cascade_ws, block_size=r.cache.block_size,
                                   decode_route=decode_route, hopper=r.cache.hopper_prefill)

    def load(self, batch: Batch) -> None:
        """Writes the batch into the static inputs: host work and two copies
        (plus the cascade plan's own copy when it has to plan again)."""
        n, size = len(batch), self.size
        mb = batch.block_table.shape[1]
        h64 = self.h64.numpy()
        h64[:n] = batch.input_ids
        h64[size:size + n] = batch.seq_lens - 1
        h_slots, h_lens, h_table = self.h_slots.numpy(), self.h_lens.numpy(), self.h_table.numpy()
        h_slots[:n] = batch.slot_mapping
        h_slots[n:] = -1
        h_lens[:n] = batch.seq_lens
        h_table[:n, :mb] = batch.block_table
        h_table[:n, mb:] = -1
        for g, (hs, ht) in enumerate(zip(self.hg_slots, self.hg_tables), start=1):
            hs, ht = hs.numpy(), ht.numpy()
            gt = batch.group_tables[g]
            hs[:n] = batch.group_slots[g]
            hs[n:] = -1
            ht[:n, :gt.shape[1]] = gt
            ht[:n, gt.shape[1]:] = -1
            ht[n:] = -1
        if self.cascade:
            h_lens[n:] = 1  # padding rows: one token of block 0, no sharing, nothing written
            h_table[n:] = -1
            h_table[n:, 0] = 0
        else:
            h_lens[n:] = 0
        self.d64.copy_(self.h64, non_blocking=True)
        self.d32.copy_(self.h32, non_blocking=True)
        if self.cascade:
            # A step whose sequences only grew keeps its plan (checked in O(batch)) and its route for
            # REPLAN_EVERY steps. The workspaces are shared by every graph and eager step: only the
            # last planner may skip.
            r = self.runner
            same = (r.cascade_update and r._cascade_owner is self and self.plan_age < self.REPLAN_EVERY
                    and np.array_equal(self.plan_ids, batch.seq_ids))
            if same and (self.route_decode or self.plan.update(h_lens)):
                self.plan_age += 1
            else:
                self.plan = self._plan_now(decode_route=r.cascade_auto_route)
                self.plan_ids = batch.seq_ids.copy()
                self.plan_age = 0
                self.route_decode = self.plan.route != kvplug.cascade.ROUTE_CASCADE
                r._cascade_owner = self

    def replay(self, n: int) -> torch.Tensor:
        if self.route_decode and self.cascade:
            self.graph_decode.replay()
            self.runner.graph_decode_steps += 1
            return self.logits_decode[:n]
        self.graph.replay()
        return self.logits[:n]


class Runner:
    """Runs `model` (a transformers causal LM of the Llama family, prepared
    with prepare_model) over `cache`.

    backend: "kernels" (kvplug's CUDA kernels; needs a CUDA fp16/bf16
    cache), "torch" (the reference path: gather through the block table and
    softmax attention in torch; any device), or "auto" (kernels where they run).
    max_batch / max_step_tokens bound a step (they size the kernels'
    workspaces); max_model_len bounds a sequence (the block-table width).
    cuda_graphs: capture decode steps for batch sizes `graph_sizes`
    (default 1, 2, 4, 8, then multiples of 16 up to max_batch) and replay
    them; other steps run eagerly. cascade: steps use kvplug.cascade's
    shared-prefix attention (each block run that sequences share, a system
    prompt or the prompt of forked samples, read once per step for all of
    their decode rows and prompt chunks; kernels backend, no sliding window)
    where the library's cost model says it pays, paged decode or prefill
    elsewhere (decode graphs: both are captured and the plan's route picks
    the replay).

    A cache with a host tier (PagedKVCache(host_tier_slots=...)) has its
    copies run by step(): once per step, before the forward pass, on the
    step's stream (kvplug.hf.tier_copy), which first waits, on the device,
    for the early loads of the sequences that join it (issued by the
    schedule that admitted them, beside the step before); so do a model's linear-attention
    states (Qwen3-Next): the manager's checkpoint and prefix-hit copies
    (PagedKVCache.apply_copies), and the layers run from and into each
    sequence's state blocks (kvplug.hf.recurrent)."""

    def __init__(
        self,
        model: Any,
        cache: PagedKVCache,
        *,
        backend: str = "auto",
        max_batch: int = 256,
        max_step_tokens: int = 8192,
        max_model_len: int = 8192,
        cuda_graphs: bool = False,
        graph_sizes: Optional[Sequence[int]] = None,
        cascade: bool = False,
    ) -> None:
        if getattr(model.config, "_attn_implementation", None) != NAME:
            raise kvplug.InvalidArgumentError("kvplug.hf.Runner: call kvplug.hf.prepare_model(model) first (attn_implementation must be 'kvplug')")
        shape = ModelShape.of(model.config)
        if shape != cache.shape:
            raise kvplug.InvalidArgumentError(f"kvplug.hf.Runner: the cache was made for {cache.shape}, the model is {shape}")
        if shape.recurrent is not None and not recurrent.is_prepared(model):
            # transformers' own forward would run the packed batch as one sequence, with no state.
            raise kvplug.InvalidArgumentError("kvplug.hf.Runner: call kvplug.hf.prepare_model(model) first (its linear-attention "
                                              "layers must keep their states in the cache)")
        p = next(model.parameters())
        if p.dtype != cache.dtype or p.device != cache.device:
            raise kvplug.InvalidArgumentError(f"kvplug.hf.Runner: the model is {p.dtype} on {p.device}, the cache {cache.dtype} on "
                                              f"{cache.device} (PagedKVCache.for_model makes a matching one)")
        self.model = model
        self.cache = cache
        self.backend = _backend_for(cache, backend)
        self.max_batch = int(max_batch)
        self.max_step_tokens = int(max_step_tokens)
        self.max_model_len = int(max_model_len)
        self.max_blocks = -(-self.max_model_len // cache.block_size)
        self.device = cache.device
        self._readback = HostReadback(self.device, self.max_batch) if self.device.type == "cuda" else None
        self.prefill_ws = self.decode_ws = self.prefill_ws_window = None
        self.cascade = bool(cascade)
        self.cascade_update = True  # keep a decode graph's cascade plan while its batch only grows (plan.update)
        self.cascade_auto_route = True  # False: every plan keeps the cascade route (tests; may not fit the workspaces)
        self.cascade_ws = None
        self._cascade_owner: Any = None  # the graph whose plan the cascade workspaces hold (None: an eager step's)
        if self.cascade and self.backend != "kernels":
            raise kvplug.InvalidArgumentError("kvplug.hf: cascade attention needs the kernels backend (a CUDA fp16/bf16 cache)")
        if self.backend == "kernels":
            sh = cache.shape
            kvplug.attn.prepare(self.device)
            if self.cascade:
                # Sized for varlen queries too: prefill and mixed steps plan into them as well.
                self.cascade_ws = kvplug.cascade.Workspaces(self.max_batch, sh.num_q_heads, sh.num_kv_heads, sh.head_dim,
                                                            device=self.device, max_tokens=self.max_step_tokens)
            self.prefill_ws = torch.empty(kvplug.attn.prefill_workspace_size(
                self.max_batch, self.max_step_tokens, sh.num_q_heads, sh.num_kv_heads, sh.head_dim),
                dtype=torch.uint8, device=self.device)
            if sh.sliding_window:
                # Full and window layers plan the same step twice (window and none): each plan's work list
                # needs a workspace of its own.
                self.prefill_ws_window = torch.empty_like(self.prefill_ws)
            self.decode_ws = torch.empty(kvplug.attn.workspace_size(self.max_batch, sh.num_q_heads, sh.head_dim),
                                         dtype=torch.uint8, device=self.device)
        cfg = model.config
        # The window the attention layers receive (Qwen2 keeps sliding_window set with use_sliding_window off).
        self._window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.graphs: Dict[int, _DecodeGraph] = {}
        if cuda_graphs:
            self.capture(graph_sizes)
        self._inputs_copied: Any = None  # a CUDA event after the last step's host-to-device input copies
        self.graph_steps = 0
        self.graph_decode_steps = 0  # with cascade: graph steps the cost model sent to paged_decode
        self.eager_steps = 0
        self.last_prep = 0.0  # host seconds the last step spent preparing (metadata, plans, graph inputs)

    # -- CUDA graphs ----------------------------------------------------------

    def capture(self, sizes: Optional[Sequence[int]] = None) -> None:
        """Captures decode graphs (kernels backend only), sliding windows and
        attention layer groups included (the decode kernel takes the window
        and each group's table). Models with recurrent layers (their state
        updates run per sequence) and cascade with a window (the
        shared-prefix kernels take none) run decode eagerly."""
        if self.backend != "kernels":
            raise kvplug.InvalidArgumentError("kvplug.hf: CUDA graphs need the kernels backend (a CUDA fp16/bf16 cache)")
        if self.cache.recurrent_groups or (self.cascade and self._window):
            return
        if sizes is None:
            sizes = [s for s in (1, 2, 4, 8) if s <= self.max_batch] + list(range(16, self.max_batch + 1, 16))
        sizes = sorted({int(s) for s in sizes if 0 < int(s) <= self.max_batch}, reverse=True)
        pool = None
        with torch.no_grad():
            for s in sizes:  # largest first: the smaller graphs reuse its memory pool
                try:
                    g = _DecodeGraph(self, s, pool, self.cascade)
                except RuntimeError as e:
                    # The model's own code may not be capturable (a host copy in the forward pass, as
                    # transformers' gpt-oss MoE makes): say so, rather than a failure deep in torch.
                    self.graphs.clear()
                    raise kvplug.InvalidArgumentError(f"kvplug.hf: {type(self.model).__name__} cannot be captured in a "
                                                      f"CUDA graph ({e}); run it with cuda_graphs=False") from e
                pool = g.graph.pool()
                self.graphs[s] = g
        torch.cuda.synchronize(self.device)

    def _graph_for(self, n: int) -> Optional[_DecodeGraph]:
        best = None
        for s, g in self.graphs.items():
            if s >= n and (best is None or s < best.size):
                best = g
        return best

    # -- steps ----------------------------------------------------------------

    def _context(self, batch: Batch) -> StepContext:
        dev = self.device
        qo = batch.qo_indptr()
        host = torch.from_numpy
        pin = dev.type == "cuda"
        meta = np.concatenate([batch.slot_mapping, batch.seq_lens, qo]).astype(np.int32)
        meta_t = host(meta)
        if pin:
            meta_t = meta_t.pin_memory()
        meta_d = meta_t.to(dev, non_blocking=True)
        T, n = batch.num_tokens, len(batch)
        slots, lens, qo_d = meta_d[:T], meta_d[T:T + n], meta_d[T + n:]
        table = host(np.ascontiguousarray(batch.block_table)).to(dev, non_blocking=True)
        ctx = StepContext(self.cache, self.backend, slots, table, lens, qo, batch.seq_lens, batch.is_decode,
                          qo_indptr=qo_d, prefill_ws=self.prefill_ws, decode_ws=self.decode_ws,
                          prefill_ws_window=self.prefill_ws_window)
        if self.cascade and self._window is None:
            # Shared-prefix attention for decode rows and prompt chunks alike (chunks of prompts that share
            # a cached system prompt read it once); the plan's route is plain decode or prefill where
            # sharing does not pay.
            sh = self.cache.shape
            varlen = {} if batch.is_decode else dict(qo_indptr_host=qo, qo_indptr=qo_d)
            ctx.cascade_plan = kvplug.cascade.plan(
                torch.from_numpy(np.ascontiguousarray(batch.block_table)), batch.seq_lens, lens, sh.num_q_heads,
                sh.num_kv_heads, sh.head_dim, self.cache.dtype, self.cascade_ws, block_size=self.cache.block_size,
                decode_route=self.cascade_auto_route, hopper=self.cache.hopper_prefill, **varlen)
            self._cascade_owner = None
        elif self.backend == "kernels" and not batch.is_decode:
            ctx.plan(ctx.window_left(self._window))  # now, so that its host time counts as the step's preparation
        if batch.group_tables is not None:
            # Layer groups: each group's table and slots (group 0's are the step's own).
            ctx.group_tables = [table] + [host(np.ascontiguousarray(t)).to(dev, non_blocking=True) for t in batch.group_tables[1:]]
            ctx.group_slots = [slots] + [host(np.ascontiguousarray(s).astype(np.int32)).to(dev, non_blocking=True)
                                         for s in batch.group_slots[1:]]
        if self.cache.recurrent_groups:
            # A recurrent group's table holds one block per sequence: its state.
            ctx.state_blocks = [None] * len(self.cache.groups)
            for g in self.cache.recurrent_groups:
                ctx.state_blocks[g] = ctx.group_tables[g][:, 0].long()  # the group's table, already on the device
        if self.backend == "torch":
            bs = self.cache.block_size
            tables = batch.group_tables if batch.group_tables is not None else [batch.block_table]
            ctx.group_gather = []
            for g, tb in enumerate(tables):
                if g in self.cache.recurrent_groups:
                    ctx.group_gather.append([])
                    continue
                gather = []
                for i, L in enumerate(batch.seq_lens.tolist()):
                    t = np.arange(L)
                    # A window group's dropped blocks (-1) hold tokens its mask excludes: any slot will do.
                    gather.append(host(np.maximum(tb[i, t // bs], 0).astype(np.int64) * bs + t % bs).to(dev))
                ctx.group_gather.append(gather)
            ctx.gather = ctx.group_gather[0]
        return ctx

    def _record_inputs_copied(self) -> None:
        if self.device.type == "cuda" and (self.graphs or self.cascade):
            if self._inputs_copied is None:
                self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record(torch.cuda.current_stream(self.device))

    def _check(self, batch: Batch) -> None:
        if len(batch) > self.max_batch:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: a step of {len(batch)} sequences; this Runner takes up to {self.max_batch}")
        if batch.num_tokens > self.max_step_tokens:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: a step of {batch.num_tokens} tokens; this Runner takes up to {self.max_step_tokens}")
        if len(batch) and int(batch.seq_lens.max()) > self.max_model_len:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: a sequence of {int(batch.seq_lens.max())} tokens; max_model_len is {self.max_model_len}")

    def to_host(self, t: torch.Tensor) -> List[Any]:
        """t.tolist() for a step's sampled token ids: on a CUDA device without
        a device-to-host copy, which would wait behind the host tier's
        stores in flight (kvplug.hf.readback)."""
        return t.tolist() if self._readback is None else self._readback.tolist(t)

    @torch.no_grad()
    def step(self, batch: Batch, all_logits: bool = False) -> torch.Tensor:
        """Computes a scheduled batch and marks its tokens computed. Returns
        float32 logits: one row per sequence (its last new token's), or with
        all_logits one row per new token (sequence after sequence)."""
        self._check(batch)
        if len(batch) == 0:
            return torch.empty((0, self.model.config.vocab_size), dtype=torch.float32, device=self.device)
        t0 = time.perf_counter()
        if self._inputs_copied is not None:
            # The graphs' pinned input buffers and the cascade host workspace are rewritten below: the last
            # step's copies out of them must have run (a caller need not wait for a step's results before
            # scheduling the next one). Usually done already; otherwise this waits for one step.
            self._inputs_copied.synchronize()
        if self.cache.tier is not None:
            # The host tier's copies of this step (its admissions' reloads, demotions ahead of need) go on the
            # step's stream ahead of the forward pass, after it waits for the early loads of the sequences that
            # join it: every reloaded block lands before attention reads it.
            self.cache.tier.step(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        # The recurrent states' queued copies (checkpoints of the last step, this step's prefix hits), ahead of
        # the forward pass that reads and overwrites them.
        self.cache.apply_copies()
        g = self._graph_for(len(batch)) if (batch.is_decode and self.graphs) else None
        if g is not None:
            g.load(batch)
            self._record_inputs_copied()
            self.last_prep = time.perf_counter() - t0
            logits = g.replay(len(batch))
            self.graph_steps += 1
        else:
            ctx = self._context(batch)
            self._record_inputs_copied()
            self.last_prep = time.perf_counter() - t0
            ids = torch.from_numpy(batch.input_ids).to(self.device, non_blocking=True)[None]
            pos = torch.from_numpy(batch.positions()).to(self.device, non_blocking=True)[None]
            keep: Any = 0
            if not all_logits:
                keep = torch.from_numpy(batch.qo_indptr()[1:].astype(np.int64) - 1).to(self.device)
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False, kvplug_batch=ctx,
                                logits_to_keep=keep).logits[0]
            self.eager_steps += 1
        self.cache.commit(batch)
        return logits.float()


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 32,
    *,
    cache: Optional[PagedKVCache] = None,
    runner: Optional[Runner] = None,
    num_blocks: Optional[int] = None,
    block_size: Optional[int] = None,
    chunk: int = 512,
    temperature: float = 0.0,
    eos_token_id: Optional[int] = None,
    seed: int = 0,
) -> List[List[int]]:
    """Generates up to max_new_tokens tokens for each prompt (lists of token
    ids) through kvplug's paged cache: all prompts prefilled in chunks of
    `chunk` tokens, then decoded together; when the pool runs out, the
    newest sequence is preempted and re-admitted later. Greedy when
    temperature is 0. Returns each prompt's new tokens.

    A cache (and a runner) are made for the call unless given: num_blocks
    defaults to room for every prompt and its outputs, block_size to 16,
    or for a model with linear-attention layers the smallest multiple of
    16 whose blocks hold their states (PagedKVCache.min_block_size)."""
    prepare_model(model)
    own = cache is None
    if own:
        shape = ModelShape.of(model.config)
        if block_size is None:
            dtype = next(model.parameters()).dtype
            block_size = max(16, -(-PagedKVCache.min_block_size(shape, dtype) // 16) * 16)
        need = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
        if shape.recurrent is not None:
            # Each sequence's state blocks, one per recurrent group of as many layers as the full ones.
            full = shape.layer_types.count("full_attention")
            need += len(prompts) * -(-shape.layer_types.count("linear_attention") // full)
        cache = PagedKVCache.for_model(model, num_blocks or max(need, 1), block_size)
    if runner is None:
        longest = max(len(p) for p in prompts) + max_new_tokens
        runner = Runner(model, cache, max_batch=max(len(prompts), 1), max_step_tokens=max(chunk, len(prompts)),
                        max_model_len=longest)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    base = max(cache.seqs, default=-1) + 1
    ids = [base + i for i in range(len(prompts))]
    outs: List[List[int]] = [[] for _ in prompts]
    try:
        for sid, p in zip(ids, prompts):
            cache.add(sid, p)
        active = list(ids)  # admission order: preemption takes the newest
        while active:
            budget = chunk
            req = []
            for sid in active:
                s = cache.seqs[sid]
                if s.live and s.pending == 1:
                    req.append((sid, 1))
                    budget -= 1
            for sid in active:
                s = cache.seqs[sid]
                if not (s.live and s.pending == 1) and budget > 0:
                    n = min(budget, s.pending)
                    req.append((sid, n))
                    budget -= n
            try:
                batch = cache.schedule(req)
            except kvplug.OutOfBlocksError:
                live = [sid for sid in active if cache.seqs[sid].live]
                if len(live) <= 1:
                    raise
                cache.preempt(live[-1])
                continue
            if batch.refused:  # a prompt the pool can never hold (this call's sequences are removed below)
                raise batch.refused[0][1]
            if len(batch) == 0:
                raise kvplug.OutOfBlocksError("kvplug.hf.generate: the pool cannot hold one sequence; give more num_blocks",
                                              kvplug.Status.OUT_OF_BLOCKS)
            logits = runner.step(batch)
            done = []
            for row, sid in enumerate(batch.seq_ids.tolist()):
                s = cache.seqs[sid]
                if s.pending:
                    continue  # mid-prompt chunk: nothing sampled
                if temperature > 0:
                    probs = torch.softmax(logits[row].cpu() / temperature, -1)
                    tok = int(torch.multinomial(probs, 1, generator=gen))
                else:
                    tok = int(logits[row].argmax())
                k = ids.index(sid)
                outs[k].append(tok)
                if len(outs[k]) >= max_new_tokens or tok == eos_token_id:
                    done.append(sid)
                else:
                    cache.append(sid, tok)
            if done:
                cache.remove(done)
                active = [a for a in active if a not in done]
    finally:
        if own:
            cache.close()
        else:
            leftover = [sid for sid in ids if sid in cache.seqs]
            if leftover:
                cache.remove(leftover)
    return outs
