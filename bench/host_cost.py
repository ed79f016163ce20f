"""Host cost per call of kvplug's attention calls, beside FlashInfer's and the
bare C calls, in one process (the issue 22 table).

GPU work is tiny (a decode of B=1 sequence of 512 tokens, 32 q / 8 kv heads,
head_dim 128, fp16, block size 16; the prefill case: 16 new tokens at the end
of those 512), so each call costs the host more than the GPU: a loop of
--calls calls with no synchronisation inside, timed on the host, divided by
the calls; the median of --rounds loops is reported (the GPU is synchronised
between loops, outside the timing).

Rows (kvplug; FlashInfer when `import flashinfer` works; the bare C call
through ctypes with its argument struct packed once, the floor of any
binding):
  paged_decode               BatchDecodeWithPagedKVCacheWrapper.run
  paged_prefill              BatchPrefillWithPagedKVCacheWrapper.run
  prefill_plan (host arrays) BatchPrefillWithPagedKVCacheWrapper.plan (CPU indptr arrays)
  kv_write
  cascade.plan, B = 32, 64, 128 sequences sharing a 2048-token prefix, 256
      tokens each after it, host table given (against the bare kvp_cascade_plan)
  kvplug.ops.* (the torch operators) where they import.
Targets (issue 22): per-layer calls at most 0.5x FlashInfer's run(), kv_write
at most 8 us, plans at most 1.3x the bare C call.

--cpu measures, on a machine without a GPU, kvplug's host work up to the C
boundary: CPU tensors pass for device tensors, the stream and device queries
answer at once, and each C function is a no-op of the same signature
compiled here (cc); it runs against the package on PYTHONPATH, the current
one or an older one (its internals are patched to the same effect), for a
before/after comparison.

    python3 bench/host_cost.py [--calls 3000] [--rounds 5] [--no-flashinfer]
    PYTHONPATH=bindings/python python3 bench/host_cost.py --cpu
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HQ, HK, D, BS = 32, 8, 128, 16
KV_LEN, Q_LEN = 512, 16
CASCADE_B = (32, 64, 128)
CASCADE_SHARED, CASCADE_TAIL = 2048, 256


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--calls", type=int, default=3000, help="calls per timed loop (default 3000)")
    ap.add_argument("--rounds", type=int, default=5, help="timed loops per row; the median is reported (default 5)")
    ap.add_argument("--no-flashinfer", action="store_true", help="kvplug's rows only, even where flashinfer imports")
    ap.add_argument("--no-ops", action="store_true", help="leave out the kvplug.ops rows")
    ap.add_argument("--cpu", action="store_true", help="no GPU: kvplug's host work up to the C boundary (see above)")
    return ap.parse_args(argv)


def per_call_us(fn: Callable[[], Any], calls: int, rounds: int, sync: Callable[[], Any] = lambda: None) -> float:
    """Host microseconds per call: median over rounds of a loop of calls (no sync inside)."""
    for _ in range(min(calls, 100)):
        fn()
    sync()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        ts.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(ts)


def table(rows: List[Tuple[str, Optional[float], Optional[float], str]], heads: Tuple[str, str, str]) -> str:
    out = [f"| call | {heads[0]} | {heads[1]} | {heads[2]} |", "| --- | --- | --- | --- |"]
    for name, a, b, note in rows:
        out.append(f"| {name} | {'-' if a is None else f'{a:.1f}'} | {'-' if b is None else f'{b:.1f}'} | {note} |")
    return "\n".join(out)


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return "" if a is None or b is None or not b else f"{a / b:.2f}x"


# --------------------------------------------------------------------------
# The device machine: kvplug beside FlashInfer and the bare C calls
# --------------------------------------------------------------------------


class Setup:
    """The tensors of the tiny step, on the GPU."""

    def __init__(self, torch: Any) -> None:
        dev, f16, i32 = "cuda", torch.float16, torch.int32
        g = torch.Generator(device=dev).manual_seed(0)
        nb = KV_LEN // BS
        self.num_blocks = 2 * nb
        shape = (self.num_blocks, BS, HK, D)
        self.k_cache = torch.randn(shape, dtype=f16, device=dev, generator=g)
        self.v_cache = torch.randn(shape, dtype=f16, device=dev, generator=g)
        self.pages = torch.randperm(self.num_blocks, device=dev, generator=g)[:nb].to(i32)
        self.table = self.pages.view(1, nb).contiguous()
        self.seq_lens = torch.tensor([KV_LEN], dtype=i32, device=dev)
        self.q1 = torch.randn((1, HQ, D), dtype=f16, device=dev, generator=g)
        self.out1 = torch.empty_like(self.q1)
        self.qp = torch.randn((Q_LEN, HQ, D), dtype=f16, device=dev, generator=g)
        self.outp = torch.empty_like(self.qp)
        self.key = torch.randn((1, HK, D), dtype=f16, device=dev, generator=g)
        self.value = torch.randn((1, HK, D), dtype=f16, device=dev, generator=g)
        self.slots = torch.tensor([int(self.pages[-1]) * BS + BS - 1], dtype=i32, device=dev)
        self.qo_host, self.kv_host = [0, Q_LEN], [KV_LEN]
        self.qo = torch.tensor(self.qo_host, dtype=i32, device=dev)
        self.kvl = torch.tensor(self.kv_host, dtype=i32, device=dev)
        # FlashInfer's page lists: host copies for its plan, device ones too.
        self.kv_indptr_h = torch.tensor([0, nb], dtype=i32)
        self.kv_indices = self.pages.clone()
        self.last_page_h = torch.tensor([KV_LEN - (nb - 1) * BS], dtype=i32)
        self.qo_h = torch.tensor(self.qo_host, dtype=i32)


def kvplug_rows(torch: Any, s: Setup, calls: int, rounds: int, with_ops: bool) -> Dict[str, float]:
    from kvplug import attn

    sync = torch.cuda.synchronize
    r: Dict[str, float] = {}
    ws_dec = torch.empty(attn.workspace_size(1, HQ, D), dtype=torch.uint8, device="cuda")
    ws_pre = torch.empty(attn.prefill_workspace_size(1, Q_LEN, HQ, HK, D), dtype=torch.uint8, device="cuda")
    attn.prepare()
    r["paged_decode"] = per_call_us(lambda: attn.paged_decode(s.q1, s.k_cache, s.v_cache, s.table, s.seq_lens, out=s.out1,
                                                              workspace=ws_dec), calls, rounds, sync)
    r["paged_decode, out allocated"] = per_call_us(
        lambda: attn.paged_decode(s.q1, s.k_cache, s.v_cache, s.table, s.seq_lens, workspace=ws_dec), calls, rounds, sync)

    def plan() -> Any:
        return attn.prefill_plan(s.qo, s.kvl, HQ, HK, D, torch.float16, ws_pre, qo_indptr_host=s.qo_host,
                                 kv_lens_host=s.kv_host)

    p = plan()
    r["paged_prefill"] = per_call_us(lambda: attn.paged_prefill(p, s.qp, s.k_cache, s.v_cache, s.table, out=s.outp),
                                     calls, rounds, sync)
    r["prefill_plan"] = per_call_us(plan, calls, rounds, sync)
    r["kv_write"] = per_call_us(lambda: attn.kv_write(s.key, s.value, s.k_cache, s.v_cache, s.slots), calls, rounds, sync)
    if with_ops:
        try:
            import kvplug.ops as ops
        except Exception as e:  # an older package, or a torch without torch.library
            print(f"kvplug.ops: not measured ({type(e).__name__}: {e})", file=sys.stderr)
        else:
            r["ops.paged_decode"] = per_call_us(lambda: ops.paged_decode(s.q1, s.k_cache, s.v_cache, s.table, s.seq_lens,
                                                                          ws_dec), calls, rounds, sync)
            pt = p.as_tensor()
            r["ops.paged_prefill"] = per_call_us(lambda: ops.paged_prefill(pt, s.qp, s.k_cache, s.v_cache, s.table),
                                                 calls, rounds, sync)
            r["ops.kv_write"] = per_call_us(lambda: ops.kv_write(s.key, s.value, s.k_cache, s.v_cache, s.slots),
                                            calls, rounds, sync)
    return r


def bare_rows(torch: Any, s: Setup, calls: int, rounds: int) -> Dict[str, float]:
    """The C calls through ctypes with their structs packed once."""
    from kvplug import _lib, attn

    vp, u64 = ctypes.c_void_p, ctypes.c_uint64
    two = lambda name: _lib.fn(name, ctypes.c_int, [vp, u64])  # noqa: E731
    three = lambda name: _lib.fn(name, ctypes.c_int, [vp, vp, u64])  # noqa: E731
    stream = torch.cuda.current_stream().cuda_stream
    sync = torch.cuda.synchronize
    r: Dict[str, float] = {}
    ks = s.k_cache.stride()
    ws_dec = torch.empty(attn.workspace_size(1, HQ, D), dtype=torch.uint8, device="cuda")
    dec = attn._PagedDecodeArgs(ctypes.sizeof(attn._PagedDecodeArgs), attn.DTYPE_F16, D, 1, HQ, HK, s.num_blocks, BS,
                                s.table.shape[1], s.q1.data_ptr(), s.q1.stride(0), s.q1.stride(1), s.k_cache.data_ptr(),
                                s.v_cache.data_ptr(), ks[0], ks[1], ks[2], s.table.data_ptr(), s.table.shape[1],
                                s.seq_lens.data_ptr(), s.out1.data_ptr(), s.out1.stride(0), s.out1.stride(1), 0,
                                ws_dec.data_ptr(), ws_dec.numel(), 0.0, 0, 0, 0)
    f, a = two("kvp_paged_decode"), ctypes.addressof(dec)
    r["paged_decode"] = per_call_us(lambda: f(a, stream), calls, rounds, sync)
    ws_pre = torch.empty(attn.prefill_workspace_size(1, Q_LEN, HQ, HK, D), dtype=torch.uint8, device="cuda")
    qo_h = (ctypes.c_int32 * 2)(*s.qo_host)
    kv_h = (ctypes.c_int32 * 1)(*s.kv_host)
    pa = attn._PrefillPlanArgs(ctypes.sizeof(attn._PrefillPlanArgs), attn.DTYPE_F16, D, HQ, HK, 1, 0, 0, 0, qo_h, kv_h,
                               s.qo.data_ptr(), s.kvl.data_ptr(), ws_pre.data_ptr(), ws_pre.numel())
    plan = attn._AttnPlan()
    plan.struct_size = ctypes.sizeof(plan)
    f, a, b = three("kvp_prefill_plan"), ctypes.addressof(pa), ctypes.addressof(plan)
    r["prefill_plan"] = per_call_us(lambda: f(a, b, stream), calls, rounds, sync)
    pre = attn._PagedPrefillArgs(ctypes.sizeof(attn._PagedPrefillArgs), s.num_blocks, BS, s.table.shape[1], 0,
                                 s.qp.data_ptr(), s.qp.stride(0), s.qp.stride(1), s.k_cache.data_ptr(), s.v_cache.data_ptr(),
                                 ks[0], ks[1], ks[2], s.table.data_ptr(), s.table.shape[1], s.outp.data_ptr(),
                                 s.outp.stride(0), s.outp.stride(1), 0, 0.0, 0)
    f, a = three("kvp_paged_prefill"), ctypes.addressof(pre)
    r["paged_prefill"] = per_call_us(lambda: f(b, a, stream), calls, rounds, sync)
    kw = attn._KVWriteArgs(ctypes.sizeof(attn._KVWriteArgs), attn.DTYPE_F16, D, 1, HK, s.num_blocks, BS,
                           s.key.data_ptr(), s.key.stride(0), s.key.stride(1), s.value.data_ptr(), s.value.stride(0),
                           s.value.stride(1), s.k_cache.data_ptr(), s.v_cache.data_ptr(), ks[0], ks[1], ks[2],
                           s.slots.data_ptr())
    f, a = two("kvp_kv_write"), ctypes.addressof(kw)
    r["kv_write"] = per_call_us(lambda: f(a, stream), calls, rounds, sync)
    return r


def flashinfer_rows(torch: Any, fi: Any, s: Setup, calls: int, rounds: int) -> Dict[str, float]:
    sync = torch.cuda.synchronize
    r: Dict[str, float] = {}
    dev = torch.device("cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    dw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    dw.plan(s.kv_indptr_h.to(dev), s.kv_indices, s.last_page_h.to(dev), HQ, HK, D, BS, q_data_type=torch.float16,
            kv_data_type=torch.float16)
    try:
        dw.run(s.q1, (s.k_cache, s.v_cache), out=s.out1)
        r["paged_decode"] = per_call_us(lambda: dw.run(s.q1, (s.k_cache, s.v_cache), out=s.out1), calls, rounds, sync)
    except TypeError:  # a FlashInfer whose run() takes no out
        pass
    r["paged_decode, out allocated"] = per_call_us(lambda: dw.run(s.q1, (s.k_cache, s.v_cache)), calls, rounds, sync)
    ws2 = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    pw = fi.BatchPrefillWithPagedKVCacheWrapper(ws2, "NHD")

    def plan() -> None:
        pw.plan(s.qo_h, s.kv_indptr_h, s.kv_indices, s.last_page_h, HQ, HK, D, BS, causal=True,
                q_data_type=torch.float16, kv_data_type=torch.float16)

    plan()
    r["paged_prefill"] = per_call_us(lambda: pw.run(s.qp, (s.k_cache, s.v_cache), out=s.outp), calls, rounds, sync)
    r["prefill_plan"] = per_call_us(plan, max(calls // 10, 10), rounds, sync)
    return r


def cascade_case(torch: Any, B: int) -> Tuple[Any, List[int], Any]:
    """B sequences sharing CASCADE_SHARED tokens, CASCADE_TAIL each after them:
    the host table, the host lengths and the device lengths."""
    shared, own = CASCADE_SHARED // BS, -(-CASCADE_TAIL // BS)
    table = torch.empty((B, shared + own), dtype=torch.int32)
    table[:, :shared] = torch.arange(shared, dtype=torch.int32)
    table[:, shared:] = shared + torch.arange(B * own, dtype=torch.int32).view(B, own)
    lens = [CASCADE_SHARED + CASCADE_TAIL] * B
    return table, lens, torch.tensor(lens, dtype=torch.int32, device="cuda")


def cascade_rows(torch: Any, calls: int, rounds: int) -> List[Tuple[str, Optional[float], Optional[float], str]]:
    from kvplug import _lib, cascade

    sync = torch.cuda.synchronize
    ws = cascade.Workspaces(max(CASCADE_B), HQ, HK, D)
    stream = torch.cuda.current_stream().cuda_stream
    f = _lib.fn("kvp_cascade_plan", ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64])
    rows = []
    n = max(calls // 10, 10)
    for B in CASCADE_B:
        table, lens, lens_d = cascade_case(torch, B)
        us = per_call_us(lambda: cascade.plan(table, lens, lens_d, HQ, HK, D, torch.float16, ws), n, rounds, sync)
        lens_h = (ctypes.c_int32 * B)(*lens)
        a = cascade._CascadePlanArgs(
            ctypes.sizeof(cascade._CascadePlanArgs), 1, D, HQ, HK, B, ws.max_batch, BS, table.shape[1], table.shape[1],
            ctypes.cast(table.data_ptr(), ctypes.POINTER(ctypes.c_int32)), lens_h, lens_d.data_ptr(),
            ctypes.c_void_p(ws.host.data_ptr()), ws.host.numel(), ws.device.data_ptr(), ws.device.numel(), 0, 0,
            None, 0, 0, 0)
        p = cascade._AttnPlan()
        p.struct_size = ctypes.sizeof(p)
        pa, pp = ctypes.addressof(a), ctypes.addressof(p)
        bare = per_call_us(lambda: f(pa, pp, stream), n, rounds, sync)
        rows.append((f"cascade.plan, B={B} (host table given) / bare kvp_cascade_plan", us, bare,
                     f"{ratio(us, bare)} of the bare call"))
    return rows


def device_main(args: argparse.Namespace) -> None:
    import torch

    import kvplug

    fi = None
    if not args.no_flashinfer:
        try:
            import flashinfer as fi
        except Exception as e:
            print(f"flashinfer: not measured ({type(e).__name__}: {e})", file=sys.stderr)
    s = Setup(torch)
    kv = kvplug_rows(torch, s, args.calls, args.rounds, not args.no_ops)
    bare = bare_rows(torch, s, args.calls, args.rounds)
    fir = flashinfer_rows(torch, fi, s, args.calls, args.rounds) if fi is not None else {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, kvplug {kvplug.version_string()} "
          f"({os.path.dirname(kvplug.__file__)}), flashinfer {getattr(fi, '__version__', 'absent')}, "
          f"{args.calls} calls x {args.rounds} rounds, host us per call (median round)\n")
    rows = []
    for name, fi_name in (("paged_decode", "BatchDecodeWithPagedKVCacheWrapper.run"),
                          ("paged_decode, out allocated", "BatchDecodeWithPagedKVCacheWrapper.run, out allocated"),
                          ("paged_prefill", "BatchPrefillWithPagedKVCacheWrapper.run"),
                          ("prefill_plan (host arrays given)", "BatchPrefillWithPagedKVCacheWrapper.plan"),
                          ("kv_write", "")):
        key = name.split(" (")[0]
        notes = [f"{ratio(kv[key], fir.get(key))} of FlashInfer" if key in fir else "",
                 f"{ratio(kv[key], bare.get(key))} of the bare C call" if key in bare else ""]
        rows.append((f"{name} / {fi_name}" if fi_name else name, kv[key], fir.get(key), "; ".join(n for n in notes if n)))
    for key in ("ops.paged_decode", "ops.paged_prefill", "ops.kv_write"):
        if key in kv:
            base = key.split(".", 1)[1]
            rows.append((f"kvplug.{key}", kv[key], fir.get(base), f"{ratio(kv[key], kv[base])} of attn.{base}"))
    for name, b in bare.items():
        rows.append((f"bare C call: kvp_{name}", b, None, ""))
    print(table(rows, ("kvplug us", "FlashInfer us", "ratio")))
    print()
    print(table(cascade_rows(torch, args.calls, args.rounds), ("kvplug us", "bare C us", "ratio")))


# --------------------------------------------------------------------------
# --cpu: kvplug's host work up to the C boundary, no GPU
# --------------------------------------------------------------------------

NOOP_C = """
int kvp_noop2(void *a, unsigned long long stream) { (void)a; (void)stream; return 0; }
int kvp_noop3(void *a, void *b, unsigned long long stream) { (void)a; (void)b; (void)stream; return 0; }
"""


def noop_library() -> ctypes.CDLL:
    """No-op C functions of the attention calls' signatures, compiled here."""
    d = tempfile.mkdtemp(prefix="kvplug-host-cost-")
    src, so = os.path.join(d, "noop.c"), os.path.join(d, "libnoop.so")
    with open(src, "w") as fh:
        fh.write(NOOP_C)
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", src, "-o", so], check=True)
    return ctypes.CDLL(so)


class _NoDevice:
    """torch.cuda.device stand-in: nothing to switch on a CPU."""

    def __init__(self, device: Any) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def stub_package(torch: Any, noop: ctypes.CDLL) -> str:
    """Patches the package on the path so that CPU tensors reach no-op C
    functions; returns "current" or "older" (the layout it found)."""
    import kvplug
    from kvplug import _lib, attn

    kvplug.version()  # loads the library (and binds the table, where there is one)
    torch.cuda.device = _NoDevice
    names2, names3 = ("kvp_kv_write", "kvp_paged_decode"), ("kvp_paged_prefill", "kvp_paged_cascade")

    def fresh(name: str, argtypes: List[Any]) -> Any:
        f = noop["kvp_noop2" if len(argtypes) == 2 else "kvp_noop3"]
        f.restype, f.argtypes = ctypes.c_int, argtypes
        return f

    try:
        from kvplug import _tensors
    except ImportError:
        _tensors = None
    if _tensors is not None:
        _tensors.torch()
        _tensors.DEVICE_TYPE = "cpu"
        _tensors._current_device = lambda: 0
        _tensors._raw_stream = lambda index: 0
        for name in names2 + names3:
            restype, argtypes = _capi_sig(name)
            _lib.C.__dict__[name] = fresh(name, argtypes)
        return "current"
    # The bindings before the table: patch the device check, the stream and
    # the functions _lib.fn caches (the calls still look them up each time).
    check = attn._cuda_tensor

    def cuda_tensor(t: Any, what: str, ndim: int, device: Any = None) -> None:
        if _lib._is_torch_tensor(t) and t.device.type == "cpu":
            if device is not None and t.device != device:
                raise ValueError(what)
            if t.dim() != ndim:
                raise ValueError(what)
            return
        check(t, what, ndim, device)

    attn._cuda_tensor = cuda_tensor
    attn._stream = lambda stream, dev: 0
    P = ctypes.POINTER
    sigs = {"kvp_kv_write": [P(attn._KVWriteArgs), ctypes.c_uint64],
            "kvp_paged_decode": [P(attn._PagedDecodeArgs), ctypes.c_uint64],
            "kvp_paged_prefill": [P(attn._AttnPlan), P(attn._PagedPrefillArgs), ctypes.c_uint64],
            "kvp_paged_cascade": [P(attn._AttnPlan), P(attn._PagedPrefillArgs), ctypes.c_uint64]}
    for name, argtypes in sigs.items():
        _lib._fns[(name, ctypes.c_int, tuple(argtypes))] = fresh(name, argtypes)
    return "older"


def _capi_sig(name: str) -> Tuple[Any, List[Any]]:
    from kvplug import _capi

    return _capi.FUNCTIONS[name]


DECODE_SCHEMA = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, Tensor? workspace, "
                 "float scale, int num_splits, int max_seq_len) -> Tensor")


def dispatch_cases(torch: Any, args: Tuple[Any, ...]) -> List[Tuple[str, Callable[[], Any]]]:
    """The cost of dispatch alone: a function of paged_decode's signature whose
    body allocates the output, called plainly, as a torch.library.custom_op
    and as an operator defined through torch.library.Library (kvplug.ops' way)."""

    def body(q: Any, *rest: Any) -> Any:
        return torch.empty_like(q)

    lib = torch.library.Library("kvplug_host_cost", "DEF")
    lib.define("noop" + DECODE_SCHEMA)
    lib.impl("noop", body, "CompositeExplicitAutograd")
    custom = torch.library.custom_op("kvplug_host_cost::custom_noop", mutates_args=(), schema=DECODE_SCHEMA)(body)
    op = torch.ops.kvplug_host_cost.noop.default
    dispatch_cases._keep = lib  # the registration lives as long as the library object
    return [("no-op body, plain Python call", lambda: body(*args)),
            ("no-op body, torch.library.Library operator", lambda: op(*args)),
            ("no-op body, torch.library.custom_op", lambda: custom(*args))]


def cpu_main(args: argparse.Namespace) -> None:
    import torch

    import kvplug
    from kvplug import attn

    layout = stub_package(torch, noop_library())
    f16, i32 = torch.float16, torch.int32
    nb = KV_LEN // BS
    k_cache = torch.randn(2 * nb, BS, HK, D).to(f16)
    v_cache = torch.randn(2 * nb, BS, HK, D).to(f16)
    table_ = torch.arange(nb, dtype=i32).view(1, nb)
    seq_lens = torch.tensor([KV_LEN], dtype=i32)
    q1, qp = torch.randn(1, HQ, D).to(f16), torch.randn(Q_LEN, HQ, D).to(f16)
    out1, outp = torch.empty_like(q1), torch.empty_like(qp)
    key, value, slots = torch.randn(1, HK, D).to(f16), torch.randn(1, HK, D).to(f16), torch.tensor([7], dtype=i32)
    ws = torch.empty(1 << 16, dtype=torch.uint8)
    c = attn._AttnPlan()
    c.struct_size = ctypes.sizeof(c)
    c.kind, c.route, c.dtype, c.head_dim, c.num_q_heads, c.num_kv_heads = 1, 1, attn.DTYPE_F16, D, HQ, HK
    c.batch, c.total_q, c.max_q_len, c.max_kv_len = 1, Q_LEN, Q_LEN, KV_LEN
    plan = attn.PrefillPlan(c, ())
    n, r = args.calls, args.rounds
    cases = [
        ("paged_decode", lambda: attn.paged_decode(q1, k_cache, v_cache, table_, seq_lens, out=out1, workspace=ws)),
        ("paged_decode, out allocated", lambda: attn.paged_decode(q1, k_cache, v_cache, table_, seq_lens, workspace=ws)),
        ("paged_prefill", lambda: attn.paged_prefill(plan, qp, k_cache, v_cache, table_, out=outp)),
        ("kv_write", lambda: attn.kv_write(key, value, k_cache, v_cache, slots)),
    ]
    if layout == "current" and not args.no_ops:
        import kvplug.ops as ops

        pt = plan.as_tensor()
        cases += [
            ("ops.paged_decode", lambda: ops.paged_decode(q1, k_cache, v_cache, table_, seq_lens, ws)),
            ("ops.paged_prefill", lambda: ops.paged_prefill(pt, qp, k_cache, v_cache, table_)),
            ("ops.kv_write", lambda: ops.kv_write(key, value, k_cache, v_cache, slots)),
        ]
    cases += dispatch_cases(torch, (q1, k_cache, v_cache, table_, seq_lens, ws, 0.0, 0, 0))
    noop = noop_library()["kvp_noop2"]
    noop.restype, noop.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64]
    cases.append(("no-op C call through ctypes (the floor)", lambda: noop(0, 0)))
    rows = [f"| {name} | {per_call_us(fn, n, r):.1f} |" for name, fn in cases]
    print(f"CPU, no GPU: the package at {os.path.dirname(kvplug.__file__)} ({layout} layout), torch {torch.__version__}, "
          f"python {sys.version.split()[0]}, {n} calls x {r} rounds, host us per call up to a no-op C function "
          f"(median round)\n")
    print("\n".join(["| call | host us |", "| --- | --- |"] + rows))


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.cpu:
        cpu_main(args)
    else:
        device_main(args)


if __name__ == "__main__":
    main()
