"""FP8 (e4m3) KV-cache decode beside kvplug's 16-bit decode and FlashInfer's
FP8 decode, at the nine B x L shapes of the decode table (Llama-3-8B heads:
32 q, 8 kv, head_dim 128, block size 16, bf16 q).

Timing (triton's do_bench, median, L2 cold): kvplug 16-bit (bf16 cache),
kvplug e4m3 with one scale per (token, kv head) (the cache written by
attn.kv_write, which quantises), kvplug e4m3 with one scale per cache, and
FlashInfer's decode (CUDA-core and tensor-core, the better) over the same
per-cache-scale e4m3 bytes. The FP8 floor is the bytes a decode must read
(e4m3 K and V, plus the token-head scales for kvplug's default mode) at the
copy bandwidth measured in the same run (torch copy of 1 GiB: read + write).

Accuracy (--acc): B=8 x L=4096 with real-model-like outliers (4 of 128 K
channels 20-50x the rest), relative L2 error of each FP8 decode against a
float64 attention over the original bf16 K and V.

Prefill (--prefill): kvplug's paged prefill over the e4m3 cache on the
Hopper (wgmma) mainloop, which widens the e4m3 tiles into shared memory, and
on the sm_80 one, beside its 16-bit prefill on both, at shapes of the
prefill table (B sequences of `new` new tokens over `prefix` cached,
causal), in TFLOP/s of the causal attention; and the Hopper mainloop's FP8
Q/K/V mode (prefill_plan(..., fp8_qkv=True): q quantised to e4m3, both
products on the 8-bit tensor cores) beside FlashInfer's fa3 with FP8 Q, K and
V (per-tensor scales; --no-fi leaves it out; its JIT build takes minutes).

Usage: python3 bench/fp8_decode_bench.py [--no-fi] [--acc] [--prefill] [--json FILE]
Prints markdown tables.
"""

import argparse
import json
import math

import torch
from decode_fi_bench import timed  # triton's do_bench, median, us

from kvplug import attn

HQ, HK, D, BS = 32, 8, 128, 16
PLAIN = [(1, 512), (1, 4096), (1, 16384), (8, 512), (8, 4096), (32, 2048), (32, 4096), (64, 8192), (128, 2048)]
E4M3 = torch.float8_e4m3fn


def copy_bandwidth():
    """Bytes per second of a device copy (read + write)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    x.random_(0, 255)
    us = timed(lambda: y.copy_(x))
    return 2 * x.numel() / (us * 1e-6)


class Batch:
    def __init__(self, B, L, gen, outliers=False):
        self.B, self.L = B, L
        nb = math.ceil(L / BS)
        self.num_blocks = B * nb
        perm = torch.randperm(self.num_blocks, generator=gen, device="cuda").to(torch.int32)
        self.table = perm.view(B, nb).contiguous()
        self.seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        shape = (self.num_blocks, BS, HK, D)
        self.k = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen)
        self.v = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen)
        if outliers:
            ch = torch.randperm(D, generator=gen, device="cuda")[:4]
            mult = 20 + 30 * torch.rand(4, generator=gen, device="cuda")
            self.k[..., ch] *= mult.to(torch.bfloat16)
        self.q = torch.randn((B, HQ, D), dtype=torch.bfloat16, device="cuda", generator=gen)
        self.kv_indptr = torch.arange(0, B + 1, dtype=torch.int32, device="cuda") * nb
        self.kv_indices = self.table.flatten()
        self.last = torch.full((B,), (L - 1) % BS + 1, dtype=torch.int32, device="cuda")
        self.ws = torch.empty(attn.workspace_size(B, HQ, D), dtype=torch.uint8, device="cuda")
        # e4m3 caches written by kvplug's KV write from the bf16 ones.
        slots = torch.arange(self.num_blocks * BS, dtype=torch.int32, device="cuda")
        key, val = self.k.view(-1, HK, D), self.v.view(-1, HK, D)
        self.k8, self.v8 = torch.empty(shape, dtype=E4M3, device="cuda"), torch.empty(shape, dtype=E4M3, device="cuda")
        self.ks = torch.empty(shape[:3], dtype=torch.float32, device="cuda")
        self.vs = torch.empty_like(self.ks)
        attn.kv_write(key, val, self.k8, self.v8, slots, k_scale=self.ks, v_scale=self.vs)
        # One scale per cache: the largest magnitude maps to 448.
        self.kt = (self.k.abs().max().float() / 448).reshape(1)
        self.vt = (self.v.abs().max().float() / 448).reshape(1)
        self.k8t, self.v8t = torch.empty_like(self.k8), torch.empty_like(self.v8)
        attn.kv_write(key, val, self.k8t, self.v8t, slots, k_scale=self.kt, v_scale=self.vt)
        torch.cuda.synchronize()
        tokens = B * L * HK
        self.bytes16 = 2 * tokens * D * 2
        self.bytes8 = 2 * tokens * (D + 4)  # e4m3 elements and float32 token-head scales
        self.bytes8t = 2 * tokens * D

    def kvplug(self, k, v, ks=None, vs=None):
        out = torch.empty_like(self.q)
        return lambda: attn.paged_decode(self.q, k, v, self.table, self.seq_lens, out=out, workspace=self.ws,
                                         max_seq_len=self.L, k_scale=ks, v_scale=vs), out

    def fi_fp8(self, tensor_cores):
        import flashinfer
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
        w.plan(self.kv_indptr, self.kv_indices, self.last, HQ, HK, D, BS, q_data_type=self.q.dtype, kv_data_type=E4M3)
        out = torch.empty_like(self.q)
        ks, vs = self.kt.item(), self.vt.item()
        return lambda: w.run(self.q, (self.k8t, self.v8t), out=out, k_scale=ks, v_scale=vs), out

    def reference(self):
        """float64 attention over the bf16 K and V: out [B, HQ, D]."""
        outs = []
        g = HQ // HK
        for b in range(self.B):
            blocks = self.table[b]
            k = self.k[blocks].reshape(-1, HK, D)[: self.L].double()
            v = self.v[blocks].reshape(-1, HK, D)[: self.L].double()
            q = self.q[b].double().view(HK, g, D)
            s = torch.einsum("hgd,thd->hgt", q, k) / math.sqrt(D)
            p = torch.softmax(s, dim=-1)
            outs.append(torch.einsum("hgt,thd->hgd", p, v).reshape(HQ, D))
        return torch.stack(outs)


# The prefill table's eight shapes (B, new tokens, cached tokens), causal.
PREFILL = [(1, 2048, 0), (8, 2048, 0), (1, 8192, 0), (8, 512, 2048), (8, 2048, 8192), (32, 128, 8192),
           (32, 512, 2048), (1, 2048, 8192)]


def fi_fa3_fp8(bt, q, qo):
    """FlashInfer fa3 over bt's per-tensor e4m3 cache with q quantised to
    e4m3 (one scale for all of q): the launch and its output."""
    import flashinfer
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(qo, bt.kv_indptr, bt.kv_indices, bt.last, HQ, HK, D, BS, causal=True, q_data_type=E4M3,
           kv_data_type=E4M3, o_data_type=torch.bfloat16)
    qs = (q.abs().max().float() / 448).item()
    q8 = (q.float() / qs).to(E4M3)
    out = torch.empty_like(q)
    ks, vs = bt.kt.item(), bt.vt.item()
    return lambda: w.run(q8, (bt.k8t, bt.v8t), q_scale=qs, k_scale=ks, v_scale=vs, out=out), out


def prefill_table(gen, fi=True):
    """kvplug's prefill over bf16 and e4m3 caches: rows of the --prefill table."""
    rows = []
    print("\n| B x new (prefix) | 16-bit Hopper TFLOP/s | e4m3 Hopper TFLOP/s | FP8 Q/K/V TFLOP/s | FlashInfer fa3 FP8 TFLOP/s | "
          "16-bit sm_80 TFLOP/s | e4m3 sm_80 TFLOP/s | "
          "e4m3 / 16-bit Hopper speed | FP8 Q/K/V / FlashInfer | e4m3 / 16-bit sm_80 speed | err vs 16-bit (e4m3, FP8 Q/K/V, FI) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B, new, prefix in PREFILL:
        L = new + prefix
        bt = Batch(B, L, gen)
        q = torch.randn((B * new, HQ, D), dtype=torch.bfloat16, device="cuda", generator=gen)
        qo = torch.arange(0, B + 1, dtype=torch.int32, device="cuda") * new
        ws_bytes = attn.prefill_workspace_size(B, B * new, HQ, HK, D)
        # causal FLOPs: 4 * D * HQ * (pairs), pairs = sum over rows of visible tokens
        pairs = B * (new * prefix + new * (new + 1) / 2)
        flops = 4 * D * HQ * pairs

        def run(k, v, ks, vs, hopper, fp8_qkv=False):
            # A workspace for each plan: a workspace holds one plan's work list at a time, and the runs below
            # come after all five plans (the sm_80 and Hopper mainloops' lists differ).
            ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
            plan = attn.prefill_plan(qo, bt.seq_lens, HQ, HK, D, torch.bfloat16, ws, qo_indptr_host=qo.cpu(),
                                     kv_lens_host=[L] * B, hopper=hopper, fp8_qkv=fp8_qkv)
            out = torch.empty_like(q)
            return (lambda: attn.paged_prefill(plan, q, k, v, bt.table, out=out, k_scale=ks, v_scale=vs)), out
        f90, o90 = run(bt.k, bt.v, None, None, True)
        f80, o80 = run(bt.k, bt.v, None, None, False)
        f8, o8 = run(bt.k8, bt.v8, bt.ks, bt.vs, False)
        f8h, o8h = run(bt.k8, bt.v8, bt.ks, bt.vs, True)
        f8q, o8q = run(bt.k8, bt.v8, bt.ks, bt.vs, True, fp8_qkv=True)
        t90, t80, t8, t8h, t8q = timed(f90), timed(f80), timed(f8), timed(f8h), timed(f8q)
        tfi, efi = float("nan"), float("nan")
        if fi:
            ffi, ofi = fi_fa3_fp8(bt, q, qo)
            tfi = timed(ffi)
            efi = rel(ofi, o90)
        tf = lambda us: flops / (us * 1e-6) / 1e12
        r = dict(B=B, new=new, prefix=prefix, us_hopper=t90, us_sm80=t80, us_e4m3=t8, us_e4m3_hopper=t8h,
                 us_fp8_qkv=t8q, us_fi_fa3_fp8=tfi, err=rel(o8h, o90), err_sm80=rel(o8, o90), err_fp8_qkv=rel(o8q, o90),
                 err_fi=efi)
        rows.append(r)
        print(f"| {B} x {new} ({prefix}) | {tf(t90):.0f} | {tf(t8h):.0f} | {tf(t8q):.0f} | {tf(tfi):.0f} | {tf(t80):.0f} | "
              f"{tf(t8):.0f} | {t90 / t8h:.2f}x | {tfi / t8q:.2f}x | {t80 / t8:.2f}x | "
              f"{r['err']:.1e}, {r['err_fp8_qkv']:.1e}, {efi:.1e} |", flush=True)
        del bt
        torch.cuda.empty_cache()
    return rows


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-fi", action="store_true")
    ap.add_argument("--acc", action="store_true")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw / 1e9:.0f} GB/s")
    rows = []
    print("\n| B x L | 16-bit us | e4m3 token-head us | e4m3 tensor us | FlashInfer e4m3 us | e4m3 vs 16-bit | "
          "vs FlashInfer | of FP8 floor | err vs 16-bit (kvplug, FI) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, L in ([] if args.no_decode else PLAIN):
        bt = Batch(B, L, gen)
        f16, o16 = bt.kvplug(bt.k, bt.v)
        f8, o8 = bt.kvplug(bt.k8, bt.v8, bt.ks, bt.vs)
        f8t, o8t = bt.kvplug(bt.k8t, bt.v8t, bt.kt, bt.vt)
        t16, t8, t8t = timed(f16), timed(f8), timed(f8t)
        tfi, efi = float("nan"), float("nan")
        if not args.no_fi:
            best = None
            for tc in (False, True):
                ffi, ofi = bt.fi_fp8(tc)
                t = timed(ffi)
                if best is None or t < best[0]:
                    best = (t, ofi)
            tfi, efi = best[0], rel(best[1], o16)
        floor = bt.bytes8 / bw * 1e6
        r = dict(B=B, L=L, us16=t16, us8=t8, us8t=t8t, usfi=tfi, speedup=t16 / t8, vs_fi=tfi / t8,
                 of_floor=floor / t8, err8=rel(o8, o16), err8t=rel(o8t, o16), errfi=efi)
        rows.append(r)
        print(f"| {B} x {L} | {t16:.1f} | {t8:.1f} | {t8t:.1f} | {tfi:.1f} | {r['speedup']:.2f}x | {r['vs_fi']:.2f}x | "
              f"{r['of_floor']:.2f} | {r['err8']:.1e}, {efi:.1e} |", flush=True)
        del bt
        torch.cuda.empty_cache()
    prefill = prefill_table(gen, fi=not args.no_fi) if args.prefill else []
    acc = {}
    if args.acc:
        bt = Batch(8, 4096, gen, outliers=True)
        ref = bt.reference()
        f16, o16 = bt.kvplug(bt.k, bt.v)
        f8, o8 = bt.kvplug(bt.k8, bt.v8, bt.ks, bt.vs)
        f8t, o8t = bt.kvplug(bt.k8t, bt.v8t, bt.kt, bt.vt)
        f16(), f8(), f8t()
        acc = dict(bf16=rel(o16, ref), token_head=rel(o8, ref), tensor=rel(o8t, ref))
        if not args.no_fi:
            ffi, ofi = bt.fi_fp8(False)
            ffi()
            acc["flashinfer_tensor"] = rel(ofi, ref)
        torch.cuda.synchronize()
        print("\nAccuracy, B=8 x L=4096, 4 K channels 20-50x: relative L2 error against float64 over the bf16 K/V")
        print("| cache | error |\n|---|---|")
        for k, v in acc.items():
            print(f"| {k} | {v:.2e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bw=bw, rows=rows, prefill=prefill, acc=acc), f, indent=1)


if __name__ == "__main__":
    main()
