"""Shared-prefix decode attention benchmark (fp16, 32 q / 8 kv heads,
head_dim 128, block size 16).

For each case (B sequences sharing a tree of prefixes, each with its own
tail) it times, in one process: kvplug's cascade run (kvplug.cascade,
planned once outside the timing), kvplug's plain paged decode over the same
cache and tables, and, when flashinfer imports, FlashInfer's decode wrapper
(tensor cores) and its multi-level cascade wrapper (one level per tree
level). The floor is the step's unique K/V bytes at the copy bandwidth
measured in the same run (a 1 GiB device-to-device copy: read + write bytes
over its median time).

Timing: each call is preceded by a 256 MiB write that evicts L2 (50 MB on an
H100) and a 1 ms spin kernel (so the host has enqueued the call before the
GPU reaches it), and timed alone with CUDA events; the median of --iters
calls is reported. Outputs are checked against plain decode (max abs difference).

With --prefill it also times varlen prefill batches (requests sharing a
cached prompt, each with new tokens) against kvplug's paged prefill.

With --fp8 it also writes each case's K/V into an e4m3 cache (per-token-head
scales, kv_write) and times kvplug's cascade over it (planned with
hopper=False, routed as the 16-bit plan is) and the FP8 paged decode, in a
second table beside the 16-bit cascade, with the FP8 output's relative error
against the 16-bit one.

Usage: python3 bench/cascade_bench.py [--iters N] [--no-flashinfer] [--prefill] [--probes] [--fp8] [--out DIR]
Prints a markdown table; writes JSON to DIR (default $OUT or .).
"""

import argparse
import json
import os
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))
import kvplug  # noqa: E402
from kvplug import cascade  # noqa: E402

HQ, HK, D, BS = 32, 8, 128, 16


def copy_bandwidth(dev, flush, iters=20):
    """GB/s of a 1 GiB device-to-device copy (bytes read + written), timed as
    every case is."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), flush, iters) / 1e3


def make_case(B, levels, tail):
    """levels: [(group_size, tokens)] from the root: sequences
    [g*group_size, (g+1)*group_size) share `tokens` more tokens (whole
    blocks). Each sequence then owns `tail` tokens."""
    rows = [[] for _ in range(B)]
    next_block = 0
    level_pages = []  # per level: list of (seq_lo, seq_hi, pages)
    for gsize, tokens in levels:
        nb = tokens // BS
        groups = []
        for lo in range(0, B, gsize):
            pages = list(range(next_block, next_block + nb))
            next_block += nb
            for s in range(lo, min(B, lo + gsize)):
                rows[s].extend(pages)
            groups.append((lo, min(B, lo + gsize), pages))
        level_pages.append(groups)
    own = []
    for s in range(B):
        nb = -(-tail // BS)
        pages = list(range(next_block, next_block + nb))
        next_block += nb
        own.append(pages)
        rows[s].extend(pages)
    shared = sum(t for _, t in levels)
    lens = [shared + tail] * B
    width = max(len(r) for r in rows)
    table = torch.full((B, width), -1, dtype=torch.int32)
    for s, r in enumerate(rows):
        table[s, : len(r)] = torch.tensor(r, dtype=torch.int32)
    unique_tokens = sum(len(p) * BS for groups in level_pages for _, _, p in groups) + B * tail
    return table, lens, next_block, level_pages, own, unique_tokens


CASES = [
    ("B=32 P=2048 S=512", 32, [(32, 2048)], 512),
    ("B=64 P=4096 S=512", 64, [(64, 4096)], 512),
    ("B=96 P=1024 S=512", 96, [(96, 1024)], 512),
    ("B=128 P=8192 S=256", 128, [(128, 8192)], 256),
    ("two-level 128x4096 + 8x16x1024, S=256", 128, [(128, 4096), (16, 1024)], 256),
    ("fork 64 x 4096, S=128", 64, [(64, 4096)], 128),
    ("no sharing B=32 L=4096", 32, [], 4096),
    ("no sharing B=128 L=2048", 128, [], 2048),
]

# --probes: cases that separate the cascade's costs: the shared items nearly
# alone (16-token tails), and the tails alone at the issue cases' tail sizes.
PROBES = [
    ("probe: B=32 P=2048 S=16 (shared)", 32, [(32, 2048)], 16),
    ("probe: B=128 P=8192 S=16 (shared)", 128, [(128, 8192)], 16),
    ("probe: B=8 P=2048 S=512", 8, [(8, 2048)], 512),
    ("probe: no sharing B=32 L=576 (tails)", 32, [], 576),
    ("probe: no sharing B=128 L=256 (tails)", 128, [], 256),
]


def timed(fn, flush, iters):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Keep the GPU busy (about 1 ms) while the host enqueues the call, so
        # the events time the kernels, not Python's launch overhead.
        torch.cuda._sleep(2_000_000)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def flashinfer_fns(fi, q, k, v, lens, level_pages, own, B):
    dev = q.device
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    fns = {}
    # Plain decode over each sequence's whole page list.
    indptr, indices, last = [0], [], []
    for s in range(B):
        pages = [p for groups in level_pages for lo, hi, ps in groups if lo <= s < hi for p in ps] + own[s]
        indices += pages
        indptr.append(len(indices))
        last.append(lens[s] - (len(pages) - 1) * BS)
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(t(indptr), t(indices), t(last), HQ, HK, D, BS, q_data_type=q.dtype, kv_data_type=k.dtype)
    fns["fi_decode"] = lambda: w.run(q, (k, v))
    if level_pages:
        ws2 = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        qo, kvi, kvx, kvl = [], [], [], []
        for groups in level_pages:
            qo.append(t([0] + [hi for _, hi, _ in groups]))
            ip, ix, ll = [0], [], []
            for _, _, ps in groups:
                ix += ps
                ip.append(len(ix))
                ll.append(BS)
            kvi.append(t(ip))
            kvx.append(t(ix))
            kvl.append(t(ll))
        ip, ix, ll = [0], [], []
        for s in range(B):
            ix += own[s]
            ip.append(len(ix))
            ll.append(lens[s] - sum(len(ps) for groups in level_pages for lo, hi, ps in groups if lo <= s < hi) * BS
                      - (len(own[s]) - 1) * BS)
        qo.append(t(list(range(B + 1))))
        kvi.append(t(ip))
        kvx.append(t(ix))
        kvl.append(t(ll))
        cw = fi.MultiLevelCascadeAttentionWrapper(len(qo), ws2, "NHD")
        cw.plan(qo, kvi, kvx, kvl, HQ, HK, D, BS, causal=False, q_data_type=q.dtype)
        fns["fi_cascade"] = lambda: cw.run(q, (k, v))
    return fns


# Prefill cases: B requests share a cached prompt of P tokens, request s has
# q_lens[s] new tokens (its own part is just them).
PREFILL_CASES = [
    ("8 x 200-900 new over a shared 4096", 4096, [200 + 100 * s for s in range(8)]),
    ("16 x 256 new over a shared 8192", 8192, [256] * 16),
    ("32 x 64 new (chunks) over a shared 4096", 4096, [64] * 32),
]


def prefill_case(P, qlens, dev):
    """A PREFILL_CASES batch: each sequence holds the shared P-token prompt's
    blocks then its own for its qlens[b] new tokens. Returns the host block
    table, the lengths, the query offsets (lists) and random fp16 K, V and q."""
    rows, nxt = [], P // BS
    for n in qlens:
        own = -(-n // BS)
        rows.append(list(range(P // BS)) + list(range(nxt, nxt + own)))
        nxt += own
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)
    lens = [P + n for n in qlens]
    qo = [0]
    for n in qlens:
        qo.append(qo[-1] + n)
    k = torch.randn(nxt, BS, HK, D, dtype=torch.float16, device=dev)
    v = torch.randn(nxt, BS, HK, D, dtype=torch.float16, device=dev)
    q = torch.randn(qo[-1], HQ, D, dtype=torch.float16, device=dev)
    return table, lens, qo, k, v, q


def prefill_cases(dev, flush, iters):
    """Times the cascade (routed, and its kernels) against kvplug's paged
    prefill on the PREFILL_CASES; returns their rows."""
    rows_out = []
    print()
    print("| prefill case | new tokens | kvplug cascade, routed (us) | cascade kernels (us) | kvplug paged_prefill (us) | route | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, P, qlens in PREFILL_CASES:
        B = len(qlens)
        table, lens, qo, k, v, q = prefill_case(P, qlens, dev)
        T = qo[-1]
        table_d = table.to(dev)
        lens_h, qo_h = torch.tensor(lens, dtype=torch.int32), torch.tensor(qo, dtype=torch.int32)
        lens_d, qo_d = lens_h.to(dev), qo_h.to(dev)
        plans = []
        for route in (True, False):
            ws = cascade.Workspaces(B, HQ, HK, D, device=dev, max_tokens=2 * T)
            plans.append(cascade.plan(table, lens_h, lens_d, HQ, HK, D, torch.float16, ws, block_size=BS,
                                      decode_route=route, qo_indptr_host=qo_h, qo_indptr=qo_d))
        pws = torch.empty(kvplug.attn.prefill_workspace_size(B, T, HQ, HK, D), dtype=torch.uint8, device=dev)
        pplan = kvplug.attn.prefill_plan(qo_d, lens_d, HQ, HK, D, torch.float16, pws, qo_indptr_host=qo_h,
                                         kv_lens_host=lens_h)
        outs = [torch.empty_like(q) for _ in range(3)]
        row = {"case": name, "prefill": True, "P": P, "q_lens": qlens, "route": plans[0].route}
        row["cascade_us"] = timed(lambda: cascade.paged_cascade(plans[0], q, k, v, table_d, out=outs[0]), flush, iters)
        row["cascade_kernels_us"] = timed(lambda: cascade.paged_cascade(plans[1], q, k, v, table_d, out=outs[1]),
                                          flush, iters)
        row["prefill_us"] = timed(lambda: kvplug.attn.paged_prefill(pplan, q, k, v, table_d, out=outs[2]), flush, iters)
        torch.cuda.synchronize()
        row["max_abs_diff"] = max(float((o.float() - outs[2].float()).abs().max()) for o in outs[:2])
        route = {cascade.ROUTE_CASCADE: "cascade", cascade.ROUTE_PREFILL: "prefill"}.get(plans[0].route, "?")
        print(f"| {name} | {T} | {row['cascade_us']:.1f} | {row['cascade_kernels_us']:.1f} | {row['prefill_us']:.1f} | "
              f"{route} | {row['max_abs_diff']:.2g} |", flush=True)
        rows_out.append(row)
        del k, v
    return rows_out


def fp8_case(row, q, k, v, table, table_d, lens_h, lens_d, ws, out16, flush, iters):
    """--fp8: the case's K/V in an e4m3 cache; times its cascade (planned for
    the device, routed: on a Hopper GPU the shared items on the wgmma
    mainloop that widens e4m3 tiles; and planned for the sm_80 kernels) and
    its paged decode into row."""
    nb, dev = k.shape[0], k.device
    k8 = torch.empty(k.shape, dtype=torch.float8_e4m3fn, device=dev)
    v8 = torch.empty_like(k8)
    ks = torch.empty(k.shape[:3], dtype=torch.float32, device=dev)
    vs = torch.empty_like(ks)
    slots = torch.arange(nb * BS, dtype=torch.int32, device=dev)
    kvplug.attn.kv_write(k.view(-1, HK, D), v.view(-1, HK, D), k8, v8, slots, k_scale=ks, v_scale=vs)
    out = torch.empty_like(q)
    plan = cascade.plan(table, lens_h, lens_d, HQ, HK, D, torch.float16, ws, block_size=BS, hopper=False)
    row["fp8_cascade_sm80_us"] = timed(lambda: cascade.paged_cascade(plan, q, k8, v8, table_d, out=out, k_scale=ks,
                                                                     v_scale=vs), flush, iters)
    plan = cascade.plan(table, lens_h, lens_d, HQ, HK, D, torch.float16, ws, block_size=BS)
    row["fp8_cascade_us"] = timed(lambda: cascade.paged_cascade(plan, q, k8, v8, table_d, out=out, k_scale=ks,
                                                                v_scale=vs), flush, iters)
    B = q.shape[0]
    dws = torch.empty(kvplug.attn.workspace_size(B, HQ, D), dtype=torch.uint8, device=dev)
    out_d = torch.empty_like(q)
    row["fp8_decode_us"] = timed(lambda: kvplug.attn.paged_decode(q, k8, v8, table_d, lens_d, out=out_d, workspace=dws,
                                                                  k_scale=ks, v_scale=vs), flush, iters)
    torch.cuda.synchronize()
    row["fp8_route"] = plan.route
    row["fp8_rel_err"] = float((out.float() - out16.float()).norm() / out16.float().norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--fi-budget-s", type=float, default=240, help="skip FlashInfer once the run is this old")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--prefill", action="store_true", help="also the varlen prefill cases (kvplug only)")
    ap.add_argument("--probes", action="store_true", help="also the PROBES cases (shared items or tails alone)")
    ap.add_argument("--fp8", action="store_true", help="also the cascade and decode over an e4m3 cache")
    args = ap.parse_args()
    t0 = time.time()
    fi = None
    if not args.no_flashinfer:
        try:
            import flashinfer as fi  # noqa: F811
        except Exception as e:  # noqa: BLE001
            print(f"flashinfer not available: {e!r}"[:300], file=sys.stderr)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    gbps = copy_bandwidth(dev, flush)
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {gbps:.0f} GB/s (the floor's)")
    results = []
    print("| case | floor (us) | kvplug cascade, routed (us) | cascade kernels (us) | kvplug paged_decode (us) | FlashInfer decode (us) | FlashInfer cascade (us) | route | saved/total | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, B, levels, tail in CASES + (PROBES if args.probes else []):
        table, lens, nblocks, level_pages, own, uniq = make_case(B, levels, tail)
        k = torch.randn(nblocks, BS, HK, D, dtype=torch.float16, device=dev)
        v = torch.randn(nblocks, BS, HK, D, dtype=torch.float16, device=dev)
        q = torch.randn(B, HQ, D, dtype=torch.float16, device=dev)
        table_d = table.to(dev)
        lens_h = torch.tensor(lens, dtype=torch.int32)
        lens_d = lens_h.to(dev)
        ws = cascade.Workspaces(B, HQ, HK, D, device=dev)
        plan = cascade.plan(table, lens_h, lens_d, HQ, HK, D, torch.float16, ws, block_size=BS)
        # The cascade kernels whatever the route (the cost model's input).
        ws_k = cascade.Workspaces(B, HQ, HK, D, device=dev)
        plan_k = cascade.plan(table, lens_h, lens_d, HQ, HK, D, torch.float16, ws_k, block_size=BS, decode_route=False)
        out_k = torch.empty_like(q)
        out_c = torch.empty_like(q)
        out_d = torch.empty_like(q)
        dws = torch.empty(kvplug.attn.workspace_size(B, HQ, D), dtype=torch.uint8, device=dev)
        row = {"case": name, "B": B, "levels": levels, "tail": tail,
               "floor_us": uniq * HK * D * 2 * 2 / (gbps * 1e3), "copy_gbps": gbps, "route": plan.route,
               "saved_tokens": plan.saved_tokens, "total_tokens": plan.total_tokens, "items": plan.num_items}
        fc = lambda: cascade.paged_cascade(plan, q, k, v, table_d, out=out_c)  # noqa: E731
        fd = lambda: kvplug.attn.paged_decode(q, k, v, table_d, lens_d, out=out_d, workspace=dws)  # noqa: E731
        row["cascade_us"] = timed(fc, flush, args.iters)
        row["cascade_kernels_us"] = timed(lambda: cascade.paged_cascade(plan_k, q, k, v, table_d, out=out_k), flush,
                                          args.iters)
        row["decode_us"] = timed(fd, flush, args.iters)
        torch.cuda.synchronize()
        row["max_abs_diff"] = max(float((out_c.float() - out_d.float()).abs().max()),
                                  float((out_k.float() - out_d.float()).abs().max()))
        if args.fp8:
            fp8_case(row, q, k, v, table, table_d, lens_h, lens_d, ws, out_c, flush, args.iters)
        if fi is not None and time.time() - t0 < args.fi_budget_s:
            try:
                for key, f in flashinfer_fns(fi, q, k, v, lens, level_pages, own, B).items():
                    row[key + "_us"] = timed(f, flush, args.iters)
            except Exception as e:  # noqa: BLE001
                row["fi_error"] = repr(e)[:300]
        results.append(row)

        def f(x):
            return f"{row[x]:.1f}" if x in row else "-"

        print(f"| {name} | {row['floor_us']:.1f} | {f('cascade_us')} | {f('cascade_kernels_us')} | {f('decode_us')} | {f('fi_decode_us')} | "
              f"{f('fi_cascade_us')} | {'cascade' if plan.route == cascade.ROUTE_CASCADE else 'decode'} | "
              f"{plan.saved_tokens / max(plan.total_tokens, 1):.2f} | {row['max_abs_diff']:.2g} |", flush=True)
        del k, v, ws, ws_k
    if args.fp8:
        print()
        print("| case | 16-bit cascade, routed (us) | FP8 cascade, routed (us) | FP8 / 16-bit | FP8 cascade, sm_80 plan (us) "
              "| FP8 paged_decode (us) | 16-bit paged_decode (us) | FP8 rel err vs 16-bit |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in results:
            print(f"| {r['case']} | {r['cascade_us']:.1f} | {r['fp8_cascade_us']:.1f} | "
                  f"{r['fp8_cascade_us'] / r['cascade_us']:.2f} | {r['fp8_cascade_sm80_us']:.1f} | {r['fp8_decode_us']:.1f} | "
                  f"{r['decode_us']:.1f} | {r['fp8_rel_err']:.1e} |")
    if args.prefill:
        results += prefill_cases(dev, flush, args.iters)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cascade_bench.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": results}, indent=1))
    for r in results:
        if "fi_error" in r:
            print(f"{r['case']}: flashinfer error {r['fi_error']}", file=sys.stderr)


if __name__ == "__main__":
    main()
