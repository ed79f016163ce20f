"""GPU tests of attention sinks (gpt-oss: one learned logit per q head in the
softmax denominator) in paged decode, paged prefill (both mainloops, with and
without a window, split-KV, the decode route and the decode rows of a mixed
batch) and the shared-prefix (cascade) route, on torch CUDA tensors through
libkvplug's C ABI.

Each test draws fresh random inputs and sinks from N(log n, 2), n the typical
number of keys a row sees (about the log of a row's own denominator, so
that the sinks move the outputs and some exceed every score of their row),
poisons out and lse with NaN, and compares with a float64
reference: out = sum_j exp(x_j) v_j / (exp(s_h) + sum_j exp(x_j)) and lse =
log(exp(s_h) + sum_j exp(x_j)). Run on a GPU machine with the library built:

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_sinks_torch.py

Skips only on a machine with no NVIDIA device, and fails under
KVPLUG_REQUIRE_GPU=1 (tests/gpu/gputest.py).
"""

import math

import pytest

from gputest import capture, cuda_torch, row_err, skip  # noqa: E402  (tests/gpu: skips only where there is no NVIDIA device)

torch = cuda_torch()

import kvplug  # noqa: E402
from kvplug import attn, cascade  # noqa: E402
from test_prefill_torch import Batch  # noqa: E402  (the random paged batch of the prefill tests)

DEV = torch.device("cuda")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
HOPPER_DEVICE = torch.cuda.get_device_capability() == (9, 0)


def draw_sinks(gen, qh, keys=1):
    """One sink per q head from N(log keys, 2): comparable to the log of the
    denominator of rows that see about `keys` keys."""
    return (torch.randn((qh,), generator=gen, dtype=torch.float64) * 2 + math.log(keys)).float().to(DEV)


def reference(b, sinks, seq_lens=None, scale=None):
    """float64 out and lse of Batch b's query rows with sinks (None: none);
    seq_lens overrides the key count of each sequence (a row then sits at
    position seq_len - q_len + i and sees at most seq_len keys; 0: none)."""
    scale = 1.0 / math.sqrt(b.D) if scale is None else scale
    group = b.qh // b.kvh
    outs, lses = [], []
    for s, n in enumerate(b.q_lens):
        if n == 0:
            continue
        L = b.kv_lens[s] if seq_lens is None else seq_lens[s]
        q0 = int(b.qo[s])
        q = b.q[q0:q0 + n].double()                                   # [n, qh, D]
        k = b.k[s][:L].double().repeat_interleave(group, dim=1)       # [L, qh, D]
        v = b.v[s][:L].double().repeat_interleave(group, dim=1)
        sc = torch.einsum("ihd,thd->hit", q, k) * scale               # [qh, n, L]
        pos = torch.arange(L - n, L, device=DEV)[:, None]
        t = torch.arange(L, device=DEV)[None, :]
        mask = t <= pos
        if b.window >= 0:
            mask &= t >= pos - b.window
        sc = sc.masked_fill(~mask[None], float("-inf"))
        lse = torch.logsumexp(sc, dim=-1)                             # [qh, n]; -inf for no keys
        if sinks is not None:
            lse = torch.logaddexp(lse, sinks.double()[:, None])
        p = torch.exp(sc - lse[..., None]).nan_to_num(0.0)            # a row with no keys and no sink: 0
        outs.append(torch.einsum("hit,thd->ihd", p, v))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def check(out, lse, want, want_lse, dtype, what):
    err, row = row_err(out, want)
    assert err < TOL[dtype], f"{what}: out rel err {err:.2e} at row {row}"
    assert not torch.isnan(lse).any(), f"{what}: lse has NaN (unwritten elements)"
    lerr = (lse.double() - want_lse).abs().max().item()
    assert lerr < 1e-3, f"{what}: lse max abs err {lerr:.2e}"


def poisoned(b):
    return (torch.full_like(b.q, float("nan")),
            torch.full((b.total_q, b.qh), float("nan"), dtype=torch.float32, device=DEV))


def decode(b, sinks, splits, q_len=1, seq_lens=None):
    out, lse = poisoned(b)
    ws = torch.empty(attn.workspace_size(b.total_q, b.qh, b.D, 64), dtype=torch.uint8, device=DEV)
    lens = b.kvl if seq_lens is None else torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    attn.paged_decode(b.q, b.k_cache, b.v_cache, b.table, lens, out=out, lse=lse, workspace=ws, num_splits=splits,
                      q_len=q_len, sinks=sinks)
    torch.cuda.synchronize()
    return out, lse


def ragged_decode(gen, dtype, D, qh, kvh, bs, batch, q_len, max_len):
    kv = [max(q_len, int(x)) for x in torch.randint(1, max_len, (batch,), generator=gen)]
    return Batch(gen, dtype, D, qh, kvh, bs, kv, [q_len] * batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("D", [64, 128])
def test_decode(dtype, q_len, splits, D):
    """Forced one split (the decode kernel adds the sink) and five (the
    partials hold none, the combine adds it once)."""
    gen = torch.Generator().manual_seed(100 + q_len * 10 + splits + D)
    b = ragged_decode(gen, dtype, D, 16, 4, 16, 7, q_len, 900)
    sinks = draw_sinks(gen, b.qh, 450)
    out, lse = decode(b, sinks, splits, q_len)
    want, want_lse = reference(b, sinks)
    check(out, lse, want, want_lse, dtype, f"decode q_len {q_len} splits {splits}")
    # The sinks matter at these values: without them some lse moves by 50
    # times the tolerance the check above holds the kernel's lse to.
    _, plain_lse = reference(b, None)
    assert (want_lse - plain_lse).abs().max().item() > 0.05


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_empty_sequence_gives_zero_and_sink_lse(splits):
    gen = torch.Generator().manual_seed(7)
    b = ragged_decode(gen, torch.float16, 128, 8, 2, 16, 4, 1, 500)
    sinks = draw_sinks(gen, b.qh, 250)
    lens = list(b.kv_lens)
    lens[2] = 0
    out, lse = decode(b, sinks, splits, seq_lens=lens)
    assert torch.equal(out[2].float(), torch.zeros_like(out[2].float())), "a row with no keys must be 0"
    assert torch.allclose(lse[2], sinks, atol=1e-5), "a row with no keys has lse = its sink"
    want, want_lse = reference(b, sinks, seq_lens=lens)
    check(out, lse, want, want_lse, torch.float16, f"decode with an empty sequence, splits {splits}")


def test_decode_minus_inf_sinks_are_no_sinks():
    """A sink of -inf adds exp(-inf) = 0: bit for bit the call without sinks."""
    gen = torch.Generator().manual_seed(8)
    b = ragged_decode(gen, torch.bfloat16, 128, 32, 8, 16, 5, 1, 2000)
    for splits in (1, 6):
        none_out, none_lse = decode(b, None, splits)
        inf_out, inf_lse = decode(b, torch.full((b.qh,), float("-inf"), device=DEV), splits)
        assert torch.equal(none_out, inf_out) and torch.equal(none_lse, inf_lse), f"splits {splits}"


@pytest.fixture(params=[True, False], ids=["hopper", "sm80"])
def hopper(request):
    if request.param and not HOPPER_DEVICE:
        skip("the Hopper kernel needs compute capability 9.0")
    return request.param


def prefill(b, plan, sinks):
    out, lse = poisoned(b)
    attn.paged_prefill(plan, b.q, b.k_cache, b.v_cache, b.table, out=out, lse=lse, sinks=sinks)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [-1, 0, 37, 300])
@pytest.mark.parametrize("D,bs,qh,kvh", [(128, 16, 32, 8), (64, 1, 8, 8), (256, 64, 16, 2)])
def test_prefill(hopper, dtype, window, D, bs, qh, kvh):
    """Prompts, tails after a prefix and chunks in one batch, on the prefill
    route of either mainloop, with and without a window (0: each row sees
    its own token alone)."""
    gen = torch.Generator().manual_seed(200 + window + D + bs)
    kv = [300, 517, 64, 1000, 90]
    ql = [300, 100, 64, 129, 5]
    b = Batch(gen, dtype, D, qh, kvh, bs, kv, ql, window=window)
    sinks = draw_sinks(gen, qh, 200 if window < 0 else window + 1)
    plan = b.plan(hopper=hopper, split_kv=False)
    assert plan.route == attn.ROUTE_PREFILL
    out, lse = prefill(b, plan, sinks)
    want, want_lse = reference(b, sinks)
    check(out, lse, want, want_lse, dtype, f"prefill window {window} ({plan})")


@pytest.mark.parametrize("window", [-1, 200])
def test_prefill_split_kv(hopper, window):
    """A short chunk over a long prefix: the plan splits the K/V range; the
    partials hold no sink and the merge of the splits adds it once."""
    gen = torch.Generator().manual_seed(300 + window)
    b = Batch(gen, torch.bfloat16, 128, 8, 8, 16, [6000, 5000], [64, 32], window=window)
    sinks = draw_sinks(gen, b.qh, 5000 if window < 0 else window)
    plan = b.plan(hopper=hopper)
    assert plan.num_splits > 1, plan
    out, lse = prefill(b, plan, sinks)
    want, want_lse = reference(b, sinks)
    check(out, lse, want, want_lse, torch.bfloat16, f"split prefill ({plan})")


def test_prefill_mixed_batch_decode_rows(hopper):
    """The one-token sequences of a mixed batch go to a decode launch (split
    or not) beside the prefill kernel: each path adds the sink of its rows."""
    gen = torch.Generator().manual_seed(400)
    b = Batch(gen, torch.float16, 128, 32, 8, 16, [800, 3000, 40, 2500, 1], [200, 1, 40, 1, 1])
    sinks = draw_sinks(gen, b.qh, 1000)
    plan = b.plan(hopper=hopper)
    assert plan.route == attn.ROUTE_PREFILL and plan.decode_rows == 3, plan
    out, lse = prefill(b, plan, sinks)
    want, want_lse = reference(b, sinks)
    check(out, lse, want, want_lse, torch.float16, f"mixed batch ({plan})")


@pytest.mark.parametrize("q_len", [1, 2])
def test_prefill_decode_route(q_len):
    gen = torch.Generator().manual_seed(500 + q_len)
    b = Batch(gen, torch.bfloat16, 128, 32, 4, 16, [700, 2000, 33], [q_len] * 3)
    sinks = draw_sinks(gen, b.qh, 700)
    plan = b.plan()
    assert plan.route == attn.ROUTE_DECODE, plan
    out, lse = prefill(b, plan, sinks)
    want, want_lse = reference(b, sinks)
    check(out, lse, want, want_lse, torch.bfloat16, f"decode route q_len {q_len} ({plan})")


def test_prefill_f32():
    """f32 calls take sinks too (the plain kernels end rows through the same
    state as the tensor-core ones)."""
    gen = torch.Generator().manual_seed(600)
    b = Batch(gen, torch.float32, 64, 8, 2, 16, [200, 90, 1], [70, 90, 1], window=50)
    sinks = draw_sinks(gen, b.qh, 40)
    plan = b.plan(hopper=False)
    out, lse = prefill(b, plan, sinks)
    want, want_lse = reference(b, sinks)
    check(out, lse, want, want_lse, torch.float32, f"f32 prefill ({plan})")


def test_decode_graph_replay_reads_new_sinks():
    """A captured decode (split) reads the sinks array at replay: new values
    written into the same tensor change the result as the reference says."""
    gen = torch.Generator().manual_seed(700)
    b = ragged_decode(gen, torch.float16, 128, 32, 8, 16, 3, 1, 3000)
    sinks = draw_sinks(gen, b.qh, 1500)
    ws = torch.empty(attn.workspace_size(b.total_q, b.qh, b.D, 64), dtype=torch.uint8, device=DEV)
    out, lse = poisoned(b)
    attn.prepare()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        attn.paged_decode(b.q, b.k_cache, b.v_cache, b.table, b.kvl, out=out, lse=lse, workspace=ws, num_splits=4,
                          sinks=sinks)
        s.synchronize()
        g = capture(torch, lambda: attn.paged_decode(b.q, b.k_cache, b.v_cache, b.table, b.kvl, out=out, lse=lse,
                                                     workspace=ws, num_splits=4, sinks=sinks), s)
    for trial in range(2):
        sinks.copy_(draw_sinks(gen, b.qh, 1500))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        with torch.cuda.stream(s):
            g.replay()
        s.synchronize()
        want, want_lse = reference(b, sinks)
        check(out, lse, want, want_lse, torch.float16, f"graph replay {trial}")


@pytest.mark.parametrize("decode_route", [False, True])
def test_cascade_decode(decode_route):
    """Shared-prefix decode: the merge of each row's partial states (shared
    runs, tail) adds its sink once; the decode route as paged_decode."""
    gen = torch.Generator().manual_seed(800)
    qh, kvh, D, bs, B = 16, 4, 128, 16, 16
    shared = 40  # blocks every sequence holds
    nb = shared + B * 20
    table = torch.empty((B, shared + 20), dtype=torch.int32)
    table[:, :shared] = torch.arange(shared, dtype=torch.int32)
    lens = []
    for s in range(B):
        table[s, shared:] = torch.arange(shared + 20 * s, shared + 20 * (s + 1), dtype=torch.int32)
        lens.append(shared * bs + int(torch.randint(0, 300, (1,), generator=gen)))
    k = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).half()
    v = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).half()
    q = (torch.rand((B, qh, D), generator=gen) * 4 - 2).half()
    sinks = draw_sinks(gen, qh, shared * bs)
    ws = cascade.Workspaces(B, qh, kvh, D, device=DEV)
    lens_h = torch.tensor(lens, dtype=torch.int32)
    plan = cascade.plan(table, lens_h, lens_h.to(DEV), qh, kvh, D, torch.float16, ws, block_size=bs,
                        decode_route=decode_route)
    if not decode_route:
        assert plan.route == cascade.ROUTE_CASCADE, plan
    out = torch.full((B, qh, D), float("nan"), dtype=torch.float16, device=DEV)
    lse = torch.full((B, qh), float("nan"), dtype=torch.float32, device=DEV)
    cascade.paged_cascade(plan, q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV), out=out, lse=lse, sinks=sinks)
    torch.cuda.synchronize()
    want = torch.zeros((B, qh, D), dtype=torch.float64)
    want_lse = torch.zeros((B, qh), dtype=torch.float64)
    g = qh // kvh
    for s in range(B):
        L = lens[s]
        blocks = table[s, :-(-L // bs)].long()
        kk = k[blocks].reshape(-1, kvh, D)[:L].double()
        vv = v[blocks].reshape(-1, kvh, D)[:L].double()
        for h in range(qh):
            x = (kk[:, h // g] @ q[s, h].double()) / math.sqrt(D)
            tot = torch.logaddexp(torch.logsumexp(x, 0), sinks[h].double().cpu())
            want_lse[s, h] = tot
            want[s, h] = torch.exp(x - tot) @ vv[:, h // g]
    check(out, lse, want.to(DEV), want_lse.to(DEV), torch.float16, f"cascade ({plan})")


def test_sinks_argument_errors():
    gen = torch.Generator().manual_seed(900)
    b = ragged_decode(gen, torch.float16, 64, 8, 2, 16, 2, 1, 100)
    plan = b.plan()
    good = draw_sinks(gen, b.qh)
    bad = [
        (good.double(), "float32"),
        (good.half(), "float32"),
        (good[:-1], "one per q head"),
        (torch.zeros((b.qh, 1), device=DEV), "dimensions"),
        (good.cpu(), "CUDA"),
        (torch.zeros(2 * b.qh, device=DEV)[::2], "contiguous"),
    ]
    for s, msg in bad:
        with pytest.raises(kvplug.InvalidArgumentError, match=msg):
            attn.paged_decode(b.q, b.k_cache, b.v_cache, b.table, b.kvl, sinks=s)
        with pytest.raises(kvplug.InvalidArgumentError, match=msg):
            attn.paged_prefill(plan, b.q, b.k_cache, b.v_cache, b.table, sinks=s)
