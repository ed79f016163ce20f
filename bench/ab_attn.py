"""Two builds of kvplug's attention, timed against each other in one run.

For a change that must not make any kernel slower (a refactor of the kernels
or of the launch path), this times the same cases through the public Python
API of two builds, A (before) and B (after): the shapes of bench/RESULTS.md's
decode, multi-token, mixed-batch, prefill and shared-prefix tables (32 q / 8
kv heads, head_dim 128, block size 16). Each build runs in its own process
(its library and its bindings), A B B A A B ... for --rounds rounds,
so that clock and thermal drift fall on both alike; a case's time is the
median over the rounds of each round's median. Every process draws the same
seeded random inputs, and the outputs of B are compared with A's (relative
L2 error and max abs difference): a refactor should leave them equal.

Usage (device machine):
    python3 bench/ab_attn.py --a LIB_A:BINDINGS_A --b LIB_B:BINDINGS_B [--rounds 3] [--only REGEX] [--out DIR]
where LIB is a libkvplug.so and BINDINGS the bindings/python folder of the
same build. Prints a markdown table (B / A time per case, 1.00 = unchanged,
above 1 = B faster) and writes ab_attn.json to DIR (default $OUT or .).
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
HQ, HK, D, BS = 32, 8, 128, 16

MULTI = [(64, 4096, 4), (64, 4096, 2), (32, 2048, 4), (64, 4096, 8)]
MIXED = [(255, 2560, 512, 2048), (128, 4096, 2048, 0), (32, 8192, 128, 8192), (8, 16384, 512, 0)]
PREFILL = [(1, 2048, 0), (8, 2048, 0), (1, 8192, 0), (8, 512, 2048), (8, 2048, 8192), (32, 128, 8192),
           (32, 512, 2048), (1, 2048, 8192)]


def worker(out_dir):
    """Times every case with the kvplug on sys.path; writes times and outputs."""
    import torch
    from triton.testing import do_bench

    import kvplug
    from kvplug import attn, cascade

    sys.path.insert(1, str(HERE))
    import cascade_bench
    import decode_fi_bench
    import prefill_bench

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3  # us

    res, outs = {"version": kvplug.__version__}, {}
    only = re.compile(os.environ.get("AB_ATTN_ONLY", ""))

    def case(name, fn, out):
        if not only.search(name):
            return
        res[name] = timed(fn)
        outs[name] = out.detach().clone().cpu()
        print(f"{name}: {res[name]:.1f} us", flush=True)

    for dt_name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        gen = torch.Generator(device="cuda").manual_seed(1)
        for B, L in decode_fi_bench.PLAIN:
            b = decode_fi_bench.Batch(dt, B, L, 1, gen)
            fn, out = b.kvplug()
            case(f"decode {dt_name} B={B} L={L}", fn, out)
        if dt_name != "bf16":
            continue
        for B, L, Q in MULTI:
            b = decode_fi_bench.Batch(dt, B, L, Q, gen)
            fn, out = b.kvplug()
            case(f"multi-token {dt_name} B={B} L={L} q={Q}", fn, out)
            fn, out = b.kvplug_prefill_route()
            case(f"multi-token prefill route {dt_name} B={B} L={L} q={Q}", fn, out)
        for n, L, c, p in MIXED:
            b = decode_fi_bench.MixedBatch(dt, n, L, c, p, gen)
            fn, out, _ = b.kvplug_plan(True)
            case(f"mixed {dt_name} {n}x{L} + {c} over {p}", fn, out)
    for dt_name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        gen = torch.Generator(device="cuda").manual_seed(2)
        for B, new, prefix in PREFILL:
            c = prefill_bench.Case(dt, [new] * B, [new + prefix] * B, gen)
            fn, out, _ = c.kvplug()
            case(f"prefill {dt_name} B={B} new={new} prefix={prefix}", fn, out)
            del c
            torch.cuda.empty_cache()
    dev = torch.device("cuda")
    torch.manual_seed(3)
    for name, B, levels, tail in [c for c in cascade_bench.CASES if c[2]]:  # the cases that share
        table, lens, nblocks, _, _, _ = cascade_bench.make_case(B, levels, tail)
        k = torch.randn(nblocks, BS, HK, D, dtype=torch.float16, device=dev)
        v = torch.randn_like(k)
        q = torch.randn(B, HQ, D, dtype=torch.float16, device=dev)
        lens_h = torch.tensor(lens, dtype=torch.int32)
        lens_d, table_d = lens_h.to(dev), table.to(dev)
        ws = cascade.Workspaces(B, HQ, HK, D, device=dev)
        plan = cascade.plan(table, lens_h, lens_d, HQ, HK, D, torch.float16, ws, block_size=BS)
        out = torch.empty_like(q)
        case(f"cascade decode {name}", lambda: cascade.paged_cascade(plan, q, k, v, table_d, out=out), out)
    for name, P, qlens in cascade_bench.PREFILL_CASES:
        B = len(qlens)
        table, lens, qo, k, v, q = cascade_bench.prefill_case(P, qlens, dev)
        T = qo[-1]
        lens_h, qo_h = torch.tensor(lens, dtype=torch.int32), torch.tensor(qo, dtype=torch.int32)
        ws = cascade.Workspaces(B, HQ, HK, D, device=dev, max_tokens=2 * T)
        plan = cascade.plan(table, lens_h, lens_h.to(dev), HQ, HK, D, torch.float16, ws, block_size=BS,
                            decode_route=False, qo_indptr_host=qo_h, qo_indptr=qo_h.to(dev))
        table_d = table.to(dev)
        out = torch.empty_like(q)
        case(f"cascade prefill {name}", lambda: cascade.paged_cascade(plan, q, k, v, table_d, out=out), out)
    with open(os.path.join(out_dir, "times.json"), "w") as f:
        json.dump(res, f)
    torch.save(outs, os.path.join(out_dir, "outs.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="LIB:BINDINGS of build A (before)")
    ap.add_argument("--b", required=True, help="LIB:BINDINGS of build B (after)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="a regular expression: the cases whose names it matches")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    import torch

    builds = {"A": args.a.split(":"), "B": args.b.split(":")}
    runs = {"A": [], "B": []}
    work = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"ab_attn_{os.getpid()}"
    t0 = time.time()
    for r in range(args.rounds):
        # A B, then B A: whatever favours the first (or second) process of
        # a round falls on both builds alike.
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            lib, bindings = builds[name]
            d = work / f"{name}{r}"
            d.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ, KVPLUG_LIBRARY=os.path.abspath(lib), PYTHONPATH=os.path.abspath(bindings),
                       PYTHONUNBUFFERED="1", AB_ATTN_ONLY=args.only)
            p = subprocess.run([sys.executable, __file__, "--a", args.a, "--b", args.b, "--worker", str(d)], env=env,
                               capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"build {name}, round {r}: exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
            runs[name].append(json.loads((d / "times.json").read_text()))
            print(f"# round {r + 1}/{args.rounds}, build {name} ({runs[name][-1]['version']}): done at "
                  f"{time.time() - t0:.0f} s", flush=True)
    oa, ob = torch.load(work / "A0" / "outs.pt"), torch.load(work / "B0" / "outs.pt")
    rows = []
    print(f"\n# {torch.cuda.get_device_name()} {time.strftime('%Y-%m-%d')}, {args.rounds} rounds, A B then B A")
    print("| case | A us | B us | A / B | B vs A rel err | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in [k for k in runs["A"][0] if k != "version"]:
        ta = statistics.median(run[case] for run in runs["A"])
        tb = statistics.median(run[case] for run in runs["B"])
        a, b = oa[case].float(), ob[case].float()
        err = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
        diff = (a - b).abs().max().item()
        rows.append(dict(case=case, a_us=ta, b_us=tb, a_over_b=ta / tb, rel_err=err, max_abs_diff=diff,
                         a_runs=[run[case] for run in runs["A"]], b_runs=[run[case] for run in runs["B"]]))
        print(f"| {case} | {ta:.1f} | {tb:.1f} | {ta / tb:.3f} | {err:.1e} | {diff:.1e} |")
    ratios = [r["a_over_b"] for r in rows]
    print(f"\nA / B: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, max {max(ratios):.3f} "
          f"over {len(rows)} cases; worst: {min(rows, key=lambda r: r['a_over_b'])['case']}")
    with open(os.path.join(args.out, "ab_attn.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "a": args.a, "b": args.b,
                   "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
