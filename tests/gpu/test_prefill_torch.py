"""GPU tests of paged prefill / extend attention (attn.prefill_plan +
attn.paged_prefill) on torch CUDA tensors, through libkvplug's C ABI.

Each test draws fresh random inputs, poisons out and lse with NaN, and
compares with a float64 reference computed from each sequence's logical K
and V (causal, optional window). Run on a GPU machine with the library built:

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_prefill_torch.py

Skips only on a machine with no NVIDIA device, and fails under
KVPLUG_REQUIRE_GPU=1 (tests/gpu/gputest.py).
"""

import math

import pytest

from gputest import capture, cuda_torch, row_err, skip, window_reference  # noqa: E402  (tests/gpu: skips only where there is no NVIDIA device)

torch = cuda_torch()

import kvplug  # noqa: E402
from kvplug import attn  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
HOPPER_DEVICE = torch.cuda.get_device_capability() == (9, 0)

# Every test runs on both prefill kernels: the Hopper (sm_90a) one, which the
# plan picks on compute capability 9.0, and the sm_80 one (hopper=False; the
# only one elsewhere).
MAINLOOP = {"hopper": True}


@pytest.fixture(autouse=True, params=[True, False], ids=["hopper", "sm80"])
def mainloop(request):
    if request.param and not HOPPER_DEVICE:
        skip("the Hopper kernel needs compute capability 9.0")
    MAINLOOP["hopper"] = request.param
    yield request.param
    MAINLOOP["hopper"] = True


def rel_err(got, want):
    """The worst row's relative error (gputest.row_err)."""
    return row_err(got, want)[0]


class Batch:
    """A random varlen batch: kv_lens[b] tokens of logical K/V per sequence in
    a paged cache (blocks in shuffled order, NaN in every unused slot, table
    columns past a sequence's blocks holding garbage ids), and q_lens[b] new
    query rows per sequence."""

    def __init__(self, gen, dtype, D, qh, kvh, bs, kv_lens, q_lens, window=-1):
        assert all(q <= k for q, k in zip(q_lens, kv_lens))
        self.dtype, self.D, self.qh, self.kvh, self.bs, self.window = dtype, D, qh, kvh, bs, window
        self.kv_lens, self.q_lens = list(kv_lens), list(q_lens)
        nblk = [math.ceil(L / bs) for L in kv_lens]
        self.num_blocks = sum(nblk) + 3
        max_blocks = max(max(nblk), 1)
        perm = torch.randperm(self.num_blocks, generator=gen)
        table = torch.randint(-self.num_blocks, 2 * self.num_blocks, (len(kv_lens), max_blocks + 2), generator=gen,
                              dtype=torch.int32)
        shape = (self.num_blocks, bs, kvh, D)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.k, self.v = [], []
        nxt = 0
        for b, L in enumerate(kv_lens):
            k = (torch.rand((L, kvh, D), generator=gen) * 4 - 2).to(dtype)
            v = (torch.rand((L, kvh, D), generator=gen) * 4 - 2).to(dtype)
            for c in range(nblk[b]):
                table[b, c] = perm[nxt]
                n = min(bs, L - c * bs)
                self.k_cache[perm[nxt], :n] = k[c * bs:c * bs + n]
                self.v_cache[perm[nxt], :n] = v[c * bs:c * bs + n]
                nxt += 1
            self.k.append(k.to(DEV))
            self.v.append(v.to(DEV))
        self.table = table[:, :max_blocks].to(DEV)
        self.k_cache, self.v_cache = self.k_cache.to(DEV), self.v_cache.to(DEV)
        qo = [0]
        for n in q_lens:
            qo.append(qo[-1] + n)
        self.qo = torch.tensor(qo, dtype=torch.int32, device=DEV)
        self.kvl = torch.tensor(kv_lens, dtype=torch.int32, device=DEV)
        self.total_q = qo[-1]
        self.q = (torch.rand((self.total_q, qh, D), generator=gen) * 4 - 2).to(dtype).to(DEV)
        self.ws = torch.empty(attn.prefill_workspace_size(len(kv_lens), max(self.total_q, 1), qh, kvh, D),
                              dtype=torch.uint8, device=DEV)

    def plan(self, **kw):
        kw.setdefault("hopper", MAINLOOP["hopper"])
        p = attn.prefill_plan(self.qo, self.kvl, self.qh, self.kvh, self.D, self.dtype, self.ws,
                              window_left=self.window, qo_indptr_host=self.qo.cpu(), kv_lens_host=self.kv_lens, **kw)
        if p.route == attn.ROUTE_PREFILL:
            want = attn.MAINLOOP_SM90 if kw["hopper"] and HOPPER_DEVICE and self.dtype != torch.float32 else attn.MAINLOOP_SM80
            if kw.get("fp8_qkv"):
                want = attn.MAINLOOP_SM90_FP8
            assert p.mainloop == want, p
        return p

    def run(self, plan, scale=None):
        out = torch.full_like(self.q, float("nan"))
        lse = torch.full((self.total_q, self.qh), float("nan"), dtype=torch.float32, device=DEV)
        attn.paged_prefill(plan, self.q, self.k_cache, self.v_cache, self.table, out=out, lse=lse, scale=scale)
        torch.cuda.synchronize()
        return out, lse

    def reference(self, scale=None):
        scale = 1.0 / math.sqrt(self.D) if scale is None else scale
        group = self.qh // self.kvh
        outs, lses = [], []
        for b, (L, n) in enumerate(zip(self.kv_lens, self.q_lens)):
            if n == 0:
                continue
            q = self.q[int(self.qo[b]):int(self.qo[b]) + n].double()  # [n, qh, D]
            k = self.k[b].double().repeat_interleave(group, dim=1)    # [L, qh, D]
            v = self.v[b].double().repeat_interleave(group, dim=1)
            s = torch.einsum("ihd,thd->hit", q, k) * scale
            pos = torch.arange(L - n, L, device=DEV)[:, None]
            t = torch.arange(L, device=DEV)[None, :]
            mask = t <= pos
            if self.window >= 0:
                mask &= t >= pos - self.window
            s = s.masked_fill(~mask[None], float("-inf"))
            lses.append(torch.logsumexp(s, dim=-1).transpose(0, 1))   # [n, qh]
            outs.append(torch.einsum("hit,thd->ihd", torch.softmax(s, dim=-1), v))
        if not outs:
            return torch.empty(0, self.qh, self.D, dtype=torch.float64, device=DEV), torch.empty(0, self.qh, device=DEV)
        return torch.cat(outs), torch.cat(lses)

    def check(self, plan, scale=None):
        out, lse = self.run(plan, scale)
        want, want_lse = self.reference(scale)
        err = rel_err(out, want)
        assert err < TOL[self.dtype], f"out rel err {err:.2e} (plan {plan})"
        assert not torch.isnan(lse).any(), "lse has NaN (unwritten elements)"
        lerr = (lse.double() - want_lse).abs().max().item()
        assert lerr < 1e-3, f"lse max abs err {lerr:.2e}"
        return out, lse


def ragged(gen, n, max_prefix, max_new, bs):
    """kv_lens and q_lens: prompts with no prefix, tails after a prefix, one
    decode row, a sequence ending on a block boundary."""
    kv, q = [], []
    for i in range(n):
        new = 1 if i == 1 else int(torch.randint(1, max_new + 1, (1,), generator=gen))
        prefix = 0 if i % 3 == 0 else int(torch.randint(0, max_prefix + 1, (1,), generator=gen))
        if i == 2:
            prefix = bs * 3 - new if bs * 3 > new else prefix
        kv.append(prefix + new)
        q.append(new)
    return kv, q


CASES = [(dt, D, bs, g) for dt in (torch.float16, torch.bfloat16) for D in (64, 128, 256)
         for bs, g in ((1, 4), (16, 1), (64, 8), (256, 4))]
CASES += [(torch.float32, D, 16, 4) for D in (64, 128, 256)]


@pytest.mark.parametrize("dtype,D,bs,group", CASES)
def test_prefill(dtype, D, bs, group):
    gen = torch.Generator().manual_seed(D * 1000 + bs * 10 + group + {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}[dtype])
    kv, q = ragged(gen, 5, 300, 150, bs)
    b = Batch(gen, dtype, D, 2 * group, 2, bs, kv, q)
    plan = b.plan()
    assert plan.route == attn.ROUTE_PREFILL
    b.check(plan)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_batch(dtype):
    # 3 prefill chunks over cached prefixes + 12 decodes: the decode rows go
    # to a decode launch; with decode_route=False the prefill kernel takes
    # them all, and both agree with the reference.
    gen = torch.Generator().manual_seed(7)
    kv = [700, 130, 64] + [int(x) for x in torch.randint(1, 900, (12,), generator=gen)]
    q = [200, 130, 17] + [1] * 12
    b = Batch(gen, dtype, 128, 32, 8, 16, kv, q)
    plan = b.plan()
    assert plan.route == attn.ROUTE_PREFILL and plan.decode_rows == 12, plan
    out, _ = b.check(plan)
    whole = b.plan(decode_route=False)
    assert whole.decode_rows == 0, whole
    out1, _ = b.check(whole)
    assert rel_err(out, out1.double()) < TOL[dtype]


@pytest.mark.parametrize("D,group,bs", [(64, 1, 1), (128, 4, 16), (256, 8, 64), (128, 32, 16)])
def test_mixed_batch_decode_rows(D, group, bs):
    # Decode rows interleaved with chunks, sequences with no new token, and a
    # decode row at the end of a block; few decode rows over long contexts
    # split their launch.
    gen = torch.Generator().manual_seed(70 + D + group + bs)
    kv = [2900, 40, 3000, 16 * bs, 700, 5, 2500]
    q = [1, 40, 1, 1, 0, 5, 1]
    b = Batch(gen, torch.bfloat16, D, 2 * group if group < 32 else 32, 2 if group < 32 else 1, bs, kv, q)
    plan = b.plan()
    assert plan.decode_rows == 4, plan
    if group < 32:
        assert plan.decode_splits > 1, plan
    b.check(plan)
    b.check(b.plan(split_kv=False))


def test_mixed_batch_only_decode_rows_and_empty():
    # One-token rows beside sequences with no new token: not a uniform batch,
    # so the prefill route, with no prefill items at all.
    gen = torch.Generator().manual_seed(71)
    b = Batch(gen, torch.float16, 128, 8, 2, 16, [300, 50, 900, 20], [1, 0, 1, 0])
    plan = b.plan()
    assert plan.route == attn.ROUTE_PREFILL and plan.decode_rows == 2, plan
    b.check(plan)


def test_mixed_batch_window_decode_rows():
    # The one-token row of a windowed mixed batch runs on the decode kernel,
    # window and all, as without a window.
    gen = torch.Generator().manual_seed(72)
    b = Batch(gen, torch.float16, 128, 8, 2, 16, [500, 90], [300, 1], window=40)
    plan = b.plan()
    assert plan.route == attn.ROUTE_PREFILL and plan.decode_rows == 1, plan
    b.check(plan)


def test_long_chunk_over_prefix():
    gen = torch.Generator().manual_seed(8)
    b = Batch(gen, torch.bfloat16, 128, 32, 8, 16, [4096, 1000], [2048, 1000])
    b.check(b.plan())


@pytest.mark.parametrize("window", [0, 37, 200])
def test_sliding_window(window):
    gen = torch.Generator().manual_seed(9 + window)
    b = Batch(gen, torch.float16, 128, 8, 2, 16, [500, 90, 300], [300, 1, 7], window=window)
    b.check(b.plan())


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 64), (torch.float16, 256),
                                     (torch.float32, 128)])
def test_split_kv(dtype, D):
    # A short chunk over a long prefix fills few blocks: the plan splits the
    # K/V range and merges the partial states; the unsplit plan agrees.
    gen = torch.Generator().manual_seed(14 + D)
    b = Batch(gen, dtype, D, 8, 2, 16, [3000, 1700], [70, 1])
    plan = b.plan()
    assert plan.num_splits > 1, plan
    out, lse = b.check(plan)
    out1, lse1 = b.run(b.plan(split_kv=False))
    assert rel_err(out, out1.double()) < TOL[dtype]


def test_decode_route_and_forced_prefill():
    gen = torch.Generator().manual_seed(10)
    kv = [int(x) for x in torch.randint(1, 3000, (9,), generator=gen)]
    b = Batch(gen, torch.bfloat16, 128, 32, 8, 16, kv, [1] * 9)
    plan = b.plan()
    assert plan.route == attn.ROUTE_DECODE
    b.check(plan)
    plan = b.plan(decode_route=False)
    assert plan.route == attn.ROUTE_PREFILL
    b.check(plan)


@pytest.mark.parametrize("q_len,qh,kvh,route", [
    (4, 32, 8, attn.ROUTE_DECODE),   # 4 tokens x group 4: one decode block per kv head
    (2, 64, 8, attn.ROUTE_DECODE),   # x group 8
    (16, 8, 8, attn.ROUTE_DECODE),   # 16 tokens x group 1
    (4, 16, 2, attn.ROUTE_PREFILL),  # 4 x group 8 = 32 rows: the prefill kernel's tiles
])
def test_uniform_short_queries_route(q_len, qh, kvh, route):
    """Speculative verification: every sequence brings the same few new
    tokens; the decode kernel takes them when a kv head's rows fit its tile."""
    gen = torch.Generator().manual_seed(11 + q_len + qh)
    kv = [q_len, q_len + 3] + [int(x) for x in torch.randint(q_len, 3000, (7,), generator=gen)]
    b = Batch(gen, torch.bfloat16, 128, qh, kvh, 16, kv, [q_len] * len(kv))
    plan = b.plan()
    assert plan.route == route, plan
    out, lse = b.check(plan)
    out1, _ = b.run(b.plan(decode_route=False))
    assert rel_err(out, out1.double()) < TOL[torch.bfloat16]


# The benchmark's shapes (bench/prefill_bench.py): B, new tokens, cached prefix;
# 32 q / 8 kv heads, d 128, block size 16.
BENCH_SHAPES = [(1, 2048, 0), (8, 2048, 0), (1, 8192, 0), (8, 512, 2048), (8, 2048, 8192), (32, 128, 8192),
                (32, 512, 2048), (1, 2048, 8192)]


@pytest.mark.parametrize("B,new,prefix", BENCH_SHAPES)
def test_benchmark_shapes(B, new, prefix):
    gen = torch.Generator().manual_seed(B * 7 + new + prefix)
    dtype = torch.float16 if (B + new) % 2 else torch.bfloat16
    b = Batch(gen, dtype, 128, 32, 8, 16, [prefix + new] * B, [new] * B)
    b.check(b.plan())


def test_scale_and_empty_batch():
    gen = torch.Generator().manual_seed(11)
    b = Batch(gen, torch.float16, 64, 4, 4, 16, [40, 8], [40, 0])
    b.check(b.plan(), scale=0.3)
    e = Batch(gen, torch.float16, 64, 4, 4, 16, [5], [0])
    out, _ = e.run(e.plan())
    assert out.numel() == 0


def test_graph_capture_replays_later_plans():
    # One captured run; each replay follows a new plan of a different batch
    # composition (same shapes of q and table) into the same workspace.
    gen = torch.Generator().manual_seed(12)
    a = Batch(gen, torch.bfloat16, 128, 16, 4, 16, [300, 200, 100, 64], [100, 1, 50, 64])
    attn.prepare()
    s = torch.cuda.Stream()
    out = torch.full_like(a.q, float("nan"))
    with torch.cuda.stream(s):
        plan = a.plan(decode_route=False, split_kv=False)
        attn.paged_prefill(plan, a.q, a.k_cache, a.v_cache, a.table, out=out)
        s.synchronize()
        g = capture(torch, lambda: attn.paged_prefill(plan, a.q, a.k_cache, a.v_cache, a.table, out=out), s)
    qbuf = a.q  # the captured launch reads this buffer
    for trial in range(3):
        # New composition over the same cache and q buffer.
        q_lens = [int(x) for x in torch.randint(1, 50, (4,), generator=gen)]
        q_lens[trial] = 1
        a.q_lens = q_lens
        a.total_q = sum(q_lens)
        qo = [0]
        for n in q_lens:
            qo.append(qo[-1] + n)
        a.qo = torch.tensor(qo, dtype=torch.int32, device=DEV)
        qbuf.copy_((torch.rand(qbuf.shape, generator=gen) * 4 - 2).to(qbuf.dtype))
        a.q = qbuf[:a.total_q]
        with torch.cuda.stream(s):
            a.plan(stream=s, decode_route=False, split_kv=False)
            out.fill_(float("nan"))
            g.replay()
        s.synchronize()
        want, _ = a.reference()
        # The graph wrote rows [0, total_q) of the captured out buffer from
        # the captured q buffer, whose first rows are a.q.
        err = rel_err(out[:a.total_q], want)
        assert err < TOL[torch.bfloat16], f"replay {trial}: rel err {err:.2e}"


def test_one_plan_serves_many_launches():
    # The layers of a step share one plan: each launch must see the whole
    # work list, though the Hopper kernel's blocks take units from a counter
    # in the workspace (the last block of a launch zeroes it for the next),
    # and a captured launch replays without a new plan.
    gen = torch.Generator().manual_seed(13)
    b = Batch(gen, torch.bfloat16, 128, 32, 8, 16, [900, 300, 77, 520], [600, 300, 1, 20])
    plan = b.plan()
    for layer in range(3):
        b.q.copy_((torch.rand(b.q.shape, generator=gen) * 4 - 2).to(b.q.dtype))
        b.check(plan)
    s = torch.cuda.Stream()
    out = torch.full_like(b.q, float("nan"))
    g = capture(torch, lambda: attn.paged_prefill(plan, b.q, b.k_cache, b.v_cache, b.table, out=out), s)
    want, _ = b.reference()
    for replay in range(2):
        with torch.cuda.stream(s):
            out.fill_(float("nan"))
            g.replay()
        s.synchronize()
        err = rel_err(out, want)
        assert err < TOL[torch.bfloat16], f"replay {replay}: rel err {err:.2e}"


def test_argument_errors():
    gen = torch.Generator().manual_seed(13)
    b = Batch(gen, torch.float16, 64, 4, 2, 16, [40, 4], [3, 1])
    with pytest.raises(kvplug.InvalidArgumentError, match="kv_len"):
        attn.prefill_plan(b.qo, b.kvl, 4, 2, 64, torch.float16, b.ws, qo_indptr_host=[0, 41, 42], kv_lens_host=[40, 4])
    with pytest.raises(kvplug.InvalidArgumentError, match="decrease"):
        attn.prefill_plan(b.qo, b.kvl, 4, 2, 64, torch.float16, b.ws, qo_indptr_host=[0, 3, 2], kv_lens_host=[40, 4])
    small = torch.empty(40, dtype=torch.uint8, device=DEV)
    with pytest.raises(kvplug.BufferTooSmallError, match="workspace"):
        attn.prefill_plan(b.qo, b.kvl, 4, 2, 64, torch.float16, small, qo_indptr_host=[0, 3, 4], kv_lens_host=[40, 4])
    plan = b.plan()
    with pytest.raises(kvplug.InvalidArgumentError, match="block table"):
        attn.paged_prefill(plan, b.q, b.k_cache, b.v_cache, b.table[:, :1].contiguous())
    out = torch.full_like(b.q, float("nan"))
    with pytest.raises(kvplug.InvalidArgumentError, match="scale"):
        attn.paged_prefill(plan, b.q, b.k_cache, b.v_cache, b.table, out=out, scale=-0.125)
    assert torch.isnan(out).all()  # nothing was launched


# ---- sliding windows: decode rows, head sizes, block sizes, split-KV, graphs ----
#
# A window is a field of kvp_prefill_plan_args (window_size = window_left +
# 1) and of kvp_paged_decode_args (window_size): a windowed batch of uniform
# short queries takes the decode route, a mixed one the prefill kernel with
# its one-token rows on the decode kernel, as without a window; the
# shared-prefix planner takes none (kvp_cascade_plan_args;
# test_cascade_torch.py).


def dt_id(v):
    """Short test ids of dtypes (f16, bf16); None: pytest's own id."""
    names = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
    return names.get(v) if isinstance(v, torch.dtype) else None


def row_where(row, qo, kv_lens):
    """Where row `row` of a varlen batch is: its sequence and position."""
    qo = [int(x) for x in qo]
    for b, L in enumerate(kv_lens):
        if qo[b] <= row < qo[b + 1]:
            n = qo[b + 1] - qo[b]
            return f"row {row} (sequence {b}: kv_len {L}, q_len {n}; position {L - n + row - qo[b]})"
    return f"row {row}"


def check_window(out, lse, want, want_lse, qo, kv_lens, tol, what):
    """out and lse against the reference row by row; a failure names the
    case, the worst row, its sequence and position."""
    err, row = row_err(out, want)
    assert err < tol, f"{what}: {row_where(row, qo, kv_lens)}: relative error {err:.3g} above {tol:.1g}"
    got, w = lse.detach().cpu().double(), want_lse.detach().cpu().double()
    nan = got.isnan().any(dim=1).nonzero().flatten().tolist()
    assert not nan, f"{what}: lse rows {nan[:16]} hold NaN (unwritten elements)"
    if got.shape[0]:
        d = (got - w).abs().amax(dim=1)
        r = int(d.argmax())
        assert d[r] < 1e-3, f"{what}: lse of {row_where(r, qo, kv_lens)}: max abs error {float(d[r]):.3g} above 1e-3"


def case(dtype, D, bs, qh, kvh, window, plan):
    dt = str(dtype).replace("torch.", "")
    return f"window_left {window}, {dt}, D {D}, block size {bs}, heads {qh}/{kvh} ({plan})"


@pytest.mark.parametrize("dtype,D,bs,group,q_len,window", [
    (torch.float16, 128, 16, 4, 1, 37),
    (torch.bfloat16, 64, 1, 8, 1, 0),        # each row sees its own token only
    (torch.bfloat16, 256, 16, 1, 1, 200),
    (torch.float16, 64, 1, 4, 4, 15),        # 4 draft tokens x group 4: the decode kernel's without a window
    (torch.bfloat16, 128, 16, 2, 8, 63),
    (torch.float16, 256, 16, 2, 1, 4096),    # a window over every token: the decode kernel's result
], ids=dt_id)
def test_window_decode_rows(dtype, D, bs, group, q_len, window):
    """Decode with a sliding window: every sequence brings q_len new tokens
    (one: decode; more: speculative verification). The plan runs such a
    batch on the decode kernel (ROUTE_DECODE), window and all; planned
    without the decode route it runs on the prefill kernel; both against the
    reference. Sequences shorter than the window, exactly one longer, ending
    on and one past a block boundary, and long ones (the plan may split
    their K/V)."""
    gen = torch.Generator().manual_seed(300 + D + bs + 10 * group + 100 * q_len + window)
    kv = [q_len, max(q_len, window), max(q_len, window + 1), window + q_len, 16 * bs, 16 * bs + 1, 700, 1503]
    qh = 2 * group
    b = Batch(gen, dtype, D, qh, 2, bs, kv, [q_len] * len(kv), window=window)
    plan = b.plan()
    what = f"{q_len} new tokens per sequence, " + case(dtype, D, bs, qh, 2, window, plan)
    assert plan.route == attn.ROUTE_DECODE, f"{what}: a windowed batch of short queries left the decode route"
    out, lse = b.run(plan)
    qo = b.qo.tolist()
    want, want_lse = window_reference(b.q, b.k, b.v, kv, qo, window)
    check_window(out, lse, want, want_lse, qo, kv, TOL[dtype], what)
    tiles = attn.prefill_plan(b.qo, b.kvl, qh, 2, D, dtype, b.ws, window_left=window, qo_indptr_host=b.qo.cpu(),
                              kv_lens_host=kv, decode_route=False, hopper=MAINLOOP["hopper"])
    assert tiles.route == attn.ROUTE_PREFILL and tiles.decode_rows == 0, tiles
    out2, lse2 = b.run(tiles)
    check_window(out2, lse2, want, want_lse, qo, kv, TOL[dtype], f"{what}: on the prefill kernel ({tiles})")
    nowin = attn.prefill_plan(b.qo, b.kvl, qh, 2, D, dtype, b.ws, qo_indptr_host=b.qo.cpu(), kv_lens_host=kv,
                              hopper=MAINLOOP["hopper"])
    assert nowin.route == attn.ROUTE_DECODE, f"{what}: without the window the batch plans {nowin}"
    if window >= max(kv) - 1:  # the window holds every token: the decode kernel's output
        out1, _ = b.run(nowin)
        err, row = row_err(out, out1.double())
        assert err < TOL[dtype], f"{what}: against the decode kernel ({nowin}): {row_where(row, qo, kv)}: " \
                                 f"relative difference {err:.3g}"


@pytest.mark.parametrize("dtype,D,bs,group,window", [
    (torch.bfloat16, 64, 1, 4, 37),
    (torch.bfloat16, 128, 16, 8, 0),
    (torch.bfloat16, 256, 16, 1, 100),
    (torch.float16, 64, 16, 8, 200),
    (torch.float16, 256, 1, 4, 15),
    (torch.float16, 128, 1, 1, 127),
], ids=dt_id)
def test_window_shapes(dtype, D, bs, group, window):
    """Windowed prefill over bf16 and f16, head sizes 64/128/256, block
    sizes 1 and 16: prompts, tails after a prefix, a decode row, and a whole
    prompt longer than twice the window."""
    gen = torch.Generator().manual_seed(500 + D + bs + 10 * group + window)
    kv, q = ragged(gen, 5, 300, 150, bs)
    kv.append(2 * window + 70)
    q.append(2 * window + 70)
    b = Batch(gen, dtype, D, 2 * group, 2, bs, kv, q, window=window)
    plan = b.plan()
    what = case(dtype, D, bs, 2 * group, 2, window, plan)
    assert plan.route == attn.ROUTE_PREFILL and plan.decode_rows == q.count(1), what
    out, lse = b.run(plan)
    qo = b.qo.tolist()
    want, want_lse = window_reference(b.q, b.k, b.v, kv, qo, window)
    check_window(out, lse, want, want_lse, qo, kv, TOL[dtype], what)


@pytest.mark.parametrize("dtype,D,bs,window", [
    (torch.bfloat16, 128, 16, 37),    # the window within one 64-token tile: most splits are empty
    (torch.float16, 256, 1, 700),     # the window over several splits
    (torch.bfloat16, 64, 16, 0),
    (torch.float16, 128, 16, 2500),   # cuts the longest sequence only
], ids=dt_id)
def test_window_splits(dtype, D, bs, window):
    """A short chunk, a decode row and 5 draft tokens over long prefixes,
    windowed: the plan splits each tile's K/V range (num_splits > 1) and
    merges the partial states; a captured run of the split plan replays
    with new queries; the unsplit plan agrees."""
    gen = torch.Generator().manual_seed(600 + D + bs + window)
    kv, q = [3000, 1700, 900], [70, 1, 5]
    b = Batch(gen, dtype, D, 8, 2, bs, kv, q, window=window)
    qo = b.qo.tolist()
    plan = b.plan()
    what = case(dtype, D, bs, 8, 2, window, plan)
    assert plan.num_splits > 1, f"{what}: the batch was meant to split"
    out, lse = b.run(plan)
    want, want_lse = window_reference(b.q, b.k, b.v, kv, qo, window)
    check_window(out, lse, want, want_lse, qo, kv, TOL[dtype], what)

    attn.prepare()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    gout = torch.full_like(b.q, float("nan"))
    glse = torch.full((b.total_q, 8), float("nan"), dtype=torch.float32, device=DEV)
    g = capture(torch, lambda: attn.paged_prefill(plan, b.q, b.k_cache, b.v_cache, b.table, out=gout, lse=glse), s)
    for replay in range(2):
        with torch.cuda.stream(s):
            b.q.copy_((torch.rand(b.q.shape, generator=gen) * 4 - 2).to(dtype))
            gout.fill_(float("nan"))
            glse.fill_(float("nan"))
            g.replay()
        s.synchronize()
        want, want_lse = window_reference(b.q, b.k, b.v, kv, qo, window)
        check_window(gout, glse, want, want_lse, qo, kv, TOL[dtype], f"graph replay {replay}, {what}")

    whole = b.plan(split_kv=False)
    assert whole.num_splits == 1, whole
    out1, lse1 = b.run(whole)
    check_window(out1, lse1, want, want_lse, qo, kv, TOL[dtype], "unsplit, " + case(dtype, D, bs, 8, 2, window, whole))
    err, row = row_err(gout, out1.double())
    assert err < TOL[dtype], f"{what}: split against unsplit: {row_where(row, qo, kv)}: relative difference {err:.3g}"


@pytest.mark.parametrize("dtype,D,bs,window", [(torch.bfloat16, 128, 16, 50), (torch.float16, 64, 1, 9)], ids=dt_id)
def test_window_graph_replay(dtype, D, bs, window):
    """One captured windowed paged_prefill (decode_route=False,
    split_kv=False: one launch for any composition) replays for later plans
    of the same window into the same workspace: new query counts, shorter
    lengths, and a step of one new token per sequence (windowed decode).
    qo_indptr and kv_lens are fixed device buffers, rewritten on the
    replay's stream before each plan; q and out are the capture's buffers,
    of which each plan uses the first rows (the rest stay unwritten)."""
    gen = torch.Generator().manual_seed(700 + D + bs + window)
    qh, kvh = 16, 4
    cap_kv, cap_q = [600, 300, 77, 1000, 160], [200, 1, 77, 64, 30]
    b = Batch(gen, dtype, D, qh, kvh, bs, cap_kv, cap_q, window=window)
    B, Tcap = len(cap_kv), b.total_q
    qo_d, kvl_d = b.qo.clone(), b.kvl.clone()
    qbuf = b.q.clone()
    out = torch.full_like(qbuf, float("nan"))
    lse = torch.full((Tcap, qh), float("nan"), dtype=torch.float32, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())

    def plan_for(kv_now, q_now):
        qo = [0]
        for n in q_now:
            qo.append(qo[-1] + n)
        with torch.cuda.stream(s):
            qo_d.copy_(torch.tensor(qo, dtype=torch.int32))
            kvl_d.copy_(torch.tensor(kv_now, dtype=torch.int32))
            p = attn.prefill_plan(qo_d, kvl_d, qh, kvh, D, dtype, b.ws, window_left=window, qo_indptr_host=qo,
                                  kv_lens_host=kv_now, decode_route=False, split_kv=False, stream=s,
                                  hopper=MAINLOOP["hopper"])
        assert p.route == attn.ROUTE_PREFILL and p.num_splits == 1 and p.decode_rows == 0, p
        return p, qo

    attn.prepare()
    plan, _ = plan_for(cap_kv, cap_q)
    with torch.cuda.stream(s):
        attn.paged_prefill(plan, qbuf, b.k_cache, b.v_cache, b.table, out=out, lse=lse)  # warm-up
        s.synchronize()
        g = capture(torch, lambda: attn.paged_prefill(plan, qbuf, b.k_cache, b.v_cache, b.table, out=out, lse=lse), s)
    steps = [
        (cap_kv, cap_q),                                    # the capture's own composition
        (cap_kv, [17, 1, 3, 150, 30]),                      # new query counts
        ([L - int(torch.randint(0, 60, (1,), generator=gen)) for L in cap_kv], [40, 1, 0, 9, 100]),
        ([L - 7 for L in cap_kv], [1] * B),                 # windowed decode: one new token each
    ]
    for step, (kv_now, q_now) in enumerate(steps):
        q_now = [min(n, L) for n, L in zip(q_now, kv_now)]
        p, qo = plan_for(kv_now, q_now)
        T = qo[-1]
        assert T <= Tcap
        with torch.cuda.stream(s):
            qbuf.copy_((torch.rand(qbuf.shape, generator=gen) * 4 - 2).to(dtype))
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            g.replay()
        s.synchronize()
        want, want_lse = window_reference(qbuf[:T], b.k, b.v, kv_now, qo, window)
        what = f"replay {step} (kv_lens {kv_now}, q_lens {q_now}), " + case(dtype, D, bs, qh, kvh, window, p)
        check_window(out[:T], lse[:T], want, want_lse, qo, kv_now, TOL[dtype], what)
        assert out[T:].isnan().all() and lse[T:].isnan().all(), f"{what}: rows past the plan's {T} were written"


def test_window_empty_batch():
    """A windowed step with no sequences (batch 0): the plan and the run
    return OK and write nothing: out and lse, zero-row views into poisoned
    buffers, keep their NaN, and the workspace its byte pattern."""
    qh, kvh, D = 8, 2, 128
    ws = torch.full((attn.prefill_workspace_size(4, 64, qh, kvh, D),), 0x5A, dtype=torch.uint8, device=DEV)
    qo = torch.zeros(1, dtype=torch.int32, device=DEV)
    kvl = torch.zeros(0, dtype=torch.int32, device=DEV)
    plan = attn.prefill_plan(qo, kvl, qh, kvh, D, torch.float16, ws, window_left=37, qo_indptr_host=[0],
                             kv_lens_host=[], hopper=MAINLOOP["hopper"])
    assert plan.batch == 0 and plan.total_q == 0 and plan.num_items == 0, plan
    k_cache = torch.full((4, 16, kvh, D), float("nan"), dtype=torch.float16, device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.zeros((4, 3), dtype=torch.int32, device=DEV)
    qbuf = torch.rand((8, qh, D), device=DEV).to(torch.float16)
    out_buf = torch.full((8, qh, D), float("nan"), dtype=torch.float16, device=DEV)
    lse_buf = torch.full((8, qh), float("nan"), dtype=torch.float32, device=DEV)
    out, lse = attn.paged_prefill(plan, qbuf[:0], k_cache, v_cache, table[:0], out=out_buf[:0], lse=lse_buf[:0],
                                  return_lse=True)
    torch.cuda.synchronize()
    assert tuple(out.shape) == (0, qh, D) and tuple(lse.shape) == (0, qh)
    assert out_buf.isnan().all() and lse_buf.isnan().all(), f"batch 0 wrote out or lse ({plan})"
    assert (ws == 0x5A).all(), f"batch 0 wrote the workspace ({plan})"


def test_stale_plan_refused():
    """A workspace holds one plan's work list: a plan whose workspace a later
    plan of another batch was written into raises (stale plan) and writes
    nothing; the later plan runs; the first batch planned again (the same
    list) runs, and so does the earlier identical plan beside it; a split
    decode launch into the workspace makes its plans stale too."""
    gen = torch.Generator().manual_seed(91)
    b = Batch(gen, torch.bfloat16, 128, 8, 2, 16, [700, 300, 90], [200, 100, 90])
    first = b.plan(decode_route=False)
    assert first.route == attn.ROUTE_PREFILL, first
    qo = torch.tensor([0, 64, 100, 190], dtype=torch.int32, device=DEV)  # another batch, the same workspace
    other = attn.prefill_plan(qo, b.kvl, b.qh, b.kvh, b.D, b.dtype, b.ws, qo_indptr_host=qo.cpu(),
                              kv_lens_host=b.kv_lens, decode_route=False)
    out = torch.full_like(b.q, float("nan"))
    with pytest.raises(kvplug.InvalidArgumentError, match="stale plan"):
        attn.paged_prefill(first, b.q, b.k_cache, b.v_cache, b.table, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "a refused run wrote its output"
    attn.paged_prefill(other, b.q[:190], b.k_cache, b.v_cache, b.table, out=out[:190])
    again = b.plan(decode_route=False)
    b.check(again)
    b.check(first)  # the same batch and flags: the same work list, so not stale
    # A split decode launch's partials land at the workspace's start, over the list: its plans are stale after it.
    dq = torch.rand((3, b.qh, b.D), device=DEV).to(b.dtype)
    attn.paged_decode(dq, b.k_cache, b.v_cache, b.table, b.kvl, workspace=b.ws, num_splits=2)
    out.fill_(float("nan"))
    with pytest.raises(kvplug.InvalidArgumentError, match="stale plan"):
        attn.paged_prefill(again, b.q, b.k_cache, b.v_cache, b.table, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "a refused run wrote its output"
    b.check(b.plan(decode_route=False))  # planned again: the list is back
