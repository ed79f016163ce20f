"""Loading of libkvplug, the bound C functions, status-to-exception mapping,
buffer helpers and the log hook. Every module of the package reaches the C
library through here:

    from ._lib import C
    st = C.kvp_manager_add(handle, 7, 100)
    if st:
        _lib.raise_status(st)      # or _lib.check(st)

C holds every function of include/kvplug.h, bound once (name, restype,
argtypes from kvplug._capi.FUNCTIONS) when the library loads. The library is
loaded on first use, from the KVPLUG_LIBRARY environment variable if set,
else from libkvplug.so next to this file (where `pip install` puts it). It is
never unloaded: it contains a Go runtime.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import operator
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, TypeVar

from . import _capi

_LIB_NAME = "libkvplug.so"
_ENV_VAR = "KVPLUG_LIBRARY"


# --------------------------------------------------------------------------
# Status codes and exceptions
# --------------------------------------------------------------------------


class Status(enum.IntEnum):
    """enum kvp_status of include/kvplug.h."""

    OK = 0
    INVALID_ARGUMENT = 1
    NULL_POINTER = 2
    STRUCT_SIZE = 3
    INVALID_HANDLE = 4
    UNKNOWN_SEQUENCE = 5
    DUPLICATE_SEQUENCE = 6
    OUT_OF_BLOCKS = 7
    BUFFER_TOO_SMALL = 8
    NO_DEVICE = 9
    CUDA = 10
    UNSUPPORTED = 11
    OUT_OF_MEMORY = 12
    NOT_FOUND = 13
    INTERNAL = 14
    IN_USE = 15


class KvplugError(Exception):
    """A kvplug call failed. `status` is the kvp_status code (an int: codes
    added by a newer library stay representable), `str(err)` the library's
    message (kvp_last_error())."""

    status: int = -1

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = int(status)
        self.message = message

    @property
    def status_name(self) -> str:
        try:
            return "KVP_ERR_" + Status(self.status).name if self.status else "KVP_OK"
        except ValueError:
            return f"kvp_status({self.status})"

    def __str__(self) -> str:
        # KeyError (a base of UnknownSequenceError) would quote the message.
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, status={self.status_name})"

    def __reduce__(self):  # picklable across processes despite the extra argument
        return (type(self), (self.message, self.status))


# The builtin bases let callers catch errors the Python way (ValueError for a
# bad argument, KeyError for an unknown id) without knowing kvplug's classes.
class InvalidArgumentError(KvplugError, ValueError):
    status = Status.INVALID_ARGUMENT


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of a type the call does not take (None for an array, a
    float array for token ids, ...): also a TypeError, as Python's own
    checks raise, and an InvalidArgumentError, as the library would say."""


class PromptTooLongError(InvalidArgumentError):
    """A prompt needs more blocks than the whole pool holds: no eviction or
    wait can ever admit it (unlike OutOfBlocksError, which is "not now")."""


class NullPointerError(KvplugError, ValueError):
    status = Status.NULL_POINTER


class StructSizeError(KvplugError, ValueError):
    status = Status.STRUCT_SIZE


class InvalidHandleError(KvplugError, ValueError):
    """A closed (or never opened) object was used."""

    status = Status.INVALID_HANDLE


class UnknownSequenceError(KvplugError, KeyError):
    status = Status.UNKNOWN_SEQUENCE


class DuplicateSequenceError(KvplugError, ValueError):
    status = Status.DUPLICATE_SEQUENCE


class OutOfBlocksError(KvplugError):
    """Too few free blocks; nothing changed. An expected answer under load:
    the scheduler preempts and retries."""

    status = Status.OUT_OF_BLOCKS


class BufferTooSmallError(KvplugError, ValueError):
    status = Status.BUFFER_TOO_SMALL


class NoDeviceError(KvplugError):
    status = Status.NO_DEVICE


class CudaError(KvplugError):
    status = Status.CUDA


class UnsupportedError(KvplugError):
    status = Status.UNSUPPORTED


class OutOfMemoryError(KvplugError):
    status = Status.OUT_OF_MEMORY


class NotFoundError(KvplugError, LookupError):
    status = Status.NOT_FOUND


class InternalError(KvplugError, RuntimeError):
    """A bug in kvplug (a recovered panic or a broken invariant)."""

    status = Status.INTERNAL


class InUseError(KvplugError):
    """The call would take state that another live sequence still uses;
    nothing changed."""

    status = Status.IN_USE


_ERRORS: Dict[int, type] = {
    int(cls.status): cls
    for cls in (
        InvalidArgumentError,
        NullPointerError,
        StructSizeError,
        InvalidHandleError,
        UnknownSequenceError,
        DuplicateSequenceError,
        OutOfBlocksError,
        BufferTooSmallError,
        NoDeviceError,
        CudaError,
        UnsupportedError,
        OutOfMemoryError,
        NotFoundError,
        InternalError,
        InUseError,
    )
}


class LibraryLoadError(OSError):
    """libkvplug.so could not be loaded, or lacks a function the bindings
    need (a library older than the bindings)."""


def error_for(status: int, message: str) -> KvplugError:
    """The exception for a non-zero status (KvplugError for unknown codes)."""
    cls = _ERRORS.get(int(status), KvplugError)
    return cls(message, int(status))


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

# --------------------------------------------------------------------------
# Integers crossing into C
# --------------------------------------------------------------------------

# ctypes converts an out-of-range Python int by wrapping it (2**64 becomes 0)
# and a float or a numpy float by truncating or refusing with its own error;
# every integer the bindings pass to a C function goes through checked_int
# first, so a bad value is an InvalidArgumentError naming the argument.
C_INT_RANGES: Dict[str, Tuple[int, int]] = {
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
}


def _bound(v: int) -> str:
    """v as a power of two where it is one (2^31, -2^63, 2^64-1), else decimal."""
    for sign, base in ((1, v), (-1, -v)):
        for off, suffix in ((0, ""), (1, "-1")):
            b = base + off
            if b > 1 and b & (b - 1) == 0 and b >= 1 << 10:
                return f"{'-' if sign < 0 else ''}2^{b.bit_length() - 1}{suffix}"
    return str(v)


def checked_int(value: Any, what: str, ctype: str = "int64", lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """value as a Python int that fits the C type `ctype` ("int32",
    "int64", "uint32", "uint64") and lies in [lo, hi] where given. Python
    and numpy integers are accepted; bool, float, str and anything else
    without __index__ are not. Raises InvalidArgumentError naming `what`."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ArgumentTypeError(f"{what} must be an integer: got {type(value).__name__} {value!r}",
                                Status.INVALID_ARGUMENT)
    try:
        v = operator.index(value)
    except TypeError:  # a float tensor, or one of several elements: torch's __index__ refuses them
        raise ArgumentTypeError(f"{what} must be an integer: got {type(value).__name__} {value!r}",
                                Status.INVALID_ARGUMENT) from None
    tlo, thi = C_INT_RANGES[ctype]
    lo = tlo if lo is None else max(lo, tlo)
    hi = thi if hi is None else min(hi, thi)
    if not lo <= v <= hi:
        raise InvalidArgumentError(f"{what} must be in [{_bound(lo)}, {_bound(hi)}]: got {v}", Status.INVALID_ARGUMENT)
    return v


def c_string(value: Optional[str], what: str) -> Optional[bytes]:
    """value as the bytes of a config struct's char * field: None is NULL.
    A NUL inside would cut the string short in C, so it is refused."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{what} must be a str or None, not {type(value).__name__}", Status.INVALID_ARGUMENT)
    b = value.encode("utf-8")
    if b"\x00" in b:
        raise InvalidArgumentError(f"{what} contains a NUL character", Status.INVALID_ARGUMENT)
    return b


_load_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None
_fns: Dict[Tuple[Any, ...], Any] = {}


class _Functions:
    """Every function of include/kvplug.h as an attribute (C.kvp_manager_add),
    bound once from kvplug._capi.FUNCTIONS when the library loads. Before
    that, the first attribute read loads the library; a function the library
    lacks raises LibraryLoadError when it is read (the others still work)."""

    def __getattr__(self, name: str) -> Any:
        # Reached only for names not bound (yet): see _bind.
        if name not in _capi.FUNCTIONS:
            raise AttributeError(f"kvplug: {name} is not a function of include/kvplug.h")
        library()
        f = self.__dict__.get(name)
        if f is None:
            raise LibraryLoadError(
                f"kvplug: {_lib_path} has no function {name} (a library older than these bindings?)"
            )
        return f


C = _Functions()


def _bind(lib: ctypes.CDLL) -> Dict[str, Any]:
    """lib's functions of the table, each with its signature."""
    bound = {}
    for name, (restype, argtypes) in _capi.FUNCTIONS.items():
        try:
            f = lib[name]  # a fresh function object: fn()'s signatures never clash with the table's
        except AttributeError:
            continue
        f.restype = restype
        f.argtypes = argtypes
        bound[name] = f
    return bound


def _candidate() -> Tuple[str, str]:
    env = os.environ.get(_ENV_VAR)
    if env:
        return env, f"{_ENV_VAR}={env}"
    path = str(Path(__file__).resolve().parent / _LIB_NAME)
    return path, f"the package directory ({path})"


def library() -> ctypes.CDLL:
    """The loaded library, loading it on first use."""
    lib = _lib
    if lib is not None:
        return lib
    return _load()


def _load() -> ctypes.CDLL:
    global _lib, _lib_path
    with _load_lock:
        if _lib is not None:
            return _lib
        path, where = _candidate()
        if not os.path.exists(path):
            raise LibraryLoadError(
                f"kvplug: {_LIB_NAME} not found: looked in {where}. Build it with `make` in the "
                f"kvplug repository and set {_ENV_VAR} to build/{_LIB_NAME}, or install the package "
                "with `pip install ./bindings/python`, which builds it into the package."
            )
        try:
            lib = ctypes.CDLL(path)  # never closed: a Go runtime cannot be unloaded
        except OSError as e:
            raise LibraryLoadError(f"kvplug: cannot load {path} (from {where}): {e}") from e
        bound = _bind(lib)
        if "kvp_last_error" not in bound or "kvp_version" not in bound:
            raise LibraryLoadError(f"kvplug: {path} is not libkvplug (no kvp_last_error/kvp_version)")
        major = bound["kvp_version"]() // 10000
        if major != _ABI_MAJOR:
            raise LibraryLoadError(
                f"kvplug: {path} has ABI version {major}.x; these bindings need {_ABI_MAJOR}.x"
            )
        C.__dict__.update(bound)
        _lib_path = path
        _lib = lib  # last: a thread that sees the library sees C bound
        return lib


_ABI_MAJOR = 0  # KVP_VERSION_MAJOR of the header these bindings follow


def library_path() -> str:
    """The path the library was loaded from (loading it if needed)."""
    library()
    assert _lib_path is not None
    return _lib_path


def fn(name: str, restype: Any, argtypes: Sequence[Any]) -> Any:
    """The library function `name` with the given signature, bound once and
    cached, for callers that want another signature than C's (tests passing
    raw pointers, say); the package itself calls through C. Raises
    LibraryLoadError if the library lacks it."""
    key = (name, restype, tuple(argtypes))
    f = _fns.get(key)
    if f is not None:
        return f
    lib = library()
    try:
        f = lib[name]
    except AttributeError as e:
        raise LibraryLoadError(
            f"kvplug: {_lib_path} has no function {name} (a library older than these bindings?)"
        ) from e
    f.restype = restype
    f.argtypes = list(argtypes)
    _fns[key] = f
    return f


def last_error() -> str:
    """The calling thread's kvp_last_error() message."""
    raw = C.kvp_last_error()
    return raw.decode("utf-8", "replace") if raw else ""


def raise_status(status: int) -> None:
    """Raises the exception for a non-zero status with the calling thread's
    kvp_last_error() message. Call it on the thread that made the failing
    call, right after it."""
    raise error_for(status, last_error())


def check(status: int) -> None:
    """Raises for a non-zero kvp_status; returns None for KVP_OK."""
    if status:
        raise error_for(status, last_error())


def version() -> Tuple[int, int, int]:
    """The loaded library's version as (major, minor, patch)."""
    v = C.kvp_version()
    return v // 10000, v // 100 % 100, v % 100


def version_string() -> str:
    return C.kvp_version_string().decode()


def live_handles() -> int:
    """The library's count of live handles of every type (managers, caches):
    for leak checks."""
    n = ctypes.c_int64()
    check(C.kvp_live_handles(ctypes.byref(n)))
    return n.value


# --------------------------------------------------------------------------
# Objects owning a handle
# --------------------------------------------------------------------------

_O = TypeVar("_O", bound="Owner")


class Lease:
    """What every array or tensor viewing memory that an Owner's handle owns
    holds on to (the ctypes buffer at the base of a numpy view, the context
    of a DLPack capsule): numpy and torch read such memory without asking,
    so nothing but the handle's survival can keep a read of it valid. A
    lease keeps its owner alive, and an owner closed while a lease lives
    destroys its handle when the lease goes."""

    __slots__ = ("owner", "__weakref__")

    def __init__(self, owner: "Owner") -> None:
        self.owner = owner


class Owner:
    """An object that owns a library handle (self._h, None once closed):
    close() or a with block destroys it with the C function named by
    _destroy; a finalizer (set by _own) destroys it when the object is
    collected without close(), seeing only the handle, never the object.
    Not at interpreter exit: the process is ending and modules may be half
    torn down.

    Views of the handle's memory hold the owner's lease (_lease()): close()
    then makes the object unusable at once, and destroys the handle when
    the last view is gone."""

    _h: Optional[int] = None
    _destroy = ""
    _lease_ref: Optional["weakref.ReferenceType[Lease]"] = None

    def _own(self, handle: int, release: Callable[..., None], *args: Any) -> None:
        self._h = handle
        self._finalizer = weakref.finalize(self, release, *args)
        self._finalizer.atexit = False

    @property
    def closed(self) -> bool:
        return self._h is None

    def _lease(self) -> Lease:
        """The lease that a new view of the handle's memory must hold (one
        per owner, shared by its views; made again once they are all gone)."""
        lease = self._lease_ref() if self._lease_ref is not None else None
        if lease is None:
            lease = Lease(self)
            self._lease_ref = weakref.ref(lease)
        return lease

    def close(self) -> None:
        h, self._h = self._h, None
        if h is None:
            return
        self._finalizer.detach()
        destroy = getattr(C, self._destroy)
        lease = self._lease_ref() if self._lease_ref is not None else None
        if lease is None:
            destroy(h)
        else:
            # An array still views the handle's memory: freeing it now would
            # turn that array's reads into reads of freed (or unmapped)
            # memory. Not at interpreter exit either: a view may still be
            # read by code that runs later in the shutdown.
            later = weakref.finalize(lease, destroy, h)
            later.atexit = False

    def __enter__(self: _O) -> _O:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------

# ctypes type -> (numpy dtype str, torch dtype name)
_CTYPE_INFO: Dict[Any, Tuple[str, str]] = {
    ctypes.c_int8: ("i1", "torch.int8"),
    ctypes.c_uint8: ("u1", "torch.uint8"),
    ctypes.c_int16: ("i2", "torch.int16"),
    ctypes.c_uint16: ("u2", "torch.uint16"),
    ctypes.c_int32: ("i4", "torch.int32"),
    ctypes.c_uint32: ("u4", "torch.uint32"),
    ctypes.c_int64: ("i8", "torch.int64"),
    ctypes.c_uint64: ("u8", "torch.uint64"),
    ctypes.c_float: ("f4", "torch.float32"),
    ctypes.c_double: ("f8", "torch.float64"),
}

_np: Any = None


def _numpy() -> Any:
    global _np
    if _np is None:
        import numpy

        _np = numpy
    return _np


def _is_torch_tensor(obj: Any) -> bool:
    # Never imports torch: a torch tensor's class lives in a torch module.
    mod = type(obj).__module__
    return (mod == "torch" or mod.startswith("torch.")) and hasattr(obj, "data_ptr")


def as_ptr(obj: Any, ctype: Any, writable: bool = False, min_count: int = 0, what: str = "") -> Tuple[int, int]:
    """The address and element count of obj's memory, without copying.

    obj is a numpy array, a torch CPU (or pinned) tensor, or any object with
    the buffer protocol (memoryview, array.array, bytearray, ...). It must be
    C-contiguous, hold elements of ctype (ctypes.c_int32, ...; None accepts
    any element type and counts bytes), be writable if `writable`, and hold at
    least min_count elements. The address is valid while obj is alive and not
    resized: keep obj referenced across the call that uses it. `what` names
    the argument in the messages.

    Raises ArgumentTypeError (a TypeError: unsupported object or element
    type), InvalidArgumentError (a ValueError: not contiguous, read-only,
    torch tensor not on the CPU) or BufferTooSmallError (a ValueError)."""
    name = f"kvplug: {what}: " if what else "kvplug: "
    np = _numpy()
    if isinstance(obj, np.ndarray):
        return _ndarray_ptr(obj, ctype, writable, min_count, name)
    if _is_torch_tensor(obj):
        return _torch_ptr(obj, ctype, min_count, name)
    try:
        view = memoryview(obj)
    except TypeError:
        raise _type_error(f"{name}expected a numpy array, a torch CPU tensor or a buffer, got {type(obj).__name__}") from None
    if not view.c_contiguous:
        raise _value_error(f"{name}the buffer must be C-contiguous")
    if writable and view.readonly:
        raise _value_error(f"{name}the buffer is read-only; an output buffer must be writable")
    if ctype is not None:
        want = np.dtype(_CTYPE_INFO[ctype][0]) if ctype in _CTYPE_INFO else None
        try:
            got = np.dtype(view.format.lstrip("@=<"))
        except TypeError:
            got = None
        if want is None or got is None or got.kind != want.kind or view.itemsize != want.itemsize:
            raise _type_error(
                f"{name}buffer of format {view.format!r} (itemsize {view.itemsize}); "
                f"expected {want.name if want is not None else getattr(ctype, '__name__', ctype)}"
            )
        count = view.nbytes // view.itemsize
    else:
        count = view.nbytes
    if count < min_count:
        raise _too_small(f"{name}buffer holds {count} elements, {min_count} needed")
    if not view.nbytes:
        return 0, 0
    # numpy reads the address of read-only buffers too (ctypes.from_buffer
    # accepts only writable ones). The view keeps obj's export only as long
    # as it lives; the caller keeps obj itself alive.
    return np.frombuffer(view, dtype=np.uint8).ctypes.data, count


def _type_error(msg: str) -> ArgumentTypeError:
    return ArgumentTypeError(msg, Status.INVALID_ARGUMENT)


def _value_error(msg: str) -> InvalidArgumentError:
    return InvalidArgumentError(msg, Status.INVALID_ARGUMENT)


def _too_small(msg: str) -> BufferTooSmallError:
    return BufferTooSmallError(msg, Status.BUFFER_TOO_SMALL)


def _ndarray_ptr(arr: Any, ctype: Any, writable: bool, min_count: int, name: str) -> Tuple[int, int]:
    if ctype is not None:
        code = _CTYPE_INFO.get(ctype)
        if code is None or arr.dtype != _numpy().dtype(code[0]):
            want = _numpy().dtype(code[0]).name if code else getattr(ctype, "__name__", ctype)
            raise _type_error(f"{name}array of dtype {arr.dtype}; expected {want}")
        count = arr.size
    else:
        count = arr.nbytes
    if not arr.flags.c_contiguous:
        raise _value_error(f"{name}the array must be C-contiguous (use numpy.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise _value_error(f"{name}the array is read-only; an output array must be writable")
    if count < min_count:
        raise _too_small(f"{name}array holds {count} elements, {min_count} needed")
    return arr.ctypes.data, count


def _torch_ptr(t: Any, ctype: Any, min_count: int, name: str) -> Tuple[int, int]:
    if t.device.type != "cpu":
        raise _value_error(f"{name}a host buffer is needed; the tensor is on {t.device}")
    if not t.is_contiguous():
        raise _value_error(f"{name}the tensor must be contiguous (use .contiguous())")
    if ctype is not None:
        code = _CTYPE_INFO.get(ctype)
        if code is None or str(t.dtype) != code[1]:
            raise _type_error(f"{name}tensor of dtype {t.dtype}; expected {code[1] if code else ctype}")
        count = t.numel()
    else:
        count = t.numel() * t.element_size()
    if count < min_count:
        raise _too_small(f"{name}tensor holds {count} elements, {min_count} needed")
    return t.data_ptr(), count


# --------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------

LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR, LOG_OFF = 0, 1, 2, 3, 4

_LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)
_TO_PY_LEVEL = {LOG_DEBUG: logging.DEBUG, LOG_INFO: logging.INFO, LOG_WARN: logging.WARNING, LOG_ERROR: logging.ERROR}
_FROM_PY_LEVEL = ((logging.ERROR, LOG_ERROR), (logging.WARNING, LOG_WARN), (logging.INFO, LOG_INFO))

# The installed callback: ctypes frees the C thunk with this object, so it
# must stay referenced while the library may call it.
_log_thunk: Any = None
# Marks a thread that runs the callback: set_logger from there would free
# the thunk that is running.
_in_callback = threading.local()


def set_logger(callback: Optional[Callable[[int, str], None]], level: int = LOG_INFO) -> None:
    """Routes the library's log lines to callback(level, message) (level is
    LOG_DEBUG..LOG_ERROR), for lines at `level` or above; None silences the
    library (its default). The callback may run on any thread, including
    the library's own, and must not call into kvplug (calls on kvplug
    objects from it raise UnsupportedError; set_logger raises RuntimeError).

    Raises ArgumentTypeError (a TypeError) at once for a callback that is
    not callable."""
    global _log_thunk
    if callback is not None and not callable(callback):
        raise _type_error(f"kvplug: set_logger: callback must be callable(level, message) or None: got {type(callback).__name__}")
    if getattr(_in_callback, "depth", 0):
        raise RuntimeError("kvplug: set_logger called from inside the log callback; the callback must not call into kvplug")
    set_fn = C.kvp_set_logger
    if callback is None:
        check(set_fn(None, None, int(level)))
        _log_thunk = None
        return

    def thunk(_user: Any, lvl: int, msg: bytes) -> None:
        _in_callback.depth = getattr(_in_callback, "depth", 0) + 1
        try:
            callback(lvl, msg.decode("utf-8", "replace") if msg else "")
        except Exception:  # an exception cannot cross into the library
            logging.getLogger("kvplug").exception("kvplug log callback failed")
        finally:
            _in_callback.depth -= 1

    new = _LOG_FN(thunk)
    check(set_fn(ctypes.cast(new, ctypes.c_void_p), None, int(level)))
    # Replaced only after the library switched over, so a concurrent line
    # never reaches a freed thunk.
    _log_thunk = new


def set_log_level(level: int) -> None:
    """Changes the minimum level delivered (LOG_DEBUG..LOG_OFF)."""
    check(C.kvp_set_log_level(int(level)))


def enable_logging(logger: Optional[logging.Logger] = None, level: Optional[int] = None) -> None:
    """Sends the library's log lines to a `logging` logger (default: the
    "kvplug" logger) at the matching levels. `level` is a logging level; by
    default the logger's effective level."""
    log = logger or logging.getLogger("kvplug")
    py_level = log.getEffectiveLevel() if level is None else level
    kvp_level = LOG_DEBUG
    for threshold, lvl in _FROM_PY_LEVEL:
        if py_level >= threshold:
            kvp_level = lvl
            break

    def to_logging(lvl: int, msg: str) -> None:
        log.log(_TO_PY_LEVEL.get(lvl, logging.ERROR), "%s", msg)

    set_logger(to_logging, kvp_level)
