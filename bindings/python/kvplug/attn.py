"""Attention kernels on torch CUDA tensors (kvp_kv_write, kvp_paged_decode,
kvp_merge_states of include/kvplug.h).

    from kvplug import attn
    ws = torch.empty(attn.workspace_size(max_batch, 32, 128), dtype=torch.uint8, device="cuda")
    attn.kv_write(k, v, k_cache, v_cache, slot_mapping)          # this step's K, V
    out, lse = attn.paged_decode(q, k_cache, v_cache, block_table, seq_lens,
                                 workspace=ws, return_lse=True)

Tensors stay where they are: the calls pass their data_ptr and strides (in
elements) to the library, which launches on the current torch stream of the
tensors' device (or `stream`, a torch.cuda.Stream or a raw CUstream int)
without synchronising, so the calls can be captured in CUDA graphs (call
prepare() once first). The last dimension (head_dim) must be contiguous;
K and V caches share strides; index arrays are int32. Misuse raises a
KvplugError subclass (InvalidArgumentError, UnsupportedError, ...), never a
crash.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional, Sequence, Tuple

from . import _lib
from . import _tensors as _t
from ._capi import AttnPlan as _AttnPlan
from ._capi import KVWriteArgs as _KVWriteArgs
from ._capi import MergeStatesArgs as _MergeStatesArgs
from ._capi import PagedDecodeArgs as _PagedDecodeArgs
from ._capi import PagedPrefillArgs as _PagedPrefillArgs  # noqa: F401 (the header mirrors keep their names here)
from ._capi import PrefillPlanArgs as _PrefillPlanArgs
from ._lib import C
from ._tensors import DTYPE_BF16, DTYPE_E4M3, DTYPE_F16, DTYPE_F32, bad as _bad, check as _check, host_i32 as _host_i32
from ._tensors import layout as _layout

__all__ = [
    "DTYPE_F16",
    "DTYPE_BF16",
    "DTYPE_F32",
    "DTYPE_E4M3",
    "MERGE_MAX_STATES",
    "cuda_available",
    "prepare",
    "workspace_size",
    "num_splits",
    "kv_write",
    "paged_decode",
    "merge_states",
    "prefill_workspace_size",
    "PrefillPlan",
    "prefill_plan",
    "paged_prefill",
]

MERGE_MAX_STATES = 8  # KVP_MERGE_MAX_STATES
ROUTE_PREFILL, ROUTE_DECODE = 1, 2  # KVP_ATTN_ROUTE_*
DECODE_MAX_Q_LEN = 16  # KVP_DECODE_MAX_Q_LEN: new tokens per sequence of paged_decode
PLAN_NO_DECODE_ROUTE, PLAN_NO_SPLIT_KV = 1, 2  # KVP_PREFILL_NO_DECODE_ROUTE, KVP_PREFILL_NO_SPLIT_KV
PLAN_NO_HOPPER = 4  # KVP_PREFILL_NO_HOPPER: the sm_80 kernel on a Hopper GPU too
PLAN_FP8_QKV = 8  # KVP_PREFILL_FP8_QKV: FP8 Q/K/V over an e4m3 cache on Hopper (head_dim 128)
# kvp_attn_plan.state[KVP_PLAN_STATE_MAINLOOP] of a prefill plan
MAINLOOP_SM80, MAINLOOP_SM90, MAINLOOP_SM90_FP8 = 0, 1, 2

_u64 = ctypes.c_uint64
_ci = _lib.checked_int


def cuda_available() -> bool:
    """True when the library finds a CUDA driver and a device."""
    v = ctypes.c_int32(0)
    _check(C.kvp_cuda_available(ctypes.byref(v)))
    return bool(v.value)


def prepare(device: Any = None) -> None:
    """Loads the kernels on `device` (default: torch's current device) now,
    so that no launch loads them, as graph capture requires. Raises
    NoDeviceError on a machine without a CUDA device."""
    torch = _t.need_cuda("attn.prepare")
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        torch.cuda.init()
        torch.empty(0, device="cuda")  # makes torch's context current on this thread
        _check(C.kvp_attn_prepare())


def _int32s(what: str, values: Sequence[Tuple[Any, str]]) -> list:
    """Each value checked as an int32 argument named what + its name."""
    return [_ci(v, what + n, "int32") for v, n in values]


def workspace_size(max_batch: int, num_q_heads: int, head_dim: int, max_splits: int = 0) -> int:
    """Bytes of decode workspace for batches up to max_batch with up to
    max_splits splits (0: the library's default ceiling)."""
    args = _int32s("workspace_size: ", ((max_batch, "max_batch"), (num_q_heads, "num_q_heads"),
                   (head_dim, "head_dim"), (max_splits, "max_splits")))
    out = _u64(0)
    _check(C.kvp_attn_workspace_size(*args, ctypes.byref(out)))
    return int(out.value)


def num_splits(dtype: Any, head_dim: int, batch: int, num_q_heads: int, num_kv_heads: int, max_seq_len: int) -> int:
    """The split count paged_decode chooses for this shape on torch's current
    device (before capping it to the workspace). dtype: a torch dtype or a
    DTYPE_* code; torch.float8_e4m3fn (DTYPE_E4M3) for a decode over an FP8
    cache, whose kernel holds more blocks per SM. Raises NoDeviceError
    without a CUDA device."""
    torch = _t.need_cuda("attn.num_splits")
    args = _int32s("num_splits: ", ((_t.dtype_arg(dtype), "dtype"), (head_dim, "head_dim"), (batch, "batch"),
                   (num_q_heads, "num_q_heads"), (num_kv_heads, "num_kv_heads"), (max_seq_len, "max_seq_len")))
    out = ctypes.c_int32(0)
    with torch.cuda.device(torch.cuda.current_device()):
        _check(C.kvp_attn_num_splits(*args, ctypes.byref(out)))
    return int(out.value)


def prefill_workspace_size(max_batch: int, max_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of workspace prefill_plan needs for batches of up to max_batch
    sequences and max_tokens query tokens in all."""
    args = _int32s("prefill_workspace_size: ", ((max_batch, "max_batch"), (max_tokens, "max_tokens"),
                   (num_q_heads, "num_q_heads"), (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim")))
    out = _u64(0)
    _check(C.kvp_prefill_workspace_size(*args, ctypes.byref(out)))
    return int(out.value)


# --------------------------------------------------------------------------
# kv_write and paged_decode: packed per thread for the last layouts
# --------------------------------------------------------------------------

_kv_write_tls = threading.local()
_decode_tls = threading.local()


def _pack_kv_write(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, k_scale: Any,
                   v_scale: Any) -> _t.Packed:
    """Every check of kv_write's tensors, and its struct with their sizes and
    strides (the addresses are the caller's to set)."""
    kv = _t.paged_kv(k_cache, v_cache, k_scale=k_scale, v_scale=v_scale)
    dev = k_cache.device
    _t.cuda_tensor(key, "key", 3, dev)
    _t.cuda_tensor(value, "value", 3, dev)
    _t.call_dtype(key, k_cache, "key")
    _t.same_dtype(value, key.dtype, "value")
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    for t, name in ((key, "key"), (value, "value")):
        if tuple(t.shape[1:]) != (kvh, d):
            raise _bad(f"{name} has shape {tuple(t.shape)}; [num_tokens, {kvh}, {d}] expected")
        _t.rows(t, name)
    if value.shape[0] != key.shape[0]:
        raise _bad(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    _t.index(slot_mapping, "slot_mapping", 1, dev, _t.torch().int32)
    if slot_mapping.shape[0] != key.shape[0]:
        raise _bad(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    a = _KVWriteArgs(
        ctypes.sizeof(_KVWriteArgs), _t.dtype_code(key, "key"), d, key.shape[0], kvh, 0, 0,
        0, key.stride(0), key.stride(1), 0, value.stride(0), value.stride(1),
    )
    return _t.Packed(a, dev, kv=kv)


def kv_write(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, stream: Any = None,
             k_scale: Any = None, v_scale: Any = None) -> None:
    """Writes key and value ([num_tokens, num_kv_heads, head_dim]) into the
    caches ([num_blocks, block_size, num_kv_heads, head_dim]) at
    slot_mapping (int32 [num_tokens]; slot = block * block_size + offset,
    negative = padding, skipped).

    An FP8 cache (torch.float8_e4m3fn caches under float16 or bfloat16 key
    and value) takes its float32 scales: k_scale and v_scale
    [num_blocks, block_size, num_kv_heads] get each written row's scale
    (max|x| / 448); one-element scales (calibrated, per cache) are read."""
    try:
        layout = (_layout(key), _layout(value), _layout(k_cache), _layout(v_cache), _layout(slot_mapping),
                  _t.scale_layout(k_scale, v_scale))
    except Exception:
        layout = None  # not all strided tensors: the checks say what is wrong
    p = _t.packed(_kv_write_tls, layout)
    if p is None:
        p = _t.keep(_kv_write_tls, _pack_kv_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale), layout)
    a = p.args
    a.key, a.value, a.slot_mapping = key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr()
    kv = p.kv
    kv.k_cache, kv.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    _t.set_scales(kv, k_scale, v_scale)
    _t.launch(C.kvp_kv_write, p.index, stream, p.addr)


def _pack_decode(q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any, out: Any, lse: Any,
                 workspace: Any, return_lse: bool, q_len: int, k_scale: Any,
                 v_scale: Any, sinks: Any = None) -> Tuple[_t.Packed, Any, Any]:
    """Every check of paged_decode's tensors, and its struct with their sizes
    and strides; returns it with out and lse (allocated where needed)."""
    torch = _t.torch()
    _t.cuda_tensor(k_cache, "k_cache", 4)
    dev = k_cache.device
    _t.cuda_tensor(q, "q", 3, dev)
    _t.call_dtype(q, k_cache, "q")
    d = k_cache.shape[3]
    q_len = _t.i32(q_len, "paged_decode: q_len")
    if not 1 <= q_len <= DECODE_MAX_Q_LEN or q.shape[0] % q_len:
        raise _bad(f"q_len must be in [1, {DECODE_MAX_Q_LEN}] and divide q's {q.shape[0]} rows: got {q_len}")
    batch, qh = q.shape[0] // q_len, q.shape[1]
    if q.shape[2] != d:
        raise _bad(f"q has head_dim {q.shape[2]}, the caches {d}")
    _t.rows(q, "q")
    kv = _t.paged_kv(k_cache, v_cache, block_table, batch, k_scale, v_scale)
    _t.index(seq_lens, "seq_lens", 1, dev, torch.int32)
    if block_table.shape[0] != batch or seq_lens.shape[0] != batch:
        raise _bad(f"block_table has {block_table.shape[0]} rows and seq_lens {seq_lens.shape[0]} entries for batch {batch}")
    _t.sinks_arg(sinks, qh, dev)
    out, lse = _t.out_and_lse(q, out, lse, return_lse, dev)
    ws_bytes = 0
    if workspace is not None:
        ws_bytes = _t.workspace(workspace, dev)[1]
    a = _PagedDecodeArgs(
        struct_size=ctypes.sizeof(_PagedDecodeArgs), dtype=_t.dtype_code(q, "q"), head_dim=d, batch=batch,
        num_q_heads=qh, q_batch_stride=q.stride(0), q_head_stride=q.stride(1), out_batch_stride=out.stride(0),
        out_head_stride=out.stride(1), workspace_bytes=ws_bytes, q_len=q_len,
    )
    return _t.Packed(a, dev, batch * q_len, qh, kv), out, lse


def paged_decode(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_table: Any,
    seq_lens: Any,
    out: Any = None,
    lse: Any = None,
    scale: Optional[float] = None,
    workspace: Any = None,
    num_splits: int = 0,
    max_seq_len: int = 0,
    return_lse: bool = False,
    stream: Any = None,
    q_len: int = 1,
    k_scale: Any = None,
    v_scale: Any = None,
    sinks: Any = None,
    window_left: int = -1,
) -> Any:
    """Decode attention of q ([batch * q_len, num_q_heads, head_dim]: q_len
    new tokens per sequence, 1 to 16, the last q_len of its seq_lens[b]
    tokens, causal among them) over the paged caches through block_table
    (int32 [batch, max_blocks]) and seq_lens (int32 [batch]). Returns out
    (allocated when None), or (out, lse) with return_lse (lse float32
    [batch * q_len, num_q_heads], natural log; allocated when None).
    workspace: a CUDA tensor of at least workspace_size(batch * q_len, ...)
    bytes enabling split-KV; num_splits 0 lets the library choose from
    max_seq_len (0: max_blocks * block_size). An FP8 cache
    (torch.float8_e4m3fn, under float16 or bfloat16 q) comes with its
    float32 scales k_scale and v_scale, as kv_write takes them.

    sinks: attention sinks (gpt-oss), a float32 CUDA tensor [num_q_heads] of
    one natural-log logit per q head (not multiplied by scale), added to
    each row's softmax denominator only; lse is then the log of the whole
    denominator (such states must not be merged again with merge_states).

    window_left: -1 (no window) or w >= 0, the new token at position pos
    sees positions [pos - w, pos] only (a sliding-window layer, as
    prefill_plan takes it); the blocks before every new token's window are
    not read, so their table entries may be -1."""
    try:
        layout = (_layout(q), _layout(k_cache), _layout(v_cache), _layout(block_table), _layout(seq_lens),
                  out is not None and _layout(out), lse is not None and _layout(lse),
                  workspace is not None and _layout(workspace), q_len, _t.scale_layout(k_scale, v_scale),
                  _t.sinks_layout(sinks))
    except Exception:
        layout = None  # not all strided tensors: the checks say what is wrong
    p = _t.packed(_decode_tls, layout)
    if p is None:
        p, out, lse = _pack_decode(q, k_cache, v_cache, block_table, seq_lens, out, lse, workspace, return_lse, q_len,
                                   k_scale, v_scale, sinks)
        _t.keep(_decode_tls, p, layout)
    else:
        out, lse = _t.new_outputs(p, q, out, lse, return_lse)
    a = p.args
    a.scale = 0.0 if scale is None else float(scale)  # 0: the library's 1/sqrt(head_dim)
    a.num_splits = _t.i32(num_splits, "paged_decode: num_splits")
    a.max_seq_len = _t.i32(max_seq_len, "paged_decode: max_seq_len")
    a.window_size = _ci(window_left, "paged_decode: window_left", "int32", lo=-1, hi=2**31 - 2) + 1
    a.q, a.seq_lens, a.out = q.data_ptr(), seq_lens.data_ptr(), out.data_ptr()
    kv = p.kv
    kv.k_cache, kv.v_cache, kv.block_table = k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr()
    _t.set_scales(kv, k_scale, v_scale)
    a.lse = 0 if lse is None else lse.data_ptr()
    a.workspace = 0 if workspace is None else workspace.data_ptr()
    a.sinks = 0 if sinks is None else sinks.data_ptr()
    _t.launch(C.kvp_paged_decode, p.index, stream, p.addr)
    return (out, lse) if return_lse else out


def merge_states(
    values: Sequence[Any],
    lses: Sequence[Any],
    out: Any = None,
    out_lse: Any = None,
    return_lse: bool = True,
    stream: Any = None,
) -> Any:
    """Merges attention states: values[i] ([num_tokens, num_heads, head_dim],
    all with the same strides) with lses[i] (float32 [num_tokens, num_heads],
    natural log, -inf = empty, all with the same strides). Returns (out,
    out_lse), or out alone when return_lse is False and out_lse is None."""
    torch = _t.torch()
    n = len(values)
    if n < 1 or n > MERGE_MAX_STATES or len(lses) != n:
        raise _bad(f"1..{MERGE_MAX_STATES} states with one lse each expected, got {len(values)} values and {len(lses)} lses")
    v0, s0 = values[0], lses[0]
    _t.cuda_tensor(v0, "values[0]", 3, None)
    dev = v0.device
    tokens, heads, d = v0.shape
    for i in range(n):
        v, s = values[i], lses[i]
        _t.cuda_tensor(v, f"values[{i}]", 3, dev)
        _t.cuda_tensor(s, f"lses[{i}]", 2, dev)
        _t.same_dtype(v, v0.dtype, f"values[{i}]")
        _t.same_dtype(s, torch.float32, f"lses[{i}]")
        if tuple(v.shape) != tuple(v0.shape) or v.stride() != v0.stride():
            raise _bad(f"values[{i}] has shape {tuple(v.shape)} strides {v.stride()}; values[0] {tuple(v0.shape)} {v0.stride()}")
        if tuple(s.shape) != (tokens, heads) or s.stride() != s0.stride():
            raise _bad(f"lses[{i}] has shape {tuple(s.shape)} strides {s.stride()}; [{tokens}, {heads}] with lses[0]'s strides expected")
        _t.rows(v, f"values[{i}]")
    if out is None:
        out = torch.empty((tokens, heads, d), dtype=v0.dtype, device=dev)
    else:
        _t.cuda_tensor(out, "out", 3, dev)
        _t.same_dtype(out, v0.dtype, "out")
        if tuple(out.shape) != tuple(v0.shape):
            raise _bad(f"out has shape {tuple(out.shape)}; {tuple(v0.shape)} expected")
        _t.rows(out, "out")
    if out_lse is None and return_lse:
        out_lse = torch.empty((tokens, heads), dtype=torch.float32, device=dev)
    lse_ptr, lse_strides = 0, (0, 0)
    if out_lse is not None:
        _t.cuda_tensor(out_lse, "out_lse", 2, dev)
        _t.same_dtype(out_lse, torch.float32, "out_lse")
        if tuple(out_lse.shape) != (tokens, heads):
            raise _bad(f"out_lse has shape {tuple(out_lse.shape)}; [{tokens}, {heads}] expected")
        lse_ptr, lse_strides = out_lse.data_ptr(), out_lse.stride()
    vs = (_u64 * MERGE_MAX_STATES)(*[v.data_ptr() for v in values])
    ss = (_u64 * MERGE_MAX_STATES)(*[s.data_ptr() for s in lses])
    a = _MergeStatesArgs(
        ctypes.sizeof(_MergeStatesArgs), _t.dtype_code(v0, "values"), d, n, tokens, heads, 0, vs, ss,
        v0.stride(0), v0.stride(1), s0.stride(0), s0.stride(1),
        out.data_ptr(), out.stride(0), out.stride(1), lse_ptr, lse_strides[0], lse_strides[1],
    )
    _t.launch(C.kvp_merge_states, _t.device_index(dev), stream, ctypes.byref(a))
    return (out, out_lse) if (return_lse or out_lse is not None) else out


# --------------------------------------------------------------------------
# Planned batches: prefill_plan, then paged_prefill per layer
# --------------------------------------------------------------------------


class PrefillPlan(_t.Plan):
    """A planned batch (kvp_attn_plan). Pass it to paged_prefill for every
    layer of the step."""

    @property
    def num_splits(self) -> int:
        return int(self._c.num_splits)

    @property
    def mainloop(self) -> int:
        """The prefill route's kernel: MAINLOOP_SM80, MAINLOOP_SM90 (Hopper) or
        MAINLOOP_SM90_FP8 (its FP8 Q/K/V mode)."""
        return int(self._c.state[0])

    @property
    def decode_rows(self) -> int:
        """Sequences of one new token in a mixed batch that the prefill route
        leaves to a decode launch (0: the prefill kernel takes every row)."""
        return int(self._c.state[1] & 0xFFFFFFFF)

    @property
    def decode_splits(self) -> int:
        """Splits of that decode launch."""
        return int(self._c.state[1] >> 32)

    def __repr__(self) -> str:
        c = self._c
        route = {ROUTE_PREFILL: "prefill", ROUTE_DECODE: "decode"}.get(c.route, str(c.route))
        return (f"PrefillPlan(route={route}, batch={c.batch}, total_q={c.total_q}, max_q_len={c.max_q_len}, "
                f"max_kv_len={c.max_kv_len}, items={c.num_items}, grid={c.grid}, splits={c.num_splits}, "
                f"mainloop={({MAINLOOP_SM90: 'sm90', MAINLOOP_SM90_FP8: 'sm90-fp8'}).get(self.mainloop, 'sm80')}, decode_rows={self.decode_rows})")


def prefill_plan(
    qo_indptr: Any,
    kv_lens: Any,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
    workspace: Any,
    window_left: int = -1,
    qo_indptr_host: Any = None,
    kv_lens_host: Any = None,
    decode_route: bool = True,
    split_kv: bool = True,
    stream: Any = None,
    hopper: bool = True,
    fp8_qkv: bool = False,
) -> PrefillPlan:
    """Plans a varlen batch once per step: qo_indptr (int32 [batch+1], from
    0, non-decreasing) and kv_lens (int32 [batch], each >= its q_len, the new
    tokens included) on the device, with their host copies (CPU tensors or
    sequences; when None they are read back from the device, which
    synchronises). workspace: a CUDA tensor of prefill_workspace_size bytes.
    window_left: -1 (no window) or w >= 0, each row sees tokens
    [pos - w, pos] (the C field window_size is w + 1).
    decode_route=False keeps one-token batches, and the one-token rows of
    mixed batches (which otherwise go to a decode launch), on the prefill
    kernel;
    split_kv=False keeps every plan at one split (both: one captured graph
    serves any batch composition). hopper=False keeps a Hopper GPU on the
    sm_80 kernel (plan.mainloop says which one a plan runs). fp8_qkv=True
    plans the fast FP8 mode for runs over an e4m3 cache: q quantised to
    e4m3 and both products on the 8-bit tensor cores (Hopper, head_dim 128;
    KVP_PREFILL_FP8_QKV in kvplug.h); without it such a cache is widened to
    q's type on the way into shared memory."""
    a, dev, keep = _prefill_plan_args(qo_indptr, kv_lens, num_q_heads, num_kv_heads, head_dim, dtype, workspace,
                                      window_left, qo_indptr_host, kv_lens_host, decode_route, split_kv, hopper,
                                      fp8_qkv)
    plan = _AttnPlan()
    plan.struct_size = ctypes.sizeof(_AttnPlan)
    _t.launch(C.kvp_prefill_plan, _t.device_index(dev), stream, ctypes.byref(a), ctypes.byref(plan))
    return PrefillPlan(plan, keep)


def _prefill_plan_args(qo_indptr: Any, kv_lens: Any, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: Any,
                       workspace: Any, window_left: int, qo_indptr_host: Any, kv_lens_host: Any, decode_route: bool,
                       split_kv: bool, hopper: bool = True,
                       fp8_qkv: bool = False) -> Tuple[_PrefillPlanArgs, Any, Tuple[Any, ...]]:
    """prefill_plan's checks and its kvp_prefill_plan_args; returns them with
    the device and what the plan keeps alive."""
    torch = _t.torch()
    dev = workspace.device
    _t.index(qo_indptr, "qo_indptr", 1, dev, torch.int32)
    _t.index(kv_lens, "kv_lens", 1, dev, torch.int32)
    batch = kv_lens.shape[0]
    if qo_indptr.shape[0] != batch + 1:
        raise _bad(f"qo_indptr has {qo_indptr.shape[0]} entries; batch + 1 = {batch + 1} expected")
    ws_ptr, ws_bytes = _t.workspace(workspace, dev)
    dtype = _t.dtype_arg(dtype)
    num_q_heads = _ci(num_q_heads, "prefill_plan: num_q_heads", "int32")
    num_kv_heads = _ci(num_kv_heads, "prefill_plan: num_kv_heads", "int32")
    head_dim = _ci(head_dim, "prefill_plan: head_dim", "int32")
    window_left = _ci(window_left, "prefill_plan: window_left", "int32", lo=-1, hi=2**31 - 2)
    qo_h = _host_i32(qo_indptr if qo_indptr_host is None else qo_indptr_host, batch + 1, "qo_indptr_host")
    kv_h = _host_i32(kv_lens if kv_lens_host is None else kv_lens_host, batch, "kv_lens_host")
    a = _PrefillPlanArgs(
        ctypes.sizeof(_PrefillPlanArgs), dtype, head_dim, num_q_heads, num_kv_heads, batch, window_left + 1,
        (0 if decode_route else PLAN_NO_DECODE_ROUTE) | (0 if split_kv else PLAN_NO_SPLIT_KV)
        | (0 if hopper else PLAN_NO_HOPPER) | (PLAN_FP8_QKV if fp8_qkv else 0), 0, qo_h, kv_h,
        qo_indptr.data_ptr(), kv_lens.data_ptr(), ws_ptr, ws_bytes,
    )
    return a, dev, (qo_indptr, kv_lens, workspace)


def paged_prefill(
    plan: PrefillPlan,
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_table: Any,
    out: Any = None,
    lse: Any = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    stream: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    sinks: Any = None,
) -> Any:
    """Attention of a planned batch over one layer: q ([total_q,
    num_q_heads, head_dim]) over the paged caches through block_table (int32
    [batch, max_blocks]). Returns out (allocated when None), or (out, lse)
    with return_lse (lse float32 [total_q, num_q_heads], natural log).
    An FP8 cache (torch.float8_e4m3fn) comes with its k_scale and v_scale, as
    kv_write takes them; it is widened to q's type on the way into shared
    memory, or read by the 8-bit tensor cores under a plan of
    prefill_plan(..., fp8_qkv=True). sinks: attention sinks, float32
    [num_q_heads], as paged_decode takes them (every route and window).
    A workspace holds one plan's work list: a plan whose workspace a later
    plan of another batch or flags was written into raises
    InvalidArgumentError ("stale plan"); give each plan its own workspace
    to keep several."""
    if not isinstance(plan, PrefillPlan):
        raise _bad(f"plan must come from prefill_plan, got {type(plan).__name__}")
    out, lse = plan._run(q, k_cache, v_cache, block_table, out, lse, scale, return_lse, stream, k_scale, v_scale,
                         sinks)
    return (out, lse) if return_lse else out
