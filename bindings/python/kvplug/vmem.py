"""The virtual-contiguous KV cache (kvp_vcache of include/kvplug.h; vAttention).

Each layer's K and V is one dense tensor [max_batch, max_context, kv_heads,
head_dim] in contiguous virtual memory whose pages are mapped as requests
grow, so unmodified kernels (torch SDPA, FlashAttention's plain kernels) read
it directly:

    with kvplug.VirtualKVCache(num_layers=32, num_kv_heads=8, head_dim=128,
                               dtype="bfloat16", max_batch=64, max_context=32768,
                               budget_bytes=40 << 30) as vc:
        k0, v0 = vc.k(0), vc.v(0)            # torch tensors on the GPU, no copy
        slot = vc.alloc()
        vc.step([slot], [prompt_len])        # before the step's kernels
        k0[slot, :prompt_len] = ...          # the engine writes K and V
        ...
        vc.free(slot)

The slot (batch) stride is padded to a page multiple: the tensors returned
by k()/v() carry the real strides; kernels that take a batch stride must use
tensor.stride(0), not max_context * kv_heads * head_dim.

The CUDA backend exposes torch tensors through DLPack (tensors are created
before any page is mapped, which __cuda_array_interface__ cannot express:
torch asks the driver which device an address belongs to). The host backend
exposes numpy arrays over the mapped memory. Touching tokens that step() has
not mapped faults (a GPU error, or SIGSEGV on the host backend).

close() (or a with block) releases a cache when the engine says so: its
methods raise InvalidHandleError from then on, and its memory is unmapped at
once, or, while a tensor from k()/v() (or one made from it) is still alive,
when the last of them is gone, so no tensor ever reads unmapped memory. A
cache dropped without close() is closed when it is collected, once no such
tensor is alive, with a ResourceWarning and a warning on the "kvplug" logger
if slots were still allocated.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import warnings
import weakref
from typing import Any, Dict, List, Sequence, Tuple, Union

from . import _lib
from ._capi import VCacheConfig, VCacheStats
from ._lib import C

__all__ = ["VirtualKVCache", "VCacheConfig", "VCacheStats", "BACKEND_CUDA", "BACKEND_HOST"]

BACKEND_CUDA = 0  # KVP_VMEM_CUDA
BACKEND_HOST = 1  # KVP_VMEM_HOST

_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p


# dtype name -> (bytes, DLPack type code, numpy dtype string). DLPack codes:
# 0 int, 1 uint, 2 float, 4 bfloat. numpy has no bfloat16: host arrays of it
# are raw uint16.
_DTYPES: Dict[str, Tuple[int, int, str]] = {
    "float16": (2, 2, "<f2"),
    "bfloat16": (2, 4, "<u2"),
    "float32": (4, 2, "<f4"),
    "float64": (8, 2, "<f8"),
    "int8": (1, 0, "i1"),
    "uint8": (1, 1, "u1"),
    "float8_e4m3fn": (1, 1, "u1"),  # exported as raw bytes; view() in torch
    "float8_e5m2": (1, 1, "u1"),
}


def _dtype_name(dtype: Any) -> str:
    name = str(dtype)
    for prefix in ("torch.", "numpy."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    aliases = {"half": "float16", "float": "float32", "double": "float64", "f2": "float16", "f4": "float32"}
    name = aliases.get(name, name)
    if name not in _DTYPES:
        raise _lib.ArgumentTypeError(f"kvplug: VirtualKVCache: dtype: unsupported KV dtype {dtype!r}; one of {sorted(_DTYPES)}",
                                     _lib.Status.INVALID_ARGUMENT)
    return name


# ---------------------------------------------------------------------------
# DLPack (dlpack.h v0.8 legacy ABI: DLManagedTensor in a "dltensor" capsule)
# ---------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", _i32), ("device_id", _i32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", _vp),
        ("device", _DLDevice),
        ("ndim", _i32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(_i64)),
        ("strides", ctypes.POINTER(_i64)),
        ("byte_offset", _u64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", _vp), ("deleter", _DLDeleter)]

_KDL_CUDA = 2
_CAPSULE_NAME = b"dltensor"  # must outlive every capsule: module lifetime
# Exported tensors' ctypes objects (and the cache's lease), by DLManagedTensor
# address, until the consumer calls the deleter.
_dl_live: Dict[int, Any] = {}
_dl_lock = threading.Lock()


def _dl_delete(addr: int) -> None:
    with _dl_lock:
        _dl_live.pop(addr, None)


_dl_deleter = _DLDeleter(_dl_delete)  # module lifetime: the consumer may call it any time

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [_vp, ctypes.c_char_p, _vp]


def _dlpack_capsule(owner: Any, ptr: int, shape: Sequence[int], strides: Sequence[int],
                    code: int, bits: int, device: int) -> Any:
    ndim = len(shape)
    shp = (_i64 * ndim)(*shape)
    std = (_i64 * ndim)(*strides)
    mt = _DLManagedTensor()
    mt.dl_tensor.data = ptr
    mt.dl_tensor.device = _DLDevice(_KDL_CUDA, device)
    mt.dl_tensor.ndim = ndim
    mt.dl_tensor.dtype = _DLDataType(code, bits, 1)
    mt.dl_tensor.shape = ctypes.cast(shp, ctypes.POINTER(_i64))
    mt.dl_tensor.strides = ctypes.cast(std, ctypes.POINTER(_i64))
    mt.dl_tensor.byte_offset = 0
    mt.manager_ctx = None
    mt.deleter = _dl_deleter
    addr = ctypes.addressof(mt)
    with _dl_lock:
        _dl_live[addr] = (mt, shp, std, owner)
    return _PyCapsule_New(addr, _CAPSULE_NAME, None)


# ---------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------

IntArray = Union[Sequence[int], Any]  # lists, numpy int32 arrays, buffers


def _release(handle: int, backend: int) -> None:
    """Destroys a cache that was collected without close(). Holds no
    reference to the VirtualKVCache (a finalizer must not)."""
    s = VCacheStats()
    s.struct_size = ctypes.sizeof(VCacheStats)
    live = s.active_slots if C.kvp_vcache_stats_get(handle, ctypes.byref(s)) == 0 else 0
    C.kvp_vcache_destroy(handle)
    if live:
        kind = "CUDA" if backend == BACKEND_CUDA else "host"
        slots = f"{live} slot" if live == 1 else f"{live} slots"
        msg = (f"kvplug: a VirtualKVCache ({kind} backend) was collected with {slots} still "
               "allocated and has been closed; call close() or use it in a with block")
        warnings.warn(msg, ResourceWarning, stacklevel=2)
        logging.getLogger("kvplug").warning("%s", msg)


class VirtualKVCache(_lib.Owner):
    """A kvp_vcache. Methods are thread-safe (the library locks); close() must
    not race other calls. Use it as a context manager or call close(); a
    cache collected without it is closed then (see the module's notes).

    The arguments are kvp_vcache_config's fields: page_size 0 is the
    backend's granularity; reclaim_below_bytes 0 is budget_bytes / 8 and a
    negative value reclaims only when a step needs the pages;
    lookahead_tokens 0 is 16; background=False makes step map everything
    itself."""

    _destroy = "kvp_vcache_destroy"

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        max_batch: int,
        max_context: int,
        budget_bytes: int,
        *,
        backend: Union[str, int] = "cuda",
        device: int = 0,
        page_size: int = 0,
        lookahead_tokens: int = 0,
        background: bool = True,
        reclaim_below_bytes: int = 0,
    ) -> None:
        self._dtype = _dtype_name(dtype)
        nbytes, self._dl_code, self._np_dtype = _DTYPES[self._dtype]
        if isinstance(backend, str):
            try:
                backend = {"cuda": BACKEND_CUDA, "host": BACKEND_HOST}[backend]
            except KeyError:
                raise _lib.InvalidArgumentError(f"VirtualKVCache: backend must be 'cuda' or 'host': got {backend!r}",
                                                _lib.Status.INVALID_ARGUMENT) from None
        ci = _lib.checked_int
        self.backend = ci(backend, "VirtualKVCache: backend", "int32")
        self.device = ci(device, "VirtualKVCache: device", "int32")
        num_layers = ci(num_layers, "VirtualKVCache: num_layers", "int32")
        num_kv_heads = ci(num_kv_heads, "VirtualKVCache: num_kv_heads", "int32")
        head_dim = ci(head_dim, "VirtualKVCache: head_dim", "int32")
        max_batch = ci(max_batch, "VirtualKVCache: max_batch", "int32")
        max_context = ci(max_context, "VirtualKVCache: max_context", "int32")
        page_size = ci(page_size, "VirtualKVCache: page_size", "int64")
        budget_bytes = ci(budget_bytes, "VirtualKVCache: budget_bytes", "int64")
        reclaim_below_bytes = ci(reclaim_below_bytes, "VirtualKVCache: reclaim_below_bytes", "int64")
        lookahead_tokens = ci(lookahead_tokens, "VirtualKVCache: lookahead_tokens", "int32")
        cfg = VCacheConfig(
            ctypes.sizeof(VCacheConfig), self.backend, self.device, num_layers, num_kv_heads, head_dim,
            nbytes, max_batch, max_context, page_size, budget_bytes, reclaim_below_bytes,
            lookahead_tokens, 0 if background else 1,
        )
        h = _vp()
        _lib.check(C.kvp_vcache_create(ctypes.byref(cfg), ctypes.byref(h)))
        self._own(h.value, _release, h.value, self.backend)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_batch, self.max_context = max_batch, max_context
        self.dtype_bytes = nbytes
        st = (_i64 * 4)()
        _lib.check(C.kvp_vcache_strides(self._h, st))
        self.strides: Tuple[int, int, int, int] = tuple(st)  # type: ignore[assignment]
        # Weak: every view holds the cache's lease (its memory must stay
        # mapped), so strong references back would keep a dropped cache
        # alive for ever.
        self._views: "weakref.WeakValueDictionary[Tuple[int, int], Any]" = weakref.WeakValueDictionary()

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Unmaps and frees everything, at once when no tensor from k()/v()
        is alive, else when the last one is gone; later calls raise
        InvalidHandleError. Work the GPU has queued on the tensors must be
        done (synchronize first) when none is alive."""
        self._views.clear()
        super().close()

    @property
    def handle(self) -> int:
        if self._h is None:
            raise _lib.InvalidHandleError("kvplug: the VirtualKVCache is closed", _lib.Status.INVALID_HANDLE)
        return self._h

    # -- slots and steps ----------------------------------------------------

    def alloc(self) -> int:
        """A free slot (the freed slot holding the most pages first)."""
        s = _i32()
        _lib.check(C.kvp_vcache_alloc_slot(self.handle, ctypes.byref(s)))
        return s.value

    def free(self, slot: int) -> None:
        slot = _lib.checked_int(slot, "free: slot", "int32")
        _lib.check(C.kvp_vcache_free_slot(self.handle, slot))

    def step(self, slots: IntArray, ctx_lens: IntArray) -> None:
        """Maps tokens [0, ctx_lens[i]) of slots[i] in every layer; raises
        OutOfMemoryError (nothing changed) when the budget cannot cover them.
        Pass numpy int32 arrays to avoid conversions."""
        sp, n = _int32_ptr(slots, "step: slots")
        cp, m = _int32_ptr(ctx_lens, "step: ctx_lens")
        if n != m:
            raise _lib.InvalidArgumentError(f"step: {n} slots but {m} context lengths", _lib.Status.INVALID_ARGUMENT)
        _lib.check(C.kvp_vcache_step(self.handle, sp[0], cp[0], n))

    def trim(self) -> None:
        """Gives freed slots' pages and idle pages back to the driver."""
        _lib.check(C.kvp_vcache_trim(self.handle))

    def stats(self) -> Dict[str, int]:
        s = VCacheStats()
        s.struct_size = ctypes.sizeof(VCacheStats)
        _lib.check(C.kvp_vcache_stats_get(self.handle, ctypes.byref(s)))
        return {name: getattr(s, name) for name, _ in VCacheStats._fields_[1:]}

    # -- tensors ------------------------------------------------------------

    def layer_ptrs(self, layer: int) -> Tuple[int, int]:
        """The base addresses of layer's K and V tensors."""
        layer = _lib.checked_int(layer, "layer", "int32")
        k, v = _u64(), _u64()
        _lib.check(C.kvp_vcache_layer_ptrs(self.handle, layer, ctypes.byref(k), ctypes.byref(v)))
        return k.value, v.value

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        return (self.max_batch, self.max_context, self.num_kv_heads, self.head_dim)

    def k(self, layer: int) -> Any:
        """Layer's K tensor: torch (CUDA backend) or numpy (host backend)."""
        return self._view(layer, 0)

    def v(self, layer: int) -> Any:
        """Layer's V tensor: torch (CUDA backend) or numpy (host backend)."""
        return self._view(layer, 1)

    def _view(self, layer: int, which: int) -> Any:
        key = (layer, which)
        t = self._views.get(key)
        if t is None:
            ptr = self.layer_ptrs(layer)[which]
            t = self._torch_view(ptr) if self.backend == BACKEND_CUDA else self._numpy_view(ptr)
            self._views[key] = t
        return t

    def _torch_view(self, ptr: int) -> Any:
        import torch

        bits = 8 * self.dtype_bytes
        cap = _dlpack_capsule(self._lease(), ptr, self.shape, self.strides, self._dl_code, bits, self.device)
        t = torch.utils.dlpack.from_dlpack(cap)
        want = getattr(torch, self._dtype)
        return t if t.dtype == want else t.view(want)

    def _numpy_view(self, ptr: int) -> Any:
        import numpy as np

        isz = self.dtype_bytes
        nbytes = self.strides[0] * self.max_batch * isz
        buf = (ctypes.c_char * nbytes).from_address(ptr)
        buf._kvplug_lease = self._lease()  # the array's base keeps the memory mapped: see _lib.Lease
        return np.ndarray(self.shape, dtype=np.dtype(self._np_dtype), buffer=buf,
                          strides=tuple(s * isz for s in self.strides))

    def tensors(self) -> List[Tuple[Any, Any]]:
        """[(K, V)] of every layer."""
        return [(self.k(i), self.v(i)) for i in range(self.num_layers)]

    def __repr__(self) -> str:
        state = "closed" if self._h is None else f"{self.stats()['active_slots']} active slots"
        return (f"VirtualKVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self._dtype}, max_batch={self.max_batch}, max_context={self.max_context}, {state})")


def _int32_ptr(obj: IntArray, what: str) -> Tuple[Tuple[int, Any], int]:
    """(address, keep-alive) and count of obj as int32 elements."""
    if isinstance(obj, (list, tuple, range)):
        arr = (_i32 * len(obj))(*(_lib.checked_int(v, f"{what} element {i}", "int32") for i, v in enumerate(obj)))
        return (ctypes.addressof(arr), arr), len(arr)
    addr, n = _lib.as_ptr(obj, _i32, what=what)
    return (addr, obj), n
