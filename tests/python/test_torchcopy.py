"""kvplug._torchcopy on the CPU: the torch copies of KV blocks between device
tensors and host rows that kvplug.hf's TorchTierCopier and kvplug.vllm's
BlockCopier both run."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvplug  # noqa: E402
from kvplug import _torchcopy as tc  # noqa: E402
from kvplug.hf import tier_copy  # noqa: E402
from kvplug.vllm import BlockCopier, plan_rows  # noqa: E402


def test_runs_of_consecutive_rows():
    assert tc.runs(np.array([], np.int64)) == []
    assert tc.runs(np.array([4])) == [(0, 1, 4)]
    assert tc.runs(np.array([0, 1, 2, 5, 6, 9])) == [(0, 3, 0), (3, 5, 5), (5, 6, 9)]


def test_fp8_is_copied_as_bytes():
    fp8 = torch.float8_e4m3fn
    assert tc.is_fp8(fp8) and not tc.is_fp8(torch.bfloat16)
    t = torch.zeros(2, 3, dtype=fp8)
    assert tc.as_bytes(t).dtype == torch.uint8 and tc.as_bytes(t).data_ptr() == t.data_ptr()
    b = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert tc.as_bytes(b) is b


def test_device_index_is_int64_on_the_device():
    idx = tc.device_index(np.array([3, 1, 2], np.int32), torch.device("cpu"))
    assert idx.dtype == torch.int64 and idx.device.type == "cpu" and idx.tolist() == [3, 1, 2]


def test_pin_of_nothing_is_not_pinned():
    # No CUDA call for an empty region (CPU-only torch has no cudart).
    assert tc.pin(np.zeros((0, 16), np.uint8), "test", "nothing") is False


@pytest.mark.parametrize("dim", [0, 2])
def test_copy_rows_round_trip_through_unordered_rows(dim):
    """Blocks along `dim` go to unordered, partly consecutive host rows and
    come back into other blocks; nothing else is written."""
    shape = [3, 2, 4, 5]
    shape.insert(dim, 10)  # 10 blocks along dim
    dev = torch.randn(shape)
    host = torch.zeros((8,) + tuple(dev.movedim(dim, 0).shape[1:]))
    blocks = np.array([5, 1, 9, 2, 7], np.int32)
    rows = np.array([6, 2, 3, 0, 7], np.int32)  # runs 2-3 and 6-7 once sorted
    tc.copy_rows([(dev, host)], dim, blocks, rows, store=True, non_blocking=False)
    for b, r in zip(blocks, rows):
        assert torch.equal(host[r], dev.select(dim, int(b)))
    assert not host[1].any() and not host[4].any() and not host[5].any()
    want = dev.clone()
    dev.zero_()
    back = np.array([0, 3, 4, 6, 8], np.int32)
    tc.copy_rows([(dev, host)], dim, back, rows, store=False, non_blocking=False)
    for b, nb in zip(blocks, back):
        assert torch.equal(dev.select(dim, int(nb)), want.select(dim, int(b)))
    for untouched in (1, 2, 5, 7, 9):
        assert not dev.select(dim, untouched).any()
    tc.copy_rows([(dev, host)], dim, back[:0], rows[:0], store=False, non_blocking=False)  # nothing to do
    assert not dev.select(dim, 1).any()


def test_copy_rows_moves_every_pair_and_fp8_bytes():
    """Several pairs (K/V and their scales) share one index; FP8 moves as
    bytes into strided host rows (a column range of one region)."""
    fp8 = torch.float8_e4m3fn
    kv = torch.randint(0, 120, (6, 2, 4), dtype=torch.uint8).view(fp8)
    scales = torch.rand(6, 2)
    region = torch.zeros(5, 8 + 8, dtype=torch.uint8)
    host_kv = region[:, :8].view(5, 2, 4).view(fp8)
    host_s = region[:, 8:].view(torch.float32)
    pairs = [(tc.as_bytes(kv), tc.as_bytes(host_kv)), (scales, host_s)]
    tc.copy_rows(pairs, 0, np.array([4, 0]), np.array([1, 3]), store=True, non_blocking=False)
    assert torch.equal(region[1, :8], kv.view(torch.uint8)[4].flatten())
    assert torch.equal(region[3, :8], kv.view(torch.uint8)[0].flatten())
    assert torch.equal(host_s[1], scales[4]) and torch.equal(host_s[3], scales[0])
    assert not region[0].any() and not region[2].any() and not region[4].any()


def test_staged_finish_scatters_a_store_only():
    stage = torch.arange(6, dtype=torch.int8).view(2, 3)
    host = torch.zeros(4, 3, dtype=torch.int8)
    store = tc.Staged(stage, host, torch.tensor([3, 0]))
    assert store.nbytes == 6
    assert not host.any()  # nothing before finish()
    store.finish()
    assert torch.equal(host[3], stage[0]) and torch.equal(host[0], stage[1]) and not host[1:3].any()
    before = host.clone()
    tc.Staged(torch.ones(2, 3, dtype=torch.int8)).finish()  # a load's stage: nothing to scatter
    assert torch.equal(host, before)


def test_both_torch_copiers_run_here(monkeypatch):
    """kvplug.hf's TorchTierCopier and kvplug.vllm's BlockCopier copy
    through copy_rows on the CPU, and their copies land."""
    calls = []
    real = tc.copy_rows

    def spy(pairs, dim, *a, **kw):
        calls.append(dim)
        return real(pairs, dim, *a, **kw)

    monkeypatch.setattr(tc, "copy_rows", spy)
    monkeypatch.setattr(tier_copy, "copy_rows", spy)
    kv = torch.randn(2, 2, 6, 4, 1, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
    host = np.zeros((3, tier_copy.block_bytes(2, 4, 1, 8, torch.float32)), np.uint8)
    cp = tier_copy.TorchTierCopier(kv, host)
    none = np.empty(0, np.int32)
    cp.run(kvplug.CopyBatch(1, np.array([4], np.int32), np.array([2], np.int32), none, none))
    assert torch.equal(cp.host[2], kv[:, :, 4]) and 2 in calls
    cp.close()

    calls.clear()
    views = [torch.randint(-100, 100, (6, 32), dtype=torch.int8) for _ in range(2)]
    bc = BlockCopier.for_views(views, 4, [[0, 1]])
    assert bc.tier_copier is None
    assert bc.transfer(1, plan_rows([5, 1], [2], [0], [3, 0], 1), store=True) == 2 * 2 * 32
    assert bc.last_skipped == 0
    assert [j for j, _, _ in bc.finished()] == [1]
    assert calls == [0, 0]  # one copy_rows a tensor
    assert torch.equal(bc.host_tensors[0][3], views[0][5]) and torch.equal(bc.host_tensors[1][0], views[1][1])
    assert bc.transfer(2, plan_rows([2, 4], [2], [0], [1, -1], 1), store=True) == 2 * 32  # slot -1: skipped
    assert bc.last_skipped == 1 and [j for j, _, _ in bc.finished()] == [2]
    assert torch.equal(bc.host_tensors[0][1], views[0][2])
    bc.shutdown()
