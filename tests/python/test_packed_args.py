"""The attention calls' argument structs, packed from torch CPU tensors (no
GPU): the kernels' device type is set to "cpu" and the C functions are
replaced by recorders, so each test sees the bytes the library would read.
Every struct must equal the one the previous bindings built field by field
(written out below from their code), on a call that checks and packs the
layouts and on later calls that reuse them; a call with other layouts is
checked again. Without the recorders the calls reach the library, which
answers NO_DEVICE on this machine."""

from __future__ import annotations

import ctypes
import threading

import pytest

from conftest import require

torch = require("torch")

import kvplug  # noqa: E402
from kvplug import _capi, _lib, _tensors, attn, cascade  # noqa: E402

STREAM = 0x5EED


@pytest.fixture
def cpu_kernels(monkeypatch):
    """Tensors on the CPU pass the device checks; no device switch; the current stream is STREAM."""
    _tensors.torch()
    monkeypatch.setattr(_tensors, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(_tensors, "_current_device", lambda: 0)
    monkeypatch.setattr(_tensors, "_raw_stream", lambda index: STREAM)
    # Fresh per-thread packs: another test's layouts must not be reused here.
    monkeypatch.setattr(attn, "_kv_write_tls", threading.local())
    monkeypatch.setattr(attn, "_decode_tls", threading.local())


class Recorder:
    """Stands in for a C function taking struct pointers and a stream: keeps
    a copy of each struct, and peek(structs) of the memory they point to
    (alive during the call only), and returns KVP_OK."""

    def __init__(self, *types, peek=None):
        self.types, self.calls, self.peek, self.peeked = types, [], peek, []

    def __call__(self, *args):
        *ptrs, stream = args
        assert stream == STREAM
        ptrs = [p if isinstance(p, int) else ctypes.cast(p, ctypes.c_void_p).value for p in ptrs]  # byref(...)
        self.calls.append([resolve_kv(t.from_buffer_copy((ctypes.c_char * ctypes.sizeof(t)).from_address(p)))
                           for t, p in zip(self.types, ptrs)] + [ptrs])
        if self.peek:
            self.peeked.append(self.peek(*self.calls[-1][:-1]))
        return 0


def resolve_kv(s):
    """The args as the library reads them: the kvp_paged_kv they point to
    (read during the call) folded into their own cache fields, and kv NULL,
    so that they compare with the previous bindings' structs field by field."""
    names = {f for f, _ in s._fields_}
    if "kv" not in names or not s.kv:
        return s
    d = s.kv.contents
    assert d.struct_size == ctypes.sizeof(_capi.PagedKV) and d.k_scale == 0 and d.v_scale == 0
    assert (s.k_cache, s.v_cache, s.num_blocks, s.block_size) == (0, 0, 0, 0), "a cache described twice"
    s.k_cache, s.v_cache = d.k_cache, d.v_cache
    s.cache_block_stride, s.cache_token_stride, s.cache_head_stride = d.block_stride, d.token_stride, d.head_stride
    s.num_blocks, s.block_size = d.num_blocks, d.block_size
    if "block_table" in names:
        s.block_table, s.max_blocks_per_seq = d.block_table, d.max_blocks_per_seq
        s.block_table_stride = d.block_table_stride or d.max_blocks_per_seq
    for f in ("dtype", "num_kv_heads"):
        if f in names:
            assert getattr(s, f) in (0, getattr(d, f))
            setattr(s, f, getattr(d, f))
    s.kv = None
    return s


def record(monkeypatch, name, *types, peek=None):
    r = Recorder(*types, peek=peek)
    monkeypatch.setattr(_lib.C, name, r)
    return r


def fields(s):
    def value(v):
        if isinstance(v, ctypes.Array):
            return list(v)
        if isinstance(v, ctypes._Pointer):
            return ctypes.cast(v, ctypes.c_void_p).value  # the address, not the wrapper object
        return v
    return {f: value(getattr(s, f)) for f, _ in s._fields_}


def same(a, b):
    assert type(a) is type(b)
    assert fields(a) == fields(b)  # names the field that differs
    assert bytes(a) == bytes(b)


def caches(blocks=8, bs=16, kvh=2, d=64, dtype=torch.float16):
    k = torch.randn(blocks, bs, kvh, d).to(dtype)
    return k, torch.randn(blocks, bs, kvh, d).to(dtype)


# -- what the previous bindings packed, field by field ----------------------


def old_kv_write(key, value, k_cache, v_cache, slot_mapping):
    nb, bs, kvh, d = k_cache.shape
    s = k_cache.stride()
    return _capi.KVWriteArgs(
        ctypes.sizeof(_capi.KVWriteArgs), attn.DTYPE_F16 if key.dtype == torch.float16 else attn.DTYPE_BF16, d,
        key.shape[0], kvh, nb, bs,
        key.data_ptr(), key.stride(0), key.stride(1),
        value.data_ptr(), value.stride(0), value.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), s[0], s[1], s[2], slot_mapping.data_ptr(),
    )


def old_decode(q, k_cache, v_cache, block_table, seq_lens, out, lse, workspace, scale, num_splits, max_seq_len):
    nb, bs, kvh, d = k_cache.shape
    batch, qh = q.shape[0], q.shape[1]
    s = k_cache.stride()
    ws_ptr, ws_bytes = (0, 0) if workspace is None else (workspace.data_ptr(), workspace.numel() * workspace.element_size())
    tstride = block_table.stride(0) if batch > 1 else block_table.shape[1]
    return _capi.PagedDecodeArgs(
        ctypes.sizeof(_capi.PagedDecodeArgs), attn.DTYPE_F16, d, batch, qh, kvh, nb, bs, block_table.shape[1],
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), s[0], s[1], s[2],
        block_table.data_ptr(), tstride, seq_lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        0 if lse is None else lse.data_ptr(), ws_ptr, ws_bytes, 0.0 if scale is None else float(scale),
        num_splits, max_seq_len, 1,  # q_len: one new token per sequence
    )


def old_planned(c, q, k_cache, v_cache, block_table, out, lse, scale):
    nb, bs, kvh, d = k_cache.shape
    s = k_cache.stride()
    tstride = block_table.stride(0) if c.batch > 1 else block_table.shape[1]
    return _capi.PagedPrefillArgs(
        ctypes.sizeof(_capi.PagedPrefillArgs), nb, bs, block_table.shape[1], 0,
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), s[0], s[1], s[2],
        block_table.data_ptr(), tstride,
        out.data_ptr(), out.stride(0), out.stride(1), 0 if lse is None else lse.data_ptr(),
        0.0 if scale is None else float(scale), 0,
    )


# -- kv_write -----------------------------------------------------------------


def test_kv_write_packs_what_it_packed(cpu_kernels, monkeypatch):
    rec = record(monkeypatch, "kvp_kv_write", _capi.KVWriteArgs)
    k_cache, v_cache = caches()
    for layer in range(3):  # the first call checks and packs; the others reuse the layouts
        key, value = torch.randn(5, 2, 64).half(), torch.randn(5, 2, 64).half()
        slots = torch.arange(5, dtype=torch.int32)
        k_cache, v_cache = caches()
        attn.kv_write(key, value, k_cache, v_cache, slots)
        same(rec.calls[-1][0], old_kv_write(key, value, k_cache, v_cache, slots))
    # Other layouts: strided key rows, more tokens, bf16.
    big = torch.randn(7, 4, 64).half()
    key, value = big[:, ::2], torch.randn(7, 2, 64).half()
    slots = torch.arange(7, dtype=torch.int32)
    attn.kv_write(key, value, k_cache, v_cache, slots)
    same(rec.calls[-1][0], old_kv_write(key, value, k_cache, v_cache, slots))
    kb, vb = caches(dtype=torch.bfloat16)
    kk, vv = torch.randn(7, 2, 64).bfloat16(), torch.randn(7, 2, 64).bfloat16()
    attn.kv_write(kk, vv, kb, vb, slots)
    same(rec.calls[-1][0], old_kv_write(kk, vv, kb, vb, slots))
    assert len(rec.calls) == 5


def test_kv_write_checks_a_changed_layout(cpu_kernels, monkeypatch):
    rec = record(monkeypatch, "kvp_kv_write", _capi.KVWriteArgs)
    k_cache, v_cache = caches()
    key = torch.randn(5, 2, 64).half()
    slots = torch.arange(5, dtype=torch.int32)
    attn.kv_write(key, key.clone(), k_cache, v_cache, slots)
    with pytest.raises(kvplug.InvalidArgumentError, match="slot_mapping must be torch.int32"):
        attn.kv_write(key, key.clone(), k_cache, v_cache, slots.long())
    with pytest.raises(kvplug.InvalidArgumentError, match="v_cache has shape"):
        attn.kv_write(key, key.clone(), k_cache, v_cache[:4], slots)
    with pytest.raises(kvplug.InvalidArgumentError, match="key has dtype"):
        attn.kv_write(key.float(), key.clone(), k_cache, v_cache, slots)
    with pytest.raises(kvplug.InvalidArgumentError, match="must be a torch tensor"):
        attn.kv_write(key.numpy(), key.clone(), k_cache, v_cache, slots)
    assert len(rec.calls) == 1
    attn.kv_write(key, key.clone(), k_cache, v_cache, slots)  # the checked layout still serves
    assert len(rec.calls) == 2


# -- paged_decode ---------------------------------------------------------------


def decode_inputs(batch=3, qh=4, d=64, cols=6):
    k_cache, v_cache = caches(d=d)
    q = torch.randn(batch, qh, d).half()
    table = torch.randint(0, 8, (batch, cols), dtype=torch.int32)
    lens = torch.randint(1, 96, (batch,), dtype=torch.int32)
    return q, k_cache, v_cache, table, lens


def test_paged_decode_packs_what_it_packed(cpu_kernels, monkeypatch):
    rec = record(monkeypatch, "kvp_paged_decode", _capi.PagedDecodeArgs)
    for layer in range(3):
        q, k, v, table, lens = decode_inputs()
        out = attn.paged_decode(q, k, v, table, lens)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        same(rec.calls[-1][0], old_decode(q, k, v, table, lens, out, None, None, None, 0, 0))
    # Every optional argument, given, twice with the same layouts.
    ws = torch.empty(4096, dtype=torch.uint8)
    for layer in range(2):
        q, k, v, table, lens = decode_inputs()
        out = torch.empty(3, 4, 64).half()
        got, lse = attn.paged_decode(q, k, v, table, lens, out=out, workspace=ws, scale=0.5, num_splits=3,
                                     max_seq_len=90, return_lse=True)
        assert got is out and lse.shape == (3, 4) and lse.dtype == torch.float32
        same(rec.calls[-1][0], old_decode(q, k, v, table, lens, out, lse, ws, 0.5, 3, 90))
    # The same layouts without out, lse or workspace: the scalars are this call's.
    q, k, v, table, lens = decode_inputs()
    out = attn.paged_decode(q, k, v, table, lens, out=None, workspace=ws, scale=None)
    same(rec.calls[-1][0], old_decode(q, k, v, table, lens, out, None, ws, None, 0, 0))
    # A batch of one (the table stride is its width), a strided q.
    q, k, v, table, lens = decode_inputs(batch=1)
    qs = torch.randn(1, 8, 64).half()[:, ::2]
    out, lse = attn.paged_decode(qs, k, v, table, lens, return_lse=True)
    same(rec.calls[-1][0], old_decode(qs, k, v, table, lens, out, lse, None, None, 0, 0))


def test_paged_decode_checks_a_changed_layout(cpu_kernels, monkeypatch):
    rec = record(monkeypatch, "kvp_paged_decode", _capi.PagedDecodeArgs)
    q, k, v, table, lens = decode_inputs()
    attn.paged_decode(q, k, v, table, lens)
    with pytest.raises(kvplug.InvalidArgumentError, match="block_table has 2 rows"):
        attn.paged_decode(q, k, v, table[:2], lens)
    with pytest.raises(kvplug.InvalidArgumentError, match="q has dtype"):
        attn.paged_decode(q.float(), k, v, table, lens)
    with pytest.raises(kvplug.InvalidArgumentError, match="out has shape"):
        attn.paged_decode(q, k, v, table, lens, out=torch.empty(2, 4, 64).half())
    with pytest.raises(kvplug.InvalidArgumentError, match="workspace must be contiguous"):
        attn.paged_decode(q, k, v, table, lens, workspace=torch.empty(64, dtype=torch.uint8)[::2])
    with pytest.raises(kvplug.InvalidArgumentError, match="num_splits"):
        attn.paged_decode(q, k, v, table, lens, num_splits=2**31)
    with pytest.raises(kvplug.InvalidArgumentError, match="max_seq_len"):
        attn.paged_decode(q, k, v, table, lens, max_seq_len=1.5)
    assert len(rec.calls) == 1


def test_each_thread_packs_its_own(cpu_kernels, monkeypatch):
    rec = record(monkeypatch, "kvp_paged_decode", _capi.PagedDecodeArgs)
    q, k, v, table, lens = decode_inputs()
    attn.paged_decode(q, k, v, table, lens)
    mine = attn._decode_tls.p
    other = []
    th = threading.Thread(target=lambda: other.append(attn.paged_decode(q, k, v, table, lens)))
    th.start()
    th.join()
    assert attn._decode_tls.p is mine and rec.calls[0][1][0] != rec.calls[1][1][0]
    same(rec.calls[1][0], old_decode(q, k, v, table, lens, other[0], None, None, None, 0, 0))


# -- planned layers: paged_prefill and paged_cascade ------------------------------


def a_plan(cls, batch=2, total_q=5, qh=4, kvh=2, d=64, dtype=attn.DTYPE_F16):
    c = _capi.AttnPlan()
    c.struct_size = ctypes.sizeof(c)
    c.kind, c.batch, c.total_q, c.num_q_heads, c.num_kv_heads, c.head_dim, c.dtype = 1, batch, total_q, qh, kvh, d, dtype
    return cls(c, ())


@pytest.mark.parametrize("cls,run,name", [(attn.PrefillPlan, attn.paged_prefill, "kvp_paged_prefill"),
                                          (cascade.CascadePlan, cascade.paged_cascade, "kvp_paged_cascade")])
def test_planned_layers_pack_what_they_packed(cpu_kernels, monkeypatch, cls, run, name):
    rec = record(monkeypatch, name, _capi.AttnPlan, _capi.PagedPrefillArgs)
    plan = a_plan(cls)
    for layer in range(3):
        k, v = caches()
        q = torch.randn(5, 4, 64).half()
        table = torch.randint(0, 8, (2, 6), dtype=torch.int32)
        out = run(plan, q, k, v, table)
        got_plan, got_args, ptrs = rec.calls[-1]
        assert ptrs[0] == ctypes.addressof(plan._c)
        same(got_plan, plan._c)
        same(got_args, old_planned(plan._c, q, k, v, table, out, None, None))
    out = torch.empty(5, 4, 64).half()
    lse = torch.empty(5, 4)
    for layer in range(2):
        got, got_lse = run(plan, q, k, v, table, out=out, lse=lse, scale=0.25, return_lse=True)
        assert got is out and got_lse is lse
        same(rec.calls[-1][1], old_planned(plan._c, q, k, v, table, out, lse, 0.25))
    got, got_lse = run(plan, q, k, v, table, return_lse=True)
    same(rec.calls[-1][1], old_planned(plan._c, q, k, v, table, got, got_lse, None))
    one = a_plan(cls, batch=1, total_q=1)
    q1 = torch.randn(1, 4, 64).half()
    out = run(one, q1, k, v, table[:1])
    same(rec.calls[-1][1], old_planned(one._c, q1, k, v, table[:1], out, None, None))


def planned_layer(monkeypatch, cls, run, name):
    """A plan of cls and one layer run through it (5 rows of 4 q heads over
    2 kv heads of 64), with the recorder of the C calls named name."""
    rec = record(monkeypatch, name, _capi.AttnPlan, _capi.PagedPrefillArgs)
    plan = a_plan(cls)
    k, v = caches()
    q = torch.randn(5, 4, 64).half()
    table = torch.randint(0, 8, (2, 6), dtype=torch.int32)
    run(plan, q, k, v, table)
    return rec, plan, q, k, v, table


@pytest.mark.parametrize("cls,run,name", [(attn.PrefillPlan, attn.paged_prefill, "kvp_paged_prefill"),
                                          (cascade.CascadePlan, cascade.paged_cascade, "kvp_paged_cascade")])
def test_planned_layers_check_against_the_plan(cpu_kernels, monkeypatch, cls, run, name):
    rec, plan, q, k, v, table = planned_layer(monkeypatch, cls, run, name)
    with pytest.raises(kvplug.InvalidArgumentError, match="the plan has"):
        run(plan, q[:4], k, v, table)
    with pytest.raises(kvplug.InvalidArgumentError, match="kv heads"):
        run(plan, q, *caches(kvh=1), table)
    with pytest.raises(kvplug.InvalidArgumentError, match="rows for batch"):
        run(plan, q, k, v, table[:1])
    with pytest.raises(kvplug.InvalidArgumentError, match="the plan was made for"):
        kb, vb = caches(dtype=torch.bfloat16)
        run(plan, q.bfloat16(), kb, vb, table)
    with pytest.raises(kvplug.InvalidArgumentError, match="plan must come from"):
        run(object(), q, k, v, table)
    assert len(rec.calls) == 1


# -- plans and merge_states: packed per call, as before ------------------------


def test_prefill_plan_args(cpu_kernels, monkeypatch):
    rec = record(monkeypatch, "kvp_prefill_plan", _capi.PrefillPlanArgs, _capi.AttnPlan,
                 peek=lambda a, p: ([a.qo_indptr_host[i] for i in range(a.batch + 1)],
                                    [a.kv_lens_host[i] for i in range(a.batch)]))
    qo = torch.tensor([0, 3, 4], dtype=torch.int32)
    kv = torch.tensor([10, 4], dtype=torch.int32)
    ws = torch.empty(1 << 12, dtype=torch.uint8)
    plan = attn.prefill_plan(qo, kv, 8, 2, 128, torch.bfloat16, ws, window_left=7, qo_indptr_host=[0, 3, 4],
                             kv_lens_host=kv, decode_route=False)
    a, p, ptrs = rec.calls[-1]
    assert isinstance(plan, attn.PrefillPlan) and p.struct_size == ctypes.sizeof(_capi.AttnPlan)
    assert (a.struct_size, a.dtype, a.head_dim, a.num_q_heads, a.num_kv_heads, a.batch, a.window_size, a.flags,
            a.reserved) == (ctypes.sizeof(_capi.PrefillPlanArgs), attn.DTYPE_BF16, 128, 8, 2, 2, 8, 1, 0)
    assert (a.qo_indptr, a.kv_lens, a.workspace, a.workspace_bytes) == (qo.data_ptr(), kv.data_ptr(), ws.data_ptr(), 4096)
    assert rec.peeked[-1] == ([0, 3, 4], [10, 4])


def test_cascade_plan_args(cpu_kernels, monkeypatch):
    rec = record(monkeypatch, "kvp_cascade_plan", _capi.CascadePlanArgs, _capi.AttnPlan,
                 peek=lambda a, p: ([a.seq_lens_host[i] for i in range(a.batch)],
                                    [a.block_table_host[i] for i in range(a.batch * a.block_table_stride)]))
    ws = object.__new__(cascade.Workspaces)
    ws.max_batch, ws.max_tokens = 4, 0
    ws.device, ws.host = torch.empty(1 << 10, dtype=torch.uint8), torch.empty(1 << 9, dtype=torch.uint8)
    lens = torch.tensor([20, 40], dtype=torch.int32)
    table = [[0, 1, 2], [0, 1, 3]]
    plan = cascade.plan(table, [20, 40], lens, 8, 2, 64, torch.float16, ws, headroom=5, decode_route=False)
    a, p, ptrs = rec.calls[-1]
    assert isinstance(plan, cascade.CascadePlan)
    assert (a.dtype, a.head_dim, a.num_q_heads, a.num_kv_heads, a.batch, a.max_batch, a.block_size,
            a.max_blocks_per_seq, a.block_table_stride) == (attn.DTYPE_F16, 64, 8, 2, 2, 4, 16, 3, 3)
    assert (a.seq_lens, a.host_workspace, a.host_workspace_bytes, a.workspace, a.workspace_bytes, a.flags,
            a.headroom, a.max_tokens, a.reserved) == (lens.data_ptr(), ws.host.data_ptr(), 512, ws.device.data_ptr(),
                                                      1024, cascade.NO_DECODE_ROUTE, 5, 0, 0)
    assert rec.peeked[-1] == ([20, 40], [0, 1, 2, 0, 1, 3])
    assert not a.qo_indptr_host and a.qo_indptr == 0


def test_merge_states_args(cpu_kernels, monkeypatch):
    rec = record(monkeypatch, "kvp_merge_states", _capi.MergeStatesArgs)
    vs = [torch.randn(3, 4, 64).half() for _ in range(2)]
    ss = [torch.randn(3, 4) for _ in range(2)]
    out, lse = attn.merge_states(vs, ss)
    a = rec.calls[-1][0]
    assert (a.dtype, a.head_dim, a.num_states, a.num_tokens, a.num_heads) == (attn.DTYPE_F16, 64, 2, 3, 4)
    assert list(a.v)[:2] == [t.data_ptr() for t in vs] and list(a.s)[:2] == [t.data_ptr() for t in ss]
    assert (a.out, a.out_lse, a.v_token_stride, a.s_token_stride) == (out.data_ptr(), lse.data_ptr(), 256, 4)


# -- through to the library ----------------------------------------------------------


def test_calls_reach_the_library(cpu_kernels):
    """Packed from CPU tensors, the calls reach the library, which has no device here."""
    q, k, v, table, lens = decode_inputs()
    if attn.cuda_available():
        pytest.skip("a CUDA device is present: the library would launch on CPU pointers")
    with pytest.raises(kvplug.NoDeviceError):
        attn.paged_decode(q, k, v, table, lens)
    with pytest.raises(kvplug.NoDeviceError):
        attn.paged_decode(q, k, v, table, lens)  # the packed layouts
    with pytest.raises(kvplug.NoDeviceError):
        attn.kv_write(q[:, :2], q[:, :2], k, v, lens)


# -- FP8 (e4m3) caches ------------------------------------------------------------


def record_kv(monkeypatch, name, args_type):
    """Records the kvp_paged_kv that each call's args point to, as fields."""
    seen = []

    def fn(*args):
        *ptrs, stream = args
        a = args_type.from_buffer_copy((ctypes.c_char * ctypes.sizeof(args_type)).from_address(
            ptrs[-1] if isinstance(ptrs[-1], int) else ctypes.cast(ptrs[-1], ctypes.c_void_p).value))
        seen.append((fields(a.kv.contents), a.dtype))
        return 0
    monkeypatch.setattr(_lib.C, name, fn)
    return seen


def test_fp8_caches_pack_their_scales(cpu_kernels, monkeypatch):
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    if e4m3 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    writes = record_kv(monkeypatch, "kvp_kv_write", _capi.KVWriteArgs)
    decodes = record_kv(monkeypatch, "kvp_paged_decode", _capi.PagedDecodeArgs)
    k8, v8 = (torch.zeros(8, 16, 2, 64).to(e4m3) for _ in range(2))
    ks, vs = torch.zeros(8, 16, 2), torch.zeros(8, 16, 2)
    key = torch.randn(5, 2, 64).bfloat16()
    slots = torch.arange(5, dtype=torch.int32)
    attn.kv_write(key, key.clone(), k8, v8, slots, k_scale=ks, v_scale=vs)
    kv, dt = writes[-1]
    assert dt == attn.DTYPE_BF16 and kv["dtype"] == attn.DTYPE_E4M3 and kv["scale_kind"] == _tensors.SCALE_TOKEN_HEAD
    assert (kv["k_scale"], kv["v_scale"]) == (ks.data_ptr(), vs.data_ptr())
    assert (kv["block_stride"], kv["token_stride"], kv["head_stride"]) == k8.stride()[:3]  # bytes: e4m3 elements
    # One scale per cache, and new scale tensors under a kept layout.
    kt, vt = torch.ones(1), torch.ones(1)
    attn.kv_write(key, key.clone(), k8, v8, slots, k_scale=kt, v_scale=vt)
    assert writes[-1][0]["scale_kind"] == _tensors.SCALE_TENSOR and writes[-1][0]["k_scale"] == kt.data_ptr()
    ks2 = torch.zeros(8, 16, 2)
    attn.kv_write(key, key.clone(), k8, v8, slots, k_scale=ks2, v_scale=vs)
    assert writes[-1][0]["k_scale"] == ks2.data_ptr()
    q = torch.randn(2, 4, 64).bfloat16()
    table = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    attn.paged_decode(q, k8, v8, table, lens, k_scale=ks, v_scale=vs)
    kv, dt = decodes[-1]
    assert dt == attn.DTYPE_BF16 and kv["dtype"] == attn.DTYPE_E4M3 and kv["k_scale"] == ks.data_ptr()
    # A 16-bit cache keeps no scales.
    k16, v16 = caches(dtype=torch.bfloat16)
    attn.paged_decode(q, k16, v16, table, lens)
    assert decodes[-1][0]["dtype"] == attn.DTYPE_BF16 and decodes[-1][0]["k_scale"] == 0 and decodes[-1][0]["scale_kind"] == 0


def test_fp8_misuse_is_refused_before_the_library(cpu_kernels, monkeypatch):
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    if e4m3 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    writes = record_kv(monkeypatch, "kvp_kv_write", _capi.KVWriteArgs)
    k8, v8 = (torch.zeros(8, 16, 2, 64).to(e4m3) for _ in range(2))
    ks, vs = torch.zeros(8, 16, 2), torch.zeros(8, 16, 2)
    key = torch.randn(5, 2, 64).bfloat16()
    slots = torch.arange(5, dtype=torch.int32)
    with pytest.raises(kvplug.InvalidArgumentError, match="needs k_scale and v_scale"):
        attn.kv_write(key, key.clone(), k8, v8, slots)
    with pytest.raises(kvplug.InvalidArgumentError, match="k_scale has shape"):
        attn.kv_write(key, key.clone(), k8, v8, slots, k_scale=ks[:4], v_scale=vs)
    with pytest.raises(kvplug.InvalidArgumentError, match="both be per token"):
        attn.kv_write(key, key.clone(), k8, v8, slots, k_scale=ks, v_scale=torch.ones(1))
    with pytest.raises(kvplug.InvalidArgumentError, match="k_scale has dtype"):
        attn.kv_write(key, key.clone(), k8, v8, slots, k_scale=ks.double(), v_scale=vs)
    with pytest.raises(kvplug.InvalidArgumentError, match="float16 or bfloat16"):
        attn.kv_write(key.float(), key.float(), k8, v8, slots, k_scale=ks, v_scale=vs)
    k16, v16 = caches()
    with pytest.raises(kvplug.InvalidArgumentError, match="belong to an e4m3 cache"):
        attn.kv_write(key.half(), key.half(), k16, v16, slots, k_scale=ks, v_scale=vs)
    assert writes == []  # nothing reached the library


# -- attention sinks: the address packed per call, the tensor checked first --------


BAD_SINKS = [
    (lambda qh: torch.zeros(qh, dtype=torch.float64), "float32"),
    (lambda qh: torch.zeros(qh, dtype=torch.float16), "float32"),
    (lambda qh: torch.zeros(qh - 1), "one per q head"),
    (lambda qh: torch.zeros(qh + 1), "one per q head"),
    (lambda qh: torch.zeros(qh, 1), "dimensions"),
    (lambda qh: torch.zeros(2 * qh)[::2], "contiguous"),
    (lambda qh: [0.0] * qh, "torch tensor"),
]


def test_paged_decode_packs_sinks(cpu_kernels, monkeypatch):
    rec = record(monkeypatch, "kvp_paged_decode", _capi.PagedDecodeArgs)
    q, k, v, table, lens = decode_inputs()
    attn.paged_decode(q, k, v, table, lens)
    assert rec.calls[-1][0].sinks == 0
    for layer in range(2):  # a new tensor each layer: this call's address, not the packed one's
        sinks = torch.randn(4)
        attn.paged_decode(q, k, v, table, lens, sinks=sinks)
        assert rec.calls[-1][0].sinks == sinks.data_ptr()
    attn.paged_decode(q, k, v, table, lens, sinks=None)  # the layouts of the first call again
    assert rec.calls[-1][0].sinks == 0
    n = len(rec.calls)
    for make, msg in BAD_SINKS:
        with pytest.raises(kvplug.InvalidArgumentError, match=msg):
            attn.paged_decode(q, k, v, table, lens, sinks=make(4))
    assert len(rec.calls) == n, "a refused call reached the library"


@pytest.mark.parametrize("cls,run,name", [(attn.PrefillPlan, attn.paged_prefill, "kvp_paged_prefill"),
                                          (cascade.CascadePlan, cascade.paged_cascade, "kvp_paged_cascade")])
def test_planned_layers_pack_sinks(cpu_kernels, monkeypatch, cls, run, name):
    rec, plan, q, k, v, table = planned_layer(monkeypatch, cls, run, name)
    assert rec.calls[-1][1].sinks == 0
    sinks = torch.randn(4)
    run(plan, q, k, v, table, sinks=sinks)
    assert rec.calls[-1][1].sinks == sinks.data_ptr()
    n = len(rec.calls)
    for make, msg in BAD_SINKS:
        with pytest.raises(kvplug.InvalidArgumentError, match=msg):
            run(plan, q, k, v, table, sinks=make(4))
    assert len(rec.calls) == n, "a refused call reached the library"


def test_fields_appended_in_0_6_are_last():
    """Appended in 0.6: sinks after kv at the end of both structs, and
    window_size (with its reserved word) after it in the decode args, so
    that an older struct_size (through kv) leaves them at their default 0."""
    for t in (_capi.PagedDecodeArgs, _capi.PagedPrefillArgs):
        assert t.sinks.offset == t.kv.offset + 8
    p = _capi.PagedPrefillArgs
    assert p._fields_[-1][0] == "sinks" and ctypes.sizeof(p) == p.sinks.offset + 8
    d = _capi.PagedDecodeArgs
    assert [f[0] for f in d._fields_[-4:]] == ["kv", "sinks", "window_size", "reserved"]
    assert d.window_size.offset == d.sinks.offset + 8 and ctypes.sizeof(d) == d.window_size.offset + 8