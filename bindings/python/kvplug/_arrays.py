"""Host arrays into C: the converters of the manager's calls (manager.py,
prefix.py, cascade.plan_from_manager). Each takes the documented input forms
(lists, tuples, ranges, numpy arrays, torch CPU tensors, buffers) and
returns an address the C call reads, with the object that keeps it alive.
Arrays of the C type are used in place; lists and tuples of ints go through
array.array (one C loop, a few tens of nanoseconds an element, half numpy's
cost); anything else through numpy, whose refusal names the problem.
"""

from __future__ import annotations

import array
import ctypes
import sys
from typing import Any, Dict, List, Optional, Tuple

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
_min, _max = np.minimum.reduce, np.maximum.reduce  # arr.min() and arr.max() without their Python wrapper
_int = _lib.checked_int


# Up to this many integers of another width convert faster through a list
# (tolist, then array.array's checked conversion) than through numpy's range
# check and copy, whose calls cost microseconds each whatever the size: a
# decode step's tokens as int64.
_SMALL = 128
_TYPECODE = {_I32: "i", _I64: "q"}  # array.array's C int32 and int64 (Linux: int, long long)
_SAFE_CAST: Dict[Tuple[np.dtype, np.dtype], bool] = {}


def _safe_cast(src: np.dtype, dst: np.dtype) -> bool:
    """np.can_cast(src, dst), remembered (it costs a microsecond)."""
    ok = _SAFE_CAST.get((src, dst))
    if ok is None:
        ok = _SAFE_CAST[(src, dst)] = bool(np.can_cast(src, dst))
    return ok


_TORCH_NAME = {_I32: "int32", _I64: "int64"}
_TORCH_DTYPE = {_I32: lambda t: t.int32, _I64: lambda t: t.int64}


def _tensor(obj: Any, dtype: Optional[np.dtype] = None) -> bool:
    """Whether obj is a torch.Tensor proper (not a subclass or another
    object with the tensor protocol _lib.as_ptr reads) on the CPU, C-contiguous
    and, with dtype (_I32 or _I64), of that dtype: the tensors the fast
    paths take in place, in a few attribute reads."""
    torch = sys.modules.get("torch")
    return (torch is not None and type(obj) is torch.Tensor and obj.is_cpu and obj.is_contiguous()
            and (dtype is None or obj.dtype is getattr(torch, _TORCH_NAME[dtype])))


def ints(seq: Any, typecode: str) -> Optional[array.array]:
    """seq, a non-empty list or tuple of integers, as an array.array of
    typecode ("i" int32, "q" int64), each element checked as C does it (an
    int, or a numpy integer, in range). None when one is not, or when the
    first is a bool (numpy makes a list of bools a bool array, which the
    converters refuse): the caller's general path then refuses, or
    converts, as it did before this fast path existed."""
    if not seq or type(seq[0]) is bool:
        return None
    try:
        return array.array(typecode, seq)
    except (TypeError, OverflowError):
        return None


def bad(msg: str) -> _lib.InvalidArgumentError:
    return _lib.InvalidArgumentError(msg, _lib.Status.INVALID_ARGUMENT)


def bad_type(msg: str) -> _lib.ArgumentTypeError:
    return _lib.ArgumentTypeError(msg, _lib.Status.INVALID_ARGUMENT)


def _numpy_of_tensor(t: Any, what: str) -> np.ndarray:
    """numpy's view of a CPU tensor (a copy for none), for the converters'
    general paths; a tensor elsewhere or of a dtype numpy lacks is refused."""
    if t.device.type != "cpu":
        raise bad(f"{what}: a CPU tensor is needed; the tensor is on {t.device}")
    try:
        return (t.detach() if getattr(t, "requires_grad", False) else t).numpy()
    except (TypeError, RuntimeError):  # bfloat16 and other dtypes numpy has no counterpart of
        raise bad_type(f"{what} must hold integers: got a tensor of {t.dtype}") from None


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
    if type(obj) is list or type(obj) is tuple:
        a = ints(obj, _TYPECODE[dtype])
        if a is not None:
            ptr, n = a.buffer_info()
            return ptr, n, a
    elif type(obj) is _ndarray:
        # Another integer dtype that converts without loss (int32 ids): the
        # copy the general path below makes, without its checks' cost.
        if obj.ndim == 1 and obj.size and obj.dtype.kind in "iu" and _safe_cast(obj.dtype, dtype):
            arr = obj.astype(dtype)
            return _addressof(_from_buffer(arr)), arr.size, arr
    elif _tensor(obj, dtype):
        return obj.data_ptr(), obj.numel(), obj  # in place, as _lib.as_ptr takes it
    if obj is None:
        raise bad_type(f"{what} must be a sequence of integers (a list, a numpy array, a CPU tensor), not None")
    if isinstance(obj, (int, np.integer)):
        arr = np.array([_int(obj, what, dtype.name)], dtype)
        return _addressof(_from_buffer(arr)), 1, arr
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.is_cpu and obj.dtype is not _TORCH_DTYPE[dtype](torch):
        # Another dtype (int32 ids, int64 counts): converted as the same
        # numpy array would be. Tensors on a GPU, and objects that only
        # look like tensors, go to _lib.as_ptr, which takes or refuses them.
        obj = _numpy_of_tensor(obj, what)
    if isinstance(obj, (list, tuple, range, np.ndarray)):
        src = obj if isinstance(obj, np.ndarray) else np.asarray(obj)
        if src.ndim == 0 and src.dtype.kind in "iu":
            src = src.reshape(1)  # one number, as an int is taken
        if src.ndim != 1:
            raise bad(f"{what} must be one-dimensional: got shape {src.shape}")
        if src.size:
            if src.dtype.kind not in "iu":
                raise bad_type(f"{what} must hold integers: got {src.dtype} values")
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
    ptr, n = _lib.as_ptr(obj, ctype, what=what)
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
            ptr, n = _lib.as_ptr(obj, _i32, writable=True, what=what)  # raises with the reason
    else:
        if obj is None:
            raise bad_type(f"{what} must be a writable int32 array, not None")
        ptr, n = _lib.as_ptr(obj, _i32, writable=True, what=what)
    if n < need:
        raise _lib.BufferTooSmallError(f"{what} holds {n} entries, {need} needed", _lib.Status.BUFFER_TOO_SMALL)
    return ptr, n


def tokens(t: Any, what: str) -> np.ndarray:
    """t as a contiguous int32 array, without a copy when it is one
    already (a numpy array or a torch CPU tensor of int32). Other integer
    arrays are range-checked and converted; lists of ints go through
    array.array, other lists through numpy, which rejects non-integers,
    with no Python work per token."""
    if type(t) is _ndarray:
        arr = t
    elif type(t) is list or type(t) is tuple:
        a = ints(t, "i")
        if a is not None:
            return np.frombuffer(a, _I32)
        arr = np.asarray(t)
    elif _tensor(t):
        small = _small_tensor(t) if t.dim() == 1 else None
        if small is not None:
            return small
        arr = (t.detach() if t.requires_grad else t).numpy()  # shares the tensor's memory
    elif _is_torch(t):
        arr = _numpy_of_tensor(t, what)  # shares the tensor's memory
    elif t is None or isinstance(t, (str, bytes, dict, set)):
        raise bad_type(f"{what} must be a sequence of token ids, not {type(t).__name__}")
    else:
        arr = np.asarray(t)
    if arr.dtype is _I32 or arr.dtype == _I32:
        if arr.ndim != 1:
            raise bad(f"{what} must be one-dimensional: got shape {arr.shape}")
        return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    if arr.ndim != 1:
        raise bad(f"{what} must be one-dimensional: got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise bad_type(f"{what} must hold integers: got {arr.dtype}")
    if arr.size <= _SMALL:
        a = ints(arr.tolist(), "i")
        if a is not None:
            return np.frombuffer(a, _I32)
    if arr.size and (_min(arr) < -(2**31) or _max(arr) > _INT32_MAX):
        raise bad(f"{what} must hold int32 token ids")
    return arr.astype(np.int32)  # a new, C-contiguous array


NO_TOKENS = np.zeros(1, np.int32)  # a valid address for an all-empty batch


def _small_tensor(t: Any) -> Optional[np.ndarray]:
    """A short 1-D integer CPU tensor of another width (a decode step's int64
    tokens) as an int32 array through a list (see _SMALL); None otherwise."""
    dt = t.dtype
    if t.numel() > _SMALL or dt.is_floating_point or dt.is_complex:
        return None
    a = ints(t.tolist(), "i")
    return None if a is None else np.frombuffer(a, _I32)


def token_ptr(t: Any, what: str) -> Tuple[int, int, Any]:
    """(address, count, keepalive) of tokens(t, what); an int32 CPU tensor
    is used in place without numpy's view of it. An empty one gives
    NO_TOKENS's address (never NULL)."""
    if _tensor(t) and t.dim() == 1:
        n = t.numel()
        if t.dtype is sys.modules["torch"].int32:
            return (t.data_ptr() if n else addr(NO_TOKENS)), n, t
        arr = _small_tensor(t)
        if arr is not None:
            return addr(arr), n, arr
    arr = tokens(t, what)
    return addr(arr if arr.size else NO_TOKENS), arr.size, arr


def batch_len(prompts: Any, what: str = "prompts") -> int:
    """len(prompts), refusing what has no length (None, a number) by name."""
    try:
        return len(prompts)
    except TypeError:
        raise bad_type(f"{what} must be a list of token sequences or a 2-D array, not {type(prompts).__name__}") from None


def flatten(prompts: Any) -> Tuple[np.ndarray, np.ndarray]:
    """(tokens, offsets[n+1]) of a batch of prompts: a list of token
    sequences, or a 2-D array of equal-length prompts. One int32 prompt
    or a 2-D int32 array is used in place."""
    batch_len(prompts)
    if (type(prompts) is _ndarray or _is_torch(prompts)) and len(prompts.shape) == 2:
        n, k = prompts.shape
        if _tensor(prompts):  # numpy's view of it reshapes for a tenth of torch's cost
            prompts = (prompts.detach() if prompts.requires_grad else prompts).numpy()
        flat = tokens(prompts.reshape(-1), "prompts")
        return (flat if flat.size else NO_TOKENS), np.arange(n + 1, dtype=np.int64) * k
    if len(prompts) == 1:
        a = tokens(prompts[0], "prompt 0")
        return (a if a.size else NO_TOKENS), np.array((0, a.size), np.int64)
    first = type(prompts[0]) if len(prompts) else None
    if type(prompts) is list and (first is list or first is _ndarray):
        got = _flat_lists(prompts) if first is list else _flat_arrays(prompts)
        if got is not None:
            return got
    arrs = [tokens(p, f"prompt {i}") for i, p in enumerate(prompts)]
    offsets = np.zeros(len(arrs) + 1, np.int64)
    np.cumsum([a.size for a in arrs], out=offsets[1:])
    toks = np.concatenate(arrs) if arrs else NO_TOKENS
    return (toks if toks.size else NO_TOKENS), offsets


def _offsets(lens: List[int]) -> np.ndarray:
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return offsets


def _flat_lists(prompts: List[Any]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """flatten of a list of lists of ints, each list converted by array.array
    into one array; None when a prompt is not a list, none has tokens, or a
    token is not an int32 int: the per-prompt path converts or refuses
    those as before."""
    flat = array.array("i")
    lens = []
    try:
        for p in prompts:
            if type(p) is not list or p and type(p[0]) is bool:
                return None
            flat.extend(array.array("i", p))  # a list through extend would take the slower iterator path
            lens.append(len(p))
    except (TypeError, OverflowError):
        return None
    if not flat:
        return None
    return np.frombuffer(flat, _I32), _offsets(lens)


def _flat_arrays(prompts: List[Any]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """flatten of a list of 1-D integer arrays in one np.concatenate; None
    when that fails, or gives no tokens, no 1-D integer array or values
    beyond int32: the per-prompt path converts or refuses those."""
    try:
        lens = list(map(len, prompts))
        flat = np.concatenate(prompts)
    except (TypeError, ValueError):
        return None
    if flat.ndim != 1 or not flat.size or flat.dtype.kind not in "iu":
        return None
    if flat.dtype != _I32:
        if _min(flat) < -(2**31) or _max(flat) > _INT32_MAX:
            return None
        flat = flat.astype(np.int32)
    return flat, _offsets(lens)


def one_each(lists: List[Any]) -> Optional[np.ndarray]:
    """The tokens of a decode step given as one list of one token per
    sequence ([[t] for t in toks]) as an int32 array, without numpy's
    conversion of each list; None when an element is not a list of one
    int32 int (flatten then takes it)."""
    try:
        flat = [t for p in lists if p.__class__ is list for (t,) in (p,)]  # ValueError unless one each
    except ValueError:
        return None
    a = ints(flat, "i") if len(flat) == len(lists) else None  # shorter: not every element a list
    return None if a is None else np.frombuffer(a, _I32)
