"""Tier copy bandwidth: kvplug's batched copy (kvplug.TierCopier, one
launch per 500 blocks, every layer's K and V) between paged GPU caches and
pinned host slots, against the link's ceiling (one large pinned
cudaMemcpyAsync each way, measured in the same run) and against the copy
an engine writes with torch (per layer and tensor: gather the blocks on the
GPU, then one pinned copy; 2 x layers x 2 calls per batch).

Shape: Llama-3-8B's KV (32 layers, 8 kv heads, head_dim 128, bf16, block
size 16): 32 KiB per block, layer and tensor; 2 MiB per block.

Each figure is the median of --iters timed batches (CUDA events around the
batch), on fresh random K/V; the round trip (demote, poison, reload) is
checked byte for byte first.

Usage: python3 bench/tier_copy_bench.py [--iters N] [--blocks 8,32,128,512] [--json FILE]
Prints a markdown table.
"""

import argparse
import json
import pathlib
import statistics
import sys

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))
import kvplug  # noqa: E402

LAYERS, HK, D, BS = 32, 8, 128, 16
DT = torch.bfloat16


def timed(fn, iters):
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--blocks", default="8,32,128,512")
    ap.add_argument("--gpu-blocks", type=int, default=1536)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    sizes = [int(x) for x in args.blocks.split(",")]
    nslots = max(sizes)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    k = [torch.randn((args.gpu_blocks, BS, HK, D), generator=g, device=dev, dtype=torch.float32).to(DT) for _ in range(LAYERS)]
    v = [torch.randn((args.gpu_blocks, BS, HK, D), generator=g, device=dev, dtype=torch.float32).to(DT) for _ in range(LAYERS)]
    chunk = BS * HK * D * 2
    slot = chunk * LAYERS * 2
    host_t = torch.empty((nslots, slot), dtype=torch.uint8).pin_memory()  # the engine's pinned pool
    host = host_t.numpy()
    cp = kvplug.TierCopier(k, v, host=host)
    rng = np.random.default_rng(1)

    # Check a round trip first.
    blocks = rng.permutation(args.gpu_blocks)[:64]
    cp.run(demote=(blocks, np.arange(64)))
    torch.cuda.synchronize()
    want = [t[torch.from_numpy(blocks).to(dev)].clone() for t in k + v]
    for t in k + v:
        t[torch.from_numpy(blocks).to(dev)] = float("nan")
    cp.run(reload=(np.arange(64), blocks))
    torch.cuda.synchronize()
    for t, w in zip(k + v, want):
        assert torch.equal(t[torch.from_numpy(blocks).to(dev)], w), "round trip differs"

    # Ceiling: one large pinned copy each way.
    big = 1 << 30
    hbuf = torch.empty(big, dtype=torch.uint8).pin_memory()
    dbuf = torch.empty(big, dtype=torch.uint8, device=dev)
    h2d = big / timed(lambda: dbuf.copy_(hbuf, non_blocking=True), args.iters) / 1e9
    d2h = big / timed(lambda: hbuf.copy_(dbuf, non_blocking=True), args.iters) / 1e9
    del hbuf, dbuf

    rows = []
    for n in sizes:
        blocks = rng.permutation(args.gpu_blocks)[:n]
        slots = rng.permutation(nslots)[:n]
        bidx = torch.from_numpy(blocks).to(dev)
        nbytes = n * slot
        t_dem = timed(lambda: cp.run(demote=(blocks, slots)), args.iters)
        t_rel = timed(lambda: cp.run(reload=(slots, blocks)), args.iters)
        # The torch copy: per layer and tensor, gather on the GPU, one pinned
        # copy into a contiguous staging area per (layer, tensor).
        stage = torch.empty((2 * LAYERS, n, chunk), dtype=torch.uint8).pin_memory()

        def torch_demote():
            for i, t in enumerate(k + v):
                stage[i].copy_(t[bidx].view(torch.uint8).view(n, chunk), non_blocking=True)

        def torch_reload():
            for i, t in enumerate(k + v):
                t[bidx] = stage[i].to(dev, non_blocking=True).view(DT).view(n, BS, HK, D)

        t_tdem = timed(torch_demote, args.iters)
        t_trel = timed(torch_reload, args.iters)
        del stage
        rows.append(dict(blocks=n, mib=nbytes / 2**20,
                         demote_gbps=nbytes / t_dem / 1e9, reload_gbps=nbytes / t_rel / 1e9,
                         torch_demote_gbps=nbytes / t_tdem / 1e9, torch_reload_gbps=nbytes / t_trel / 1e9,
                         demote_ms=t_dem * 1e3, reload_ms=t_rel * 1e3))
    cp.close()

    print(f"device: {torch.cuda.get_device_name()}; pinned-copy ceiling H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s (1 GiB)")
    print("| blocks | MiB | demote GB/s (of D2H) | reload GB/s (of H2D) | torch demote GB/s | torch reload GB/s | demote ms | reload ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['blocks']} | {r['mib']:.0f} | {r['demote_gbps']:.1f} ({r['demote_gbps'] / d2h:.2f}) | "
              f"{r['reload_gbps']:.1f} ({r['reload_gbps'] / h2d:.2f}) | {r['torch_demote_gbps']:.1f} | "
              f"{r['torch_reload_gbps']:.1f} | {r['demote_ms']:.2f} | {r['reload_ms']:.2f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(h2d_gbps=h2d, d2h_gbps=d2h, rows=rows), indent=1))


if __name__ == "__main__":
    main()
