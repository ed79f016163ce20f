"""Decode of sliding-window layers beside FlashInfer: the window layers of
gpt-oss (64 q heads, 8 kv heads, head_dim 64, window 128, with attention
sinks) and of Gemma 3 (32 q, 16 kv, head_dim 128, window 1024), one new
token per sequence over L cached tokens, block size 16, bf16.

kvplug plans the batch with the window (attn.prefill_plan(window_left=W-1):
one new token per sequence takes the decode route, whose kernel reads only
the window's blocks) and runs attn.paged_prefill, with gpt-oss's sinks where
the model has them and without; the same plan without the decode route (the
prefill kernel, which windowed decode ran on before the decode kernel took
windows) is timed beside it. FlashInfer runs its decode wrapper with window_left
(CUDA-core and tensor-core kernels; the faster is reported). The floor is
the window's K and V bytes at the copy bandwidth measured in the same run.
Timing: triton's do_bench (median; L2 rewritten before every call);
random inputs; blocks in shuffled order; outputs compared with FlashInfer's
(without sinks: FlashInfer's decode wrapper takes none).

Usage: python3 bench/window_decode_bench.py [--rounds N] [--no-fi] [--fi-sinks] [--json FILE]
Prints a markdown table.
"""

import argparse
import json
import math
import statistics

import torch
from triton.testing import do_bench

from kvplug import attn

BS = 16
MODELS = {  # name: (q heads, kv heads, head_dim, window, sinks)
    "gpt-oss": (64, 8, 64, 128, True),
    "gemma-3": (32, 16, 128, 1024, False),
}
SHAPES = [(1, 8192), (8, 8192), (32, 8192), (64, 32768), (128, 8192)]


def timed(fn):
    return do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3  # us


def copy_bandwidth():
    """Bytes per second of a device-to-device copy of 1 GiB (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = timed(lambda: b.copy_(a))
    return 2 * a.numel() / (us * 1e-6)


class Case:
    def __init__(self, model, B, L, gen):
        hq, hk, d, w, sinks = MODELS[model]
        self.hq, self.hk, self.d, self.w, self.B, self.L = hq, hk, d, w, B, L
        nb = math.ceil(L / BS)
        n = B * nb
        perm = torch.randperm(n, generator=gen, device="cuda").to(torch.int32)
        self.table = perm.view(B, nb).contiguous()
        self.lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        dt = torch.bfloat16
        self.k = torch.randn((n, BS, hk, d), dtype=dt, device="cuda", generator=gen)
        self.v = torch.randn((n, BS, hk, d), dtype=dt, device="cuda", generator=gen)
        self.q = torch.randn((B, hq, d), dtype=dt, device="cuda", generator=gen)
        self.sinks = torch.randn(hq, device="cuda", generator=gen) * 2 if sinks else None
        self.qo = torch.arange(0, B + 1, dtype=torch.int32, device="cuda")
        self.kv_indptr = self.qo * nb
        self.last = torch.full((B,), (L - 1) % BS + 1, dtype=torch.int32, device="cuda")
        self.bytes = 2 * B * min(L, w) * hk * d * 2

    def kvplug(self, sinks=None, decode_route=True):
        ws = torch.empty(attn.prefill_workspace_size(self.B, self.B, self.hq, self.hk, self.d), dtype=torch.uint8,
                         device="cuda")
        plan = attn.prefill_plan(self.qo, self.lens, self.hq, self.hk, self.d, torch.bfloat16, ws,
                                 window_left=self.w - 1, qo_indptr_host=self.qo.cpu(), kv_lens_host=[self.L] * self.B,
                                 decode_route=decode_route)
        assert (plan.route == attn.ROUTE_DECODE) == decode_route, plan
        out = torch.empty_like(self.q)
        return lambda: attn.paged_prefill(plan, self.q, self.k, self.v, self.table, out=out, sinks=sinks), out

    def fi_sinks(self, backend="fa2"):
        """FlashInfer's attention-sink wrapper (its prefill kernels, JIT-built,
        one new token a sequence) with the window and the sinks."""
        import flashinfer
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchAttentionWithAttentionSinkWrapper(
            ws, "NHD", backend=backend, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, head_dim_qk=self.d,
            head_dim_vo=self.d, window_left=self.w - 1)
        w.plan(self.qo, self.kv_indptr, self.table.flatten(), self.last, self.hq, self.hk, self.d, BS, causal=True,
               window_left=self.w - 1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        out = torch.empty_like(self.q)
        sink, scale = self.sinks.float().contiguous(), 1 / math.sqrt(self.d)
        return lambda: w.run(self.q, (self.k, self.v), sink, scale, out=out), out

    def fi(self, tensor_cores):
        import flashinfer
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
        w.plan(self.kv_indptr, self.table.flatten(), self.last, self.hq, self.hk, self.d, BS, window_left=self.w - 1,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        out = torch.empty_like(self.q)
        return lambda: w.run(self.q, (self.k, self.v), out=out), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the kernel without and with sinks this many times, alternating, and keep each one's "
                         "median (a ratio of single timings of a 10 us kernel moves by several percent)")
    ap.add_argument("--no-fi", action="store_true", help="leave FlashInfer out (its JIT build takes minutes)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--fi-sinks", action="store_true",
                    help="also time FlashInfer's attention-sink wrapper (fa2, JIT-built) where the model has sinks")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(1)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| model | B | L | window | kvplug us | kvplug + sinks us | prefill kernel us | FlashInfer us "
          "| FlashInfer / kvplug | kvplug at the floor | rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for model in args.models.split(","):
        for B, L in SHAPES:
            c = Case(model, B, L, gen)
            fk, ok = c.kvplug()
            fp, op = c.kvplug(decode_route=False)
            tp = timed(fp)
            ts = "-"
            fs, osk = c.kvplug(c.sinks) if c.sinks is not None else (None, None)
            plain, with_sinks = [], []
            for r in range(args.rounds):  # alternating, the order reversed every other round
                order = [(fk, plain), (fs, with_sinks)] if r % 2 == 0 else [(fs, with_sinks), (fk, plain)]
                for fn, out in order:
                    if fn is not None:
                        out.append(timed(fn))
            tk = statistics.median(plain)
            tks = statistics.median(with_sinks) if with_sinks else None
            if tks is not None:
                ts = f"{tks:.1f}"
            best, ofi = None, None
            for tc in (() if args.no_fi else (False, True)):
                try:
                    ff, of = c.fi(tc)
                    t = timed(ff)
                except Exception as e:  # a kernel FlashInfer does not build for this shape
                    print(f"  FlashInfer decode (tensor cores {tc}) at {model} {B}x{L}: {type(e).__name__}: {e}")
                    continue
                if best is None or t < best:
                    best, ofi = t, of
            fis_sinks = ""
            if args.fi_sinks and fs is not None:
                try:
                    ffs, ofs = c.fi_sinks()
                    tfs = timed(ffs)
                    fs()
                    torch.cuda.synchronize()
                    d = ((osk.float() - ofs.float()).norm() / ofs.float().norm()).item()
                    fis_sinks = f" FlashInfer + sinks {tfs:.1f} us ({tfs / tks:.2f}x kvplug + sinks, rel diff {d:.1e})"
                except Exception as e:  # its JIT build or plan refused this shape
                    fis_sinks = f" FlashInfer + sinks: {type(e).__name__}: {e}"
            fk()
            fp()
            torch.cuda.synchronize()
            route_diff = ((ok.float() - op.float()).norm() / op.float().norm()).item()
            assert route_diff < 1e-2, f"{model} {B}x{L}: the decode and prefill routes differ by {route_diff:.2e}"
            diff = "-"
            fis = ratio = "-"
            if best is not None:
                torch.cuda.synchronize()
                diff = f"{((ok.float() - ofi.float()).norm() / ofi.float().norm()).item():.1e}"
                fis, ratio = f"{best:.1f}", f"{best / tk:.2f}x"
            floor = c.bytes / bw * 1e6
            print(f"| {model} | {B} | {L} | {c.w} | {tk:.1f} | {ts} | {tp:.1f} | {fis} | {ratio} | {floor / tk:.2f} "
                  f"| {diff} |", flush=True)
            if fis_sinks:
                print(f"  {model} {B}x{L}:{fis_sinks}", flush=True)
            rows.append(dict(model=model, B=B, L=L, window=c.w, kvplug_us=tk, sinks_us=ts, prefill_kernel_us=tp,
                             fi_us=best, floor_us=floor))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_GBps=bw / 1e9, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
