"""kvplug.vllm with a hybrid model's KV cache groups, on the CPU without vLLM:
the names kvplug.vllm takes from vLLM's kv_offload package (OffloadKey and
its helpers, ReqContext, the spec types) are stood in for by small modules of
the same names and fields.

What vLLM's OffloadingConnector sends a manager for a hybrid model (full
attention beside sliding-window or Mamba groups): keys make_offload_key(block
hash, group index), the chunk hashes of each group's own block size, so a
full-attention chunk and a window chunk ending at the same token carry the
same block hash and differ in the group index; lookups of one key at a time
(the connector itself applies the window: the last chunks of a window group,
the last one of a Mamba group); stores and loads of several groups in one
call, their GPU blocks ordered by group (GPULoadStoreSpec.group_sizes,
block_indices per group); events whose keys carry the group, from which the
connector fills BlockStored's group_idx. vLLM's own CPU manager keeps one
slot pool and one LRU over every group's chunks, as kvplug's does.

make test-engines runs the adapter inside vLLM's scheduler
(tests/engines/vllm); these tests need no engine."""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass, field
from typing import Any, List, Optional

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvplug.vllm as kv  # noqa: E402


def _standin() -> dict:
    base = types.ModuleType("vllm.v1.kv_offload.base")

    def make_offload_key(block_hash: bytes, group_idx: int) -> bytes:
        return block_hash + group_idx.to_bytes(4, "big", signed=False)

    def get_offload_group_idx(key: bytes) -> int:
        return int.from_bytes(key[-4:], "big", signed=False)

    class LookupResult(enum.Enum):
        MISS = 1
        HIT = 2
        HIT_PENDING = 3

    class Medium(enum.Enum):
        CPU = "CPU"

    @dataclass
    class ReqContext:
        req_id: str
        _state: dict = field(default_factory=dict)
        _positions: dict = field(default_factory=dict)

        def set_state(self, val):
            self._state[type(val)] = val

        def get_state(self, cls):
            return self._state.get(cls)

        def set_offload_key_position(self, key, end_token):
            self._positions[key] = end_token

        def get_offload_key_position(self, key):
            return self._positions.get(key)

    class LoadStoreSpec:
        pass

    class GPULoadStoreSpec(LoadStoreSpec):
        def __init__(self, block_ids, group_sizes, block_indices):
            self.block_ids = np.array(block_ids, dtype=np.int32)
            self.group_sizes, self.block_indices = group_sizes, block_indices

    @dataclass
    class PrepareStoreOutput:
        keys_to_store: list
        store_spec: Any
        evicted_keys: list

    @dataclass
    class OffloadingEvent:
        keys: list
        medium: Any
        removed: bool

    @dataclass
    class TransferResult:
        job_id: int
        success: bool
        transfer_size: Optional[int] = None
        transfer_time: Optional[float] = None

    @dataclass
    class CanonicalKVCacheTensor:
        tensor: Any
        page_size_bytes: int

    @dataclass
    class CanonicalKVCacheRef:
        tensor_idx: int
        page_size_bytes: int

    @dataclass
    class CanonicalKVCaches:
        tensors: list
        group_data_refs: list

    @dataclass(frozen=True)
    class _Metadata:
        documentation: str
        buckets: Any = None

    class RequestOffloadingContext:
        pass

    class OffloadingManager:
        pass

    class OffloadingWorker:
        pass

    class OffloadingSpec:
        def __init__(self, config):
            self.config, self.extra_config = config, config.extra_config
            self.blocks_per_chunk = config.blocks_per_chunk
            self.kv_events_config = types.SimpleNamespace(enable_kv_cache_events=config.enable_kv_cache_events)

    names = dict(make_offload_key=make_offload_key, get_offload_group_idx=get_offload_group_idx,
                 OffloadKey=bytes, LookupResult=LookupResult, Medium=Medium, ReqContext=ReqContext,
                 LoadStoreSpec=LoadStoreSpec, GPULoadStoreSpec=GPULoadStoreSpec,
                 PrepareStoreOutput=PrepareStoreOutput, OffloadingEvent=OffloadingEvent,
                 TransferResult=TransferResult, CanonicalKVCacheTensor=CanonicalKVCacheTensor,
                 CanonicalKVCacheRef=CanonicalKVCacheRef, CanonicalKVCaches=CanonicalKVCaches,
                 OffloadingCounterMetadata=_Metadata, OffloadingGaugeMetadata=_Metadata,
                 OffloadingHistogramMetadata=_Metadata, RequestOffloadingContext=RequestOffloadingContext,
                 OffloadingManager=OffloadingManager, OffloadingWorker=OffloadingWorker,
                 OffloadingSpec=OffloadingSpec)
    for k, v in names.items():
        setattr(base, k, v)

    config = types.ModuleType("vllm.v1.kv_offload.config")
    config.OffloadingConfig = types.SimpleNamespace
    common = types.ModuleType("vllm.v1.kv_offload.cpu.common")

    class CPULoadStoreSpec(LoadStoreSpec):
        def __init__(self, block_ids):
            self.block_ids = np.array(block_ids, dtype=np.int32)

    common.CPULoadStoreSpec = CPULoadStoreSpec
    common.CPUOffloadingMetrics = types.SimpleNamespace(
        CPU_CACHE_USAGE_PERC="u", CPU_CACHE_WRITE_USAGE_PERC="w", CPU_CACHE_READ_USAGE_PERC="r",
        CPU_ALLOCATION_SIZE="a")
    hit = types.ModuleType("vllm.v1.metrics.cache_hit_source")
    hit.CacheHitSource = enum.Enum("CacheHitSource", "HOST")
    mods = {m.__name__: m for m in (base, config, common, hit)}
    for name in ("vllm", "vllm.v1", "vllm.v1.kv_offload", "vllm.v1.kv_offload.cpu", "vllm.v1.metrics"):
        mods[name] = types.ModuleType(name)
    return mods


@pytest.fixture
def vl(monkeypatch):
    """The stand-in base module, with kvplug.vllm's classes built on it."""
    mods = _standin()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    for name in kv._LAZY:
        monkeypatch.delitem(vars(kv), name, raising=False)
    base = mods["vllm.v1.kv_offload.base"]
    base.kv = types.SimpleNamespace(**{name: getattr(kv, name) for name in kv._LAZY})
    yield base
    for name in kv._LAZY:
        vars(kv).pop(name, None)


FULL, WINDOW, MAMBA = 0, 1, 2


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_vllm_groups_of_one_block_hash_are_distinct_blocks(vl):
    # gpt-oss / Qwen3-Next shaped: a full-attention, a window and a Mamba
    # chunk ending at the same token share a block hash. Each is its own
    # block: stored, looked up, evicted and announced on its own, the group
    # index kept in every key the manager hands back.
    m = vl.kv.KvplugOffloadingManager(4, enable_events=True)
    ctx = vl.ReqContext(req_id="r")
    keys = [vl.make_offload_key(h(1), g) for g in (FULL, WINDOW, MAMBA)]
    out = m.prepare_store(keys, ctx)
    assert out.keys_to_store == keys and sorted(out.store_spec.block_ids.tolist()) == [0, 1, 2]
    m.complete_store(keys, ctx)
    assert [m.lookup(k, ctx) for k in keys] == [vl.LookupResult.HIT] * 3
    assert m.lookup(vl.make_offload_key(h(1), 3), ctx) == vl.LookupResult.MISS
    # Touching the full-attention and Mamba chunks leaves the window chunk
    # least recently used: the next store evicts it alone.
    m.touch([keys[FULL], keys[MAMBA]], ctx)
    more = [vl.make_offload_key(h(2), FULL), vl.make_offload_key(h(2), WINDOW)]
    out = m.prepare_store(more, ctx)
    assert out.evicted_keys == [keys[WINDOW]]
    m.complete_store(more, ctx)
    assert m.lookup(keys[WINDOW], ctx) == vl.LookupResult.MISS
    assert m.lookup(keys[FULL], ctx) == vl.LookupResult.HIT
    events = list(m.take_events())
    stored = [e for e in events if not e.removed]
    assert [[vl.get_offload_group_idx(k) for k in e.keys] for e in stored] == [[FULL, WINDOW, MAMBA], [FULL, WINDOW]]
    assert [e.keys for e in events if e.removed] == [[keys[WINDOW]]]
    assert list(m.take_events()) == []
    assert m.counters()["key_collisions"] == 0 and m.counters()["evictions"] == 1
    m.shutdown()


def test_vllm_request_finish_orders_groups_of_different_chunk_sizes_by_position(vl):
    # A full-attention group of 32-token chunks beside a window group of
    # 16-token chunks (DeepSeek V4's shape): the connector records each
    # key's end token; at the request's end its chunks become the most
    # recently used head first across both groups, so the pool evicts the
    # tail of the prefix first, whatever group it is in.
    m = vl.kv.KvplugOffloadingManager(6)
    ctx = vl.ReqContext(req_id="r")
    m.on_new_request(ctx)
    full = [vl.make_offload_key(h(32 * (i + 1)), FULL) for i in range(2)]
    window = [vl.make_offload_key(h(16 * (i + 1)), WINDOW) for i in range(4)]
    for i, k in enumerate(full):
        ctx.set_offload_key_position(k, 32 * (i + 1))
    for i, k in enumerate(window):
        ctx.set_offload_key_position(k, 16 * (i + 1))
    # Stored out of order (window backfills after the full chunks).
    for batch in (full, window[::-1]):
        out = m.prepare_store(batch, ctx)
        m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    other = vl.ReqContext(req_id="o")
    order = []
    for i in range(6):  # each new chunk evicts the least recently used one
        k = vl.make_offload_key(h(1000 + i), FULL)
        out = m.prepare_store([k], other)
        m.complete_store([k], other)
        order += out.evicted_keys
    # The chunks ending at 64 (one per group) go first, then 48, 32, 16.
    assert [ctx.get_offload_key_position(k) for k in order] == [64, 64, 48, 32, 32, 16]
    assert {vl.get_offload_group_idx(k) for k in order[:2]} == {FULL, WINDOW}
    m.shutdown()


def _kv_caches(vl, num_blocks=8):
    """A full-attention group over two tensors of 96-byte pages and a
    window group over one tensor of 40-byte pages (groups with their own
    tensors and page sizes, as vLLM lays out groups it cannot unify)."""
    tensors = [torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8) for p in (96, 96, 40)]
    cts = [vl.CanonicalKVCacheTensor(tensor=t, page_size_bytes=t.shape[1]) for t in tensors]
    refs = [[vl.CanonicalKVCacheRef(0, 96), vl.CanonicalKVCacheRef(1, 96)], [vl.CanonicalKVCacheRef(2, 40)]]
    return tensors, vl.CanonicalKVCaches(tensors=cts, group_data_refs=refs)


def test_vllm_worker_moves_each_groups_own_tensors(vl):
    # Chunks of 2 GPU blocks; the full group's 3 blocks start at logical
    # block 1 (one row into its first chunk), the window group's 2 at block
    # 4. A store then a load into other GPU blocks gives each group's bytes
    # back in its own tensors, and leaves the other group's blocks alone.
    tensors, caches = _kv_caches(vl)
    w = vl.kv.KvplugOffloadingWorker(caches, blocks_per_chunk=2, num_slots=6, pin_memory=False)
    assert w.copier.group_tensors == [[0, 1], [2]] and w.copier.tier_copier is None
    full_src, win_src = [1, 2, 3], [5, 6]
    src = vl.GPULoadStoreSpec(full_src + win_src, group_sizes=(3, 2), block_indices=(1, 4))
    host = types.SimpleNamespace(block_ids=np.array([4, 0, 2], np.int32))  # 2 chunks for full, 1 for window
    want = [t.clone() for t in tensors]
    assert w.submit_store(1, src, host)
    assert [r.job_id for r in w.get_finished()] == [1]
    for t in tensors:
        t.zero_()
    dst = vl.GPULoadStoreSpec([0, 4, 7] + [2, 3], group_sizes=(3, 2), block_indices=(1, 4))
    assert w.submit_load(2, host, dst)
    w.wait({2})
    assert [r.job_id for r in w.get_finished()] == [2]
    for t in (0, 1):
        assert torch.equal(tensors[t][[0, 4, 7]], want[t][full_src])
        assert not tensors[t][[2, 3]].any()  # the window group's blocks: not this group's
    assert torch.equal(tensors[2][[2, 3]], want[2][win_src])
    assert not tensors[2][[0, 4, 7]].any()
    w.shutdown()


def test_vllm_worker_moves_fp8_blocks_as_their_bytes(vl):
    # vLLM's FP8 KV cache (kv_cache_dtype="fp8"): e4m3 K and V tensors whose
    # per-tensor scales stay with the attention layers, so a block is its
    # e4m3 bytes alone: a page of block_size x kv_heads x head_dim bytes,
    # half a 16-bit block's. A store then a load gives the blocks back bit
    # for bit, NaN encodings and all, and moves half the bytes.
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    if e4m3 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    page = 16 * 2 * 8  # block_size 16, 2 kv heads, head_dim 8: elements of one block
    raw = torch.randint(0, 256, (2, 8, page), dtype=torch.uint8)
    raw[0, 1, :4] = 0x7F  # e4m3fn's NaN, which a copy through float would not keep
    fp8 = [raw[i].view(e4m3) for i in range(2)]
    half = [torch.randn(8, page).to(torch.bfloat16) for _ in range(2)]

    def round_trip(tensors):
        cts = [vl.CanonicalKVCacheTensor(tensor=t, page_size_bytes=t.shape[1] * t.element_size()) for t in tensors]
        refs = [[vl.CanonicalKVCacheRef(0, cts[0].page_size_bytes), vl.CanonicalKVCacheRef(1, cts[1].page_size_bytes)]]
        w = vl.kv.KvplugOffloadingWorker(vl.CanonicalKVCaches(tensors=cts, group_data_refs=refs), blocks_per_chunk=1,
                                         num_slots=4, pin_memory=False)
        want = [t.clone() for t in tensors]
        host = types.SimpleNamespace(block_ids=np.array([3, 0, 2], np.int32))
        assert w.submit_store(1, vl.GPULoadStoreSpec([1, 2, 5], group_sizes=(3,), block_indices=(0,)), host)
        stored = w.get_finished()
        assert [r.job_id for r in stored] == [1]
        for t in tensors:
            t.view(torch.uint8).zero_() if t.element_size() == 1 else t.zero_()
        assert w.submit_load(2, host, vl.GPULoadStoreSpec([0, 6, 7], group_sizes=(3,), block_indices=(0,)))
        w.wait({2})
        assert [r.job_id for r in w.get_finished()] == [2]
        for t, o in zip(tensors, want):
            assert torch.equal(t[[0, 6, 7]].view(torch.uint8), o[[1, 2, 5]].view(torch.uint8))
            assert not t[[1, 2, 3, 4, 5]].view(torch.uint8).any()
        w.shutdown()
        return stored[0].transfer_size

    fp8_bytes, half_bytes = round_trip(fp8), round_trip(half)
    assert fp8_bytes == 3 * 2 * page
    assert half_bytes == 2 * fp8_bytes
