"""GPU tests of FP8 (e4m3) KV caches through kvplug.attn on torch tensors:
kv_write quantises (one scale per token and kv head, or one per cache),
paged_decode and paged_prefill (both mainloops: the sm_80 one, and on a
Hopper GPU the wgmma one that widens e4m3 tiles on their way into shared
memory; with and without the decode route, with a window, split-KV) read
the e4m3 cache, against a float64
reference over the dequantised cache (e4m3 * scale), outputs poisoned with
NaN first; FP8's own error against the 16-bit cache stays small; misuse
raises. A sweep of paged_decode over the e4m3 cache covers q_len new tokens
per sequence, sliding windows, sinks and forced splits pairwise with
head_dim, block size, batch, GQA group and K outlier channels. Run as
tests/gpu/test_attn_torch.py.
"""

import math
import zlib

import pytest

from gputest import capture, check_rows, cuda_torch, row_err, window_reference  # noqa: E402

torch = cuda_torch()

import kvplug  # noqa: E402
from kvplug import attn  # noqa: E402

from test_attn_torch import DEV, TOL, Paged, ragged, window_table  # noqa: E402
from test_sinks_torch import draw_sinks  # noqa: E402

E4M3 = torch.float8_e4m3fn


class Paged8:
    """p's K and V written by kv_write into e4m3 caches of p's layout: with
    per-token-head scales ("token") or one scale per cache ("tensor")."""

    def __init__(self, p, kind):
        shape = tuple(p.k_cache.shape)
        self.p = p
        self.k8 = torch.full(shape, float("nan"), device=DEV).to(E4M3)
        self.v8 = torch.full(shape, float("nan"), device=DEV).to(E4M3)
        if kind == "token":
            self.ks = torch.full(shape[:3], float("nan"), device=DEV)
            self.vs = torch.full(shape[:3], float("nan"), device=DEV)
        else:
            self.ks = (p.k.abs().max().float() / 448).reshape(1)
            self.vs = (p.v.abs().max().float() / 448).reshape(1)
        attn.kv_write(p.k, p.v, self.k8, self.v8, p.slots, k_scale=self.ks, v_scale=self.vs)

    def dequantized(self):
        """The caches as float64, e4m3 * scale."""
        ks, vs = self.ks, self.vs
        if ks.dim() == 3:
            ks, vs = ks[..., None], vs[..., None]
        return self.k8.double() * ks.double(), self.v8.double() * vs.double()

    def reference(self, scale):
        """float64 attention over the dequantised caches, through p's table."""
        p = self.p
        kd, vd = self.dequantized()
        B, g = len(p.lens), p.qh // p.kvh
        out = torch.zeros((B, p.qh, p.D), dtype=torch.float64, device=DEV)
        for b, L in enumerate(p.lens):
            if L == 0:
                continue
            t = torch.arange(L, device=DEV)
            blk = p.table[b, t // p.bs].long()
            k = kd[blk, t % p.bs].repeat_interleave(g, dim=1)
            v = vd[blk, t % p.bs].repeat_interleave(g, dim=1)
            s = torch.einsum("hd,lhd->hl", p.q[b].double(), k) * scale
            out[b] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=1), v)
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("kind", ["token", "tensor"])
def test_fp8_write_and_decode(dtype, D, bs, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    p = Paged(gen, dtype, D, 8, 2, bs, ragged(gen, 6, bs, 500))
    c = Paged8(p, kind)
    # Every written row's e4m3 values are within half a step of x / scale.
    slots = p.slots.long()
    blk, off = slots // bs, slots % bs
    kd, _ = c.dequantized()
    got = kd[blk, off]
    x = p.k.double()
    step = torch.maximum(x.abs() / 16, (c.ks[blk, off, :, None] if kind == "token" else c.ks).double() / 1024)
    assert ((got - x).abs() <= step * 1.0001).all()
    if kind == "token":
        amax = p.k.float().abs().amax(dim=2)
        want = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        assert torch.allclose(c.ks[blk, off], want, rtol=2e-7, atol=0)  # torch may divide by a reciprocal
    ws = torch.empty(attn.workspace_size(6, 8, D), dtype=torch.uint8, device=DEV)
    out = torch.full_like(p.q, float("nan"))
    attn.paged_decode(p.q, c.k8, c.v8, p.table, p.seq_lens, out=out, workspace=ws, max_seq_len=max(p.lens),
                      k_scale=c.ks, v_scale=c.vs)
    torch.cuda.synchronize()
    scale = 1 / math.sqrt(D)
    check_rows(out, c.reference(scale), TOL[dtype])
    exact, _ = p.reference(scale)
    err = ((out.double() - exact).norm() / exact.norm()).item()
    assert err < 0.08, f"FP8's error against the 16-bit cache: {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("spread", ["random", "falling", "rising"])
def test_fp8_decode_v_scales_spread(dtype, D, spread, seed):
    """V rows whose magnitudes span 2^24 (per token and head at random, or
    falling or rising along the sequence): the decode counts its output in
    units of a V scale it moves only when a tile's largest leaves a band of
    16x, and the result still matches the float64 reference over the
    dequantised cache."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1500, 700, 64, 3000]
    p = Paged(gen, dtype, D, 8, 2, 16, lens)
    if spread == "random":
        e = torch.rand(p.v.shape[:2], generator=gen) * 24 - 12
    else:
        pos = torch.cat([torch.arange(L, dtype=torch.float32) / L for L in lens])
        e = (12 - 24 * pos if spread == "falling" else 24 * pos - 12)[:, None].expand(p.v.shape[:2])
    v = p.v.float() * torch.exp2(e).to(DEV)[..., None]
    p.v = v.to(dtype)
    c = Paged8(p, "token")
    ws = torch.empty(attn.workspace_size(len(lens), 8, D), dtype=torch.uint8, device=DEV)
    out = torch.full_like(p.q, float("nan"))
    attn.paged_decode(p.q, c.k8, c.v8, p.table, p.seq_lens, out=out, workspace=ws, max_seq_len=max(lens),
                      k_scale=c.ks, v_scale=c.vs)
    torch.cuda.synchronize()
    check_rows(out, c.reference(1 / math.sqrt(D)), TOL[dtype])


# ---- paged_decode over an e4m3 cache: positions and options ---------------

def covering(axes, seeds=()):
    """Cases (tuples of values, one per axis of axes, a dict of name ->
    values) in which every pair of values of two axes occurs at least once:
    the partial cases of seeds (dicts of axis index -> value index) first,
    then one per pair still missing, each completed axis by axis with the
    value that covers the most missing pairs, then the most triples not yet
    seen (so that the axes do not move together), then the least used.
    Deterministic."""
    vals = list(axes.values())
    n = len(vals)
    missing = {(i, a, j, b) for i in range(n) for j in range(i + 1, n)
               for a in range(len(vals[i])) for b in range(len(vals[j]))}
    seen = set()  # triples ((axis, value), ...) in axis order
    used = [[0] * len(v) for v in vals]
    rows = []

    def complete(row):
        for i in range(n):
            if i in row:
                continue

            def score(v):
                pairs = sum(((k, row[k], i, v) if k < i else (i, v, k, row[k])) in missing for k in row)
                triples = sum(tuple(sorted(((k, row[k]), (m, row[m]), (i, v)))) not in seen
                              for k in row for m in row if k < m)
                return pairs, triples, -used[i][v], -v

            row[i] = max(range(len(vals[i])), key=score)
        for i in range(n):
            used[i][row[i]] += 1
            for j in range(i + 1, n):
                missing.discard((i, row[i], j, row[j]))
                seen.update(((i, row[i]), (j, row[j]), (k, row[k])) for k in range(j + 1, n))
        rows.append(tuple(vals[i][row[i]] for i in range(n)))

    for s in seeds:
        complete(dict(s))
    while missing:
        i, a, j, b = min(missing)
        complete({i: a, j: b})
    return rows


SWEEP_AXES = {
    "dtype": [torch.float16, torch.bfloat16],
    "D": [64, 128, 256],
    "bs": [1, 16],
    "batch": [1, 16],
    "q_len": [1, 2, 5, 16],
    "window": [-1, 0, 3, 70, 200],  # window_left: -1 none; w >= 0 sees [pos - w, pos] (0: itself only)
    "sinks": [False, True],
    "splits": [1, 3],
    "group": [1, 3, 4, 8],
    "outliers": [False, True],
}
_names = list(SWEEP_AXES)
# Every (q_len, window, splits) triple, the rest pairwise.
SWEEP = covering(SWEEP_AXES, [{_names.index("q_len"): a, _names.index("window"): b, _names.index("splits"): c}
                              for a in range(4) for b in range(5) for c in range(2)])


def sweep_id(case):
    dtype, D, bs, batch, q_len, window, sinks, splits, group, outliers = case
    return (f"{'f16' if dtype == torch.float16 else 'bf16'}-D{D}-bs{bs}-B{batch}-q{q_len}-w{window}"
            f"{'-sinks' if sinks else ''}-s{splits}-g{group}{'-outliers' if outliers else ''}")


def sweep_lens(gen, batch, bs, q_len, window):
    """Sequence lengths (the new tokens included) for a decode of q_len new
    tokens: the shortest legal one (q_len: the first new token at position
    0), one more, lengths about the window (shorter than it, where the first
    new token's window starts at 0 or 1), an empty sequence, and random
    ones up to 1400; those drawn are not multiples of the block size. One
    of them, at random, for a batch of 1."""
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    def off_block(L):
        return L + draw(1, bs - 1) if bs > 1 and L % bs == 0 else L

    edge = [q_len, q_len + 1, off_block(draw(q_len + 2, 60))]
    if window >= 0:
        if window > q_len:
            edge.append(draw(q_len, window - 1))
        edge += [window + q_len, window + q_len + 1, off_block(window + q_len + draw(bs, 4 * bs))]
    long = [off_block(draw(300, 1400)) for _ in range(2)]
    if batch == 1:
        pool = edge + long + long
        return [pool[draw(0, len(pool) - 1)]]
    lens = [0] + edge + long
    lens += [off_block(draw(q_len, 1400)) for _ in range(batch - len(lens))]
    return [lens[i] for i in torch.randperm(batch, generator=gen).tolist()]


def dequantized_sequences(c):
    """Each sequence's K and V as c's e4m3 cache holds them (float64,
    e4m3 * scale; [L, kvh, D]), read through the table of c.p."""
    p = c.p
    kd, vd = c.dequantized()
    ks, vs = [], []
    for b, L in enumerate(p.lens):
        t = torch.arange(L, device=DEV)
        blk = p.table[b, t // p.bs].long()
        ks.append(kd[blk, t % p.bs])
        vs.append(vd[blk, t % p.bs])
    return ks, vs


@pytest.mark.parametrize("dtype,D,bs,batch,q_len,window,sinks,splits,group,outliers", SWEEP,
                         ids=[sweep_id(c) for c in SWEEP])
def test_fp8_decode_sweep(dtype, D, bs, batch, q_len, window, sinks, splits, group, outliers, seed):
    """paged_decode over an e4m3 cache (per-token-head scales written by
    kv_write) across head_dim, block size, batch, q_len new tokens per
    sequence (causal among them), sliding windows (the table's blocks
    before every new token's window dropped to -1), sinks, forced splits,
    GQA groups and K outlier channels, over mixed lengths (the shortest
    legal, about the window, empty, long): out and lse, poisoned with NaN,
    against the float64 reference over the dequantised cache, row by row."""
    gen = torch.Generator().manual_seed(seed ^ zlib.crc32(sweep_id(
        (dtype, D, bs, batch, q_len, window, sinks, splits, group, outliers)).encode()))
    lens = sweep_lens(gen, batch, bs, q_len, window)
    kvh = 2
    qh = group * kvh
    p = Paged(gen, dtype, D, qh, kvh, bs, lens)
    if outliers:  # a few K channels of each kv head 4 to 16 times the others, as in real models' keys
        for h in range(kvh):
            ch = torch.randperm(D, generator=gen)[:4].to(DEV)
            f = (torch.rand(4, generator=gen) * 12 + 4).to(DEV)
            p.k[:, h, ch] = (p.k[:, h, ch].float() * f).to(dtype)
    c = Paged8(p, "token")
    q = (torch.rand((batch * q_len, qh, D), generator=gen) * 4 - 2).to(dtype).to(DEV)
    sk = None
    if sinks:  # about the log of a row's denominator: they move the outputs
        seen = [min(L, window + 1) if window >= 0 else L for L in lens if L]
        keys = max(1.0, sum(seen) / max(1, len(seen)))
        sk = draw_sinks(gen, qh, keys)
    table = window_table(p, [q_len] * batch, window) if window >= 0 else p.table
    ws = torch.empty(attn.workspace_size(batch * q_len, qh, D, 8), dtype=torch.uint8, device=DEV)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch * q_len, qh), float("nan"), dtype=torch.float32, device=DEV)
    attn.paged_decode(q, c.k8, c.v8, table, p.seq_lens, out=out, lse=lse, workspace=ws, num_splits=splits,
                      max_seq_len=max(max(lens), 1), q_len=q_len, k_scale=c.ks, v_scale=c.vs, sinks=sk,
                      window_left=window)
    torch.cuda.synchronize()
    ks, vs = dequantized_sequences(c)
    qo = [b * q_len for b in range(batch + 1)]
    want, want_lse = window_reference(q, ks, vs, lens, qo, window, sinks=sk)
    what = f"lens {lens}"
    check_rows(out, want, TOL[dtype], what)
    got_lse = lse.double()
    assert not got_lse.isnan().any(), f"{what}: lse has NaN (unwritten elements)"
    empty = want_lse.isinf()
    assert torch.equal(got_lse.isinf(), empty), f"{what}: rows with no keys differ"
    if (~empty).any():
        d = (got_lse[~empty] - want_lse[~empty]).abs().max().item()
        bound = 2e-3 * max(1.0, want_lse[~empty].abs().max().item())
        assert d < bound, f"{what}: lse max abs error {d:.3g} above {bound:.3g}"


def test_fp8_graph_capture(seed):
    gen = torch.Generator().manual_seed(seed)
    p = Paged(gen, torch.bfloat16, 128, 32, 8, 16, [2000, 5, 700])
    c = Paged8(p, "token")
    ws = torch.empty(attn.workspace_size(3, 32, 128), dtype=torch.uint8, device=DEV)
    out = torch.empty_like(p.q)
    attn.prepare()
    g = capture(torch, lambda: attn.paged_decode(p.q, c.k8, c.v8, p.table, p.seq_lens, out=out, workspace=ws,
                                                 max_seq_len=2000, k_scale=c.ks, v_scale=c.vs))
    for _ in range(2):
        p.q.copy_((torch.rand(p.q.shape, generator=gen) * 4 - 2).to(p.q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_rows(out, c.reference(1 / math.sqrt(128)), TOL[torch.bfloat16])


def test_fp8_misuse(seed):
    gen = torch.Generator().manual_seed(seed)
    p = Paged(gen, torch.bfloat16, 64, 4, 2, 16, [40, 3])
    c = Paged8(p, "token")
    with pytest.raises(kvplug.InvalidArgumentError, match="k_scale and v_scale"):
        attn.kv_write(p.k, p.v, c.k8, c.v8, p.slots)  # no scales
    with pytest.raises(kvplug.InvalidArgumentError, match="belong to an e4m3 cache"):
        attn.paged_decode(p.q, p.k_cache, p.v_cache, p.table, p.seq_lens, k_scale=c.ks, v_scale=c.vs)
    with pytest.raises(kvplug.InvalidArgumentError, match="shape"):
        attn.paged_decode(p.q, c.k8, c.v8, p.table, p.seq_lens, k_scale=c.ks[:1], v_scale=c.vs[:1])
    with pytest.raises(kvplug.InvalidArgumentError, match="float16 or bfloat16"):
        attn.paged_decode(p.q.float(), c.k8, c.v8, p.table, p.seq_lens, k_scale=c.ks, v_scale=c.vs)
    ws = torch.empty(attn.prefill_workspace_size(2, 2, 4, 2, 64), dtype=torch.uint8, device=DEV)
    qo = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    plan = attn.prefill_plan(qo, p.seq_lens, 4, 2, 64, torch.bfloat16, ws, decode_route=False)
    with pytest.raises(kvplug.InvalidArgumentError, match="shape"):
        attn.paged_prefill(plan, p.q, c.k8, c.v8, p.table, k_scale=c.ks[:1], v_scale=c.vs[:1])


def _prefill_batch(dtype, D, kind, seed, window=-1, lens=None, heads=(8, 2)):
    """test_prefill_torch's varlen batch (chunks over cached prefixes, a
    decode row, a block-boundary tail; or lens, (kv_lens, q_lens)) written
    into e4m3 caches of its layout by kv_write."""
    from test_prefill_torch import Batch, ragged as prefill_ragged

    gen = torch.Generator().manual_seed(seed)
    kv, q = lens if lens is not None else prefill_ragged(gen, 5, 300, 150, 16)
    b = Batch(gen, dtype, D, heads[0], heads[1], 16, kv, q, window=window)
    shape = tuple(b.k_cache.shape)
    k8 = torch.full(shape, float("nan"), device=DEV).to(E4M3)
    v8 = torch.full(shape, float("nan"), device=DEV).to(E4M3)
    key, val = torch.cat(b.k), torch.cat(b.v)
    if kind == "token":
        ks = torch.full(shape[:3], float("nan"), device=DEV)
        vs = torch.full(shape[:3], float("nan"), device=DEV)
    else:
        ks, vs = (key.abs().max().float() / 448).reshape(1), (val.abs().max().float() / 448).reshape(1)
    attn.kv_write(key, val, k8, v8, batch_slots(b), k_scale=ks, v_scale=vs)
    exact = (list(b.k), list(b.v))
    read_dequantized(b, k8, v8, ks, vs)
    return b, k8, v8, ks, vs, exact


def batch_slots(b):
    """The cache slots of b's sequences' tokens, in their order."""
    return torch.cat([b.table[i, torch.arange(L, device=DEV) // 16].long() * 16 + torch.arange(L, device=DEV) % 16
                      for i, L in enumerate(b.kv_lens)]).to(torch.int32)


def read_dequantized(b, k8, v8, ks, vs):
    """Points b's reference at the dequantised cache (e4m3 * scale)."""
    token = ks.dim() == 3
    kd = k8.double() * (ks[..., None].double() if token else ks.double())
    vd = v8.double() * (vs[..., None].double() if token else vs.double())
    for i, L in enumerate(b.kv_lens):
        t = torch.arange(L, device=DEV)
        blk = b.table[i, t // 16].long()
        b.k[i], b.v[i] = kd[blk, t % 16], vd[blk, t % 16]


def lse_tol(plan):
    """The lse bound against the reference over the dequantised cache. The
    Hopper mainloop rounds each dequantised value (e4m3 * scale) to q's
    16-bit type before its products (bf16: 2^-9 relative), where the sm_80
    one multiplies the scales in fp32: its scores move by about 1e-3 of
    their size, far below FP8's own rounding (2^-4)."""
    return 1e-2 if plan.route == attn.ROUTE_PREFILL and plan.mainloop == attn.MAINLOOP_SM90 else 1e-3


def run_errors(b, plan, k8, v8, ks, vs):
    """plan's run over the e4m3 cache into NaN-poisoned out and lse; returns
    out and out's and lse's errors against b's reference over the
    dequantised cache."""
    out = torch.full_like(b.q, float("nan"))
    lse = torch.full((b.total_q, b.qh), float("nan"), dtype=torch.float32, device=DEV)
    attn.paged_prefill(plan, b.q, k8, v8, b.table, out=out, lse=lse, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    want, want_lse = b.reference()
    assert not torch.isnan(lse).any(), "lse has NaN (unwritten elements)"
    return out, row_err(out, want)[0], (lse.double() - want_lse).abs().max().item()


def run_checked(b, plan, k8, v8, ks, vs):
    """run_errors within the widened modes' bounds; returns out."""
    out, err, lerr = run_errors(b, plan, k8, v8, ks, vs)
    assert err < TOL[b.dtype], f"out rel err {err:.2e} (plan {plan})"
    assert lerr < lse_tol(plan), f"lse max abs err {lerr:.2e} (plan {plan})"
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("kind", ["token", "tensor"])
@pytest.mark.parametrize("hopper", [False, True], ids=["sm80", "device"])
def test_fp8_prefill(dtype, D, kind, hopper, seed):
    b, k8, v8, ks, vs, exact = _prefill_batch(dtype, D, kind, seed + D)
    for decode_route in (True, False):
        plan = b.plan(hopper=hopper, decode_route=decode_route)  # Batch.plan checks the mainloop
        out = run_checked(b, plan, k8, v8, ks, vs)
    b.k, b.v = exact
    exact_out, _ = b.reference()
    fp8_err = row_err(out, exact_out)[0]
    assert fp8_err < 0.1, f"FP8's error against the 16-bit cache: {fp8_err:.3g}"


@pytest.mark.parametrize("hopper", [False, True], ids=["sm80", "device"])
def test_fp8_prefill_window(hopper, seed):
    b, k8, v8, ks, vs, _ = _prefill_batch(torch.bfloat16, 128, "token", seed, window=40)
    plan = b.plan(hopper=hopper)
    out = torch.full_like(b.q, float("nan"))
    attn.paged_prefill(plan, b.q, k8, v8, b.table, out=out, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    want, _ = b.reference()
    assert row_err(out, want)[0] < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("splits", [False, True], ids=["one-split", "split-kv"])
def test_fp8_prefill_long(dtype, D, splits, seed):
    """Units of many K/V tiles on the device's mainloop (the wgmma one on a
    Hopper GPU, whose ring of raw tiles wraps many times a unit): chunks
    over long cached prefixes, a prompt from scratch, GQA 4, split-KV when
    the plan allows it; against the float64 reference over the dequantised
    cache, outputs and lse poisoned."""
    lens = ([3000, 1900, 700, 2500], [200, 1900, 64, 1])
    b, k8, v8, ks, vs, exact = _prefill_batch(dtype, D, "token", seed + 7 * D, lens=lens, heads=(16, 4))
    plan = b.plan(split_kv=splits, decode_route=False)
    out = run_checked(b, plan, k8, v8, ks, vs)
    b.k, b.v = exact
    exact_out, _ = b.reference()
    assert row_err(out, exact_out)[0] < 0.1


HOPPER = torch.cuda.get_device_capability() == (9, 0)
# FP8 Q/K/V's bound on a row's relative error against the float64 reference
# over the dequantised cache: q and P are rounded to e4m3 too (3 mantissa
# bits: 2^-4 relative at most). H200 runs gave 4.3e-2 to 6.0e-2, where
# FlashInfer's fa3 with FP8 Q/K/V gives 4.7e-2 to 5.4e-2 on the prefill
# table's inputs (bench/RESULTS.md).
QKV_TOL = 8e-2
# Its bound on lse: a score moves with q's rounding (a few percent of its
# size), and a row of few tokens (a window's, a sequence's first) sums few
# rounded weights; H200 runs gave up to 0.12.
QKV_LSE_TOL = 0.25


def qkv_plan(b, **kw):
    """b's plan in the FP8 Q/K/V mode; off Hopper the plan must refuse it."""
    if not HOPPER:
        with pytest.raises(kvplug.UnsupportedError, match="KVP_PREFILL_FP8_QKV"):
            b.plan(fp8_qkv=True, **kw)
        pytest.skip("FP8 Q/K/V runs on Hopper only (the refusal above is checked)")
    return b.plan(fp8_qkv=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["token", "tensor"])
@pytest.mark.parametrize("window", [-1, 40])
def test_fp8_qkv_prefill(dtype, kind, window, seed):
    """FP8 Q/K/V (KVP_PREFILL_FP8_QKV): the varlen batch against the float64
    reference over the dequantised cache, and beside the accurate mode."""
    b, k8, v8, ks, vs, _ = _prefill_batch(dtype, 128, kind, seed, window=window)
    plan = qkv_plan(b, decode_route=False)
    assert plan.route == attn.ROUTE_PREFILL and plan.mainloop == attn.MAINLOOP_SM90_FP8, plan
    _, err, lerr = run_errors(b, plan, k8, v8, ks, vs)
    _, acc_err, _ = run_errors(b, b.plan(decode_route=False), k8, v8, ks, vs)
    print(f"fp8 q/k/v rel err {err:.3e} (accurate mode {acc_err:.3e}), lse abs err {lerr:.3e}")
    assert err < QKV_TOL, f"FP8 Q/K/V out rel err {err:.3e} (accurate mode {acc_err:.3e})"
    assert lerr < QKV_LSE_TOL, f"FP8 Q/K/V lse max abs err {lerr:.3e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [False, True], ids=["one-split", "split-kv"])
def test_fp8_qkv_prefill_long(dtype, splits, seed):
    """Units of many K/V tiles (the raw V ring wraps many times) with GQA 4
    and split-KV where the plan allows it."""
    lens = ([3000, 1900, 700, 2500], [200, 1900, 64, 1])
    b, k8, v8, ks, vs, _ = _prefill_batch(dtype, 128, "token", seed + 11, lens=lens, heads=(16, 4))
    plan = qkv_plan(b, split_kv=splits, decode_route=False)
    _, err, lerr = run_errors(b, plan, k8, v8, ks, vs)
    assert err < QKV_TOL and lerr < QKV_LSE_TOL, (err, lerr, plan)


@pytest.mark.parametrize("L", [32768, 131072])
@pytest.mark.parametrize("kind", ["token", "tensor"])
def test_fp8_qkv_needle(L, kind, seed):
    """Long-context retrieval: one needle key among L tokens, early in the
    context so that hundreds of tiles follow it; the last 16 tokens' queries
    point at it (their scores with it about 22, every other key orthogonal
    to them). FP8 Q/K/V finds the needle's V (as the cache holds it) within
    2e-2 in every query row and head, and stays within 1e-2 of the float64
    reference's rows."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    qh, kvh, D, bs, n = 32, 8, 128, 16, 16
    blocks = (L + bs - 1) // bs
    u = torch.nn.functional.normalize(torch.randn(kvh, D, generator=gen, device=DEV, dtype=torch.float64), dim=1)
    k = torch.randn(L, kvh, D, generator=gen, device=DEV, dtype=torch.float64)
    k -= (k * u).sum(-1, keepdim=True) * u  # orthogonal to each head's query direction
    pos = int(torch.randint(L // 20, L // 8, (1,), generator=gen, device=DEV))
    k[pos] = 16 * u
    v = torch.randn(L, kvh, D, generator=gen, device=DEV, dtype=torch.float64)
    q = (16 * u).repeat_interleave(qh // kvh, dim=0)[None].expand(n, qh, D).to(torch.float16).contiguous()
    k8 = torch.empty((blocks, bs, kvh, D), device=DEV).to(E4M3)
    v8 = torch.empty_like(k8)
    if kind == "token":
        ks = torch.empty((blocks, bs, kvh), device=DEV)
        vs = torch.empty_like(ks)
    else:
        ks, vs = (k.abs().max().float() / 448).reshape(1), (v.abs().max().float() / 448).reshape(1)
    slots = torch.arange(L, device=DEV, dtype=torch.int32)
    attn.kv_write(k.half(), v.half(), k8, v8, slots, k_scale=ks, v_scale=vs)
    vd = (v8.double() * (vs[..., None].double() if kind == "token" else vs.double())).reshape(-1, kvh, D)[:L]
    kd = (k8.double() * (ks[..., None].double() if kind == "token" else ks.double())).reshape(-1, kvh, D)[:L]
    table = torch.arange(blocks, device=DEV, dtype=torch.int32)[None]
    qo = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    kvl = torch.tensor([L], dtype=torch.int32, device=DEV)
    ws = torch.empty(attn.prefill_workspace_size(1, n, qh, kvh, D), dtype=torch.uint8, device=DEV)
    if not HOPPER:
        with pytest.raises(kvplug.UnsupportedError, match="KVP_PREFILL_FP8_QKV"):
            attn.prefill_plan(qo, kvl, qh, kvh, D, torch.float16, ws, qo_indptr_host=[0, n], kv_lens_host=[L],
                              decode_route=False, fp8_qkv=True)
        pytest.skip("FP8 Q/K/V runs on Hopper only (the refusal above is checked)")
    plan = attn.prefill_plan(qo, kvl, qh, kvh, D, torch.float16, ws, qo_indptr_host=[0, n], kv_lens_host=[L],
                             decode_route=False, fp8_qkv=True)
    out = torch.full_like(q, float("nan"))
    attn.paged_prefill(plan, q, k8, v8, table, out=out, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    needle = vd[pos].repeat_interleave(qh // kvh, dim=0)  # [qh, D]
    err = (out.double() - needle[None]).abs().max().item()
    # The float64 reference over the dequantised cache (causal: query i at L - n + i).
    g = qh // kvh
    s = torch.einsum("nhd,lhd->hnl", q.double(), kd.repeat_interleave(g, dim=1)) / math.sqrt(D)
    s = s.masked_fill(torch.arange(L, device=DEV)[None, None] > (L - n + torch.arange(n, device=DEV))[None, :, None],
                      float("-inf"))
    ref = torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), vd.repeat_interleave(g, dim=1))
    rerr = (out.double() - ref).abs().max().item()
    print(f"needle at {pos} of {L} ({kind} scales): max abs err vs its V {err:.3e}, vs the reference {rerr:.3e}")
    assert err < 2e-2, f"the needle's V missed by {err:.3e}"
    assert rerr < 1e-2, f"the reference missed by {rerr:.3e}"


def test_fp8_qkv_graph(seed):
    """A CUDA graph of an FP8 Q/K/V run (one split, no decode route)
    replays new queries correctly, outputs poisoned before each replay."""
    b, k8, v8, ks, vs, _ = _prefill_batch(torch.bfloat16, 128, "token", seed)
    plan = qkv_plan(b, decode_route=False, split_kv=False)
    out = torch.empty_like(b.q)
    attn.prepare()
    g = capture(torch, lambda: attn.paged_prefill(plan, b.q, k8, v8, b.table, out=out, k_scale=ks, v_scale=vs))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(2):
        b.q.copy_((torch.rand(b.q.shape, generator=gen) * 4 - 2).to(b.q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        want, _ = b.reference()
        err = row_err(out, want)[0]
        assert err < QKV_TOL, f"replayed FP8 Q/K/V out rel err {err:.3e}"


@pytest.mark.parametrize("hopper", [False, True], ids=["sm80", "device"])
def test_fp8_write_and_prefill_graph(hopper, seed):
    """One CUDA graph of kv_write (quantising into the e4m3 cache and its
    per-token-head scales) and the prefill over that cache, on either
    mainloop: each replay takes new K, V and queries; the cache, the scales
    and the output are poisoned before it, and the output is checked
    against the float64 reference over what the replay wrote."""
    b, k8, v8, ks, vs, exact = _prefill_batch(torch.bfloat16, 128, "token", seed)
    key, val, slots = torch.cat(exact[0]).to(b.dtype), torch.cat(exact[1]).to(b.dtype), batch_slots(b)
    plan = b.plan(hopper=hopper, decode_route=False, split_kv=False)
    out = torch.empty_like(b.q)

    def step():
        attn.kv_write(key, val, k8, v8, slots, k_scale=ks, v_scale=vs)
        attn.paged_prefill(plan, b.q, k8, v8, b.table, out=out, k_scale=ks, v_scale=vs)

    attn.prepare()
    g = capture(torch, step)
    gen = torch.Generator().manual_seed(seed + 3)
    for _ in range(2):
        for x in (b.q, key, val):
            x.copy_((torch.rand(x.shape, generator=gen) * 4 - 2).to(x.dtype))
        for x in (k8, v8, ks, vs, out):
            x.copy_(torch.full(x.shape, float("nan"), device=DEV).to(x.dtype))
        g.replay()
        torch.cuda.synchronize()
        assert not ks[slots.long() // 16, slots.long() % 16].isnan().any(), "a replay left a written row's scale unset"
        read_dequantized(b, k8, v8, ks, vs)
        want, _ = b.reference()
        err = row_err(out, want)[0]
        assert err < TOL[b.dtype], f"replayed prefill ({plan.mainloop}) out rel err {err:.3e}"


def test_fp8_qkv_misuse(seed):
    """KVP_PREFILL_FP8_QKV with the sm_80 mainloop, head_dim 64, or a run
    over a 16-bit cache: errors, nothing written."""
    b, k8, v8, ks, vs, _ = _prefill_batch(torch.bfloat16, 128, "token", seed)
    with pytest.raises(kvplug.InvalidArgumentError, match="KVP_PREFILL_NO_HOPPER"):
        b.plan(fp8_qkv=True, hopper=False)
    b64, *_ = _prefill_batch(torch.bfloat16, 64, "token", seed)
    with pytest.raises(kvplug.UnsupportedError, match="head_dim 128"):
        attn.prefill_plan(b64.qo, b64.kvl, b64.qh, b64.kvh, 64, b64.dtype, b64.ws, qo_indptr_host=b64.qo.cpu(),
                          kv_lens_host=b64.kv_lens, fp8_qkv=True)
    plan = qkv_plan(b, decode_route=False)
    out = torch.full_like(b.q, float("nan"))
    with pytest.raises(kvplug.InvalidArgumentError, match="e4m3 cache"):
        attn.paged_prefill(plan, b.q, b.k_cache, b.v_cache, b.table, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "a refused run wrote its output"


@pytest.mark.parametrize("cascade", [False, True], ids=["paged", "cascade"])
def test_fp8_hf_engine_logits(cascade):
    """kvplug.hf over an FP8 cache on the kernels (kv_write, the sm_80
    prefill, decode; or every step on kvplug.cascade's kernels) against the
    same bf16 model over a bf16 cache: FP8's rounding only (the CPU run of
    tests/python/test_hf_correctness.py gives the torch path's figures)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
    import test_hf_correctness as hfc

    worst, mean, agree = hfc.fp8_against_16bit("cuda", backend="kernels", cascade=cascade)
    print(f"FP8 vs bf16 cache, teacher-forced logits: max rel {worst:.2e}, mean rel {mean:.2e}, argmax agreement {agree:.3f}")
    assert worst < 0.1 and mean < 0.05, (worst, mean)
    assert agree >= 0.9, agree


@pytest.mark.parametrize("cascade", [False, True], ids=["paged", "cascade"])
@pytest.mark.parametrize("mode", ["hopper", "fp8"])
def test_fp8_hf_engine_prefill_modes(mode, cascade):
    """kvplug.hf over an FP8 cache with prefill on Hopper's mainloop, widened
    or in the FP8 Q/K/V mode (head_dim 128), against the bf16 cache; with
    cascade, every step on kvplug.cascade's kernels, whose plans then cut the
    shared items for the Hopper mainloop (the cache's hopper_prefill)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
    import test_hf_correctness as hfc

    if not HOPPER:
        pytest.skip("Hopper's prefill mainloop runs on compute capability 9.0 only")
    worst, mean, agree = hfc.fp8_against_16bit("cuda", backend="kernels", fp8_prefill=mode, head_dim=128,
                                               cascade=cascade)
    print(f"FP8 ({mode} prefill{', cascade' if cascade else ''}) vs bf16 cache, teacher-forced logits: max rel {worst:.2e}, mean rel {mean:.2e}, "
          f"argmax agreement {agree:.3f}")
    assert worst < 0.15 and mean < 0.05, (worst, mean)
    assert agree >= 0.9, agree


def test_fp8_num_splits():
    """The split count for a decode over an FP8 cache is the e4m3 kernel's
    (4 blocks per SM at head_dim 128 where the 16-bit kernel holds 2: 256
    blocks fill 0.97 of the 16-bit kernel's wave unsplit and take two splits
    for the e4m3 one's), and paged_decode with num_splits 0 uses it."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s16 = attn.num_splits(torch.bfloat16, 128, 32, 32, 8, 2048)
    s8 = attn.num_splits(torch.float8_e4m3fn, 128, 32, 32, 8, 2048)
    assert s16 == 1, s16
    if sms == 132:  # H100 / H200: the heuristic's worked example
        assert s8 == 2, s8
    assert attn.num_splits(attn.DTYPE_E4M3, 128, 32, 32, 8, 2048) == s8


# ---- shared-prefix (cascade) attention over an e4m3 cache ----------------

def e4m3_blocks(gen, nb, bs, kvh, D, dtype):
    """Random K and V of nb blocks (CPU, [nb, bs, kvh, D], uniform in [-2, 2)
    in dtype), written by kv_write into an e4m3 cache with per-token-head
    scales that holds NaN before: (k, v, k8, v8, k_scale, v_scale, kd, vd),
    kd and vd the dequantised cache in float64 on the CPU (the references'
    K/V)."""
    k = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    v = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    k8 = torch.full((nb, bs, kvh, D), float("nan"), device=DEV).to(E4M3)
    v8 = torch.full_like(k8, float("nan"))
    ks = torch.full((nb, bs, kvh), float("nan"), device=DEV)
    vs = torch.full_like(ks, float("nan"))
    slots = torch.arange(nb * bs, dtype=torch.int32, device=DEV)
    attn.kv_write(k.reshape(-1, kvh, D).to(DEV), v.reshape(-1, kvh, D).to(DEV), k8, v8, slots, k_scale=ks, v_scale=vs)
    kd = (k8.double() * ks[..., None].double()).cpu()
    vd = (v8.double() * vs[..., None].double()).cpu()
    return k, v, k8, v8, ks, vs, kd, vd


@pytest.mark.parametrize("dtype,B,depth,max_run,tail,max_q,bs,qh,kvh,D", [
    (torch.bfloat16, 24, 2, 64, 300, 0, 16, 32, 8, 128),   # decode: one row per sequence
    (torch.float16, 8, 1, 256, 600, 600, 16, 8, 2, 128),   # prompts over a shared prompt
    (torch.bfloat16, 16, 2, 64, 400, 4, 16, 32, 8, 128),   # draft tokens: tails on the decode tile
    (torch.bfloat16, 10, 2, 200, 120, 120, 1, 8, 8, 64),   # token mode, no GQA
    (torch.float16, 8, 2, 5, 600, 500, 64, 8, 1, 256),     # large blocks, group 8, head_dim 256
    (torch.bfloat16, 8, 0, 1, 500, 300, 16, 32, 8, 128),   # nothing shared: the prefill route
])
@pytest.mark.parametrize("hopper", [False, True], ids=["sm80-plan", "device-plan"])
def test_fp8_cascade(dtype, B, depth, max_run, tail, max_q, bs, qh, kvh, D, hopper):
    """kvplug.cascade over an e4m3 cache (per-token-head scales written by
    kv_write) against the float64 reference over the dequantised cache, row
    by row, outputs poisoned with NaN: sharing trees in decode and varlen
    batches, decode tails, token mode, head_dim 256. A plan cut for the
    Hopper launch (hopper=True on an H100/H200) runs its shared items and
    its prefill route on the wgmma mainloop that widens e4m3 tiles."""
    from test_cascade_torch import prefill_reference, random_queries, random_tree
    from kvplug import cascade

    gen = torch.Generator().manual_seed(zlib.crc32(f"fp8 cascade {dtype} {B} {depth} {bs} {D} {max_q}".encode()))
    table, lens, nb = random_tree(gen, B, depth, max_run, tail, bs)
    decode = max_q == 0
    qo = list(range(B + 1)) if decode else random_queries(gen, lens, max_q)
    T = qo[-1]
    k, v, k8, v8, ks, vs, kd, vd = e4m3_blocks(gen, nb, bs, kvh, D, dtype)
    q = (torch.rand((max(T, 1), qh, D), generator=gen) * 4 - 2).to(dtype)[:T]
    want, want_lse = prefill_reference(q, kd, vd, table, lens, qo, bs)
    exact, _ = prefill_reference(q, k, v, table, lens, qo, bs)

    lens_h, qo_h = torch.tensor(lens, dtype=torch.int32), torch.tensor(qo, dtype=torch.int32)
    lens_d, qo_d = lens_h.to(DEV), qo_h.to(DEV)
    ws = cascade.Workspaces(B, qh, kvh, D, device=DEV, max_tokens=None if decode else max(B, 4 * T + 8 * B))
    varlen = {} if decode else dict(qo_indptr_host=qo_h, qo_indptr=qo_d)
    # Nothing shared: routed (the prefill route); else the cascade kernels.
    plan = cascade.plan(table, lens_h, lens_d, qh, kvh, D, dtype, ws, block_size=bs, decode_route=depth == 0,
                        hopper=hopper, **varlen)
    what = f"{plan}, lens {lens}, qo {qo}"
    assert plan.route == (cascade.ROUTE_PREFILL if depth == 0 else cascade.ROUTE_CASCADE), what
    qd, td = q.to(DEV), table.to(DEV)
    out = torch.full((T, qh, D), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((T, qh), float("nan"), dtype=torch.float32, device=DEV)
    cascade.paged_cascade(plan, qd, k8, v8, td, out=out, lse=lse, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    got, gl = out.cpu().double(), lse.cpu().double()
    bad = torch.isnan(got).any(-1).any(-1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:10]} have NaN (unwritten elements) ({what})"
    if T:
        err = (got - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2)).clamp_min(1e-30)
        assert err.max().item() < TOL[dtype], f"row {int(err.argmax())}: relative error {err.max().item():.3g} ({what})"
        live = ~torch.isinf(want_lse)
        assert torch.equal(torch.isinf(gl), ~live), f"empty rows differ ({what})"
        assert (gl[live] - want_lse[live]).abs().max().item() < 2e-3 * max(1.0, want_lse[live].abs().max().item()), what
        fp8 = ((got - exact).norm() / exact.norm()).item()
        assert fp8 < 0.08, f"FP8's error against the 16-bit cache: {fp8:.3g} ({what})"


@pytest.mark.parametrize("hopper", [False, True], ids=["sm80-plan", "device-plan"])
def test_fp8_cascade_graph(hopper):
    """A CUDA graph of kvplug.cascade over an e4m3 cache (a decode batch
    over a two-level sharing tree): replays with new queries, outputs
    poisoned before each, against the float64 reference over the
    dequantised cache."""
    from test_cascade_torch import prefill_reference, random_tree
    from kvplug import cascade

    dtype, B, qh, kvh, D, bs = torch.bfloat16, 24, 32, 8, 128, 16
    gen = torch.Generator().manual_seed(zlib.crc32(f"fp8 cascade graph {hopper}".encode()))
    table, lens, nb = random_tree(gen, B, 2, 64, 300, bs)
    _, _, k8, v8, ks, vs, kd, vd = e4m3_blocks(gen, nb, bs, kvh, D, dtype)
    lens_h = torch.tensor(lens, dtype=torch.int32)
    ws = cascade.Workspaces(B, qh, kvh, D, device=DEV)
    # decode_route=False: the cascade kernels even where the cost model would route this batch to plain decode.
    plan = cascade.plan(table, lens_h, lens_h.to(DEV), qh, kvh, D, dtype, ws, block_size=bs, hopper=hopper,
                        decode_route=False)
    assert plan.route == cascade.ROUTE_CASCADE, plan
    q = torch.empty((B, qh, D), dtype=dtype, device=DEV)
    out = torch.empty_like(q)
    td = table.to(DEV)
    attn.prepare()
    g = capture(torch, lambda: cascade.paged_cascade(plan, q, k8, v8, td, out=out, k_scale=ks, v_scale=vs))
    for _ in range(2):
        qh_ = (torch.rand((B, qh, D), generator=gen) * 4 - 2).to(dtype)
        q.copy_(qh_)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        want, _ = prefill_reference(qh_, kd, vd, table, lens, list(range(B + 1)), bs)
        got = out.cpu().double()
        assert not got.isnan().any(), f"unwritten rows ({plan})"
        err = (got - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2)).clamp_min(1e-30)
        assert err.max().item() < TOL[dtype], f"row {int(err.argmax())}: relative error {err.max().item():.3g} ({plan})"
