"""GPU tests of shared-prefix attention (kvplug.cascade), decode and varlen
prefill queries, on torch CUDA tensors, through libkvplug's C ABI.

Each test builds a batch whose sequences share runs of blocks (a tree of
prefixes, forks, or nothing), draws fresh random K/V and queries, poisons
out and lse with NaN, and compares with a float64 reference computed from
each sequence's logical K and V. Run on a GPU machine with the library built:

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_cascade_torch.py

Skips only on a machine with no NVIDIA device, and fails under
KVPLUG_REQUIRE_GPU=1 (tests/gpu/gputest.py).
"""

import math
import zlib

import pytest

from gputest import capture, check_rows, cuda_torch, row_err  # noqa: E402  (tests/gpu: skips only where there is no NVIDIA device)

torch = cuda_torch()

import kvplug  # noqa: E402
from kvplug import attn, cascade  # noqa: E402

DEV = torch.device("cuda")
# Hopper runs the prefill route on its wgmma kernel, faster than the cascade's shared items.
HOPPER = torch.cuda.get_device_capability() == (9, 0)
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
    check_rows(out, want, TOL[dtype], str(plan))
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
    # A fixed seed per case (crc32: str hashes change with every process).
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {levels} {bs}".encode()))
    plan = run_case(gen, dtype, levels, tail, bs)
    assert plan.route == cascade.ROUTE_CASCADE and plan.saved_tokens > 0


@pytest.mark.parametrize("qh,kvh,D,bs,tail", [
    (8, 8, 64, 1, 300),      # no GQA, token mode
    (16, 2, 256, 64, 700),   # group 8, head_dim 256
    (32, 8, 128, 256, 900),  # block size 256: tails inside one block
    (64, 4, 128, 16, 200),   # group 16: a tail fills the 16-row tile
    (32, 1, 64, 16, 150),    # group 32: tails of 32 rows (the 64-row tile; Hopper's 128-row one)
])
def test_cascade_decode_tails(qh, kvh, D, bs, tail):
    """Decode tails of at most 16 packed rows run the decode kernel's tile
    inside the cascade kernel; longer ones the 64-row tile (on Hopper the
    wgmma mainloop's 128-row tile)."""
    gen = torch.Generator().manual_seed(qh * 100 + D + bs)
    plan = run_case(gen, torch.bfloat16, [(12, 20), (4, 9)], tail, bs, qh=qh, kvh=kvh, D=D)
    assert plan.route == cascade.ROUTE_CASCADE


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
    with torch.cuda.stream(stream):
        cascade.paged_cascade(plan, qd, kd, vd, td, out=out, stream=stream)  # warm-up
        stream.synchronize()
        g = capture(torch, lambda: cascade.paged_cascade(plan, qd, kd, vd, td, out=out, stream=stream), stream)
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
            check_rows(out, want, TOL[dtype], f"step {step}")
    assert replans > 0


# ---- varlen prefill queries sharing cached prefixes ------------------------

def random_tree(gen, B, depth, max_run, tail_max, bs):
    """A random sharing tree of B sequences: each level splits a group into
    children of random sizes sharing a run of 1..max_run more blocks; each
    sequence then owns up to tail_max tokens. Returns (table, lens, blocks)."""
    rows = [[] for _ in range(B)]
    nxt = [0]

    def split(members, level):
        if level >= depth or not members:
            return
        perm = torch.randperm(len(members), generator=gen).tolist()
        members = [members[i] for i in perm]
        while members:
            n = 1 + int(torch.randint(0, len(members), (1,), generator=gen))
            if float(torch.rand((1,), generator=gen)) < 0.3:
                n = len(members)
            g, members = members[:n], members[n:]
            run = 1 + int(torch.randint(0, max_run, (1,), generator=gen))
            ids = list(range(nxt[0], nxt[0] + run))
            nxt[0] += run
            for m in g:
                rows[m] += ids
            split(g, level + 1)

    split(list(range(B)), 0)
    lens = []
    for s in range(B):
        tail = int(torch.randint(0, tail_max + 1, (1,), generator=gen))
        own = -(-tail // bs)
        shared = len(rows[s]) * bs
        rows[s] += list(range(nxt[0], nxt[0] + own))
        nxt[0] += own
        lens.append(shared + tail)
    perm = torch.randperm(max(nxt[0], 1), generator=gen).tolist()
    width = max(1, max(len(r) for r in rows))
    table = torch.full((B, width), -1, dtype=torch.int32)
    for s, r in enumerate(rows):
        if r:
            table[s, : len(r)] = torch.tensor([perm[i] for i in r], dtype=torch.int32)
    return table, lens, max(nxt[0], 1)


def random_queries(gen, lens, max_q):
    """Query offsets: a third decode rows (1 token), a sixth none, the rest
    1..max_q new tokens, never more than the sequence's length."""
    qo = [0]
    for L in lens:
        k = int(torch.randint(0, 6, (1,), generator=gen))
        q = 1 if k < 2 else (0 if k == 2 else 1 + int(torch.randint(0, max_q, (1,), generator=gen)))
        qo.append(qo[-1] + min(q, L))
    return qo


def prefill_reference(q, k_cache, v_cache, table, lens, qo, bs):
    """float64 causal attention: row i of sequence b (q_len new tokens at
    positions [L - q_len, L)) over the sequence's logical tokens [0, pos]."""
    T, qh, D = q.shape
    kvh = k_cache.shape[2]
    g = qh // kvh
    out = torch.zeros((T, qh, D), dtype=torch.float64)
    lse = torch.full((T, qh), -math.inf, dtype=torch.float64)
    for b in range(len(lens)):
        L, q0, q1 = lens[b], qo[b], qo[b + 1]
        if q1 == q0 or L == 0:
            continue
        blocks = table[b, : -(-L // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, D)[:L].double()
        v = v_cache[blocks].reshape(-1, kvh, D)[:L].double()
        n = q1 - q0
        pos = torch.arange(L - n, L)
        mask = torch.arange(L)[None, :] <= pos[:, None]  # [n, L]
        for h in range(qh):
            s = (q[q0:q1, h].double() @ k[:, h // g].T) / math.sqrt(D)
            s = s.masked_fill(~mask, -math.inf)
            lse[q0:q1, h] = torch.logsumexp(s, 1)
            out[q0:q1, h] = torch.softmax(s, 1) @ v[:, h // g]
    return out, lse


def run_prefill_case(gen, dtype, B, depth, max_run, tail_max, max_q, bs, qh, kvh, D, decode_route=False):
    table, lens, nb = random_tree(gen, B, depth, max_run, tail_max, bs)
    qo = random_queries(gen, lens, max_q)
    T = qo[-1]
    k = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    v = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    q = (torch.rand((max(T, 1), qh, D), generator=gen) * 4 - 2).to(dtype)[:T]
    want, want_lse = prefill_reference(q, k, v, table, lens, qo, bs)
    ws = cascade.Workspaces(B, qh, kvh, D, device=DEV, max_tokens=max(B, 4 * T + 8 * B))
    lens_h = torch.tensor(lens, dtype=torch.int32)
    qo_h = torch.tensor(qo, dtype=torch.int32)
    lens_d, qo_d = lens_h.to(DEV), qo_h.to(DEV)
    plan = cascade.plan(table, lens_h, lens_d, qh, kvh, D, dtype, ws, block_size=bs, decode_route=decode_route,
                        qo_indptr_host=qo_h, qo_indptr=qo_d)
    assert plan.total_q == T and plan.batch == B
    qd, kd, vd, td = q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV)
    out = torch.full((T, qh, D), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((T, qh), float("nan"), dtype=torch.float32, device=DEV)
    cascade.paged_cascade(plan, qd, kd, vd, td, out=out, lse=lse)
    torch.cuda.synchronize()
    got, gl = out.cpu().double(), lse.cpu().double()
    bad = torch.isnan(got).any(-1).any(-1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:10]} have NaN (unwritten elements) ({plan}, lens {lens}, qo {qo})"
    err = ((got - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2)).clamp_min(1e-30))
    worst = int(err.argmax()) if T else 0
    assert T == 0 or err.max().item() < TOL[dtype], \
        f"row {worst}: relative error {err.max().item():.3g} ({plan}, lens {lens}, qo {qo})"
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(gl), empty), f"empty rows differ ({plan})"
    if (~empty).any():
        assert (gl[~empty] - want_lse[~empty]).abs().max().item() < 2e-3 * max(
            1.0, want_lse[~empty].abs().max().item())
    # kvplug's own paged prefill on the same inputs.
    pws = torch.empty(attn.prefill_workspace_size(B, max(T, 1), qh, kvh, D), dtype=torch.uint8, device=DEV)
    pplan = attn.prefill_plan(qo_d, lens_d, qh, kvh, D, dtype, pws, qo_indptr_host=qo_h, kv_lens_host=lens_h)
    pout, plse = attn.paged_prefill(pplan, qd, kd, vd, td, return_lse=True)
    torch.cuda.synchronize()
    perr = ((got - pout.cpu().double()).norm(dim=(1, 2)) / want.norm(dim=(1, 2)).clamp_min(1e-30))
    assert T == 0 or perr.max().item() < 2 * TOL[dtype], \
        f"vs paged_prefill: row {int(perr.argmax())} relative difference {perr.max().item():.3g} ({plan})"
    return plan


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,depth,max_run,tail,max_q,bs,qh,kvh,D", [
    (8, 1, 256, 1000, 1000, 16, 8, 2, 128),   # prompts of up to 1000 tokens over a shared prompt
    (20, 3, 16, 300, 300, 16, 32, 8, 128),    # deeper tree, decode rows mixed
    (10, 2, 200, 120, 120, 1, 8, 8, 64),      # token mode, no GQA
    (8, 2, 5, 600, 500, 64, 8, 1, 256),       # large blocks, group 8, head_dim 256
    (16, 2, 64, 400, 4, 16, 32, 8, 128),      # draft tokens: tails of up to 16 rows on the decode tile
    (12, 2, 40, 300, 2, 256, 16, 2, 256),     # 1-2 tokens x group 8
])
def test_cascade_prefill_matches_reference(dtype, B, depth, max_run, tail, max_q, bs, qh, kvh, D):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {B} {depth} {bs} {D}".encode()))
    for _ in range(2):
        plan = run_prefill_case(gen, dtype, B, depth, max_run, tail, max_q, bs, qh, kvh, D)
        assert plan.route == cascade.ROUTE_CASCADE


def test_cascade_prefill_shared_system_prompt_routes():
    """8 requests share a 4096-token cached prompt, each with 200-1000 new
    tokens: the cascade route by the cost model (on Hopper the prefill route,
    whose kernel is faster there; the cascade kernels, forced, are checked
    too); the same requests without sharing: the prefill route
    (kvp_paged_prefill's kernel); all correct."""
    gen = torch.Generator().manual_seed(21)
    qh, kvh, D, bs, dtype = 8, 2, 128, 16, torch.float16
    for shared in (True, False):
        B, P = 8, 4096
        qlens = [200 + 100 * s for s in range(B)]
        lens = [P + n for n in qlens]
        nxt = 0 if not shared else P // bs
        rows = []
        for s in range(B):
            own = -(-qlens[s] // bs)
            pre = list(range(P // bs)) if shared else list(range(nxt, nxt + P // bs))
            if not shared:
                nxt += P // bs
            rows.append(pre + list(range(nxt, nxt + own)))
            nxt += own
        width = max(len(r) for r in rows)
        table = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)
        qo = [0]
        for n in qlens:
            qo.append(qo[-1] + n)
        T = qo[-1]
        k = (torch.rand((nxt, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
        v = (torch.rand((nxt, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
        q = (torch.rand((T, qh, D), generator=gen) * 4 - 2).to(dtype)
        want, _ = prefill_reference(q, k, v, table, lens, qo, bs)
        ws = cascade.Workspaces(B, qh, kvh, D, device=DEV, max_tokens=T)
        lens_h, qo_h = torch.tensor(lens, dtype=torch.int32), torch.tensor(qo, dtype=torch.int32)
        plan = cascade.plan(table, lens_h, lens_h.to(DEV), qh, kvh, D, dtype, ws, qo_indptr_host=qo_h,
                            qo_indptr=qo_h.to(DEV))
        assert plan.route == (cascade.ROUTE_CASCADE if shared and not HOPPER else cascade.ROUTE_PREFILL), plan
        assert plan.update(lens_h) is False
        plans = [plan]
        if shared:
            ws_forced = cascade.Workspaces(B, qh, kvh, D, device=DEV, max_tokens=T)
            forced = cascade.plan(table, lens_h, lens_h.to(DEV), qh, kvh, D, dtype, ws_forced, qo_indptr_host=qo_h,
                                  qo_indptr=qo_h.to(DEV), decode_route=False)
            assert forced.route == cascade.ROUTE_CASCADE, forced
            plans.append(forced)
        for pl in plans:
            out = torch.full((T, qh, D), float("nan"), dtype=dtype, device=DEV)
            cascade.paged_cascade(pl, q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV), out=out)
            torch.cuda.synchronize()
            check_rows(out, want, TOL[dtype], f"shared={shared} ({pl})")


def test_cascade_prefill_plans_replay_in_a_captured_graph():
    """One kvp_paged_cascade captured with a varlen prefill plan replays
    correctly for later cascade-route plans into the same workspaces with
    other query counts (decode rows, empty rows, long prompts) and shorter
    tails, as the header promises: q and out are fixed buffers of the
    capture's rows, each plan using a prefix of them."""
    gen = torch.Generator().manual_seed(33)
    qh, kvh, D, bs, dtype = 16, 4, 128, 16, torch.float16
    B = 12
    table, lens, nb = random_tree(gen, B, 2, 40, 400, bs)
    cap_qo = [0]
    for L in lens:
        cap_qo.append(cap_qo[-1] + min(L, 256))
    Tcap = cap_qo[-1]
    k = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    v = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    kd, vd, td = k.to(DEV), v.to(DEV), table.to(DEV)
    ws = cascade.Workspaces(B, qh, kvh, D, device=DEV, max_tokens=4 * Tcap + 8 * B)
    lens_d = torch.tensor(lens, dtype=torch.int32, device=DEV)
    qo_d = torch.zeros(B + 1, dtype=torch.int32, device=DEV)
    qbuf = torch.zeros((Tcap, qh, D), dtype=dtype, device=DEV)
    out = torch.zeros((Tcap, qh, D), dtype=dtype, device=DEV)
    stream = torch.cuda.Stream()

    def plan_for(lens_now, qo):
        lens_h, qo_h = torch.tensor(lens_now, dtype=torch.int32), torch.tensor(qo, dtype=torch.int32)
        stream.synchronize()  # the previous plan's copy has executed before the host workspace is rewritten
        with torch.cuda.stream(stream):
            lens_d.copy_(lens_h)
            qo_d.copy_(qo_h)
        p = cascade.plan(table, lens_h, lens_d, qh, kvh, D, dtype, ws, block_size=bs, decode_route=False,
                         qo_indptr_host=qo_h, qo_indptr=qo_d, stream=stream)
        assert p.route == cascade.ROUTE_CASCADE and p.total_q == qo[-1], p
        return p

    plan = plan_for(lens, cap_qo)
    with torch.cuda.stream(stream):
        cascade.paged_cascade(plan, qbuf, kd, vd, td, out=out, stream=stream)  # warm-up
        stream.synchronize()
        g = capture(torch, lambda: cascade.paged_cascade(plan, qbuf, kd, vd, td, out=out, stream=stream), stream)
    for step in range(4):
        # Shorter tails (within the rows' blocks) and fresh query counts, within the capture's rows.
        lens_now = [int(torch.randint(max(1, L - 200), L + 1, (1,), generator=gen)) if L else 0 for L in lens]
        qo = random_queries(gen, lens_now, 200)
        while qo[-1] > Tcap:
            qo = random_queries(gen, lens_now, 50)
        T = qo[-1]
        q = (torch.rand((max(T, 1), qh, D), generator=gen) * 4 - 2).to(dtype)[:T]
        want, _ = prefill_reference(q, k, v, table, lens_now, qo, bs)
        plan_for(lens_now, qo)
        with torch.cuda.stream(stream):
            qbuf[:T].copy_(q)
            out.fill_(float("nan"))
            g.replay()
        stream.synchronize()
        got = out[:T].cpu().double()
        bad = torch.isnan(got).any(-1).any(-1).nonzero().flatten().tolist()
        assert not bad, f"step {step}: rows {bad[:10]} unwritten (qo {qo})"
        err = (got - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2)).clamp_min(1e-30)
        assert T == 0 or err.max().item() < TOL[dtype], f"step {step}: row {int(err.argmax())} error {err.max().item():.3g}"


def test_cascade_prefill_errors():
    gen = torch.Generator().manual_seed(3)
    table, lens, nb = tree_batch(gen, [(4, 8)], 50, 16)
    B = table.shape[0]
    lens_h = torch.tensor(lens, dtype=torch.int32)
    qo_h = torch.tensor([0, 10, 20, 30, 40], dtype=torch.int32)
    ws = cascade.Workspaces(B, 8, 2, 64, device=DEV, max_tokens=64)
    with pytest.raises(kvplug.KvplugError) as e:
        cascade.plan(table, lens_h, lens_h.to(DEV), 8, 2, 64, torch.float16, ws, qo_indptr_host=qo_h)
    assert "go together" in str(e.value)
    small = cascade.Workspaces(B, 8, 2, 64, device=DEV, max_tokens=16)
    with pytest.raises(Exception) as e:
        cascade.plan(table, lens_h, lens_h.to(DEV), 8, 2, 64, torch.float16, small, qo_indptr_host=qo_h,
                      qo_indptr=qo_h.to(DEV))
    assert "max_tokens" in str(e.value)
    bad = torch.tensor([0, 10, 5, 30, 40], dtype=torch.int32)
    with pytest.raises(Exception) as e:
        cascade.plan(table, lens_h, lens_h.to(DEV), 8, 2, 64, torch.float16, ws, qo_indptr_host=bad,
                     qo_indptr=bad.to(DEV))
    assert "decrease" in str(e.value)


# ---- sliding windows ---------------------------------------------------------
#
# The shared-prefix planner takes no window: kvp_cascade_plan_args has no
# window field and cascade.plan no window argument, and the plans it writes
# record window_left -1 (core/cascadeattn: "shared-prefix plans have no
# window"). A windowed step over shared blocks is an attn.prefill_plan with
# the window (kvp_prefill_plan_args.window_size), reading the shared blocks
# once per sequence, as kvplug.hf's Runner does for a windowed model.

def dt_id(v):
    """Short test ids of dtypes (f16, bf16); None: pytest's own id."""
    names = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
    return names.get(v) if isinstance(v, torch.dtype) else None


def window_reference(q, k_cache, v_cache, table, lens, qo, bs, window):
    """float64 attention of the varlen rows q ([total_q, qh, D], CPU):
    sequence b's rows [qo[b], qo[b+1]) at positions [L - n, L), the row at
    position p over its logical tokens [max(0, p - window), p]."""
    T, qh, D = q.shape
    kvh = k_cache.shape[2]
    g = qh // kvh
    out = torch.zeros((T, qh, D), dtype=torch.float64)
    lse = torch.full((T, qh), -math.inf, dtype=torch.float64)
    for b in range(len(lens)):
        L, q0, q1 = lens[b], qo[b], qo[b + 1]
        if q1 == q0 or L == 0:
            continue
        blocks = table[b, : -(-L // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, D)[:L].double().repeat_interleave(g, dim=1)  # [L, qh, D]
        v = v_cache[blocks].reshape(-1, kvh, D)[:L].double().repeat_interleave(g, dim=1)
        n = q1 - q0
        pos = torch.arange(L - n, L)[:, None]
        t = torch.arange(L)[None, :]
        mask = (t <= pos) & (t >= pos - window)  # [n, L]
        s = torch.einsum("ihd,thd->hit", q[q0:q1].double(), k) / math.sqrt(D)
        s = s.masked_fill(~mask[None], -math.inf)
        lse[q0:q1] = torch.logsumexp(s, -1).transpose(0, 1)
        out[q0:q1] = torch.einsum("hit,thd->ihd", torch.softmax(s, -1), v)
    return out, lse


@pytest.mark.parametrize("dtype,B,depth,max_run,tail,max_q,bs,qh,kvh,D,window", [
    (torch.float16, 12, 2, 40, 300, 0, 16, 32, 8, 128, 100),   # decode: one row per sequence
    (torch.bfloat16, 10, 2, 120, 120, 120, 1, 8, 8, 64, 37),   # prompt chunks and decode rows, token mode
    (torch.bfloat16, 8, 2, 5, 600, 500, 16, 8, 1, 256, 300),   # group 8, head_dim 256
], ids=dt_id)
def test_cascade_takes_no_window_windowed_sharing_on_prefill_plan(dtype, B, depth, max_run, tail, max_q, bs, qh,
                                                                  kvh, D, window):
    """The cascade planner has no window to take (a window keyword is a
    TypeError naming it; its plan records window_left -1); the same batch of
    sequences sharing blocks (max_q 0: decode), windowed, runs on
    attn.prefill_plan's kernels (the decode kernel for one row per
    sequence) and matches the windowed reference row by row."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"window {dtype} {B} {bs} {D} {window}".encode()))
    table, lens, nb = random_tree(gen, B, depth, max_run, tail, bs)
    decode = max_q == 0
    qo = list(range(B + 1)) if decode else random_queries(gen, lens, max_q)
    T = qo[-1]
    assert any(L > window + 1 for L in lens), "the window cuts no sequence: the case checks nothing"
    k = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    v = (torch.rand((nb, bs, kvh, D), generator=gen) * 4 - 2).to(dtype)
    q = (torch.rand((max(T, 1), qh, D), generator=gen) * 4 - 2).to(dtype)[:T]
    lens_h, qo_h = torch.tensor(lens, dtype=torch.int32), torch.tensor(qo, dtype=torch.int32)
    lens_d, qo_d = lens_h.to(DEV), qo_h.to(DEV)

    varlen = {} if decode else dict(qo_indptr_host=qo_h, qo_indptr=qo_d)
    ws = cascade.Workspaces(B, qh, kvh, D, device=DEV, max_tokens=None if decode else max(B, 4 * T + 8 * B))
    with pytest.raises(TypeError, match="window_left"):
        cascade.plan(table, lens_h, lens_d, qh, kvh, D, dtype, ws, block_size=bs, window_left=window, **varlen)
    cplan = cascade.plan(table, lens_h, lens_d, qh, kvh, D, dtype, ws, block_size=bs, **varlen)
    assert cplan._c.window_left == -1, f"the cascade plan records window_left {cplan._c.window_left} ({cplan})"

    pws = torch.empty(attn.prefill_workspace_size(B, max(T, 1), qh, kvh, D), dtype=torch.uint8, device=DEV)
    plan = attn.prefill_plan(qo_d, lens_d, qh, kvh, D, dtype, pws, window_left=window, qo_indptr_host=qo_h,
                             kv_lens_host=lens_h)
    what = f"window_left {window}, {dtype}, D {D}, block size {bs}, heads {qh}/{kvh}, lens {lens}, qo {qo} ({plan})"
    if decode:  # one row per sequence: the decode kernel, window and all
        assert plan.route == attn.ROUTE_DECODE, what
    else:  # the prefill kernel, its one-token rows on the decode kernel
        assert plan.route == attn.ROUTE_PREFILL and plan.decode_rows == sum(
            1 for b in range(B) if qo[b + 1] - qo[b] == 1), what
    out = torch.full((T, qh, D), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((T, qh), float("nan"), dtype=torch.float32, device=DEV)
    attn.paged_prefill(plan, q.to(DEV), k.to(DEV), v.to(DEV), table.to(DEV), out=out, lse=lse)
    torch.cuda.synchronize()
    want, want_lse = window_reference(q, k, v, table, lens, qo, bs, window)
    err, row = row_err(out, want)

    def where(r):
        b = next(i for i in range(B) if qo[i] <= r < qo[i + 1])
        n = qo[b + 1] - qo[b]
        return f"row {r} (sequence {b}: length {lens[b]}, q_len {n}; position {lens[b] - qo[b + 1] + r})"

    assert err < TOL[dtype], f"{what}: {where(row)}: relative error {err:.3g} above {TOL[dtype]:.1g}"
    gl = lse.cpu().double()
    assert not gl.isnan().any(), f"{what}: lse has NaN (unwritten elements)"
    d = (gl - want_lse).abs().amax(dim=1)
    assert float(d.max()) < 2e-3, f"{what}: lse of {where(int(d.argmax()))}: max abs error {float(d.max()):.3g}"
