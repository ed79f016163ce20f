"""Paged prefill / extend attention benchmark (Llama-3-8B heads: 32 q, 8 kv,
head_dim 128, block size 16).

For each dtype, new tokens per sequence Q, cached prefix P and batch B it
times, in the same run: kvplug (attn.paged_prefill after one prefill_plan),
FlashInfer's BatchPrefillWithPagedKVCacheWrapper with backend "fa2" and
"fa3" over the same paged cache (when flashinfer imports), and torch SDPA
(flash backend) over the same K/V stored contiguously (K/V expanded to the
q heads, bottom-right causal mask). Plus a mixed batch (4 prefill chunks of
512 new tokens over a 1536-token prefix + 64 decodes at 2048 context):
kvplug in one call against FlashInfer's prefill wrapper on the whole batch
and against the sum of FlashInfer's separate prefill (the 4 chunks) and
decode (the 64 decodes) calls.

TFLOP/s counts causal FLOPs once: 4 * D * heads * sum over rows of the
tokens the row sees. Timing: triton.testing.do_bench, median; inputs are
random (never zeros); blocks are allocated in a shuffled order.

Attention sinks (--sinks): at each shape, the prefill kernel with sinks (a
float32 logit per q head) against the same kernel without, and with a
window of --window tokens with and without sinks, on the Hopper mainloop
(and with --sm80 the sm_80 one), in the same run; no other system is
timed. The four variants are timed in five rounds (the order reversed every
other round) and each keeps the median of its five; the spread ((slowest -
fastest) / median of the plain kernel's five) says how much of a ratio is
noise.

Usage: python3 bench/prefill_bench.py [--quick] [--no-fa3] [--out DIR]
       python3 bench/prefill_bench.py --split-check   (split-KV against one split)
       python3 bench/prefill_bench.py --sinks [--window W] [--sm80] [--shapes B:new:prefix,...]
"""

import argparse
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kvplug import attn

HQ, HK, D, BS = 32, 8, 128, 16


def flops(q_lens, kv_lens):
    rows = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in zip(q_lens, kv_lens))
    return 4.0 * D * HQ * rows


class Case:
    def __init__(self, dtype, q_lens, kv_lens, gen):
        self.dtype, self.q_lens, self.kv_lens = dtype, q_lens, kv_lens
        nblk = [math.ceil(k / BS) for k in kv_lens]
        self.num_blocks = sum(nblk)
        perm = torch.randperm(self.num_blocks, generator=gen, device="cuda").to(torch.int32)
        self.max_blocks = max(nblk)
        table = torch.zeros((len(q_lens), self.max_blocks), dtype=torch.int32, device="cuda")
        indices, indptr, nxt = [], [0], 0
        for b, n in enumerate(nblk):
            table[b, :n] = perm[nxt:nxt + n]
            indices.append(perm[nxt:nxt + n])
            nxt += n
            indptr.append(nxt)
        self.table = table
        self.kv_indices = torch.cat(indices)
        self.kv_indptr = torch.tensor(indptr, dtype=torch.int32, device="cuda")
        self.last_page = torch.tensor([(k - 1) % BS + 1 for k in kv_lens], dtype=torch.int32, device="cuda")
        shape = (self.num_blocks, BS, HK, D)
        self.k_cache = torch.randn(shape, dtype=dtype, device="cuda", generator=gen)
        self.v_cache = torch.randn(shape, dtype=dtype, device="cuda", generator=gen)
        qo = [0]
        for n in q_lens:
            qo.append(qo[-1] + n)
        self.qo_host = qo
        self.qo = torch.tensor(qo, dtype=torch.int32, device="cuda")
        self.kvl = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
        self.q = torch.randn((qo[-1], HQ, D), dtype=dtype, device="cuda", generator=gen)
        self.flops = flops(q_lens, kv_lens)

    def kvplug(self, hopper=True, sinks=None, window_left=-1, k_scale=None, v_scale=None, fp8_qkv=False):
        ws = torch.empty(attn.prefill_workspace_size(len(self.q_lens), self.q.shape[0], HQ, HK, D),
                         dtype=torch.uint8, device="cuda")
        plan = attn.prefill_plan(self.qo, self.kvl, HQ, HK, D, self.dtype, ws, window_left=window_left,
                                 qo_indptr_host=self.qo_host, kv_lens_host=self.kv_lens, hopper=hopper,
                                 fp8_qkv=fp8_qkv)
        out = torch.empty_like(self.q)
        t0 = time.perf_counter()  # host cost of a plan (checks + one small launch)
        for _ in range(20):
            attn.prefill_plan(self.qo, self.kvl, HQ, HK, D, self.dtype, ws,
                              qo_indptr_host=self.qo_host, kv_lens_host=self.kv_lens, hopper=hopper)
        t_plan = (time.perf_counter() - t0) / 20 * 1e3
        fn = lambda: attn.paged_prefill(plan, self.q, self.k_cache, self.v_cache, self.table, out=out,  # noqa: E731
                                        sinks=sinks, k_scale=k_scale, v_scale=v_scale)
        return fn, out, t_plan

    def flashinfer(self, backend):
        import flashinfer
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(self.qo, self.kv_indptr, self.kv_indices, self.last_page, HQ, HK, D, BS, causal=True,
               q_data_type=self.dtype, kv_data_type=self.dtype)
        out = torch.empty_like(self.q)
        return lambda: w.run(self.q, (self.k_cache, self.v_cache), out=out), out

    def sdpa(self):
        # Uniform batches only: [B, HQ, q, D] against contiguous [B, HQ, kv, D].
        assert len(set(self.q_lens)) == 1 and len(set(self.kv_lens)) == 1
        B, q, kv = len(self.q_lens), self.q_lens[0], self.kv_lens[0]
        blk = self.table[:, :math.ceil(kv / BS)].long()
        k = self.k_cache[blk].reshape(B, -1, HK, D)[:, :kv].repeat_interleave(HQ // HK, dim=2).transpose(1, 2).contiguous()
        v = self.v_cache[blk].reshape(B, -1, HK, D)[:, :kv].repeat_interleave(HQ // HK, dim=2).transpose(1, 2).contiguous()
        qq = self.q.view(B, q, HQ, D).transpose(1, 2).contiguous()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(q, kv)

        def fn():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qq, k, v, attn_mask=mask)
        return fn, lambda o: o.transpose(1, 2).reshape(-1, HQ, D)


def timed(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def split_check():
    """Small batches timed with the plan's split-KV choice and with
    split_kv=False, in the same run."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    print("| dtype | new | prefix | batch | splits | kvplug TFLOP/s | no-split TFLOP/s | split gain | rel diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dn, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for new, pre, B in ((128, 2048, 1), (128, 8192, 1), (512, 2048, 1), (512, 8192, 1), (128, 0, 1), (128, 2048, 8)):
            c = Case(dt, [new] * B, [pre + new] * B, gen)
            ws = torch.empty(attn.prefill_workspace_size(B, B * new, HQ, HK, D), dtype=torch.uint8, device="cuda")
            outs, ts, ns = [], [], []
            for split in (True, False):
                plan = attn.prefill_plan(c.qo, c.kvl, HQ, HK, D, dt, ws, qo_indptr_host=c.qo_host,
                                         kv_lens_host=c.kv_lens, split_kv=split)
                out = torch.empty_like(c.q)
                ts.append(timed(lambda: attn.paged_prefill(plan, c.q, c.k_cache, c.v_cache, c.table, out=out)))
                outs.append(out.float())
                ns.append(plan.num_splits)
            rd = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
            print(f"| {dn} | {new} | {pre} | {B} | {ns[0]} | {c.flops / ts[0] / 1e9:.0f} | {c.flops / ts[1] / 1e9:.0f} "
                  f"| {ts[1] / ts[0]:.2f} | {rd:.1e} |", flush=True)


def sinks_main(args):
    """--sinks: kvplug with sinks against kvplug without, same run."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    dts = {"bf16": torch.bfloat16, "fp16": torch.float16}
    shapes = [tuple(int(x) for x in t.split(":")) for t in args.shapes.split(",") if t] or \
        [(1, 2048, 0), (8, 512, 2048), (1, 8192, 0), (32, 512, 0), (8, 2048, 8192)]
    loops = [("sm90", True)] + ([("sm80", False)] if args.sm80 else [])
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d')}, window {args.window}")
    print("| dtype | mainloop | new | prefix | batch | TFLOP/s | sinks/none | spread | window+sinks/window | spread |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for dn in args.dtypes.split(","):
        dt = dts[dn]
        for B, new, pre in shapes:
            c = Case(dt, [new] * B, [pre + new] * B, gen)
            sinks = torch.randn(HQ, device="cuda", generator=gen) * 2
            for name, hopper in loops:
                f0, _, _ = c.kvplug(hopper)
                f1, _, _ = c.kvplug(hopper, sinks)
                w0, _, _ = c.kvplug(hopper, None, args.window - 1)
                w1, _, _ = c.kvplug(hopper, sinks, args.window - 1)
                fs = (f0, f1, w0, w1)
                rounds = []
                for i in range(5):
                    order = range(4) if i % 2 == 0 else range(3, -1, -1)
                    t = {j: timed(fs[j]) for j in order}
                    rounds.append([t[j] for j in range(4)])
                t0, t1, tw0, tw1 = (sorted(col)[2] for col in zip(*rounds))
                a, c_ = [x[0] for x in rounds], [x[2] for x in rounds]
                r = {"dtype": dn, "mainloop": name, "new": new, "prefix": pre, "batch": B, "window": args.window,
                     "plain_ms": t0, "sinks_ms": t1, "window_ms": tw0, "window_sinks_ms": tw1, "rounds": rounds,
                     "spread": (max(a) - min(a)) / t0, "window_spread": (max(c_) - min(c_)) / tw0}
                results.append(r)
                print(f"| {dn} | {name} | {new} | {pre} | {B} | {c.flops / t0 / 1e9:.0f} | {t0 / t1:.3f} | "
                      f"{r['spread']:.3f} | {tw0 / tw1:.3f} | {r['window_spread']:.3f} |", flush=True)
            del c
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "argv": sys.argv}
    with open(os.path.join(args.out, "prefill_sinks_bench.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


def main():
    if "--split-check" in sys.argv:
        return split_check()
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-fa3", action="store_true")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--max-tokens", type=int, default=16384, help="skip points with batch * new tokens above this")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="", help="B:new:prefix,... instead of the grid (e.g. the issue's eight)")
    ap.add_argument("--sm80", action="store_true", help="also time the sm_80 kernel (hopper=False) on a Hopper GPU")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--sinks", action="store_true", help="kvplug with attention sinks against without, only")
    ap.add_argument("--window", type=int, default=1024, help="--sinks: the window (tokens) of the window pairs")
    args = ap.parse_args()
    if args.sinks:
        return sinks_main(args)
    backends = []
    if not args.no_flashinfer:
        try:
            import flashinfer  # noqa: F401
            backends = ["fa2"] + ([] if args.no_fa3 else ["fa3"])
        except Exception as e:  # noqa: BLE001
            print(f"flashinfer not available: {e}", file=sys.stderr)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dts = {"bf16": torch.bfloat16, "fp16": torch.float16}
    news = [128, 512, 2048, 8192] if not args.quick else [512, 2048]
    prefixes = [0, 2048, 8192] if not args.quick else [0, 2048]
    batches = [1, 8, 32] if not args.quick else [1, 8]
    results = []
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d')}", flush=True)
    shapes = [tuple(int(x) for x in t.split(":")) for t in args.shapes.split(",") if t]
    hdr = "| dtype | new | prefix | batch | kvplug TFLOP/s | " + ("kvplug sm80 TFLOP/s | sm90/sm80 | " if args.sm80 else "") + "".join(f"{b} TFLOP/s | kvplug/{b} | " for b in backends) + ("" if args.no_sdpa else "SDPA TFLOP/s | kvplug/SDPA |")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for dn in args.dtypes.split(","):
        dt = dts[dn]
        grid = shapes or [(B, new, pre) for new in news for pre in prefixes for B in batches if B * new <= args.max_tokens]
        for B, new, pre in grid:
            c = Case(dt, [new] * B, [pre + new] * B, gen)
            fn, out, t_plan = c.kvplug()
            t = timed(fn)
            r = {"dtype": dn, "new": new, "prefix": pre, "batch": B, "kvplug_ms": t, "plan_ms": t_plan,
                 "flops": c.flops}
            row = f"| {dn} | {new} | {pre} | {B} | {c.flops / t / 1e9:.0f} |"
            if args.sm80:
                f8, o8, _ = c.kvplug(hopper=False)
                t8 = timed(f8)
                r["sm80_ms"], r["sm80_err"] = t8, rel(out, o8)
                row += f" {c.flops / t8 / 1e9:.0f} | {t8 / t:.2f} |"
            for be in backends:
                try:
                    f2, o2 = c.flashinfer(be)
                    t2 = timed(f2)
                    r[be + "_ms"] = t2
                    r[be + "_err"] = rel(out, o2)
                    row += f" {c.flops / t2 / 1e9:.0f} | {t2 / t:.2f} |"
                except Exception as e:  # noqa: BLE001
                    r[be + "_error"] = repr(e)[:300]
                    row += " err | - |"
            if not args.no_sdpa:
                try:
                    f3, conv = c.sdpa()
                    t3 = timed(f3)
                    r["sdpa_ms"] = t3
                    r["sdpa_err"] = rel(out, conv(f3()))
                    row += f" {c.flops / t3 / 1e9:.0f} | {t3 / t:.2f} |"
                except Exception as e:  # noqa: BLE001
                    r["sdpa_error"] = repr(e)[:300]
                    row += " err | - |"
            print(row, flush=True)
            results.append(r)
            del c
            torch.cuda.empty_cache()
        # Mixed batch: 4 chunks of 512 over a 1536-token prefix + 64 decodes at 2048.
        q_lens = [512] * 4 + [1] * 64
        kv_lens = [2048] * 68
        c = Case(dt, q_lens, kv_lens, gen)
        fn, out, t_plan = c.kvplug()
        t = timed(fn)
        r = {"dtype": dn, "mixed": True, "kvplug_ms": t, "plan_ms": t_plan, "flops": c.flops}
        line = f"mixed {dn}: kvplug {t * 1e3:.1f} us"
        if backends:
            try:
                f2, o2 = c.flashinfer("fa2")
                t2 = timed(f2)
                r["fa2_whole_ms"], r["fa2_err"] = t2, rel(out, o2)
                pre = Case(dt, [512] * 4, [2048] * 4, gen)
                fp, _ = pre.flashinfer("fa2")
                tp = timed(fp)
                import flashinfer
                dec = Case(dt, [1] * 64, [2048] * 64, gen)
                ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                wd = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
                wd.plan(dec.kv_indptr, dec.kv_indices, dec.last_page, HQ, HK, D, BS, q_data_type=dt, kv_data_type=dt)
                qd = dec.q
                od = torch.empty_like(qd)
                td = timed(lambda: wd.run(qd, (dec.k_cache, dec.v_cache), out=od))
                r["fi_prefill_ms"], r["fi_decode_ms"] = tp, td
                line += (f"; FlashInfer fa2 whole batch {t2 * 1e3:.1f} us ({t2 / t:.2f}x), separate prefill "
                         f"{tp * 1e3:.1f} + decode {td * 1e3:.1f} = {(tp + td) * 1e3:.1f} us ({(tp + td) / t:.2f}x)")
            except Exception as e:  # noqa: BLE001
                r["fi_error"] = repr(e)[:300]
                line += f"; FlashInfer failed: {e!r}"[:300]
        print(line, flush=True)
        results.append(r)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"), "argv": sys.argv}
    with open(os.path.join(args.out, "prefill_bench.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
