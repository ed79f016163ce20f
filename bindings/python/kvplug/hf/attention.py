"""The "kvplug" attention implementation for transformers' AttentionInterface.

transformers calls an attention implementation as

    fn(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)

with query [1, q_heads, T, D] and key/value [1, kv_heads, T, D] (rotary
applied) and every keyword argument the caller gave the model's forward in
kwargs. That signature and the forwarding of keyword arguments are the
stable part of the interface (the Cache classes are not), so the step's
paged-cache description travels as the keyword argument `kvplug_batch` (a
StepContext) and the model runs with use_cache=False: this function writes
the new K/V into the paged cache itself, then attends over the cache.

The batch is packed: T is every sequence's new tokens one after the other,
position_ids give each token's position in its own sequence, and no mask
is built (the implementation is not in transformers' mask registry, so
create_causal_mask returns None).

Two paths read the same block tables and slots:
  - "kernels": kvplug.attn.kv_write, then paged_decode (a decode step) or
    prefill_plan/paged_prefill (prefill chunks and mixed batches), on CUDA
    fp16/bf16 tensors;
  - "torch": the reference, on any device and dtype: K/V scattered into the
    cache by slot, gathered back through the block table, attended by torch
    softmax attention with a causal (and sliding-window) mask.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

import kvplug

__all__ = ["NAME", "StepContext", "kvplug_attention", "register"]

NAME = "kvplug"


@dataclasses.dataclass
class StepContext:
    """Everything one forward pass's attention layers need, built once per
    step by the Runner (or, for a captured decode graph, once per graph with
    static tensors updated before each replay)."""

    cache: Any  # PagedKVCache
    backend: str  # "kernels" or "torch"
    slots: torch.Tensor  # int32 [T] on the cache's device (-1: padding, not written)
    block_table: torch.Tensor  # int32 [n, max_blocks]
    seq_lens: torch.Tensor  # int32 [n]
    qo_indptr_host: np.ndarray  # int32 [n + 1]
    seq_lens_host: np.ndarray  # int32 [n]
    decode: bool  # every sequence has one new token
    # kernels: planned once per step and window (kvplug plans carry the window)
    qo_indptr: Optional[torch.Tensor] = None
    prefill_ws: Optional[torch.Tensor] = None
    # A second prefill workspace for the windowed plan of a model with full and window layers: a plan's
    # work list lives in its workspace, so two plans of one step must not share one.
    prefill_ws_window: Optional[torch.Tensor] = None
    decode_ws: Optional[torch.Tensor] = None
    num_splits: int = 0  # decode: fixed for a captured graph (0: the library chooses per call)
    plans: Dict[int, Any] = dataclasses.field(default_factory=dict)
    cascade_plan: Any = None  # a kvplug.cascade plan (shared-prefix attention) instead of paged_decode/prefill
    # torch: per sequence, the flat slot index of each of its tokens (int64 on the device)
    gather: Optional[List[torch.Tensor]] = None
    # backend "custom": fn(ctx, layer, q, k, v, scale, window_left) -> out [T, H, D], for engines (and
    # benchmarks) that bring other kernels over the same cache, block tables and slots
    custom: Optional[Callable[..., torch.Tensor]] = None
    # Layer groups (a hybrid model's cache): each group's block table, slots and (torch) gather; entry 0
    # is block_table, slots and gather. None without groups.
    group_tables: Optional[List[torch.Tensor]] = None
    group_slots: Optional[List[torch.Tensor]] = None
    group_gather: Optional[List[List[torch.Tensor]]] = None
    # Linear-attention layers (kvplug.hf.recurrent): each recurrent group's state block per sequence (int64
    # [n] on the device; None for the attention groups). None without such layers.
    state_blocks: Optional[List[Optional[torch.Tensor]]] = None

    def window_left(self, sliding_window: Optional[int]) -> int:
        """kvplug's window_left (-1: none) for transformers' sliding_window W,
        under which a query at position p sees keys p - W + 1 .. p. A window
        longer than every sequence is no window (so decode keeps its kernel)."""
        if sliding_window is None or sliding_window <= 0:
            return -1
        if len(self.seq_lens_host) and int(self.seq_lens_host.max()) <= sliding_window:
            return -1
        return int(sliding_window) - 1

    def plan(self, window_left: int) -> Any:
        p = self.plans.get(window_left)
        if p is None:
            sh = self.cache.shape
            ws = self.prefill_ws
            if window_left >= 0 and self.prefill_ws_window is not None:
                ws = self.prefill_ws_window
            elif self.plans and self.prefill_ws_window is None:
                raise kvplug.InternalError("kvplug.hf: a second prefill plan in one step needs its own workspace",
                                           kvplug.Status.INTERNAL)
            p = kvplug.attn.prefill_plan(
                self.qo_indptr, self.seq_lens, sh.num_q_heads, sh.num_kv_heads, sh.head_dim, self.cache.dtype,
                ws, window_left=window_left, qo_indptr_host=self.qo_indptr_host,
                kv_lens_host=self.seq_lens_host, hopper=self.cache.hopper_prefill,
                fp8_qkv=self.cache.fp8 and self.cache.fp8_prefill == "fp8")  # FP8: the cache's fp8_prefill
            self.plans[window_left] = p
        return p


def _reference(ctx: StepContext, layer: int, q: torch.Tensor, scale: float, window_left: int,
               gather: List[torch.Tensor], sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of q [T, H, D] over the paged cache, sequence by sequence
    (gather: each sequence's slots in the layer's group; sinks: float [H],
    one more logit per head in the softmax's denominator)."""
    sh = ctx.cache.shape
    kc = ctx.cache.k_cache(layer).reshape(-1, sh.num_kv_heads, sh.head_dim)
    vc = ctx.cache.v_cache(layer).reshape(-1, sh.num_kv_heads, sh.head_dim)
    ks = vs = None
    if ctx.cache.fp8:
        ks = ctx.cache.k_scale(layer).reshape(-1, sh.num_kv_heads)
        vs = ctx.cache.v_scale(layer).reshape(-1, sh.num_kv_heads)
    group = sh.num_q_heads // sh.num_kv_heads
    out = torch.empty_like(q)
    qo = ctx.qo_indptr_host
    for i, idx in enumerate(gather):
        a, b = int(qo[i]), int(qo[i + 1])
        n, L = b - a, int(ctx.seq_lens_host[i])
        if n == 0:
            continue
        if ks is not None:  # FP8: e4m3 * its row's scale (gathered as bytes: no float8 indexing on the CPU)
            k = kc.view(torch.uint8)[idx].view(kc.dtype).float() * ks[idx][..., None]
            v = vc.view(torch.uint8)[idx].view(vc.dtype).float() * vs[idx][..., None]
        else:
            k, v = kc[idx], vc[idx]  # [L, kv_heads, D]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        pos = torch.arange(L - n, L, device=q.device)[:, None]
        t = torch.arange(L, device=q.device)[None, :]
        mask = t <= pos
        if window_left >= 0:
            mask = mask & (t >= pos - window_left)
        # Written out rather than F.scaled_dot_product_attention: on the CPU, SDPA with a boolean mask takes
        # its slow generic path (8x slower at these sizes); scores and softmax in float32 as SDPA does.
        scores = torch.matmul(q[a:b].transpose(0, 1).float(), k.float().transpose(1, 2)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            # The sink is one more column of the softmax whose value row is zero.
            sink = sinks.float()[:, None, None].expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v.float())
        out[a:b] = o.transpose(0, 1).to(out.dtype)
    return out


def _write_fp8(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
    """The torch path's FP8 write, as kvplug.attn.kv_write quantises: each
    (token, kv head) row's scale max |x| / 448 (1 for a zero row), x / scale
    rounded to e4m3 (saturated at +-448)."""
    h, d = cache.shape[-2], cache.shape[-1]
    xf = x.float()
    s = xf.abs().amax(dim=-1)
    s = torch.where(s > 0, s / 448, torch.ones_like(s))
    q = (xf / s[..., None]).clamp(-448, 448).to(cache.dtype)
    # As bytes: torch has no index_copy_ of float8 on the CPU.
    cache.view(torch.uint8).view(-1, h, d).index_copy_(0, slots, q.view(torch.uint8))
    scales.view(-1, h).index_copy_(0, slots, s)


def _float_sinks(module: torch.nn.Module, sinks: torch.Tensor) -> torch.Tensor:
    """The layer's sinks as the kernels take them (float32, contiguous),
    converted once and kept on the module until the parameter changes (its
    version counter moves with every in-place update), not on every step."""
    kept = getattr(module, "_kvplug_sinks", None)
    if kept is not None and kept[0] is sinks and kept[1] == sinks._version:
        return kept[2]
    f = sinks.detach().float().contiguous()
    module._kvplug_sinks = (sinks, sinks._version, f)
    return f


def kvplug_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    kvplug_batch: Optional[StepContext] = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """transformers attention implementation over kvplug's paged cache."""
    ctx = kvplug_batch
    if ctx is None:
        raise RuntimeError(
            "kvplug attention: the model was called without kvplug_batch. A model with attn_implementation='kvplug' "
            "runs through kvplug.hf.Runner (step / generate), which passes the step's paged-cache description; "
            "for plain transformers calls, switch the model back with model.set_attn_implementation('sdpa')")
    if query.shape[0] != 1:
        raise kvplug.InvalidArgumentError(f"kvplug attention: the batch is packed into one row of tokens; got query shape {tuple(query.shape)}")
    if dropout:
        raise kvplug.InvalidArgumentError("kvplug attention is for inference: dropout must be 0 (call model.eval())")
    if kwargs.get("softcap") is not None:
        raise kvplug.InvalidArgumentError("kvplug attention does not support logit softcapping")
    layer = module.layer_idx
    # gpt-oss's learned attention sinks: one logit per query head added to the softmax's denominator.
    sinks = kwargs.get("s_aux")
    g = ctx.cache.group_of[layer]
    table, slots = ctx.block_table, ctx.slots
    if g:
        table, slots = ctx.group_tables[g], ctx.group_slots[g]
    q = query[0].transpose(0, 1)  # [T, H, D]: head_dim stays contiguous, as the kernels need
    k = key[0].transpose(0, 1)  # [T, kv_heads, D]
    v = value[0].transpose(0, 1)
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(q.shape[-1])
    kc, vc = ctx.cache.k_cache(layer), ctx.cache.v_cache(layer)
    ks, vs = ctx.cache.k_scale(layer), ctx.cache.v_scale(layer)  # FP8 caches' scales; None for 16-bit
    if sinks is not None:
        sinks = _float_sinks(module, sinks)
    if ctx.backend == "custom":
        if sinks is not None:
            raise kvplug.InvalidArgumentError("kvplug attention: the custom backend does not take attention sinks")
        out = ctx.custom(ctx, layer, q, k, v, scale, ctx.window_left(sliding_window))
    elif ctx.backend == "kernels":
        kvplug.attn.kv_write(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
        if ctx.cascade_plan is not None and g == 0:  # planned for models without a window only
            out = kvplug.cascade.paged_cascade(ctx.cascade_plan, q, kc, vc, table, scale=scale, sinks=sinks,
                                               k_scale=ks, v_scale=vs)
        elif ctx.decode:
            # The decode kernel, with the layer's own window (not ctx.window_left's, which drops a window no
            # sequence reaches yet: a captured graph replays with longer sequences). With a window the library
            # picks the splits from the window's reach.
            wd = int(sliding_window) - 1 if sliding_window and sliding_window > 0 else -1
            out = kvplug.attn.paged_decode(q, kc, vc, table, ctx.seq_lens, scale=scale, workspace=ctx.decode_ws,
                                           num_splits=ctx.num_splits if wd < 0 else 0, k_scale=ks, v_scale=vs,
                                           sinks=sinks, window_left=wd)
        else:
            out = kvplug.attn.paged_prefill(ctx.plan(ctx.window_left(sliding_window)), q, kc, vc, table, scale=scale,
                                            k_scale=ks, v_scale=vs, sinks=sinks)
    else:
        sh = ctx.cache.shape
        flat = slots.long()
        if ks is not None:
            _write_fp8(k, kc, ks, flat)
            _write_fp8(v, vc, vs, flat)
        else:
            kc.view(-1, sh.num_kv_heads, sh.head_dim).index_copy_(0, flat, k.to(kc.dtype))
            vc.view(-1, sh.num_kv_heads, sh.head_dim).index_copy_(0, flat, v.to(vc.dtype))
        out = _reference(ctx, layer, q, scale, ctx.window_left(sliding_window),
                         ctx.group_gather[g] if ctx.group_gather else ctx.gather, sinks)
    return out.unsqueeze(0), None


_registered = False


def register() -> None:
    """Registers "kvplug" with transformers' AttentionInterface (idempotent).
    Models then take attn_implementation="kvplug" (from_pretrained,
    from_config, or model.set_attn_implementation)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, kvplug_attention)
    _registered = True
