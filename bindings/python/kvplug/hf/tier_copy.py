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

__all__ = ["TorchTierCopier", "HostTier", "make_copier", "block_bytes", "manager_takes"]


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
    kvplug.TierCopier (the library's batched copy kernel) on a CUDA cache,
    else TorchTierCopier; "copy-engine": kvplug.TierCopier with its stores
    (demotions, write-through) on the copy engines, CUDA caches only;
    "torch": TorchTierCopier; a callable: spec(cache)."""
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
        if spec == "copy-engine":
            kw["store_engine"] = "copy-engine"
        return kvplug.TierCopier([kv[i, 0] for i in range(L)], [kv[i, 1] for i in range(L)], manager=cache.manager, **kw)
    return TorchTierCopier(cache.kv, cache.manager.host_tier_memory(), scales=scales)


@dataclasses.dataclass
class _InFlight:
    ticket: int
    r0: Any  # CUDA timing events on the step's stream: before and after the reloads
    r1: Any
    d0: Any  # before and after the demotions (on the side stream with overlap)
    d1: Any
    reload_bytes: int
    demote_bytes: int

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
        self.in_flight: Deque[_InFlight] = collections.deque()
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

    def _complete(self, f: _InFlight, failed: bool = False) -> None:
        if not failed:
            if f.reload_bytes:
                self.reload_seconds += f.r0.elapsed_time(f.r1) * 1e-3
            if f.demote_bytes:
                self.demote_seconds += f.d0.elapsed_time(f.d1) * 1e-3
        self.manager.complete_copies(f.ticket, failed=failed)

    def step(self, stream: Any = None) -> Optional[kvplug.CopyBatch]:
        """Once per step, after the step's admissions and before its
        attention: completes finished batches, then flushes and enqueues
        this step's copies on `stream` (CUDA: the step's stream). Returns
        the batch (None when there was nothing to copy)."""
        self.poll()
        batch = self.manager.flush_copies()
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
        try:
            if self.cuda:
                stream = stream if stream is not None else torch.cuda.current_stream(self.device)
                r0, r1, d0, d1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
                dstream = stream
                # Stores by the copy engines cannot run on the legacy default stream: they take the side
                # stream, and the step's stream waits for them (the reloads after the demotions, as on one stream).
                legacy = bool(nd) and not self.overlap and isinstance(stream, torch.cuda.Stream) \
                    and stream.cuda_stream == 0 and getattr(self.copier, "store_engine", None) == "copy-engine"
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
                r0.record(stream)
                if nr:
                    self.copier.run(reloads, stream)
                r1.record(stream)
                self.in_flight.append(_InFlight(batch.ticket, r0, r1, d0, d1, rbytes, dbytes))
            else:
                if nd:
                    t0 = time.perf_counter()
                    self.copier.run(demotes, None)
                    self.demote_seconds += time.perf_counter() - t0
                if nr:
                    t0 = time.perf_counter()
                    self.copier.run(reloads, None)
                    self.reload_seconds += time.perf_counter() - t0
                self.manager.complete_copies(batch.ticket)
        except BaseException:
            # Nothing of this batch is known to have landed: report it failed (a failed reload leaves its
            # blocks cached without valid K/V; the caller should clear the prefix cache).
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.in_flight = collections.deque(f for f in self.in_flight if f.ticket != batch.ticket)
            self.manager.complete_copies(batch.ticket, failed=True)
            raise
        return batch

    def drain(self) -> None:
        """Waits for every batch in flight and completes it."""
        while self.in_flight:
            f = self.in_flight.popleft()
            f.synchronize()
            self._complete(f)

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
    if s.get("write_through_stored") or s.get("write_through_queue") or s.get("write_through_lost"):
        lines.append(f"host tier write-through: {s['write_through_stored']} blocks stored while kept on the GPU, "
                     f"{s['write_through_lost']} evicted before their store, {s['write_through_queue']} waiting")
    shared = {k: v for k, v in s.items() if k.startswith("shared_")}
    # The stats carry the shared tier's fields whether or not there is one:
    # a manager without one has them all zero (and no server available).
    if any(shared.values()):
        lines.append("shared tier: " + ", ".join(
            f"{k[7:]} {v:.1%}" if isinstance(v, float) else f"{k[7:]} {v}" for k, v in sorted(shared.items())))
    return lines
