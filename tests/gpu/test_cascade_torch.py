"""GPU tests of shared-prefix decode attention (kvplug.cascade) on torch CUDA
tensors, through libkvplug's C ABI.

Each test builds a batch whose sequences share runs of blocks (a tree of
prefixes, forks, or nothing), draws fresh random K/V and queries, poisons
out and lse with NaN, and compares with a float64 reference computed from
each sequence's logical K and V. Run on a GPU machine with the library built:

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_cascade_torch.py

Skips when torch or a CUDA device is absent.
"""

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kvplug import cascade  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def tree_batch(gen, levels, tail_max, bs, extra_cols=0):
    """levels: [(group_size, blocks)] from the root: sequences
    [g*size, (g+1)*size) share `blocks` more blocks. Each sequence then owns
    a random tail of up to tail_max tokens. Returns (table rows, lengths,
    number of blocks); block ids are shuffled."""
    B = levels[0][0] if levels else 8
    rows = [[] for _ in range(B)]
    nxt = 0
    for size, blocks in levels:
        for lo in range(0, B, size):
            ids = list(range(nxt, nxt + blocks))
            nxt += blocks
            for s in range(lo, min(B, lo + size)):
                rows[s] += ids
    lens = []
    for s in range(B):
        tail = int(torch.randint(0, tail_max + 1, (1,), generator=gen))
        own = -(-tail // bs) + extra_cols
        rows[s] += list(range(nxt, nxt + own))
        nxt += own
        lens.append(len(rows[s]) * bs - own * bs + tail)
    perm = torch.randperm(nxt, generator=gen).tolist()
    width = max(len(r) for r in rows)
    table = torch.full((B, width), -1, dtype=torch.int32)
    for s, r in enumerate(rows):
        table[s, : len(r)] = torch.tensor([perm[i] for i in r], dtype=torch.int32)
    return table, lens, nxt


def reference(q, k_cache, v_cache, table, lens, bs):
    """float64 decode attention over each sequence's logical tokens."""
    B, qh, D = q.shape
    kvh = k_cache.shape[2]
    g = qh // kvh
    out = torch.zeros((B, qh, D), dtype=torch.float64)
    lse = torch.full((B, qh), -math.inf, dtype=torch.float64)
    for b in range(B):
        L = lens[b]
        if L == 0:
            continue
        blocks = table[b, : -(-L // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, D)[:L].double()
        v = v_cache[blocks].reshape(-1, kvh, D)[:L].double()
        for h in range(qh):
            s = (k[:, h // g] @ q[b, h].double()) / math.sqrt(D)
            lse[b, h] = torch.logsumexp(s, 0)
            out[b, h] = torch.softmax(s, 0) @ v[:, h // g]
    return out, lse


def run_case(gen, dtype, levels, tail_max, bs, qh=32, kvh=8, D=128, decode_route=False):
    table, lens, nb = tree_batch(gen, levels, tail_max, bs)
    B = table.shape[0]
    k = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    v = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    q = (torch.rand((B, qh, D), generator=gen) * 4 - 2).to(dtype)
    want, want_lse = reference(q, k, v, table, lens, bs)
    ws = cascade.Workspaces(B, qh, kvh, D, device=DEV)
    lens_h = torch.tensor(lens, dtype=torch.int32)
    plan = cascade.plan(table, lens_h, lens_h.to(DEV), qh, kvh, D, dtype, ws, block_size=bs,
                        decode_route=decode_route)
    out = torch.full((B, qh, D), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((B, qh), float("nan"), dtype=torch.float32, device=DEV)
    cascade.paged_cascade(plan, q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV), out=out, lse=lse)
    torch.cuda.synchronize()
    got = out.cpu().double()
    assert not torch.isnan(got).any(), "output has NaN (unwritten elements)"
    err = (got - want).norm().item() / max(want.norm().item(), 1e-30)
    assert err < TOL[dtype], f"relative error {err:.3g} ({plan})"
    gl = lse.cpu().double()
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(gl), empty)
    assert (gl[~empty] - want_lse[~empty]).abs().max().item() < 2e-3 * max(1.0, want_lse[~empty].abs().max().item())
    return plan


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("levels,tail,bs", [
    ([(32, 128)], 512, 16),            # one shared prompt
    ([(48, 40), (8, 24)], 300, 16),    # two levels
    ([(24, 300), (6, 200)], 40, 1),    # token mode
    ([(16, 20), (4, 6)], 1000, 64),    # large blocks
    ([(64, 256)], 128, 16),            # forks of one prompt
])
def test_cascade_matches_reference(dtype, levels, tail, bs):
    gen = torch.Generator().manual_seed(hash((str(dtype), str(levels), bs)) & 0xFFFF)
    plan = run_case(gen, dtype, levels, tail, bs)
    assert plan.route == cascade.ROUTE_CASCADE and plan.saved_tokens > 0


def test_no_sharing_cascade_and_decode_routes():
    gen = torch.Generator().manual_seed(5)
    plan = run_case(gen, torch.float16, [], 2000, 16)  # forced cascade route over tails only
    assert plan.route == cascade.ROUTE_CASCADE and plan.saved_tokens == 0
    plan = run_case(gen, torch.float16, [], 2000, 16, decode_route=True)
    assert plan.route == cascade.ROUTE_DECODE


def test_update_and_graph_replay_across_growth():
    gen = torch.Generator().manual_seed(9)
    qh, kvh, D, bs, dtype = 32, 8, 128, 16, torch.float16
    # Room in every row for 1600 more tokens: tails outgrow a plan's
    # headroom (64 tokens, rounded up to whole KV chunks) and force re-plans.
    table, lens, nb = tree_batch(gen, [(32, 64), (8, 16)], 100, bs, extra_cols=104)
    B = table.shape[0]
    k = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    v = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    q = (torch.rand((B, qh, D), generator=gen) * 4 - 2).to(dtype)
    kd, vd, qd, td = k.to(DEV), v.to(DEV), q.to(DEV), table.to(DEV)
    ws = cascade.Workspaces(B, qh, kvh, D, device=DEV)
    lens_h = torch.tensor(lens, dtype=torch.int32)
    lens_d = lens_h.to(DEV)
    stream = torch.cuda.Stream()
    plan = cascade.plan(table, lens_h, lens_d, qh, kvh, D, dtype, ws, decode_route=False, stream=stream)
    out = torch.empty((B, qh, D), dtype=dtype, device=DEV)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        cascade.paged_cascade(plan, qd, kd, vd, td, out=out, stream=stream)  # warm-up
        stream.synchronize()
        with torch.cuda.graph(g, stream=stream):
            cascade.paged_cascade(plan, qd, kd, vd, td, out=out, stream=stream)
    replans = 0
    for step in range(100):
        lens_h += 16
        if not plan.update(lens_h):
            # The pinned host workspace is rewritten only after the last
            # plan's copy has executed.
            stream.synchronize()
            plan = cascade.plan(table, lens_h, lens_d, qh, kvh, D, dtype, ws, decode_route=False, stream=stream)
            replans += 1
        with torch.cuda.stream(stream):
            lens_d.copy_(lens_h)
        if step % 25 == 24:
            out.fill_(float("nan"))
            with torch.cuda.stream(stream):
                g.replay()
            stream.synchronize()
            want, _ = reference(q, k, v, table, lens_h.tolist(), bs)
            got = out.cpu().double()
            assert not torch.isnan(got).any()
            err = (got - want).norm().item() / want.norm().item()
            assert err < TOL[dtype], f"step {step}: relative error {err:.3g}"
    assert replans > 0
