"""A step's sampled token ids to the host without a copy engine.

`tensor.tolist()` on a CUDA tensor is a device-to-host copy, and such a
copy waits behind every copy in flight in the same direction, whatever
stream it is on: with the host tier's write-through stores going by the
copy engines on a side stream (tens of MiB a step), the readback that ends
each step waited for all of them (bench/store_interference.py measures it:
a 6 ms step took 8 ms with 90 MiB of stores beside it, 6.4 ms without the
copy). HostReadback instead has a kernel write the ids into pinned host
memory through its device address (pinned memory is mapped into the
device's address space under unified addressing, at the same address,
which the driver is asked before the first write), then waits for the
stream: no copy engine is involved."""

from __future__ import annotations

import ctypes
from typing import Any, List, Optional

import torch


# The dtypes whose values int64 holds as they are (bool would come back as 0/1, uint64 wrapped).
_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3  # CUpointer_attribute (cuda.h)
_cuda_driver: Optional[Any] = None


def _device_address(ptr: int) -> int:
    """The device address of host memory at ptr in the current context
    (cuPointerGetAttribute), or 0 where the device cannot reach it (memory
    that is not pinned, or pinned without a mapping), or where the driver
    cannot be asked."""
    global _cuda_driver
    try:
        if _cuda_driver is None:
            _cuda_driver = ctypes.CDLL("libcuda.so.1")
        out = ctypes.c_uint64(0)
        rc = _cuda_driver.cuPointerGetAttribute(ctypes.byref(out), ctypes.c_int(_CU_POINTER_ATTRIBUTE_DEVICE_POINTER),
                                                ctypes.c_uint64(ptr))
    except (OSError, AttributeError):
        return 0
    return out.value if rc == 0 else 0


class _DeviceView:
    """The __cuda_array_interface__ of n int64 at a device address."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i8", "data": (ptr, False), "version": 3}


class HostReadback:
    """Reads small integer tensors of one CUDA device back to the host
    (tolist), through a pinned buffer of at least `capacity` int64 that
    grows as needed. Not thread-safe: one per serving loop."""

    def __init__(self, device: Any, capacity: int = 256) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"HostReadback: a CUDA device, not {self.device}")
        if self.device.index is None:
            # Tensors made on "cuda" say which device: name it, so that tolist compares like with like.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._grow(max(1, int(capacity)))

    def _grow(self, n: int) -> None:
        self.view, self.aliased = None, False
        # Not an inference tensor even when made under torch.inference_mode (tolist may run outside it).
        with torch.inference_mode(False), torch.cuda.device(self.device):
            self.host = torch.zeros(n, dtype=torch.int64, pin_memory=True)
            # The view must be the host buffer itself at its own address (not a copy on the device). The
            # driver says first whether the device reaches the buffer there (a write through an address
            # it does not map would fault and end the context); then the view's address is checked, and
            # a value the buffer does not hold is written through it. Where any of these fails (or torch
            # takes no such view), tolist keeps the device-to-host copy.
            if _device_address(self.host.data_ptr()) != self.host.data_ptr():
                return
            try:
                view = torch.as_tensor(_DeviceView(self.host.data_ptr(), n), device=self.device)
                if view.data_ptr() != self.host.data_ptr() or view.device != self.device:
                    return
                view[:1].fill_(-7)
                torch.cuda.current_stream(self.device).synchronize()
                if int(self.host[0]) == -7:
                    self.view, self.aliased = view, True
            except (RuntimeError, TypeError, ValueError):
                pass

    def tolist(self, t: torch.Tensor) -> List[Any]:
        """t.tolist() for an integer tensor on this device (any shape), its
        values written into pinned memory by a kernel on the current stream,
        which the call then waits for."""
        if t.device != self.device or t.dtype not in _INTS or not self.aliased:
            return t.tolist()
        n = t.numel()
        if n > self.host.numel():
            torch.cuda.current_stream(self.device).synchronize()  # the old buffer's last write has landed
            self._grow(2 * n)
            if not self.aliased:
                return t.tolist()
        flat = self.view[:n]
        torch.add(t.reshape(-1).to(torch.int64), 0, out=flat)
        torch.cuda.current_stream(self.device).synchronize()
        return self.host[:n].reshape(t.shape).tolist()
