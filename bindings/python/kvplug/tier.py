"""The host KV tier of a Manager (include/kvplug.h, "Host KV tier").

A Manager created with host_tier_slots > 0 (and prefix_cache=True) demotes
cached blocks the GPU pool evicts ahead of need into host memory that the
library allocates, and reloads them when a prompt's prefix continues there.
The engine performs the copies, since it knows its K/V layout. Per step,
after the step's admissions and before its forward pass:

    batch = m.flush_copies()
    host = m.host_tier_memory()                 # uint8 [slots, block_bytes]
    for block, slot in zip(batch.demote_blocks, batch.demote_slots):
        host[slot] = gpu_block_bytes(block)     # every layer's K and V
    for slot, block in zip(batch.reload_slots, batch.reload_blocks):
        write_gpu_block(block, host[slot])      # before the step's attention
    if batch.ticket:
        m.complete_copies(batch.ticket)         # once the copies finished

On a GPU, kvplug.TierCopier performs the copies (every layer's K and V of
a batch in one kernel launch, host memory page-locked and mapped).

With shared_tier="host:port" as well (a Valkey or Redis server that
instances share, include/kvplug.h "Shared KV tier"), admit and match_tiers
fetch the blocks the server holds past a prompt's GPU and host matches
into host slots (reloaded like any host hit), and the blocks
complete_copies commits are stored there by a library thread, so that an
instance serves a prompt another instance computed. shared_tier_namespace
must name the model and K/V layout (e.g. "llama-3.1-8b.bf16.l32.kv8.d128"):
the blocks' hashes do not cover the model. A server that is down or slow
is skipped and counted (tier_stats().shared_*); no call fails for it.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, List, NamedTuple, Sequence, Tuple

import numpy as np

from . import _lib
from ._capi import TierCopyStruct, TierMatchStruct, TierStatsStruct
from ._lib import C
from .tiercopy import TierCopier  # noqa: F401 (the copies on a GPU)

__all__ = ["CopyBatch", "TierMatch", "TierStats", "HostTierMethods", "TierCopier"]

_i32, _i64, _u64, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p


class CopyBatch(NamedTuple):
    """One step's host tier copies (Manager.flush_copies). Demotions copy
    GPU block demote_blocks[i] into host slot demote_slots[i]; reloads
    copy host slot reload_slots[i] into GPU block reload_blocks[i], and
    must land before the step's attention. ticket 0: nothing to copy."""

    ticket: int
    demote_blocks: np.ndarray  # int32
    demote_slots: np.ndarray  # int32
    reload_slots: np.ndarray  # int32
    reload_blocks: np.ndarray  # int32


class TierMatch(NamedTuple):
    """Manager.match_tiers' answer for one prompt: its first gpu_tokens in
    the GPU prefix cache, the next host_tokens in the host tier."""

    gpu_tokens: int
    host_tokens: int


@dataclasses.dataclass(frozen=True)
class TierStats:
    """The host tier's counters (since creation) and gauges (struct
    kvp_tier_stats); all zero without a host tier."""

    demotions_queued: int
    demotions_completed: int
    demotions_failed: int
    skipped_full: int
    skipped_present: int
    evicted_undemoted: int
    reloads: int
    reloads_completed: int
    reloads_failed: int
    host_hit_tokens: int
    match_queries: int
    match_gpu_tokens: int
    match_host_tokens: int
    host_evictions: int
    host_hits: int
    host_misses: int
    in_flight: int
    host_slots: int
    host_resident: int
    host_reserved: int
    host_pinned: int
    # The shared tier's (all zero without one): see struct kvp_tier_stats.
    # Defaults, so that the host tier's fields alone still make one.
    shared_lookups: int = 0
    shared_hits: int = 0
    shared_misses: int = 0
    shared_fetched: int = 0
    shared_fetch_misses: int = 0
    shared_hit_tokens: int = 0
    shared_match_tokens: int = 0
    shared_puts_queued: int = 0
    shared_puts_done: int = 0
    shared_puts_present: int = 0
    shared_puts_failed: int = 0
    shared_puts_dropped: int = 0
    shared_corrupt: int = 0
    shared_timeouts: int = 0
    shared_errors: int = 0
    shared_skipped: int = 0
    shared_bytes_read: int = 0
    shared_bytes_written: int = 0
    shared_queue_len: int = 0
    shared_available: bool = False
    shared_auth_failures: int = 0  # of shared_errors: AUTH refused, commands refused (NOAUTH, NOPERM)
    shared_tls_failures: int = 0  # of shared_errors: TLS handshakes or certificate verifications failed
    shared_mac_failures: int = 0  # of shared_corrupt: values whose MAC did not verify
    # A Valkey/Redis Cluster: MOVED/ASK replies followed, slot maps read, whether it is one, its primaries.
    shared_redirects: int = 0
    shared_map_reads: int = 0
    shared_cluster: bool = False
    shared_primaries: int = 0
    # Write-through (Manager(write_through=N)): computed blocks copied to the host tier while they
    # stay on the GPU; those the GPU evicted before their store; those waiting for it (with
    # write_through_slack=S, all of them while the pool has more than S free blocks).
    write_through_stored: int = 0
    write_through_lost: int = 0
    write_through_queue: int = 0
    # Prompts not looked up in the shared tier: it lacked their first block past the GPU and host
    # matches within the last second.
    shared_remembered: int = 0


_STAT_FIELDS = [f.name for f in dataclasses.fields(TierStats)]


def _check(st: int) -> None:
    if st:
        _lib.raise_status(st)


class HostTierMethods:
    """The host tier's methods of Manager (self._h is the kvp_manager *)."""

    _h: Any
    _flush_caps: Tuple[int, int]  # the demote and reload array sizes the next flush starts at
    _lease: Any  # _lib.Owner's
    _empty: Any  # Manager's
    _per_prompt: Any  # PrefixCacheMethods'

    def flush_copies(self) -> CopyBatch:
        """Demotes least recently used cached blocks and returns this step's
        copy batch (demotions and the reloads admissions queued). The
        engine copies, then calls complete_copies(batch.ticket) when the
        ticket is nonzero. Raises InvalidArgumentError without a host tier."""
        # The arrays start at the sizes the last flush asked for (a write-through
        # manager's batches are larger than demote_ahead), so that a step makes
        # one call, not a refused one and a retry.
        cap_d, cap_r = self._flush_caps
        nd, nr, tk = _i32(), _i32(), _u64()
        while True:
            d = (TierCopyStruct * cap_d)()
            r = (TierCopyStruct * cap_r)()
            st = C.kvp_manager_flush_copies(self._h, d, cap_d, ctypes.byref(nd), r, cap_r, ctypes.byref(nr),
                                            ctypes.byref(tk))
            if st != _lib.Status.BUFFER_TOO_SMALL:
                break
            # Nothing changed: grow to the room the library asked for.
            cap_d, cap_r = max(cap_d, nd.value), max(cap_r, nr.value)
            self._flush_caps = (cap_d, cap_r)
        _check(st)
        # np.frombuffer views the ctypes arrays at a fraction of np.ctypeslib.as_array's cost.
        dv = np.frombuffer(d, np.int32, 2 * nd.value).reshape(-1, 2)
        rv = np.frombuffer(r, np.int32, 2 * nr.value).reshape(-1, 2)
        return CopyBatch(tk.value, dv[:, 0].copy(), dv[:, 1].copy(), rv[:, 1].copy(), rv[:, 0].copy())

    def complete_copies(self, ticket: int, failed: bool = False) -> None:
        """Reports that batch ticket's copies finished (or failed, with
        failed=True; a failed reload leaves its blocks cached without valid
        K/V). Raises NotFoundError for an unknown or completed ticket."""
        ticket = _lib.checked_int(ticket, "complete_copies: ticket", "uint64")
        _check(C.kvp_manager_complete_copies(self._h, ticket, int(bool(failed))))

    def match_tiers(self, prompts: Sequence[Any], keys: Any = None) -> List[TierMatch]:
        """Per prompt, the tokens of its longest prefix in the GPU prefix
        cache and, beyond them, those the host tier holds (nothing is
        admitted). With a shared tier, the blocks it holds past those are
        fetched into the host tier first and counted in host_tokens."""
        out = self._per_prompt("match_tiers", prompts, keys, TierMatchStruct, C.kvp_manager_match_tiers)
        return [] if out is None else [TierMatch(o.gpu_tokens, o.host_tokens) for o in out]

    def tier_stats(self) -> TierStats:
        s = TierStatsStruct()
        s.struct_size = ctypes.sizeof(TierStatsStruct)
        _check(C.kvp_manager_tier_stats(self._h, ctypes.byref(s)))
        v = {f: getattr(s, f) for f in _STAT_FIELDS}
        v["shared_available"] = bool(v["shared_available"])
        v["shared_cluster"] = bool(v["shared_cluster"])
        return TierStats(**v)

    def host_tier_memory(self) -> np.ndarray:
        """The host tier's memory as a uint8 array [host_tier_slots,
        host_block_bytes] (row s is slot s), a view of the library's
        memory (or of host_tier_memory given at creation). The array, and
        every array or tensor made from it, keeps that memory alive: a
        Manager closed while one exists frees its memory when the last is
        gone. Raises InvalidArgumentError without a host tier,
        InvalidHandleError after close()."""
        base, nbytes, nslots = _vp(), _i64(), _i32()
        _check(C.kvp_manager_host_tier_memory(self._h, ctypes.byref(base), ctypes.byref(nbytes), ctypes.byref(nslots)))
        buf = (ctypes.c_uint8 * (nbytes.value * nslots.value)).from_address(base.value)
        buf._kvplug_lease = self._lease()  # type: ignore[attr-defined]  # numpy's base: see _lib.Lease
        return np.frombuffer(buf, np.uint8).reshape(nslots.value, nbytes.value)
