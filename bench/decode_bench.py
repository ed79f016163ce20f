"""Paged decode attention benchmark (Llama-3-8B heads: 32 q, 8 kv, head_dim 128).

For each dtype, batch B and context L it times the kvplug decode kernel for
block sizes 1, 16 and 64, a device-to-device copy, and PyTorch SDPA over the
same K/V stored contiguously ([B, kv_heads, L, D], enable_gqa), all in the
same run. Speed is logical KV bytes / time (K and V of every token read once).

Timing: every measured call is captured N times into one CUDA graph, cycling
over rotated input sets whose total size exceeds the L2 cache, and the graph
is replayed under triton.testing.do_bench (median); time per call = replay
time / N. The kernels are launched through the driver API (ctypes) with the
params struct packed as in kernels/kvplug_kernels.h, and num_splits comes from
the heuristic of kernels/README.md (decode_splits below).

Usage: python3 bench/decode_bench.py [--fatbin PATH] [--quick] [--out DIR]
Prints a markdown table; writes the full results as JSON to DIR (default $OUT).
"""

import argparse
import ctypes
import json
import math
import os
import pathlib
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from triton.testing import do_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernels"))
from kernel_abi import DECODE, DTYPE_BF16, DTYPE_F16, KV_WRITE, cdiv, decode_smem, paged_kv  # noqa: E402  (the header's mirror)
HQ, HK, D = 32, 8, 128
TILE = 64
L2_ROTATE_BYTES = 256 << 20  # rotated input sets together exceed this (H100 L2: 50 MB)


# ---------------------------------------------------------------------------
# Driver API launch (what the library's Go side does).

_cuda = ctypes.CDLL("libcuda.so.1")
_cuda.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
_cuda.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
_cuda.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
_cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
    ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, pad, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_cuda.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                   ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


class Kernels:
    def __init__(self, path):
        torch.zeros(1, device="cuda")  # primary context current
        self._img = ctypes.create_string_buffer(pathlib.Path(path).read_bytes())
        self.mod = ctypes.c_void_p()
        _check(_cuda.cuModuleLoadData(ctypes.byref(self.mod), ctypes.cast(self._img, ctypes.c_void_p)),
               "cuModuleLoadData")
        self.funcs = {}

    def func(self, name, smem=0):
        f = self.funcs.get(name)
        if f is None:
            f = ctypes.c_void_p()
            _check(_cuda.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()), name)
            if smem > 48 * 1024:
                _check(_cuda.cuFuncSetAttribute(f, 8, smem), "cuFuncSetAttribute")
            self.funcs[name] = f
        return f

    def launch(self, name, grid, block, params, smem=0, pdl=False):
        """pdl: programmatic dependent launch (the kernel may start while the
        previous one in the stream finishes; it waits in griddepcontrol.wait)."""
        f = self.func(name, smem)
        raw = params.tobytes()
        buf = ctypes.create_string_buffer(raw, len(raw))
        args = (ctypes.c_void_p * 1)(ctypes.cast(buf, ctypes.c_void_p))
        stream = torch.cuda.current_stream().cuda_stream
        if not pdl:
            _check(_cuda.cuLaunchKernel(f, *grid, *block, smem, ctypes.c_void_p(stream), args, None), name)
            return
        attr = _LaunchAttr(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 0)
        attr.value[0] = 1
        cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem, stream,
                            ctypes.pointer(attr), 1)
        _check(_cuda.cuLaunchKernelEx(ctypes.byref(cfg), f, args, None), name)


def decode_splits(batch, num_kv_heads, num_q_heads, max_seq_len, head_dim, num_sms, dtype_bytes=2):
    """The split heuristic of kernels/README.md (the Go side implements the same)."""
    group = num_q_heads // num_kv_heads
    ctas = batch * num_kv_heads * cdiv(group, 16)
    per_sm = 4 if dtype_bytes == 4 else {64: 3, 128: 2, 256: 1}[head_dim]
    slots = num_sms * per_sm
    tiles = cdiv(max_seq_len, TILE)
    if ctas >= slots or tiles <= 1:
        return 1
    s = min(slots // ctas, tiles)
    if s <= 1:
        return 1
    per = cdiv(tiles, s)  # tiles per split; drop splits that would be empty
    return cdiv(tiles, per)


# ---------------------------------------------------------------------------


def time_graph(fns, n_calls):
    """Median time (us) of one call: fns[i % len(fns)] captured n_calls times in a graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # warm-up outside the capture (module load, lazy init)
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_calls):
            fns[i % len(fns)]()
    torch.cuda.synchronize()
    ms = do_bench(g.replay, warmup=25, rep=150, return_mode="median")
    del g
    return ms * 1e3 / n_calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fatbin", default=None)
    ap.add_argument("--quick", action="store_true", help="a few configurations only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--explore", action="store_true", help="bs16 at forced split counts, head-major layout")
    ap.add_argument("--profile", default=None, metavar="B,L,BS",
                    help="launch one configuration a few times without graphs or baselines (for ncu)")
    args = ap.parse_args()
    fatbin = args.fatbin
    for p in (fatbin, os.environ.get("KVPLUG_FATBIN"), ROOT / "kernels" / "fatbin" / "kvplug.fatbin",
              ROOT / ".device" / "kern" / "kvplug.fatbin"):
        if p and pathlib.Path(p).is_file():
            fatbin = str(p)
            break
    kern = Kernels(fatbin)
    prop = torch.cuda.get_device_properties(0)
    sms = prop.multi_processor_count
    torch.manual_seed(0)

    # Device-to-device copy: bytes read + written per second.
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    copy_ms = do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    copy_gbs = 2 * n / (copy_ms * 1e-3) / 1e9
    del a, b
    torch.cuda.empty_cache()

    Bs = (1, 8, 32, 64, 128)
    Ls = (512, 2048, 4096, 8192, 16384)
    if args.quick:
        Bs, Ls = (1, 32, 128), (512, 4096, 16384)
    prof = None
    if args.explore:
        Bs, Ls = (1, 8, 32), (64, 512, 4096)
        # Launch floor: a KV write of one token (one tiny block) per call.
        src = torch.randn(HK, D, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty(4, HK, D, dtype=torch.bfloat16, device="cuda")
        slot = torch.zeros(1, dtype=torch.int32, device="cuda")
        pw = np.zeros((), dtype=KV_WRITE)
        pw["kv"] = paged_kv(k_cache=dst.data_ptr(), v_cache=dst.data_ptr(), block_stride=HK * D, token_stride=HK * D,
                            head_stride=D, num_kv_heads=HK, block_size=1, num_blocks=4, dtype=DTYPE_BF16)
        for k, v in dict(key=src.data_ptr(), value=src.data_ptr(), slot_mapping=slot.data_ptr(),
                         key_token_stride=HK * D, key_head_stride=D, value_token_stride=HK * D, value_head_stride=D,
                         num_tokens=1).items():
            pw[k] = v
        floor = time_graph([lambda: kern.launch(f"kvp_kv_write_bf16_h{D}", (1, 1, 1), (256, 1, 1), pw)], 50)
        print(f"launch floor (tiny kernel in a graph): {floor:.2f} us per launch", flush=True)
    if args.profile:
        pb, pl, pbs = args.profile.split(",")
        Bs, Ls, prof = (int(pb),), (int(pl),), (pbs if pbs == "1r" else int(pbs))
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[x] for x in args.dtypes.split(",")]
    results = []
    scale = 1.0 / math.sqrt(D)
    t0 = time.time()
    for B in Bs:
        for L in Ls:
            kv_bytes = 2 * B * L * HK * D * 2
            rot = max(1, min(64, cdiv(L2_ROTATE_BYTES, kv_bytes)))
            n_calls = max(rot, 10)
            tokens = rot * B * L
            splits = decode_splits(B, HK, HQ, L, D, sms)
            ws_splits = 32 if args.explore else splits
            ws = torch.empty(max(1, ws_splits * B * HQ * (D + 1)), dtype=torch.float32, device="cuda")
            # Logical -> physical mapping in 64-token pages (random permutation);
            # the bs=16 and bs=1 tables are derived from it so all block sizes
            # describe the same K/V and can be checked against SDPA.
            pages = torch.randperm(tokens // 64, device="cuda", dtype=torch.int64).view(rot, B, L // 64)
            tables = {}
            for bs in (64, 16, 1):
                per = 64 // bs
                t = (pages.unsqueeze(-1) * per + torch.arange(per, device="cuda")).reshape(rot, B, L // bs)
                tables[bs] = t.to(torch.int32).contiguous()
            rnd = torch.randperm(tokens, device="cuda", dtype=torch.int64).to(torch.int32).view(rot, B, L)
            tables["1r"] = rnd.contiguous()  # token mode, fully scattered slots
            lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
            for dt in dtypes:
                dname = "bf16" if dt == torch.bfloat16 else "fp16"
                kc = torch.randn(tokens, HK, D, dtype=dt, device="cuda")
                vc = torch.randn(tokens, HK, D, dtype=dt, device="cuda")
                qs = [torch.randn(B, HQ, D, dtype=dt, device="cuda") for _ in range(rot)]
                outs = [torch.empty(B, HQ, D, dtype=dt, device="cuda") for _ in range(rot)]
                row = {"dtype": dname, "B": B, "L": L, "splits": splits, "rot": rot, "kv_bytes": kv_bytes}

                def make(bs_key, r, mode="pdl", nsplit=None, head_major=False):
                    """mode: pdl (the combine launched with programmatic dependent launch) or plain."""
                    bs = 1 if bs_key == "1r" else bs_key
                    tab = tables[bs_key][r]
                    ns = splits if nsplit is None else nsplit
                    p = np.zeros((), dtype=DECODE)
                    kv = dict(k_cache=kc.data_ptr(), v_cache=vc.data_ptr(), block_table=tab.data_ptr(),
                              block_stride=bs * HK * D, token_stride=HK * D, head_stride=D,
                              block_table_stride=tab.shape[1], num_kv_heads=HK, block_size=bs,
                              num_blocks=tokens // bs, max_blocks_per_seq=tab.shape[1],
                              dtype=DTYPE_BF16 if dt == torch.bfloat16 else DTYPE_F16)
                    if head_major:  # same buffer read as [HK, tokens, D]: contiguous runs per head
                        kv.update(block_stride=bs * D, token_stride=D, head_stride=tokens * D)
                    p["kv"] = paged_kv(**kv)
                    vals = dict(q=qs[r].data_ptr(), seq_lens=lens.data_ptr(), out=outs[r].data_ptr(), lse=0,
                                workspace=ws.data_ptr(), q_batch_stride=HQ * D, q_head_stride=D,
                                out_batch_stride=HQ * D, out_head_stride=D, batch=B, num_q_heads=HQ, num_splits=ns,
                                scale=scale)
                    for k, v in vals.items():
                        p[k] = v
                    name = f"kvp_paged_decode_{dname.replace('fp', 'f')}_h{D}"
                    comb = f"kvp_paged_decode_combine_{dname.replace('fp', 'f')}_h{D}"
                    smem = decode_smem(2, D)

                    def f():
                        kern.launch(name, (HK * cdiv(HQ // HK, 16), B, ns), (128, 1, 1), p, smem)
                        if ns > 1:
                            kern.launch(comb, (cdiv(B * HQ, 4), 1, 1), (128, 1, 1), p, pdl=(mode == "pdl"))
                    return f

                if args.explore:
                    ex = {"dtype": dname, "B": B, "L": L, "heuristic": splits}
                    for ns in (1, 2, 4, 8, 16, 32):
                        if ns <= cdiv(L, TILE) and B * HK * ns <= 8 * sms * 2:
                            ex[f"s{ns}"] = time_graph([make(16, r, nsplit=ns) for r in range(rot)], n_calls)
                    ex["head_major"] = time_graph([make(16, r, head_major=True) for r in range(rot)], n_calls)
                    ex["kv_bytes"] = kv_bytes
                    print(json.dumps(ex), flush=True)
                    results.append(ex)
                    del kc, vc, qs, outs
                    torch.cuda.empty_cache()
                    continue
                if prof is not None:
                    f = make(prof, 0)
                    for _ in range(6):
                        f()
                    torch.cuda.synchronize()
                    print(f"profiled B={B} L={L} bs={prof} {dname} splits={splits}")
                    return 0
                ref = None
                for bs_key in (16, 64, 1, "1r"):
                    fns = [make(bs_key, r) for r in range(rot)]
                    us = time_graph(fns, n_calls)
                    row[f"us_bs{bs_key}"] = us
                    if bs_key != "1r":
                        fns[0]()
                        torch.cuda.synchronize()
                        if ref is None:
                            ref = outs[0].float().clone()
                        else:
                            err = ((outs[0].float() - ref).norm() / ref.norm()).item()
                            row[f"err_bs{bs_key}_vs_bs16"] = err
                            assert err < 1e-6, f"block size {bs_key} differs from 16: {err}"
                if splits > 1:  # what the programmatic launch of the combine saves
                    row["us_bs16_nopdl"] = time_graph([make(16, r, mode="plain") for r in range(rot)], n_calls)
                # SDPA over contiguous K/V holding the same logical tokens (bs=64 mapping).
                sl = (tables[64].long().unsqueeze(-1) * 64 + torch.arange(64, device="cuda")).reshape(rot, B, L)
                kcs = [kc[sl[r]].permute(0, 2, 1, 3).contiguous() for r in range(rot)]  # [B, HK, L, D]
                vcs = [vc[sl[r]].permute(0, 2, 1, 3).contiguous() for r in range(rot)]
                qv = [q.view(B, HQ, 1, D) for q in qs]
                try:
                    so = F.scaled_dot_product_attention(qv[0], kcs[0], vcs[0], scale=scale, enable_gqa=True)
                    err = ((so.view(B, HQ, D).float() - ref).norm() / so.float().norm()).item()
                    row["err_vs_sdpa"] = err
                    del so
                    row["us_sdpa"] = time_graph(
                        [(lambda r=r: F.scaled_dot_product_attention(qv[r], kcs[r], vcs[r], scale=scale,
                                                                     enable_gqa=True)) for r in range(rot)],
                        n_calls)
                except Exception as e:  # noqa: BLE001 - a missing baseline is reported, not fatal
                    row["us_sdpa"] = None
                    row["sdpa_error"] = str(e)[:200]
                del kcs, vcs, kc, vc, qs, outs
                torch.cuda.empty_cache()
                results.append(row)
                if row.get("err_vs_sdpa") is not None:
                    assert row["err_vs_sdpa"] < 2e-2, f"decode differs from SDPA: {row}"
                print(json.dumps(row), flush=True)
            del tables, rnd, pages, ws
            torch.cuda.empty_cache()

    if args.explore:
        keys = ["heuristic", "s1", "s2", "s4", "s8", "s16", "s32", "head_major"]
        print("| B | L | " + " | ".join(keys) + " |")
        for r in results:
            print(f"| {r['B']} | {r['L']} | " + " | ".join(
                str(r[k]) if k == "heuristic" else (f"{r[k]:.1f}" if k in r else "-") for k in keys) + " |")
        return 0
    # Table.
    lines = [f"device: {prop.name}, {sms} SMs; D2D copy {copy_gbs:.0f} GB/s (read+write); "
             f"torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; {time.time() - t0:.0f} s",
             "",
             "| dtype | B | L | splits | bs1 us | bs16 us | bs64 us | bs1 scattered us | bs16 no-PDL us | GB/s (bs16) | "
             "% copy (worst bs) | SDPA us | x SDPA (worst bs) | bs spread |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        us = [r["us_bs1"], r["us_bs16"], r["us_bs64"]]
        worst = max(us)
        gbs = r["kv_bytes"] / (r["us_bs16"] * 1e-6) / 1e9
        frac = r["kv_bytes"] / (worst * 1e-6) / 1e9 / copy_gbs
        sd = r["us_sdpa"]
        lines.append(f"| {r['dtype']} | {r['B']} | {r['L']} | {r['splits']} | {us[0]:.1f} | {us[1]:.1f} | "
                     f"{us[2]:.1f} | {r['us_bs1r']:.1f} | {r.get('us_bs16_nopdl', float('nan')):.1f} | {gbs:.0f} | "
                     f"{100 * frac:.1f} | "
                     f"{'n/a' if sd is None else f'{sd:.1f}'} | {'n/a' if sd is None else f'{sd / worst:.2f}'} | "
                     f"{100 * (max(us) / min(us) - 1):.1f}% |")
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_bench.json").write_text(json.dumps({"device": prop.name, "sms": sms, "copy_gbs": copy_gbs,
                                                       "host": platform.node(), "results": results}, indent=1))
    (out / "decode_bench.md").write_text(table + "\n")


if __name__ == "__main__":
    sys.exit(main())
