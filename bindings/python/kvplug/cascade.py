"""Shared-prefix ("cascade") attention on torch tensors: decode, or varlen
prefill queries (new prompts or chunks sharing a cached prefix, mixed with
decode rows).

When sequences of a decode batch share KV blocks (a system prompt, few-shot
blocks of a group, forks of parallel sampling), each shared run of blocks is
read once per step for the queries of every sequence holding it, each tail
once, and the partial states are merged: the result is plain paged decode
attention. A plan is made from the host copies of the block table and the
lengths (any engine has them) into two workspaces of fixed addresses, so a
CUDA graph captured over paged_cascade replays for every later plan; a step
whose sequences only grew is checked by CascadePlan.update in O(batch).

    ws = kvplug.cascade.Workspaces(max_batch, 32, 8, 128, device="cuda")
    plan = kvplug.cascade.plan(table_cpu, lens_cpu, lens_gpu, 32, 8, 128, torch.float16, ws)
    out = kvplug.cascade.paged_cascade(plan, q, k_cache, v_cache, table_gpu)  # per layer
    # next step, lengths + 1 (the device lens updated as usual):
    if not plan.update(lens_cpu):
        plan = kvplug.cascade.plan(...)

Prefill: size the workspaces for the query rows (max_tokens) and pass the
query offsets as for kvplug.attn.prefill_plan; q and out are [total_q,
num_q_heads, head_dim]:

    ws = kvplug.cascade.Workspaces(max_batch, 32, 8, 128, max_tokens=8192)
    plan = kvplug.cascade.plan(table_cpu, kv_lens_cpu, kv_lens_gpu, 32, 8, 128, torch.float16, ws,
                               qo_indptr_host=qo_cpu, qo_indptr=qo_gpu)
    out = kvplug.cascade.paged_cascade(plan, q, k_cache, v_cache, table_gpu)
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Tuple

from . import _lib
from . import _tensors as _t
from ._arrays import _I64, in_ptr as _in_ptr
from ._capi import AttnPlan as _AttnPlan
from ._capi import CascadePlanArgs as _CascadePlanArgs
from ._lib import C
from ._tensors import bad as _bad, check as _check
from .attn import ROUTE_DECODE, ROUTE_PREFILL
from .manager import Manager

__all__ = ["ROUTE_PREFILL", "ROUTE_DECODE", "ROUTE_CASCADE", "MAX_PARTS", "workspace_size", "Workspaces", "CascadePlan", "plan",
           "paged_cascade"]

ROUTE_CASCADE = 3  # KVP_ATTN_ROUTE_CASCADE (ROUTE_PREFILL and ROUTE_DECODE are attn's)
PLAN_CASCADE = 2  # KVP_ATTN_PLAN_CASCADE
NO_DECODE_ROUTE = 1  # KVP_CASCADE_NO_DECODE_ROUTE
NO_HOPPER = 4  # KVP_CASCADE_NO_HOPPER
MAX_PARTS = 16  # KVP_CASCADE_MAX_PARTS

_i64 = ctypes.c_int64
_u64 = ctypes.c_uint64
_i32 = ctypes.c_int32


def _flags(decode_route: bool, hopper: bool) -> int:
    return (0 if decode_route else NO_DECODE_ROUTE) | (0 if hopper else NO_HOPPER)


def _i32arg(v: Any, what: str) -> int:
    return _lib.checked_int(v, "kvplug.cascade: " + what, "int32")


def workspace_size(max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   max_tokens: Optional[int] = None) -> Tuple[int, int]:
    """(device_bytes, host_bytes) of the workspaces for batches of up to
    max_batch sequences and, for varlen queries, max_tokens query rows in all
    (None: one per sequence, decode)."""
    dev, host = ctypes.c_uint64(0), ctypes.c_uint64(0)
    heads = (_i32arg(num_q_heads, "num_q_heads"), _i32arg(num_kv_heads, "num_kv_heads"), _i32arg(head_dim, "head_dim"))
    if max_tokens is None:
        _check(C.kvp_cascade_workspace_size(_i32arg(max_batch, "max_batch"), *heads, ctypes.byref(dev),
                                            ctypes.byref(host)))
    else:
        _check(C.kvp_cascade_prefill_workspace_size(_i32arg(max_batch, "max_batch"), _i32arg(max_tokens, "max_tokens"),
                                                    *heads, ctypes.byref(dev), ctypes.byref(host)))
    return int(dev.value), int(host.value)


class Workspaces:
    """The device workspace (a CUDA uint8 tensor) and the host workspace (a
    pinned CPU uint8 tensor, so the plan's copy is asynchronous) for batches
    of up to max_batch sequences and max_tokens query rows (None: decode,
    one per sequence). Allocate once; plan every step into them. Raises
    NoDeviceError on a machine without a CUDA device."""

    def __init__(self, max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, device: Any = "cuda",
                 max_tokens: Optional[int] = None):
        torch = _t.need_cuda("cascade.Workspaces")
        dev_bytes, host_bytes = workspace_size(max_batch, num_q_heads, num_kv_heads, head_dim, max_tokens)
        self.max_batch = _i32arg(max_batch, "max_batch")
        self.max_tokens = 0 if max_tokens is None else _i32arg(max_tokens, "max_tokens")
        self.device = torch.empty(dev_bytes, dtype=torch.uint8, device=device)
        self.host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)


class CascadePlan(_t.Plan):
    """A planned batch (kvp_attn_plan of kind cascade). Pass it to
    paged_cascade for every layer of the step."""

    _run_fn = "kvp_paged_cascade"

    @property
    def saved_tokens(self) -> int:
        """KV tokens per kv head that reading shared runs once saves."""
        return int(self._c.state[4])

    @property
    def total_tokens(self) -> int:
        """KV tokens per kv head plain decode reads."""
        return int(self._c.state[5])

    def update(self, seq_lens_host: Any) -> bool:
        """True when the plan still covers these lengths (a step whose
        sequences only grew); False: plan again."""
        n = self.batch
        lens = _t.host_i32(seq_lens_host, n, "seq_lens_host")
        fits = _i32(-1)
        _check(C.kvp_cascade_update(self._addr, lens, n, ctypes.byref(fits)))
        return fits.value == 1

    def __repr__(self) -> str:
        c = self._c
        route = {ROUTE_CASCADE: "cascade", ROUTE_DECODE: "decode", ROUTE_PREFILL: "prefill"}.get(c.route, str(c.route))
        return (f"CascadePlan(route={route}, batch={c.batch}, total_q={c.total_q}, items={c.num_items}, "
                f"max_kv_len={c.max_kv_len}, "
                f"saved_tokens={self.saved_tokens}, total_tokens={self.total_tokens})")


def _host_table(t: Any) -> Tuple[Any, int, int]:
    """A host int32 [batch, cols] C-contiguous tensor (converted when needed)."""
    torch = _t.torch()
    t = torch.as_tensor(t)
    if t.dim() != 2:
        raise _bad(f"block_table_host must be 2-D [batch, max_blocks], got shape {tuple(t.shape)}")
    t = t.to(device="cpu", dtype=torch.int32).contiguous()
    return t, int(t.shape[0]), int(t.shape[1])


def plan(
    block_table_host: Any,
    seq_lens_host: Any,
    seq_lens: Any,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
    workspaces: Workspaces,
    block_size: int = 16,
    decode_route: bool = True,
    headroom: int = 0,
    stream: Any = None,
    qo_indptr_host: Any = None,
    qo_indptr: Any = None,
    hopper: bool = True,
) -> CascadePlan:
    """Plans a batch: block_table_host (int32 [batch, max_blocks], CPU) and
    seq_lens_host (batch lengths, this step's tokens included) are read on
    the host; seq_lens (int32 [batch] CUDA) holds the same values for the
    kernels. decode_route=False keeps the cascade route even when sharing
    does not pay (one captured graph for every batch). Varlen queries:
    qo_indptr_host (batch + 1 offsets, CPU) and qo_indptr (int32 [batch + 1]
    CUDA, the same values) give sequence b the query rows [qo[b], qo[b+1])
    at its last positions, as kvplug.attn.prefill_plan; the workspaces must
    be sized with max_tokens; plain prefill is the route where sharing does
    not pay. hopper=False plans for the sm_80 kernels on a Hopper GPU too;
    an FP8 cache runs on either (the Hopper mainloop widens its tiles to
    the 16-bit type on their way into shared memory)."""
    table, batch, cols = _host_table(block_table_host)
    dev, qo, qo_dev = _device_args(workspaces, seq_lens, batch, qo_indptr_host, qo_indptr,
                                   f"a block table of {batch} rows")
    lens = _t.host_i32(seq_lens_host, batch, "seq_lens_host")
    a = _CascadePlanArgs(
        ctypes.sizeof(_CascadePlanArgs), _i32arg(_t.dtype_arg(dtype), "dtype"), _i32arg(head_dim, "head_dim"),
        _i32arg(num_q_heads, "num_q_heads"), _i32arg(num_kv_heads, "num_kv_heads"), _i32arg(batch, "batch"),
        workspaces.max_batch, _i32arg(block_size, "block_size"), _i32arg(max(cols, 1), "max_blocks_per_seq"),
        max(cols, 1), ctypes.cast(table.data_ptr(), ctypes.POINTER(_i32)), lens, seq_lens.data_ptr(),
        ctypes.c_void_p(workspaces.host.data_ptr()), workspaces.host.numel(),
        workspaces.device.data_ptr(), workspaces.device.numel(),
        _flags(decode_route, hopper), _i32arg(headroom, "headroom"),
        qo, qo_dev, workspaces.max_tokens, 0,
    )
    p = _AttnPlan()
    p.struct_size = ctypes.sizeof(_AttnPlan)
    _t.launch(C.kvp_cascade_plan, _t.device_index(dev), stream, ctypes.byref(a), ctypes.byref(p))
    return CascadePlan(p, (seq_lens, workspaces, qo_indptr))


def _device_args(workspaces: Any, seq_lens: Any, n: int, qo_indptr_host: Any, qo_indptr: Any,
                 rows: str) -> Tuple[Any, Any, int]:
    """Checks what a plan reads on the device (workspaces, seq_lens of n
    entries, varlen qo_indptr of n + 1 with its host copy) and returns the
    device, the host offsets (None: decode) and qo_indptr's pointer (0).
    rows names the n rows in messages."""
    if not isinstance(workspaces, Workspaces):
        raise _bad(f"workspaces must be a kvplug.cascade.Workspaces, got {type(workspaces).__name__}")
    torch = _t.torch()
    dev = workspaces.device.device
    _t.index(seq_lens, "seq_lens", 1, dev, torch.int32)
    if seq_lens.shape[0] != n:
        raise _bad(f"seq_lens has {seq_lens.shape[0]} entries for {rows}")
    if (qo_indptr_host is None) != (qo_indptr is None):
        raise _bad("qo_indptr_host and qo_indptr go together (both None: decode)")
    if qo_indptr_host is None:
        return dev, None, 0
    qo = _t.host_i32(qo_indptr_host, n + 1, "qo_indptr_host")
    _t.index(qo_indptr, "qo_indptr", 1, dev, torch.int32)
    if qo_indptr.shape[0] != n + 1:
        raise _bad(f"qo_indptr has {qo_indptr.shape[0]} entries; {n} + 1 = {n + 1} expected")
    return dev, qo, qo_indptr.data_ptr()


def paged_cascade(
    plan: CascadePlan,
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_table: Any,
    out: Any = None,
    lse: Any = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    stream: Any = None,
    sinks: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> Any:
    """Attention of a planned batch over one layer: q ([total_q,
    num_q_heads, head_dim]; total_q = batch in decode) over the paged caches
    ([num_blocks, block_size, num_kv_heads, head_dim]) through block_table
    (int32 [batch, max_blocks] CUDA, the host table's values). Returns out,
    or (out, lse) with return_lse (lse float32 [total_q, num_q_heads],
    natural log). sinks: attention sinks, float32 [num_q_heads], as
    kvplug.attn.paged_decode takes them. An FP8 cache
    (torch.float8_e4m3fn) comes with its k_scale and v_scale, as kv_write
    takes them, under plans for either mainloop (see plan)."""
    if not isinstance(plan, CascadePlan):
        raise _bad(f"plan must come from kvplug.cascade.plan, got {type(plan).__name__}")
    out, lse = plan._run(q, k_cache, v_cache, block_table, out, lse, scale, return_lse, stream, k_scale, v_scale,
                         sinks)
    return (out, lse) if return_lse else out


def plan_from_manager(
    manager: Any,
    seq_ids: Any,
    max_blocks_per_seq: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
    workspaces: Optional[Workspaces] = None,
    seq_lens: Any = None,
    decode_route: bool = True,
    headroom: int = 0,
    stream: Any = None,
    qo_indptr_host: Any = None,
    qo_indptr: Any = None,
    hopper: bool = True,
) -> CascadePlan:
    """Plans the batch seq_ids of a kvplug.Manager from the manager's own
    block tables and lengths (kvp_manager_cascade_plan): the plan that
    plan() gives for the table and lengths manager.describe(seq_ids,
    max_blocks_per_seq) returns, without a host table. max_blocks_per_seq
    is the device block table's width; seq_lens (int32 [n] CUDA) holds the
    batch's lengths for the kernels, and qo_indptr_host / qo_indptr the
    varlen query offsets, as in plan(); hopper as in plan().

    With workspaces=None (and no seq_lens or qo_indptr) the batch is
    planned on the host for its summary alone, on any machine, torch not
    needed: the plan's route, saved_tokens and total_tokens say how much a
    step's KV reads shrink; it cannot be updated or run. dtype is a torch
    dtype or attn.DTYPE_F16 / DTYPE_BF16."""
    if not isinstance(manager, Manager):
        raise _bad(f"manager must be a kvplug.Manager, got {type(manager).__name__}")
    ids_ptr, n, ids_keep = _in_ptr(seq_ids, _I64, _i64, "seq_ids")
    a = _CascadePlanArgs()
    a.struct_size = ctypes.sizeof(_CascadePlanArgs)
    a.dtype, a.head_dim = _i32arg(_t.dtype_arg(dtype), "dtype"), _i32arg(head_dim, "head_dim")
    a.num_q_heads, a.num_kv_heads = _i32arg(num_q_heads, "num_q_heads"), _i32arg(num_kv_heads, "num_kv_heads")
    a.batch = _i32arg(n, "batch")
    a.max_blocks_per_seq = _i32arg(max_blocks_per_seq, "max_blocks_per_seq")
    a.flags = _flags(decode_route, hopper)
    a.headroom = _i32arg(headroom, "headroom")
    p = _AttnPlan()
    p.struct_size = ctypes.sizeof(_AttnPlan)
    if workspaces is None:
        if seq_lens is not None or qo_indptr is not None:
            raise _bad("seq_lens or qo_indptr without workspaces: a host-only plan reads no device array")
        if qo_indptr_host is not None:
            a.qo_indptr_host = _t.host_i32(qo_indptr_host, n + 1, "qo_indptr_host")
        _check(C.kvp_manager_cascade_plan(manager.handle or 0, ids_ptr or None, n, ctypes.byref(a), ctypes.byref(p), 0))
        return CascadePlan(p, (ids_keep,))
    dev, qo, a.qo_indptr = _device_args(workspaces, seq_lens, n, qo_indptr_host, qo_indptr, f"{n} seq_ids")
    if qo is not None:
        a.qo_indptr_host = qo
    a.max_batch, a.max_tokens = workspaces.max_batch, workspaces.max_tokens
    a.seq_lens = seq_lens.data_ptr()
    a.host_workspace, a.host_workspace_bytes = workspaces.host.data_ptr(), workspaces.host.numel()
    a.workspace, a.workspace_bytes = workspaces.device.data_ptr(), workspaces.device.numel()
    _t.launch(C.kvp_manager_cascade_plan, _t.device_index(dev), stream, manager.handle or 0, ids_ptr or None, n,
              ctypes.byref(a), ctypes.byref(p))
    return CascadePlan(p, (seq_lens, workspaces, qo_indptr))


__all__ += ["plan_from_manager"]
