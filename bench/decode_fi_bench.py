"""Decode beside FlashInfer (Llama-3-8B heads: 32 q, 8 kv, head_dim 128, block
size 16): plain decode at the nine B x L shapes of issue 21 against the
better of FlashInfer's CUDA-core and tensor-core decode, and speculative
verification (q_len new tokens per sequence) against FlashInfer's prefill
wrapper on its fa2 and fa3 backends over the same rows.

kvplug runs attn.paged_decode (split-KV chosen by the library, workspace
given) and, for q_len > 1, also attn.paged_prefill through a plan forced
onto the prefill kernel (decode_route=False), the route such batches took
before the decode kernel took several tokens. Timing: triton's do_bench
(median; it rewrites a 256 MB buffer before every call, so L2 is cold);
random inputs; blocks in shuffled order; outputs compared with FlashInfer's.

Mixed batches (--mixed N:L:C:P,...: N decode rows over L cached tokens each
beside one prompt chunk of C new tokens over P cached, a serving loop's
step with chunked prefill): kvplug's plan (the decode rows on a decode
launch, the chunk on the prefill kernel), the same batch with
decode_route=False (every row on the prefill kernel), and FlashInfer's
prefill wrapper (fa2, fa3) over the whole batch.

Attention sinks (--sinks): the decode kernel with sinks (a float32 logit
per q head) against the same kernel without, at the plain shapes and at
q_len 4 (speculative verification), in the same run; FlashInfer is not
timed. Each pair is timed twice, alternating (plain, sinks, sinks,
plain), and the ratio uses the sums; the spread of the plain kernel's two
timings says how much of a ratio is noise.

Usage: python3 bench/decode_fi_bench.py [--dtype bf16|fp16] [--spec B:L:Q,...] [--mixed N:L:C:P,...] [--no-fa3] [--json FILE]
       python3 bench/decode_fi_bench.py --sinks [--dtype bf16|fp16]
Prints markdown tables.
"""

import argparse
import json
import math
import sys
import time

import torch
from triton.testing import do_bench

from kvplug import attn

HQ, HK, D, BS = 32, 8, 128, 16
PLAIN = [(1, 512), (1, 4096), (1, 16384), (8, 512), (8, 4096), (32, 2048), (32, 4096), (64, 8192), (128, 2048)]


class Batch:
    def __init__(self, dtype, B, L, q_len, gen):
        self.B, self.L, self.q_len = B, L, q_len
        nb = math.ceil(L / BS)
        self.num_blocks = B * nb
        perm = torch.randperm(self.num_blocks, generator=gen, device="cuda").to(torch.int32)
        self.table = perm.view(B, nb).contiguous()
        self.seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        self.k = torch.randn((self.num_blocks, BS, HK, D), dtype=dtype, device="cuda", generator=gen)
        self.v = torch.randn((self.num_blocks, BS, HK, D), dtype=dtype, device="cuda", generator=gen)
        self.q = torch.randn((B * q_len, HQ, D), dtype=dtype, device="cuda", generator=gen)
        self.kv_indptr = torch.arange(0, B + 1, dtype=torch.int32, device="cuda") * nb
        self.kv_indices = self.table.flatten()
        self.last = torch.full((B,), (L - 1) % BS + 1, dtype=torch.int32, device="cuda")
        self.qo = torch.arange(0, B + 1, dtype=torch.int32, device="cuda") * q_len
        self.bytes = 2 * B * L * HK * D * self.k.element_size()

    def kvplug(self, sinks=None):
        ws = torch.empty(attn.workspace_size(self.B * self.q_len, HQ, D), dtype=torch.uint8, device="cuda")
        out = torch.empty_like(self.q)
        return lambda: attn.paged_decode(self.q, self.k, self.v, self.table, self.seq_lens, out=out, workspace=ws,
                                         max_seq_len=self.L, q_len=self.q_len, sinks=sinks), out

    def kvplug_prefill_route(self):
        ws = torch.empty(attn.prefill_workspace_size(self.B, self.B * self.q_len, HQ, HK, D), dtype=torch.uint8,
                         device="cuda")
        plan = attn.prefill_plan(self.qo, self.seq_lens, HQ, HK, D, self.q.dtype, ws, qo_indptr_host=self.qo.cpu(),
                                 kv_lens_host=[self.L] * self.B, decode_route=False)
        out = torch.empty_like(self.q)
        return lambda: attn.paged_prefill(plan, self.q, self.k, self.v, self.table, out=out), out

    def fi_decode(self, tensor_cores):
        import flashinfer
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
        w.plan(self.kv_indptr, self.kv_indices, self.last, HQ, HK, D, BS, q_data_type=self.q.dtype,
               kv_data_type=self.q.dtype)
        out = torch.empty_like(self.q)
        return lambda: w.run(self.q, (self.k, self.v), out=out), out

    def fi_prefill(self, backend):
        import flashinfer
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(self.qo, self.kv_indptr, self.kv_indices, self.last, HQ, HK, D, BS, causal=True,
               q_data_type=self.q.dtype, kv_data_type=self.q.dtype)
        out = torch.empty_like(self.q)
        return lambda: w.run(self.q, (self.k, self.v), out=out), out


class MixedBatch(Batch):
    """n decode rows over L tokens each, then one chunk of c new tokens over
    p cached (its kv_len p + c)."""

    def __init__(self, dtype, n, L, c, p, gen):
        lens, qls = [L] * n + [p + c], [1] * n + [c]
        nbs = [math.ceil(x / BS) for x in lens]
        self.B, self.L = len(lens), max(lens)
        self.num_blocks = sum(nbs)
        perm = torch.randperm(self.num_blocks, generator=gen, device="cuda").to(torch.int32)
        width = max(nbs)
        self.table = torch.zeros((self.B, width), dtype=torch.int32, device="cuda")
        ind, o = [0], 0
        for b, nb in enumerate(nbs):
            self.table[b, :nb] = perm[o:o + nb]
            o += nb
            ind.append(o)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self.lens_h, self.qls = lens, qls
        self.k = torch.randn((self.num_blocks, BS, HK, D), dtype=dtype, device="cuda", generator=gen)
        self.v = torch.randn((self.num_blocks, BS, HK, D), dtype=dtype, device="cuda", generator=gen)
        T = sum(qls)
        self.q = torch.randn((T, HQ, D), dtype=dtype, device="cuda", generator=gen)
        self.kv_indptr = torch.tensor(ind, dtype=torch.int32, device="cuda")
        self.kv_indices = perm
        self.last = torch.tensor([(x - 1) % BS + 1 for x in lens], dtype=torch.int32, device="cuda")
        qo = [0]
        for x in qls:
            qo.append(qo[-1] + x)
        self.qo = torch.tensor(qo, dtype=torch.int32, device="cuda")
        self.bytes = 2 * sum(lens) * HK * D * self.k.element_size()

    def kvplug_plan(self, decode_route):
        ws = torch.empty(attn.prefill_workspace_size(self.B, self.q.shape[0], HQ, HK, D), dtype=torch.uint8,
                         device="cuda")
        plan = attn.prefill_plan(self.qo, self.seq_lens, HQ, HK, D, self.q.dtype, ws, qo_indptr_host=self.qo.cpu(),
                                 kv_lens_host=self.lens_h, decode_route=decode_route)
        out = torch.empty_like(self.q)
        return lambda: attn.paged_prefill(plan, self.q, self.k, self.v, self.table, out=out), out, plan


def timed(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3  # us


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def pair(fa, fb):
    """(time a, time b, spread of a): each timed twice, alternating."""
    a1, b1 = timed(fa), timed(fb)
    b2, a2 = timed(fb), timed(fa)
    return (a1 + a2) / 2, (b1 + b2) / 2, abs(a1 - a2) / min(a1, a2)


def sinks_main(dt, gen, res):
    print("| B | L | q_len | splits | no sinks us | sinks us | no sinks / sinks | spread | rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    shapes = [(B, L, 1) for B, L in PLAIN] + [(64, 4096, 4), (32, 2048, 4)]
    for B, L, q_len in shapes:
        b = Batch(dt, B, L, q_len, gen)
        sinks = torch.randn(HQ, device="cuda", generator=gen) * 2
        f0, o0 = b.kvplug()
        f1, o1 = b.kvplug(sinks)
        t0, t1, spread = pair(f0, f1)
        splits = attn.num_splits(dt, D, B, HQ, HK, L) if q_len == 1 else "-"
        res["sinks"].append(dict(B=B, L=L, q_len=q_len, plain_us=t0, sinks_us=t1, spread=spread))
        # The sinks change the output (a sanity check that they were read).
        diff = rel(o1, o0)
        print(f"| {B} | {L} | {q_len} | {splits} | {t0:.1f} | {t1:.1f} | {t0 / t1:.3f} | {spread:.3f} | {diff:.1e} |",
              flush=True)
        del b
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--sinks", action="store_true", help="decode with attention sinks against without, only")
    ap.add_argument("--spec", default="64:4096:4,64:4096:2,32:2048:4,64:4096:8")
    ap.add_argument("--mixed", default="255:2560:512:2048,128:4096:2048:0,32:8192:128:8192,8:16384:512:0")
    ap.add_argument("--no-plain", action="store_true")
    ap.add_argument("--no-fa3", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "plain": [], "spec": [], "mixed": []}
    print(f"# {res['device']} {args.dtype} {res['date']}")
    if args.sinks:
        res["sinks"] = []
        sinks_main(dt, gen, res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    if not args.no_plain:
        print("| B | L | kvplug us | FI CUDA-core us | FI tensor-core us | best FI / kvplug | GB/s kvplug | rel err |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for B, L in PLAIN:
            b = Batch(dt, B, L, 1, gen)
            fk, ok = b.kvplug()
            tk = timed(fk)
            fc, oc = b.fi_decode(False)
            tc = timed(fc)
            ft, _ = b.fi_decode(True)
            tt = timed(ft)
            err = rel(ok, oc)
            res["plain"].append(dict(B=B, L=L, kvplug_us=tk, fi_cuda_us=tc, fi_tc_us=tt, err=err))
            print(f"| {B} | {L} | {tk:.1f} | {tc:.1f} | {tt:.1f} | {min(tc, tt) / tk:.2f} | {b.bytes / tk / 1e3:.0f} | {err:.1e} |",
                  flush=True)
            del b
            torch.cuda.empty_cache()
    backends = ["fa2"] + ([] if args.no_fa3 else ["fa3"])
    print()
    print("| B | L | q_len | kvplug decode us | kvplug prefill route us | " + " | ".join(f"FI {x} us" for x in backends)
          + " | best FI / kvplug | rel err |")
    print("|" + " --- |" * (6 + len(backends)))
    for spec in [s for s in args.spec.split(",") if s]:
        B, L, Q = (int(x) for x in spec.split(":"))
        b = Batch(dt, B, L, Q, gen)
        fk, ok = b.kvplug()
        tk = timed(fk)
        fp, _ = b.kvplug_prefill_route()
        tp = timed(fp)
        tf, err = [], None
        for be in backends:
            f, o = b.fi_prefill(be)
            tf.append(timed(f))
            if err is None:
                err = rel(ok, o)
        res["spec"].append(dict(B=B, L=L, q_len=Q, kvplug_us=tk, kvplug_prefill_route_us=tp,
                                **{f"fi_{x}_us": t for x, t in zip(backends, tf)}, err=err))
        print(f"| {B} | {L} | {Q} | {tk:.1f} | {tp:.1f} | " + " | ".join(f"{t:.1f}" for t in tf)
              + f" | {min(tf) / tk:.2f} | {err:.1e} |", flush=True)
        del b
        torch.cuda.empty_cache()
    if args.mixed:
        print()
        print("| decode rows | over L | chunk | over P | kvplug us | kvplug, all rows on the prefill kernel us | "
              + " | ".join(f"FI {x} us" for x in backends) + " | best FI / kvplug | rel err |")
        print("|" + " --- |" * (7 + len(backends)))
    for spec in [s for s in args.mixed.split(",") if s]:
        n, L, c, p = (int(x) for x in spec.split(":"))
        b = MixedBatch(dt, n, L, c, p, gen)
        fk, ok, plan = b.kvplug_plan(True)
        assert plan.decode_rows == n, plan
        tk = timed(fk)
        fp, op, _ = b.kvplug_plan(False)
        tp = timed(fp)
        tf, err = [], rel(ok, op)
        for be in backends:
            f, o = b.fi_prefill(be)
            tf.append(timed(f))
            err = max(err, rel(ok, o))
        res["mixed"].append(dict(decode_rows=n, L=L, chunk=c, prefix=p, kvplug_us=tk, kvplug_prefill_kernel_us=tp,
                                 **{f"fi_{x}_us": t for x, t in zip(backends, tf)}, err=err))
        print(f"| {n} | {L} | {c} | {p} | {tk:.1f} | {tp:.1f} | " + " | ".join(f"{t:.1f}" for t in tf)
              + f" | {min(tf) / tk:.2f} | {err:.1e} |", flush=True)
        del b
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
