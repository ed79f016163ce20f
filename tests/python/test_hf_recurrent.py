"""kvplug.hf serving a Qwen3-Next-shaped hybrid -- Gated DeltaNet
(linear-attention) layers, three to each full-attention layer -- from a
small config built in code with random weights, on kvplug's manager with
its six linear layers in three recurrent groups of two: each sequence's
conv and recurrent states live in its state blocks, forks copy them, and the
prefix cache keeps them at checkpoints that a later prompt resumes from.
Every logit row the engine computes (packed batches of sequences of
different lengths, chunked prefill, decode, prefix hits through a
checkpoint, preemption, forks) matches transformers' own forward of the same
model, teacher forced, in float32 on the CPU. tests/gpu/test_hf_recurrent_gpu.py
runs the engine harness on the kernels."""

from __future__ import annotations

import copy
import pathlib
import sys
import types

import numpy as np
import pytest
import torch
import transformers

import kvplug
import kvplug.hf as kvhf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_hf_correctness as H  # noqa: E402

# Twice the hybrid tests' bound: the gated delta rule's chunked form rounds differently with each chunking, and
# transformers' own forward over a 96-token sequence and its token-by-token decode of the same tokens differ by up
# to 6e-5 on these logits (|logit| <= 3). A wrong or missing state costs errors of 2 to 4 (the tests that corrupt one
# or drop its copy).
ATOL = RTOL = 1e-4
BLOCK = 8  # a block's page (K and V of one layer: 2 x 8 x 2 x 16 float32) holds a layer's 1792-byte state


def tiny_qwen3_next(dtype=torch.float32, device="cpu", seed=0, experts=4, layers=8, **over):
    """An 8-layer Qwen3-Next (linear, linear, linear, full, twice), GQA
    4:2, head_dim 16, Gated DeltaNet layers of 2 key and 4 value heads of 8,
    a mixture of `experts` experts (two a token; 0: a dense MLP). Weights
    drawn wide enough for logits of O(1), and every value head's decay slow
    enough (A in [0.02, 1]) that a state carries over many tokens: a wrong
    or missing state changes the logits."""
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=experts,
               num_experts_per_tok=min(2, experts), moe_intermediate_size=32, shared_expert_intermediate_size=32,
               max_position_embeddings=1024, initializer_range=0.1)
    cfg.update(over)
    config = transformers.Qwen3NextConfig(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.A_log.copy_(torch.linspace(0.02, 1.0, m.A_log.numel()).log())
    return model.to(device=device, dtype=dtype)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_next()


def rows_against(ref: torch.Tensor, got: torch.Tensor, start: int) -> float:
    """Max |got - ref| over got's rows (positions start..), asserted within
    ATOL + RTOL * max |ref|."""
    want = ref[start:start + got.shape[0]]
    err = (got.cpu() - want.cpu()).abs().max().item()
    assert err <= ATOL + RTOL * want.abs().max().item(), f"rows from position {start}: max error {err:.3e}"
    return err


def test_shape_and_groups(model):
    shape = kvhf.ModelShape.of(model.config)
    assert shape.layer_types == tuple(model.config.layer_types)
    assert shape.recurrent == kvhf.RecurrentShape(conv_dim=2 * 2 * 8 + 4 * 8, conv_kernel=4, num_v_heads=4, head_k_dim=8,
                                                  head_v_dim=8)
    assert shape.recurrent.state_bytes(torch.float32) == 64 * 3 * 4 + 4 * 8 * 8 * 4
    assert kvhf.PagedKVCache.min_block_size(shape, torch.float32) == 7
    kvmodel = H.twin(model)
    with kvhf.PagedKVCache.for_model(kvmodel, 64, BLOCK) as cache:
        # The two full layers are group 0; the six linear ones three recurrent groups of two.
        assert cache.groups == [[3, 7], [0, 1], [2, 4], [5, 6]] and cache.num_slots == 2
        assert cache.recurrent_groups == [1, 2, 3]
        kinds = [g.kind for g in cache.manager.layer_groups]
        assert kinds == [kvplug.LayerGroup.FULL_ATTENTION] + [kvplug.LayerGroup.RECURRENT] * 3
        runner = kvhf.Runner(kvmodel, cache, max_batch=2, max_step_tokens=64, max_model_len=64)
        cache.add(0, list(range(1, 21)))
        batch = cache.schedule([(0, 64)])
        # 20 tokens stop at the checkpoint boundary 16 (checkpoint_every 1 block of 8): the state is kept there.
        assert batch.q_lens.tolist() == [16]
        runner.step(batch)
        assert cache.manager.group_blocks()[1:] == [1, 1, 1], "one state block per recurrent group"
        cache.remove([0])


def test_layer_types_it_cannot_serve_raise():
    base = dict(num_hidden_layers=4, num_attention_heads=4, hidden_size=64, num_key_value_heads=2, head_dim=16,
                model_type="qwen3_next", linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4)
    cfg = lambda **kw: types.SimpleNamespace(**{**base, **kw})  # noqa: E731
    with pytest.raises(kvplug.InvalidArgumentError, match="mamba"):
        kvhf.ModelShape.of(cfg(layer_types=["mamba", "mamba", "mamba", "full_attention"]))
    with pytest.raises(kvplug.InvalidArgumentError, match="minimax"):
        kvhf.ModelShape.of(cfg(model_type="minimax", layer_types=["linear_attention"] * 3 + ["full_attention"]))
    with pytest.raises(kvplug.InvalidArgumentError, match="sliding-window and linear"):
        kvhf.ModelShape.of(cfg(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
                               sliding_window=8))
    with pytest.raises(kvplug.InvalidArgumentError, match="linear-attention layers only"):
        kvhf.ModelShape.of(cfg(layer_types=["linear_attention"] * 4))
    with pytest.raises(kvplug.InvalidArgumentError, match="linear_conv_kernel_dim"):
        kvhf.ModelShape.of(cfg(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=None))
    ok = kvhf.ModelShape.of(cfg(layer_types=["linear_attention"] * 3 + ["full_attention"]))
    assert ok.recurrent is not None and ok.sliding_window == 0


def test_cache_misuse_is_clear(model):
    shape = kvhf.ModelShape.of(model.config)
    with pytest.raises(kvplug.InvalidArgumentError, match="block_size >= 7"):
        kvhf.PagedKVCache(shape, 64, 4, dtype=torch.float32)
    with pytest.raises(kvplug.InvalidArgumentError, match="layer_groups=False"):
        kvhf.PagedKVCache(shape, 64, BLOCK, dtype=torch.float32, layer_groups=False)
    with pytest.raises(kvplug.InvalidArgumentError, match="host tier"):
        kvhf.PagedKVCache(shape, 64, BLOCK, dtype=torch.float32, host_tier_slots=8)
    with pytest.raises(kvplug.InvalidArgumentError, match="FP8"):
        kvhf.PagedKVCache(shape, 64, 16, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(kvplug.InvalidArgumentError, match="checkpoint_every"):
        kvhf.PagedKVCache(shape, 64, BLOCK, dtype=torch.float32, checkpoint_every=0)
    unprepared = copy.deepcopy(model)
    unprepared.set_attn_implementation(kvhf.NAME)  # the attention switched, the linear layers not
    with kvhf.PagedKVCache.for_model(unprepared, 64, BLOCK) as cache:
        with pytest.raises(kvplug.InvalidArgumentError, match="prepare_model"):
            kvhf.Runner(unprepared, cache)


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_packed_batches_chunks_and_decode_match_transformers(model, prefix_cache):
    """Five sequences of 1 to 45 tokens in one packed batch, their prompts
    in chunks of 3 or 13 tokens (with the prefix cache, a chunk that passes
    a block boundary stops there, so some start inside blocks and some
    stop short), then 6 decode steps, every step all five together once
    admitted: every row against transformers' teacher-forced logits."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 97, n).tolist() for n in (1, 5, 23, 17, 45)]
    outputs = [rng.integers(1, 97, 6).tolist() for _ in prompts]
    chunk = [3, 13, 13, 3, 13]
    kvmodel = H.twin(model)
    got = {i: [] for i in range(len(prompts))}
    with kvhf.PagedKVCache.for_model(kvmodel, 64, BLOCK, prefix_cache=prefix_cache) as cache:
        runner = kvhf.Runner(kvmodel, cache, max_batch=8, max_step_tokens=128, max_model_len=64)
        for i, p in enumerate(prompts):
            cache.add(i, p)
        starts_inside = cut = 0
        while any(cache.seqs[i].pending for i in got):
            batch = cache.schedule([(i, chunk[i]) for i in got if cache.seqs[i].pending])
            logits = runner.step(batch, all_logits=True)
            qo = batch.qo_indptr()
            for k, sid in enumerate(batch.seq_ids.tolist()):
                got[sid].append((int(batch.starts[k]), logits[qo[k]:qo[k + 1]]))
                starts_inside += int(batch.starts[k]) % BLOCK != 0 and batch.q_lens[k] > 1
                want = min(chunk[sid], len(prompts[sid]) - int(batch.starts[k]))
                cut += int(batch.q_lens[k]) < want
        assert len(set(map(len, got.values()))) > 1, "sequences of several chunk counts shared steps"
        assert starts_inside >= 1
        assert (cut >= 1) == prefix_cache, "chunks stop at checkpoint boundaries only with the prefix cache"
        for t in range(6):
            cache.append_tokens(list(got), [o[t] for o in outputs])
            batch = cache.schedule([(i, 1) for i in got])
            assert batch.is_decode and len(batch) == 5
            logits = runner.step(batch, all_logits=True)
            for k, sid in enumerate(batch.seq_ids.tolist()):
                got[sid].append((int(batch.starts[k]), logits[k:k + 1]))
        assert cache.stats["state_copies"] > 0 if prefix_cache else cache.stats["state_copies"] == 0
        cache.remove(list(got))
        cache.manager.check()
    worst = 0.0
    for i, p in enumerate(prompts):
        ref = H.reference_logits(model, p + outputs[i], len(p))
        assert sum(r.shape[0] for _, r in got[i]) == len(p) + 6
        for start, rows in got[i]:
            worst = max(worst, rows_against(ref, rows, start))
    print(f"max logit error {worst:.2e}")


def run_prompt(cache, runner, sid, tokens, chunk):
    """Computes a prompt in chunks; returns (the first batch's cached
    tokens, the logits of every computed position, from that one)."""
    cache.add(sid, tokens)
    rows, hit = [], None
    while cache.seqs[sid].pending:
        batch = cache.schedule([(sid, chunk)])
        if hit is None:
            hit = int(batch.cached_tokens[0])
        rows.append(runner.step(batch, all_logits=True))
    return hit, torch.cat(rows)


def test_shared_system_prompt_resumes_from_a_checkpoint(model):
    """Request A (a 40-token system prompt and its own 9 tokens) runs in
    chunks of 16, leaving checkpoints at 16, 32 and 48 tokens, and decodes;
    request B (the system prompt and 7 other tokens) then hits the 32
    tokens up to the last checkpoint inside the system prompt, its states
    copied from that checkpoint, and computes the rest: its logits are those
    of transformers and of a run without the prefix cache. With the copies
    left out, they are not: the hit does read the checkpoint."""
    rng = np.random.default_rng(5)
    system = rng.integers(1, 97, 40).tolist()
    a = system + rng.integers(1, 97, 9).tolist()
    b = system + rng.integers(1, 97, 7).tolist()
    kvmodel = H.twin(model)

    def serve(prefix_cache, drop_copies=False):
        with kvhf.PagedKVCache.for_model(kvmodel, 64, BLOCK, prefix_cache=prefix_cache) as cache:
            runner = kvhf.Runner(kvmodel, cache, max_batch=2, max_step_tokens=64, max_model_len=64)
            hit_a, _ = run_prompt(cache, runner, 0, a, 16)
            for t in (11, 12, 13):
                cache.append(0, t)
                runner.step(cache.schedule([(0, 1)]))
            cache.remove([0])
            copies = cache.stats["state_copies"]
            if drop_copies:
                cache.copy_blocks = lambda pairs: None
            hit_b, rows = run_prompt(cache, runner, 1, b, 64)
            cache.manager.check()
            return hit_a, hit_b, cache.stats["state_copies"] - copies, rows

    hit_a, hit_b, copies, rows = serve(True)
    assert hit_a == 0 and hit_b == 32, (hit_a, hit_b)
    assert copies >= 3, "a state copy per recurrent group out of the checkpoint"
    ref = H.reference_logits(model, b, len(b))
    err = rows_against(ref, rows, 32)
    _, hit_plain, _, plain = serve(False)
    assert hit_plain == 0
    rows_against(ref, plain, 0)
    assert (rows - plain[32:]).abs().max() <= ATOL + RTOL * plain.abs().max()
    _, _, _, wrong = serve(True, drop_copies=True)
    assert (wrong - ref[32:]).abs().max() > 1e-2, "a hit without its state gives other logits"
    print(f"max logit error after the hit {err:.2e}")


def test_a_chunk_ends_where_the_shared_prefix_ends(model):
    """A 40-token system prompt, longer than a chunk of 24: user A's chunks
    end at 24 and 48, so the system prompt's last state is at 24. User B
    (the system prompt and 15 other tokens) hits those 24, and its cached
    blocks go on to 40 (Manager.match_blocks): its first step ends there,
    not at 48, leaving a state at the system prompt's end. User C then hits
    all 40 tokens, past the first chunk's boundary, and its logits after the
    hit are transformers' and those of a run without the prefix cache."""
    rng = np.random.default_rng(13)
    system = rng.integers(1, 97, 40).tolist()
    a, b, c = (system + rng.integers(1, 97, k).tolist() for k in (9, 15, 5))
    kvmodel = H.twin(model)

    def serve(prefix_cache):
        with kvhf.PagedKVCache.for_model(kvmodel, 64, BLOCK, prefix_cache=prefix_cache) as cache:
            runner = kvhf.Runner(kvmodel, cache, max_batch=1, max_step_tokens=64, max_model_len=64)
            hits, rows = [], None
            for sid, p in enumerate((a, b, c)):
                if prefix_cache and sid == 1:
                    got = cache.manager.match_blocks([p])[0]
                    assert got == kvplug.BlockMatch(24, 40), f"B: the hit stops at A's state at 24, the blocks go on: {got}"
                cache.add(sid, p)
                ends = []
                first = None
                while cache.seqs[sid].pending:
                    batch = cache.schedule([(sid, 24)])
                    if first is None:
                        first = int(batch.cached_tokens[0])
                    ends.append(int(batch.seq_lens[0]))
                    out = runner.step(batch, all_logits=True)
                    rows = out if len(ends) == 1 else torch.cat([rows, out])
                if prefix_cache and sid == 1:
                    assert ends == [40, 48, 55], f"B's steps end at {ends}, want at the system prompt's end first"
                cache.remove([sid])
                hits.append(first)
            cache.manager.check()
            return hits, rows

    hits, rows = serve(True)
    assert hits == [0, 24, 40], hits
    ref = H.reference_logits(model, c, len(c))
    err = rows_against(ref, rows, 40)
    plain_hits, plain = serve(False)
    assert plain_hits == [0, 0, 0]
    rows_against(ref, plain, 0)
    assert (rows - plain[40:]).abs().max() <= ATOL + RTOL * plain.abs().max()
    print(f"max logit error after the hit {err:.2e}")


def test_a_hit_keeps_its_checkpoint_when_the_pool_is_short(model):
    """A pool of 16 blocks of 8: A (16 tokens) leaves a checkpoint at 16
    (three blocks, one per recurrent group) and goes; D (16 other tokens,
    live) leaves one too, which fills the pool. B (A's 16 tokens and 8 more)
    matches A's checkpoint, but its admission with that hit does not fit:
    the checkpoint it would copy from is not among the blocks the admission
    may evict, so B waits, with nothing changed (it still matches). Once D
    goes, B is admitted on A's checkpoint and its logits are
    transformers'."""
    rng = np.random.default_rng(9)
    a = rng.integers(1, 97, 16).tolist()
    d = rng.integers(1, 97, 16).tolist()
    b = a + rng.integers(1, 97, 8).tolist()
    kvmodel = H.twin(model)
    with kvhf.PagedKVCache.for_model(kvmodel, 16, BLOCK) as cache:
        runner = kvhf.Runner(kvmodel, cache, max_batch=2, max_step_tokens=64, max_model_len=64)
        assert run_prompt(cache, runner, 1, a, 16)[0] == 0
        assert run_prompt(cache, runner, 2, d, 16)[0] == 0
        cache.remove([1])
        assert cache.manager.match([b])[0].matched_tokens == 16, "B matches A's checkpoint"
        cache.add(3, b)
        assert len(cache.schedule([(3, 64)])) == 0, "B fits only by evicting the checkpoint it hits"
        cache.manager.check()
        assert cache.manager.match([b])[0].matched_tokens == 16, "the refused admission changed nothing"
        cache.remove([2])
        rows = []
        while cache.seqs[3].pending:
            batch = cache.schedule([(3, 64)])
            if not rows:
                assert int(batch.cached_tokens[0]) == 16, "B resumes from A's checkpoint"
            rows.append(runner.step(batch, all_logits=True))
        cache.manager.check()
    rows_against(H.reference_logits(model, b, len(b)), torch.cat(rows), 16)


def test_corrupted_state_is_detected(model):
    """The comparison can fail: a sequence's state block overwritten between
    steps makes its next rows differ."""
    kvmodel = H.twin(model)
    toks = np.random.default_rng(6).integers(1, 97, 31).tolist()
    ref = H.reference_logits(model, toks, 30)
    for corrupt in (False, True):
        with kvhf.PagedKVCache.for_model(kvmodel, 64, BLOCK, prefix_cache=False) as cache:
            runner = kvhf.Runner(kvmodel, cache, max_batch=1, max_step_tokens=64, max_model_len=64)
            cache.add(0, toks[:30])
            runner.step(cache.schedule([(0, 30)]))
            cache.append(0, toks[30])
            batch = cache.schedule([(0, 1)])
            if corrupt:
                state = int(batch.group_tables[1][0, 0])  # layer 0's group
                cache.kv[0, 1, state] += 1.0  # the V half of layer 0's page: most of its recurrent state
            got = runner.step(batch, all_logits=True)
        if corrupt:
            assert (got[0] - ref[30]).abs().max() > 1e-3
        else:
            rows_against(ref, got, 30)


@pytest.mark.parametrize("num_blocks", [96, 48], ids=["hits", "preemption"])
def test_engine_matches_transformers(model, num_blocks):
    """examples/hf_engine.py over the recurrent cache: requests sharing a
    40-token system prompt arriving at once, chunked prefill, mixed steps
    and forks (two requests sampled 3 ways, their states copied). 96 blocks
    keep the system prompt's checkpoints for prefix hits; in 48, sequences
    are preempted and re-admitted, and the allocations evict every
    checkpoint before a later prompt can hit it (each checkpoint takes a
    block per recurrent group, three here). Every row against
    transformers."""
    eng_mod = H.load_engine()
    reqs = H.make_requests(eng_mod, model.config.vocab_size)
    engine, rec = H.run_engine(model, torch.float32, "cpu", reqs, num_blocks=num_blocks, block_size=BLOCK)
    assert all(r.finished is not None for r in reqs)
    if num_blocks == 96:
        assert rec.prefix_hits >= 3, rec.prefix_hits
    else:
        assert engine.preemptions >= 1, "the pool is small enough to preempt"
    assert rec.steps["mixed"] >= 1 and rec.steps["decode"] >= 1, rec.steps
    assert engine.cache.stats["forks"] == 4 and engine.cache.stats["state_copies"] > 0
    count, worst = H.compare(model, engine, rec, reqs, atol=ATOL, rtol=RTOL)
    assert count > 200
    print(f"{count} rows, worst error {worst:.2f} of the bound")


def test_preempted_sequence_resumes_from_its_checkpoint(model):
    """A 30-token prompt in chunks of 16 runs [0, 16), [16, 24) (the chunk
    stops at the checkpoint boundary) and [24, 30), then decodes two
    tokens; preempted, it is re-admitted on its checkpoint at 24 tokens and
    recomputes only the rest."""
    toks = np.random.default_rng(7).integers(1, 97, 33).tolist()
    ref = H.reference_logits(model, toks, 30)
    kvmodel = H.twin(model)
    with kvhf.PagedKVCache.for_model(kvmodel, 64, BLOCK) as cache:
        runner = kvhf.Runner(kvmodel, cache, max_batch=1, max_step_tokens=64, max_model_len=64)
        cache.add(0, toks[:30])
        spans = []
        while cache.seqs[0].pending:
            batch = cache.schedule([(0, 16)])
            spans.append((int(batch.starts[0]), int(batch.seq_lens[0])))
            rows_against(ref, runner.step(batch, all_logits=True), spans[-1][0])
        assert spans == [(0, 16), (16, 24), (24, 30)]
        for t in toks[30:32]:
            cache.append(0, t)
            runner.step(cache.schedule([(0, 1)]))
        assert cache.preempt(0) == 32
        batch = cache.schedule([(0, 64)])
        assert batch.cached_tokens.tolist() == [24] and batch.q_lens.tolist() == [8]
        rows_against(ref, runner.step(batch, all_logits=True), 24)
        cache.append(0, toks[32])
        rows_against(ref, runner.step(cache.schedule([(0, 1)]), all_logits=True), 32)


def test_forks_copy_the_states(model):
    """A prompt forked into three samples: each child starts from a copy of
    the parent's states (its own state blocks) and decodes its own tokens;
    each matches transformers on its own sequence."""
    rng = np.random.default_rng(8)
    prompt = rng.integers(1, 97, 21).tolist()
    tails = [rng.integers(1, 97, 4).tolist() for _ in range(3)]
    kvmodel = H.twin(model)
    with kvhf.PagedKVCache.for_model(kvmodel, 64, BLOCK) as cache:
        runner = kvhf.Runner(kvmodel, cache, max_batch=3, max_step_tokens=64, max_model_len=64)
        cache.add(0, prompt)
        while cache.seqs[0].pending:
            runner.step(cache.schedule([(0, 64)]))
        cache.fork(0, [1, 2])
        states = {sid: cache.manager.describe_groups([sid])[1].block_table[0, 0] for sid in (0, 1, 2)}
        assert len(set(states.values())) == 3, "each child has its own state block"
        got = {sid: [] for sid in (0, 1, 2)}
        for t in range(4):
            cache.append_tokens([0, 1, 2], [tails[sid][t] for sid in (0, 1, 2)])
            logits = runner.step(cache.schedule([(sid, 1) for sid in (0, 1, 2)]), all_logits=True)
            for k in range(3):
                got[k].append(logits[k])
        cache.remove([0, 1, 2])
    for sid in (0, 1, 2):
        ref = H.reference_logits(model, prompt + tails[sid], len(prompt))
        rows_against(ref, torch.stack(got[sid]), len(prompt))


def test_generate_matches_transformers_generate(model):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3] * 21, list(range(40, 75))]
    want = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=8, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    assert kvhf.generate(H.twin(model), prompts, max_new_tokens=8, chunk=16, block_size=BLOCK) == want
