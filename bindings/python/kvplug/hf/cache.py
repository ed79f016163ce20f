"""The paged KV cache of a transformers model: kvplug's Manager (block tables,
prefix cache) plus one K and one V tensor per layer in kvplug's layout
[num_blocks, block_size, num_kv_heads, head_dim], and the per-sequence token
state a scheduler needs (what is known, what is computed).

A sequence's life, as a scheduler drives it:

    cache.add(7, prompt)                  # known tokens, no blocks yet
    batch = cache.schedule([(7, 512)])    # admit a first chunk: prefix hit + up to 512 new tokens
    logits = runner.step(batch)           # computes them (kvplug.hf.Runner)
    batch = cache.schedule([(7, 512)])    # the next chunk: grows the sequence
    ...
    cache.append(7, token)                # a sampled token: the next step computes it
                                          # (append_tokens: one per sequence of a batch)
    cache.fork(7, [8, 9])                 # parallel sampling: 8 and 9 share 7's blocks
    cache.preempt(7)                      # frees its blocks, keeps its tokens
    cache.remove([8, 9])

Tokens enter the manager (admit / grow_tokens) in the step that computes
their K/V, so a block the prefix cache holds always has its K/V written by
the time another sequence reads it: within one step every layer writes all
of the step's K/V before any attention reads the cache. A model's
linear-attention layers (Qwen3-Next) keep a state per sequence in the same
memory, in state blocks of the manager's recurrent layer groups.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

import kvplug

from .tier_copy import HostTier, LoadRecord, block_bytes, make_copier

__all__ = ["ModelShape", "RecurrentShape", "PagedKVCache", "Batch", "SequenceState", "chunk_end"]


def chunk_end(start: int, end: int, period: int, stop: int = 0) -> int:
    """Where a step computing tokens start .. end - 1 of a sequence stops,
    with recurrent states kept every period tokens (0: none kept). The
    manager keeps a state only where a step ends at a checkpoint boundary,
    so a prompt computed in one piece would leave none for a later prompt
    with its prefix to resume from: the step stops at stop (a checkpoint
    boundary where the cached prefix ends, past the prompt's hit:
    Manager.match_blocks) when it passes it, else at the last boundary past
    start when end is not one itself. The rest follows in the next step (a
    prompt's last few tokens cost one more step)."""
    if period and start < stop < end:
        return stop
    if period and end % period and end - end % period > start:
        return end - end % period
    return end


# The models whose "linear_attention" layers kvplug.hf serves: Gated DeltaNet token mixers of Qwen3-Next's
# layout (kvplug.hf.recurrent). Other models name other layers so (MiniMax's lightning attention, Kimi's
# KDA, Qwen3.5's DeltaNet with split projections): their states and forwards differ.
GATED_DELTANET_MODELS = ("qwen3_next",)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class RecurrentShape:
    """The state a Gated DeltaNet (linear-attention) layer keeps per
    sequence, as transformers keeps it: the causal convolution's last
    conv_kernel - 1 inputs of its conv_dim channels in the model's dtype,
    then the recurrent state, float32 [num_v_heads, head_k_dim,
    head_v_dim]."""

    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    @staticmethod
    def of(config: Any) -> "RecurrentShape":
        fields = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                  "linear_num_value_heads")
        missing = [f for f in fields if getattr(config, f, None) is None]
        if missing:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: the linear-attention layers of {type(config).__name__} lack "
                                              f"{', '.join(missing)}: not Gated DeltaNet layers of Qwen3-Next's shape")
        kh, vh = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        kd, vd = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        if vh % kh:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: {vh} linear-attention value heads are not a multiple of "
                                              f"{kh} key heads")
        return RecurrentShape(2 * kh * kd + vh * vd, int(config.linear_conv_kernel_dim), vh, kd, vd)

    def conv_bytes(self, dtype: torch.dtype) -> int:
        return self.conv_dim * (self.conv_kernel - 1) * _element_size(dtype)

    @property
    def recurrent_bytes(self) -> int:
        return self.num_v_heads * self.head_k_dim * self.head_v_dim * 4

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One layer's state of one sequence, for a model of `dtype`."""
        return self.conv_bytes(dtype) + self.recurrent_bytes


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the cache needs to know of a decoder model."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    # Hybrid models: each layer's type, "full_attention" with "sliding_attention" (gpt-oss, Gemma 3) or with
    # "linear_attention" (Qwen3-Next), and the window of the sliding ones; () and 0 when every layer is alike.
    layer_types: Tuple[str, ...] = ()
    sliding_window: int = 0
    # The linear-attention layers' state per sequence (Qwen3-Next); None without such layers.
    recurrent: Optional[RecurrentShape] = None

    @staticmethod
    def of(config: Any) -> "ModelShape":
        """From a transformers config of the Llama family (Llama, Mistral,
        Qwen2 and those with the same attention fields), of hybrids that
        mix full and sliding-window attention layers (gpt-oss, Gemma 3:
        config.layer_types), and of Qwen3-Next (full attention and Gated
        DeltaNet layers, "linear_attention" in config.layer_types). Other
        layer types raise InvalidArgumentError: serving them as attention
        layers would compute wrong logits."""
        missing = [f for f in ("num_hidden_layers", "num_attention_heads", "hidden_size") if getattr(config, f, None) is None]
        if missing:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: config {type(config).__name__} lacks {', '.join(missing)}: not a decoder of the Llama family")
        qh = int(config.num_attention_heads)
        kvh = int(getattr(config, "num_key_value_heads", None) or qh)
        hd = getattr(config, "head_dim", None) or config.hidden_size // qh
        if qh % kvh:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: {qh} query heads are not a multiple of {kvh} kv heads")
        types = tuple(getattr(config, "layer_types", None) or ())
        kinds = set(types)
        unknown = kinds - {"full_attention", "sliding_attention", "linear_attention"}
        if unknown:
            raise kvplug.InvalidArgumentError(
                f"kvplug.hf: {type(config).__name__} has layers of type {', '.join(sorted(unknown))}, which kvplug.hf "
                "does not serve (it serves full_attention, sliding_attention, and Qwen3-Next's linear_attention)")
        layers = int(config.num_hidden_layers)
        if "linear_attention" in kinds:
            model_type = getattr(config, "model_type", None)
            if model_type not in GATED_DELTANET_MODELS:
                raise kvplug.InvalidArgumentError(
                    f"kvplug.hf: the linear_attention layers of {model_type or type(config).__name__} are not served: "
                    f"kvplug.hf serves the Gated DeltaNet layers of {', '.join(GATED_DELTANET_MODELS)}")
            if "sliding_attention" in kinds:
                raise kvplug.InvalidArgumentError("kvplug.hf: a model with both sliding-window and linear-attention layers "
                                                  "is not served in this version")
            if "full_attention" not in kinds:
                raise kvplug.InvalidArgumentError("kvplug.hf: a model of linear-attention layers only is not served: the "
                                                  "manager's layer group 0 holds full-attention layers")
            if len(types) != layers:
                raise kvplug.InvalidArgumentError(f"kvplug.hf: {len(types)} layer types for {layers} layers")
            return ModelShape(layers, qh, kvh, int(hd), types, 0, RecurrentShape.of(config))
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        if not window or "sliding_attention" not in types or "full_attention" not in types:
            types, window = (), None
        return ModelShape(layers, qh, kvh, int(hd), types, int(window or 0))


@dataclasses.dataclass
class SequenceState:
    tokens: List[int]  # every known token: prompt, then outputs
    computed: int = 0  # leading tokens whose K/V is in the cache (= the manager's length while live, but for
    # a sequence admitted with early loads until it joins a step: the manager holds one more, the token at computed)
    live: bool = False  # holds blocks in the manager
    keys: Optional[kvplug.Keys] = None  # prefix-cache keys (adapter, multimodal, tenant salt)
    # With recurrent states: the checkpoint boundary where the prompt's cached prefix ended at admission, when
    # past its hit (no state there yet); a prompt chunk that passes it ends there, leaving a state (0: none).
    stop: int = 0

    @property
    def pending(self) -> int:
        """Known tokens still to compute."""
        return len(self.tokens) - self.computed


@dataclasses.dataclass
class Batch:
    """One scheduled step: for each sequence, its new tokens at positions
    start .. start + len - 1, the block table and the slots the new tokens'
    K/V go to. Arrays are numpy int32/int64 in batch order."""

    seq_ids: np.ndarray  # int64 [n]
    starts: np.ndarray  # int32 [n]: tokens computed before this step (prefix hits included)
    q_lens: np.ndarray  # int32 [n]: new tokens this step
    input_ids: np.ndarray  # int64 [total]: the new tokens, sequence after sequence
    block_table: np.ndarray  # int32 [n, max_blocks] (-1 padded)
    seq_lens: np.ndarray  # int32 [n]: starts + q_lens
    slot_mapping: np.ndarray  # int32 [total]
    cached_tokens: np.ndarray  # int32 [n]: tokens found in the prefix cache at admission (0 if not admitted now)
    not_admitted: List[int]  # requested sequences left out: the pool could not hold them now
    # Layer groups: every group's block table and slot mapping (group 0's are block_table and slot_mapping;
    # a recurrent group's table holds each sequence's state block in column 0, and it has no slots); None
    # without groups.
    group_tables: Optional[List[np.ndarray]] = None
    group_slots: Optional[List[np.ndarray]] = None
    # Early loads (PagedKVCache early_loads): sequences admitted now whose host tier blocks are loading
    # beside this step; they are live and join the next step that schedules them.
    deferred: List[int] = dataclasses.field(default_factory=list)
    # The host tier loads of this schedule's admissions (one record per admission that has any).
    loads: List[LoadRecord] = dataclasses.field(default_factory=list)
    # Requested sequences the manager refused for good (an InvalidArgumentError, such as a hybrid model's
    # history that the pool's layer groups can never hold: PromptTooLongError), with the error: left out and
    # not live; the caller retires them (remove) or the next schedules refuse them again.
    refused: List[Tuple[int, Exception]] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence has one new token."""
        return len(self.q_lens) > 0 and bool((self.q_lens == 1).all())

    def positions(self) -> np.ndarray:
        """int64 [total]: each new token's position in its sequence."""
        out = np.empty(self.num_tokens, np.int64)
        o = 0
        for s, n in zip(self.starts.tolist(), self.q_lens.tolist()):
            out[o:o + n] = np.arange(s, s + n)
            o += n
        return out

    def qo_indptr(self) -> np.ndarray:
        out = np.zeros(len(self.q_lens) + 1, np.int32)
        np.cumsum(self.q_lens, out=out[1:])
        return out


def _rows_int32(rows: List[List[int]]) -> Any:
    """Rows of token ids for Manager.grow_tokens as int32 views of one array,
    which it takes in place: a list per row costs it a numpy conversion and
    range check per row. Rows with a token outside int32 stay lists, so that
    the manager's own check reports it."""
    total = sum(map(len, rows))
    try:
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, total)
    except OverflowError:
        return rows
    if total and (int(flat.min()) < -(2**31) or int(flat.max()) > 2**31 - 1):
        return rows
    ends = np.cumsum(np.fromiter(map(len, rows), np.int64, len(rows)))
    return np.split(flat.astype(np.int32), ends[:-1])


class PagedKVCache:
    """K/V of every layer in kvplug's paged layout, managed by a
    kvplug.Manager. `num_blocks` blocks of `block_size` tokens; the tensors
    are allocated once (2 * layers * num_blocks * block_size * kv_heads *
    head_dim elements of `dtype` on `device`).

    host_tier_slots > 0 adds the manager's host KV tier, slots of
    block_bytes each (host_slots_for converts GiB), with demote_ahead
    (default_demote_ahead when None); the Runner runs its copies each step
    (self.tier, a kvplug.hf.tier_copy.HostTier; tier_copier picks the
    copier, tier_overlap runs demotions and write-through stores on a side
    stream; None: on with write_through, else off). demote_evicted
    (default: on unless tier_overlap or layer groups) also demotes the
    cached blocks that allocations evict, copied in the step's batch on the
    step's stream ahead of its forward pass (kvplug.Manager's
    demote_evicted; it needs the demotions on the step's stream, so not
    with tier_overlap).
    early_loads (default: on with a host tier, for block_size > 1): a
    prompt whose prefix continues in the host tier, admitted by a schedule
    whose step has other sequences to run, is left out of that step
    (Batch.deferred) while its blocks load on a side stream beside the
    step's forward pass (tier_copy.HostTier.load_early), and joins the
    next step that schedules it, whose stream waits for the loads on the
    device. It is admitted with its cached prefix and one token (in a block
    of its own, which nothing shares or stores before it is full), so that
    nothing it has not computed reads as computed meanwhile; its first
    chunk follows when it joins. A sequence of the step that reads blocks
    being loaded makes the step wait for them. Off: the loads run in the
    step's copies ahead of its forward pass. Batch.loads records each
    admission's loads (time, overlap).
    write_through > 0 copies instead of moving: each step's copies store up
    to that many blocks computed since to the host tier while they stay on
    the GPU (kvplug.Manager's write_through); demote_ahead then defaults to
    0, demote_evicted to off and tier_overlap to on (a store reads blocks
    that stay cached and held until it lands, so it overlaps the next
    forward pass instead of delaying it). write_through_slack (with
    write_through; when nonzero, at least demote_ahead; kvplug.Manager's) holds the stores back while the pool
    has more than that many free blocks: a pool that holds the whole
    working set never evicts, and every store would be wasted copying; the
    computed blocks wait in the queue and are stored, oldest first, once
    the free blocks fall to the slack. None: default_write_through_slack,
    max(2 * write_through, num_blocks // 4) capped at num_blocks, room for
    the allocations of the steps the queue takes to drain (0 with a shared
    tier, which the stores feed); 0 stores every step
    (self.write_through_slack has the value used). shared_tier ("host:port", with a
    host tier) adds the Manager's shared tier (a Valkey or Redis server
    that instances share), with shared_tier_namespace (required: the model
    and layout whose blocks instances of that namespace share),
    shared_tier_timeout_ms, shared_tier_put_queue, and any other of the
    Manager's shared_tier_* arguments (AUTH, TLS, MAC keys) in
    shared_tier_options.

    A hybrid model's shape (layer_types: full and sliding-window attention
    layers, gpt-oss and Gemma 3) gets layer groups (layer_groups None or
    True; False: one table for every layer): its full-attention layers are
    group 0 and its window layers groups of as many, over layer slots
    (self.kv [slots, 2, blocks, ...]; a layer's slot is slot_of[layer], its
    group group_of[layer]), so that the window layers keep only the blocks
    their window reads (kvplug.Manager's layer_groups). With a host tier a
    slot holds one group's layers of a block (num_slots layers, not
    num_layers: block_bytes), a host hit reloads only the window blocks its
    next query reads, and the tier demotes ahead of need only (no
    demote_evicted or write_through with groups in this version); not with
    the shared tier.

    A shape with linear-attention layers (Qwen3-Next) gets them as
    recurrent groups of as many layers as group 0's full-attention ones
    (kvplug.LayerGroup.recurrent): each sequence holds one state block per
    recurrent group, and the layer in slot j keeps its state in slot j's
    page of that block (state_pages). A state lives in the bytes of a K/V
    block, as vLLM's hybrid allocator lays Mamba states over attention
    pages: one pool, one block size, and a block id meaning the same bytes
    in every slot, so that fork and the prefix cache's checkpoints copy
    states as they copy K/V blocks. block_size must make a block's page
    (K and V of one layer) hold a layer's state (min_block_size). With the
    prefix cache, the state is kept at checkpoints every checkpoint_every
    blocks where a step ends (Manager.take_copies), and schedule ends
    prompt chunks there; a prefix hit resumes from the last checkpoint.
    Where a prompt's cached prefix reaches past that checkpoint (a shared
    system prompt whose first user's chunks ended elsewhere), schedule
    ends a chunk at the prefix's end too, so that the next prompt with it
    resumes there (chunk_end).

    kv_dtype torch.float8_e4m3fn holds K and V in FP8 (one byte an element,
    twice the tokens in the memory of a 16-bit cache) with one float32 scale
    per (token, kv head) beside them (self.scales; k_scale/v_scale give a
    layer's), for float16 and bfloat16 models, with the host tier and the
    shared-prefix route too. fp8_prefill picks how prefill reads it:
    "hopper" (the default: Hopper's wgmma mainloop with the tiles widened
    to 16 bits on compute capability 9.0, the sm_80 mainloop elsewhere;
    2.2-2.4x the sm_80 mainloop's speed on an H200), "sm80" (the sm_80
    mainloop everywhere) or "fp8" (the FP8 Q/K/V mode on Hopper, head_dim
    128: faster again over long cached prefixes, with q rounded to e4m3
    too). bench/RESULTS.md ("FP8 prefill at the eight shapes") has the
    three side by side. A 16-bit cache takes no fp8_prefill."""

    def __init__(
        self,
        shape: ModelShape,
        num_blocks: int,
        block_size: int = 16,
        *,
        dtype: torch.dtype = torch.float16,
        device: Any = "cpu",
        prefix_cache: bool = True,
        host_tier_slots: int = 0,
        demote_ahead: Optional[int] = None,
        shared_tier: Optional[str] = None,
        shared_tier_namespace: Optional[str] = None,
        shared_tier_timeout_ms: int = 0,
        shared_tier_put_queue: int = 0,
        shared_tier_options: Optional[Dict[str, Any]] = None,
        tier_copier: Any = None,
        tier_overlap: Optional[bool] = None,
        demote_evicted: Optional[bool] = None,
        write_through: int = 0,
        write_through_slack: Optional[int] = None,
        kv_dtype: Optional[torch.dtype] = None,
        layer_groups: Optional[bool] = None,
        checkpoint_every: int = 1,
        fp8_prefill: Optional[str] = None,
        early_loads: Optional[bool] = None,
    ) -> None:
        if isinstance(shape, ModelShape) is False:
            shape = ModelShape.of(shape)
        self.shape = shape
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.fp8 = self.kv_dtype == getattr(torch, "float8_e4m3fn", None)
        if self.kv_dtype != dtype and not self.fp8:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: kv_dtype must be the model's dtype or torch.float8_e4m3fn, not {kv_dtype}")
        if self.fp8 and dtype not in (torch.float16, torch.bfloat16):
            raise kvplug.InvalidArgumentError(f"kvplug.hf: an FP8 cache serves float16 and bfloat16 models, not {dtype}")
        if shape.recurrent is not None and self.fp8:
            raise kvplug.InvalidArgumentError("kvplug.hf: a model with linear-attention layers does not take an FP8 cache "
                                              "in this version")
        if fp8_prefill not in (None, "sm80", "hopper", "fp8"):
            raise kvplug.InvalidArgumentError(f"kvplug.hf: fp8_prefill must be 'sm80', 'hopper' or 'fp8', not {fp8_prefill!r}")
        if fp8_prefill is not None and not self.fp8:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: fp8_prefill={fp8_prefill!r} is for FP8 caches (kv_dtype "
                                              "torch.float8_e4m3fn)")
        if fp8_prefill == "fp8" and shape.head_dim != 128:
            raise kvplug.UnsupportedError(f"kvplug.hf: fp8_prefill='fp8' (FP8 Q/K/V) is cut for head_dim 128, "
                                          f"not {shape.head_dim}")
        self.fp8_prefill = ("hopper" if fp8_prefill is None else fp8_prefill) if self.fp8 else None
        # Whether prefill plans and shared-prefix plans may use Hopper's wgmma mainloop: always for a
        # 16-bit cache; over FP8 unless fp8_prefill asks for the sm_80 mainloop.
        self.hopper_prefill = not self.fp8 or fp8_prefill != "sm80"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" is the current device: name it, as tensors made there do ("cuda:0"), so that the
            # runner's check that model and cache share a device compares like with like.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefix_cache = prefix_cache
        host_tier_slots = int(host_tier_slots)
        self._plan_groups(shape, layer_groups, tiered=host_tier_slots > 0)
        # A host slot holds one block id over every layer slot: with groups, one group's layers of it.
        self.block_bytes = block_bytes(self.num_slots, self.block_size, shape.num_kv_heads, shape.head_dim, self.kv_dtype)
        kw: Dict[str, Any] = {}
        if host_tier_slots > 0:
            if not prefix_cache:
                raise kvplug.InvalidArgumentError("kvplug.hf: a host tier needs the prefix cache (prefix_cache=True)")
            write_through = int(write_through)
            if demote_ahead is None:
                demote_ahead = 0 if write_through > 0 else self.default_demote_ahead(self.num_blocks)
            kw.update(host_tier_slots=host_tier_slots, host_block_bytes=self.block_bytes, demote_ahead=int(demote_ahead))
            if write_through:
                kw["write_through"] = write_through
                if write_through_slack is None:
                    # With a shared tier the stores are how blocks reach it (other instances read them
                    # there), so none is wasted: store every step.
                    write_through_slack = 0 if shared_tier else self.default_write_through_slack(self.num_blocks, write_through)
                if int(write_through_slack):
                    kw["write_through_slack"] = int(write_through_slack)
            elif write_through_slack:
                raise kvplug.InvalidArgumentError("kvplug.hf: write_through_slack needs write_through > 0")
            if tier_overlap is None:
                tier_overlap = write_through > 0 and demote_evicted is not True
            if demote_evicted and tier_overlap:
                raise kvplug.InvalidArgumentError("kvplug.hf: demote_evicted needs the demotions on the step's stream (not tier_overlap)")
            if len(self.groups) > 1 and (demote_evicted or write_through):
                raise kvplug.InvalidArgumentError("kvplug.hf: with layer groups the host tier demotes ahead of need only "
                                                  "(no demote_evicted or write_through in this version)")
            if demote_evicted is None:
                demote_evicted = not tier_overlap and write_through == 0 and len(self.groups) == 1
            if demote_evicted:
                kw["demote_evicted"] = True
        elif write_through or write_through_slack:
            raise kvplug.InvalidArgumentError("kvplug.hf: write_through and write_through_slack need a host tier "
                                              "(host_tier_slots > 0)")
        self.demote_evicted = bool(kw.get("demote_evicted", False))
        self.write_through = int(kw.get("write_through", 0))
        self.write_through_slack = int(kw.get("write_through_slack", 0))
        if shared_tier:
            if not shared_tier_namespace:
                raise kvplug.InvalidArgumentError(
                    "kvplug.hf: a shared tier needs shared_tier_namespace, naming the model (weights) and K/V layout "
                    "whose blocks it shares: instances of one namespace serve each other's blocks")
            if host_tier_slots <= 0:
                raise kvplug.InvalidArgumentError("kvplug.hf: a shared tier needs a host tier (host_tier_slots > 0): "
                                                  "the blocks it fetches land in host slots")
            extra = dict(shared_tier_options or {})
            bad = [k for k in extra if not k.startswith("shared_tier_")]
            if bad:
                raise kvplug.InvalidArgumentError(f"kvplug.hf: shared_tier_options takes kvplug.Manager's shared_tier_* "
                                                  f"arguments, not {', '.join(sorted(bad))}")
            kw.update(extra, shared_tier=shared_tier, shared_tier_namespace=shared_tier_namespace,
                      shared_tier_timeout_ms=int(shared_tier_timeout_ms), shared_tier_put_queue=int(shared_tier_put_queue))
        elif shared_tier_namespace or shared_tier_options:
            raise kvplug.InvalidArgumentError("kvplug.hf: shared_tier_namespace and shared_tier_options need shared_tier")
        # Tokens between checkpoints of the recurrent states, where schedule ends prompt chunks (0: none kept).
        self.checkpoint_tokens = 0
        self.state_bytes = 0  # a linear-attention layer's state per sequence
        if shape.recurrent is not None:
            self.state_bytes = shape.recurrent.state_bytes(dtype)
            page = self.page_bytes(shape, self.block_size, self.kv_dtype)
            if self.state_bytes > page:
                raise kvplug.InvalidArgumentError(
                    f"kvplug.hf: a linear-attention layer's state of {self.state_bytes} bytes does not fit a block's "
                    f"{page} bytes of K and V per layer at block_size {self.block_size}: block_size >= "
                    f"{self.min_block_size(shape, dtype)} holds it (PagedKVCache.min_block_size)")
            checkpoint_every = int(checkpoint_every) if prefix_cache else 0
            if prefix_cache and checkpoint_every < 1:
                raise kvplug.InvalidArgumentError(f"kvplug.hf: checkpoint_every must be >= 1 block: got {checkpoint_every}")
            self.checkpoint_tokens = checkpoint_every * self.block_size
            kw["block_bytes"] = page
        if len(self.groups) > 1:
            kw["layer_groups"] = [kvplug.LayerGroup.full_attention()] + [
                kvplug.LayerGroup.recurrent(self.state_bytes, checkpoint_every) if kind == "linear_attention"
                else kvplug.LayerGroup.sliding_window(shape.sliding_window) for kind in self.group_kinds[1:]]
        self.manager = kvplug.Manager(self.num_blocks, self.block_size, prefix_cache=prefix_cache, **kw)
        # [layers, 2, blocks, block_size, kv_heads, head_dim]: K and V of a layer share strides, as the kernels
        # require. Zeroed on the CPU so that a reference run is deterministic; on the GPU every slot a kernel
        # reads was written first (kernels skip tokens past seq_lens).
        alloc = torch.zeros if self.device.type == "cpu" else torch.empty
        self.kv = alloc((self.num_slots, 2, self.num_blocks, self.block_size, shape.num_kv_heads, shape.head_dim),
                        dtype=self.kv_dtype, device=self.device)
        # The same memory as bytes, [slots, 2, blocks, page / 2]: block b's page in slot j, its K half and
        # its V half, is [j, :, b], where a recurrent layer keeps its state.
        self._kv_bytes = self.kv.view(torch.uint8).view(self.num_slots, 2, self.num_blocks, -1)
        # FP8: float32 [slots, 2, blocks, block_size, kv_heads], each written row's max |x| / 448.
        self.scales: Optional[torch.Tensor] = None
        if self.fp8:
            self.scales = alloc((self.num_slots, 2, self.num_blocks, self.block_size, shape.num_kv_heads),
                                dtype=torch.float32, device=self.device)
        self.seqs: Dict[int, SequenceState] = {}
        # prompt_tokens: tokens known at each admission, summed; cached_tokens: of them, matched (GPU and host)
        # tier_waits: allocations that found the pool short while host tier copies held blocks, and waited for
        # those copies instead of failing (_wait_for_copies); reload_recoveries: recover_from_failed_reloads calls
        self.stats = {"scheduled_tokens": 0, "cached_tokens": 0, "prompt_tokens": 0, "admitted": 0, "preempted": 0,
                      "forks": 0, "state_copies": 0, "tier_waits": 0, "reload_recoveries": 0}
        # The host tier's copies (Runner.step runs them); closed before the manager, also when collected.
        self.tier: Optional[HostTier] = None
        if host_tier_slots > 0:
            try:
                copier = make_copier(self, tier_copier)
            except BaseException:
                self.manager.close()
                raise
            self.tier = HostTier(self.manager, self.kv, copier, self.block_bytes, overlap=tier_overlap)
            self._tier_finalizer = weakref.finalize(self, self.tier.close)
        # A block of one token is full: the token an early load's admission adds would be cached (and stored)
        # before it is computed.
        self.early_loads = self.tier is not None and early_loads is not False and self.block_size > 1
        self._joining: Dict[int, int] = {}  # admitted with early loads, not joined yet: seq id -> its computed

    def _plan_groups(self, shape: ModelShape, layer_groups: Optional[bool], tiered: bool) -> None:
        """Layer groups of a hybrid shape: group 0 its full-attention
        layers, then its window or linear-attention layers in groups of as
        many (the last one padded); self.groups (each group's layers),
        group_kinds (each group's layer type), group_of, slot_of and
        num_slots. One group of every layer otherwise."""
        n = shape.num_layers
        recurrent = shape.recurrent is not None
        want = bool(shape.layer_types) if layer_groups is None else bool(layer_groups)
        if recurrent and not want:
            raise kvplug.InvalidArgumentError("kvplug.hf: linear-attention layers keep their states in layer groups "
                                              "(layer_groups=False cannot serve them)")
        if want and not shape.layer_types:
            raise kvplug.InvalidArgumentError("kvplug.hf: layer_groups=True needs a model with full and sliding-window layers")
        if want and tiered and recurrent:
            raise kvplug.InvalidArgumentError("kvplug.hf: the host tier does not hold linear-attention layers' states "
                                              "in this version")
        if not want:
            self.groups: List[List[int]] = [list(range(n))]
            self.group_kinds = ["full_attention"]
        else:
            full = [i for i, t in enumerate(shape.layer_types) if t == "full_attention"]
            kind = "linear_attention" if recurrent else "sliding_attention"
            other = [i for i, t in enumerate(shape.layer_types) if t == kind]
            self.groups = [full] + [other[k:k + len(full)] for k in range(0, len(other), len(full))]
            self.group_kinds = ["full_attention"] + [kind] * (len(self.groups) - 1)
        self.group_of = [0] * n
        self.slot_of = [0] * n
        for g, layers in enumerate(self.groups):
            for j, layer in enumerate(layers):
                self.group_of[layer], self.slot_of[layer] = g, j
        self.num_slots = max(map(len, self.groups))
        # The groups whose layers keep a state per sequence (a state block in Batch.group_tables[g][:, 0]).
        self.recurrent_groups = [g for g, k in enumerate(self.group_kinds) if k == "linear_attention"]

    @classmethod
    def for_model(cls, model: Any, num_blocks: int, block_size: int = 16, *, prefix_cache: bool = True,
                  kv_dtype: Optional[torch.dtype] = None, layer_groups: Optional[bool] = None,
                  checkpoint_every: int = 1, fp8_prefill: Optional[str] = None, **tier: Any) -> "PagedKVCache":
        """A cache for `model`'s shape, dtype and device (tier: the host and
        shared tier arguments of the constructor; kv_dtype: the cache's own,
        torch.float8_e4m3fn for FP8; layer_groups, checkpoint_every and
        fp8_prefill: see the class)."""
        p = next(model.parameters())
        return cls(ModelShape.of(model.config), num_blocks, block_size, dtype=p.dtype, device=p.device,
                   prefix_cache=prefix_cache, kv_dtype=kv_dtype, layer_groups=layer_groups,
                   checkpoint_every=checkpoint_every, fp8_prefill=fp8_prefill, **tier)

    @staticmethod
    def page_bytes(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block in one layer slot, its K and V: the manager's
        block_bytes, which a recurrent layer's state must fit."""
        return 2 * block_size * shape.num_kv_heads * shape.head_dim * _element_size(dtype)

    @staticmethod
    def min_block_size(shape: ModelShape, dtype: torch.dtype) -> int:
        """The smallest block_size whose page holds a linear-attention
        layer's state (1 for a shape without such layers). Qwen3-Next-80B in
        bfloat16 needs 1048 tokens (a state of 2 MiB, its recurrent part
        float32, against 2 KiB of K and V per token), as vLLM sizes its
        attention blocks up to its Mamba pages; tiny test shapes need a
        few."""
        if shape.recurrent is None:
            return 1
        per_token = PagedKVCache.page_bytes(shape, 1, dtype)
        return -(-shape.recurrent.state_bytes(dtype) // per_token)

    @staticmethod
    def default_demote_ahead(num_blocks: int, block_size: int = 16, step_tokens: int = 0, max_batch: int = 0) -> int:
        """A demote_ahead that covers one step's allocations: its computed
        tokens' blocks, as many again for blocks reloaded from the host tier
        (not counted in the step's tokens), and a new block for each
        sequence (2 x step_tokens / block_size + max_batch), at most a
        quarter of the pool; without a step size, an eighth of the pool (at
        most 512)."""
        if step_tokens > 0 or max_batch > 0:
            want = 2 * -(-step_tokens // block_size) + max_batch
            return max(1, min(want, num_blocks // 4))
        return max(1, min(num_blocks // 8, 512))

    @staticmethod
    def default_write_through_slack(num_blocks: int, write_through: int) -> int:
        """The write_through_slack PagedKVCache takes when none is given:
        max(2 * write_through, num_blocks // 4), at most num_blocks (0
        without write-through). While the pool has more free blocks than
        this, no cached block can be evicted before the next steps' stores,
        so storing would only cost copy bandwidth; once the free blocks fall
        to it, they must last the few steps the queue (write_through a step)
        takes to drain."""
        if write_through <= 0:
            return 0
        return min(int(num_blocks), max(2 * int(write_through), int(num_blocks) // 4))

    @staticmethod
    def host_slots_for(gib: float, shape: ModelShape, block_size: int, dtype: torch.dtype,
                       layer_groups: Optional[bool] = None) -> int:
        """Host tier slots that `gib` GiB hold for this K/V layout (one slot:
        layers x 2 x block_size x kv_heads x head_dim x dtype bytes, and for
        torch.float8_e4m3fn the block's float32 scales). layers: every layer,
        or with layer groups (layer_groups as the constructor takes it) the
        layer slots, a group's share of a block."""
        layers = shape.num_layers
        if shape.layer_types and shape.recurrent is None and layer_groups is not False:
            layers = shape.layer_types.count("full_attention")
        return int(gib * 2**30) // block_bytes(layers, block_size, shape.num_kv_heads, shape.head_dim, dtype)

    # -- tensors --------------------------------------------------------------

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.kv[self.slot_of[layer], 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.kv[self.slot_of[layer], 1]

    def k_scale(self, layer: int) -> Optional[torch.Tensor]:
        """An FP8 cache's K scales of `layer` ([blocks, block_size,
        kv_heads] float32); None for a 16-bit cache."""
        return None if self.scales is None else self.scales[self.slot_of[layer], 0]

    def v_scale(self, layer: int) -> Optional[torch.Tensor]:
        return None if self.scales is None else self.scales[self.slot_of[layer], 1]

    # -- recurrent states -----------------------------------------------------

    def state_pages(self, layer: int) -> torch.Tensor:
        """uint8 [2, num_blocks, page / 2]: the pages of `layer`'s slot, a
        block's state spanning the K half and then the V half of its page."""
        return self._kv_bytes[self.slot_of[layer]]

    def load_states(self, layer: int, blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The states of linear-attention layer `layer` in the state blocks
        `blocks` (int64 [n] on the cache's device): the convolution's inputs
        [n, conv_dim, conv_kernel - 1] in the model's dtype and the recurrent
        state float32 [n, num_v_heads, head_k_dim, head_v_dim] (copies)."""
        r = self.shape.recurrent
        n = blocks.shape[0]
        flat = self.state_pages(layer)[:, blocks].transpose(0, 1).reshape(n, -1)
        cb = r.conv_bytes(self.dtype)
        conv = flat[:, :cb].contiguous().view(self.dtype).view(n, r.conv_dim, r.conv_kernel - 1)
        rec = flat[:, cb:cb + r.recurrent_bytes].contiguous().view(torch.float32)
        return conv, rec.view(n, r.num_v_heads, r.head_k_dim, r.head_v_dim)

    def store_states(self, layer: int, blocks: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor) -> None:
        """Writes load_states' two tensors (one row per block) into the state blocks."""
        pages = self.state_pages(layer)
        n, half = blocks.shape[0], pages.shape[-1]
        flat = torch.zeros((n, 2 * half), dtype=torch.uint8, device=self.device)
        cb = self.shape.recurrent.conv_bytes(self.dtype)
        flat[:, :cb] = conv.to(self.dtype).contiguous().view(n, -1).view(torch.uint8)
        flat[:, cb:cb + self.shape.recurrent.recurrent_bytes] = rec.float().contiguous().view(n, -1).view(torch.uint8)
        pages[:, blocks] = flat.view(n, 2, half).transpose(0, 1)

    def copy_blocks(self, pairs: Sequence[Tuple[int, int]]) -> None:
        """Performs block copies (src, dst) in their order, every layer slot
        of src into dst: K and V, FP8 scales and the recurrent states that
        live in the same pages. Copies run in batches of one gather and one
        scatter; a batch ends before a copy that reads a block the batch
        writes, or writes one it already writes (a checkpoint's copy
        followed by a prefix hit's copy out of that checkpoint)."""
        i = 0
        while i < len(pairs):
            written: set = set()
            j = i
            while j < len(pairs) and pairs[j][0] not in written and pairs[j][1] not in written:
                written.add(pairs[j][1])
                j += 1
            run = np.array(pairs[i:j], np.int64).reshape(-1, 2)
            if run.min() < 0 or run.max() >= self.num_blocks:
                # torch would read a negative index from the end of the pool.
                raise kvplug.InternalError(f"kvplug.hf: a block copy names a block outside the pool: {pairs[i:j]}",
                                           kvplug.Status.INTERNAL)
            src = torch.from_numpy(run[:, 0]).to(self.device)
            dst = torch.from_numpy(run[:, 1]).to(self.device)
            self.kv[:, :, dst] = self.kv[:, :, src]
            if self.scales is not None:
                self.scales[:, :, dst] = self.scales[:, :, src]
            i = j

    def apply_copies(self) -> int:
        """Performs the copies the manager queued (Manager.take_copies): the
        recurrent states' checkpoints (taken at the last commit) and the
        states of this schedule's prefix hits, in order, on the current
        stream. Runner.step calls it before each forward pass; nothing
        may write a block between the schedule or commit that queued a
        copy and this call (fork calls it first). Returns the copies."""
        if not self.recurrent_groups or not self.prefix_cache:
            return 0
        pairs = self.manager.take_copies()
        if pairs:
            self.copy_blocks(pairs)
            self.stats["state_copies"] += len(pairs)
        return len(pairs)

    @property
    def nbytes(self) -> int:
        n = self.kv.numel() * self.kv.element_size()
        return n if self.scales is None else n + self.scales.numel() * self.scales.element_size()

    @property
    def max_blocks_per_seq(self) -> int:
        return self.num_blocks

    # -- sequences ------------------------------------------------------------

    def add(self, seq_id: int, prompt: Iterable[int], keys: Optional[kvplug.Keys] = None) -> None:
        """Registers a sequence with its prompt. No blocks are taken until a
        schedule admits it. A prompt longer than the whole pool holds is a
        PromptTooLongError here: no schedule could ever admit it."""
        seq_id = int(seq_id)
        if seq_id in self.seqs:
            raise kvplug.DuplicateSequenceError(f"kvplug.hf: sequence {seq_id} exists", kvplug.Status.DUPLICATE_SEQUENCE)
        toks = [int(t) for t in prompt]
        if not toks:
            raise kvplug.InvalidArgumentError(f"kvplug.hf: sequence {seq_id} has an empty prompt", kvplug.Status.INVALID_ARGUMENT)
        if len(toks) > self.manager.num_blocks * self.block_size:
            # Group 0's layers attend to the whole context, which the pool can never hold: refused here, not
            # by an admission in the middle of a schedule that has grown other sequences already.
            raise kvplug.PromptTooLongError(
                f"kvplug.hf: sequence {seq_id}'s prompt of {len(toks)} tokens is longer than the whole pool "
                f"({self.manager.num_blocks} blocks of {self.block_size} tokens): it can never be admitted",
                kvplug.Status.INVALID_ARGUMENT)
        self.seqs[seq_id] = SequenceState(toks, keys=keys)

    def state(self, seq_id: int) -> SequenceState:
        try:
            return self.seqs[int(seq_id)]
        except KeyError:
            raise kvplug.UnknownSequenceError(f"kvplug.hf: unknown sequence {seq_id}", kvplug.Status.UNKNOWN_SEQUENCE) from None

    def append(self, seq_id: int, token: int) -> None:
        """Adds a sampled token; the next step that schedules the sequence
        computes it."""
        self.state(seq_id).tokens.append(int(token))

    def append_tokens(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> None:
        """append for a batch, one sampled token per sequence (tokens[i] is
        seq_ids[i]'s): what a decode step's sampling adds, in one call. All
        or none: an unknown sequence raises before any token is added."""
        if len(seq_ids) != len(tokens):
            raise kvplug.InvalidArgumentError(f"kvplug.hf: {len(tokens)} tokens for {len(seq_ids)} sequences",
                                              kvplug.Status.INVALID_ARGUMENT)
        try:
            states = list(map(self.seqs.__getitem__, seq_ids))  # int-like ids: the dict's hash and == are int's
        except (KeyError, TypeError):
            states = [self.state(i) for i in seq_ids]  # converts other ids; raises UnknownSequenceError naming one
        for s, t in zip(states, list(map(int, tokens))):  # all converted before the first is added
            s.tokens.append(t)

    def fork(self, parent: int, children: Sequence[int]) -> None:
        """Parallel sampling: the children start as copies of `parent`
        (sharing its full blocks; its partial last block is copied). The
        parent must be live with no pending tokens: fork after the step that
        computed its prompt, then append each child's own sampled token."""
        p = self.state(parent)
        if not p.live or p.pending:
            raise kvplug.InvalidArgumentError(
                f"kvplug.hf: fork of sequence {parent} needs it live with every token computed "
                f"(live={p.live}, pending={p.pending})", kvplug.Status.INVALID_ARGUMENT)
        children = [int(c) for c in children]
        for c in children:
            if c in self.seqs:
                raise kvplug.DuplicateSequenceError(f"kvplug.hf: sequence {c} exists", kvplug.Status.DUPLICATE_SEQUENCE)
        # The queued state copies read and write blocks that the fork may allocate and its copies overwrite
        # (a finished sequence's state, a checkpoint the allocation evicts): they go first.
        self.apply_copies()
        copies = self.manager.fork(int(parent), np.array(children, np.int64))
        if copies and self.tier is not None and self.demote_evicted:
            # The blocks the fork's allocation evicted are demoted from their K/V, which the copy-on-write
            # copy below overwrites: their demotions go first, on the same stream.
            self.tier.step(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        if copies:
            # The kernels read dst before the children write their next token into it; a recurrent group's
            # copy is the parent's state.
            self.copy_blocks(copies)
        for c in children:
            self.seqs[c] = SequenceState(list(p.tokens), p.computed, True, p.keys)
        self.stats["forks"] += len(children)

    def preempt(self, seq_id: int) -> int:
        """Frees a live sequence's blocks and keeps its tokens: the next
        schedule re-admits it, recomputing only what the prefix cache lost.
        Returns the tokens it had computed."""
        s = self.state(seq_id)
        done = s.computed
        if s.live:
            self.manager.remove([int(seq_id)])
        self._joining.pop(int(seq_id), None)
        s.live, s.computed = False, 0
        self.stats["preempted"] += 1
        return done

    def recover_from_failed_reloads(self) -> List[int]:
        """After a host tier batch with reloads failed (its exception raised
        by Runner.step or a schedule), the blocks it was loading are cached
        on the GPU without valid K/V, and schedule refuses to run. This
        waits for the copies still in flight, preempts every live sequence
        (their tokens are kept: the next schedules re-admit them, reloading
        from the host tier or recomputing), and clears the GPU prefix cache;
        the host tier's blocks are intact. Returns the preempted sequences."""
        tier = self.tier
        if tier is None:
            return []
        tier.recover()
        live = [sid for sid, s in self.seqs.items() if s.live]
        for sid in live:
            self.preempt(sid)
        self._joining.clear()
        self.manager.clear_prefix_cache()
        self.stats["reload_recoveries"] += 1
        return live

    def remove(self, seq_ids: Iterable[int]) -> None:
        """Retires sequences (their full blocks stay in the prefix cache)."""
        ids = [int(i) for i in seq_ids]
        live = [i for i in ids if self.state(i).live]
        if live:
            self.manager.remove(np.array(live, np.int64))
        for i in ids:
            del self.seqs[i]
            self._joining.pop(i, None)

    # -- scheduling -----------------------------------------------------------

    def schedule(self, requests: Sequence[Tuple[int, int]]) -> Batch:
        """Allocates one step: (seq_id, max_new_tokens) for each sequence to
        run, the number counting tokens to compute (a chunk of a prompt, or 1
        for decode); at most the sequence's pending tokens are taken.

        Live sequences grow first, all or none: when the pool cannot hold
        them this raises kvplug.OutOfBlocksError and nothing changed (preempt
        one and retry). Sequences not live are then admitted in order, each
        starting on its longest cached prefix; admission stops at the first
        that does not fit (Batch.not_admitted lists it and those after it);
        one the manager refuses for good is skipped (Batch.refused, with its
        error; the caller retires it). The batch is ordered live sequences
        first, then the admitted ones.
        With linear-attention layers in the prefix cache, a chunk that
        passes a checkpoint boundary (checkpoint_every blocks) stops at the
        last one it reaches, so that its state is kept there; and at the
        boundary where its cached prefix ended at admission, when that lies
        past its hit (chunk_end).

        With a host tier, blocks whose demotion has landed are freed first
        (never waiting for copies), and an admission counts the tokens the
        host tier holds as matched: they are reloaded by the step's copies
        (Runner.step), not computed. With early_loads, an admission whose
        reloads can overlap the step (other sequences run in it) is left
        out of the batch (Batch.deferred: admitted, live) and its reloads
        start at once on a side stream; the sequence joins the next step
        that schedules it. It is deferred only where its first chunk's
        blocks could be found now (_room), and the blocks its
        chunk still needs are kept from the admissions after it in the same
        schedule: admitted with one token it holds too few to say, and its
        next step's growth would preempt. (With layer groups, not checked.)

        A host tier copy holds its GPU block until the copy completes (a
        write-through store, a demotion ahead of need), and with overlap it
        completes a step or more later: where the pool is short while copies
        that hold blocks (stores, demotions) are in flight, the schedule
        waits for them (stats["tier_waits"]) before it raises
        OutOfBlocksError or leaves out a prompt that the manager refused, so
        that a store never costs a preemption. A prompt left out for the
        blocks a deferred chunk keeps (see above) does not wait: the next
        schedule finds the copies landed."""
        tier = self.tier
        if tier is not None:
            if tier.in_flight:
                tier.poll()
            if tier.reloads_failed:
                raise kvplug.InternalError(
                    "kvplug.hf: a host tier reload failed, so GPU blocks are cached without their K/V: nothing is "
                    "scheduled until PagedKVCache.recover_from_failed_reloads() has preempted the live sequences and "
                    "cleared the GPU prefix cache", kvplug.Status.INTERNAL)
            tier.begin_schedule()
        step = self._decode_step(requests)
        if step is not None:
            ids, starts, flat = step
            # The step's tokens go to the manager as one array (the batch's input_ids), converted and
            # range-checked by one numpy call.
            ids_arr = np.array(ids, np.int64)
            self._grow(ids_arr, flat)  # raises OutOfBlocksError: nothing grew
            return self._batch(ids_arr, starts, np.ones(len(ids), np.int32), flat, [0] * len(ids), [])
        seqs, joining = self.seqs, self._joining
        ids: List[int] = []  # the batch's sequences: live ones first
        starts = []  # tokens computed before this step, per scheduled sequence
        news: List[List[int]] = []  # the new tokens of each scheduled sequence
        grow_ids: List[int] = []
        grows: List[List[int]] = []  # the tokens each growing sequence adds in the manager
        joined: List[int] = []  # sequences admitted with early loads that join now
        patch: List[int] = []  # their rows whose first token the manager holds since admission (no slot in describe)
        admits: List[Tuple[int, int]] = []
        multi = False  # a growing sequence adds more than one token
        for sid, n in requests:
            sid, n = int(sid), int(n)
            s = self.state(sid)
            if n < 1:
                raise kvplug.InvalidArgumentError(f"kvplug.hf: sequence {sid} scheduled for {n} tokens", kvplug.Status.INVALID_ARGUMENT)
            if s.live:
                c, toks = s.computed, s.tokens
                take = self._chunk_end(c, c + min(n, len(toks) - c), s.stop) - c
                if take < 1:
                    raise kvplug.InvalidArgumentError(f"kvplug.hf: sequence {sid} has no pending token to compute "
                                                      "(append the sampled token first)", kvplug.Status.INVALID_ARGUMENT)
                ids.append(sid)
                starts.append(c)
                news.append(toks[c:c + take])
                first = c
                if joining and sid in joining:
                    # Admitted with its hit and the token at c: the manager grows by the rest of the chunk.
                    joined.append(sid)
                    first = c + 1
                    if take > 1:
                        patch.append(len(ids) - 1)
                if c + take > first:
                    grow_ids.append(sid)
                    grows.append(toks[first:c + take])
                    multi = multi or c + take - first > 1
            else:
                admits.append((sid, n))
        if len(set(ids)) + len({a for a, _ in admits}) != len(requests):
            raise kvplug.DuplicateSequenceError("kvplug.hf: a sequence is scheduled twice in one step", kvplug.Status.DUPLICATE_SEQUENCE)
        if grow_ids:
            # A list per sequence costs the manager a conversion and a range check per sequence: the rows
            # go as int32 views of one array (or, one token each, as one flat list).
            grow = _rows_int32(grows) if multi else [t[0] for t in grows]
            self._grow(np.array(grow_ids, np.int64), grow)  # raises OutOfBlocksError: nothing grew
        for sid in joined:
            del joining[sid]
        cached: List[int] = [0] * len(ids)
        not_admitted: List[int] = []
        refused: List[Tuple[int, Exception]] = []
        deferred: List[int] = []
        reserved = 0  # blocks the deferred admissions' chunks still need (see below)
        check_room = tier is not None and len(self.groups) == 1
        loads: List[LoadRecord] = []
        for k, (sid, n) in enumerate(admits):
            s = seqs[sid]
            early = False
            if tier is not None:
                # Tokens the host tier holds beyond the GPU hit are reloaded, not computed: they do not count
                # against the chunk.
                tm = self.manager.match_tiers([s.tokens], s.keys)[0]
                hit = tm.gpu_tokens + tm.host_tokens
                # Early loads, when the step has other sequences to run beside them: the hit and one token
                # (hit < the prompt's length), so that the manager holds nothing uncomputed in a full block
                # while the sequence waits for its next step (a commit in between marks what it holds computed).
                early = tm.host_tokens > 0 and self.early_loads and len(ids) > 0
            elif self.checkpoint_tokens:
                # The hit stops at the last state; where the cached blocks go on past it, no step ended at their
                # end yet: this prompt's does, so that the next prompt sharing them resumes there.
                bm = self.manager.match_blocks([s.tokens], s.keys)[0]
                hit = bm.matched_tokens
                stop = bm.block_tokens - bm.block_tokens % self.checkpoint_tokens
                s.stop = stop if stop > hit else 0
            else:
                hit = self.manager.match([s.tokens], s.keys)[0].matched_tokens if self.prefix_cache else 0
            full = self._chunk_end(hit, min(len(s.tokens), hit + n), s.stop)  # the first chunk's end
            if check_room and (early or reserved):
                # A deferred admission holds its hit and one token, too few blocks to say whether its chunk
                # fits: it is deferred only where the chunk's blocks could be found now, and the blocks its
                # chunk still needs are kept from the admissions after it (reserved), so that they do not
                # take them. (For this schedule only: the next step's growth of the other sequences may
                # still find the pool short, as it may without early loads.)
                if self._blocks_past(full, tm.gpu_tokens) > self._room(s) - reserved:
                    if reserved:  # taking its blocks now would starve a deferred chunk: it waits
                        not_admitted = [a for a, _ in admits[k:]]
                        break
                    early = False  # admitted as without early loads (with its chunk, or not at all)
            upto = hit + 1 if early else full
            try:
                got = self.manager.admit([sid], [s.tokens[:upto]], s.keys)
                if got.size == 0 and self._wait_for_copies():
                    got = self.manager.admit([sid], [s.tokens[:upto]], s.keys)
            except kvplug.InvalidArgumentError as e:
                # Never admissible (with layer groups the manager counts the prompt's blocks in every group):
                # the live sequences have grown already, so the schedule goes on without it rather than raise
                # and leave them out of step with the manager.
                refused.append((sid, e))
                continue
            if got.size == 0:
                not_admitted = [a for a, _ in admits[k:]]
                break
            m = int(got[0])  # may be below `hit` when admitting an earlier sequence evicted blocks
            s.live = True
            if tier is not None and tm.host_tokens > 0 and m > tm.gpu_tokens:
                loads.append(LoadRecord(sid, 0, 0, deferred=early and m == hit))
            if early and m == hit:
                s.computed = m
                joining[sid] = m
                deferred.append(sid)
                if check_room:
                    reserved += self._blocks_past(full, upto)
            else:
                # (Early, with part of the hit lost: it computes what it was admitted with, this step.)
                ids.append(sid)
                starts.append(m)
                news.append(s.tokens[m:upto])
                cached.append(m)
            self.stats["admitted"] += 1
            self.stats["cached_tokens"] += m
            self.stats["prompt_tokens"] += len(s.tokens)
        if loads:
            owners = self._load_owners(loads)
            if deferred:
                tier.load_early(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None, owners)
            else:
                tier.pending_records.extend(owners)  # the step's copies load them (Runner.step)
        q_lens = np.fromiter(map(len, news), np.int32, len(news))
        flat = np.fromiter(itertools.chain.from_iterable(news), np.int64, int(q_lens.sum()))
        batch = self._batch(ids, starts, q_lens, flat, cached, not_admitted, patch)
        batch.deferred, batch.loads, batch.refused = deferred, loads, refused
        if tier is not None and tier.fresh and len(batch):
            # A sequence of this step that reads blocks being loaded (a prompt sharing a prefix with a deferred
            # one, matched on the GPU) has the step's stream wait for those loads.
            tables = batch.group_tables if batch.group_tables is not None else [batch.block_table]
            tier.join_now([f for f in tier.fresh if any(np.isin(f.blocks, t).any() for t in tables)])
        return batch

    def _blocks_past(self, end: int, start: int) -> int:
        """Blocks tokens [0, end) take beyond the full blocks of [0, start)."""
        bs = self.block_size
        return -(-end // bs) - start // bs

    def _room(self, s: SequenceState) -> int:
        """Blocks an admission of s could allocate now beyond its GPU hit
        (Manager.match_room: the free blocks and the evictable cached ones,
        less the hit's blocks that nothing holds; a hit that running or
        deferred sequences share costs nothing)."""
        return self.manager.match_room([s.tokens], s.keys)[0]

    def _grow(self, ids: np.ndarray, tokens: Any) -> None:
        """manager.grow_tokens, waiting once for the host tier's copies in
        flight where the pool is short (see schedule)."""
        try:
            self.manager.grow_tokens(ids, tokens)
        except kvplug.OutOfBlocksError:
            if not self._wait_for_copies():
                raise
            self.manager.grow_tokens(ids, tokens)  # raises OutOfBlocksError: nothing grew

    def _wait_for_copies(self) -> bool:
        """Waits for the host tier's batches in flight and completes them,
        which gives the blocks their copies held back to the prefix cache;
        False when none holds a block an allocation could take (nothing to
        retry). Only stores and demotions do: a reload's blocks belong to
        the live sequence that loads them, so a batch of reloads alone is
        not waited for (the host would wait on the GPU for nothing)."""
        tier = self.tier
        if tier is None or not any(f.demote_bytes for f in tier.in_flight):
            return False
        tier.drain()
        self.stats["tier_waits"] += 1
        return True

    def _load_owners(self, loads: List[LoadRecord]) -> List[Tuple[LoadRecord, np.ndarray]]:
        """(record, every GPU block of its sequence) for admissions with host
        tier loads: which of a flush's reloads are whose."""
        ids = np.array([r.seq_id for r in loads], np.int64)
        if len(self.groups) > 1:
            tables = np.stack([d.block_table for d in self.manager.describe_groups(ids)], axis=1)
        else:
            tables = self.manager.describe(ids).block_table[:, None]
        return [(r, t[t >= 0]) for r, t in zip(loads, tables.reshape(len(loads), -1))]

    def _chunk_end(self, start: int, end: int, stop: int = 0) -> int:
        """Where a step computing tokens start .. end - 1 of a sequence
        stops: chunk_end with this cache's checkpoint period (0 without
        recurrent states in the prefix cache)."""
        return chunk_end(start, end, self.checkpoint_tokens, stop)

    def _decode_step(self, requests: Sequence[Tuple[int, int]]) -> Optional[Tuple[Sequence[int], List[int], np.ndarray]]:
        """A decode step in bulk, one comprehension per field rather than a
        loop over the sequences: (ids, starts, the new token of each, int64)
        when every request is (live sequence, 1) with a token pending and no
        sequence twice; None for anything else (prompt chunks, admissions,
        bad requests), left to schedule's checked loop, which raises the
        precise error. Changes nothing."""
        try:
            ids, ns = zip(*requests)  # TypeError, ValueError: not pairs
            if ns.count(1) != len(ns):
                return None
            states = list(map(self.seqs.__getitem__, ids))  # ids are int-like: the dict's hash and == are int's
            if not all(s.live for s in states) or len(set(ids)) != len(ids):
                return None
            if self._joining and not self._joining.keys().isdisjoint(ids):
                return None  # a sequence admitted with early loads: the manager holds its token already
            starts = [s.computed for s in states]
            flat = np.array([s.tokens[c] for s, c in zip(states, starts)], np.int64)  # IndexError: nothing pending
        except (KeyError, IndexError, TypeError, ValueError, OverflowError):
            return None
        return ids, starts, flat

    def _batch(self, ids: Any, starts: List[int], q_lens: np.ndarray, flat: np.ndarray, cached: List[int],
               not_admitted: List[int], patch: Sequence[int] = ()) -> Batch:
        """The Batch of scheduled sequences (their blocks taken), checked
        against the manager's view. patch: rows whose first new token the
        manager was given before their latest grow (early loads), its slot
        not among describe's."""
        total = flat.shape[0]
        ids_arr = np.asarray(ids, np.int64)
        starts_arr = np.array(starts, np.int32)
        want = starts_arr + q_lens
        group_tables = group_slots = None
        if len(ids_arr) and len(self.groups) > 1:
            group_tables, lens, group_slots = self._describe_groups(ids_arr, want, total)
            if patch:
                group_slots = [sl if g in self.recurrent_groups else self._patch_slots(group_tables[g], sl, patch,
                                                                                       starts_arr, q_lens)
                               for g, sl in enumerate(group_slots)]
            table, slots = group_tables[0], group_slots[0]
        elif len(ids_arr):
            table, lens, slots = self._describe(ids_arr, want, total)
            if patch:
                slots = self._patch_slots(table, slots, patch, starts_arr, q_lens)
        else:
            table, lens, slots = np.zeros((0, 1), np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32)
        # The manager's view and ours must agree, or the kernels would read the wrong K/V.
        if not np.array_equal(lens, want) or len(slots) != total:
            raise kvplug.InternalError(f"kvplug.hf: manager lengths {lens.tolist()} disagree with the schedule "
                                       f"{want.tolist()}", kvplug.Status.INTERNAL)
        self.stats["scheduled_tokens"] += total
        return Batch(ids_arr, starts_arr, q_lens, flat, table, lens, slots, np.array(cached, np.int32), not_admitted,
                     group_tables, group_slots)

    def _patch_slots(self, table: np.ndarray, slots: np.ndarray, patch: Sequence[int], starts: np.ndarray,
                     q_lens: np.ndarray) -> np.ndarray:
        """slots with, for each row of patch, the slot of its first new token
        (at starts[row], in the row's block of table) put before the row's
        slots that describe gave."""
        rows = np.asarray(patch, np.int64)
        counts = q_lens.astype(np.int64)
        counts[rows] -= 1
        offs = (np.cumsum(counts) - counts)[rows]
        pos = starts[rows].astype(np.int64)
        blocks = table[rows, pos // self.block_size].astype(np.int64)
        if (blocks < 0).any():
            raise kvplug.InternalError(f"kvplug.hf: rows {rows.tolist()} have no block at positions {pos.tolist()}",
                                       kvplug.Status.INTERNAL)
        return np.insert(slots, offs, (blocks * self.block_size + pos % self.block_size).astype(np.int32))

    def _describe(self, ids: np.ndarray, lens: np.ndarray, total: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The manager's (block_table, seq_lens, slot_mapping) of a scheduled batch in one C call, the
        buffers sized from the schedule's lengths (the block table as wide as the longest sequence needs,
        as Manager.describe makes it; Manager.describe sizes them with a describe call of its own). A
        manager that holds more than the schedule says is described at its own size, for the caller's
        check to report."""
        mb = max(1, -(-int(lens.max()) // self.block_size))
        table, got, slots = np.empty((len(ids), mb), np.int32), np.empty(len(ids), np.int32), np.empty(total, np.int32)
        try:
            k = self.manager.describe_into(ids, table, got, slots)
        except kvplug.BufferTooSmallError:
            return self.manager.describe(ids)
        return table, got, slots[:k]

    def _describe_groups(self, ids: np.ndarray, lens: np.ndarray,
                         total: int) -> Tuple[List[np.ndarray], np.ndarray, List[np.ndarray]]:
        """_describe for every layer group, also in one C call: (each group's block table, seq_lens, each
        group's slot mapping). The groups' tables share a shape, and so do their mappings: each kind is
        one allocation, its groups' arrays views of it. A recurrent group's mapping, which the manager
        does not write, is empty, as Manager.describe_groups gives it. A manager that holds more than
        the schedule says is described at its own size, for the caller's check to report."""
        n, ng, rec = len(ids), len(self.groups), self.recurrent_groups
        mb = max(1, -(-int(lens.max()) // self.block_size))
        tables = list(np.empty((ng, n, mb), np.int32))
        slots = np.empty((ng, total), np.int32)
        maps: List[Optional[np.ndarray]] = [None if g in rec else slots[g] for g in range(ng)] if rec else list(slots)
        got = np.empty(n, np.int32)
        try:
            k = self.manager.describe_groups_into(ids, tables, got, maps)
        except kvplug.BufferTooSmallError:
            d = self.manager.describe_groups(ids)
            return [x.block_table for x in d], d[0].seq_lens, [x.slot_mapping for x in d]
        return tables, got, [slots[g, :0] if m is None else m[:k] for g, m in enumerate(maps)]

    def commit(self, batch: Batch) -> None:
        """Marks a batch's tokens computed (the runner calls it after the
        forward pass), in the manager too: the blocks the step filled stay
        cached when their sequences go (Manager.mark_computed)."""
        self.manager.mark_computed()
        seqs = self.seqs
        for st, end in zip(map(seqs.get, batch.seq_ids.tolist()), (batch.starts + batch.q_lens).tolist()):
            if st is not None and st.live:
                st.computed = end

    def tier_summary(self) -> Optional[Dict[str, Any]]:
        """The host tier's figures (HostTier.summary), its write-through
        settings (write_through, write_through_slack) and the schedules that
        waited for its copies (tier_waits), None without one."""
        if self.tier is None:
            return None
        d = self.tier.summary(self.stats["prompt_tokens"], self.stats["cached_tokens"])
        d.update(write_through=self.write_through, write_through_slack=self.write_through_slack,
                 tier_waits=self.stats["tier_waits"])
        return d

    def close(self) -> None:
        """Waits for the host tier's copies in flight, unpins its memory and
        destroys the manager."""
        if self.tier is not None:
            self._tier_finalizer()
        self.manager.close()

    def __enter__(self) -> "PagedKVCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
