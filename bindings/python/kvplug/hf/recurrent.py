"""Linear-attention (Gated DeltaNet) layers of Qwen3-Next over kvplug's
paged cache.

Such a layer keeps a state per sequence instead of K/V per token: the last
conv_kernel - 1 inputs of its causal convolution and a recurrent state
[num_v_heads, head_k_dim, head_v_dim]. Each sequence's state lives in the
state block that the manager's recurrent layer group gives it
(PagedKVCache.load_states / store_states), so that forks, preemption and
prefix-cache checkpoints move it as block copies.

prepare_linear_attention replaces each such layer's forward by one that,
given the step's StepContext (the kvplug_batch keyword argument that
transformers' decoder layers pass on to their token mixers), runs the
packed batch sequence by sequence: the token-wise projections over the
whole batch, then for each sequence the convolution and the gated delta
rule from its stored state, with the functions transformers' own forward
calls (its torch fallbacks, or the flash-linear-attention and causal-conv1d
kernels where transformers picks them), then the gated norm and the output
projection over the whole batch again. A call without kvplug_batch runs
transformers' forward.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Dict, List

import numpy as np
import torch
import torch.nn.functional as F

import kvplug

__all__ = ["gated_delta_net", "is_prepared", "linear_attention_layers", "prepare_linear_attention"]

# What a Gated DeltaNet module of Qwen3-Next's layout has, and its modeling module's functions.
_MODULE_PARTS = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering", "conv1d", "A_log", "dt_bias", "norm",
                 "out_proj", "key_dim", "value_dim", "head_k_dim", "head_v_dim", "activation")
_FUNCTIONS = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def linear_attention_layers(model: Any) -> Dict[int, torch.nn.Module]:
    """Each linear-attention layer's token mixer, by layer index. Raises
    InvalidArgumentError when one is missing or not of Qwen3-Next's
    layout."""
    layer_types = list(getattr(model.config, "layer_types", None) or ())
    want = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
    found: Dict[int, torch.nn.Module] = {}
    for m in model.modules():
        i = getattr(m, "layer_idx", None)
        if isinstance(i, int) and i in want and hasattr(m, "conv1d"):
            missing = [p for p in _MODULE_PARTS if not hasattr(m, p)]
            missing += [f for f in _FUNCTIONS if not hasattr(sys.modules[type(m).__module__], f)]
            if missing:
                raise kvplug.InvalidArgumentError(f"kvplug.hf: layer {i}'s {type(m).__name__} lacks {', '.join(missing)}: "
                                                  "not a Gated DeltaNet of Qwen3-Next's layout")
            found[i] = m
    absent = [i for i in want if i not in found]
    if absent:
        raise kvplug.InvalidArgumentError(f"kvplug.hf: no linear-attention module found for layers {absent}")
    return found


def _forward(self: torch.nn.Module, hidden_states: torch.Tensor, cache_params: Any = None,
             attention_mask: Any = None, **kwargs: Any) -> torch.Tensor:
    """A prepared layer's forward: over the paged states within a Runner's
    step, transformers' own elsewhere."""
    ctx = kwargs.get("kvplug_batch")
    if ctx is None:
        return type(self).forward(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    return gated_delta_net(self, hidden_states, ctx)


def prepare_linear_attention(model: Any) -> int:
    """Switches the model's linear-attention layers to the paged states
    (idempotent). Returns how many there are."""
    layers = linear_attention_layers(model)
    for m in layers.values():
        m.forward = types.MethodType(_forward, m)
    return len(layers)


def is_prepared(model: Any) -> bool:
    """Whether every linear-attention layer runs over the paged states."""
    return all(getattr(m.forward, "__func__", None) is _forward for m in linear_attention_layers(model).values())


def gated_delta_net(module: torch.nn.Module, hidden_states: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Qwen3NextGatedDeltaNet.forward over a packed batch ([1, T, hidden]:
    the sequences' new tokens one after the other), each sequence starting
    from the state in its state block (none for a sequence's first
    tokens) and leaving its new state there."""
    if hidden_states.shape[0] != 1:
        raise kvplug.InvalidArgumentError(f"kvplug linear attention: the batch is packed into one row of tokens; got "
                                          f"hidden states of shape {tuple(hidden_states.shape)}")
    if ctx.state_blocks is None:
        raise kvplug.InvalidArgumentError("kvplug linear attention: the step context has no state blocks (kvplug.hf.Runner "
                                          "builds them from the batch's recurrent groups)")
    fns = sys.modules[type(module).__module__]
    cache = ctx.cache
    layer = module.layer_idx
    blocks = ctx.state_blocks[cache.group_of[layer]]
    qo = ctx.qo_indptr_host
    lens = np.diff(qo)
    starts = ctx.seq_lens_host - lens
    T = hidden_states.shape[1]

    # Token-wise: the projections, the gates and the decay, for the whole batch at once.
    qkvz = module.in_proj_qkvz(hidden_states)
    ba = module.in_proj_ba(hidden_states)
    query, key, value, z, b, a = module.fix_query_key_value_ordering(qkvz, ba)
    mixed = torch.cat([x.reshape(1, T, -1) for x in (query, key, value)], dim=-1).transpose(1, 2)  # [1, conv_dim, T]
    beta = b.sigmoid()
    # As transformers: in float32, or A might be -inf in float16.
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)

    conv_state, rec_state = cache.load_states(layer, blocks)
    keep = conv_state.shape[-1]  # conv_kernel - 1 inputs
    weight = module.conv1d.weight.squeeze(1)
    outs: List[torch.Tensor] = []
    convs: List[torch.Tensor] = []
    recs: List[torch.Tensor] = []
    for i in range(len(lens)):
        lo, hi, fresh = int(qo[i]), int(qo[i + 1]), int(starts[i]) == 0
        n = hi - lo
        prev = torch.zeros_like(conv_state[i:i + 1]) if fresh else conv_state[i:i + 1]
        # The new inputs behind the last ones of the sequence's past (zeros before its first token): the
        # convolution's outputs at the new positions are those of transformers over the whole sequence.
        x = torch.cat([prev.to(mixed.dtype), mixed[:, :, lo:hi]], dim=-1)
        convs.append(x[:, :, x.shape[-1] - keep:])
        y = fns.causal_conv1d_fn(x, weight, module.conv1d.bias, activation=module.activation)[:, :, keep:]
        y = y.transpose(1, 2)
        q, k, v = torch.split(y, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        q = q.reshape(1, n, -1, module.head_k_dim)
        k = k.reshape(1, n, -1, module.head_k_dim)
        v = v.reshape(1, n, -1, module.head_v_dim)
        if q.shape[2] != v.shape[2]:
            # Each key head serves value heads in a row. transformers' forward repeats them before the rule (up
            # to 5.17) or the rule does (5.23, where repeating first changes nothing).
            q = q.repeat_interleave(v.shape[2] // q.shape[2], dim=2)
            k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
        # transformers' choice: the token-by-token rule for a decode step from a state, else the chunked one.
        rule = fns.torch_recurrent_gated_delta_rule if (n == 1 and not fresh) else fns.torch_chunk_gated_delta_rule
        out, state = rule(q, k, v, g=g[:, lo:hi], beta=beta[:, lo:hi], initial_state=None if fresh else rec_state[i:i + 1],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(out)
        recs.append(state)
    cache.store_states(layer, blocks, torch.cat(convs), torch.cat(recs))

    core = torch.cat(outs, dim=1)  # [1, T, num_v_heads, head_v_dim]
    z_shape = z.shape
    core = module.norm(core.reshape(-1, core.shape[-1]), z.reshape(-1, z.shape[-1]))
    return module.out_proj(core.reshape(z_shape).reshape(1, T, -1))
