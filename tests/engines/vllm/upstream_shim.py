"""A pytest plugin (-p upstream_shim) that points vLLM's own unit tests of the
CPU offloading manager (tests/v1/kv_offload/cpu/test_manager.py of the
pinned release) at kvplug's manager: vllm.v1.kv_offload.cpu.manager's
CPUOffloadingManager is replaced, before the test module imports it, by a
subclass of KvplugOffloadingManager that takes the same constructor
arguments. What those tests check of the CPU manager's own internals (its
cache policy objects, ARC, the store_threshold filter, its gauges) has no
counterpart in kvplug and fails; make test-engines reports the counts."""

from __future__ import annotations

from typing import Any, Optional

import vllm.v1.kv_offload.cpu.manager as cpu_manager

import kvplug.vllm as kv


class CPUOffloadingManager(kv.KvplugOffloadingManager):
    """kvplug's manager under the name and constructor of vLLM's."""

    def __init__(self, num_chunks: int, cache_policy: str = "lru", cache_policy_module_path: Optional[str] = None,
                 enable_events: bool = False, store_threshold: int = 1, max_tracker_size: int = 64_000,
                 **_: Any) -> None:
        super().__init__(num_chunks, enable_events=enable_events)
        self.cache_policy = cache_policy


cpu_manager.CPUOffloadingManager = CPUOffloadingManager
