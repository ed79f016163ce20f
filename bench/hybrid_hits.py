#!/usr/bin/env python3
"""Prefix-cache hits of hybrid (sliding-window) models under memory pressure.

Many chat sessions take turns round-robin (vLLM's issue 48435: Gemma multi-session
chat, whose hits collapsed at a quarter of the pool in use): every turn's prompt is the
session's whole history plus new user tokens, admitted through kvplug's manager with
the prefix cache, then an answer decoded token by token. The same workload runs for a
hybrid model and for a full-attention model with the same layer groups, on pools from
a quarter to all of the workload's full-attention KV; the hybrid's prompt-token hit
rate is reported beside the full model's (target: at least 0.9x at every pool size).

Only the manager runs (no GPU): block tables, hits and evictions are what a GPU run
would see. Run from the repository root after `make lib`:

    PYTHONPATH=bindings/python KVPLUG_LIBRARY=build/libkvplug.so \\
        build/venv/bin/python bench/hybrid_hits.py
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import kvplug
from kvplug import LayerGroup as G

MODELS = {
    # name: (groups of the hybrid model); the full model has as many full groups
    "gpt-oss": [G.full_attention(), G.sliding_window(128)],
    "gemma-3": [G.full_attention()] + [G.sliding_window(1024)] * 5,
}


def run(groups, pool_blocks, args, rng_seed):
    """Hit rate (turns 2+, and all turns) of the workload on one manager."""
    rng = np.random.default_rng(rng_seed)
    m = kvplug.Manager(pool_blocks, args.block_size, prefix_cache=True, layer_groups=groups)
    hist = [[] for _ in range(args.sessions)]
    hit = tot = hit2 = tot2 = 0
    next_id = 1
    for turn in range(args.turns):
        for first in range(0, args.sessions, args.batch):
            batch = list(range(first, min(first + args.batch, args.sessions)))
            ids, prompts = [], []
            for s in batch:
                user = rng.integers(1, 50000, int(rng.integers(args.user // 2, args.user * 3 // 2))).tolist()
                prompts.append(hist[s] + user)
                ids.append(next_id)
                next_id += 1
            matched = m.admit(ids, prompts)
            if len(matched) < len(ids):
                raise SystemExit(f"pool of {pool_blocks} blocks too small for a batch of {len(ids)}")
            m.mark_computed()
            for p, k in zip(prompts, matched):
                hit += int(k)
                tot += len(p)
                if turn > 0:
                    hit2 += int(k)
                    tot2 += len(p)
            answer = rng.integers(1, 50000, (args.answer, len(ids)))
            for t in range(args.answer):
                m.grow_tokens(ids, answer[t])
                m.mark_computed()
            for i, s in enumerate(batch):
                hist[s] = prompts[i] + answer[:, i].tolist()
            m.remove(ids)
    m.close()
    return hit2 / max(tot2, 1), hit / max(tot, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt-oss,gemma-3")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user", type=int, default=300, help="mean new user tokens a turn")
    ap.add_argument("--answer", type=int, default=120, help="decoded tokens a turn")
    ap.add_argument("--batch", type=int, default=4, help="sessions in one step")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--fractions", default="0.25,0.5,0.75,1.0",
                    help="pool sizes, as fractions of the workload's full-attention KV")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    # The workload's KV at full attention, per group: every session's final context.
    final = args.turns * (args.user + args.answer)
    per_group = args.sessions * (-(-final // args.block_size) + 1)
    print(f"{args.sessions} sessions x {args.turns} turns, ~{args.user} user + {args.answer} answer tokens a turn "
          f"(final context ~{final}), batches of {args.batch}, block size {args.block_size}", flush=True)
    print("| model | pool (x full-attention KV) | blocks | full model hit rate, turns 2+ | hybrid hit rate, turns 2+ "
          "| ratio | hybrid, all turns |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    worst = float("inf")
    for name in args.models.split(","):
        hybrid = MODELS[name]
        full = [G.full_attention()] * len(hybrid)
        for frac in (float(f) for f in args.fractions.split(",")):
            blocks = max(int(per_group * len(hybrid) * frac), 1)
            t0 = time.perf_counter()
            f2, _ = run(full, blocks, args, args.seed)
            h2, hall = run(hybrid, blocks, args, args.seed)
            ratio = h2 / f2 if f2 else float("inf")
            worst = min(worst, ratio)
            print(f"| {name} | {frac:.2f} | {blocks} | {f2:.3f} | {h2:.3f} | {ratio:.2f}x | {hall:.3f} |", flush=True)
            print(f"  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    print(f"lowest hybrid/full ratio: {worst:.2f}x (target >= 0.9x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
