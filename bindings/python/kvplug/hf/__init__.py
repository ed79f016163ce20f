"""kvplug for Hugging Face transformers: decoder models of the Llama family
(Llama, Mistral, Qwen2) with their K/V in kvplug's paged cache and their
attention on kvplug's kernels (on CPU, a torch reference path over the same
block tables and slots); hybrids of full and sliding-window attention
(gpt-oss, Gemma 3) and of full attention and Gated DeltaNet layers
(Qwen3-Next, whose per-sequence states live in the cache's blocks:
kvplug.hf.recurrent) on the manager's layer groups.

    import kvplug.hf as kvhf
    model = kvhf.prepare_model(model)              # registers attn_implementation="kvplug"
    print(kvhf.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16))

A scheduler drives the step API itself:

    cache = kvhf.PagedKVCache(kvhf.ModelShape.of(model.config), num_blocks=4096, block_size=16,
                              dtype=torch.bfloat16, device="cuda")
    runner = kvhf.Runner(model, cache, max_batch=256, cuda_graphs=True)
    cache.add(1, prompt)                           # then, every step:
    batch = cache.schedule([(1, 512), ...])        # chunks and decode tokens; OutOfBlocksError: preempt, retry
    logits = runner.step(batch)                    # one row per sequence
    cache.append(1, int(logits[0].argmax()))

A host KV tier below the GPU pool (kvplug.tier): PagedKVCache(...,
host_tier_slots=PagedKVCache.host_slots_for(gib, shape, block_size, dtype))
demotes cached blocks the pool evicts into host memory and reloads them on a
prefix hit; the Runner runs the copies each step (kvplug.hf.tier_copy) and
cache.tier_summary() has the hit rates and load bandwidth.

This subpackage needs torch and transformers (pip install 'kvplug[hf]');
`import kvplug` does not import it.
"""

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # said plainly: the core package works without them
    raise ImportError(f"kvplug.hf needs torch and transformers (pip install 'kvplug[hf]'): {e}") from e

from .attention import NAME, StepContext, kvplug_attention, register
from .cache import Batch, ModelShape, PagedKVCache, RecurrentShape, SequenceState
from .readback import HostReadback
from .runner import Runner, generate, prepare_model
from .tier_copy import HostTier, TorchTierCopier

__all__ = [
    "NAME",
    "Batch",
    "HostReadback",
    "HostTier",
    "ModelShape",
    "PagedKVCache",
    "RecurrentShape",
    "Runner",
    "SequenceState",
    "StepContext",
    "TorchTierCopier",
    "generate",
    "kvplug_attention",
    "prepare_model",
    "register",
]
