"""GPU tests of the tier copier (kvplug.TierCopier, kvp_tier_copier_*): a
Manager's host tier driven end to end on torch caches (demote a
conversation's blocks, lose them on the GPU, reload them into other
blocks, compare bytes), both cache layouts, K-only caches, batches of more
than one launch, and bad ops refused with nothing copied. Run on a GPU
machine with the library built:

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 -m pytest -q tests/gpu/test_tier_copy_torch.py

Skips only on a machine with no NVIDIA device, and fails under
KVPLUG_REQUIRE_GPU=1 (tests/gpu/gputest.py).
"""

import numpy as np
import pytest

from gputest import cuda_torch  # noqa: E402  (tests/gpu: skips only where there is no NVIDIA device)

torch = cuda_torch()

import kvplug  # noqa: E402
from kvplug.tiercopy import TierCopier  # noqa: E402

DEV = torch.device("cuda")


def caches(layers, blocks, shape, dtype, seed, kv=True):
    g = torch.Generator(device=DEV).manual_seed(seed)
    mk = lambda: [torch.randn((blocks, *shape), generator=g, device=DEV, dtype=torch.float32).to(dtype)  # noqa: E731
                  for _ in range(layers)]
    return mk(), (mk() if kv else None)


@pytest.mark.parametrize("layout", ["nhd", "hnd", "vllm"])
@pytest.mark.parametrize("kv", [True, False])
def test_manager_round_trip(layout, kv):
    L, BS, H, D, BLOCKS = 3, 16, 4, 64, 48
    shape = {"nhd": (BS, H, D), "hnd": (H, BS, D), "vllm": (BS, H, D)}[layout]
    if layout == "vllm":  # one [2, blocks, ...] tensor per layer: K = [0], V = [1]
        g = torch.Generator(device=DEV).manual_seed(7)
        both = [torch.randn((2, BLOCKS, *shape), generator=g, device=DEV).half() for _ in range(L)]
        k, v = [t[0] for t in both], ([t[1] for t in both] if kv else None)
    else:
        k, v = caches(L, BLOCKS, shape, torch.bfloat16, 11, kv)
    chunk = k[0][0].numel() * k[0].element_size()
    slot_bytes = chunk * L * (2 if kv else 1)
    with kvplug.Manager(BLOCKS, BS, prefix_cache=True, host_tier_slots=32, host_block_bytes=slot_bytes,
                        demote_ahead=BLOCKS) as m:
        with TierCopier(k, v, manager=m) as cp:
            assert cp.slot_bytes_needed == slot_bytes
            rng = np.random.default_rng(3)
            conv = rng.integers(0, 32000, 6 * BS + 1, dtype=np.int32)
            assert m.admit([1], [conv]).tolist() == [0]
            # The step's flush (nothing to copy; its forward pass writes the
            # blocks after it): flush_copies never demotes a block allocated
            # since the previous flush.
            assert m.flush_copies().ticket == 0
            table = m.describe([1]).block_table[0][:6].tolist()
            want_k = [t[table].clone() for t in k]
            want_v = [t[table].clone() for t in v] if kv else None
            m.mark_computed()  # the step's forward pass ran
            m.remove([1])

            host = m.host_tier_memory()
            host[:] = 0xEE
            batch = m.flush_copies()
            assert sorted(batch.demote_blocks.tolist()) == sorted(table)
            cp.run(batch)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            m.complete_copies(batch.ticket)
            for blk, slot in zip(batch.demote_blocks.tolist(), batch.demote_slots.tolist()):
                i = table.index(blk)
                row = host[slot]
                for layer in range(L):
                    for t, src in enumerate([want_k] + ([want_v] if kv else [])):
                        off = (layer * (2 if kv else 1) + t) * chunk
                        got = torch.from_numpy(row[off:off + chunk].copy()).view(k[0].dtype).reshape(shape)
                        assert torch.equal(got, src[layer][i].cpu()), (blk, layer, t)

            for t in k + (v or []):  # the GPU K/V is gone (poisoned)
                t.fill_(float("nan"))
            assert m.admit([2], [conv]).tolist() == [6 * BS]  # all six blocks from the host tier
            batch = m.flush_copies()
            assert len(batch.reload_blocks) == 6 and len(batch.demote_blocks) == 0
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                cp.run(batch, stream=s)
            torch.cuda.synchronize()
            m.complete_copies(batch.ticket)
            table2 = m.describe([2]).block_table[0][:6].tolist()
            for layer in range(L):
                assert torch.equal(k[layer][table2], want_k[layer])
                if kv:
                    assert torch.equal(v[layer][table2], want_v[layer])
            st = m.tier_stats()
            assert (st.demotions_completed, st.reloads_completed, st.host_hit_tokens) == (6, 6, 6 * BS)
            m.check()


def test_many_ops_and_bad_ops():
    L, BLOCKS, SLOTS = 2, 1400, 1300
    k, v = caches(L, BLOCKS, (1, 2, 64), torch.float16, 5)  # 256-byte chunks: token mode
    chunk = 256
    host = np.full((SLOTS, chunk * L * 2 + 16), 0xEE, np.uint8)  # slots wider than the layout
    with TierCopier(k, v, host=host) as cp:
        blocks = np.random.default_rng(1).permutation(BLOCKS)[:1203]
        slots = np.arange(1203)
        with pytest.raises(kvplug.InvalidArgumentError):
            cp.run(demote=(np.append(blocks, BLOCKS), np.append(slots, 0)))  # one bad op: nothing runs
        torch.cuda.synchronize()
        assert (host == 0xEE).all()
        cp.run(demote=(blocks, slots))  # three launches
        torch.cuda.synchronize()
        hk = torch.from_numpy(host[:1203, :chunk * L * 2].copy()).view(torch.float16).reshape(1203, L, 2, 1, 2, 64)
        for layer in range(L):
            assert torch.equal(hk[:, layer, 0].to(DEV), k[layer][torch.from_numpy(blocks).to(DEV)])
            assert torch.equal(hk[:, layer, 1].to(DEV), v[layer][torch.from_numpy(blocks).to(DEV)])
        assert (host[:1203, chunk * L * 2:] == 0xEE).all()  # the padding past the layout is untouched
        # Reload into other blocks.
        dst = np.arange(BLOCKS - 1203, BLOCKS)[::-1].copy()
        before = [t.clone() for t in k]
        cp.run(reload=(slots, dst))
        torch.cuda.synchronize()
        for layer in range(L):
            expect = before[layer].clone()
            expect[torch.from_numpy(dst).to(DEV)] = before[layer][torch.from_numpy(blocks).to(DEV)]
            assert torch.equal(k[layer], expect)


def test_bad_layouts():
    k, v = caches(2, 8, (16, 2, 64), torch.float16, 1)
    host = np.zeros((4, 16 * 2 * 64 * 2 * 4), np.uint8)
    with pytest.raises(kvplug.InvalidArgumentError):
        TierCopier(k, v, host=host[:, :-16])  # slots too small
    with pytest.raises(kvplug.InvalidArgumentError):
        TierCopier(k, v[:1], host=host)
    with pytest.raises(kvplug.InvalidArgumentError):
        TierCopier([t[:, :, :1] for t in k], None, host=host)  # blocks not contiguous
    cp = TierCopier(k, v, host=host)
    cp.close()
    with pytest.raises(kvplug.KvplugError):
        cp.run(demote=([0], [0]))


def test_host_pinned_by_the_engine():
    """Host memory the engine pinned itself (torch's pinned allocator) is
    used as it is, and stays usable after the copier is closed."""
    k, v = caches(2, 8, (16, 2, 64), torch.float16, 9)
    pinned = torch.zeros((4, 16 * 2 * 64 * 2 * 4), dtype=torch.uint8).pin_memory()
    with TierCopier(k, v, host=pinned.numpy()) as cp:
        cp.run(demote=([5, 2], [0, 3]))
        torch.cuda.synchronize()
    row = pinned[3, : 16 * 2 * 64 * 2].view(torch.float16).reshape(16, 2, 64)
    assert torch.equal(row.to(DEV), k[0][2])
    assert pinned.is_pinned()
    back = pinned.to(DEV, non_blocking=True)  # still a pinned buffer torch can copy from
    torch.cuda.synchronize()
    assert torch.equal(back.cpu(), pinned)


def test_manager_over_pinned_engine_memory():
    """A Manager whose host tier is the engine's pinned tensor
    (host_tier_memory=), copied by a TierCopier over the manager: the
    demoted bytes land in the engine's tensor."""
    L, BS, H, D, BLOCKS, SLOTS = 2, 16, 2, 64, 16, 8
    k, v = caches(L, BLOCKS, (BS, H, D), torch.float16, 21)
    chunk = BS * H * D * 2
    pinned = torch.zeros((SLOTS, chunk * L * 2), dtype=torch.uint8).pin_memory()
    with kvplug.Manager(BLOCKS, BS, prefix_cache=True, host_tier_slots=SLOTS, host_block_bytes=chunk * L * 2,
                        demote_ahead=BLOCKS, host_tier_memory=pinned) as m:
        with TierCopier(k, v, manager=m) as cp:
            conv = np.arange(100, 100 + 2 * BS + 1, dtype=np.int32)
            m.admit([1], [conv])
            assert m.flush_copies().ticket == 0  # the admission's step: nothing to demote yet
            table = m.describe([1]).block_table[0][:2].tolist()
            m.mark_computed()
            m.remove([1])
            batch = m.flush_copies()
            cp.run(batch)
            torch.cuda.synchronize()
            m.complete_copies(batch.ticket)
            for blk, slot in zip(batch.demote_blocks.tolist(), batch.demote_slots.tolist()):
                got = pinned[slot, :chunk].view(torch.float16).reshape(BS, H, D)
                assert torch.equal(got.to(DEV), k[0][blk]) and blk in table
    assert pinned.is_pinned()


@pytest.mark.parametrize("kind", ["token", "tensor"])
def test_fp8_blocks_move_with_their_scales(kind):
    """FP8 caches written by kv_write (per-token-head or per-cache scales):
    demoted blocks land in their slots as the e4m3 bytes of every layer's K
    and V, then (token-head) each block's K and V scales of every layer at
    the documented offsets after them; after the GPU blocks and scales are
    poisoned, reloads into other blocks bring back bytes and scales exactly,
    and attention over the reloaded blocks equals attention over the
    originals. A per-cache scale is not in the slots."""
    L, BLOCKS, BS, KVH, D, N = 3, 64, 16, 2, 64, 20
    E4M3 = torch.float8_e4m3fn
    g = torch.Generator(device=DEV).manual_seed(7)
    k8 = [torch.empty((BLOCKS, BS, KVH, D), dtype=E4M3, device=DEV) for _ in range(L)]
    v8 = [torch.empty_like(t) for t in k8]
    if kind == "token":
        ks = [torch.empty((BLOCKS, BS, KVH), device=DEV) for _ in range(L)]
        vs = [torch.empty_like(t) for t in ks]
    else:
        ks = [torch.full((1,), 0.02, device=DEV) for _ in range(L)]
        vs = [torch.full((1,), 0.03, device=DEV) for _ in range(L)]
    slots_all = torch.arange(BLOCKS * BS, dtype=torch.int32, device=DEV)
    for layer in range(L):
        x = torch.randn((BLOCKS * BS, KVH, D), generator=g, device=DEV).half() * (layer + 1)
        y = torch.randn((BLOCKS * BS, KVH, D), generator=g, device=DEV).half()
        kvplug.attn.kv_write(x, y, k8[layer], v8[layer], slots_all, k_scale=ks[layer], v_scale=vs[layer])
    chunk, sc = BS * KVH * D, (BS * KVH * 4 if kind == "token" else 0)
    need = (chunk + sc) * L * 2
    host = np.full((N + 2, need + 16), 0xEE, np.uint8)
    with TierCopier(k8, v8, host=host, k_scales=ks, v_scales=vs) as cp:
        assert cp.slot_bytes_needed == need
        rng = np.random.default_rng(3)
        blocks = rng.permutation(BLOCKS)[:N]
        slots = np.arange(N)
        cp.run(demote=(blocks, slots))
        torch.cuda.synchronize()
        bt = torch.from_numpy(blocks).to(DEV)
        for i in range(N):
            row = host[i]
            for layer in range(L):
                for t, (c, s) in enumerate(((k8, ks), (v8, vs))):
                    off = (layer * 2 + t) * chunk
                    got = torch.from_numpy(row[off:off + chunk].copy())
                    assert torch.equal(got, c[layer][blocks[i]].view(torch.uint8).flatten().cpu()), (i, layer, t)
                    if sc:
                        so = L * 2 * chunk + (layer * 2 + t) * sc
                        gs = torch.from_numpy(row[so:so + sc].copy()).view(torch.float32)
                        assert torch.equal(gs, s[layer][blocks[i]].flatten().cpu()), ("scales", i, layer, t)
            assert (row[need:] == 0xEE).all()
        # Poison the blocks the slots reload into (bytes and scales), reload, compare.
        dst = np.setdiff1d(np.arange(BLOCKS), blocks)[:N]
        dt = torch.from_numpy(dst).to(DEV)
        want = [(k8[i][bt].clone(), v8[i][bt].clone(), ks[i][bt].clone() if sc else None, vs[i][bt].clone() if sc else None)
                for i in range(L)]
        for i in range(L):
            k8[i].view(torch.uint8)[dt] = 0x7F
            v8[i].view(torch.uint8)[dt] = 0x7F
            if sc:
                ks[i][dt] = float("nan")
                vs[i][dt] = float("nan")
        cp.run(reload=(slots, dst))
        torch.cuda.synchronize()
        for i in range(L):
            assert torch.equal(k8[i][dt].view(torch.uint8), want[i][0].view(torch.uint8))
            assert torch.equal(v8[i][dt].view(torch.uint8), want[i][1].view(torch.uint8))
            if sc:
                assert torch.equal(ks[i][dt], want[i][2]) and torch.equal(vs[i][dt], want[i][3])
        # Attention over a reloaded block equals attention over its original.
        q = torch.randn((2, 4, D), generator=g, device=DEV).half()
        lens = torch.full((2,), BS, dtype=torch.int32, device=DEV)
        table = torch.tensor([[int(blocks[0])], [int(dst[0])]], dtype=torch.int32, device=DEV)
        out = kvplug.attn.paged_decode(q[:1].expand(2, 4, D).contiguous(), k8[1], v8[1], table, lens,
                                       k_scale=ks[1], v_scale=vs[1])
        torch.cuda.synchronize()
        assert torch.equal(out[0], out[1])


def test_fp8_bad_layouts():
    k8 = [torch.zeros((8, 16, 2, 64), dtype=torch.float8_e4m3fn, device=DEV) for _ in range(2)]
    v8 = [torch.zeros_like(t) for t in k8]
    ks = [torch.ones((8, 16, 2), device=DEV) for _ in range(2)]
    host = np.zeros((4, 1 << 16), np.uint8)
    with pytest.raises(kvplug.InvalidArgumentError):
        TierCopier(k8, v8, host=host)  # no scales
    with pytest.raises(kvplug.InvalidArgumentError):
        TierCopier(k8, v8, host=host, k_scales=ks, v_scales=ks[:1])
    need = (16 * 2 * 64 + 16 * 2 * 4) * 2 * 2
    with pytest.raises(kvplug.InvalidArgumentError):
        TierCopier(k8, v8, host=np.zeros((4, need - 16), np.uint8), k_scales=ks, v_scales=ks)  # no room for the scales
    tiny = [torch.zeros((8, 1, 2, 64), dtype=torch.float8_e4m3fn, device=DEV) for _ in range(2)]
    with pytest.raises(kvplug.InvalidArgumentError):  # 8 bytes of scales a block: not a 16-byte chunk
        TierCopier(tiny, [torch.zeros_like(t) for t in tiny], host=host, k_scales=[torch.ones((8, 1, 2), device=DEV)] * 2,
                   v_scales=[torch.ones((8, 1, 2), device=DEV)] * 2)
    with TierCopier(k8, v8, host=np.zeros((4, need), np.uint8), k_scales=ks, v_scales=ks) as cp:
        assert cp.slot_bytes_needed == need
