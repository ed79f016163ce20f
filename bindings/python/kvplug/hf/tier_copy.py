"""The host KV tier of a PagedKVCache: the copies between the paged K/V and
the manager's host slots (kvplug.tier), driven once per step.

A copier moves whole blocks, every layer's K and V:

    copier.run(batch, stream)   # enqueues batch's reloads (host slot -> GPU
                                # block) and demotions (GPU block -> host
                                # slot) on `stream` (None on the CPU)
    copier.close()              # before the manager frees the host memory

TorchTierCopier does it with torch (kvplug._torchcopy.copy_rows, kvplug's
one torch copy path): the host region registered as pinned memory
(cudaHostRegister), demotions gathered with index_select into a
device staging tensor and copied to the host slots non_blocking, reloads
the reverse (host slots -> staging -> index_copy_ into the blocks); one copy
per run of consecutive host slots, not one per block and layer. On the CPU
the copies are plain tensor copies. A host slot holds its block as
[layers, 2 (K, V), block_size, kv_heads, head_dim] of the cache's dtype.
kvplug.TierCopier (the library's batched copy kernel, every layer's K and
V of a batch in one launch) has the same contract and replaces it on CUDA
caches; with tier_copier="copy-engine" its stores go to the copy engines
(cuMemcpyBatchAsync), leaving the SMs to the step's kernels.

HostTier drives a step: step(stream) completes the batches whose copies
have finished (CUDA events, polled, never waited on), calls flush_copies,
runs the copier (demotions, then reloads, each between timing events) on
the step's stream (demotions on a side stream with overlap=True) and keeps
the batch's events; on the CPU the batch completes at once. PagedKVCache.schedule polls too, so that blocks whose demotion has
landed are free for the step's admissions.

Early loads (PagedKVCache(early_loads=True), the default): a schedule that
admits a prompt whose prefix continues in the host tier leaves it out of
its step's batch and calls load_early(stream, owners) at once: the flush's
reloads go on a load stream (after the step's stream, which holds the
flush's demotions), one copier run per admitted sequence between its own
events, while the step's forward pass runs on the step's stream; the
sequence joins the next step, whose stream waits for those events
(join_loads, from step: on the device, never on the host). A sequence of
the current step that reads blocks being loaded (a prompt that shares a
prefix with one being loaded) has its step wait for them
(join_now). Each admission's loads are recorded (LoadRecord: time, whether
they overlapped a forward pass, whether they had landed when joined).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Union

import numpy as np
import torch

import kvplug

from .._torchcopy import as_bytes, copy_rows, is_fp8, pin as pin_host, unpin

__all__ = ["TorchTierCopier", "HostTier", "LoadRecord", "make_copier", "block_bytes", "manager_takes"]


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block's K and V over all layers: one host slot. An FP8
    cache's slot also holds the block's per-token-head float32 scales, after
    its K/V bytes (the tier copier's layout)."""
    n = num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return n + (num_layers * 2 * block_size * num_kv_heads * 4 if is_fp8(dtype) else 0)


def manager_takes(kwarg: str) -> bool:
    """Whether this binding's kvplug.Manager takes the keyword argument."""
    import inspect

    try:
        return kwarg in inspect.signature(kvplug.Manager.__init__).parameters
    except (TypeError, ValueError):
        return False


class TorchTierCopier:
    """Copies blocks between `kv` ([layers, 2, num_blocks, block_size,
    kv_heads, head_dim], PagedKVCache.kv) and `host` (uint8 [slots,
    slot_bytes], Manager.host_tier_memory()) with torch. pin=True registers
    the host region as pinned memory on a CUDA cache (falls back, with a
    warning, to pageable copies if that fails); close() unregisters it."""

    def __init__(self, kv: torch.Tensor, host: np.ndarray, *, pin: bool = True, scales: Optional[torch.Tensor] = None) -> None:
        L, two, _, bs, kvh, hd = kv.shape
        self.kv = kv
        self.scales = scales  # FP8: [layers, 2, num_blocks, block_size, kv_heads] float32, copied with their blocks
        if is_fp8(kv.dtype) != (scales is not None):
            raise kvplug.InvalidArgumentError("kvplug.hf: an FP8 cache's host tier copies its scales (scales=), "
                                              "and only an FP8 cache has them")
        self.block_shape = (L, two, bs, kvh, hd)
        want = block_bytes(L, bs, kvh, hd, kv.dtype)
        if host.ndim != 2 or host.dtype != np.uint8 or host.shape[1] != want:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: host tier slots of {host.shape[1] if host.ndim == 2 else '?'} bytes; "
                                              f"a block of this cache is {want} bytes")
        self._host_np = host  # the library's memory, kept alive by this array
        raw = torch.from_numpy(host)
        kv_bytes = L * two * bs * kvh * hd * kv.element_size()
        self.host = raw[:, :kv_bytes].view(kv.dtype).view(host.shape[0], *self.block_shape)
        self.host_scales = None if scales is None else raw[:, kv_bytes:].view(torch.float32).view(host.shape[0], L, two, bs, kvh)
        self.device = kv.device
        self.cuda = kv.device.type == "cuda"
        self.pinned = bool(self.cuda and pin and pin_host(host, "kvplug.hf", "the host tier"))

    def run(self, batch: kvplug.CopyBatch, stream: Any = None) -> None:
        """Enqueues batch's demotions, then its reloads, on `stream` (the
        current stream when None). The staging tensors are freed on that
        stream, so the caching allocator reuses them only after the copies."""
        if self.cuda:
            with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(self.device)):
                self._run(batch)
        else:
            self._run(batch)

    def _run(self, batch: kvplug.CopyBatch) -> None:
        # Demotions first: a reload may write a GPU block that a demotion of the batch reads (a block an
        # allocation evicted and gave to the reloading prompt, with the manager's demote_evicted).
        pairs = [(as_bytes(self.kv), as_bytes(self.host))]
        if self.scales is not None:
            pairs.append((self.scales, self.host_scales))
        copy_rows(pairs, 2, batch.demote_blocks, batch.demote_slots, store=True, non_blocking=self.cuda)
        copy_rows(pairs, 2, batch.reload_blocks, batch.reload_slots, store=False, non_blocking=self.cuda)

    def close(self) -> None:
        if self.pinned:
            self.pinned = False
            unpin(self._host_np)


CopierSpec = Union[None, str, Callable[[Any], Any]]


def make_copier(cache: Any, spec: CopierSpec = None) -> Any:
    """The copier of a PagedKVCache's host tier. spec None or "auto":
    kvplug.TierCopier on a CUDA cache, else TorchTierCopier; with
    write-through its stores go by the copy engines (where the driver has
    them; else, as without write-through, by the library's batched copy
    kernel), which leave the SMs to the step's kernels: the kernel's stores
    lengthen the steps they run beside by about their own time
    (bench/store_interference.py); "copy-engine": kvplug.TierCopier with
    its stores (demotions, write-through) on the copy engines, CUDA caches
    only; "torch": TorchTierCopier; a callable: spec(cache)."""
    if callable(spec):
        return spec(cache)
    if spec not in (None, "auto", "torch", "copy-engine"):
        raise kvplug.InvalidArgumentError(
            f"kvplug.hf: tier_copier must be 'auto', 'torch', 'copy-engine' or a callable, not {spec!r}")
    scales = cache.scales if cache.fp8 else None  # [layers, 2, num_blocks, block_size, kv_heads]
    if spec == "copy-engine" and cache.device.type != "cuda":
        raise kvplug.InvalidArgumentError("kvplug.hf: tier_copier='copy-engine' needs a CUDA cache")
    if spec != "torch" and cache.device.type == "cuda":
        kv = cache.kv  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        L = kv.shape[0]
        kw: Dict[str, Any] = {} if scales is None else dict(k_scales=[scales[i, 0] for i in range(L)],
                                                              v_scales=[scales[i, 1] for i in range(L)])
        layers = ([kv[i, 0] for i in range(L)], [kv[i, 1] for i in range(L)])
        if spec == "copy-engine" or cache.write_through > 0:
            try:
                return kvplug.TierCopier(*layers, manager=cache.manager, store_engine="copy-engine", **kw)
            except kvplug.UnsupportedError:
                if spec == "copy-engine":
                    raise
        return kvplug.TierCopier(*layers, manager=cache.manager, **kw)
    return TorchTierCopier(cache.kv, cache.manager.host_tier_memory(), scales=scales)


@dataclasses.dataclass
class LoadRecord:
    """One admission's host tier loads (Batch.loads; the engine keeps them
    per request)."""

    seq_id: int
    blocks: int  # GPU blocks reloaded (every layer group's)
    bytes: int
    deferred: bool  # admitted one step before it joined a forward pass (early loads)
    overlapped: bool = False  # ran on the load stream beside a forward pass that did not wait for them (CUDA)
    stream: int = 0  # the CUDA stream they ran on (cudaStream_t; 0 on the CPU)
    seconds: Optional[float] = None  # their copies' device time (CUDA events; CPU: wall time); None until landed
    hidden: Optional[bool] = None  # deferred on CUDA: landed before the step that reads them began (no wait)

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Load:
    """Early loads of one admitted sequence, until a step's stream waits for them."""

    blocks: np.ndarray  # int32: the GPU blocks they write
    event: Any  # CUDA event after the copies (None on the CPU: landed)
    record: Optional[LoadRecord]


@dataclasses.dataclass
class _InFlight:
    ticket: int
    r0: Any  # CUDA timing events on the step's stream: before and after the reloads
    r1: Any
    d0: Any  # before and after the demotions (on the side stream with overlap)
    d1: Any
    reload_bytes: int
    demote_bytes: int
    # The admissions' records whose loads the batch holds, with the timing events around them.
    loads: List[Any] = dataclasses.field(default_factory=list)

    def query(self) -> bool:
        return self.r1.query() and self.d1.query()

    def synchronize(self) -> None:
        self.r1.synchronize()
        self.d1.synchronize()


class HostTier:
    """Runs a manager's host tier copies for a PagedKVCache (see the module
    docstring). Counters: batches, reload/demote bytes and the seconds their
    copies took on the device (CUDA events; on the CPU, wall time).

    overlap (CUDA): demotions run on a side stream that first waits for the
    step's stream (the blocks' K/V written), so that their device-to-host
    copies overlap the step's forward pass instead of delaying it; their
    GPU blocks are held until the batch completes either way. Reloads are
    always on the step's stream, ahead of its attention, after the
    demotions (overlap off). A manager with demote_evicted needs overlap
    off: the blocks its allocations evicted are already their new owners'
    and only the step's stream order keeps their K/V until demoted."""

    def __init__(self, manager: kvplug.Manager, kv: torch.Tensor, copier: Any, slot_bytes: int, *,
                 overlap: bool = False) -> None:
        self.manager = manager
        self.copier = copier
        self.cuda = kv.device.type == "cuda"
        self.device = kv.device
        self.slot_bytes = slot_bytes
        self.overlap = bool(overlap) and self.cuda
        self._side: Any = None
        self._load_stream: Any = None  # early loads' stream (CUDA)
        self.fresh: List[_Load] = []  # early loads of the current schedule: its step must not read their blocks
        self.to_join: List[_Load] = []  # early loads the next step's stream waits for
        # (record, its sequence's GPU blocks) of admissions whose loads the next step's flush copies.
        self.pending_records: List[Any] = []
        self.in_flight: Deque[_InFlight] = collections.deque()
        # A batch with reloads that failed: its GPU blocks are cached without valid K/V (PagedKVCache refuses
        # to schedule until recover_from_failed_reloads).
        self.reloads_failed = False
        self.batches = 0
        self.reload_bytes = self.demote_bytes = 0
        self.reload_seconds = self.demote_seconds = 0.0
        self.reload_batches = 0
        self.closed = False

    # -- per step ---------------------------------------------------------------

    def poll(self) -> int:
        """Completes the batches whose copies have finished (in order);
        returns how many. Never waits."""
        n = 0
        q = self.in_flight
        while q and q[0].query():
            self._complete(q.popleft())
            n += 1
        return n

    def _landed(self, ticket: int, demote_bytes: int = 0) -> None:
        """Off CUDA: the copies of batch `ticket` (demote_bytes of them
        stores and demotions) are done (they ran on the host, in turn), so
        it completes at once."""
        self.manager.complete_copies(ticket)

    def _complete(self, f: _InFlight, failed: bool = False) -> None:
        if failed and f.reload_bytes:
            self.reloads_failed = True
        if not failed:
            if f.reload_bytes:
                self.reload_seconds += f.r0.elapsed_time(f.r1) * 1e-3
            if f.demote_bytes:
                self.demote_seconds += f.d0.elapsed_time(f.d1) * 1e-3
            for rec, e0, e1 in f.loads:
                rec.seconds = e0.elapsed_time(e1) * 1e-3
        self.manager.complete_copies(f.ticket, failed=failed)

    # -- early loads --------------------------------------------------------------

    def begin_schedule(self) -> None:
        """At the start of each schedule: the early loads issued before it
        are the next step's to wait for (its batch may read them)."""
        if self.fresh:
            self.to_join.extend(self.fresh)
            self.fresh = []

    def join_now(self, loads: List[_Load]) -> None:
        """The current step reads these early loads' blocks: its stream
        waits for them (they overlap nothing)."""
        if not loads:
            return
        ids = {id(f) for f in loads}
        self.fresh = [f for f in self.fresh if id(f) not in ids]
        for f in loads:
            if f.record is not None:
                f.record.overlapped = False
            self.to_join.append(f)

    def join_loads(self, stream: Any = None) -> None:
        """Makes `stream` (CUDA: the step's stream) wait for the early loads
        to join, on the device; notes whether each had landed already."""
        if not self.to_join:
            return
        if self.cuda:
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            for f in self.to_join:
                if f.record is not None and f.record.hidden is None and f.record.deferred:
                    f.record.hidden = bool(f.event.query())
                stream.wait_event(f.event)
        self.to_join = []

    def load_early(self, stream: Any, owners: List[Any]) -> Optional[kvplug.CopyBatch]:
        """At admission (PagedKVCache.schedule, after its last allocation):
        flushes the copies and enqueues the batch's demotions as step()
        does, and its reloads on the load stream, once `stream` (CUDA: the
        step's stream) has reached this point, one copier run per owner
        between its events. owners: (LoadRecord or None, int32 GPU blocks
        of that sequence); each reload goes with the owner holding its
        block. The loads are fresh (HostTier.fresh: the current step must
        not read their blocks) until the next schedule or join_now."""
        return self.step(stream, owners=owners)

    # -- per step -----------------------------------------------------------------

    def step(self, stream: Any = None, owners: Optional[List[Any]] = None) -> Optional[kvplug.CopyBatch]:
        """Once per step, after the step's admissions and before its
        attention: makes `stream` (CUDA: the step's stream) wait for the
        early loads that join this step, completes finished batches, then
        flushes and enqueues this step's copies on it. Returns the batch
        (None when there was nothing to copy). owners: see load_early."""
        if owners is None:
            self.join_loads(stream)
        self.poll()
        batch = self.manager.flush_copies()
        records, self.pending_records = self.pending_records, []
        shared: List[LoadRecord] = []
        if not batch.ticket:
            return None
        self.batches += 1
        nr, nd = len(batch.reload_blocks), len(batch.demote_blocks)
        rbytes, dbytes = nr * self.slot_bytes, nd * self.slot_bytes
        self.reload_bytes += rbytes
        self.demote_bytes += dbytes
        self.reload_batches += bool(nr)
        empty = np.empty(0, np.int32)
        reloads = kvplug.CopyBatch(batch.ticket, empty, empty, batch.reload_slots, batch.reload_blocks)
        demotes = kvplug.CopyBatch(batch.ticket, batch.demote_blocks, batch.demote_slots, empty, empty)
        # The admissions whose loads this batch holds: early, each run apart on the load stream; else their
        # share of the step's reloads (their time: the reloads', which the step waits for in full).
        if owners is not None:
            owners = records + list(owners)  # admissions of a schedule whose step never flushed, if any
        groups = self._split(batch, owners, self.slot_bytes) if owners is not None and nr else None
        if groups is None and nr:
            for rec, _, part in self._split(batch, records, self.slot_bytes):
                if rec is not None:
                    shared.append(rec)
        try:
            if self.cuda:
                stream = stream if stream is not None else torch.cuda.current_stream(self.device)
                r0, r1, d0, d1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
                dstream = stream
                # Stores by the copy engines cannot run on the legacy default stream: they take the side
                # stream, and the step's stream waits for them (the reloads after the demotions, as on one stream).
                legacy = bool(nd) and not self.overlap and isinstance(stream, torch.cuda.Stream) \
                    and stream.cuda_stream in (0, 1) and getattr(self.copier, "store_engine", None) == "copy-engine"
                if nd and (self.overlap or legacy):
                    if self._side is None:
                        self._side = torch.cuda.Stream(device=self.device)
                    dstream = self._side
                    dstream.wait_stream(stream)  # the demoted blocks' K/V was written by earlier steps
                d0.record(dstream)
                if nd:
                    self.copier.run(demotes, dstream)
                d1.record(dstream)
                if legacy:
                    stream.wait_stream(dstream)
                timed: List[Any] = []
                if groups is not None:
                    # Early loads: on the load stream, after everything the step's stream holds so far (the
                    # demotions above, which may read a block a reload writes; the last writes of the reused
                    # blocks), beside the forward pass enqueued next.
                    if self._load_stream is None:
                        self._load_stream = torch.cuda.Stream(device=self.device)
                    ls = self._load_stream
                    ls.wait_stream(stream)
                    r0.record(ls)
                    for rec, blocks, part in groups:
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record(ls)
                        self.copier.run(part, ls)
                        e1.record(ls)
                        self.fresh.append(_Load(blocks, e1, rec))
                        if rec is not None:
                            rec.stream, rec.overlapped = int(ls.cuda_stream), rec.deferred
                            timed.append((rec, e0, e1))
                    r1.record(ls)
                else:
                    r0.record(stream)
                    if nr:
                        self.copier.run(reloads, stream)
                    r1.record(stream)
                    for rec in shared:
                        rec.stream = int(stream.cuda_stream)
                        timed.append((rec, r0, r1))
                self.in_flight.append(_InFlight(batch.ticket, r0, r1, d0, d1, rbytes, dbytes, timed))
            else:
                if nd:
                    t0 = time.perf_counter()
                    self.copier.run(demotes, None)
                    self.demote_seconds += time.perf_counter() - t0
                if groups is not None:
                    for rec, blocks, part in groups:
                        t0 = time.perf_counter()
                        self.copier.run(part, None)
                        dt = time.perf_counter() - t0
                        self.reload_seconds += dt
                        self.fresh.append(_Load(blocks, None, rec))
                        if rec is not None:
                            rec.seconds = dt
                elif nr:
                    t0 = time.perf_counter()
                    self.copier.run(reloads, None)
                    dt = time.perf_counter() - t0
                    self.reload_seconds += dt
                    for rec in shared:
                        rec.seconds = dt
                self._landed(batch.ticket, dbytes)
        except BaseException:
            # Nothing of this batch is known to have landed: report it failed (a failed reload leaves its
            # blocks cached without valid K/V: see reloads_failed).
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.in_flight = collections.deque(f for f in self.in_flight if f.ticket != batch.ticket)
            self.fresh = []
            self.reloads_failed = self.reloads_failed or bool(nr)
            self.manager.complete_copies(batch.ticket, failed=True)
            raise
        return batch

    @staticmethod
    def _split(batch: kvplug.CopyBatch, owners: List[Any], slot_bytes: int) -> List[Any]:
        """A flush's reloads by owner (record or None, the GPU blocks of its
        sequence): [(record, the blocks they write, a CopyBatch of them)],
        in the owners' order, each record's blocks and bytes set; reloads
        of no owner come last, as one."""
        empty = np.empty(0, np.int32)
        left = np.ones(len(batch.reload_blocks), bool)
        out = []
        for rec, blocks in owners:
            mine = left & np.isin(batch.reload_blocks, blocks)
            if not mine.any():
                continue
            left &= ~mine
            rb = batch.reload_blocks[mine]
            if rec is not None:
                rec.blocks, rec.bytes = len(rb), len(rb) * slot_bytes
            out.append((rec, rb, kvplug.CopyBatch(batch.ticket, empty, empty, batch.reload_slots[mine], rb)))
        if left.any():
            rb = batch.reload_blocks[left]
            out.append((None, rb, kvplug.CopyBatch(batch.ticket, empty, empty, batch.reload_slots[left], rb)))
        return out

    def drain(self) -> None:
        """Waits for every batch in flight and completes it (a batch whose
        wait fails is completed as failed, so that its blocks and slots are
        not left held, and the error is raised)."""
        while self.in_flight:
            f = self.in_flight.popleft()
            try:
                f.synchronize()
            except BaseException:
                # (An interrupt, or a CUDA error.) Its copies may still run: their blocks and slots are given
                # back only once the device has stopped, as step() does for a batch that failed to enqueue.
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                self._complete(f, failed=True)
                raise
            self._complete(f)

    def recover(self) -> None:
        """The tier's part of PagedKVCache.recover_from_failed_reloads:
        completes every batch in flight (those that fail too, as failed),
        forgets the early loads and their records (their sequences are
        preempted next), and lets schedules run again."""
        while self.in_flight:
            try:
                self.drain()
            except Exception:  # a further failed batch: completed as failed, its blocks cleared with the rest
                pass
        self.fresh, self.to_join, self.pending_records = [], [], []
        self.reloads_failed = False

    def close(self) -> None:
        """Drains, then releases the copier (unpins the host memory): before
        the manager closes."""
        if self.closed:
            return
        self.closed = True
        try:
            self.drain()
        finally:
            close = getattr(self.copier, "close", None)
            if close is not None:
                close()

    # -- figures ------------------------------------------------------------------

    def summary(self, prompt_tokens: int, cached_tokens: int) -> Dict[str, Any]:
        """The tier's figures for an engine's summary. prompt_tokens: tokens
        known at admission, summed over admissions; cached_tokens: of them,
        matched (GPU and host tiers)."""
        st = self.manager.tier_stats()
        d: Dict[str, Any] = dataclasses.asdict(st)
        d.update({
            "slot_bytes": self.slot_bytes,
            "host_bytes": st.host_slots * self.slot_bytes,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "host_hit_rate": st.host_hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            "gpu_hit_rate": max(cached_tokens - st.host_hit_tokens, 0) / prompt_tokens if prompt_tokens else 0.0,
            "batches": self.batches,
            "reload_batches": self.reload_batches,
            "reload_bytes": self.reload_bytes,
            "reload_seconds": self.reload_seconds,
            "load_gbps": self.reload_bytes / self.reload_seconds / 1e9 if self.reload_seconds > 0 else 0.0,
            "demote_bytes": self.demote_bytes,
            "demote_seconds": self.demote_seconds,
            "copier": type(self.copier).__name__,
            "pinned": bool(getattr(self.copier, "pinned", False)),
        })
        shared = d.get("shared_hit_tokens")
        if shared is not None:
            d["shared_hit_rate"] = shared / prompt_tokens if prompt_tokens else 0.0
        return d


def summary_lines(s: Dict[str, Any]) -> List[str]:
    """An engine summary's lines for HostTier.summary's figures."""
    lines = [
        f"host tier: {s['host_slots']} slots = {s['host_bytes'] / 2**30:.2f} GiB ({s['copier']}"
        f"{', pinned' if s['pinned'] else ''}); hit rate host {s['host_hit_rate']:.1%}, GPU {s['gpu_hit_rate']:.1%} "
        f"of {s['prompt_tokens']} prompt tokens at admission ({s['host_hit_tokens']} host hit tokens)",
        f"host tier copies: {s['demotions_completed']}/{s['demotions_queued']} demotions, "
        f"{s['reloads_completed']}/{s['reloads']} reloads in {s['batches']} batches; skipped: {s['skipped_full']} "
        f"(host full) {s['skipped_present']} (already there), {s['evicted_undemoted']} evicted undemoted, "
        f"{s['host_evictions']} host evictions",
        f"host tier loads: {s['reload_bytes'] / 2**20:.1f} MiB in {s['reload_seconds'] * 1e3:.1f} ms = "
        f"{s['load_gbps']:.1f} GB/s",
    ]
    if s.get("write_through") or s.get("write_through_stored") or s.get("write_through_queue") or s.get("write_through_lost"):
        how = f" (up to {s['write_through']} a step, slack {s.get('write_through_slack', 0)})" if s.get("write_through") else ""
        lines.append(f"host tier write-through: {s['write_through_stored']} blocks stored while kept on the GPU, "
                     f"{s['write_through_lost']} evicted before their store, {s['write_through_queue']} waiting{how}")
    shared = {k: v for k, v in s.items() if k.startswith("shared_")}
    # The stats carry the shared tier's fields whether or not there is one:
    # a manager without one has them all zero (and no server available).
    if any(shared.values()):
        lines.append("shared tier: " + ", ".join(
            f"{k[7:]} {v:.1%}" if isinstance(v, float) else f"{k[7:]} {v}" for k, v in sorted(shared.items())))
    return lines
