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
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _lib

__all__ = [
    "DTYPE_F16",
    "DTYPE_BF16",
    "DTYPE_F32",
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

DTYPE_F16, DTYPE_BF16, DTYPE_F32 = 1, 2, 3  # enum kvp_dtype
MERGE_MAX_STATES = 8  # KVP_MERGE_MAX_STATES

_i32, _i64, _u64, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float


class _KVWriteArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("dtype", _i32),
        ("head_dim", _i32),
        ("num_tokens", _i32),
        ("num_kv_heads", _i32),
        ("num_blocks", _i32),
        ("block_size", _i32),
        ("key", _u64),
        ("key_token_stride", _i64),
        ("key_head_stride", _i64),
        ("value", _u64),
        ("value_token_stride", _i64),
        ("value_head_stride", _i64),
        ("k_cache", _u64),
        ("v_cache", _u64),
        ("cache_block_stride", _i64),
        ("cache_token_stride", _i64),
        ("cache_head_stride", _i64),
        ("slot_mapping", _u64),
    ]


class _PagedDecodeArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("dtype", _i32),
        ("head_dim", _i32),
        ("batch", _i32),
        ("num_q_heads", _i32),
        ("num_kv_heads", _i32),
        ("num_blocks", _i32),
        ("block_size", _i32),
        ("max_blocks_per_seq", _i32),
        ("q", _u64),
        ("q_batch_stride", _i64),
        ("q_head_stride", _i64),
        ("k_cache", _u64),
        ("v_cache", _u64),
        ("cache_block_stride", _i64),
        ("cache_token_stride", _i64),
        ("cache_head_stride", _i64),
        ("block_table", _u64),
        ("block_table_stride", _i64),
        ("seq_lens", _u64),
        ("out", _u64),
        ("out_batch_stride", _i64),
        ("out_head_stride", _i64),
        ("lse", _u64),
        ("workspace", _u64),
        ("workspace_bytes", _u64),
        ("scale", _f32),
        ("num_splits", _i32),
        ("max_seq_len", _i32),
        ("reserved", _i32),
    ]


class _MergeStatesArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("dtype", _i32),
        ("head_dim", _i32),
        ("num_states", _i32),
        ("num_tokens", _i32),
        ("num_heads", _i32),
        ("reserved", _i32),
        ("v", _u64 * MERGE_MAX_STATES),
        ("s", _u64 * MERGE_MAX_STATES),
        ("v_token_stride", _i64),
        ("v_head_stride", _i64),
        ("s_token_stride", _i64),
        ("s_head_stride", _i64),
        ("out", _u64),
        ("out_token_stride", _i64),
        ("out_head_stride", _i64),
        ("out_lse", _u64),
        ("out_lse_token_stride", _i64),
        ("out_lse_head_stride", _i64),
    ]


def _fn(name: str, argtypes: Sequence[Any]) -> Any:
    return _lib.fn(name, ctypes.c_int, argtypes)


def _bad(msg: str) -> _lib.KvplugError:
    return _lib.error_for(_lib.Status.INVALID_ARGUMENT, "kvplug.attn: " + msg)


def _torch() -> Any:
    import torch  # imported on use: the rest of the package works without torch

    return torch


def _dtype_arg(dtype: Any) -> Any:
    """The DTYPE_* code of a torch dtype (0 for any other, which the library
    refuses by name); an int passes through, to be range-checked as one."""
    if isinstance(dtype, int):
        return dtype
    torch = _torch()
    return {torch.float16: DTYPE_F16, torch.bfloat16: DTYPE_BF16, torch.float32: DTYPE_F32}.get(dtype, 0)


def _dtype_code(t: Any, what: str) -> int:
    torch = _torch()
    codes = {torch.float16: DTYPE_F16, torch.bfloat16: DTYPE_BF16, torch.float32: DTYPE_F32}
    code = codes.get(t.dtype)
    if code is None:
        raise _bad(f"{what} has dtype {t.dtype}; float16, bfloat16 or float32 expected")
    return code


def _cuda_tensor(t: Any, what: str, ndim: int, device: Any = None) -> None:
    if not _lib._is_torch_tensor(t):
        raise _bad(f"{what} must be a torch tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise _bad(f"{what} must be on a CUDA device, not {t.device}")
    if device is not None and t.device != device:
        raise _bad(f"{what} is on {t.device}; the other tensors are on {device}")
    if t.dim() != ndim:
        raise _bad(f"{what} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _same_dtype(t: Any, dtype: Any, what: str) -> None:
    if t.dtype != dtype:
        raise _bad(f"{what} has dtype {t.dtype}; {dtype} expected")


def _rows(t: Any, what: str) -> None:
    # head_dim contiguous (a size-1 dimension has any stride).
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise _bad(f"{what}: the last dimension must be contiguous, strides are {t.stride()}")


def _index(t: Any, what: str, ndim: int, device: Any, dtype: Any) -> None:
    _cuda_tensor(t, what, ndim, device)
    if t.dtype != dtype:
        raise _bad(f"{what} must be {dtype}, got {t.dtype} (convert once with .to({dtype}))")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise _bad(f"{what}: the last dimension must be contiguous, strides are {t.stride()}")


def _stream(stream: Any, device: Any) -> int:
    if stream is None:
        return _torch().cuda.current_stream(device).cuda_stream
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)


def _check(st: int) -> None:
    if st:
        _lib.raise_status(st)


def cuda_available() -> bool:
    """True when the library finds a CUDA driver and a device."""
    v = ctypes.c_int32(0)
    _check(_fn("kvp_cuda_available", [ctypes.POINTER(ctypes.c_int32)])(ctypes.byref(v)))
    return bool(v.value)


def prepare(device: Any = None) -> None:
    """Loads the kernels on `device` (default: torch's current device) now,
    so that no launch loads them, as graph capture requires."""
    torch = _torch()
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        torch.cuda.init()
        torch.empty(0, device="cuda")  # makes torch's context current on this thread
        _check(_fn("kvp_attn_prepare", [])())


def workspace_size(max_batch: int, num_q_heads: int, head_dim: int, max_splits: int = 0) -> int:
    """Bytes of decode workspace for batches up to max_batch with up to
    max_splits splits (0: the library's default ceiling)."""
    args = [_lib.checked_int(v, n, "int32") for v, n in ((max_batch, "workspace_size: max_batch"),
            (num_q_heads, "workspace_size: num_q_heads"), (head_dim, "workspace_size: head_dim"),
            (max_splits, "workspace_size: max_splits"))]
    out = ctypes.c_uint64(0)
    f = _fn("kvp_attn_workspace_size", [_i32, _i32, _i32, _i32, ctypes.POINTER(ctypes.c_uint64)])
    _check(f(*args, ctypes.byref(out)))
    return int(out.value)


def num_splits(dtype: Any, head_dim: int, batch: int, num_q_heads: int, num_kv_heads: int, max_seq_len: int) -> int:
    """The split count paged_decode chooses for this shape on torch's current
    device (before capping it to the workspace). dtype: a torch dtype or a
    DTYPE_* code."""
    torch = _torch()
    dtype = _dtype_arg(dtype)
    args = [_lib.checked_int(v, "num_splits: " + n, "int32") for v, n in (
        (dtype, "dtype"), (head_dim, "head_dim"), (batch, "batch"), (num_q_heads, "num_q_heads"),
        (num_kv_heads, "num_kv_heads"), (max_seq_len, "max_seq_len"))]
    out = ctypes.c_int32(0)
    f = _fn("kvp_attn_num_splits", [_i32, _i32, _i32, _i32, _i32, _i32, ctypes.POINTER(ctypes.c_int32)])
    with torch.cuda.device(torch.cuda.current_device()):
        _check(f(*args, ctypes.byref(out)))
    return int(out.value)


def _cache_strides(k_cache: Any, v_cache: Any) -> Tuple[int, int, int]:
    _cuda_tensor(k_cache, "k_cache", 4)
    _cuda_tensor(v_cache, "v_cache", 4, k_cache.device)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise _bad(f"v_cache has shape {tuple(v_cache.shape)}, k_cache {tuple(k_cache.shape)}")
    _same_dtype(v_cache, k_cache.dtype, "v_cache")
    if v_cache.stride() != k_cache.stride():
        raise _bad(f"k_cache and v_cache must share strides: {k_cache.stride()} vs {v_cache.stride()}")
    _rows(k_cache, "k_cache")
    s = k_cache.stride()
    return s[0], s[1], s[2]


def _out_and_lse(q: Any, out: Any, lse: Any, return_lse: bool, dev: Any) -> Tuple[Any, Any]:
    """The output tensor for q's rows (allocated when None, else checked) and
    the lse tensor (float32 [rows, heads]; allocated when return_lse and None,
    checked when given, else None)."""
    torch = _torch()
    rows, heads = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _cuda_tensor(out, "out", 3, dev)
        _same_dtype(out, q.dtype, "out")
        if tuple(out.shape) != tuple(q.shape):
            raise _bad(f"out has shape {tuple(out.shape)}; {tuple(q.shape)} expected")
        _rows(out, "out")
    if lse is None and return_lse:
        lse = torch.empty((rows, heads), dtype=torch.float32, device=dev)
    if lse is not None:
        _cuda_tensor(lse, "lse", 2, dev)
        _same_dtype(lse, torch.float32, "lse")
        if tuple(lse.shape) != (rows, heads) or not lse.is_contiguous():
            raise _bad(f"lse must be a contiguous float32 [{rows}, {heads}] tensor, got shape {tuple(lse.shape)} strides {lse.stride()}")
    return out, lse


def kv_write(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any, stream: Any = None) -> None:
    """Writes key and value ([num_tokens, num_kv_heads, head_dim]) into the
    caches ([num_blocks, block_size, num_kv_heads, head_dim]) at
    slot_mapping (int32 [num_tokens]; slot = block * block_size + offset,
    negative = padding, skipped)."""
    cb, ct, ch = _cache_strides(k_cache, v_cache)
    dev = k_cache.device
    _cuda_tensor(key, "key", 3, dev)
    _cuda_tensor(value, "value", 3, dev)
    _same_dtype(key, k_cache.dtype, "key")
    _same_dtype(value, k_cache.dtype, "value")
    nb, bs, kvh, d = k_cache.shape
    for t, name in ((key, "key"), (value, "value")):
        if tuple(t.shape[1:]) != (kvh, d):
            raise _bad(f"{name} has shape {tuple(t.shape)}; [num_tokens, {kvh}, {d}] expected")
        _rows(t, name)
    if value.shape[0] != key.shape[0]:
        raise _bad(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    _index(slot_mapping, "slot_mapping", 1, dev, _torch().int32)
    if slot_mapping.shape[0] != key.shape[0]:
        raise _bad(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    a = _KVWriteArgs(
        ctypes.sizeof(_KVWriteArgs), _dtype_code(key, "key"), d, key.shape[0], kvh, nb, bs,
        key.data_ptr(), key.stride(0), key.stride(1),
        value.data_ptr(), value.stride(0), value.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), cb, ct, ch, slot_mapping.data_ptr(),
    )
    f = _fn("kvp_kv_write", [ctypes.POINTER(_KVWriteArgs), ctypes.c_uint64])
    with _torch().cuda.device(dev):
        _check(f(ctypes.byref(a), _stream(stream, dev)))


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
) -> Any:
    """Decode attention of q ([batch, num_q_heads, head_dim], one token per
    sequence) over the paged caches through block_table (int32 [batch,
    max_blocks]) and seq_lens (int32 [batch]). Returns out (allocated when
    None), or (out, lse) with return_lse (lse float32 [batch, num_q_heads],
    natural log; allocated when None). workspace: a CUDA tensor of at least
    workspace_size(...) bytes enabling split-KV; num_splits 0 lets the
    library choose from max_seq_len (0: max_blocks * block_size)."""
    torch = _torch()
    cb, ct, ch = _cache_strides(k_cache, v_cache)
    dev = k_cache.device
    _cuda_tensor(q, "q", 3, dev)
    _same_dtype(q, k_cache.dtype, "q")
    nb, bs, kvh, d = k_cache.shape
    batch, qh = q.shape[0], q.shape[1]
    if q.shape[2] != d:
        raise _bad(f"q has head_dim {q.shape[2]}, the caches {d}")
    _rows(q, "q")
    _index(block_table, "block_table", 2, dev, torch.int32)
    _index(seq_lens, "seq_lens", 1, dev, torch.int32)
    if block_table.shape[0] != batch or seq_lens.shape[0] != batch:
        raise _bad(f"block_table has {block_table.shape[0]} rows and seq_lens {seq_lens.shape[0]} entries for batch {batch}")
    out, lse = _out_and_lse(q, out, lse, return_lse, dev)
    lse_ptr = 0 if lse is None else lse.data_ptr()
    ws_ptr, ws_bytes = 0, 0
    if workspace is not None:
        _cuda_tensor(workspace, "workspace", workspace.dim(), dev)
        if not workspace.is_contiguous():
            raise _bad("workspace must be contiguous")
        ws_ptr, ws_bytes = workspace.data_ptr(), workspace.numel() * workspace.element_size()
    scale = 0.0 if scale is None else float(scale)  # 0: the library's 1/sqrt(head_dim)
    num_splits = _lib.checked_int(num_splits, "paged_decode: num_splits", "int32")
    max_seq_len = _lib.checked_int(max_seq_len, "paged_decode: max_seq_len", "int32")
    tstride = block_table.stride(0) if batch > 1 else block_table.shape[1]
    a = _PagedDecodeArgs(
        ctypes.sizeof(_PagedDecodeArgs), _dtype_code(q, "q"), d, batch, qh, kvh, nb, bs, block_table.shape[1],
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), cb, ct, ch,
        block_table.data_ptr(), tstride, seq_lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        lse_ptr, ws_ptr, ws_bytes, scale, num_splits, max_seq_len, 0,
    )
    f = _fn("kvp_paged_decode", [ctypes.POINTER(_PagedDecodeArgs), ctypes.c_uint64])
    with torch.cuda.device(dev):
        _check(f(ctypes.byref(a), _stream(stream, dev)))
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
    torch = _torch()
    n = len(values)
    if n < 1 or n > MERGE_MAX_STATES or len(lses) != n:
        raise _bad(f"1..{MERGE_MAX_STATES} states with one lse each expected, got {len(values)} values and {len(lses)} lses")
    v0, s0 = values[0], lses[0]
    _cuda_tensor(v0, "values[0]", 3, None)
    dev = v0.device
    tokens, heads, d = v0.shape
    for i in range(n):
        v, s = values[i], lses[i]
        _cuda_tensor(v, f"values[{i}]", 3, dev)
        _cuda_tensor(s, f"lses[{i}]", 2, dev)
        _same_dtype(v, v0.dtype, f"values[{i}]")
        _same_dtype(s, torch.float32, f"lses[{i}]")
        if tuple(v.shape) != tuple(v0.shape) or v.stride() != v0.stride():
            raise _bad(f"values[{i}] has shape {tuple(v.shape)} strides {v.stride()}; values[0] {tuple(v0.shape)} {v0.stride()}")
        if tuple(s.shape) != (tokens, heads) or s.stride() != s0.stride():
            raise _bad(f"lses[{i}] has shape {tuple(s.shape)} strides {s.stride()}; [{tokens}, {heads}] with lses[0]'s strides expected")
        _rows(v, f"values[{i}]")
    if out is None:
        out = torch.empty((tokens, heads, d), dtype=v0.dtype, device=dev)
    else:
        _cuda_tensor(out, "out", 3, dev)
        _same_dtype(out, v0.dtype, "out")
        if tuple(out.shape) != tuple(v0.shape):
            raise _bad(f"out has shape {tuple(out.shape)}; {tuple(v0.shape)} expected")
        _rows(out, "out")
    if out_lse is None and return_lse:
        out_lse = torch.empty((tokens, heads), dtype=torch.float32, device=dev)
    lse_ptr, lse_strides = 0, (0, 0)
    if out_lse is not None:
        _cuda_tensor(out_lse, "out_lse", 2, dev)
        _same_dtype(out_lse, torch.float32, "out_lse")
        if tuple(out_lse.shape) != (tokens, heads):
            raise _bad(f"out_lse has shape {tuple(out_lse.shape)}; [{tokens}, {heads}] expected")
        lse_ptr, lse_strides = out_lse.data_ptr(), out_lse.stride()
    vs = (_u64 * MERGE_MAX_STATES)(*[v.data_ptr() for v in values])
    ss = (_u64 * MERGE_MAX_STATES)(*[s.data_ptr() for s in lses])
    a = _MergeStatesArgs(
        ctypes.sizeof(_MergeStatesArgs), _dtype_code(v0, "values"), d, n, tokens, heads, 0, vs, ss,
        v0.stride(0), v0.stride(1), s0.stride(0), s0.stride(1),
        out.data_ptr(), out.stride(0), out.stride(1), lse_ptr, lse_strides[0], lse_strides[1],
    )
    f = _fn("kvp_merge_states", [ctypes.POINTER(_MergeStatesArgs), ctypes.c_uint64])
    with torch.cuda.device(dev):
        _check(f(ctypes.byref(a), _stream(stream, dev)))
    return (out, out_lse) if (return_lse or out_lse is not None) else out


class _PrefillPlanArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("dtype", _i32),
        ("head_dim", _i32),
        ("num_q_heads", _i32),
        ("num_kv_heads", _i32),
        ("batch", _i32),
        ("window_size", _i32),
        ("flags", _i32),
        ("reserved", _i32),
        ("qo_indptr_host", ctypes.POINTER(_i32)),
        ("kv_lens_host", ctypes.POINTER(_i32)),
        ("qo_indptr", _u64),
        ("kv_lens", _u64),
        ("workspace", _u64),
        ("workspace_bytes", _u64),
    ]


class _AttnPlan(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (n, _i32)
        for n in ("kind", "route", "dtype", "head_dim", "num_q_heads", "num_kv_heads", "window_left", "batch",
                  "total_q", "max_q_len", "max_kv_len", "num_items", "grid", "num_splits")
    ] + [("workspace", _u64), ("workspace_bytes", _u64), ("kv_lens", _u64), ("reserved", _u64 * 6)]


class _PagedPrefillArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_blocks", _i32),
        ("block_size", _i32),
        ("max_blocks_per_seq", _i32),
        ("reserved", _i32),
        ("q", _u64),
        ("q_token_stride", _i64),
        ("q_head_stride", _i64),
        ("k_cache", _u64),
        ("v_cache", _u64),
        ("cache_block_stride", _i64),
        ("cache_token_stride", _i64),
        ("cache_head_stride", _i64),
        ("block_table", _u64),
        ("block_table_stride", _i64),
        ("out", _u64),
        ("out_token_stride", _i64),
        ("out_head_stride", _i64),
        ("lse", _u64),
        ("scale", _f32),
        ("reserved2", _i32),
    ]


ROUTE_PREFILL, ROUTE_DECODE = 1, 2  # KVP_ATTN_ROUTE_*
MAINLOOP_SM80, MAINLOOP_SM90 = 0, 1  # kvp_attn_plan.reserved[0] of a prefill plan: the kernel of its prefill route


def prefill_workspace_size(max_batch: int, max_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of workspace prefill_plan needs for batches of up to max_batch
    sequences and max_tokens query tokens in all."""
    args = [_lib.checked_int(v, "prefill_workspace_size: " + n, "int32") for v, n in (
        (max_batch, "max_batch"), (max_tokens, "max_tokens"), (num_q_heads, "num_q_heads"),
        (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"))]
    out = ctypes.c_uint64(0)
    f = _fn("kvp_prefill_workspace_size", [_i32, _i32, _i32, _i32, _i32, ctypes.POINTER(ctypes.c_uint64)])
    _check(f(*args, ctypes.byref(out)))
    return int(out.value)


def _host_i32(x: Any, n: int, what: str) -> Any:
    """n host int32 values of a list, numpy array or tensor (a device tensor
    is copied), each checked to fit, as a ctypes array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x).reshape(-1)
    if a.size != n:
        raise _bad(f"{what} has {a.size} entries; {n} expected")
    # Planning runs every step: the type and range are checked on the whole
    # array; only a failing one is walked value by value, for the message.
    listed = isinstance(x, (list, tuple))
    if n and (a.dtype.kind not in "iu" or a.min() < -(1 << 31) or a.max() >= (1 << 31)
              or listed and any(isinstance(v, bool) for v in x)):
        for v in (x if listed else a.tolist()):
            _lib.checked_int(v, "kvplug.attn: " + what, "int32")
    out = (_i32 * max(n, 1))()
    if n:
        ctypes.memmove(out, np.ascontiguousarray(a, dtype=np.int32).ctypes.data, 4 * n)
    return out


class _Plan:
    """A kvp_attn_plan, with the device arrays and the workspaces it refers
    to kept alive as long as it is."""

    def __init__(self, c: _AttnPlan, keep: Tuple[Any, ...]):
        self._c = c
        self._keep = keep

    @property
    def route(self) -> int:
        return int(self._c.route)

    @property
    def batch(self) -> int:
        return int(self._c.batch)

    @property
    def total_q(self) -> int:
        """Query rows (the batch in decode)."""
        return int(self._c.total_q)

    @property
    def max_q_len(self) -> int:
        return int(self._c.max_q_len)

    @property
    def num_items(self) -> int:
        return int(self._c.num_items)


class PrefillPlan(_Plan):
    """A planned batch (kvp_attn_plan). Pass it to paged_prefill for every
    layer of the step."""

    @property
    def num_splits(self) -> int:
        return int(self._c.num_splits)

    @property
    def mainloop(self) -> int:
        """The prefill route's kernel: MAINLOOP_SM80 or MAINLOOP_SM90 (Hopper)."""
        return int(self._c.reserved[0])

    def __repr__(self) -> str:
        c = self._c
        route = {ROUTE_PREFILL: "prefill", ROUTE_DECODE: "decode"}.get(c.route, str(c.route))
        return (f"PrefillPlan(route={route}, batch={c.batch}, total_q={c.total_q}, max_q_len={c.max_q_len}, "
                f"max_kv_len={c.max_kv_len}, items={c.num_items}, grid={c.grid}, splits={c.num_splits}, "
                f"mainloop={'sm90' if self.mainloop == MAINLOOP_SM90 else 'sm80'})")


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
) -> PrefillPlan:
    """Plans a varlen batch once per step: qo_indptr (int32 [batch+1], from
    0, non-decreasing) and kv_lens (int32 [batch], each >= its q_len, the new
    tokens included) on the device, with their host copies (CPU tensors or
    sequences; when None they are read back from the device, which
    synchronises). workspace: a CUDA tensor of prefill_workspace_size bytes.
    window_left: -1 (no window) or w >= 0, each row sees tokens
    [pos - w, pos] (the C field window_size is w + 1).
    decode_route=False keeps one-token batches on the prefill kernel;
    split_kv=False keeps every plan at one split (both: one captured graph
    serves any batch composition). hopper=False keeps a Hopper GPU on the
    sm_80 kernel (plan.mainloop says which one a plan runs)."""
    torch = _torch()
    dev = workspace.device
    _index(qo_indptr, "qo_indptr", 1, dev, torch.int32)
    _index(kv_lens, "kv_lens", 1, dev, torch.int32)
    batch = kv_lens.shape[0]
    if qo_indptr.shape[0] != batch + 1:
        raise _bad(f"qo_indptr has {qo_indptr.shape[0]} entries; batch + 1 = {batch + 1} expected")
    _cuda_tensor(workspace, "workspace", workspace.dim(), dev)
    if not workspace.is_contiguous():
        raise _bad("workspace must be contiguous")
    dtype = _dtype_arg(dtype)
    ci = _lib.checked_int
    num_q_heads = ci(num_q_heads, "prefill_plan: num_q_heads", "int32")
    num_kv_heads = ci(num_kv_heads, "prefill_plan: num_kv_heads", "int32")
    head_dim = ci(head_dim, "prefill_plan: head_dim", "int32")
    window_left = ci(window_left, "prefill_plan: window_left", "int32", lo=-1, hi=2**31 - 2)
    qo_h = _host_i32(qo_indptr if qo_indptr_host is None else qo_indptr_host, batch + 1, "qo_indptr_host")
    kv_h = _host_i32(kv_lens if kv_lens_host is None else kv_lens_host, batch, "kv_lens_host")
    a = _PrefillPlanArgs(
        ctypes.sizeof(_PrefillPlanArgs), dtype, head_dim, num_q_heads, num_kv_heads, batch, window_left + 1,
        (0 if decode_route else 1) | (0 if split_kv else 2) | (0 if hopper else 4), 0, qo_h, kv_h, qo_indptr.data_ptr(), kv_lens.data_ptr(),
        workspace.data_ptr(), workspace.numel() * workspace.element_size(),
    )
    plan = _AttnPlan()
    plan.struct_size = ctypes.sizeof(_AttnPlan)
    f = _fn("kvp_prefill_plan", [ctypes.POINTER(_PrefillPlanArgs), ctypes.POINTER(_AttnPlan), ctypes.c_uint64])
    with torch.cuda.device(dev):
        _check(f(ctypes.byref(a), ctypes.byref(plan), _stream(stream, dev)))
    return PrefillPlan(plan, (qo_indptr, kv_lens, workspace))


def _run_planned(fn: str, c: Any, rows: int, q: Any, k_cache: Any, v_cache: Any, block_table: Any,
                 out: Any, lse: Any, scale: Optional[float], return_lse: bool, stream: Any) -> Tuple[Any, Any]:
    """One layer of a planned batch (kvp_attn_plan c, q with `rows` rows):
    checks the tensors against the plan, packs kvp_paged_prefill_args and
    calls fn (kvp_paged_prefill or kvp_paged_cascade). Returns (out, lse)."""
    torch = _torch()
    cb, ct, ch = _cache_strides(k_cache, v_cache)
    dev = k_cache.device
    _cuda_tensor(q, "q", 3, dev)
    _same_dtype(q, k_cache.dtype, "q")
    nb, bs, kvh, d = k_cache.shape
    if q.shape[0] != rows or q.shape[1] != c.num_q_heads or q.shape[2] != d or d != c.head_dim:
        raise _bad(f"q has shape {tuple(q.shape)}; the plan has [{rows}, {c.num_q_heads}, {c.head_dim}]")
    if kvh != c.num_kv_heads:
        raise _bad(f"the caches have {kvh} kv heads; the plan {c.num_kv_heads}")
    _rows(q, "q")
    _index(block_table, "block_table", 2, dev, torch.int32)
    if block_table.shape[0] != c.batch:
        raise _bad(f"block_table has {block_table.shape[0]} rows for batch {c.batch}")
    out, lse = _out_and_lse(q, out, lse, return_lse, dev)
    scale = 0.0 if scale is None else float(scale)  # 0: the library's 1/sqrt(head_dim)
    tstride = block_table.stride(0) if c.batch > 1 else block_table.shape[1]
    ci = _lib.checked_int
    a = _PagedPrefillArgs(
        ctypes.sizeof(_PagedPrefillArgs), ci(nb, "num_blocks", "int32"), ci(bs, "block_size", "int32"),
        ci(block_table.shape[1], "max_blocks_per_seq", "int32"), 0,
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), cb, ct, ch,
        block_table.data_ptr(), tstride,
        out.data_ptr(), out.stride(0), out.stride(1), 0 if lse is None else lse.data_ptr(), scale, 0,
    )
    f = _fn(fn, [ctypes.POINTER(_AttnPlan), ctypes.POINTER(_PagedPrefillArgs), ctypes.c_uint64])
    with torch.cuda.device(dev):
        _check(f(ctypes.byref(c), ctypes.byref(a), _stream(stream, dev)))
    return out, lse


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
) -> Any:
    """Attention of a planned batch over one layer: q ([total_q,
    num_q_heads, head_dim]) over the paged caches through block_table (int32
    [batch, max_blocks]). Returns out (allocated when None), or (out, lse)
    with return_lse (lse float32 [total_q, num_q_heads], natural log)."""
    if not isinstance(plan, PrefillPlan):
        raise _bad(f"plan must come from prefill_plan, got {type(plan).__name__}")
    out, lse = _run_planned("kvp_paged_prefill", plan._c, plan._c.total_q, q, k_cache, v_cache, block_table,
                            out, lse, scale, return_lse, stream)
    return (out, lse) if return_lse else out
