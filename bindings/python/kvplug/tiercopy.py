"""Batched copies between the paged KV caches on the GPU and the slots of a
host KV tier (include/kvplug.h, "tier copy").

A TierCopier takes the engine's per-layer K and V caches (torch tensors
whose first dimension is the block) and the host tier's memory (a
Manager's, or any uint8 array [slots, slot_bytes]); it page-locks that
memory and, per call, copies every layer's K and V of every block of a
batch in one kernel launch on the given stream:

    copier = TierCopier(k_caches, v_caches, manager=m)
    ...
    batch = m.flush_copies()
    copier.run(batch)                         # on the current stream
    done = torch.cuda.Event(); done.record()
    ...                                       # later, once done.query():
    m.complete_copies(batch.ticket)

Close the copier (or leave its with block) before closing the Manager whose
memory it registered. Needs a GPU and the library's kernels.

store_engine="copy-engine" hands the demotions (GPU -> host) to the copy
engines (a CUDA 12.8+ driver) instead of the kernel's launches, so that
stores running on a side stream leave the SMs to the kernels beside them;
reloads keep the kernel. Layers that are views of one tensor [layers, 2,
num_blocks, ...] (kvplug.hf's cache) take a strided copy a block; other
layouts one batched copy (cuMemcpyBatchAsync) a batch, a copy a chunk.
Its demotions need a stream other than the legacy default stream.

FP8 caches (torch.float8_e4m3fn, [num_blocks, block_size, kv_heads,
head_dim]) come with their scales, k_scales= and v_scales= (a layer's
float32 tensors as kv_write takes them): per-token-head scales move with
their blocks, stored in each slot after its K/V bytes (slot_bytes_needed
counts them); a per-cache scale stays with the engine.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence

import numpy as np

from . import _lib
from . import _tensors as _t
from ._capi import KVLayersStruct, PagedKV, TierCopyStruct
from ._lib import C
from ._tensors import check as _check, torch as _torch

__all__ = ["TierCopier", "STORE_ENGINES"]

STORE_COPY_ENGINE = 1  # KVP_TIER_COPY_STORE_COPY_ENGINE (kvp_kv_layers.flags)

# TierCopier's store_engine values -> kvp_kv_layers.flags.
STORE_ENGINES = {"kernel": 0, "copy-engine": STORE_COPY_ENGINE}


def _store_flags(store_engine: str) -> int:
    flags = STORE_ENGINES.get(store_engine) if isinstance(store_engine, str) else None
    if flags is None:
        raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT),
                             f"TierCopier: store_engine must be one of {sorted(STORE_ENGINES)}, not {store_engine!r}")
    return flags


def _ops(blocks: Any, slots: Any, what: str) -> tuple:
    b, s = np.asarray(blocks), np.asarray(slots)
    if b.dtype != np.int32 or s.dtype != np.int32:  # int32 arrays (flush_copies') are in range by their type
        b, s = np.asarray(b, dtype=np.int64), np.asarray(s, dtype=np.int64)
        if b.size and (b.min() < -(2**31) or b.max() >= 2**31 or s.min() < -(2**31) or s.max() >= 2**31):
            raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), f"TierCopier.run: {what} op out of int32 range")
    if b.shape != s.shape or b.ndim != 1:
        raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), f"TierCopier.run: {what} blocks and slots must be 1-D of one length")
    arr = (TierCopyStruct * max(b.size, 1))()
    view = np.frombuffer(arr, np.int32).reshape(-1, 2)
    view[: b.size, 0] = b
    view[: b.size, 1] = s
    return arr, int(b.size)


class TierCopier(_lib.Owner):
    """Copies blocks between the GPU caches and a host tier's slots.

    k_caches / v_caches: one tensor per layer on one CUDA device, dimension
    0 the block (any dtype; each block contiguous, as in [num_blocks,
    block_size, kv_heads, head_dim] or [num_blocks, kv_heads, block_size,
    head_dim]); v_caches None copies K only. The host memory is the
    manager's (manager=) or `host`, a C-contiguous uint8 array of shape
    [num_slots, slot_bytes] that outlives the copier. store_engine:
    "kernel" (the default) or "copy-engine" (see the module docstring)."""

    _destroy = "kvp_tier_copier_destroy"

    def __init__(self, k_caches: Sequence[Any], v_caches: Optional[Sequence[Any]] = None, *,
                 manager: Any = None, host: Any = None, k_scales: Optional[Sequence[Any]] = None,
                 v_scales: Optional[Sequence[Any]] = None, store_engine: str = "kernel") -> None:
        flags = _store_flags(store_engine)
        torch = _torch()
        k = list(k_caches)
        v = None if v_caches is None else list(v_caches)
        if not k or (v is not None and len(v) != len(k)):
            raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), "TierCopier: need >= 1 K layer and as many V layers as K")
        ref = k[0]
        for t in k + (v or []):
            if not isinstance(t, torch.Tensor) or not t.is_cuda or t.device != ref.device or t.dim() < 2:
                raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), "TierCopier: caches must be CUDA tensors of >= 2 dims on one device")
            if t.shape[0] != ref.shape[0] or t.dtype != ref.dtype or t[0].numel() != ref[0].numel():
                raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), "TierCopier: every layer needs the same blocks, dtype and block shape")
            if not t[0].is_contiguous():
                raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), "TierCopier: each block of a cache must be contiguous")
        esize = ref.element_size()
        if (manager is None) == (host is None):
            raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), "TierCopier: pass exactly one of manager= and host=")
        if manager is not None:
            host = manager.host_tier_memory()
        if not isinstance(host, np.ndarray) or host.dtype != np.uint8 or host.ndim != 2 or not host.flags.c_contiguous:
            raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), "TierCopier: host must be a C-contiguous uint8 array [slots, slot_bytes]")
        lay = KVLayersStruct()
        lay.struct_size = ctypes.sizeof(KVLayersStruct)
        lay.num_layers = len(k)
        lay.flags = flags
        scale_bytes = 0
        if _t.is_e4m3(ref) or k_scales is not None or v_scales is not None:
            descs, scale_bytes = self._descriptors(k, v, k_scales, v_scales)
            lay.kv = descs
            keep = descs
        else:
            kp = (ctypes.c_uint64 * len(k))(*[t.data_ptr() for t in k])
            vp = None if v is None else (ctypes.c_uint64 * len(v))(*[t.data_ptr() for t in v])
            lay.num_blocks = ref.shape[0]
            lay.k = ctypes.cast(kp, ctypes.c_void_p)
            lay.v = None if vp is None else ctypes.cast(vp, ctypes.c_void_p)
            lay.block_bytes = ref[0].numel() * esize
            lay.k_block_stride = ref.stride(0) * esize
            lay.v_block_stride = (v[0].stride(0) if v else ref.stride(0)) * esize
            keep = (kp, vp)
            for t in k[1:]:
                if t.stride(0) != ref.stride(0):
                    raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), "TierCopier: every K layer needs the same block stride")
            for t in (v or [])[1:]:
                if t.stride(0) != v[0].stride(0):
                    raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), "TierCopier: every V layer needs the same block stride")
        out = ctypes.c_void_p()
        with torch.cuda.device(ref.device):
            _check(C.kvp_tier_copier_create(ctypes.byref(lay), host.ctypes.data, host.shape[1], host.shape[0], ctypes.byref(out)))
        self._own(out.value, C.kvp_tier_copier_destroy, out.value)
        # Kept alive: the copier reads and writes them.
        self._keep = (k, v, k_scales, v_scales, host, manager, keep)
        self.device = ref.device
        self.store_engine = store_engine
        self.block_bytes = ref[0].numel() * esize
        kv = 1 if v is None else 2
        self.slot_bytes_needed = (self.block_bytes + scale_bytes) * len(k) * kv

    @staticmethod
    def _descriptors(k: list, v: Optional[list], k_scales: Any, v_scales: Any) -> tuple:
        """Per-layer kvp_paged_kv descriptors of [num_blocks, block_size,
        kv_heads, head_dim] caches with their scales, and the bytes of one
        block's scales of one tensor that a slot holds (0: none)."""
        if v is None or k_scales is None or v_scales is None:
            raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT),
                                 "TierCopier: FP8 caches come as K and V layers with k_scales and v_scales (one a layer)")
        ks, vs = list(k_scales), list(v_scales)
        if len(ks) != len(k) or len(vs) != len(k):
            raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), f"TierCopier: {len(k)} layers but {len(ks)} k_scales and {len(vs)} v_scales")
        arr = (ctypes.POINTER(PagedKV) * len(k))()
        structs = []
        for i in range(len(k)):
            d = _t.paged_kv(k[i], v[i], k_scale=ks[i], v_scale=vs[i])
            d.k_cache, d.v_cache = k[i].data_ptr(), v[i].data_ptr()
            _t.set_scales(d, ks[i], vs[i])
            structs.append(d)
            arr[i] = ctypes.pointer(d)
        d0 = structs[0]
        per_block = d0.block_size * d0.num_kv_heads * 4 if d0.scale_kind == _t.SCALE_TOKEN_HEAD else 0
        return ctypes.cast(arr, ctypes.POINTER(ctypes.POINTER(PagedKV))), per_block

    def run(self, batch: Any = None, stream: Any = None, *, demote: Any = None, reload: Any = None) -> None:
        """Enqueues a batch's copies on stream (a torch.cuda.Stream, a raw
        cudaStream_t int, or None: the current stream): batch is a
        Manager.flush_copies() CopyBatch, or give demote=(blocks, slots)
        and/or reload=(slots, blocks). Returns once enqueued. A
        "copy-engine" copier's demotions are refused (InvalidArgumentError)
        on the legacy default stream (0, torch's default stream)."""
        if self._h is None:
            raise _lib.error_for(int(_lib.Status.INVALID_HANDLE), "TierCopier is closed")
        if batch is not None:
            demote = (batch.demote_blocks, batch.demote_slots)
            reload = (batch.reload_slots, batch.reload_blocks)
        d, nd = _ops(*(demote if demote is not None else ((), ())), "demote")
        if reload is not None:
            r, nr = _ops(reload[1], reload[0], "reload")
        else:
            r, nr = _ops((), (), "reload")
        if nd + nr == 0:
            return
        torch = _torch()
        if stream is None:
            s = torch.cuda.current_stream(self.device).cuda_stream
        elif isinstance(stream, int):
            s = stream
        else:
            s = stream.cuda_stream
        with torch.cuda.device(self.device):
            _check(C.kvp_tier_copier_run(self._h, d, nd, r, nr, ctypes.c_void_p(s)))

    @property
    def pinned(self) -> bool:
        """The host memory is page-locked and mapped while the copier is open."""
        return self._h is not None

    def __repr__(self) -> str:
        return ("TierCopier(closed)" if self._h is None else
                f"TierCopier({self.device}, block_bytes={self.block_bytes}, store_engine={self.store_engine!r})")
