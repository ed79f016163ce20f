"""GPU tests of planning shared-prefix decode attention from a kvplug.Manager
(cascade.plan_from_manager, kvp_manager_cascade_plan) on torch CUDA
tensors: the plan, the host workspace and the device workspace are those
cascade.plan gives for the block table and lengths the manager describes,
the outputs are bitwise equal and match a float64 reference, the host-only
summary agrees with the device plan, and a step that only grew fits the
plan. Run on a GPU machine with the library built:

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_cascade_manager_torch.py

Skips only on a machine with no NVIDIA device, and fails under
KVPLUG_REQUIRE_GPU=1 (tests/gpu/gputest.py).
"""

import math
import zlib

import numpy as np
import pytest

from gputest import check_rows, cuda_torch  # noqa: E402  (tests/gpu: skips only where there is no NVIDIA device)

torch = cuda_torch()

import kvplug  # noqa: E402
from kvplug import cascade  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
QH, KVH, D = 32, 8, 128


def shared_manager(rng, bs, n_systems, seqs, forks, shots=True):
    """A manager (prefix cache on) whose sequences share system prompts
    (admitted through the cache), a few-shot block within some groups, and
    forks; every sequence grown by one decode token. Returns (manager, ids)
    with the ids shuffled."""
    m = kvplug.Manager(1 << 15, bs, prefix_cache=True)
    systems = [rng.integers(0, 32000, int(rng.integers(8, 80)) * bs + int(rng.integers(0, bs)), dtype=np.int32)
               for _ in range(n_systems)]
    shot = rng.integers(0, 32000, 5 * bs, dtype=np.int32)
    ids, nxt = [], 1
    for i in range(seqs):
        parts = [systems[i % n_systems]]
        if shots and i % 3 == 0:
            parts.append(shot)
        parts.append(rng.integers(0, 32000, int(rng.integers(1, 300)), dtype=np.int32))
        assert len(m.admit([nxt], [np.concatenate(parts)])) == 1
        ids.append(nxt)
        nxt += 1
    for parent in ids[:forks]:
        kids = list(range(nxt, nxt + 4))
        nxt += 4
        m.fork(parent, kids)
        ids += kids
    m.grow(ids, 1)
    rng.shuffle(ids)
    return m, ids


def reference(q, k_cache, v_cache, table, lens, bs):
    """float64 decode attention over each sequence's logical tokens."""
    B = q.shape[0]
    g = QH // KVH
    out = torch.zeros((B, QH, D), dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        blocks = table[b, : -(-L // bs)].long()
        k = k_cache[blocks].reshape(-1, KVH, D)[:L].double()
        v = v_cache[blocks].reshape(-1, KVH, D)[:L].double()
        for h in range(QH):
            s = (k[:, h // g] @ q[b, h].double()) / math.sqrt(D)
            out[b, h] = torch.softmax(s, 0) @ v[:, h // g]
    return out


def zeroed_workspaces(max_batch):
    ws = cascade.Workspaces(max_batch, QH, KVH, D, device=DEV)
    ws.host.zero_()  # regions a plan does not write compare equal too
    ws.device.zero_()
    return ws


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bs,n_systems,seqs,forks,spare", [
    (16, 1, 24, 2, 0),    # one system prompt, forks
    (16, 3, 40, 0, 37),   # three tenants, a wider device table
    (1, 2, 12, 1, 5),     # token mode
    (64, 2, 16, 3, 0),    # large blocks
])
@pytest.mark.parametrize("decode_route", [True, False])
def test_manager_plan_equals_described_plan(dtype, bs, n_systems, seqs, forks, spare, decode_route):
    rng = np.random.default_rng(zlib.crc32(f"{bs} {n_systems} {seqs}".encode()))  # a fixed seed per case
    m, ids = shared_manager(rng, bs, n_systems, seqs, forks)
    with m:
        d = m.describe(ids)
        width = d.block_table.shape[1] + spare
        d = m.describe(ids, max_blocks=width)
        B = len(ids)
        table = torch.from_numpy(d.block_table)
        lens_h = torch.from_numpy(d.seq_lens)
        lens_d = lens_h.to(DEV)
        ws_a, ws_b = zeroed_workspaces(B + 3), zeroed_workspaces(B + 3)
        pa = cascade.plan(table, lens_h, lens_d, QH, KVH, D, dtype, ws_a, block_size=bs, decode_route=decode_route)
        pb = cascade.plan_from_manager(m, ids, width, QH, KVH, D, dtype, ws_b, lens_d, decode_route=decode_route)
        torch.cuda.synchronize()
        for f in ("route", "batch", "num_items", "saved_tokens", "total_tokens"):
            assert getattr(pa, f) == getattr(pb, f), f
        assert (pa._c.max_kv_len, pa._c.grid, pa._c.state[2], pa._c.state[3]) == \
            (pb._c.max_kv_len, pb._c.grid, pb._c.state[2], pb._c.state[3])
        assert torch.equal(ws_a.host, ws_b.host), "host workspaces differ"
        assert torch.equal(ws_a.device, ws_b.device), "device workspaces differ"
        if not decode_route:
            assert pb.route == cascade.ROUTE_CASCADE and pb.saved_tokens > 0

        # The host-only summary is the device plan's.
        ph = cascade.plan_from_manager(m, ids, width, QH, KVH, D, dtype, decode_route=decode_route)
        assert (ph.route, ph.saved_tokens, ph.total_tokens) == (pb.route, pb.saved_tokens, pb.total_tokens)

        nb = int(table.max()) + 1  # the blocks in use (the pool is larger)
        gen = torch.Generator().manual_seed(7)
        k = (torch.rand((nb, bs, KVH, D), generator=gen) * 4 - 2).to(dtype)
        v = (torch.rand((nb, bs, KVH, D), generator=gen) * 4 - 2).to(dtype)
        q = (torch.rand((B, QH, D), generator=gen) * 4 - 2).to(dtype)
        kd, vd, qd, td = k.to(DEV), v.to(DEV), q.to(DEV), table.to(DEV)
        outs = []
        for p in (pa, pb):
            out = torch.full((B, QH, D), float("nan"), dtype=dtype, device=DEV)
            cascade.paged_cascade(p, qd, kd, vd, td, out=out)
            outs.append(out)
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]), "the two plans' outputs differ"
        want = reference(q, k, v, table, d.seq_lens, bs)
        check_rows(outs[1], want, TOL[dtype], str(pb))


@pytest.mark.parametrize("decode_route", [True, False])
def test_manager_plan_with_varlen_queries_equals_described_plan(decode_route):
    """Chunks and new prompts mixed with decode rows (qo_indptr): the plan
    from the manager is cascade.plan's of the described tables, and both
    runs give the same output."""
    rng = np.random.default_rng(11)
    m, ids = shared_manager(rng, 16, 2, 20, 1)
    with m:
        d = m.describe(ids, max_blocks=160)
        B = len(ids)
        q = [1 if i % 3 else int(min(d.seq_lens[i], 1 + 17 * i % 90)) for i in range(B)]
        qo_h = torch.tensor(np.concatenate([[0], np.cumsum(q)]), dtype=torch.int32)
        qo_d = qo_h.to(DEV)
        total_q = int(qo_h[-1])
        table, lens_h = torch.from_numpy(d.block_table), torch.from_numpy(d.seq_lens)
        lens_d = lens_h.to(DEV)
        wss = []
        for _ in range(2):
            ws = cascade.Workspaces(B, QH, KVH, D, device=DEV, max_tokens=total_q + 16)
            ws.host.zero_()
            ws.device.zero_()
            wss.append(ws)
        pa = cascade.plan(table, lens_h, lens_d, QH, KVH, D, torch.float16, wss[0], decode_route=decode_route,
                          qo_indptr_host=qo_h, qo_indptr=qo_d)
        pb = cascade.plan_from_manager(m, ids, 160, QH, KVH, D, torch.float16, wss[1], lens_d,
                                       decode_route=decode_route, qo_indptr_host=qo_h, qo_indptr=qo_d)
        torch.cuda.synchronize()
        for f in ("route", "batch", "total_q", "max_q_len", "num_items", "saved_tokens", "total_tokens"):
            assert getattr(pa, f) == getattr(pb, f), f
        assert torch.equal(wss[0].host, wss[1].host), "host workspaces differ"
        assert torch.equal(wss[0].device, wss[1].device), "device workspaces differ"
        nb = int(table.max()) + 1
        gen = torch.Generator().manual_seed(3)
        k = (torch.rand((nb, 16, KVH, D), generator=gen) * 4 - 2).half().to(DEV)
        v = (torch.rand((nb, 16, KVH, D), generator=gen) * 4 - 2).half().to(DEV)
        qt = (torch.rand((total_q, QH, D), generator=gen) * 4 - 2).half().to(DEV)
        outs = [cascade.paged_cascade(p, qt, k, v, table.to(DEV)) for p in (pa, pb)]
        torch.cuda.synchronize()
        assert not torch.isnan(outs[1]).any()
        assert torch.equal(outs[0], outs[1]), "the two plans' outputs differ"


def test_manager_plan_update_across_growth():
    rng = np.random.default_rng(3)
    m, ids = shared_manager(rng, 16, 2, 32, 2)
    with m:
        B = len(ids)
        width = 1024  # room for the growth below
        ws = cascade.Workspaces(B, QH, KVH, D, device=DEV)
        lens_d = torch.from_numpy(m.describe(ids).seq_lens).to(DEV)
        p = cascade.plan_from_manager(m, ids, width, QH, KVH, D, torch.float16, ws, lens_d, decode_route=False)
        assert p.route == cascade.ROUTE_CASCADE
        grown = 0
        while p.update(m.describe(ids).seq_lens):
            m.grow(ids, 1)
            grown += 1
            assert grown < 5000, "the plan never asked for a re-plan"
        # Each tail was planned with at least the default headroom of 64.
        assert grown > 64, f"re-plan needed after only {grown} tokens"
        lens = m.describe(ids).seq_lens
        p = cascade.plan_from_manager(m, ids, width, QH, KVH, D, torch.float16, ws,
                                      torch.from_numpy(lens).to(DEV), decode_route=False)
        assert p.update(lens) and p.route == cascade.ROUTE_CASCADE


def test_manager_plan_errors_on_device():
    rng = np.random.default_rng(4)
    m, ids = shared_manager(rng, 16, 1, 8, 0)
    with m:
        ws = cascade.Workspaces(4, QH, KVH, D, device=DEV)  # too small for 8 sequences
        lens_d = torch.from_numpy(m.describe(ids).seq_lens).to(DEV)
        with pytest.raises(kvplug.BufferTooSmallError, match="kvp_manager_cascade_plan"):
            cascade.plan_from_manager(m, ids, 128, QH, KVH, D, torch.float16, ws, lens_d)
        ws = cascade.Workspaces(8, QH, KVH, D, device=DEV)
        with pytest.raises(kvplug.InvalidArgumentError):
            cascade.plan_from_manager(m, ids, 128, QH, KVH, D, torch.float16, ws, lens_d[:4])
        with pytest.raises(kvplug.UnknownSequenceError):
            cascade.plan_from_manager(m, ids[:7] + [10**9], 128, QH, KVH, D, torch.float16, ws, lens_d)
