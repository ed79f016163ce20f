"""Host arrays into C: the converters of the manager's calls (manager.py,
prefix.py, cascade.plan_from_manager). Each takes the documented input forms
(lists, tuples, ranges, numpy arrays, torch CPU tensors, buffers) and
returns an address the C call reads, with the object that keeps it alive.
Arrays of the C type are used in place; other forms are converted without a
Python loop over their elements.
"""

from __future__ import annotations

import ctypes
from typing import Any, Tuple

import numpy as np

from . import _lib

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_INT32_MAX = 2**31 - 1
_ndarray = np.ndarray
_from_buffer = ctypes.c_char.from_buffer
_addressof = ctypes.addressof
_is_torch = _lib._is_torch_tensor
_int = _lib.checked_int


def bad(msg: str) -> _lib.InvalidArgumentError:
    return _lib.InvalidArgumentError(msg, _lib.Status.INVALID_ARGUMENT)


def addr(arr: np.ndarray) -> int:
    """The address of a C-contiguous numpy array: c_char.from_buffer is
    cheaper than arr.ctypes.data; read-only and empty arrays take the
    general path."""
    try:
        return _addressof(_from_buffer(arr))
    except (TypeError, ValueError, BufferError):
        return arr.ctypes.data


def in_ptr(obj: Any, dtype: np.dtype, ctype: Any, what: str) -> Tuple[int, int, Any]:
    """(address, count, keepalive) of an input array of dtype. numpy arrays
    of the right dtype are used in place; other sequences are converted (a
    copy); buffers and torch tensors are used in place or refused."""
    if type(obj) is _ndarray and (obj.dtype is dtype or obj.dtype == dtype) and obj.ndim == 1:
        try:
            # c_char.from_buffer is three times cheaper than arr.ctypes.data,
            # and numpy's buffer export refuses non-contiguous arrays for it.
            return _addressof(_from_buffer(obj)), obj.size, obj
        except (ValueError, TypeError, BufferError):
            pass  # read-only, empty or strided: the general path below
        if obj.flags.c_contiguous:
            return obj.ctypes.data, obj.size, obj
    if isinstance(obj, (int, np.integer)):
        arr = np.array([_int(obj, what, dtype.name)], dtype)
        return _addressof(_from_buffer(arr)), 1, arr
    if isinstance(obj, (list, tuple, range, np.ndarray)):
        src = obj if isinstance(obj, np.ndarray) else np.asarray(obj)
        if src.ndim != 1:
            raise bad(f"{what} must be one-dimensional: got shape {src.shape}")
        if src.size:
            if src.dtype.kind not in "iu":
                raise bad(f"{what} must hold integers: got {src.dtype} values")
            if src.dtype != dtype and not np.can_cast(src.dtype, dtype):
                lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
                if src.min() < lo or src.max() > hi:
                    raise bad(f"{what} must hold {dtype} values: got {src.min()}..{src.max()}")
        arr = np.ascontiguousarray(src, dtype=dtype)
        # arr.ctypes.data costs several microseconds (it builds a ctypes
        # helper object); c_char.from_buffer a tenth of that, for the
        # writable, non-empty arrays it accepts.
        if arr.size and arr.flags.writeable:
            return _addressof(_from_buffer(arr)), arr.size, arr
        return arr.ctypes.data, arr.size, arr
    ptr, n = _lib.as_ptr(obj, ctype)
    return ptr, n, obj


def out_ptr(obj: Any, need: int, what: str) -> Tuple[int, int]:
    """(address, capacity) of a writable int32 output buffer of at least
    `need` elements; raises BufferTooSmallError when it is shorter."""
    ptr = 0
    if type(obj) is _ndarray and (obj.dtype is _I32 or obj.dtype == _I32):
        n = obj.size
        try:
            ptr = _addressof(_from_buffer(obj))  # refuses read-only and strided arrays
        except (ValueError, TypeError, BufferError):
            ptr, n = _lib.as_ptr(obj, _i32, writable=True)  # raises with the reason
    else:
        ptr, n = _lib.as_ptr(obj, _i32, writable=True)
    if n < need:
        raise _lib.BufferTooSmallError(f"{what} holds {n} entries, {need} needed", _lib.Status.BUFFER_TOO_SMALL)
    return ptr, n


def tokens(t: Any, what: str) -> np.ndarray:
    """t as a contiguous int32 array, without a copy when it is one
    already (a numpy array or a torch CPU tensor of int32). Other integer
    arrays are range-checked and converted; lists go through numpy, which
    rejects non-integers, with no Python work per token."""
    if type(t) is _ndarray:
        arr = t
    elif _is_torch(t):
        if t.device.type != "cpu":
            raise bad(f"{what}: a CPU tensor is needed; the tensor is on {t.device}")
        arr = t.detach().numpy()  # shares the tensor's memory
    else:
        arr = np.asarray(t)
    if arr.dtype is _I32 or arr.dtype == _I32:
        if arr.ndim != 1:
            raise bad(f"{what} must be one-dimensional: got shape {arr.shape}")
        return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    if arr.ndim != 1:
        raise bad(f"{what} must be one-dimensional: got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise bad(f"{what} must hold integers: got {arr.dtype}")
    if arr.size and (arr.min() < -(2**31) or arr.max() > _INT32_MAX):
        raise bad(f"{what} must hold int32 token ids")
    return np.ascontiguousarray(arr, np.int32)


NO_TOKENS = np.zeros(1, np.int32)  # a valid address for an all-empty batch


def flatten(prompts: Any) -> Tuple[np.ndarray, np.ndarray]:
    """(tokens, offsets[n+1]) of a batch of prompts: a list of token
    sequences, or a 2-D array of equal-length prompts. One int32 prompt
    or a 2-D int32 array is used in place."""
    if (type(prompts) is _ndarray or _is_torch(prompts)) and len(prompts.shape) == 2:
        n, k = prompts.shape
        flat = tokens(prompts.reshape(-1), "prompts")
        return (flat if flat.size else NO_TOKENS), np.arange(n + 1, dtype=np.int64) * k
    if len(prompts) == 1:
        a = tokens(prompts[0], "prompt 0")
        return (a if a.size else NO_TOKENS), np.array((0, a.size), np.int64)
    arrs = [tokens(p, f"prompt {i}") for i, p in enumerate(prompts)]
    offsets = np.zeros(len(arrs) + 1, np.int64)
    np.cumsum([a.size for a in arrs], out=offsets[1:])
    toks = np.concatenate(arrs) if arrs else NO_TOKENS
    return (toks if toks.size else NO_TOKENS), offsets
