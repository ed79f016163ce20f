"""The paged KV manager (kvp_manager of include/kvplug.h).

A scheduler step through the fast path, with arrays it allocates once:

    ids = np.array([...], np.int64)              # the running batch
    table = np.empty((len(ids), max_blocks), np.int32)
    lens = np.empty(len(ids), np.int32)
    slots = np.empty(len(ids), np.int32)
    m.grow(ids, 1)                               # one decode token each
    n = m.describe_into(ids, table, lens, slots) # slots[:n] are this step's

Every method is one C call (describe without `out`, two); a failed call
raises a kvplug.KvplugError subclass and changes nothing.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import numbers
import warnings
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _lib
from ._arrays import _I32, _I64, bad as _bad, bad_type as _bad_type, in_ptr as _in_ptr, out_ptr as _out_ptr
from ._capi import BlockCopy, LayerGroupStruct, ManagerConfig, ManagerStatsStruct
from ._lib import C
from .prefix import PrefixCacheMethods
from .sharedstore import _SECURITY_FIELDS, _security
from .tier import HostTierMethods

__all__ = ["Manager", "ManagerStats", "Description", "ManagerConfig", "ManagerStatsStruct", "BlockCopy", "LayerGroup"]

_vp = ctypes.c_void_p
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_INT32_MAX = 2**31 - 1
_ndarray = np.ndarray
_addressof = ctypes.addressof

IntArray = Union[Sequence[int], np.ndarray, Any]  # Any: buffers and torch tensors


class LayerGroup(NamedTuple):
    """One layer group of a hybrid model (kvp_layer_group; see "Layer
    groups" in include/kvplug.h). Make them with full_attention(),
    sliding_window(w) and recurrent(state_bytes)."""

    kind: int  # FULL_ATTENTION, SLIDING_WINDOW or RECURRENT
    window: int = 0  # sliding window: the tokens a query reads, itself included
    state_bytes: int = 0  # recurrent: one layer's state in bytes
    checkpoint_every: int = 0  # recurrent with the prefix cache: keep the state every this many blocks

    FULL_ATTENTION = 0
    SLIDING_WINDOW = 1
    RECURRENT = 2

    @classmethod
    def full_attention(cls) -> "LayerGroup":
        return cls(cls.FULL_ATTENTION)

    @classmethod
    def sliding_window(cls, window: int) -> "LayerGroup":
        return cls(cls.SLIDING_WINDOW, window=window)

    @classmethod
    def recurrent(cls, state_bytes: int, checkpoint_every: int = 0) -> "LayerGroup":
        """checkpoint_every (blocks) is required with the prefix cache: see
        Manager.take_copies."""
        return cls(cls.RECURRENT, state_bytes=state_bytes, checkpoint_every=checkpoint_every)


@dataclasses.dataclass(frozen=True)
class ManagerStats:
    """Pool and fragmentation figures at the time of Manager.stats()."""

    num_blocks: int  # pool size
    block_size: int  # tokens per block
    free_blocks: int  # in the free queue
    used_blocks: int  # referenced by at least one sequence
    peak_used_blocks: int  # highest used_blocks since creation
    cached_blocks: int  # unreferenced blocks kept by the prefix cache
    shared_blocks: int  # referenced by more than one sequence
    num_seqs: int  # live sequences
    num_tokens: int  # tokens over all live sequences
    allocated_slots: int  # used_blocks * block_size
    internal_waste: int  # empty slots in partially filled last blocks
    fragmentation: float  # internal_waste / allocated_slots (0 when none)


class Description(NamedTuple):
    """Manager.describe's result, in batch order."""

    block_table: np.ndarray  # int32 [n, max_blocks], rows padded with -1
    seq_lens: np.ndarray  # int32 [n]
    slot_mapping: np.ndarray  # int32 [num_slots]: slots of the batch's new tokens


_int = _lib.checked_int


def _scalar(obj: Any) -> bool:
    """Whether obj is meant as one number (checked as an integer) rather than
    an array (numpy, torch, a sequence, a buffer): a 0-d numpy array or
    torch tensor is one number too, as numpy's integer scalars are."""
    return isinstance(obj, (numbers.Number, str, bytes)) or getattr(obj, "ndim", None) == 0


def _closed(what: str) -> _lib.InvalidHandleError:
    return _lib.InvalidHandleError(f"{what}: the Manager is closed", _lib.Status.INVALID_HANDLE)


def _shared_tier_address(addr: Optional[str]) -> None:
    """Refuses a shared_tier that is not "host:port" (the library would
    accept it and count every lookup as an unreachable server)."""
    if addr is None or not isinstance(addr, str):
        return  # None: no shared tier; another type: c_string says so
    host, sep, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # an IPv6 address
    elif ":" in host:
        host = ""  # an IPv6 address must be bracketed
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536) or any(c.isspace() for c in addr):
        raise _bad(f'Manager: shared_tier must be "host:port" (a Valkey or Redis server, e.g. "127.0.0.1:6379"; '
                   f'"[::1]:6379" for IPv6): got {addr!r}')


def _release(handle: int) -> None:
    """Destroys a manager collected without close(), saying so when it still
    had live sequences. Holds no reference to the Manager (a finalizer
    must not)."""
    s = ManagerStatsStruct()
    s.struct_size = ctypes.sizeof(ManagerStatsStruct)
    live = s.num_seqs if C.kvp_manager_stats_get(handle, ctypes.byref(s)) == 0 else 0
    C.kvp_manager_destroy(handle)
    if live:
        seqs = "1 live sequence" if live == 1 else f"{live} live sequences"
        msg = (f"kvplug: a Manager was collected with {seqs} and has been closed; "
               "call close() or use it in a with block")
        warnings.warn(msg, ResourceWarning, stacklevel=2)
        logging.getLogger("kvplug").warning("%s", msg)


def _host_memory(mem: Any, slots: int, block_bytes: int) -> Optional[int]:
    """The address of host_tier_memory (None: the library allocates), after
    checking it is a C-contiguous byte region of slots * block_bytes."""
    if mem is None:
        return None
    nbytes = slots * block_bytes
    if hasattr(mem, "data_ptr") and hasattr(mem, "is_cuda"):  # a torch tensor
        if mem.is_cuda or not mem.is_contiguous():
            raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), "Manager: host_tier_memory must be a contiguous CPU tensor")
        # Bytes, as host_tier_memory() gives them back: a float tensor of the
        # right size is more likely the engine's K/V than its tier.
        if str(mem.dtype) != "torch.uint8":
            raise _bad_type(f"Manager: host_tier_memory must be a torch.uint8 tensor: got {mem.dtype} "
                            "(.view(torch.uint8) gives the bytes of another)")
        addr, size = mem.data_ptr(), mem.numel() * mem.element_size()
    elif isinstance(mem, np.ndarray):
        if not mem.flags.c_contiguous or not mem.flags.writeable:
            raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT), "Manager: host_tier_memory must be a writable C-contiguous array")
        if mem.dtype != np.uint8:
            raise _bad_type(f"Manager: host_tier_memory must be a uint8 array: got {mem.dtype} "
                            "(.view(np.uint8) gives the bytes of another)")
        addr, size = mem.ctypes.data, mem.nbytes
    else:
        raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT),
                             f"Manager: host_tier_memory must be a numpy array or a CPU torch tensor, not {type(mem).__name__}")
    if size != nbytes:
        raise _lib.error_for(int(_lib.Status.INVALID_ARGUMENT),
                             f"Manager: host_tier_memory has {size} bytes; host_tier_slots * host_block_bytes = {nbytes}")
    return addr


class Manager(PrefixCacheMethods, HostTierMethods, _lib.Owner):
    """A pool of num_blocks KV blocks of block_size tokens and the block
    tables of the live sequences. Safe to call from several threads (the
    library serialises calls on one manager), except close(), which no
    other thread may race with.

    prefix_cache=True keeps the full blocks of sequences admitted by their
    tokens (admit, grow_tokens) for later prompts with the same prefix;
    kv_events=True records KV events for drain_events (kvplug.prefix); with
    layer_groups, every group's, which drain_group_events returns.

    host_tier_slots > 0 (with prefix_cache) adds the host KV tier
    (kvplug.tier): that many host slots of host_block_bytes each (the
    engine's K/V bytes of one block, all layers, K and V), allocated by the
    library, or host_tier_memory: the engine's own (a C-contiguous uint8
    numpy array or CPU torch tensor of host_tier_slots * host_block_bytes
    bytes, 16-byte aligned, e.g. torch's pinned memory; the Manager keeps
    it referenced); flush_copies keeps demote_ahead blocks free or being
    demoted.
    demote_evicted=True also demotes the cached blocks that allocations
    evict (in the next flush_copies batch, their GPU blocks going to their
    new owners at once): only for an engine that calls flush_copies after
    a step's last allocation and copies the batch's demotions on the
    step's stream before anything that writes K/V in the step (kvplug.h,
    "Host KV tier").
    write_through=N copies instead of moving: each flush_copies hands out
    up to N computed blocks (marked so by mark_computed) as copies to the
    host tier while they stay in the GPU prefix cache, so the GPU cache
    matches what it would without the tier and a later GPU eviction costs
    nothing (use it with demote_ahead=0; kvplug.h, "Host KV tier",
    Write-through). write_through_slack=S (needs write_through; in
    [0, num_blocks]; when nonzero, at least demote_ahead, else
    InvalidArgumentError: demotion would keep the free blocks above S) holds those stores back while the pool has more than
    S free blocks (stats().free_blocks): no cached block can be evicted
    then, so a store would be wasted; the computed blocks stay queued
    (tier_stats().write_through_queue) and are stored, oldest first, once
    the free blocks fall to S. S must cover the allocations of the few
    steps the queue needs to drain, else evictions may take queued blocks
    first (tier_stats().write_through_lost). 0 stores every flush.

    shared_tier="host:port" (with a host tier) adds the shared tier below
    it, a Valkey or Redis server that instances share (kvplug.tier);
    shared_tier_namespace names the model and K/V layout the blocks belong
    to (required; 1-64 characters of [A-Za-z0-9_.-]),
    shared_tier_timeout_ms bounds each round trip (0: 250 ms) and
    shared_tier_put_queue the blocks waiting to be stored (0: 256). close()
    writes the blocks still queued first (bounded by the timeout).
    For a server others can reach (all off by default; kvplug.sharedstore's
    docstring and kvplug.h's "Shared KV tier", Security):
    shared_tier_username with shared_tier_password_env or
    shared_tier_password_file (AUTH: the names of an environment variable or
    a file holding the password, never the password),
    shared_tier_tls=True with shared_tier_tls_ca_file (None: the system's
    roots), shared_tier_tls_cert_file and shared_tier_tls_key_file (a
    client certificate) and shared_tier_tls_server_name, and
    shared_tier_mac_keys_env or shared_tier_mac_keys_file (a MAC over every
    value: one or two hex keys, the first signing). Their faults are counted
    in tier_stats().shared_auth_failures, shared_tls_failures and
    shared_mac_failures, never raised."""

    _destroy = "kvp_manager_destroy"

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        prefix_cache: bool = False,
        kv_events: bool = False,
        max_pending_events: int = 0,
        host_tier_slots: int = 0,
        host_block_bytes: int = 0,
        demote_ahead: int = 0,
        demote_evicted: bool = False,
        shared_tier: Optional[str] = None,
        shared_tier_namespace: Optional[str] = None,
        shared_tier_timeout_ms: int = 0,
        shared_tier_put_queue: int = 0,
        host_tier_memory: Any = None,
        shared_tier_username: Optional[str] = None,
        shared_tier_password_env: Optional[str] = None,
        shared_tier_password_file: Any = None,
        shared_tier_tls: bool = False,
        shared_tier_tls_ca_file: Any = None,
        shared_tier_tls_cert_file: Any = None,
        shared_tier_tls_key_file: Any = None,
        shared_tier_tls_server_name: Optional[str] = None,
        shared_tier_mac_keys_env: Optional[str] = None,
        shared_tier_mac_keys_file: Any = None,
        write_through: int = 0,
        write_through_slack: int = 0,
        layer_groups: Sequence[LayerGroup] = (),
        max_model_len: int = 0,
        block_bytes: int = 0,
    ) -> None:
        num_blocks = _int(num_blocks, "Manager: num_blocks", "int32")
        block_size = _int(block_size, "Manager: block_size", "int32")
        if block_size == 0:
            # The C config's 0 asks for the default (16); a Python caller
            # names the default by leaving the argument out, so 0 here is a
            # mistake to report, not a request for 16.
            raise _bad("Manager: block_size must be >= 1 (leave it out for 16): got 0")
        _shared_tier_address(shared_tier)
        max_pending_events = _int(max_pending_events, "Manager: max_pending_events", "int32")
        host_tier_slots = _int(host_tier_slots, "Manager: host_tier_slots", "int32")
        demote_ahead = _int(demote_ahead, "Manager: demote_ahead", "int32")
        write_through = _int(write_through, "Manager: write_through", "int32")
        write_through_slack = _int(write_through_slack, "Manager: write_through_slack", "int32")
        host_block_bytes = _int(host_block_bytes, "Manager: host_block_bytes", "int64")
        shared_tier_timeout_ms = _int(shared_tier_timeout_ms, "Manager: shared_tier_timeout_ms", "int32")
        shared_tier_put_queue = _int(shared_tier_put_queue, "Manager: shared_tier_put_queue", "int32")
        sec = _security("Manager", "shared_tier_", username=shared_tier_username, password_env=shared_tier_password_env,
                        password_file=shared_tier_password_file, tls=shared_tier_tls,
                        tls_ca_file=shared_tier_tls_ca_file, tls_cert_file=shared_tier_tls_cert_file,
                        tls_key_file=shared_tier_tls_key_file, tls_server_name=shared_tier_tls_server_name,
                        mac_keys_env=shared_tier_mac_keys_env, mac_keys_file=shared_tier_mac_keys_file)
        groups = _layer_groups(layer_groups)
        max_model_len = _int(max_model_len, "Manager: max_model_len", "int32")
        block_bytes = _int(block_bytes, "Manager: block_bytes", "int64")
        cfg = ManagerConfig(
            ctypes.sizeof(ManagerConfig), num_blocks, block_size, int(bool(prefix_cache)), int(bool(kv_events)), max_pending_events,
            host_tier_slots, demote_ahead, int(bool(demote_evicted)), host_block_bytes,
            _lib.c_string(shared_tier, "Manager: shared_tier"),
            _lib.c_string(shared_tier_namespace, "Manager: shared_tier_namespace"),
            shared_tier_timeout_ms, shared_tier_put_queue, _host_memory(host_tier_memory, host_tier_slots, host_block_bytes),
            *(sec[n] for n in _SECURITY_FIELDS), sec["tls"], 0, write_through, write_through_slack,
            ctypes.cast(groups, _vp) if len(groups) else None, len(groups), max_model_len, block_bytes,
        )
        out = _vp()
        st = C.kvp_manager_create(ctypes.byref(cfg), ctypes.byref(out))
        if st:
            _lib.raise_status(st)
        self._own(out.value, _release, out.value)
        self._host_memory = host_tier_memory  # the engine's memory stays alive with the manager
        s = ManagerStatsStruct()
        s.struct_size = ctypes.sizeof(s)
        _lib.check(C.kvp_manager_stats_get(self._h, ctypes.byref(s)))
        self.num_blocks = s.num_blocks
        self.block_size = s.block_size
        self._max_prompt = s.num_blocks * s.block_size  # the tokens the whole pool holds
        # flush_copies' array sizes, grown to what a flush asked for (a write-through batch's stores).
        self._flush_caps = (max(demote_ahead, 1), 64)
        self.demote_evicted = bool(demote_evicted)
        self.layer_groups: Tuple[LayerGroup, ...] = tuple(
            LayerGroup(g.kind, g.window, g.state_bytes, g.checkpoint_every) for g in groups) or (
            LayerGroup.full_attention(),)
        # (value, array, address) of the counts array a grow by one number
        # for all uses; replaced, never mutated, so concurrent grows are safe.
        self._fill: Tuple[int, Any, int] = (0, None, 0)

    # -- lifetime ----------------------------------------------------------

    @property
    def handle(self) -> Optional[int]:
        """The kvp_manager * as an integer (None once closed), for other
        kvplug modules' C calls."""
        return self._h

    def close(self) -> None:
        """Destroys the manager and all its sequences; idempotent. Later
        calls raise InvalidHandleError. While an array from
        host_tier_memory() (or one made from it) is alive, the library
        frees the manager, and that memory, when the last of them goes."""
        super().close()

    def __repr__(self) -> str:
        state = "closed" if self._h is None else f"handle=0x{self._h:x}"
        return f"Manager(num_blocks={self.num_blocks}, block_size={self.block_size}, {state})"

    # -- scheduler calls -----------------------------------------------------

    def add(self, seq_id: int, prompt_len: int) -> None:
        """Admits sequence seq_id with a prompt of prompt_len tokens (they
        are its new tokens). Raises DuplicateSequenceError,
        OutOfBlocksError (not now: retry once blocks are free),
        PromptTooLongError (more tokens than the whole pool holds: never),
        InvalidArgumentError."""
        seq_id = _int(seq_id, "add: seq_id", "int64")
        prompt_len = _int(prompt_len, "add: prompt_len", "int32")
        if prompt_len > self._max_prompt:
            raise self._too_long("add", seq_id, prompt_len)
        st = C.kvp_manager_add(self._h, seq_id, prompt_len)
        if st:
            _lib.raise_status(st)

    def grow(self, seq_ids: IntArray, num_tokens: Union[int, IntArray] = 1) -> None:
        """Grows each sequence by num_tokens tokens (one int for all, or one
        per sequence), all or none; an empty batch does nothing. Raises
        OutOfBlocksError (nothing grew: preempt and retry),
        UnknownSequenceError, DuplicateSequenceError, InvalidArgumentError."""
        ids_ptr, n, keep_ids = _in_ptr(seq_ids, _I64, _i64, "seq_ids")
        if n > _INT32_MAX:
            raise _bad(f"grow: batch of {n} sequences")
        if not n:
            return self._empty("grow", num_tokens)
        if type(num_tokens) is int or _scalar(num_tokens):
            v = num_tokens
            if not (type(v) is int and -(2**31) <= v < 2**31):
                v = _int(num_tokens, "grow: num_tokens", "int32")
            fill = self._fill
            if fill[0] != v or fill[1] is None or fill[1].size < n:
                fill = self._new_fill(v, n)
            counts_ptr = fill[2]
        else:
            counts_ptr, k, keep_counts = _in_ptr(num_tokens, _I32, _i32, "num_tokens")
            if k != n:
                raise _bad(f"grow: {k} token counts for {n} sequences")
        st = C.kvp_manager_grow(self._h, ids_ptr, counts_ptr, n)
        if st:
            _lib.raise_status(st)

    def _too_long(self, call: str, seq_id: int, prompt_len: int) -> _lib.PromptTooLongError:
        bs = self.block_size
        return _lib.PromptTooLongError(
            f"{call}: sequence {seq_id}'s prompt of {prompt_len} tokens needs {-(-prompt_len // bs)} blocks of {bs} "
            f"tokens; the whole pool holds {self.num_blocks}, so it can never be admitted", _lib.Status.INVALID_ARGUMENT)

    def _new_fill(self, value: int, n: int) -> Tuple[int, Any, int]:
        # Out-of-range counts that fit in int32 are left to the library,
        # whose message names the offending sequence.
        old = self._fill[1]
        arr = np.full(max(n, 256, 0 if old is None else old.size), value, np.int32)
        fill = (value, arr, arr.ctypes.data)
        self._fill = fill
        return fill

    def _empty(self, call: str, num_tokens: Any = None) -> None:
        """An empty batch: nothing to do (a scheduler step without one kind of
        work), once the manager is known open and a count list, if any,
        known empty too."""
        if self._h is None:
            raise _closed(call)
        if num_tokens is None:
            return
        if type(num_tokens) is int or _scalar(num_tokens):
            _int(num_tokens, f"{call}: num_tokens", "int32")
        else:
            k = _in_ptr(num_tokens, _I32, _i32, "num_tokens")[1]
            if k:
                raise _bad(f"{call}: {k} token counts for 0 sequences")

    def fork(self, parent: int, children: IntArray) -> List[Tuple[int, int]]:
        """Creates the sequences `children` as copies of `parent`, sharing
        its full blocks. Returns the (src, dst) block copies the engine must
        perform before the next kernel reads dst: one per child when the
        parent's last block is partial, else none."""
        parent = _int(parent, "fork: parent", "int64")
        ptr, n, keep = _in_ptr(children, _I64, _i64, "children")
        if n > _INT32_MAX:
            raise _bad(f"fork: {n} children")
        # At most one copy per group per child (layer groups: the partial
        # last block of each attention group, each recurrent state).
        cap = min(n * len(self.layer_groups), _INT32_MAX)
        copies = np.empty((max(cap, 1), 2), np.int32)
        num = _i32()
        st = C.kvp_manager_fork(self._h, parent, ptr, n, copies.ctypes.data, cap, ctypes.byref(num))
        if st:
            _lib.raise_status(st)
        return [tuple(p) for p in copies[: num.value].tolist()]

    def remove(self, seq_ids: IntArray) -> None:
        """Retires the sequences, all or none; an empty batch does nothing.
        Raises UnknownSequenceError (also for a double remove),
        DuplicateSequenceError."""
        ptr, n, keep = _in_ptr(seq_ids, _I64, _i64, "seq_ids")
        if n > _INT32_MAX:
            raise _bad(f"remove: batch of {n} sequences")
        if not n:
            return self._empty("remove")
        st = C.kvp_manager_remove(self._h, ptr, n)
        if st:
            _lib.raise_status(st)

    def describe_into(
        self,
        seq_ids: IntArray,
        block_table: Any = None,
        seq_lens: Any = None,
        slot_mapping: Any = None,
        *,
        max_blocks: Optional[int] = None,
    ) -> int:
        """Writes the batch's block table (int32 [n, max_blocks], padded with
        -1), sequence lengths (int32 [n]) and the slots of its new tokens
        (int32, into the front of slot_mapping) into caller buffers, any of
        which may be None. Returns the number of slots (counted even when
        slot_mapping is None). block_table is 2-D (max_blocks is its number
        of columns: a different max_blocks is an InvalidArgumentError) or
        flat with max_blocks given; its rows beyond n, and entries beyond
        the returned count, are left alone.

        With int64 ids and C-contiguous int32 numpy outputs nothing is
        allocated or converted. An empty batch writes nothing and returns
        0. Raises BufferTooSmallError (nothing written),
        UnknownSequenceError."""
        ids_ptr, n, keep = _in_ptr(seq_ids, _I64, _i64, "seq_ids")
        if n > _INT32_MAX:
            raise _bad(f"describe: batch of {n} sequences")
        if block_table is None:
            table_ptr, mb = 0, 0
        else:
            shape = getattr(block_table, "shape", None)
            ndim = 1 if shape is None else len(shape)
            if ndim not in (1, 2):
                raise _bad(f"describe: block_table must be 2-D [n, max_blocks] or flat: got shape {tuple(shape)}")
            if max_blocks is not None:
                mb = _int(max_blocks, "describe: max_blocks", "int32", lo=1)
                # The library writes rows max_blocks apart: in a table of
                # another width they would straddle its rows.
                if ndim == 2 and shape[1] != mb:
                    raise _bad(f"describe: max_blocks={mb} but block_table has {shape[1]} columns: "
                               "omit max_blocks for a 2-D table, or pass a flat one")
            elif ndim == 2:
                mb = shape[1]
            else:
                raise _bad("describe: a flat block_table needs max_blocks")
            if not (1 <= mb <= _INT32_MAX):
                raise _bad(f"describe: max_blocks must be in [1, 2^31): got {mb}")
            table_ptr, _ = _out_ptr(block_table, n * mb, "describe: block_table")
        lens_ptr = 0 if seq_lens is None else _out_ptr(seq_lens, n, "describe: seq_lens")[0]
        if slot_mapping is None:
            slots_ptr, cap = 0, 0
        else:
            slots_ptr, cap = _out_ptr(slot_mapping, 0, "describe: slot_mapping")
            cap = min(cap, _INT32_MAX)
            if cap == 0:
                # A non-NULL pointer asks for slots even with no room for any.
                slots_ptr = _addressof(_EMPTY_SLOT)
        if not n:
            self._empty("describe")
            return 0
        num = _i32()
        st = C.kvp_manager_describe(self._h, ids_ptr, n, table_ptr, mb, lens_ptr, slots_ptr, cap, ctypes.byref(num))
        if st:
            _lib.raise_status(st)
        return num.value

    def describe(
        self,
        seq_ids: IntArray,
        max_blocks: Optional[int] = None,
        *,
        out: Optional[Tuple[Any, Any, Any]] = None,
    ) -> Description:
        """The batch's (block_table, seq_lens, slot_mapping) as int32 numpy
        arrays. max_blocks defaults to the widest row the batch needs. With
        out=(block_table, seq_lens, slot_mapping), preallocated int32 arrays
        (2-D block table), they are filled and views of them returned
        (block_table[:n], seq_lens[:n], slot_mapping[:num_slots])."""
        ids = seq_ids
        if not (type(ids) is _ndarray and ids.dtype == _I64):
            ids = _in_ptr(seq_ids, _I64, _i64, "seq_ids")[2]
        n = len(ids)
        if out is not None:
            table, lens, slots = out
            k = self.describe_into(ids, table, lens, slots, max_blocks=max_blocks)
            return Description(table[:n], lens[:n], slots[:k])
        if not n:
            self._empty("describe")
            mb = 1 if max_blocks is None else _int(max_blocks, "describe: max_blocks", "int32", lo=1)
            return Description(np.empty((0, mb), np.int32), np.empty(0, np.int32), np.empty(0, np.int32))

        def fill(mb: int, k: int, lens: np.ndarray) -> Description:
            table, slots = np.empty((n, mb), np.int32), np.empty(k, np.int32)
            return Description(table, lens, slots[:self.describe_into(ids, table, lens, slots)])
        return self._sized(ids, max_blocks, "describe", fill)

    def _sized(self, ids: Any, max_blocks: Optional[int], what: str, fill: Any) -> Any:
        """Sizes a describe of the batch ids (a first call for the lengths
        and the slot count) and returns fill(max_blocks, slots, seq_lens),
        which allocates and describes; with max_blocks None, retried when
        another thread grows the batch in between."""
        n = len(ids)
        for _ in range(3):
            lens = np.empty(n, np.int32)
            k = self.describe_into(ids, None, lens, None)
            need = max(1, -(-int(lens.max()) // self.block_size))
            mb = need if max_blocks is None else _int(max_blocks, f"{what}: max_blocks", "int32", lo=1)
            try:
                return fill(mb, k, lens)
            except _lib.BufferTooSmallError:
                if max_blocks is not None:
                    raise
        raise _lib.BufferTooSmallError(f"{what}: the batch kept growing while it was described",
                                       _lib.Status.BUFFER_TOO_SMALL)

    def describe_groups_into(self, seq_ids: IntArray, block_tables: Optional[Sequence[Any]] = None,
                             seq_lens: Any = None, slot_mappings: Optional[Sequence[Any]] = None) -> int:
        """describe_into for every layer group, into caller buffers, in one C
        call (kvp_manager_describe_groups): block_tables and slot_mappings
        are None or one entry per group, each None or an int32 buffer (the
        tables 2-D [n, max_blocks], all of one width). Returns the number of
        slots each attention group's mapping received; a recurrent group's
        mapping is not written. Nothing is allocated with int64 ids and
        C-contiguous int32 numpy buffers, so a step can reuse its arrays.
        Raises BufferTooSmallError (nothing written), UnknownSequenceError."""
        ids_ptr, n, keep = _in_ptr(seq_ids, _I64, _i64, "seq_ids")
        ng = len(self.layer_groups)
        if n > _INT32_MAX:
            raise _bad(f"describe_groups_into: batch of {n} sequences")
        for name, bufs in (("block_tables", block_tables), ("slot_mappings", slot_mappings)):
            if bufs is not None and len(bufs) != ng:
                raise _bad(f"describe_groups_into: {name} has {len(bufs)} entries for {ng} layer groups")
        mb, tptrs = 0, None
        if block_tables is not None:
            tptrs = (_vp * ng)()
            for g, t in enumerate(block_tables):
                if t is None:
                    continue
                shape = getattr(t, "shape", None)
                if shape is None or len(shape) != 2:
                    raise _bad(f"describe_groups_into: block_tables[{g}] must be 2-D [n, max_blocks]")
                if mb and shape[1] != mb:
                    raise _bad(f"describe_groups_into: block_tables[{g}] has {shape[1]} columns, the others {mb}")
                mb = shape[1]
                tptrs[g] = _out_ptr(t, n * mb, f"describe_groups_into: block_tables[{g}]")[0]
            if not 1 <= mb <= _INT32_MAX:
                raise _bad(f"describe_groups_into: max_blocks must be in [1, 2^31): got {mb}")
        lens_ptr = 0 if seq_lens is None else _out_ptr(seq_lens, n, "describe_groups_into: seq_lens")[0]
        cap, sptrs = _INT32_MAX, None
        if slot_mappings is not None:
            sptrs = (_vp * ng)()
            for g, sl in enumerate(slot_mappings):
                if sl is None:
                    continue
                p, c = _out_ptr(sl, 0, f"describe_groups_into: slot_mappings[{g}]")
                # One capacity for all: the smallest mapping's.
                sptrs[g], cap = (p or _addressof(_EMPTY_SLOT)), min(cap, c)
        if not n:
            self._empty("describe_groups_into")
            return 0
        num = _i32()
        st = C.kvp_manager_describe_groups(self._h, ids_ptr, n, ng, tptrs, mb, lens_ptr, sptrs,
                                           0 if sptrs is None else cap, ctypes.byref(num))
        if st:
            _lib.raise_status(st)
        return num.value

    def describe_groups(self, seq_ids: IntArray, max_blocks: Optional[int] = None) -> List[Description]:
        """Every layer group's (block_table, seq_lens, slot_mapping) of the
        batch, in one C call (kvp_manager_describe_groups): entry g is group
        g's, entry 0 what describe() returns. A sliding-window group's table
        holds -1 where blocks were dropped; a recurrent group's row is its
        state block, and its slot mapping is empty. max_blocks defaults to
        the widest row the batch needs."""
        keep = _in_ptr(seq_ids, _I64, _i64, "seq_ids")[2]
        n, ng = len(keep), len(self.layer_groups)
        if not n:
            self._empty("describe_groups")
            mb = 1 if max_blocks is None else _int(max_blocks, "describe_groups: max_blocks", "int32", lo=1)
            return [Description(np.empty((0, mb), np.int32), np.empty(0, np.int32), np.empty(0, np.int32))] * ng
        if n > _INT32_MAX:
            raise _bad(f"describe_groups: batch of {n} sequences")
        def fill(mb: int, k: int, lens: np.ndarray) -> List[Description]:
            tables = [np.empty((n, mb), np.int32) for _ in range(ng)]
            slots = [np.empty(k, np.int32) for _ in range(ng)]
            num = self.describe_groups_into(keep, tables, lens, slots)
            return [Description(tables[g], lens, slots[g][:0 if g and self.layer_groups[g].kind == LayerGroup.RECURRENT
                                                          else num]) for g in range(ng)]
        return self._sized(keep, max_blocks, "describe_groups", fill)

    def take_copies(self) -> List[Tuple[int, int]]:
        """The queued block copies (src, dst), oldest first
        (kvp_manager_take_copies): a recurrent group's checkpoints and the
        states of prefix hits. Perform them in order, every layer slot of
        src into dst, on the next forward pass's stream before it; call
        once every step after scheduling (a queued copy holds its blocks
        until this call hands it out). Empty without a recurrent group in
        the prefix cache."""
        out: List[Tuple[int, int]] = []
        buf = (BlockCopy * 256)()
        n, left = _i32(), _i32()
        while True:
            st = C.kvp_manager_take_copies(self._h, buf, 256, ctypes.byref(n), ctypes.byref(left))
            if st:
                _lib.raise_status(st)
            out.extend((buf[i].src, buf[i].dst) for i in range(n.value))
            if left.value == 0:
                return out

    def group_blocks(self) -> List[int]:
        """The blocks each layer group holds now (a block forked sequences
        share counts once)."""
        ng = len(self.layer_groups)
        out = (_i32 * ng)()
        num = _i32()
        st = C.kvp_manager_group_blocks(self._h, out, ng, ctypes.byref(num))
        if st:
            _lib.raise_status(st)
        return list(out[: num.value])

    # -- inspection ----------------------------------------------------------

    def stats(self) -> ManagerStats:
        s = ManagerStatsStruct()
        s.struct_size = ctypes.sizeof(ManagerStatsStruct)
        st = C.kvp_manager_stats_get(self._h, ctypes.byref(s))
        if st:
            _lib.raise_status(st)
        return ManagerStats(*(getattr(s, f[0]) for f in ManagerStatsStruct._fields_[1:]))

    def check(self) -> None:
        """Verifies the library's internal invariants; raises InternalError
        describing the first broken one."""
        st = C.kvp_manager_check(self._h)
        if st:
            _lib.raise_status(st)


_EMPTY_SLOT = ctypes.c_int32()


def _layer_groups(groups: Sequence[LayerGroup]) -> Any:
    """The C array of a Manager's layer_groups, checked for type (the
    library checks the values)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise _bad_type(f"Manager: layer_groups must be a sequence of LayerGroup: got {type(groups).__name__}")
    arr = (LayerGroupStruct * max(len(groups), 1))()
    for i, g in enumerate(groups):
        if not isinstance(g, LayerGroup):
            raise _bad_type(f"Manager: layer_groups[{i}] must be a LayerGroup: got {type(g).__name__}")
        arr[i].kind = _int(g.kind, f"Manager: layer_groups[{i}].kind", "int32")
        arr[i].window = _int(g.window, f"Manager: layer_groups[{i}].window", "int32")
        arr[i].state_bytes = _int(g.state_bytes, f"Manager: layer_groups[{i}].state_bytes", "int64")
        arr[i].checkpoint_every = _int(g.checkpoint_every, f"Manager: layer_groups[{i}].checkpoint_every", "int32")
    return arr if groups else (LayerGroupStruct * 0)()
