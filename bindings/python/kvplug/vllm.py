"""kvplug inside vLLM: an OffloadingSpec for vLLM's OffloadingConnector whose
scheduler-side OffloadingManager is kvplug's host store (kvplug.hoststore,
the host tier's slot pool through the C ABI) and whose workers move blocks
between vLLM's paged KV tensors and host memory in batches.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "KvplugOffloadingSpec", "spec_module_path": "kvplug.vllm",
        "kvplug_host_bytes": 17179869184}}'

kv_connector_extra_config keys read here (the connector's own keys, such as
block_size, blocks_per_chunk and offload_prompt_only, keep their meaning):

    kvplug_host_bytes  host memory for offloaded blocks, all workers together
                       (cpu_bytes_to_use is accepted too); required

The scheduler side keeps no memory: it hands out slot numbers of the host
store, keyed by a 64-bit hash of vLLM's OffloadKey (block hash and KV cache
group), and each worker owns num_slots rows of its own share of every block
in host memory, indexed by those slots, which kvplug's batched copy kernel
(kvplug.TierCopier) or torch moves (BlockCopier.for_views says which).

Faults in vLLM's terms, never an exception out of a manager call: a key
never stored or dropped by reset_cache is a MISS; a store of a block that
is stored already, being stored or being loaded is skipped (not in
keys_to_store); a store that does not fit the free and evictable slots is
refused whole (None, as vLLM's CPU manager does); completions and unpins the
store finds nothing for (after a reset) are counted as stale. Every such
case is counted: KvplugOffloadingManager.counters() and the kvplug:* metrics.

reset_cache with transfers in flight (vLLM's pause_generation(clear_cache=
True) resets between steps, copies still running): the host store's own
reset frees every slot, pinned and pending ones included, so it must not run
while a copy may still use one. The manager forgets every block at once
(lookups miss, loads get no slot) and remembers, per key, the stores and
loads that were in flight (counted in reset_inflight); it defers the store's
reset until they have all ended, and refuses every store meanwhile (None,
counted in stores_refused), so no slot is handed out while an old copy may
still write or read it. A transfer ends for the manager either with its
completion, which then counts as stale and changes nothing (in particular it
never commits or unpins anything of a later transfer: none can have been
prepared meanwhile), or with the next on_schedule_end: vLLM's
OffloadingConnector, which calls that hook every step, drops the
completions of the transfers in flight at a reset and has its workers wait
for them (jobs_to_flush) before it starts any transfer it prepares later.
The assumption: every transfer prepared before a reset is completed once
after it, or the caller calls on_schedule_end with the connector's flush
semantics; a caller that does neither keeps stores refused.

A load the manager could not serve in full (slot -1: a miss, a key
collision, a reset between lookup and load, a fault) is copied without
those blocks and reported failed by the worker (TransferResult.success
False), never as a success that would leave vLLM attending over GPU
blocks never filled. vLLM 0.32's worker connector does not handle failed
jobs (it asserts success), so such a load stops the engine with that
assertion rather than serving wrong output; vLLM schedules a load only
for what lookup found in the same step, so it takes a fault or a key
collision (both logged and counted).

This module imports without vLLM installed: the vLLM classes
(KvplugOffloadingSpec, KvplugOffloadingManager, KvplugOffloadingWorker,
KvplugLoadStoreSpec) are built on first access, which imports vLLM. The
worker's copy engine (BlockCopier, plan_rows) needs torch only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from . import _lib
from .hoststore import PENDING, RESIDENT, HostStore, key64

logger = logging.getLogger("kvplug.vllm")

__all__ = ["BlockCopier", "plan_rows", "offload_key64", "KvplugOffloadingSpec", "KvplugOffloadingManager",
           "KvplugOffloadingWorker", "KvplugLoadStoreSpec"]

_LAZY = ("KvplugOffloadingSpec", "KvplugOffloadingManager", "KvplugOffloadingWorker", "KvplugLoadStoreSpec")
_build_lock = threading.Lock()


def offload_key64(key: bytes) -> int:
    """The host store key of a vLLM OffloadKey (block hash + group index)."""
    return key64(bytes(key))


# --------------------------------------------------------------------------
# Worker side: the copy engine (torch only)
# --------------------------------------------------------------------------


def plan_rows(gpu_block_ids: Sequence[int], group_sizes: Sequence[int], block_indices: Sequence[int],
              host_slots: Sequence[int], blocks_per_chunk: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Per KV cache group, the (gpu_rows, host_rows) of one transfer in
    vLLM's terms (GPULoadStoreSpec and the host spec): group g's
    group_sizes[g] GPU blocks are logical blocks block_indices[g]... of the
    request; host slot s holds blocks_per_chunk consecutive blocks, host
    row s * blocks_per_chunk + j, so a group's first chunk may start
    block_indices[g] % blocks_per_chunk rows in. Host rows of a slot -1 (a
    load the store could not serve) are -1."""
    bpc = int(blocks_per_chunk)
    gpu = np.asarray(gpu_block_ids, dtype=np.int64).reshape(-1)
    slots = np.asarray(host_slots, dtype=np.int64).reshape(-1)
    out: List[Tuple[np.ndarray, np.ndarray]] = []
    g_off = h_off = 0
    for gs, bi in zip(group_sizes, block_indices):
        gs = int(gs)
        if gs == 0:
            out.append((np.empty(0, np.int64), np.empty(0, np.int64)))
            continue
        skip = int(bi) % bpc
        nchunks = -(-(gs + skip) // bpc)
        if g_off + gs > len(gpu) or h_off + nchunks > len(slots):
            raise _lib.InvalidArgumentError(f"transfer spec too short: group of {gs} blocks from block {bi} needs {nchunks} host "
                                            f"chunks past {h_off} of {len(slots)} and GPU blocks past {g_off} of {len(gpu)}")
        s = slots[h_off:h_off + nchunks]
        rows = (s[:, None] * bpc + np.arange(bpc, dtype=np.int64)[None, :])
        rows[s < 0, :] = -1
        out.append((gpu[g_off:g_off + gs], rows.reshape(-1)[skip:skip + gs]))
        g_off += gs
        h_off += nchunks
    if g_off != len(gpu) or h_off != len(slots):
        raise _lib.InvalidArgumentError(f"transfer spec mismatch: {len(gpu)} GPU blocks and {len(slots)} host chunks, "
                                        f"the groups use {g_off} and {h_off}")
    return out


class BlockCopier:
    """Moves whole pages between an engine's paged KV tensors and host row
    tensors, one batch a transfer: per tensor, one gather on the source side
    and one scatter on the destination side.

    device_tensors[t] is a 2-D byte view [num_blocks, page_bytes] of an
    engine's KV tensor (rows may be strided, as vLLM's canonical views are);
    host_tensors[t] is [num_host_rows, page_bytes]; group_tensors[g] lists
    the tensors of KV cache group g. With CUDA device tensors the copies run
    on a side stream, after the engine's current stream (so a store reads
    what the forward pass wrote), and a transfer finishes when its event has
    passed (a store's host rows are written then); with CPU tensors they
    run at once. With tier_copier (a kvplug.TierCopier over the same
    tensors and the host region the host tensors view, for every tensor of
    every op) a transfer is one launch of kvplug's batched copy kernel, the
    host rows written and read in place; otherwise the batched copy is
    torch's (kvplug._torchcopy: on CUDA, index_select, one host-device copy
    through a pinned staging tensor, index_copy_).
    BlockCopier.for_views builds either."""

    def __init__(self, device_tensors: Sequence[Any], host_tensors: Sequence[Any],
                 group_tensors: Sequence[Sequence[int]], tier_copier: Any = None) -> None:
        import torch

        from . import _torchcopy

        self._torch = torch
        self._tc = _torchcopy
        self.tier_copier = tier_copier
        if len(device_tensors) != len(host_tensors):
            raise _lib.InvalidArgumentError(f"{len(device_tensors)} device tensors and {len(host_tensors)} host tensors")
        for i, (d, h) in enumerate(zip(device_tensors, host_tensors)):
            if d.dim() != 2 or h.dim() != 2 or d.shape[1] != h.shape[1] or d.dtype != h.dtype:
                raise _lib.InvalidArgumentError(f"tensor {i}: device {tuple(d.shape)} {d.dtype} and host {tuple(h.shape)} {h.dtype} "
                                                "must be 2-D rows of one page size and dtype")
            if h.device.type != "cpu":
                raise _lib.InvalidArgumentError(f"tensor {i}: host tensor on {h.device}")
        self.device_tensors = list(device_tensors)
        self.host_tensors = list(host_tensors)
        self.group_tensors = [list(g) for g in group_tensors]
        self._cuda = bool(self.device_tensors) and self.device_tensors[0].device.type == "cuda"
        self._streams: Dict[bool, Any] = {}
        self.last_skipped = 0  # pairs the last transfer skipped (host row -1)
        # job id -> (event or None, bytes, start time, staged copies to finish after the event)
        self._jobs: Dict[int, Tuple[Any, int, float, List[Any]]] = {}
        self._order: List[int] = []
        self._done_early: List[Tuple[int, int, float]] = []  # finished by wait(), reported by finished()

    @classmethod
    def for_views(cls, device_tensors: Sequence[Any], num_rows: int, group_tensors: Sequence[Sequence[int]],
                  pin_memory: bool = False, use_library: Optional[bool] = None) -> "BlockCopier":
        """A copier with num_rows host rows per tensor. When every tensor has
        one page size and stride (a multiple of 16 bytes) and every group
        uses every tensor, the host rows are one region, row r holding each
        tensor's page in turn (the layout of kvplug's host slots), and on
        CUDA (use_library None or True) kvplug's TierCopier, which
        page-locks the region, moves them; otherwise each tensor gets rows
        of its own, in pinned memory when pin_memory, and torch moves them."""
        import torch

        pages = {int(t.shape[1]) for t in device_tensors}
        strides = {int(t.stride(0)) for t in device_tensors}
        n = len(device_tensors)
        one_region = (len(pages) == 1 and len(strides) == 1 and all(len(set(g)) == n for g in group_tensors)
                      and next(iter(pages)) % 16 == 0 and next(iter(strides)) % 16 == 0)
        cuda = n > 0 and device_tensors[0].device.type == "cuda"
        if use_library is None:
            use_library = cuda
        if not one_region:
            if use_library and cuda:
                logger.info("kvplug: KV tensors of several page sizes or groups; torch copies the blocks")
            host = [torch.zeros((num_rows, int(t.shape[1])), dtype=torch.int8, pin_memory=pin_memory)
                    for t in device_tensors]
            return cls(device_tensors, host, group_tensors)
        page = next(iter(pages))
        region = np.zeros((num_rows, n * page), dtype=np.uint8)
        rows = torch.from_numpy(region).view(torch.int8)
        host = [rows[:, i * page:(i + 1) * page] for i in range(n)]
        tier = None
        if use_library and cuda and num_rows > 0:
            from .tiercopy import TierCopier

            tier = TierCopier(list(device_tensors), None, host=region)
        copier = cls(device_tensors, host, group_tensors, tier_copier=tier)
        copier._region = region  # kept alive with the copier
        return copier

    def _stream(self, store: bool) -> Any:
        s = self._streams.get(store)
        if s is None:
            s = self._streams[store] = self._torch.cuda.Stream(device=self.device_tensors[0].device)
        return s

    def transfer(self, job_id: int, rows: Sequence[Tuple[np.ndarray, np.ndarray]], store: bool) -> int:
        """Starts job job_id: for each group g, rows[g] = (device rows, host
        rows) (plan_rows); store copies device -> host, else host -> device.
        Pairs whose host row is -1 are skipped (counted in last_skipped).
        Returns the bytes it moves."""
        torch, _tc = self._torch, self._tc
        per_tensor: Dict[int, Tuple[List[np.ndarray], List[np.ndarray]]] = {}
        self.last_skipped = 0
        for g, (dev_rows, host_rows) in enumerate(rows):
            if len(dev_rows) == 0:
                continue
            keep = host_rows >= 0
            if not keep.all():
                self.last_skipped += len(keep) - int(np.count_nonzero(keep))
                dev_rows, host_rows = dev_rows[keep], host_rows[keep]
            for t in self.group_tensors[g]:
                d, h = per_tensor.setdefault(t, ([], []))
                d.append(dev_rows)
                h.append(host_rows)
        nbytes = 0
        staged: List[Any] = []  # kvplug._torchcopy.Staged, finished once the event has passed
        event = None
        start = time.monotonic()
        if self.tier_copier is not None and per_tensor:
            # Every group uses every tensor here (for_views): one op per block.
            d = np.concatenate([r[0] for r in rows if len(r[0])])
            h = np.concatenate([r[1] for r in rows if len(r[0])])
            keep = h >= 0
            d, h = d[keep], h[keep]
            stream = self._stream(store)
            dev = self.device_tensors[0].device
            stream.wait_stream(torch.cuda.current_stream(dev))
            if store:
                self.tier_copier.run(stream=stream, demote=(d, h))
            else:
                self.tier_copier.run(stream=stream, reload=(h, d))
            event = torch.cuda.Event()
            event.record(stream)
            nbytes = len(d) * sum(int(t.shape[1]) for t in self.device_tensors)
        elif self._cuda and per_tensor:
            stream = self._stream(store)
            dev = self.device_tensors[0].device
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for t, (d, h) in per_tensor.items():
                    stage = (_tc.stage_store if store else _tc.stage_load)(
                        self.device_tensors[t], np.concatenate(d), self.host_tensors[t], np.concatenate(h))
                    staged.append(stage)
                    nbytes += stage.nbytes
                event = torch.cuda.Event()
                event.record(stream)
        else:
            for t, (d, h) in per_tensor.items():
                dt, ht = self.device_tensors[t], self.host_tensors[t]
                drows = np.concatenate(d)
                _tc.copy_rows([(dt, ht)], 0, drows, np.concatenate(h), store=store, non_blocking=False)
                nbytes += len(drows) * dt.shape[1] * dt.element_size()
        self._jobs[job_id] = (event, nbytes, start, staged)
        self._order.append(job_id)
        return nbytes

    def _finish(self, job_id: int) -> Tuple[int, int, float]:
        event, nbytes, start, staged = self._jobs.pop(job_id)
        self._order.remove(job_id)
        for stage in staged:
            stage.finish()  # a store's host rows
        return job_id, nbytes, time.monotonic() - start

    def finished(self) -> List[Tuple[int, int, float]]:
        """(job id, bytes, seconds) of the jobs that have finished since the
        last call, in submission order."""
        done = []
        for job_id in list(self._order):
            event = self._jobs[job_id][0]
            if event is not None and not event.query():
                continue
            done.append(self._finish(job_id))
        done, self._done_early = self._done_early + done, []
        return done

    def wait(self, job_ids: Iterable[int]) -> None:
        """Blocks until the given jobs (those still running) have finished."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            if job[0] is not None:
                job[0].synchronize()
            self._done_early.append(self._finish(job_id))

    def shutdown(self) -> None:
        self.wait(list(self._order))
        if self.tier_copier is not None:
            self.tier_copier.close()
            self.tier_copier = None


# --------------------------------------------------------------------------
# vLLM classes, built on first access
# --------------------------------------------------------------------------


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        with _build_lock:
            if name not in globals():
                globals().update(_build())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Counters of the scheduler side, and the metrics they are published as.
_COUNTERS = ("lookups", "lookup_hits", "lookup_pending", "lookup_misses", "key_collisions", "loads_prepared",
             "load_misses", "stores_prepared", "stores_skipped_present", "stores_refused", "stores_completed",
             "stores_failed", "stale_completions", "evictions", "resets", "reset_inflight", "errors")


def _build() -> Dict[str, Any]:
    import torch  # noqa: F401 (vLLM's classes need it)
    from vllm.v1.kv_offload.base import (
        CanonicalKVCaches,
        GPULoadStoreSpec,
        LoadStoreSpec,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingGaugeMetadata,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        OffloadKey,
        PrepareStoreOutput,
        ReqContext,
        RequestOffloadingContext,
        TransferResult,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.base import OffloadingHistogramMetadata, get_offload_group_idx
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    class KvplugLoadStoreSpec(CPULoadStoreSpec):
        """Host slots of kvplug's store (block_ids: slot numbers; -1 for a
        block the store could not pin)."""

    class _Accessed:
        """The keys one request loaded or offered to store, in the order seen
        (ReqContext state), for its recency update when it finishes."""

        def __init__(self, owner: Any, generation: int) -> None:
            self.owner, self.generation = owner, generation
            self.keys: List[OffloadKey] = []
            self.seen: set = set()
            self.finished = False

    class KvplugOffloadingManager(OffloadingManager):
        """vLLM's OffloadingManager over a kvplug HostStore (bookkeeping
        only: the workers own the memory). See the module docstring."""

        def __init__(self, num_slots: int, enable_events: bool = False) -> None:
            self.medium = Medium.CPU
            self.num_slots = int(num_slots)
            self._store: Optional[HostStore] = HostStore(num_slots=self.num_slots) if self.num_slots > 0 else None
            self._keys: Dict[int, OffloadKey] = {}  # store key -> vLLM key, pending and resident blocks
            self._pending: set = set()  # store keys with a store in flight
            self._pins: Counter = Counter()  # store key -> loads in flight
            # Transfers in flight at a reset and not ended since (see reset_cache):
            # store key -> stores, and store key -> loads.
            self._stale_stores: Counter = Counter()
            self._stale_loads: Counter = Counter()
            # True while the host store still holds the blocks of before the
            # last reset: its own reset waits for the transfers above.
            self._draining = False
            self.events: Optional[List[OffloadingEvent]] = [] if enable_events else None
            self._counts: Counter = Counter()
            self._published: Counter = Counter()
            self._alloc_sizes: List[int] = []
            self._generation = 0

        # -- helpers --

        def _hash(self, key: OffloadKey) -> Optional[int]:
            """The store key of key, or None when another vLLM key holds it."""
            h = offload_key64(key)
            other = self._keys.get(h)
            if other is not None and other != key:
                self._counts["key_collisions"] += 1
                return None
            return h

        def _accessed(self, req_context: ReqContext) -> Any:
            st = req_context.get_state(_Accessed)
            if st is None or st.owner is not self or st.generation != self._generation:
                st = _Accessed(self, self._generation)
                req_context.set_state(st)
            return st

        def _record(self, req_context: ReqContext, keys: Iterable[OffloadKey]) -> None:
            st = self._accessed(req_context)
            if st.finished:
                return
            for k in keys:
                if k not in st.seen:
                    st.seen.add(k)
                    st.keys.append(k)

        def _fault(self, what: str, exc: BaseException) -> None:
            self._counts["errors"] += 1
            logger.exception("kvplug offloading manager: %s failed: %s", what, exc)

        def _end_drain(self) -> None:
            """Resets the host store once no transfer of before the last
            reset_cache can still use a slot; until then (or while the reset
            fails) lookups miss, loads get no slot and stores are refused."""
            if not self._draining or self._stale_stores or self._stale_loads:
                return
            try:
                if self._store is not None:
                    self._store.reset()
                self._draining = False
            except Exception as exc:
                self._fault("reset_cache", exc)

        @staticmethod
        def _take(c: Counter, h: int) -> bool:
            """Consumes one count of h in c; False when there is none."""
            n = c.get(h, 0)
            if n <= 0:
                return False
            if n == 1:
                del c[h]
            else:
                c[h] = n - 1
            return True

        def counters(self) -> Dict[str, int]:
            """The scheduler side's counters since creation (_COUNTERS)."""
            return {name: self._counts[name] for name in _COUNTERS}

        def store_stats(self) -> Any:
            """The host store's statistics (kvplug.hoststore.HostStoreStats), or None without slots."""
            return self._store.stats() if self._store is not None else None

        # -- OffloadingManager --

        def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
            self._accessed(req_context)
            return RequestOffloadingContext()

        def on_request_finished(self, req_context: ReqContext) -> None:
            """The blocks the request loaded or stored become the most recently
            used, the prefix head first (it is the part other prompts share),
            ordered by the positions the scheduler recorded, as vLLM's CPU
            manager orders them."""
            try:
                st = req_context.get_state(_Accessed)
                if st is None or st.owner is not self or st.generation != self._generation or st.finished:
                    return
                st.finished = True
                groups: Dict[int, List[OffloadKey]] = {}
                for k in st.keys:
                    groups.setdefault(get_offload_group_idx(k), []).append(k)
                ordered = [k for g in sorted(groups) for k in groups[g]]
                pos = {k: req_context.get_offload_key_position(k) for k in ordered}
                if all(p is not None for p in pos.values()):
                    ordered.sort(key=pos.__getitem__)  # head to tail across the groups
                if self._store is not None:
                    self._store.touch([offload_key64(k) for k in ordered])
            except Exception as exc:
                self._fault("on_request_finished", exc)

        def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
            self._counts["lookups"] += 1
            try:
                # While draining, the store still holds the blocks of before the reset.
                h = self._hash(key) if self._store is not None and not self._draining else None
                if h is not None:
                    state, _ = self._store.state([h])
                    if state[0] == RESIDENT:
                        self._counts["lookup_hits"] += 1
                        return LookupResult.HIT
                    if state[0] == PENDING:
                        self._counts["lookup_pending"] += 1
                        return LookupResult.HIT_PENDING
            except Exception as exc:  # a fault is a miss, never the scheduler's exception
                self._fault("lookup", exc)
            self._counts["lookup_misses"] += 1
            return LookupResult.MISS

        def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
            return CacheHitSource.HOST

        def prepare_load(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
            keys = list(keys)
            slots = np.full(len(keys), -1, np.int32)
            try:
                hs = [self._hash(k) for k in keys]
                idx = [i for i, h in enumerate(hs) if h is not None]
                if idx and self._store is not None and not self._draining:
                    sl, _ = self._store.pin([hs[i] for i in idx])
                    for i, s in zip(idx, sl):
                        slots[i] = s
                        if s >= 0:
                            self._pins[hs[i]] += 1
            except Exception as exc:
                self._fault("prepare_load", exc)
            self._record(req_context, [k for k, s in zip(keys, slots) if s >= 0])
            misses = int((slots < 0).sum())
            self._counts["loads_prepared"] += len(keys) - misses
            if misses:
                # vLLM loads only what lookup found in this same step, so this
                # is a caller's bug or a reset in between: the worker skips
                # those blocks and reports the transfer failed (see the
                # module docstring), and the count says so.
                self._counts["load_misses"] += misses
                logger.error("kvplug offloading manager: %d of %d blocks to load are not in the host store", misses,
                             len(keys))
            return KvplugLoadStoreSpec(slots.tolist())

        def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
            if self._store is None:
                return
            try:
                hs = [h for h in (offload_key64(k) for k in keys) if h in self._keys]
                self._store.touch(hs)
            except Exception as exc:
                self._fault("touch", exc)

        def complete_load(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
            try:
                unpin, stale = [], 0
                for k in keys:
                    h = offload_key64(k)
                    if self._take(self._stale_loads, h):
                        # A load of before the last reset: no load of h can have
                        # been prepared since (see reset_cache), so this is its
                        # completion, not that of a later load holding a pin.
                        self._counts["stale_completions"] += 1
                        stale += 1
                    elif self._take(self._pins, h):
                        unpin.append(h)
                    else:
                        self._counts["stale_completions"] += 1
                if unpin and self._store is not None:
                    self._store.unpin(unpin)
                if stale:
                    self._end_drain()
            except Exception as exc:
                self._fault("complete_load", exc)

        def prepare_store(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> Optional[PrepareStoreOutput]:
            keys = list(keys)
            empty = PrepareStoreOutput(keys_to_store=[], store_spec=KvplugLoadStoreSpec([]), evicted_keys=[])
            if not keys:
                return empty
            self._end_drain()
            if self._store is None or self._draining:
                # While draining, any slot may still be under a copy of before
                # the reset (see reset_cache).
                self._counts["stores_refused"] += len(keys)
                return None
            try:
                cand, hs = [], []
                for k in keys:
                    h = self._hash(k)
                    if h is None:
                        self._counts["stores_skipped_present"] += 1
                        continue
                    cand.append(k)
                    hs.append(h)
                if not cand:
                    return empty
                new = {h for h in hs if h not in self._keys}
                if new:
                    self._alloc_sizes.append(len(new))
                r = self._store.try_reserve(hs)
                if r is None:
                    self._counts["stores_refused"] += len(cand)
                    return None
                self._record(req_context, cand)
                slots, evicted = r
                evicted_keys = []
                for e in evicted.tolist():
                    k = self._keys.pop(e, None)
                    self._pins.pop(e, None)
                    if k is not None:
                        evicted_keys.append(k)
                to_store, store_slots = [], []
                for k, h, s in zip(cand, hs, slots.tolist()):
                    if s < 0:
                        self._counts["stores_skipped_present"] += 1
                        continue
                    self._keys[h] = k
                    self._pending.add(h)
                    to_store.append(k)
                    store_slots.append(s)
                self._counts["stores_prepared"] += len(to_store)
                self._counts["evictions"] += len(evicted_keys)
                if evicted_keys and self.events is not None:
                    self.events.append(OffloadingEvent(keys=evicted_keys, medium=self.medium, removed=True))
                return PrepareStoreOutput(keys_to_store=to_store, store_spec=KvplugLoadStoreSpec(store_slots),
                                          evicted_keys=evicted_keys)
            except Exception as exc:
                self._fault("prepare_store", exc)
                return None

        def complete_store(self, keys: Iterable[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
            try:
                done_keys, hs, stale = [], [], 0
                for k in keys:
                    h = offload_key64(k)
                    if self._take(self._stale_stores, h):
                        # A store of before the last reset: its slot was not
                        # handed out again (see reset_cache) and no store of h
                        # can have been prepared since, so this completion
                        # commits nothing.
                        self._counts["stale_completions"] += 1
                        stale += 1
                    elif h in self._pending and self._keys.get(h) == k:
                        self._pending.discard(h)
                        done_keys.append(k)
                        hs.append(h)
                    # else: stored before (resident: the connector completes
                    # a job's every key), or dropped by a reset: nothing to do.
                if hs:
                    n = self._store.complete(hs, failed=not success) if self._store is not None else 0
                    self._counts["stale_completions"] += len(hs) - n
                    if success:
                        self._counts["stores_completed"] += n
                        if self.events is not None:
                            self.events.append(OffloadingEvent(keys=done_keys, medium=self.medium, removed=False))
                    else:
                        self._counts["stores_failed"] += n
                        for h in hs:
                            self._keys.pop(h, None)
                if stale:
                    self._end_drain()
            except Exception as exc:
                self._fault("complete_store", exc)

        def take_events(self) -> Iterable[OffloadingEvent]:
            if self.events is not None:
                events, self.events = self.events, []
                yield from events

        def reset_cache(self) -> None:
            """Forgets every block now; the host store's own reset (which
            frees pinned and pending slots too) waits until the transfers in
            flight have ended (see the module docstring)."""
            inflight = len(self._pending) + sum(self._pins.values())
            self._stale_stores.update(self._pending)
            self._stale_loads.update(self._pins)
            self._counts["reset_inflight"] += inflight
            self._keys.clear()
            self._pending.clear()
            self._pins.clear()
            self._generation += 1
            self._counts["resets"] += 1
            self._draining = True
            self._end_drain()

        def on_schedule_end(self, context: Any) -> None:
            """The end of a scheduler step. vLLM's OffloadingConnector calls
            it every step, and on reset_cache it drops the completions of the
            transfers then in flight and has its workers wait for them
            (jobs_to_flush) before any transfer of this step or a later one:
            those transfers will not end here, and no slot handed out from now
            on is used before they have finished. So the first step after a
            reset ends the drain."""
            if not self._draining:
                return
            self._stale_stores.clear()
            self._stale_loads.clear()
            self._end_drain()

        def get_stats(self) -> Any:
            try:
                from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

                stats = OffloadingConnectorStats()
                for name in _COUNTERS:
                    delta = self._counts[name] - self._published[name]
                    stats.increase_counter(f"kvplug:{name}", delta)
                    self._published[name] = self._counts[name]
                s = self.store_stats()
                usage = (s.resident + s.pending) / s.num_slots if s is not None and s.num_slots else 0.0
                stats.set_gauge("kvplug:host_usage_perc", usage)
                # vLLM's CPU offloading gauges, with their meaning: the share
                # of slots pinned by transfers in flight (stores, loads).
                pinned = s.pinned / s.num_slots if s is not None and s.num_slots else 0.0
                write = s.pending / s.num_slots if s is not None and s.num_slots else 0.0
                stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, pinned)
                stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
                stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(pinned - write, 0.0))
                for n in self._alloc_sizes:
                    stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, n)
                self._alloc_sizes.clear()
                return stats
            except Exception as exc:
                self._fault("get_stats", exc)
                return None

        def shutdown(self) -> None:
            if self._store is not None:
                self._store.close()
                self._store = None

    class KvplugOffloadingWorker(OffloadingWorker):
        """Moves blocks between vLLM's canonical KV tensors (one byte view
        [num_blocks, page] per tensor) and this worker's host rows
        (num_slots * blocks_per_chunk rows per tensor) with BlockCopier. A
        transfer with blocks on host slot -1 (the manager could not serve
        them) moves the others and is reported failed."""

        def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_slots: int,
                     pin_memory: Optional[bool] = None) -> None:
            self.blocks_per_chunk = int(blocks_per_chunk)
            device = []
            for ct in kv_caches.tensors:
                t = ct.tensor
                if t.dtype != torch.int8:
                    t = t.view(torch.int8)
                device.append(t.view(t.shape[0], -1))
            cuda = bool(device) and device[0].device.type == "cuda"
            if pin_memory is None:
                pin_memory = cuda
            groups = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
            # Host row r = slot r // blocks_per_chunk, block r % blocks_per_chunk of its chunk.
            self.copier = BlockCopier.for_views(device, num_slots * self.blocks_per_chunk, groups,
                                                pin_memory=pin_memory)
            self._incomplete: set = set()  # job ids with blocks the copy skipped (host slot -1)

        def _submit(self, job_id: int, gpu: GPULoadStoreSpec, host: Any, store: bool) -> bool:
            rows = plan_rows(gpu.block_ids, gpu.group_sizes, gpu.block_indices, host.block_ids,
                             self.blocks_per_chunk)
            # The copy skips blocks on slot -1 (a miss, a key collision, a reset
            # between lookup and load, a fault in prepare_load). A load that
            # reported success would leave vLLM attending over GPU blocks never
            # filled, so the job fails (see the module docstring); a store
            # fails so that its slots are given back.
            self.copier.transfer(job_id, rows, store)
            skipped = self.copier.last_skipped
            if skipped:
                logger.warning("kvplug offloading worker: %s job %d: %d blocks have no host slot; the transfer is "
                               "reported failed", "store" if store else "load", job_id, skipped)
                self._incomplete.add(job_id)
            return True

        def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
            return self._submit(job_id, src_spec, dst_spec, store=True)

        def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
            return self._submit(job_id, dst_spec, src_spec, store=False)

        def get_finished(self) -> List[TransferResult]:
            out = []
            for j, n, s in self.copier.finished():
                ok = j not in self._incomplete
                self._incomplete.discard(j)
                out.append(TransferResult(job_id=j, success=ok, transfer_size=n, transfer_time=s))
            return out

        def wait(self, job_ids: set) -> None:
            self.copier.wait(job_ids)

        def shutdown(self) -> None:
            self.copier.shutdown()

    class KvplugOffloadingSpec(OffloadingSpec):
        """The OffloadingSpec the connector loads by spec_name and
        spec_module_path (see the module docstring)."""

        @classmethod
        def build_metric_definitions(cls, extra_config: Dict[str, Any]) -> Dict[str, Any]:
            defs: Dict[str, Any] = {f"kvplug:{name}": OffloadingCounterMetadata(
                documentation=f"kvplug host store: {name.replace('_', ' ')}") for name in _COUNTERS}
            defs["kvplug:host_usage_perc"] = OffloadingGaugeMetadata(
                documentation="kvplug host store: fraction of slots holding or receiving a block")
            for name, doc in ((CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, "pinned by transfers in flight"),
                              (CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, "pinned by stores in flight"),
                              (CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, "pinned by loads in flight")):
                defs[name] = OffloadingGaugeMetadata(documentation=f"Fraction of kvplug host slots {doc}")
            defs[CPUOffloadingMetrics.CPU_ALLOCATION_SIZE] = OffloadingHistogramMetadata(
                documentation="Blocks each prepare_store call asks host slots for",
                buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144))
            return defs

        def __init__(self, config: OffloadingConfig) -> None:
            super().__init__(config)
            host_bytes = self.extra_config.get("kvplug_host_bytes", self.extra_config.get("cpu_bytes_to_use"))
            if not host_bytes:
                raise _lib.InvalidArgumentError("kvplug: kv_connector_extra_config needs kvplug_host_bytes (host memory for "
                                                "offloaded blocks, all workers together)")
            if config.canonical_layout:
                raise _lib.InvalidArgumentError("kvplug: canonical_layout is not supported; leave it off")
            world = max(int(config.parallel.world_size), 1)
            per_worker_chunk = int(config.worker_kv_bytes_per_block) * self.blocks_per_chunk
            self.worker_chunk_bytes = per_worker_chunk
            self.num_slots = int(host_bytes) // (per_worker_chunk * world) if per_worker_chunk > 0 else 0
            self._manager: Optional[KvplugOffloadingManager] = None
            self._worker: Optional[KvplugOffloadingWorker] = None

        def get_manager(self) -> OffloadingManager:
            if self._manager is None:
                self._manager = KvplugOffloadingManager(
                    self.num_slots, enable_events=self.kv_events_config.enable_kv_cache_events)
            return self._manager

        def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
            if self._worker is None:
                self._worker = KvplugOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_slots)
            return self._worker

    return {
        "KvplugLoadStoreSpec": KvplugLoadStoreSpec,
        "KvplugOffloadingManager": KvplugOffloadingManager,
        "KvplugOffloadingWorker": KvplugOffloadingWorker,
        "KvplugOffloadingSpec": KvplugOffloadingSpec,
    }
