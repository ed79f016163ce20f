"""Small-batch decode latency inside a CUDA graph (issue 21, item 3): GPU time
per kvplug paged_decode call for B=1..8 short contexts, at the library's
split choice and at forced split counts, 32 q / 8 kv heads, head_dim 128,
block size 16, bf16.

Each configuration captures 32 calls in one CUDA graph (same inputs: a
decode step's K/V of this size stays in L2, as in an engine's layer loop)
and replays it 50 times between CUDA events; time per call = total / 1600.

Usage: python3 bench/decode_graph_bench.py [--json FILE]
"""

import argparse
import json
import math
import sys
import time

import torch

from kvplug import attn

HQ, HK, D, BS = 32, 8, 128, 16
CALLS, REPLAYS = 32, 50


def per_call_us(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(REPLAYS):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (CALLS * REPLAYS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--shapes", default="1:512,1:1024,1:2048,1:4096,2:512,4:512,8:512,8:2048")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    rows = []
    splits_list = [0, 1, 2, 4, 8, 16]
    print(f"# {torch.cuda.get_device_name()} {time.strftime('%Y-%m-%d')}: us per paged_decode call in a CUDA graph")
    print("| B | L | library's splits | " + " | ".join(f"splits {s or 'auto'}" for s in splits_list) + " |")
    print("|" + " --- |" * (3 + len(splits_list)))
    for shape in args.shapes.split(","):
        B, L = (int(x) for x in shape.split(":"))
        nb = math.ceil(L / BS)
        table = torch.randperm(B * nb, generator=gen, device="cuda").to(torch.int32).view(B, nb).contiguous()
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        k = torch.randn((B * nb, BS, HK, D), dtype=dt, device="cuda", generator=gen)
        v = torch.randn_like(k)
        q = torch.randn((B, HQ, D), dtype=dt, device="cuda", generator=gen)
        out = torch.empty_like(q)
        ws = torch.empty(attn.workspace_size(B, HQ, D, 16), dtype=torch.uint8, device="cuda")
        chosen = attn.num_splits(dt, D, B, HQ, HK, L)
        ts = []
        for s in splits_list:
            ts.append(per_call_us(lambda: attn.paged_decode(q, k, v, table, lens, out=out, workspace=ws, num_splits=s,
                                                            max_seq_len=L)))
        rows.append(dict(B=B, L=L, chosen=chosen, us=dict(zip([str(s) for s in splits_list], ts))))
        print(f"| {B} | {L} | {chosen} | " + " | ".join(f"{t:.2f}" for t in ts) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "argv": sys.argv}, f, indent=1)


if __name__ == "__main__":
    main()
