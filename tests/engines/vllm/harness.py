"""A vLLM engine without a model, for kvplug.vllm's conformance tests: vLLM's
real Scheduler with the OffloadingConnector configured to kvplug's spec (by
spec_name and spec_module_path, through vLLM's own OffloadingSpecFactory),
a worker-side OffloadingConnector over CPU tensors laid out as vLLM lays out
its KV cache (one allocation, each layer's [num_blocks, 2, block_size,
heads, head_size] view), and a fake forward pass in place of the model
runner.

The fake forward pass makes the KV cache checkable: the K of the token at
position p holds a value derived from the whole token prefix up to p (as a
real model's K depends on it), V its negation. Before writing a step's new
tokens it checks every context token the step would attend to, so a block
that the prefix cache or a kvplug load placed in the wrong GPU block, or
filled with the wrong bytes, fails the run.

With sliding_window, the model is a hybrid (gpt-oss' shape): a
full-attention group and a sliding-window group of num_layers layers each,
over one pool of blocks as vLLM's hybrid allocator lays them out (layer i
of each group views the same bytes; a block id belongs to one group at a
time). A window layer's context tokens are checked only within the window
(vLLM frees the blocks that fell out of it)."""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Dict, List, Optional

import torch

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_model_dir(path: pathlib.Path) -> str:
    """A model directory with a config only: the scheduler never loads weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def kv_value(tokens: List[int], p: int) -> float:
    """The K value of the token at position p: a function of tokens[:p+1],
    exact in float32."""
    h = hashlib.blake2b(repr(tokens[: p + 1]).encode(), digest_size=4).digest()
    return float(int.from_bytes(h, "little") % (1 << 20) + 1)


class Engine:
    """See the module docstring. Sync scheduling unless async_scheduling."""

    def __init__(self, model_dir: str, *, block_size: int = 4, num_gpu_blocks: int = 16, host_blocks: int = 32,
                 num_layers: int = 2, heads: int = 2, head_size: int = 4, blocks_per_chunk: int = 1,
                 async_scheduling: bool = False, enable_events: bool = True,
                 extra_config: Optional[Dict[str, Any]] = None, sliding_window: Optional[int] = None) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.sliding_window = sliding_window
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size,
                                 dtype=torch.float32)
        if sliding_window is None:
            self.groups = [[f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]]
            specs = [spec]
        else:
            # Full attention on the even layers, the window on the odd ones.
            self.groups = [[f"model.layers.{2 * i + g}.self_attn.attn" for i in range(num_layers)] for g in (0, 1)]
            specs = [spec, SlidingWindowSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size,
                                             dtype=torch.float32, sliding_window=sliding_window)]
        self.layers = [name for g in self.groups for name in g]
        page = spec.page_size_bytes
        self.page_bytes = page
        worker_block_bytes = page * num_layers
        extra: Dict[str, Any] = {
            "spec_name": "KvplugOffloadingSpec",
            "spec_module_path": "kvplug.vllm",
            "kvplug_host_bytes": host_blocks * blocks_per_chunk * worker_block_bytes,
        }
        if blocks_per_chunk > 1:
            extra["block_size"] = block_size * blocks_per_chunk
        extra.update(extra_config or {})

        model = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float16", seed=0,
                            max_model_len=2048)
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
                                enable_chunked_prefill=True, is_encoder_decoder=False)
        sched.async_scheduling = async_scheduling
        cache = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                            enable_prefix_caching=True)
        cache.num_gpu_blocks = num_gpu_blocks
        self.vllm_config = VllmConfig(
            model_config=model, scheduler_config=sched, cache_config=cache, device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                kv_connector_extra_config=extra),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=enable_events, publisher="null"),
        )
        # Layer-outermost; the groups overlay one allocation from byte 0.
        kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * num_gpu_blocks * num_layers, layers=list(g),
                                            layer_stride=page * num_gpu_blocks, block_stride=page)
                              for g in self.groups],
            kv_cache_groups=[KVCacheGroupSpec(list(g), sp) for g, sp in zip(self.groups, specs)],
        )
        sbs, hbs = resolve_kv_cache_block_sizes(kv_cache_config, self.vllm_config)
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.async_scheduling = async_scheduling
        self.scheduler = cls(vllm_config=self.vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                             structured_output_manager=StructuredOutputManager(self.vllm_config), block_size=sbs,
                             hash_block_size=hbs)
        # The KV cache: one allocation, layer-outermost, viewed per layer.
        self.backing = torch.zeros(page * num_gpu_blocks * num_layers, dtype=torch.int8)
        self.kv: Dict[str, torch.Tensor] = {}
        for g in self.groups:
            for i, name in enumerate(g):
                chunk = self.backing[i * page * num_gpu_blocks:(i + 1) * page * num_gpu_blocks]
                self.kv[name] = chunk.view(torch.float32).view(num_gpu_blocks, 2, block_size, heads, head_size)
        self.worker = OffloadingConnector(self.vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        with set_current_vllm_config(self.vllm_config):
            self.worker.register_kv_caches(self.kv)
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        self.connector_scheduler = connector.connector_scheduler
        self.manager = self.connector_scheduler.manager
        self.spec_worker = self.worker.connector_worker.worker
        self.events: List[Any] = []
        self.scheduler.kv_event_publisher.publish = lambda batch: self.events.extend(batch.events)
        self.connector_stats: List[Any] = []
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self._ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._next_id = 0
        self.finished: Dict[str, List[int]] = {}
        self.checked_tokens = 0
        self.checked_window_tokens = 0
        self._prev: Optional[tuple] = None

    # -- requests --

    def add(self, prompt: List[int], max_tokens: int = 2) -> str:
        rid = f"r{self._next_id}"
        self._next_id += 1
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, None)
        req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=self._hasher)
        self.scheduler.add_request(req)
        return rid

    # -- the fake forward pass --

    def _block_ids(self, rid: str, group: int = 0) -> List[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[group])

    def _check_and_write(self, rid: str, computed_before: int, n_new: int) -> None:
        req = self.scheduler.requests[rid]
        tokens = list(req.all_token_ids)
        bs = self.block_size
        layer_of = {name: li for li, name in enumerate(self.layers)}
        for gi, group in enumerate(self.groups):
            blocks = self._block_ids(rid, gi)
            # The context the step's first new token attends to: all of it,
            # or a window group's last sliding_window - 1 tokens.
            first = 0 if gi == 0 else max(0, computed_before - (self.sliding_window - 1))
            for p in range(first, computed_before):
                b, row = blocks[p // bs], p % bs
                want = kv_value(tokens, p)
                for name in group:
                    li = layer_of[name]
                    k = self.kv[name][b, 0, row]
                    v = self.kv[name][b, 1, row]
                    if not (bool((k == want + li).all()) and bool((v == -(want + li)).all())):
                        raise AssertionError(f"{rid}: the KV of context token {p} (block {b}, row {row}, {name}) "
                                             f"is {k.flatten()[0].item()}, not {want + li}")
                if gi == 0:
                    self.checked_tokens += 1
                else:
                    self.checked_window_tokens += 1
            for p in range(computed_before, computed_before + n_new):
                b, row = blocks[p // bs], p % bs
                want = kv_value(tokens, p)
                for name in group:
                    li = layer_of[name]
                    self.kv[name][b, 0, row] = want + li
                    self.kv[name][b, 1, row] = -(want + li)

    def step(self) -> None:
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self._ctx)
        req_ids = list(so.num_scheduled_tokens.keys())
        sampled: List[List[int]] = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            n = so.num_scheduled_tokens[rid]
            before = req.num_computed_tokens - n  # schedule() already advanced it
            self._check_and_write(rid, before, n)
            done_prefill = req.num_computed_tokens >= req.num_tokens
            sampled.append([1000 + req.num_output_tokens] if done_prefill else [])
        self.worker.wait_for_save()
        fs, fr = self.worker.get_finished(so.finished_req_ids)
        wmeta = self.worker.build_connector_worker_meta() or OffloadingWorkerMetadata()
        self.worker.clear_connector_metadata()
        out = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            logprobs=None, prompt_logprobs_dict={}, pooler_output=None,
            kv_connector_output=KVConnectorOutput(finished_sending=fs, finished_recving=fr,
                                                  kv_connector_worker_meta=wmeta),
        )
        if self.async_scheduling:
            if self._prev is not None:
                self._update(*self._prev)
            self._prev = (so, out)
        else:
            self._update(so, out)

    def _update(self, so: Any, out: Any) -> None:
        outputs = self.scheduler.update_from_output(so, out)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finished:
                    self.finished[o.request_id] = list(o.new_token_ids)
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.connector_stats.append(eco.scheduler_stats.kv_connector_stats)

    def idle(self) -> bool:
        return (not self.scheduler.requests and not self.connector_scheduler._jobs
                and not self.scheduler.finished_req_ids)

    def run(self, max_steps: int = 200) -> int:
        """Steps until every request finished and every transfer completed."""
        for i in range(max_steps):
            if self.idle() and self._prev is None:
                return i
            self.step()
            if self.async_scheduling and self.idle() and self._prev is not None:
                self._update(*self._prev)
                self._prev = None
        raise AssertionError(f"not idle after {max_steps} steps: {len(self.scheduler.requests)} requests, "
                             f"{len(self.connector_scheduler._jobs)} jobs")

    def stats_of(self, request_id: str) -> Any:
        return self.scheduler.requests.get(request_id)


def prompt(seed: int, n: int) -> List[int]:
    """n token ids of a prompt, different for each seed."""
    return [100 + (seed * 7919 + i * 31) % 30000 for i in range(n)]


def evict_gpu(e: "Engine", seeds, n: int) -> None:
    """Runs unrelated prompts until the GPU prefix cache has turned over."""
    for s in seeds:
        e.add(prompt(s, n), max_tokens=1)
    e.run()
