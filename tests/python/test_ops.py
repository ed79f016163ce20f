"""kvplug.ops, the attention calls as torch operators, without a GPU: the
fake implementations give the outputs' shapes and dtypes under
FakeTensorMode and on meta tensors without reaching the library, a traced
function sees each call as one op, and the real implementation packs what
the direct call packs (CPU tensors passed off as the kernels' device, as
in test_packed_args.py)."""

from __future__ import annotations

import ctypes

import pytest

from conftest import require

torch = require("torch")

import kvplug  # noqa: E402
import kvplug.ops as ops  # noqa: E402
from kvplug import _capi, attn, cascade  # noqa: E402
from test_packed_args import a_plan, caches, cpu_kernels, old_decode, old_planned, record, same  # noqa: E402,F401

from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402


def inputs(device=None, dtype=torch.float16):
    q = torch.empty(3, 4, 64, dtype=dtype, device=device)
    k = torch.empty(8, 16, 2, 64, dtype=dtype, device=device)
    table = torch.empty(3, 6, dtype=torch.int32, device=device)
    lens = torch.empty(3, dtype=torch.int32, device=device)
    return q, k, k.clone(), table, lens


def test_registered():
    for name in ("kv_write", "paged_decode", "paged_prefill", "paged_cascade"):
        assert getattr(ops, name) is getattr(torch.ops.kvplug, name).default


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_tensors(dtype):
    mode = FakeTensorMode()
    plan = mode.from_tensor(a_plan(attn.PrefillPlan, batch=3, total_q=3).as_tensor())  # as torch.compile passes it
    with mode:
        q, k, v, table, lens = inputs("cuda", dtype)  # fake CUDA tensors: no device needed
        ws = torch.empty(1024, dtype=torch.uint8, device="cuda")
        for out in (ops.paged_decode(q, k, v, table, lens, ws, 0.5, 2, 100),
                    ops.paged_decode(q, k, v, table, lens),
                    ops.paged_prefill(plan, q, k, v, table),
                    ops.paged_cascade(plan, q, k, v, table, 0.25)):
            assert isinstance(out, FakeTensor)
            assert out.shape == q.shape and out.dtype == dtype and out.device == q.device and out.is_contiguous()
        assert ops.kv_write(q[:, :2], q[:, :2], k, v, lens) is None


def test_meta_tensors():
    q, k, v, table, lens = inputs("meta")
    out = ops.paged_decode(q, k, v, table, lens)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype
    plan = a_plan(cascade.CascadePlan, batch=3, total_q=3).as_tensor()
    assert ops.paged_cascade(plan, q, k, v, table).shape == q.shape
    ops.kv_write(q[:, :2], q[:, :2], k, v, lens)


def test_traced_as_one_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    def layer(q, k, v, table, lens, key):
        ops.kv_write(key, key, k, v, lens)
        return ops.paged_decode(q, k, v, table, lens) * 2

    q, k, v, table, lens = inputs()
    g = make_fx(layer, tracing_mode="fake")(q, k, v, table, lens, q[:, :2])
    called = [n.target for n in g.graph.nodes if n.op == "call_function"]
    assert called == [torch.ops.kvplug.kv_write.default, torch.ops.kvplug.paged_decode.default,
                      torch.ops.aten.mul.Tensor]


def test_real_implementation_packs_what_the_call_packs(cpu_kernels, monkeypatch):
    rec = record(monkeypatch, "kvp_paged_decode", _capi.PagedDecodeArgs)
    q, k, v = torch.randn(3, 4, 64).half(), *caches()
    table = torch.randint(0, 8, (3, 6), dtype=torch.int32)
    lens = torch.randint(1, 96, (3,), dtype=torch.int32)
    ws = torch.empty(256, dtype=torch.uint8)
    out = ops.paged_decode(q, k, v, table, lens, ws, 0.5, 3, 90)
    same(rec.calls[-1][0], old_decode(q, k, v, table, lens, out, None, ws, 0.5, 3, 90))
    rec = record(monkeypatch, "kvp_paged_prefill", _capi.AttnPlan, _capi.PagedPrefillArgs)
    plan = a_plan(attn.PrefillPlan, batch=3, total_q=3)
    out = ops.paged_prefill(plan.as_tensor(), q, k, v, table)
    assert rec.calls[-1][2][0] == ctypes.addressof(plan._c)
    same(rec.calls[-1][1], old_planned(plan._c, q, k, v, table, out, None, None))
    rec = record(monkeypatch, "kvp_kv_write", _capi.KVWriteArgs)
    ops.kv_write(q[:, :2], q[:, :2], k, v, lens)
    assert len(rec.calls) == 1


def test_errors_are_the_calls():
    q, k, v, table, lens = inputs()
    with pytest.raises(kvplug.InvalidArgumentError, match="must be on a CUDA device"):
        ops.paged_decode(q, k, v, table, lens)
    plan = a_plan(attn.PrefillPlan, batch=3, total_q=3)
    with pytest.raises(kvplug.InvalidArgumentError, match="as_tensor"):
        ops.paged_prefill(torch.zeros(136, dtype=torch.uint8), q, k, v, table)
    with pytest.raises(kvplug.InvalidArgumentError, match="as_tensor"):  # a prefill plan is no cascade plan
        ops.paged_cascade(plan.as_tensor(), q, k, v, table)
    assert plan.as_tensor() is plan.as_tensor() and plan.as_tensor().numel() == ctypes.sizeof(_capi.AttnPlan)
