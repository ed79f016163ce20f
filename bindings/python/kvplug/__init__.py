"""kvplug: the Python bindings of libkvplug, a KV cache manager (and attention
kernels) for LLM serving engines.

    import kvplug
    with kvplug.Manager(num_blocks=1024, block_size=16) as m:
        m.add(1, prompt_len=100)
        m.grow([1], 1)
        table, lens, slots = m.describe([1])

The library is loaded on first use: from $KVPLUG_LIBRARY, else from
libkvplug.so inside this package (put there by `pip install`). Failed calls
raise a KvplugError subclass carrying the library's message; a failed call
changes nothing.
"""

from ._lib import (
    LOG_DEBUG,
    LOG_ERROR,
    LOG_INFO,
    LOG_OFF,
    LOG_WARN,
    ArgumentTypeError,
    BufferTooSmallError,
    CudaError,
    DuplicateSequenceError,
    InternalError,
    InvalidArgumentError,
    InvalidHandleError,
    InUseError,
    KvplugError,
    LibraryLoadError,
    NoDeviceError,
    NotFoundError,
    NullPointerError,
    OutOfBlocksError,
    OutOfMemoryError,
    PromptTooLongError,
    Status,
    StructSizeError,
    UnknownSequenceError,
    UnsupportedError,
    as_ptr,
    enable_logging,
    library_path,
    set_log_level,
    set_logger,
    version,
    version_string,
)
from .manager import Description, LayerGroup, Manager, ManagerStats
from .prefix import BlockMatch, Keys, KVEvent, Match, MMItem, PrefixStats
from .tier import CopyBatch, TierMatch, TierStats
from .tiercopy import TierCopier
from .events import EventPublisher, EventPublisherStats  # noqa: F401 (KV events on ZMQ)
from .vmem import VirtualKVCache
from . import attn
from . import cascade  # noqa: F401 (shared-prefix decode attention)

__version__ = "0.7.0"

__all__ = [
    "attn",
    "VirtualKVCache",
    "Manager",
    "LayerGroup",
    "ManagerStats",
    "Description",
    "Keys",
    "MMItem",
    "Match",
    "BlockMatch",
    "PrefixStats",
    "KVEvent",
    "CopyBatch",
    "TierMatch",
    "TierStats",
    "TierCopier",
    "Status",
    "KvplugError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "PromptTooLongError",
    "NullPointerError",
    "StructSizeError",
    "InvalidHandleError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "OutOfBlocksError",
    "BufferTooSmallError",
    "NoDeviceError",
    "CudaError",
    "UnsupportedError",
    "OutOfMemoryError",
    "NotFoundError",
    "InternalError",
    "InUseError",
    "LibraryLoadError",
    "as_ptr",
    "version",
    "version_string",
    "library_path",
    "set_logger",
    "set_log_level",
    "enable_logging",
    "LOG_DEBUG",
    "LOG_INFO",
    "LOG_WARN",
    "LOG_ERROR",
    "LOG_OFF",
]
