"""GPU tests of the kernels in kernels/fatbin/kvplug.fatbin, launched directly.

Every kernel is launched the way the library launches it: its params struct
packed byte for byte (kernels/kvplug_kernels.h) and passed by value through
cuLaunchKernel. Results are compared with a float64 NumPy reference on fresh
random inputs; outputs (and the padding around them) are poisoned with NaN
first and checked fully written and not overrun.

Run on a GPU machine:  python3 -m pytest -q tests/gpu/test_kernels_cupy.py
The fatbin is found at $KVPLUG_FATBIN, kernels/fatbin/kvplug.fatbin or
.device/kern/kvplug.fatbin. Skips when CuPy, a GPU or the fatbin is absent.
"""

import ctypes
import math
import os
import pathlib
import sys

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))
from kernel_abi import DECODE, KV_WRITE, MERGE, cdiv, decode_smem  # noqa: E402  (the header's mirror)


def _fatbin_path():
    for p in (os.environ.get("KVPLUG_FATBIN"), ROOT / "kernels" / "fatbin" / "kvplug.fatbin",
              ROOT / ".device" / "kern" / "kvplug.fatbin"):
        if p and pathlib.Path(p).is_file():
            return str(p)
    return None


def _gpu_ok():
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


if not _gpu_ok():
    pytest.skip("no CUDA GPU", allow_module_level=True)
if _fatbin_path() is None:
    pytest.skip("kvplug.fatbin not built", allow_module_level=True)

# ---------------------------------------------------------------------------
# Launch plumbing: the driver API through ctypes, like the library's Go side.

_cuda = ctypes.CDLL("libcuda.so.1")
_cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
    ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
_cuda.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

_cuda.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
_cuda.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]

_module = None
_image = None
_funcs = {}


def _func(name):
    """CUfunction handle (int) of a kernel: through cupy.RawModule, or the driver if
    this CuPy does not expose the handle."""
    global _module, _image
    f = _funcs.get(name)
    if f is not None:
        return f
    if _module is None:
        cp.cuda.Device().use()
        _module = cp.RawModule(path=_fatbin_path())
    k = _module.get_function(name)
    ptr = getattr(getattr(k, "kernel", None), "ptr", None)
    if ptr is None:
        if _image is None:
            _image = [ctypes.create_string_buffer(pathlib.Path(_fatbin_path()).read_bytes()), ctypes.c_void_p()]
            rc = _cuda.cuModuleLoadData(ctypes.byref(_image[1]), ctypes.cast(_image[0], ctypes.c_void_p))
            assert rc == 0, f"cuModuleLoadData = {rc}"
        h = ctypes.c_void_p()
        rc = _cuda.cuModuleGetFunction(ctypes.byref(h), _image[1], name.encode())
        assert rc == 0, f"cuModuleGetFunction({name}) = {rc}"
        ptr = h.value
    _funcs[name] = ptr
    return ptr


def launch(name, grid, block, params, smem=0):
    f = _func(name)
    if smem > 48 * 1024:
        rc = _cuda.cuFuncSetAttribute(ctypes.c_void_p(f), CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        assert rc == 0, f"cuFuncSetAttribute({name}) = {rc}"
    buf = ctypes.create_string_buffer(params.tobytes(), len(params.tobytes()))
    args = (ctypes.c_void_p * 1)(ctypes.cast(buf, ctypes.c_void_p))
    stream = cp.cuda.get_current_stream().ptr
    rc = _cuda.cuLaunchKernel(ctypes.c_void_p(f), grid[0], grid[1], grid[2], block[0], block[1], block[2],
                              smem, ctypes.c_void_p(stream), args, None)
    assert rc == 0, f"cuLaunchKernel({name}) = {rc}"
    cp.cuda.get_current_stream().synchronize()  # raises on a kernel fault


def pack(dtype, **kw):
    p = np.zeros((), dtype=dtype)
    for k, v in kw.items():
        p[k] = v
    return p


# ---------------------------------------------------------------------------
# Dtypes. CuPy has no bfloat16: bf16 tensors are uint16 on the device and
# converted here with round-to-nearest-even.

DTYPES = ("f32", "f16", "bf16")
STORAGE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
# ||out - ref|| / ||ref|| bounds (METHOD.md: fp32 far under 1e-3, bf16 1e-3..1e-2).
TOL = {"f32": 2e-5, "f16": 2e-3, "bf16": 1e-2}
NAN_BITS = {"f16": np.uint16(0x7E00), "bf16": np.uint16(0x7FC0)}


def f32_to_bf16_bits(x):
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return r.astype(np.uint16)


def bf16_bits_to_f32(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def to_storage(x, dt):
    """float array -> (host storage array, exact float64 values it holds)."""
    if dt == "bf16":
        s = f32_to_bf16_bits(x)
        return s, bf16_bits_to_f32(s).astype(np.float64)
    s = x.astype(STORAGE[dt])
    return s, s.astype(np.float64)


def from_storage(s, dt):
    if dt == "bf16":
        return bf16_bits_to_f32(s).astype(np.float64)
    return s.astype(np.float64)


def rand(rng, shape, dt, scale=1.0):
    return to_storage(rng.standard_normal(shape).astype(np.float32) * scale, dt)


def poisoned(shape, dt):
    """Device array of the dtype's storage type, every element NaN."""
    if dt == "f32":
        return cp.full(shape, np.nan, dtype=np.float32)
    return cp.full(shape, NAN_BITS[dt], dtype=np.uint16).view(STORAGE[dt])


def still_poisoned(host, dt):
    if dt == "f32":
        return np.isnan(host).all()
    return (np.ascontiguousarray(host).view(np.uint16) == NAN_BITS[dt]).all()


def rel_err(got, ref):
    den = np.linalg.norm(ref)
    return np.linalg.norm(got - ref) / (den if den > 0 else 1.0)


# ---------------------------------------------------------------------------
# KV write


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("bs", (1, 16, 64, 256))
def test_kv_write(dt, d, bs):
    rng = np.random.default_rng()
    h, ntok = 3, 45
    num_blocks = cdiv(ntok * 2, bs) + 2
    # K and V slices of a fused [tokens, 3, h, d] buffer: token stride 3*h*d.
    qkv, qkv64 = rand(rng, (ntok, 3, h, d), dt)
    slots = rng.choice(num_blocks * bs, size=ntok, replace=False).astype(np.int32)
    slots[rng.choice(ntok, size=5, replace=False)] = -1  # padding tokens
    slots[0] = num_blocks * bs + 7                        # out of range: skipped
    # One combined cache tensor [num_blocks, 2, bs, h, d]: K and V share strides.
    init, _ = rand(rng, (num_blocks, 2, bs, h, d), dt)
    cache = cp.asarray(init)
    dq = cp.asarray(qkv)
    slot_d = cp.asarray(slots)
    es = np.dtype(STORAGE[dt]).itemsize
    p = pack(KV_WRITE, key=dq.data.ptr + 1 * h * d * es, value=dq.data.ptr + 2 * h * d * es,
             k_cache=cache.data.ptr, v_cache=cache.data.ptr + bs * h * d * es, slot_mapping=slot_d.data.ptr,
             key_token_stride=3 * h * d, key_head_stride=d, value_token_stride=3 * h * d, value_head_stride=d,
             cache_block_stride=2 * bs * h * d, cache_token_stride=h * d, cache_head_stride=d,
             num_tokens=ntok, num_kv_heads=h, block_size=bs, num_blocks=num_blocks)
    vec = 16 // es
    launch(f"kvp_kv_write_{dt}_h{d}", (cdiv(ntok * h * d // vec, 256), 1, 1), (256, 1, 1), p)
    got = cp.asnumpy(cache)
    want = init.copy()
    for t, s in enumerate(slots):
        if 0 <= s < num_blocks * bs:
            want[s // bs, 0, s % bs] = qkv[t, 1]
            want[s // bs, 1, s % bs] = qkv[t, 2]
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


# ---------------------------------------------------------------------------
# Paged decode


class DecodeCase:
    """Random paged batch + float64 reference."""

    def __init__(self, rng, dt, d, bs, group, lens, kv_heads=2, bad_table=False, combined=True, q_scale=1.0):
        self.dt, self.d, self.bs, self.group = dt, d, bs, group
        self.hk, self.hq = kv_heads, kv_heads * group
        self.lens = np.asarray(lens, dtype=np.int32)
        self.b = len(lens)
        self.scale = 1.0 / math.sqrt(d)
        need = [cdiv(int(n), bs) for n in lens]
        self.max_blocks = max(need + [1]) + 2  # extra columns hold junk
        self.num_blocks = sum(need) + 5
        perm = rng.permutation(self.num_blocks).astype(np.int32)
        table = rng.integers(-(2 ** 31), 2 ** 31 - 1, size=(self.b, self.max_blocks + 3), dtype=np.int64)
        table = table.astype(np.int32)  # junk beyond each row's blocks and past max_blocks
        k = 0
        for i, n in enumerate(need):
            table[i, :n] = perm[k:k + n]
            k += n
        self.ignored = np.zeros((self.b, max(lens + [1])), dtype=bool)
        if bad_table:
            # Out-of-range ids and a short max_blocks: those tokens are ignored.
            for i, n in enumerate(need):
                if n >= 2:
                    table[i, 1] = self.num_blocks + 3 if i % 2 else -5
                    self.ignored[i, bs:2 * bs] = True
            self.max_blocks = max(1, max(need) - 1)
            for i, n in enumerate(need):
                self.ignored[i, self.max_blocks * bs:] = True
        self.table = table
        # q: a slice of a fused buffer (batch stride > hq*d).
        qbuf, self.q64 = rand(rng, (self.b, self.hq + 2, d), dt, scale=q_scale)
        self.q_host = qbuf
        # Caches: one tensor [num_blocks, 2, bs, hk, d] (combined) or two.
        cache, cache64 = rand(rng, (self.num_blocks, 2, bs, self.hk, d), dt, scale=1.0)
        self.cache_host, self.cache64 = cache, cache64
        self.combined = combined

    def reference(self):
        out = np.zeros((self.b, self.hq, self.d))
        lse = np.full((self.b, self.hq), -np.inf)
        for i in range(self.b):
            n = int(self.lens[i])
            toks = [t for t in range(n) if not self.ignored[i, t]]
            if not toks:
                continue
            blk = np.array([self.table[i, t // self.bs] for t in toks])
            off = np.array([t % self.bs for t in toks])
            k = self.cache64[blk, 0, off]  # [n, hk, d]
            v = self.cache64[blk, 1, off]
            for hq in range(self.hq):
                hk = hq // self.group
                s = k[:, hk, :] @ self.q64[i, hq] * self.scale
                m = s.max()
                p = np.exp(s - m)
                out[i, hq] = (p @ v[:, hk, :]) / p.sum()
                lse[i, hq] = m + np.log(p.sum())
        return out, lse

    def run(self, splits, want_lse=True):
        dt, d = self.dt, self.d
        es = np.dtype(STORAGE[dt]).itemsize
        q = cp.asarray(self.q_host)
        if self.combined:
            cache = cp.asarray(self.cache_host)
            kp, vp = cache.data.ptr, cache.data.ptr + self.bs * self.hk * d * es
            strides = (2 * self.bs * self.hk * d, self.hk * d, d)
            keep = (cache,)
        else:
            kc = cp.asarray(np.ascontiguousarray(self.cache_host[:, 0]))
            vc = cp.asarray(np.ascontiguousarray(self.cache_host[:, 1]))
            kp, vp = kc.data.ptr, vc.data.ptr
            strides = (self.bs * self.hk * d, self.hk * d, d)
            keep = (kc, vc)
        table = cp.asarray(self.table)
        lens = cp.asarray(self.lens)
        # Output with padded rows: [b, hq, d + 8], padding must stay NaN.
        out = poisoned((self.b, self.hq, d + 8), dt)
        lse = cp.full((self.b, self.hq), np.nan, dtype=np.float32) if want_lse else None
        ws = None
        grid = (self.hk * cdiv(self.group, 16), self.b, splits)
        nfloat = splits * self.b * self.hq * (d + 1)
        if splits > 1:
            ws = cp.full(nfloat, np.nan, dtype=np.float32)
        p = pack(DECODE, q=q.data.ptr, k_cache=kp, v_cache=vp, block_table=table.data.ptr,
                 seq_lens=lens.data.ptr, out=out.data.ptr, lse=lse.data.ptr if want_lse else 0,
                 workspace=ws.data.ptr if ws is not None else 0,
                 q_batch_stride=(self.hq + 2) * d, q_head_stride=d,
                 out_batch_stride=self.hq * (d + 8), out_head_stride=d + 8,
                 cache_block_stride=strides[0], cache_token_stride=strides[1], cache_head_stride=strides[2],
                 block_table_stride=self.table.shape[1], batch=self.b, num_q_heads=self.hq,
                 num_kv_heads=self.hk, block_size=self.bs, num_blocks=self.num_blocks,
                 max_blocks_per_seq=self.max_blocks, num_splits=splits, scale=self.scale)
        launch(f"kvp_paged_decode_{dt}_h{d}", grid, (128, 1, 1), p, decode_smem(4 if dt == "f32" else 2, d))
        if splits > 1:
            launch(f"kvp_paged_decode_combine_{dt}_h{d}", (cdiv(self.b * self.hq, 4), 1, 1), (128, 1, 1), p)
        del keep
        o = cp.asnumpy(out)
        return o, (cp.asnumpy(lse) if want_lse else None)

    def check(self, splits, want_lse=True):
        ref_o, ref_l = self.reference()
        o, lse = self.run(splits, want_lse)
        assert still_poisoned(o[:, :, self.d:], self.dt), "output row padding was written"
        got = from_storage(np.ascontiguousarray(o[:, :, :self.d]), self.dt)
        assert not np.isnan(got).any(), "output not fully written"
        err = rel_err(got, ref_o)
        assert err < TOL[self.dt], f"rel err {err:.3g}"
        # Per (sequence, head) too, so a wrong small row cannot hide in the norm.
        for i in range(self.b):
            for h in range(self.hq):
                e = rel_err(got[i, h], ref_o[i, h])
                assert e < 4 * TOL[self.dt], f"seq {i} head {h}: rel err {e:.3g}"
        if want_lse:
            assert not np.isnan(lse).any(), "lse not fully written"
            fin = np.isfinite(ref_l)
            assert np.array_equal(np.isneginf(lse), ~fin), "lse -inf exactly where the sequence is empty"
            assert np.allclose(lse[fin], ref_l[fin], rtol=1e-5, atol=2e-4 if self.dt != "f32" else 2e-5)


LENS = [0, 1, 17, 64, 130, 301]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("bs", (1, 16, 64, 256))
@pytest.mark.parametrize("group", (1, 4, 8))
def test_decode(dt, d, bs, group):
    rng = np.random.default_rng()
    case = DecodeCase(rng, dt, d, bs, group, LENS, combined=(bs != 16))
    case.check(splits=1, want_lse=(group != 4))
    case.check(splits=3, want_lse=True)
    case.check(splits=7, want_lse=(group != 1))  # many empty splits for short sequences


@pytest.mark.parametrize("dt", ("f16", "bf16", "f32"))
@pytest.mark.parametrize("group", (3, 20, 32))
def test_decode_odd_groups(dt, group):
    """Groups that are not powers of two or exceed one block's 16 q heads."""
    rng = np.random.default_rng()
    case = DecodeCase(rng, dt, 128, 16, group, [5, 200, 0, 77], kv_heads=2)
    case.check(splits=1)
    case.check(splits=4)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("bs", (1, 16, 48))
def test_decode_bad_table_is_ignored(dt, bs):
    """Out-of-range block ids and columns past max_blocks_per_seq: skipped, no fault."""
    rng = np.random.default_rng()
    case = DecodeCase(rng, dt, 64, bs, 4, [3 * bs + 5, 2 * bs + 1, bs, 0], bad_table=True)
    case.check(splits=1)
    case.check(splits=2)


@pytest.mark.parametrize("dt", ("bf16", "f16"))
def test_decode_long(dt):
    """Several pipeline rounds per block and large logits."""
    rng = np.random.default_rng()
    case = DecodeCase(rng, dt, 128, 16, 4, [4000, 2500, 1], kv_heads=2, q_scale=6.0)
    case.check(splits=1)
    case.check(splits=5)
    case.check(splits=40)  # more than 32 splits: two merge rounds


# ---------------------------------------------------------------------------
# Merge of attention states


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("n", (1, 2, 3, 8))
def test_merge_states(dt, d, n):
    rng = np.random.default_rng()
    ntok, nh = 9, 5
    vs, v64s, ss = [], [], []
    for i in range(n):
        v, v64 = rand(rng, (ntok, nh, d), dt)
        s = (rng.standard_normal((ntok, nh)) * 4).astype(np.float32)
        s[rng.random((ntok, nh)) < 0.2] = -np.inf  # empty partial states
        vs.append(v)
        v64s.append(v64)
        ss.append(s)
    ss[0][0, :] = -np.inf
    for s in ss:
        s[1, 2] = -np.inf  # a row empty in every state
    dv = [cp.asarray(v) for v in vs]
    ds = [cp.asarray(s) for s in ss]
    out = poisoned((ntok, nh, d + 8), dt)
    out_lse = cp.full((ntok, nh + 1), np.nan, dtype=np.float32)
    kw = {f"v{i}": dv[i].data.ptr for i in range(n)}
    kw.update({f"s{i}": ds[i].data.ptr for i in range(n)})
    p = pack(MERGE, out=out.data.ptr, out_lse=out_lse.data.ptr, v_token_stride=nh * d, v_head_stride=d,
             s_token_stride=nh, s_head_stride=1, out_token_stride=nh * (d + 8), out_head_stride=d + 8,
             out_lse_token_stride=nh + 1, out_lse_head_stride=1, num_states=n, num_tokens=ntok, num_heads=nh,
             **kw)
    launch(f"kvp_merge_states_{dt}_h{d}", (cdiv(ntok * nh, 4), 1, 1), (128, 1, 1), p)
    S = np.stack([s.astype(np.float64) for s in ss])  # [n, t, h]
    V = np.stack(v64s)
    M = S.max(axis=0)
    with np.errstate(invalid="ignore"):
        W = np.where(np.isfinite(S), np.exp(S - np.where(np.isfinite(M), M, 0)), 0.0)
    L = W.sum(axis=0)
    ref = np.where(L[..., None] > 0, (W[..., None] * V).sum(axis=0) / np.maximum(L, 1e-300)[..., None], 0.0)
    with np.errstate(divide="ignore"):
        ref_lse = np.where(L > 0, np.where(np.isfinite(M), M, 0) + np.log(L), -np.inf)
    o = cp.asnumpy(out)
    got = from_storage(np.ascontiguousarray(o[:, :, :d]), dt)
    assert not np.isnan(got).any()
    assert rel_err(got, ref) < TOL[dt]
    assert still_poisoned(o[:, :, d:], dt), "output row padding was written"
    gl = cp.asnumpy(out_lse)
    assert np.isnan(gl[:, nh]).all()
    gl = gl[:, :nh]
    assert np.array_equal(np.isneginf(gl), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.allclose(gl[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[~fin], np.zeros_like(got[~fin]))


@pytest.mark.parametrize("dt", ("bf16", "f32"))
def test_merge_states_in_place(dt):
    """out aliases v[0] and out_lse aliases s[0] (same strides)."""
    rng = np.random.default_rng()
    ntok, nh, d = 7, 4, 128
    a, a64 = rand(rng, (ntok, nh, d), dt)
    b, b64 = rand(rng, (ntok, nh, d), dt)
    sa = rng.standard_normal((ntok, nh)).astype(np.float32)
    sb = rng.standard_normal((ntok, nh)).astype(np.float32)
    da, db, dsa, dsb = cp.asarray(a), cp.asarray(b), cp.asarray(sa), cp.asarray(sb)
    p = pack(MERGE, v0=da.data.ptr, v1=db.data.ptr, s0=dsa.data.ptr, s1=dsb.data.ptr, out=da.data.ptr,
             out_lse=dsa.data.ptr, v_token_stride=nh * d, v_head_stride=d, s_token_stride=nh, s_head_stride=1,
             out_token_stride=nh * d, out_head_stride=d, out_lse_token_stride=nh, out_lse_head_stride=1,
             num_states=2, num_tokens=ntok, num_heads=nh)
    launch(f"kvp_merge_states_{dt}_h{d}", (cdiv(ntok * nh, 4), 1, 1), (128, 1, 1), p)
    m = np.maximum(sa, sb).astype(np.float64)
    wa, wb = np.exp(sa - m), np.exp(sb - m)
    ref = (wa[..., None] * a64 + wb[..., None] * b64) / (wa + wb)[..., None]
    assert rel_err(from_storage(cp.asnumpy(da), dt), ref) < TOL[dt]
    assert np.allclose(cp.asnumpy(dsa), m + np.log(wa + wb), rtol=1e-5, atol=1e-5)
