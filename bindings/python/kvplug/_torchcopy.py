"""Torch copies of KV blocks between device tensors and host rows: kvplug's
one torch fallback, for the engines' layouts that kvplug.TierCopier (the
library's batched copy kernel) does not take and for caches off CUDA.
kvplug.hf.tier_copy.TorchTierCopier and kvplug.vllm.BlockCopier keep only
their layouts (which tensors, which rows) and run their copies here.

A device tensor holds one block along dimension `dim`; a host tensor holds
one block a row (row r is the device tensor with `dim` selected, in the same
dtype). Copies run on the current stream and are enqueued, not waited for.
FP8 tensors are copied as bytes (as_bytes): torch's index ops do not all
take float8 on the CPU.

Two ways to the host rows:

    copy_rows(pairs, dim, dev_rows, host_rows, store=..., non_blocking=...)
        per pair, one gather (index_select) or scatter (index_copy_) on the
        device and one copy per run of consecutive host rows, straight to or
        from the host tensor: for host memory that is page-locked (pin())
        or on the CPU.
    stage_store / stage_load
        per tensor, one copy through a pinned staging tensor, the host side
        gathered (index_select) before the copy or scattered (index_copy_,
        Staged.finish) once its event has passed: for host rows anywhere in
        host memory, one copy a tensor whatever their order.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, List, Sequence, Tuple

import numpy as np
import torch

__all__ = ["is_fp8", "as_bytes", "runs", "pin", "unpin", "device_index", "copy_rows", "Staged", "stage_store",
           "stage_load"]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == getattr(torch, "float8_e4m3fn", None)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t, viewed as uint8 when it is FP8 (the index ops then move its bytes)."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def runs(rows: np.ndarray) -> List[Tuple[int, int, int]]:
    """(i0, i1, r0) for each run of consecutive rows in sorted `rows`:
    positions i0..i1-1 hold rows r0..r0+i1-i0-1."""
    n = len(rows)
    if n == 0:
        return []
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [n]])
    return [(int(a), int(b), int(rows[a])) for a, b in zip(starts, ends)]


def _cuda_ok(err: Any) -> bool:
    return int(getattr(err, "value", err)) == 0


def pin(host: np.ndarray, who: str, what: str) -> bool:
    """Page-locks `host` (cudaHostRegister) for asynchronous copies; True if
    it did. A failure is a RuntimeWarning (the copies then go through
    pageable memory) naming `who` and `what`. unpin() undoes it."""
    if not host.size:
        return False
    err = torch.cuda.cudart().cudaHostRegister(host.ctypes.data, host.nbytes, 0)
    if _cuda_ok(err):
        return True
    warnings.warn(f"{who}: cudaHostRegister of {what} ({host.nbytes / 2**30:.1f} GiB) failed "
                  f"({err}): its copies go through pageable memory (synchronous, slower)", RuntimeWarning)
    return False


def unpin(host: np.ndarray) -> None:
    torch.cuda.cudart().cudaHostUnregister(host.ctypes.data)


def device_index(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """rows as an int64 index on `device`; to a CUDA device from pinned
    memory on the current stream (a pageable source may make the copy wait
    for the stream)."""
    idx = torch.from_numpy(np.asarray(rows).astype(np.int64))
    return idx.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else idx.to(device)


def copy_rows(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], dim: int, dev_rows: np.ndarray,
              host_rows: np.ndarray, *, store: bool, non_blocking: bool) -> None:
    """For each (device tensor, host tensor) of `pairs`, the blocks dev_rows
    (along `dim`) to host rows host_rows (store), or back. One gather or
    scatter on the device through a staging tensor there, and one copy per
    run of consecutive host rows (the ops sorted by host row, stably)."""
    if not len(host_rows):
        return
    host_rows = np.asarray(host_rows)
    order = np.argsort(host_rows, kind="stable")
    rows = host_rows[order]
    idx = device_index(np.asarray(dev_rows)[order], pairs[0][0].device)
    spans = runs(rows)
    for dev, host in pairs:
        if store:
            stage = dev.index_select(dim, idx).movedim(dim, 0).contiguous()
            for i0, i1, r0 in spans:
                host[r0:r0 + i1 - i0].copy_(stage[i0:i1], non_blocking=non_blocking)
        else:
            stage = torch.empty((len(rows),) + tuple(host.shape[1:]), dtype=dev.dtype, device=dev.device)
            for i0, i1, r0 in spans:
                stage[i0:i1].copy_(host[r0:r0 + i1 - i0], non_blocking=non_blocking)
            dev.index_copy_(dim, idx, stage.movedim(0, dim))


@dataclasses.dataclass
class Staged:
    """A staged copy's pinned staging tensor, kept until its stream has
    passed the copy; a store's host scatter (finish()) waits for that too."""

    stage: torch.Tensor
    host: Any = None  # a store's host tensor and rows, scattered by finish()
    rows: Any = None

    @property
    def nbytes(self) -> int:
        return self.stage.numel() * self.stage.element_size()

    def finish(self) -> None:
        """After the copy's stream has passed it: a store's host scatter."""
        if self.host is not None:
            self.host.index_copy_(0, self.rows, self.stage)


def stage_store(dev: torch.Tensor, dev_rows: np.ndarray, host: torch.Tensor, host_rows: np.ndarray) -> Staged:
    """Rows dev_rows of `dev` (a CUDA tensor, blocks along dimension 0)
    gathered into a pinned staging tensor on the current stream; finish()
    scatters them to host rows host_rows once the stream has passed."""
    idx = device_index(dev_rows, dev.device)
    stage = torch.empty((len(dev_rows),) + tuple(dev.shape[1:]), dtype=dev.dtype, pin_memory=True)
    stage.copy_(dev.index_select(0, idx), non_blocking=True)
    return Staged(stage, host, torch.from_numpy(np.asarray(host_rows).astype(np.int64)))


def stage_load(dev: torch.Tensor, dev_rows: np.ndarray, host: torch.Tensor, host_rows: np.ndarray) -> Staged:
    """Host rows host_rows gathered now into a pinned staging tensor, copied
    on the current stream into rows dev_rows of `dev` (a CUDA tensor, blocks
    along dimension 0). Keep the result until the stream has passed."""
    idx = device_index(dev_rows, dev.device)
    stage = torch.empty((len(dev_rows),) + tuple(dev.shape[1:]), dtype=dev.dtype, pin_memory=True)
    torch.index_select(host, 0, torch.from_numpy(np.asarray(host_rows).astype(np.int64)), out=stage)
    dev.index_copy_(0, idx, stage.to(dev.device, non_blocking=True))
    return Staged(stage)
