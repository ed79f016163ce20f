"""What tier stores running beside a decode step cost that step.

A stand-in for one decode step of a Llama-3-8B-shaped model, captured in a
CUDA graph: per layer, a GEMM that streams 235 MB of weights ([64, 4096] x
[4096, 28672], bf16) and kvplug's paged decode over 64 sequences of 2048
tokens. Each step the host enqueues the stores of `--blocks` KV blocks (2 MiB
each: 32 layers x K/V x 16 tokens x 8 heads x 128) from a one-tensor cache
to pinned host slots on a side stream, replays the graph on the step's
stream and reads back 64 token ids (the step's one device-to-host copy, as
examples/hf_engine.py does), as kvplug.hf's write-through does. Steps
are timed by the host (the serving loop waits for each) and by CUDA events
on the step's stream, for: no stores; the library's copy kernel; the copy
engines (TierCopier store_engine="copy-engine": a strided copy a block);
torch copies (cudaMemcpyAsync a block); and the kernel and the copy
engines again with the step's stream at high priority.

Usage (a GPU machine): python3 bench/store_interference.py [--blocks 45] [--steps 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import kvplug
from kvplug import attn
from kvplug.tiercopy import TierCopier

LAYERS, KVH, QH, D, BS = 32, 8, 32, 128, 16
BATCH, CTX = 64, 2048


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=45, help="blocks stored a step (workload b: about 45)")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    per_seq = CTX // BS
    nb = BATCH * per_seq + args.blocks
    # One tensor [layers][K, V][blocks][tokens][heads][dim], as kvplug.hf allocates it.
    kv = torch.empty((LAYERS, 2, nb, BS, KVH, D), dtype=torch.bfloat16, device=dev)
    kv.uniform_(-1, 1, generator=gen)
    table = torch.arange(BATCH * per_seq, dtype=torch.int32, device=dev).reshape(BATCH, per_seq)
    lens = torch.full((BATCH,), CTX, dtype=torch.int32, device=dev)
    q = torch.empty((BATCH, QH, D), dtype=torch.bfloat16, device=dev).uniform_(-1, 1, generator=gen)
    out = torch.empty_like(q)
    ws = torch.empty(attn.workspace_size(BATCH, QH, D), dtype=torch.uint8, device=dev)
    x = torch.empty((BATCH, 4096), dtype=torch.bfloat16, device=dev).uniform_(-1, 1, generator=gen)
    w = [torch.empty((4096, 28672), dtype=torch.bfloat16, device=dev).uniform_(-0.01, 0.01, generator=gen)
         for _ in range(4)]  # 4 distinct matrices, each layer one of them (940 MB: past L2, like the weights)
    y = torch.empty((BATCH, 28672), dtype=torch.bfloat16, device=dev)
    ids = torch.zeros(BATCH, dtype=torch.int64, device=dev)
    attn.prepare()

    def forward() -> None:
        for layer in range(LAYERS):
            torch.matmul(x, w[layer % len(w)], out=y)
            attn.paged_decode(q, kv[layer, 0], kv[layer, 1], table, lens, out=out, workspace=ws, max_seq_len=CTX)
        torch.argmax(y[:, :64], dim=1, out=ids)

    slot_bytes = LAYERS * 2 * BS * KVH * D * 2
    host = np.empty((args.blocks, slot_bytes), dtype=np.uint8)
    k_layers = [kv[layer, 0] for layer in range(LAYERS)]
    v_layers = [kv[layer, 1] for layer in range(LAYERS)]
    pinned = torch.empty((args.blocks, slot_bytes), dtype=torch.uint8, pin_memory=True)
    first = BATCH * per_seq  # the stored blocks: not read by the step
    blocks = np.arange(first, first + args.blocks, dtype=np.int32)
    slots = np.arange(args.blocks, dtype=np.int32)
    empty = np.empty(0, np.int32)
    batch = kvplug.CopyBatch(1, blocks, slots, empty, empty)
    copiers = {"kernel": TierCopier(k_layers, v_layers, host=host),
               "copy-engine": TierCopier(k_layers, v_layers, host=host, store_engine="copy-engine")}

    def torch_store(side: torch.cuda.Stream) -> None:
        with torch.cuda.stream(side):
            for i, b in enumerate(blocks):
                # A block's 64 rows (layer, K/V) of 32 KiB each, as one strided source into its slot.
                pinned[i].view(LAYERS, 2, -1).copy_(kv[:, :, b].reshape(LAYERS, 2, -1).view(torch.uint8), non_blocking=True)

    # A readback that is no device-to-host copy: a kernel writes the ids into pinned host memory through
    # its device address (mapped, as all pinned memory under unified addressing), and the host waits for the
    # step's stream, so that it does not queue behind the stores' copies.
    ids_host = torch.zeros(BATCH, dtype=torch.int64, pin_memory=True)

    class _Mapped:
        __cuda_array_interface__ = {"shape": (BATCH,), "typestr": "<i8", "data": (ids_host.data_ptr(), False),
                                    "version": 3}

    ids_mapped = torch.as_tensor(_Mapped(), device=dev)

    results = {}
    enqueue = {}
    for mode in ("none", "kernel", "copy-engine", "torch", "kernel, step stream high priority",
                 "copy-engine, step stream high priority", "none, zero-copy readback",
                 "kernel, zero-copy readback", "copy-engine, zero-copy readback"):
        high = "high priority" in mode
        zero_copy = "zero-copy" in mode
        step_stream = torch.cuda.Stream(priority=-1 if high else 0)
        side = torch.cuda.Stream()
        with torch.cuda.stream(step_stream):
            forward()  # warm-up
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=step_stream):
                forward()
        torch.cuda.synchronize()
        walls, gpus, enq = [], [], []
        for i in range(args.steps + 5):
            t0 = time.perf_counter()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            engine = mode.split(",")[0]
            if engine != "none":
                side.wait_stream(step_stream)
                if engine == "torch":
                    torch_store(side)
                else:
                    copiers[engine].run(batch, side)
            t1 = time.perf_counter()
            with torch.cuda.stream(step_stream):  # replay() launches on the current stream
                e0.record()
                g.replay()
                e1.record()
                if zero_copy:
                    torch.add(ids, 0, out=ids_mapped)
                    step_stream.synchronize()
                    ids_host.tolist()
                else:
                    ids.tolist()
            wall = time.perf_counter() - t0
            if i >= 5:
                walls.append(wall * 1e3)
                gpus.append(e0.elapsed_time(e1))
                enq.append((t1 - t0) * 1e3)
        torch.cuda.synchronize()
        if zero_copy:
            assert torch.equal(ids_host, ids.cpu()), "the zero-copy readback read other ids than the step wrote"
        results[mode] = (statistics.median(walls), statistics.median(gpus))
        enqueue[mode] = statistics.median(enq)
    base_wall, base_gpu = results["none"]
    mib = args.blocks * slot_bytes / 2**20
    print(f"{torch.cuda.get_device_name()}: a decode step (graph) beside the stores of {args.blocks} blocks "
          f"({mib:.0f} MiB) a step on a side stream; medians of {args.steps} steps")
    print("| stores by | step wall ms | step GPU ms | wall / none | GPU / none | stores' enqueue ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, (wall, gpu) in results.items():
        print(f"| {mode} | {wall:.2f} | {gpu:.2f} | {wall / base_wall:.3f}x | {gpu / base_gpu:.3f}x | {enqueue[mode]:.3f} |")
    for c in copiers.values():
        c.close()


if __name__ == "__main__":
    main()
