"""SGLang's HiCache storage path on the CPU, for kvplug.sglang's conformance
tests: SGLang's own device KV pool (MHATokenToKVPool), its host pool (L2,
MHATokenToKVPoolHost, in page_first or layer_first layout) and its
HiCacheController with `--hicache-storage-backend dynamic` pointed at
kvplug.sglang.KvplugHiCacheStorage, so that SGLang's StorageBackendFactory
loads the backend and SGLang's backup, prefetch and I/O threads call it.
The test plays the scheduler's part of the protocol: it hands pages to
write_storage and, for a prefetch, takes the hit count from
prefetch_hit_queue, allocates host pages and queues the transfer, as
SGLang's radix cache does."""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Dict, List, Optional

import torch

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

try:  # the page hashes SGLang's storage path uses
    from sglang.srt.managers.cache_controller import get_storage_hash_str
except ImportError:  # pragma: no cover
    from sglang.srt.mem_cache.utils import get_storage_hash_str

_setup_lock = threading.Lock()
_ready = False


def setup_process() -> None:
    """A one-rank gloo world and SGLang's parallel context, once per process."""
    global _ready
    with _setup_lock:
        if _ready:
            return
        import socket

        import torch.distributed as dist
        from sglang.srt.runtime_context import get_parallel

        if not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(port)
            dist.init_process_group("gloo", rank=0, world_size=1)
        get_parallel().override_permanently(
            tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, pp_size=1, pp_rank=0, attn_dcp_size=1,
            attn_dcp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_rank=0)
        _ready = True


KVPLUG = {"backend_name": "kvplug", "module_path": "kvplug.sglang", "class_name": "KvplugHiCacheStorage",
          "interface_v1": 1}


class Instance:
    """One SGLang instance's cache stack with a storage backend."""

    def __init__(self, backend: str = "dynamic", extra: Optional[Dict[str, Any]] = None, *, layout: str = "page_first",
                 page_size: int = 4, layers: int = 2, heads: int = 2, head_dim: int = 8, tokens: int = 512,
                 model_name: str = "tiny-llama") -> None:
        setup_process()
        import torch.distributed as dist

        self.page = page_size
        self.device_pool = MHATokenToKVPool(tokens, page_size, torch.float16, heads, head_dim, layers, "cpu", False,
                                            start_layer=0, end_layer=layers)
        info = self.device_pool.get_device_pool_infos()[0].buffer_info
        self.host = MHATokenToKVPoolHost(
            info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=self.device_pool.size, start_layer=0, end_layer=layers,
            write_back_staging=self.device_pool.hicache_write_back_staging)
        alloc = TokenToKVPoolAllocator(tokens, torch.float16, "cpu", self.device_pool, need_sort=False)
        self.ctl = HiCacheController(alloc, self.host, page_size, dist.group.WORLD, threading.Event(),
                                     write_policy="write_through", io_backend="direct", storage_backend=backend,
                                     prefetch_threshold=page_size, model_name=model_name,
                                     storage_backend_extra_config=dict(extra or {}))
        self.backend = self.ctl.storage_backend

    def close(self) -> None:
        try:
            self.ctl.detach_storage_backend()
        except Exception:
            pass

    # -- pages --

    def hashes(self, tokens: List[int]) -> List[str]:
        return get_storage_hash_str(tokens, None, page_size=self.page)

    def fill(self, tokens: List[int], seed: int) -> torch.Tensor:
        """Host pages holding len(tokens) tokens of seeded K/V; their indices."""
        idx = self.host.alloc(len(tokens))
        assert idx is not None, "host pool full"
        g = torch.Generator().manual_seed(seed)
        for start in range(0, len(tokens), self.page):
            page = self.host.get_dummy_flat_data_page()
            page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
            self.host.set_from_flat_data_page(int(idx[start]), page)
        return idx

    def pages(self, idx: torch.Tensor) -> List[torch.Tensor]:
        return [self.host.get_data_page(int(idx[s]), flat=True).clone() for s in range(0, len(idx), self.page)]

    # -- the storage protocol, the scheduler's side --

    def backup(self, tokens: List[int], idx: torch.Tensor, timeout: float = 30) -> int:
        """write_storage and wait for its ack: tokens backed up."""
        op_id = self.ctl.write_storage(idx, tokens, hash_value=self.hashes(tokens))
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                op = self.ctl.ack_backup_queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if op.id == op_id:
                return op.completed_tokens
        raise AssertionError("no backup ack")

    def prefetch(self, tokens: List[int], timeout: float = 30) -> tuple:
        """Queries storage for tokens' pages and loads the hits into new host
        pages: (tokens loaded, their host indices)."""
        self.ctl.prefetch(f"req-{time.monotonic_ns()}", list(tokens), None)
        op = self.ctl.prefetch_hit_queue.get(timeout=timeout)
        hit = op.storage_hit_count
        if hit == 0:
            return 0, None
        idx = self.host.alloc(hit)
        op.host_indices = idx
        op.hash_value = op.hash_value[: hit // self.page]
        self.ctl.prefetch_buffer.put(op)
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                ack = self.ctl.ack_prefetch_queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if ack.completed_tokens is not None and ack.operation is op:
                op.completed_tokens = ack.completed_tokens
            if ack.completed_req and ack.operation is op:
                return op.completed_tokens, idx
        raise AssertionError("prefetch did not complete")
