"""The attention calls as torch operators (torch.ops.kvplug.*), for
torch.compile and graph capture, which see each call as one op with a fake
implementation (the output's shape and dtype) instead of tracing into
ctypes. Opt-in: importing this module registers them (it imports torch);
`import kvplug` does not.

    import kvplug.ops
    kvplug.ops.kv_write(k, v, k_cache, v_cache, slot_mapping)     # mutates the caches
    out = kvplug.ops.paged_decode(q, k_cache, v_cache, block_table, seq_lens, workspace)
    out = kvplug.ops.paged_prefill(plan.as_tensor(), q, k_cache, v_cache, block_table)

Each op runs the kvplug.attn (kvplug.cascade) call of the same name, with
its checks, on the current stream; the output is allocated by the op. A
plan goes in as plan.as_tensor(), a CPU tensor over its kvp_attn_plan (a
tensor, so a compiled graph takes each step's plan without recompiling);
the plan object itself must stay alive while its steps run, as with the
direct calls.

The direct calls stay the fastest path: an op's dispatch adds a few
microseconds a call (the ops are registered through torch.library.Library;
torch.library.custom_op's Python wrappers cost more than the whole call,
see bench/RESULTS.md).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import _tensors, attn, cascade

__all__ = ["kv_write", "paged_decode", "paged_prefill", "paged_cascade"]

_lib = torch.library.Library("kvplug", "DEF")  # kept: the registrations live as long as it does

_SCHEMAS = {
    "kv_write": "kv_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
    "paged_decode": "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
                    "Tensor? workspace=None, float scale=0.0, int num_splits=0, int max_seq_len=0, int q_len=1) -> Tensor",
    "paged_prefill": "paged_prefill(Tensor plan, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
                     "float scale=0.0) -> Tensor",
    "paged_cascade": "paged_cascade(Tensor plan, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
                     "float scale=0.0) -> Tensor",
}


def _kv_write(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any) -> None:
    attn.kv_write(key, value, k_cache, v_cache, slot_mapping)


def _paged_decode(q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any, workspace: Optional[Any] = None,
                  scale: float = 0.0, num_splits: int = 0, max_seq_len: int = 0, q_len: int = 1) -> Any:
    return attn.paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale=scale, workspace=workspace,
                             num_splits=num_splits, max_seq_len=max_seq_len, q_len=q_len)


def _planned(kind: type, run: Any) -> Any:
    def impl(plan: Any, q: Any, k_cache: Any, v_cache: Any, block_table: Any, scale: float = 0.0) -> Any:
        return run(_tensors.Plan.of_tensor(plan, kind), q, k_cache, v_cache, block_table, scale=scale)

    return impl


def _out_like_q(q: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _out_like_plan_q(plan: Any, q: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


for _name, _impl, _fake in (
    ("kv_write", _kv_write, _nothing),
    ("paged_decode", _paged_decode, _out_like_q),
    ("paged_prefill", _planned(attn.PrefillPlan, attn.paged_prefill), _out_like_plan_q),
    ("paged_cascade", _planned(cascade.CascadePlan, cascade.paged_cascade), _out_like_plan_q),
):
    _lib.define(_SCHEMAS[_name])
    # Every real backend runs the call (which refuses non-CUDA tensors with
    # its own message); meta and fake tensors get the output's shape alone.
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake("kvplug::" + _name, _fake, lib=_lib)

kv_write = torch.ops.kvplug.kv_write.default
paged_decode = torch.ops.kvplug.paged_decode.default
paged_prefill = torch.ops.kvplug.paged_prefill.default
paged_cascade = torch.ops.kvplug.paged_cascade.default
