"""The torch side of kvplug.attn and kvplug.cascade: the argument checks they
share, the device and stream of a launch, and the packed per-layer call.

A per-layer call (kv_write, paged_decode, a plan's paged_prefill or
paged_cascade) reads each tensor argument's layout: its type, shape,
strides, dtype and device (layout()). The first call with a layout runs
every check and packs the C argument struct with the sizes and strides
(Packed); a later call on the same thread with the same layouts sets only
the addresses, which are all that can differ. The checks read nothing
else of a tensor, so a layout that passed them passes them again.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any, Optional, Tuple

import numpy as np

from . import _lib
from ._capi import AttnPlan, PagedKV, PagedPrefillArgs
from ._lib import C

DTYPE_F16, DTYPE_BF16, DTYPE_F32 = 1, 2, 3  # enum kvp_dtype
DTYPE_E4M3 = 4  # a cache format only (torch.float8_e4m3fn)
SCALE_TOKEN_HEAD, SCALE_TENSOR = 1, 2  # enum kvp_kv_scale

# The device type the kernels read; tests of the packing set it to "cpu".
DEVICE_TYPE = "cuda"

_torch: Any = None
_dtype_codes: Any = None
_current_device: Any = None
_raw_stream: Any = None


def torch() -> Any:
    """torch, imported on first use: the rest of the package works without it."""
    if _torch is None:
        _import_torch()
    return _torch


def _import_torch() -> None:
    global _torch, _dtype_codes, _current_device, _raw_stream
    import torch as t

    _dtype_codes = {t.float16: DTYPE_F16, t.bfloat16: DTYPE_BF16, t.float32: DTYPE_F32}
    # The private getters cost a tenth of torch.cuda.current_device() and
    # current_stream(i).cuda_stream (which builds a Stream); torch's own
    # compiled code calls them. The public ones serve where they are absent.
    _current_device = getattr(t._C, "_cuda_getDevice", None) or t.cuda.current_device
    _raw_stream = getattr(t._C, "_cuda_getCurrentRawStream", None) or (lambda i: t.cuda.current_stream(i).cuda_stream)
    _torch = t


def need_cuda(what: str) -> Any:
    """torch, once it sees a CUDA device; NoDeviceError otherwise, as the
    library answers its GPU calls there (torch's own calls would fail with
    a RuntimeError or an AssertionError that names no kvplug call)."""
    t = torch()
    if not t.cuda.is_available():
        built = f"built for CUDA {t.version.cuda}" if t.version.cuda else "built without CUDA"
        raise _lib.NoDeviceError(f"kvplug: {what}: no CUDA device (torch {t.__version__}, {built}, "
                                 "finds no driver or device)", _lib.Status.NO_DEVICE)
    return t


def bad(msg: str) -> _lib.KvplugError:
    return _lib.error_for(_lib.Status.INVALID_ARGUMENT, "kvplug.attn: " + msg)


def check(st: int) -> None:
    if st:
        _lib.raise_status(st)


def i32(v: Any, what: str) -> int:
    """v as an int32 argument (checked_int's checks, with a fast path for ints)."""
    if type(v) is int and -2147483648 <= v <= 2147483647:
        return v
    return _lib.checked_int(v, what, "int32")


def layout(t: Any) -> Tuple[Any, ...]:
    """What the checks read of a tensor argument (raises for a non-tensor)."""
    return (t.__class__, t.shape, t.stride(), t.dtype, t.device)


# --------------------------------------------------------------------------
# Checks (each raises InvalidArgumentError naming the argument)
# --------------------------------------------------------------------------


def dtype_arg(dtype: Any) -> Any:
    """The DTYPE_* code of a torch dtype (0 for any other, which the library
    refuses by name); an int passes through, to be range-checked as one."""
    if isinstance(dtype, int):
        return dtype
    t = torch()
    if dtype == getattr(t, "float8_e4m3fn", None):
        return DTYPE_E4M3  # kvp_attn_num_splits: a decode over an e4m3 cache
    return _dtype_codes.get(dtype, 0)


def dtype_code(t: Any, what: str) -> int:
    torch()
    code = _dtype_codes.get(t.dtype)
    if code is None:
        raise bad(f"{what} has dtype {t.dtype}; float16, bfloat16 or float32 expected")
    return code


def cuda_tensor(t: Any, what: str, ndim: int, device: Any = None) -> None:
    if not _lib._is_torch_tensor(t):
        raise bad(f"{what} must be a torch tensor, got {type(t).__name__}")
    if t.device.type != DEVICE_TYPE:
        raise bad(f"{what} must be on a CUDA device, not {t.device}")
    if device is not None and t.device != device:
        raise bad(f"{what} is on {t.device}; the other tensors are on {device}")
    if t.dim() != ndim:
        raise bad(f"{what} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def same_dtype(t: Any, dtype: Any, what: str) -> None:
    if t.dtype != dtype:
        raise bad(f"{what} has dtype {t.dtype}; {dtype} expected")


def rows(t: Any, what: str) -> None:
    # head_dim contiguous (a size-1 dimension has any stride).
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise bad(f"{what}: the last dimension must be contiguous, strides are {t.stride()}")


def index(t: Any, what: str, ndim: int, device: Any, dtype: Any) -> None:
    cuda_tensor(t, what, ndim, device)
    if t.dtype != dtype:
        raise bad(f"{what} must be {dtype}, got {t.dtype} (convert once with .to({dtype}))")
    rows(t, what)


def workspace(t: Any, device: Any) -> Tuple[int, int]:
    """(address, bytes) of a contiguous device workspace on `device`."""
    cuda_tensor(t, "workspace", t.dim(), device)
    if not t.is_contiguous():
        raise bad("workspace must be contiguous")
    return t.data_ptr(), t.numel() * t.element_size()


def is_e4m3(t: Any) -> bool:
    """Whether t is an FP8 e4m3 tensor (torch.float8_e4m3fn), the cache
    format of kvp_paged_kv.dtype KVP_DTYPE_E4M3."""
    return t.dtype == getattr(torch(), "float8_e4m3fn", None)


def call_dtype(t: Any, cache: Any, what: str) -> None:
    """Checks that t (q, key or value) may go with cache: the cache's dtype,
    or float16/bfloat16 over an e4m3 cache."""
    if is_e4m3(cache):
        if dtype_code(t, what) not in (DTYPE_F16, DTYPE_BF16):
            raise bad(f"{what} has dtype {t.dtype}; an e4m3 cache is read and written by float16 or bfloat16 tensors")
    else:
        same_dtype(t, cache.dtype, what)


def cache_strides(k_cache: Any, v_cache: Any) -> Tuple[int, int, int]:
    cuda_tensor(k_cache, "k_cache", 4)
    cuda_tensor(v_cache, "v_cache", 4, k_cache.device)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise bad(f"v_cache has shape {tuple(v_cache.shape)}, k_cache {tuple(k_cache.shape)}")
    same_dtype(v_cache, k_cache.dtype, "v_cache")
    if v_cache.stride() != k_cache.stride():
        raise bad(f"k_cache and v_cache must share strides: {k_cache.stride()} vs {v_cache.stride()}")
    rows(k_cache, "k_cache")
    s = k_cache.stride()
    return s[0], s[1], s[2]


def paged_kv(k_cache: Any, v_cache: Any, block_table: Any = None, rows: int = 0,
             k_scale: Any = None, v_scale: Any = None) -> PagedKV:
    """The one packer of a layer's cache (kvp_paged_kv) for every call that
    reads or writes it: the caches' checks, sizes and strides and, with
    block_table (int32 [rows, max_blocks], rows checked by the caller), the
    table's. An e4m3 cache (torch.float8_e4m3fn) comes with its float32
    scales: k_scale and v_scale [num_blocks, block_size, num_kv_heads]
    (one per token and kv head) or of one element each (one per cache).
    The calls set the addresses (k_cache, v_cache, block_table, k_scale,
    v_scale) per call, inline: the per-layer path pays no further function
    call."""
    cb, ct, ch = cache_strides(k_cache, v_cache)
    nb, bs, kvh, d = k_cache.shape
    ci = _lib.checked_int
    kv = PagedKV()
    kv.struct_size = ctypes.sizeof(PagedKV)
    if is_e4m3(k_cache):
        kv.dtype = DTYPE_E4M3
        kv.scale_kind = scale_kind(k_scale, v_scale, tuple(k_cache.shape[:3]), k_cache.device)
    else:
        if k_scale is not None or v_scale is not None:
            raise bad(f"k_scale and v_scale belong to an e4m3 cache; this one is {k_cache.dtype}")
        kv.dtype = dtype_code(k_cache, "k_cache")
    kv.num_kv_heads, kv.head_dim = ci(kvh, "num_kv_heads", "int32"), ci(d, "head_dim", "int32")
    kv.num_blocks, kv.block_size = ci(nb, "num_blocks", "int32"), ci(bs, "block_size", "int32")
    kv.block_stride, kv.token_stride, kv.head_stride = cb, ct, ch
    if block_table is not None:
        index(block_table, "block_table", 2, k_cache.device, torch().int32)
        kv.max_blocks_per_seq = ci(block_table.shape[1], "max_blocks_per_seq", "int32")
        kv.block_table_stride = block_table.stride(0) if rows > 1 else block_table.shape[1]
    return kv


def scale_kind(k_scale: Any, v_scale: Any, shape: Tuple[int, int, int], dev: Any) -> int:
    """The kvp_kv_scale of an e4m3 cache's scales (float32, contiguous, on
    dev): SCALE_TOKEN_HEAD for [num_blocks, block_size, num_kv_heads],
    SCALE_TENSOR for one element each."""
    if k_scale is None or v_scale is None:
        raise bad("an e4m3 cache needs k_scale and v_scale: float32 [num_blocks, block_size, num_kv_heads] "
                  "(one scale per token and kv head) or one element each (one scale per cache)")
    t = torch()
    kinds = []
    for s, what in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        cuda_tensor(s, what, s.dim(), dev)
        same_dtype(s, t.float32, what)
        if tuple(s.shape) == shape and s.is_contiguous():
            kinds.append(SCALE_TOKEN_HEAD)
        elif s.numel() == 1:
            kinds.append(SCALE_TENSOR)
        else:
            raise bad(f"{what} has shape {tuple(s.shape)}; a contiguous {list(shape)} (one scale per token and kv head) "
                      "or one element (one per cache) expected")
    if kinds[0] != kinds[1]:
        raise bad("k_scale and v_scale must both be per token and kv head or both one element")
    return kinds[0]


def scale_layout(k_scale: Any, v_scale: Any) -> Any:
    """The scales' part of a call's layout key (None without scales)."""
    return None if k_scale is None and v_scale is None else (layout(k_scale), layout(v_scale))


def set_scales(kv: PagedKV, k_scale: Any, v_scale: Any) -> None:
    """An FP8 cache's scale addresses, set per call as the caches' are."""
    if k_scale is not None:
        kv.k_scale, kv.v_scale = k_scale.data_ptr(), v_scale.data_ptr()


def sinks_arg(sinks: Any, num_q_heads: int, dev: Any) -> None:
    """Checks attention sinks: None, or a float32 CUDA tensor [num_q_heads]
    on dev with unit stride (one natural-log logit per q head). The library
    sees only the address, so the length is checked here: a shorter array
    would be read past its end."""
    if sinks is None:
        return
    cuda_tensor(sinks, "sinks", 1, dev)
    if sinks.dtype != torch().float32:
        raise bad(f"sinks must be torch.float32 (one natural-log logit per q head), got {sinks.dtype}")
    if sinks.shape[0] != num_q_heads:
        raise bad(f"sinks has {sinks.shape[0]} entries; one per q head ({num_q_heads}) expected")
    if num_q_heads > 1 and sinks.stride(0) != 1:
        raise bad(f"sinks must be contiguous, got stride {sinks.stride(0)}")


def sinks_layout(sinks: Any) -> Any:
    """The sinks' part of a call's layout key (None without sinks)."""
    return None if sinks is None else layout(sinks)


def out_and_lse(q: Any, out: Any, lse: Any, return_lse: bool, dev: Any) -> Tuple[Any, Any]:
    """The output tensor for q's rows (allocated when None, else checked) and
    the lse tensor (float32 [rows, heads]; allocated when return_lse and None,
    checked when given, else None)."""
    t = torch()
    n, heads = q.shape[0], q.shape[1]
    if out is None:
        out = t.empty_like(q, memory_format=t.contiguous_format)
    else:
        cuda_tensor(out, "out", 3, dev)
        same_dtype(out, q.dtype, "out")
        if tuple(out.shape) != tuple(q.shape):
            raise bad(f"out has shape {tuple(out.shape)}; {tuple(q.shape)} expected")
        rows(out, "out")
    if lse is None and return_lse:
        lse = t.empty((n, heads), dtype=t.float32, device=dev)
    if lse is not None:
        cuda_tensor(lse, "lse", 2, dev)
        same_dtype(lse, t.float32, "lse")
        if tuple(lse.shape) != (n, heads) or not lse.is_contiguous():
            raise bad(f"lse must be a contiguous float32 [{n}, {heads}] tensor, got shape {tuple(lse.shape)} strides {lse.stride()}")
    return out, lse


def host_i32(x: Any, n: int, what: str) -> Any:
    """n host int32 values of a list, numpy array or tensor (a device tensor
    is copied), each checked to fit, as a ctypes array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x).reshape(-1)
    if a.size != n:
        raise bad(f"{what} has {a.size} entries; {n} expected")
    # Planning runs every step: the type and range are checked on the whole
    # array; only a failing one is walked value by value, for the message.
    listed = isinstance(x, (list, tuple))
    if n and (a.dtype.kind not in "iu" or a.min() < -(1 << 31) or a.max() >= (1 << 31)
              or listed and any(isinstance(v, bool) for v in x)):
        for v in (x if listed else a.tolist()):
            _lib.checked_int(v, "kvplug.attn: " + what, "int32")
    out = (ctypes.c_int32 * max(n, 1))()
    if n:
        # Named: a converted copy must outlive the memmove that reads it.
        src = np.ascontiguousarray(a, dtype=np.int32)
        ctypes.memmove(out, src.ctypes.data, 4 * n)
    return out


# --------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------


def stream_arg(stream: Any, device_index: int) -> int:
    """The CUstream of `stream` (a torch.cuda.Stream or an int); None: torch's
    current stream on the device."""
    if stream is None:
        return _raw_stream(device_index)
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)


def device_index(device: Any) -> int:
    """The index of a torch device (the current device's for "cuda")."""
    return device.index if device.index is not None else _current_device()


def launch(fn: Any, device_index: int, stream: Any, *args: Any) -> None:
    """fn(*args, stream) with the tensors' device current (the library
    launches in the current context), raising for a failed status."""
    s = stream_arg(stream, device_index)
    if _current_device() == device_index:
        st = fn(*args, s)
    else:
        with _torch.cuda.device(device_index):
            st = fn(*args, s)
    if st:
        _lib.raise_status(st)


class Packed:
    """One thread's packed argument struct of a call site, for one layout."""

    __slots__ = ("layout", "args", "addr", "device", "index", "rows", "heads", "kv")

    def __init__(self, args: ctypes.Structure, device: Any, rows: int = 0, heads: int = 0,
                 kv: Optional[PagedKV] = None) -> None:
        self.layout: Any = None
        self.args = args
        self.kv = kv  # the args' kvp_paged_kv (args.kv points to it)
        if kv is not None:
            args.kv = ctypes.pointer(kv)
        self.addr = ctypes.addressof(args)
        self.device = device
        self.index = device_index(device)
        self.rows, self.heads = rows, heads


def packed(tls: threading.local, key: Any) -> Optional[Packed]:
    """The calling thread's Packed of a call site when its layout is key."""
    p = getattr(tls, "p", None)
    return p if p is not None and key is not None and p.layout == key else None


def keep(tls: threading.local, p: Packed, key: Any) -> Packed:
    """Keeps p, checked for layout key, as the thread's Packed of the call site."""
    if key is not None:
        p.layout = key
        tls.p = p
    return p


def new_outputs(p: Packed, q: Any, out: Any, lse: Any, return_lse: bool) -> Tuple[Any, Any]:
    """out and lse of a call whose layouts were checked: the given ones, or
    new ones as out_and_lse allocates them (whose strides p holds)."""
    if out is None:
        t = _torch
        out = t.empty_like(q, memory_format=t.contiguous_format)
    if lse is None and return_lse:
        lse = _torch.empty((p.rows, p.heads), dtype=_torch.float32, device=p.device)
    return out, lse


# Plans by the address of their kvp_attn_plan, once as_tensor() gave it out.
_plans: "weakref.WeakValueDictionary[int, Plan]" = weakref.WeakValueDictionary()


def _plan_field(name: str, doc: Optional[str] = None) -> property:
    """A read-only int property of the plan's kvp_attn_plan field `name`."""
    return property(lambda self: int(getattr(self._c, name)), doc=doc)


class Plan:
    """A kvp_attn_plan, with the device arrays and the workspaces it refers
    to kept alive as long as it is, and its per-layer call: each thread
    keeps a packed kvp_paged_prefill_args for the layouts of its last
    layer, so that a layer like the last sets only the addresses."""

    _run_fn = "kvp_paged_prefill"

    def __init__(self, c: AttnPlan, keep: Tuple[Any, ...]):
        self._c = c
        self._keep = keep
        self._addr = ctypes.addressof(c)
        self._fn = getattr(C, self._run_fn)
        self._tls = threading.local()
        self._tensor: Any = None

    route = _plan_field("route")
    batch = _plan_field("batch")
    total_q = _plan_field("total_q", "Query rows (the batch in decode).")
    max_q_len = _plan_field("max_q_len")
    num_items = _plan_field("num_items")

    def as_tensor(self) -> Any:
        """A CPU uint8 tensor over the plan's kvp_attn_plan, the plan argument
        of the kvplug.ops operators (which find the plan by its address).
        Keep the plan alive while the tensor is used."""
        if self._tensor is None:
            _plans[self._addr] = self
            self._tensor = torch().frombuffer(self._c, dtype=_torch.uint8)
        return self._tensor

    @staticmethod
    def of_tensor(t: Any, kind: type) -> "Plan":
        """The live plan of type kind whose as_tensor() t is."""
        p = _plans.get(t.data_ptr()) if _lib._is_torch_tensor(t) else None
        if not isinstance(p, kind) or p._tensor.data_ptr() != t.data_ptr():
            raise bad(f"plan must be the as_tensor() of a live {kind.__name__}, got {type(t).__name__}")
        return p

    def _pack(self, q: Any, k_cache: Any, v_cache: Any, block_table: Any, out: Any, lse: Any,
              return_lse: bool, k_scale: Any = None, v_scale: Any = None,
              sinks: Any = None) -> Tuple[Packed, Any, Any]:
        """Every check of a layer's tensors against the plan, and the layer's
        struct with their sizes and strides; returns it with out and lse
        (allocated where needed)."""
        c = self._c
        n = c.total_q
        kv = paged_kv(k_cache, v_cache, block_table, c.batch, k_scale, v_scale)
        dev = k_cache.device
        cuda_tensor(q, "q", 3, dev)
        call_dtype(q, k_cache, "q")
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        if q.shape[0] != n or q.shape[1] != c.num_q_heads or q.shape[2] != d or d != c.head_dim:
            raise bad(f"q has shape {tuple(q.shape)}; the plan has [{n}, {c.num_q_heads}, {c.head_dim}]")
        if kvh != c.num_kv_heads:
            raise bad(f"the caches have {kvh} kv heads; the plan {c.num_kv_heads}")
        if dtype_code(q, "q") != c.dtype:
            raise bad(f"q has dtype {q.dtype}; the plan was made for kvp_dtype {c.dtype}")
        rows(q, "q")
        if block_table.shape[0] != c.batch:
            raise bad(f"block_table has {block_table.shape[0]} rows for batch {c.batch}")
        sinks_arg(sinks, c.num_q_heads, dev)
        out, lse = out_and_lse(q, out, lse, return_lse, dev)
        a = PagedPrefillArgs(struct_size=ctypes.sizeof(PagedPrefillArgs), q_token_stride=q.stride(0),
                             q_head_stride=q.stride(1), out_token_stride=out.stride(0), out_head_stride=out.stride(1))
        return Packed(a, dev, n, c.num_q_heads, kv), out, lse

    def _run(self, q: Any, k_cache: Any, v_cache: Any, block_table: Any, out: Any, lse: Any,
             scale: Optional[float], return_lse: bool, stream: Any, k_scale: Any = None,
             v_scale: Any = None, sinks: Any = None) -> Tuple[Any, Any]:
        """One layer of the planned batch; returns (out, lse)."""
        try:
            key = (layout(q), layout(k_cache), layout(v_cache), layout(block_table),
                   out is not None and layout(out), lse is not None and layout(lse),
                   scale_layout(k_scale, v_scale), sinks_layout(sinks))
        except Exception:
            key = None  # not all strided tensors: the checks say what is wrong
        tls = self._tls
        p = packed(tls, key)
        if p is None:
            p, out, lse = self._pack(q, k_cache, v_cache, block_table, out, lse, return_lse, k_scale, v_scale,
                                     sinks)
            keep(tls, p, key)
        else:
            out, lse = new_outputs(p, q, out, lse, return_lse)
        a = p.args
        a.scale = 0.0 if scale is None else float(scale)  # 0: the library's 1/sqrt(head_dim)
        a.q, a.out = q.data_ptr(), out.data_ptr()
        kv = p.kv
        kv.k_cache, kv.v_cache, kv.block_table = k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr()
        set_scales(kv, k_scale, v_scale)
        a.lse = 0 if lse is None else lse.data_ptr()
        a.sinks = 0 if sinks is None else sinks.data_ptr()
        launch(self._fn, p.index, stream, self._addr, p.addr)
        return out, lse
