"""The prefix cache of a Manager (the "Prefix cache" part of include/kvplug.h).

    m = kvplug.Manager(4096, 16, prefix_cache=True)
    matched = m.admit([1, 2], [prompt_a, prompt_b])   # tokens each starts on
    m.grow_tokens([1, 2], [[tok_a], [tok_b]])         # decode, tokens known
    m.remove([1, 2])                                  # blocks stay cached

A prompt's identity besides its tokens is a Keys: a LoRA adapter id,
multimodal items (offset, length, 16-byte content hash) and a tenant salt.
Keys belong to the sequence: under chunked prefill, admit the first chunk
with the whole prompt's Keys (items may reach past the chunk) and
grow_tokens the rest; items not known at admission can follow with
add_mm_items before their tokens.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import _lib
from ._arrays import NO_TOKENS as _NO_TOKENS, _I64, addr as _addr, bad as _bad, bad_type as _bad_type
from ._arrays import batch_len as _batch_len, flatten as _flatten
from ._arrays import in_ptr as _in_ptr, one_each as _one_each, token_ptr as _token_ptr
from ._capi import BlockMMStruct, KVEventStruct, KVGroupEventStruct, MMItemStruct, PrefixKeysStruct, PrefixMatchStruct
from ._capi import BlockMatchStruct, PrefixStatsStruct
from ._lib import C

__all__ = ["Keys", "MMItem", "Match", "BlockMatch", "PrefixStats", "KVEvent", "PrefixCacheMethods"]

_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_u64 = ctypes.c_uint64
_addressof = ctypes.addressof
_Offsets2 = ctypes.c_int64 * 2
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_ndarray = np.ndarray
_is_torch = _lib._is_torch_tensor

BLOCK_STORED = 1
BLOCKS_REMOVED = 2
ALL_CLEARED = 3

# KV event media (kvp_kv_event.medium), by their names on the wire.
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_SHARED = "GPU", "CPU", "SHARED"
_MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_SHARED)


def _medium(v: int) -> str:
    return _MEDIA[v] if 0 <= v < len(_MEDIA) else f"medium {v}"


class MMItem(NamedTuple):
    """A multimodal input: placeholder tokens at prompt positions
    [offset, offset + length), and a 16-byte digest of its content."""

    offset: int
    length: int
    hash: bytes


@dataclasses.dataclass(frozen=True)
class Keys:
    """A prompt's extra keys. Different adapters, multimodal content or
    salts never share a block. Build one per prompt (or tenant) and reuse
    it: its C form is built on first use and kept, so later calls with it
    cost nothing per item. mm is stored as a tuple of MMItem and salt as
    bytes, so a Keys cannot change after its C form exists."""

    adapter: int = 0  # LoRA adapter id; 0 = none
    mm: Sequence[MMItem] = ()  # the whole prompt's, offsets strictly increasing; may reach past the tokens given
    salt: bytes = b""  # tenant salt, at most 1024 bytes
    # (kvp_prefix_keys[1], the buffers it points to, its address), once used.
    _c: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            mm = tuple(
                it if type(it) is MMItem and type(it.hash) is bytes else MMItem(it[0], it[1], bytes(it[2])) for it in self.mm
            )
        except (TypeError, ValueError, IndexError):
            mm = tuple(self.mm)  # malformed: the call that uses it says why
        object.__setattr__(self, "mm", mm)
        if isinstance(self.salt, (bytearray, memoryview)):
            object.__setattr__(self, "salt", bytes(self.salt))


class Match(NamedTuple):
    """Manager.match's answer for one prompt."""

    matched_tokens: int  # cached prefix in full blocks; never the whole prompt
    partial_block: int  # with partial=True: a block whose first rows match; -1 if none
    partial_tokens: int  # how many of its rows


class BlockMatch(NamedTuple):
    """Manager.match_blocks' answer for one prompt."""

    matched_tokens: int  # the hit admit would take (Match.matched_tokens)
    # Group 0's longest cached prefix in full blocks, at least matched_tokens: past it where a recurrent
    # group has no checkpoint at its end (a state exists only where a step ended), which a step that ends
    # there (rounded down to a checkpoint boundary) leaves for the next prompt with this prefix.
    block_tokens: int


@dataclasses.dataclass(frozen=True)
class PrefixStats:
    queries: int  # prompts matched (admit and match)
    query_tokens: int  # their tokens
    hit_tokens: int  # of those, matched in cached full blocks
    partial_tokens: int  # tokens of partial matches
    inserts: int  # blocks cached
    dedups: int  # filled blocks found cached already
    evictions: int  # blocks evicted
    events_dropped: int  # KV events lost to a full queue (a resync follows)
    cached_blocks: int  # blocks in the cache
    locked_blocks: int  # held by live sequences
    pinned_blocks: int  # covered by a pin
    evictable_blocks: int  # an allocation could evict now
    pending_events: int  # undrained KV events
    uncomputed_blocks: int  # cached blocks filled since the last mark_computed
    dropped_uncomputed: int  # uncomputed blocks removals took out of the cache

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens (0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class KVEvent:
    """A change of the set of cached blocks (vLLM's KV event fields).
    kind: "stored" (hash, parent, tokens, adapter, mm as (offset, hash)
    pairs relative to the block), "removed" (hashes; on the GPU children
    first) or "cleared" (forget every block, of every medium and group).
    medium: where a stored or removed block is, "GPU" (the prefix cache) or
    "CPU" (the host tier: its blocks carry the fields of their GPU events,
    the same hash included); "" for "cleared". group: the layer group of a
    stored or removed block (vLLM's group_idx), 0 for the prefix cache's
    own; drain_group_events reports the others' (a window's block or a
    recurrent checkpoint kept with a cached block, under its hash)."""

    kind: str
    hash: bytes = b""
    parent: bytes = b""
    tokens: Tuple[int, ...] = ()
    adapter: int = 0
    mm: Tuple[Tuple[int, bytes], ...] = ()
    hashes: Tuple[bytes, ...] = ()
    medium: str = ""
    group: int = 0


_int = _lib.checked_int


def _mm_items(mm: Sequence[Any]) -> Any:
    """A kvp_mm_item array of (offset, length, 16-byte hash) items."""
    items = (MMItemStruct * len(mm))()
    for i, it in enumerate(mm):
        try:
            off, length, h = it
        except (TypeError, ValueError):
            raise _bad(f"multimodal item {i} must be (offset, length, 16-byte hash): got {it!r}") from None
        if not isinstance(h, (bytes, bytearray, memoryview)) or len(h) != 16:
            raise _bad(f"multimodal item {i}: hash must be 16 bytes, got {h!r}")
        items[i].offset = _int(off, f"multimodal item {i}: offset", "int32")
        items[i].length = _int(length, f"multimodal item {i}: length", "int32")
        ctypes.memmove(items[i].hash, bytes(h), 16)
    return items


def _keys_struct(k: Optional[Keys], keep: list) -> PrefixKeysStruct:
    s = PrefixKeysStruct()
    if k is None:
        return s
    if not isinstance(k, Keys):
        raise _bad(f"keys must be kvplug.Keys or None: got {type(k).__name__}")
    s.adapter = _int(k.adapter, "keys: adapter", "uint64")
    if k.mm:
        items = _mm_items(k.mm)
        keep.append(items)
        s.mm = ctypes.cast(items, ctypes.POINTER(MMItemStruct))
        s.num_mm = len(k.mm)
    if k.salt:
        salt = bytes(k.salt)
        buf = (ctypes.c_uint8 * len(salt)).from_buffer_copy(salt)
        keep.append(buf)
        s.salt = ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8))
        s.salt_len = len(salt)
    return s


def _c_keys(k: Any) -> Tuple[Any, list, int]:
    """k's cached C form: (kvp_prefix_keys[1], what it points to, address).
    Built on k's first use; a Keys never changes, so it stays valid."""
    c = getattr(k, "_c", None) if type(k) is Keys else None
    if c is None:
        keep: list = []
        arr = (PrefixKeysStruct * 1)(_keys_struct(k, keep))
        c = (arr, keep, _addressof(arr))
        if type(k) is Keys:
            object.__setattr__(k, "_c", c)
    return c


def _keys_array(keys: Any, n: int, keep: list) -> Any:
    """The address of a kvp_prefix_keys[n] (or None) from None, one Keys
    for all, or a list. keep receives what must outlive the call."""
    if keys is None:
        return None
    if isinstance(keys, Keys) and n == 1:
        c = _c_keys(keys)
        keep.append(keys)
        return c[2]
    if isinstance(keys, Keys):
        keys = [keys] * n
    try:
        keys = list(keys)
    except TypeError:
        raise _bad_type(f"keys must be None, one kvplug.Keys or a list of them: got {type(keys).__name__}") from None
    if len(keys) != n:
        raise _bad(f"{len(keys)} keys for {n} prompts")
    structs = []
    for k in keys:
        if k is None:
            structs.append(PrefixKeysStruct())
        else:
            structs.append(_c_keys(k)[0][0])
            keep.append(k)
    arr = (PrefixKeysStruct * n)(*structs)
    keep.append(arr)
    return _addressof(arr)


def _one_key(keys: Optional[Keys], keep: list) -> Any:
    if keys is None:
        return None
    keep.append(keys)
    return _c_keys(keys)[2]


def _check(st: int) -> None:
    if st:
        _lib.raise_status(st)


class PrefixCacheMethods:
    """The Manager methods of the prefix cache (mixed into Manager)."""

    _h: Optional[int]
    block_size: int
    num_blocks: int
    _max_prompt: int
    _too_long: Any  # Manager's
    _empty: Any  # Manager's

    def admit(self, seq_ids: Any, prompts: Any, keys: Any = None) -> np.ndarray:
        """Admits new sequences by their prompts, in order; keys is None,
        one Keys for all, or one per prompt. Each sequence starts on its
        prompt's longest cached prefix and only the rest are its new
        tokens. Returns the matched token counts of the admitted sequences:
        fewer than len(prompts) when the pool ran out, admission stopping
        at the first prompt that did not fit (those after it are
        untouched; retry them later). An empty batch does nothing. Raises
        PromptTooLongError for a prompt of more tokens than the whole pool
        holds (it could never be admitted), DuplicateSequenceError,
        InvalidArgumentError (nothing admitted).

        prompts is a list of token sequences (int32 numpy arrays and torch
        CPU tensors are used in place; lists of ints and other integer
        arrays are converted, a batch of them at once) or a 2-D array of
        equal-length prompts. Under chunked prefill, admit the first chunk
        with the whole prompt's keys."""
        if type(seq_ids) is list and len(seq_ids) == 1 and type(seq_ids[0]) is int and _I64_MIN <= seq_ids[0] <= _I64_MAX:
            # One id, the usual admission: a ctypes scalar costs a fifth of
            # numpy's conversion of the list.
            keep_ids = _i64(seq_ids[0])
            ids_ptr, n = _addressof(keep_ids), 1
        else:
            ids_ptr, n, keep_ids = _in_ptr(seq_ids, _I64, _i64, "seq_ids")
        if n != _batch_len(prompts):
            raise _bad(f"admit: {n} ids for {len(prompts)} prompts")
        if not n:
            self._empty("admit")
            return np.empty(0, np.int32)
        if n == 1 and type(prompts) is list:
            # One prompt, the usual admission: its offsets as a ctypes
            # array, a third of a numpy array's cost with its address.
            tok_ptr, size, tokens = _token_ptr(prompts[0], "prompt 0")
            if size > self._max_prompt:
                raise self._too_long("admit", _i64.from_address(ids_ptr).value, size)
            offsets = _Offsets2(0, size)
            off_ptr = _addressof(offsets)
        else:
            tokens, offsets = _flatten(prompts)
            if offsets[-1] > self._max_prompt:  # only then may one prompt be too long
                lens = np.diff(offsets)
                i = int(np.argmax(lens > self._max_prompt))
                if lens[i] > self._max_prompt:
                    raise self._too_long("admit", _i64.from_address(ids_ptr + 8 * i).value, int(lens[i]))
            tok_ptr, off_ptr = _addr(tokens), _addr(offsets)
        keep: list = []
        karr = _keys_array(keys, n, keep)
        matched = np.empty(max(n, 1), np.int32)
        admitted = _i32()
        _check(C.kvp_manager_admit(self._h, ids_ptr, n, tok_ptr, off_ptr, karr, _addr(matched), ctypes.byref(admitted)))
        return matched[: admitted.value]

    def grow_tokens(self, seq_ids: Any, tokens: Any) -> None:
        """Grows each sequence by its new tokens, all or none; blocks they
        fill are cached. tokens is one of:
          - one token per sequence (a decode step): a 1-D integer array, a
            torch CPU tensor or a list of ints; an int32 array is passed in
            place, so a step that reuses its arrays allocates nothing;
          - a 2-D array with one row of tokens per sequence;
          - a list with one token sequence per sequence (possibly empty);
            one-token lists ([[t] for t in toks]) cost about what a list of
            ints does.
        Raises OutOfBlocksError (nothing grew), UnknownSequenceError,
        DuplicateSequenceError, InvalidArgumentError. An empty batch does
        nothing."""
        ids_ptr, n, keep_ids = _in_ptr(seq_ids, _I64, _i64, "seq_ids")
        if not n:
            if tokens is None or _batch_len(tokens, "tokens"):
                raise _bad(f"grow_tokens: tokens for 0 sequences: got {tokens!r:.60}")
            return self._empty("grow_tokens")
        if tokens is None:
            raise _bad_type("grow_tokens: tokens must be one token per sequence or one token list per sequence, not None")
        if type(tokens) is _ndarray or _is_torch(tokens):
            shape = tuple(tokens.shape)
            if len(shape) not in (1, 2) or shape[0] != n:
                raise _bad(f"grow_tokens: tokens of shape {shape} for {n} sequences: need ({n},) or ({n}, k)")
            per = 1 if len(shape) == 1 else shape[1]
            tok_ptr, _, keep = _token_ptr(tokens if per == 1 and len(shape) == 1 else tokens.reshape(-1), "tokens")
            counts_ptr = self._counts_of(per, n)
        elif n and isinstance(tokens, (list, tuple)) and len(tokens) == n and isinstance(tokens[0], (int, np.integer)):
            tok_ptr, _, keep = _token_ptr(tokens, "tokens")  # one int per sequence
            counts_ptr = self._counts_of(1, n)
        else:
            # A decode step given as one list per sequence ([[t] for t in toks]):
            # one conversion of all the tokens, not numpy's of each list.
            one = len(tokens) == n and type(tokens) is list and n and type(tokens[0]) is list
            keep = _one_each(tokens) if one else None
            if keep is not None:
                counts_ptr = self._counts_of(1, n)
            else:
                if n != len(tokens):
                    raise _bad(f"grow_tokens: {n} ids for {len(tokens)} token lists")
                keep, offsets = _flatten(tokens)
                counts = np.diff(offsets).astype(np.int32)
                counts_ptr = _addr(counts)
            tok_ptr = _addr(keep if keep.size else _NO_TOKENS)
        _check(C.kvp_manager_grow_tokens(self._h, ids_ptr, counts_ptr, n, tok_ptr))

    def mark_computed(self) -> None:
        """Marks the K/V of every new token described so far as computed:
        call it once per step, after launching the step's forward pass and
        before removing finished sequences. Until then, the blocks the step
        filled are uncomputed, and removing their sequence (preempted,
        aborted) takes them out of the cache instead of keeping them for
        later prompts; removing it while a sequence admitted after it shares
        them raises InUseError. O(1); a no-op without the prefix cache."""
        _check(C.kvp_manager_mark_computed(self._h))

    def _counts_of(self, value: int, n: int) -> int:
        """The address of n counts of value, from the Manager's cached
        array (grow's), so a decode step allocates nothing."""
        fill = self._fill  # type: ignore[attr-defined]
        if fill[0] != value or fill[1] is None or fill[1].size < n:
            fill = self._new_fill(value, n)  # type: ignore[attr-defined]
        return fill[2]

    def add_mm_items(self, seq_id: int, items: Sequence[MMItem]) -> None:
        """Appends multimodal items to a live sequence's keys, for tokens
        still to come that its admission did not name: every block it fills
        afterwards is hashed with the items that overlap it. Items start
        after the sequence's last item and not inside a block it has filled
        already. Raises InvalidArgumentError, UnknownSequenceError (nothing
        changes)."""
        seq_id = _int(seq_id, "add_mm_items: seq_id", "int64")
        items = list(items)
        arr = _mm_items(items) if items else None
        _check(C.kvp_manager_add_mm_items(self._h, seq_id, arr, len(items)))

    def _per_prompt(self, call: str, prompts: Sequence[Any], keys: Any, out_type: Any, fn: Any) -> Any:
        """Runs a per-prompt query (kvp_manager_<call>, fn(handle, n,
        tokens, offsets, keys, out)) over prompts and returns its n results
        of out_type; None for no prompts."""
        n = _batch_len(prompts)
        if not n:
            self._empty(call)
            return None
        tokens, offsets = _flatten(prompts)
        keep: list = []
        karr = _keys_array(keys, n, keep)
        out = (out_type * n)()
        _check(fn(self._h, n, _addr(tokens), _addr(offsets), karr, out))
        return out

    def match(self, prompts: Sequence[Any], keys: Any = None, *, partial: bool = False) -> List[Match]:
        """The longest cached prefix of each prompt, without admitting it
        (a router's or scheduler's query). No prompts: []."""
        out = self._per_prompt("match", prompts, keys, PrefixMatchStruct,
                               lambda h, n, t, o, k, out: C.kvp_manager_match(h, n, t, o, k, int(partial), out))
        return [] if out is None else [Match(o.matched_tokens, o.partial_block, o.partial_tokens) for o in out]

    def match_blocks(self, prompts: Sequence[Any], keys: Any = None) -> List[BlockMatch]:
        """Each prompt's hit (as match) and its block match: group 0's
        longest cached prefix, which a recurrent group's hit stops short of
        where no step ended (BlockMatch). No prompts: []."""
        out = self._per_prompt("match_blocks", prompts, keys, BlockMatchStruct, C.kvp_manager_match_blocks)
        return [] if out is None else [BlockMatch(o.matched_tokens, o.block_tokens) for o in out]

    def match_room(self, prompts: Sequence[Any], keys: Any = None) -> List[int]:
        """Per prompt, the blocks an admission of it could allocate now
        beyond its GPU hit: the free blocks and the evictable cached ones,
        less the hit's blocks that nothing holds (a hit that running
        sequences share costs nothing). admit takes a prompt whose blocks
        past its hit are at most that many, if nothing changes in between.
        A query: nothing is touched. Raises UnsupportedError with layer
        groups. No prompts: []."""
        out = self._per_prompt("match_room", prompts, keys, _i32, C.kvp_manager_match_room)
        return [] if out is None else list(out)

    def pin(self, tokens: Any, keys: Optional[Keys] = None) -> Tuple[int, int]:
        """Pins the cached full blocks of a prefix against eviction. Returns
        (pin_id, blocks pinned). Raises NotFoundError if none is cached."""
        t_ptr, size, t = _token_ptr(tokens, "tokens")
        keep: list = []
        pid, nb = _u64(), _i32()
        _check(C.kvp_manager_pin(self._h, t_ptr, size, _one_key(keys, keep), ctypes.byref(pid), ctypes.byref(nb)))
        return pid.value, nb.value

    def unpin(self, pin_id: int) -> None:
        """Releases one pin. Raises NotFoundError for an unknown id."""
        pin_id = _int(pin_id, "unpin: pin_id", "uint64")
        _check(C.kvp_manager_unpin(self._h, pin_id))

    def set_priority(self, tokens: Any, priority: int, keys: Optional[Keys] = None) -> int:
        """Sets the eviction priority of a prefix's cached full blocks
        (lower goes first; default 0). Returns how many blocks were set."""
        priority = _int(priority, "set_priority: priority", "int32")
        t_ptr, size, t = _token_ptr(tokens, "tokens")
        keep: list = []
        nb = _i32()
        _check(C.kvp_manager_set_priority(self._h, t_ptr, size, _one_key(keys, keep), priority, ctypes.byref(nb)))
        return nb.value

    def prefix_stats(self) -> PrefixStats:
        s = PrefixStatsStruct()
        s.struct_size = ctypes.sizeof(PrefixStatsStruct)
        _check(C.kvp_manager_prefix_stats(self._h, ctypes.byref(s)))
        return PrefixStats(*(getattr(s, f[0]) for f in PrefixStatsStruct._fields_[1:]))

    def reset_prefix_stats(self) -> None:
        _check(C.kvp_manager_prefix_stats_reset(self._h))

    def clear_prefix_cache(self) -> int:
        """Drops every unheld cached block and every pin; returns the blocks
        freed. Raises InvalidArgumentError while live sequences hold cached
        blocks."""
        n = _i32()
        _check(C.kvp_manager_clear_prefix_cache(self._h, ctypes.byref(n)))
        return n.value

    def drain_events(self, max_events: int = 1024) -> List[KVEvent]:
        """Drains up to max_events pending KV events of layer group 0,
        oldest first (call until it returns [] to drain all). Needs
        kv_events=True. With layer groups, the other groups' events are
        passed over and dropped (drain_group_events returns them). Makes
        progress whatever a block holds: buffers too small for the oldest
        event grow to the size the library reports, and the call is
        retried."""
        return self._drain("drain_events", max_events, False)

    def drain_group_events(self, max_events: int = 1024) -> List[KVEvent]:
        """drain_events for every layer group's events, each with its
        group (KVEvent.group): a router that mirrors every group's blocks
        predicts a hybrid model's hits exactly (include/kvplug.h, "KV events
        of layer groups"). Without layer groups it returns what drain_events
        would. Use one of the two: the events either takes are gone for the
        other."""
        return self._drain("drain_group_events", max_events, True)

    def _drain(self, op: str, max_events: int, groups: bool) -> List[KVEvent]:
        max_events = _int(max_events, f"{op}: max_events", "int32")
        if not (1 <= max_events <= 1 << 20):
            raise _bad(f"{op}: max_events must be in [1, 2^20]: got {max_events}")
        bs = self.block_size
        evs = ((KVGroupEventStruct if groups else KVEventStruct) * max_events)()
        drain = C.kvp_manager_drain_group_events if groups else C.kvp_manager_drain_events
        next_size = C.kvp_manager_next_group_event_size if groups else C.kvp_manager_next_event_size
        # Room for every event of a call with up to 64 tokens a block
        # (larger blocks: one block at least), 1024 multimodal entries and
        # 4 removed hashes an event; the retry below grows what is short.
        cap_tok = max(bs, max_events * min(bs, 64))
        cap_mm, cap_hash = 1024, 4 * max_events
        num = _i32()
        need_tok, need_mm, need_hash = _i32(), _i32(), _i32()
        # Each retry is sized by the library's answer for the oldest event,
        # so the second call succeeds unless another thread drained or
        # stored events in between; the bound only stops a pathological race.
        for _ in range(8):
            toks = np.empty(cap_tok, np.int32)
            mm = (BlockMMStruct * max(cap_mm, 1))()
            hashes = np.empty(16 * max(cap_hash, 1), np.uint8)
            st = drain(self._h, evs, max_events, toks.ctypes.data, cap_tok, mm, cap_mm, hashes.ctypes.data, cap_hash, ctypes.byref(num))
            if st != _lib.Status.BUFFER_TOO_SMALL:
                break
            _check(next_size(self._h, ctypes.byref(need_tok), ctypes.byref(need_mm), ctypes.byref(need_hash)))
            cap_tok = max(cap_tok, need_tok.value)
            cap_mm = max(cap_mm, need_mm.value)
            cap_hash = max(cap_hash, need_hash.value)
        _check(st)
        out = []
        hb = hashes.tobytes()
        for ge in evs[: num.value]:
            e, group = (ge.event, ge.group) if groups else (ge, 0)
            if e.kind == BLOCK_STORED:
                mms = tuple((mm[e.mm_offset + j].offset, bytes(mm[e.mm_offset + j].hash)) for j in range(e.num_mm))
                out.append(
                    KVEvent(
                        "stored",
                        hash=bytes(e.hash),
                        parent=bytes(e.parent),
                        tokens=tuple(toks[e.tokens_offset : e.tokens_offset + e.block_size].tolist()),
                        adapter=e.adapter,
                        mm=mms,
                        medium=_medium(e.medium),
                        group=group,
                    )
                )
            elif e.kind == BLOCKS_REMOVED:
                out.append(
                    KVEvent(
                        "removed",
                        hashes=tuple(hb[16 * (e.hashes_offset + j) : 16 * (e.hashes_offset + j + 1)] for j in range(e.num_hashes)),
                        medium=_medium(e.medium),
                        group=group,
                    )
                )
            else:
                out.append(KVEvent("cleared"))
        return out
