#!/usr/bin/env python3
"""Prefix-cache hits of a recurrent hybrid (Qwen3-Next shape) under memory pressure.

Chat sessions that share a system prompt take turns round-robin: every turn's prompt is the
session's whole history plus new user tokens, then an answer is decoded token by token. The
engine is emulated as kvplug.hf drives the manager: a prompt is computed in chunks of at most
--chunk tokens, each ending at a checkpoint boundary when it can, and at the boundary where its
cached prefix ends when that lies past its hit (Manager.match_blocks; kvplug.hf.cache.chunk_end,
the rule itself), since a recurrent layer's state exists only where a step ends; every step takes
the manager's queued copies (take_copies) before its forward pass and marks the step computed
after it. --no-stop leaves out the stop at the cached prefix's end (kvplug.hf before it).

The same workload runs on a Qwen3-Next-like group set (one full-attention group and three
recurrent groups, checkpoints every 1 and every 4 blocks) and on a full-attention model of as
many groups, on pools given as fractions of the workload's full-attention KV (every session's
final context, every group). The prompt-token hit rate is matched tokens over prompt tokens:
turns 2+ (a conversation's history), and first turns (the shared system prompt).

Only the manager runs (no GPU; torch is imported for kvplug.hf's rule): hits and evictions are
what an engine would see. From the repository root, with a library built for the CPU:

    PYTHONPATH=bindings/python KVPLUG_LIBRARY=build/libkvplug.so \\
        build/venv/bin/python bench/recurrent_hits.py

With --hf-engine 48,64,96 it runs instead examples/hf_engine.py serving the Qwen3-Next-shaped
model of tests/python/test_hf_recurrent.py (8 requests sharing a 40-token system prompt, on
the CPU) on pools of those many blocks, and reports its prefix hits.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import kvplug
from kvplug import LayerGroup as G
from kvplug.hf.cache import chunk_end


def models(every):
    """name -> layer groups; the full model has as many full groups."""
    out = {"full attention": [G.full_attention()] * 4}
    for e in every:
        out[f"qwen3-next, checkpoint every {e}"] = [G.full_attention()] + [G.recurrent(64, e)] * 3
    return out


def run(groups, pool_blocks, args, rng_seed):
    """(hit rate turns 2+, hit rate first turns, hit rate all, prefill steps) of the workload on one manager."""
    rng = np.random.default_rng(rng_seed)
    bs = args.block_size
    recurrent = [g.checkpoint_every for g in groups if g.kind == G.RECURRENT]
    period = recurrent[0] * bs if recurrent else 0  # tokens between checkpoint boundaries
    with kvplug.Manager(pool_blocks, bs, prefix_cache=True, layer_groups=groups, block_bytes=64) as m:
        system = rng.integers(1, 50000, args.system).tolist()
        hist = [list(system) for _ in range(args.sessions)]
        hits = np.zeros((2, 2), np.int64)  # [first turn, later turns] x [matched, prompt tokens]
        next_id = 1
        prefill_steps = 0

        def step():
            m.take_copies()  # the engine performs them before the forward pass
            m.mark_computed()  # after launching it

        for turn in range(args.turns):
            for first in range(0, args.sessions, args.batch):
                batch = list(range(first, min(first + args.batch, args.sessions)))
                ids, prompts, done = [], [], []
                for s in batch:
                    user = rng.integers(1, 50000, int(rng.integers(args.user // 2, args.user * 3 // 2))).tolist()
                    prompts.append(hist[s] + user)
                    ids.append(next_id)
                    next_id += 1
                stops = []
                for sid, p in zip(ids, prompts):
                    # As PagedKVCache.schedule admits: the hit, and the boundary where the cached blocks end.
                    bm = m.match_blocks([p])[0]
                    hit, stop = bm.matched_tokens, 0
                    if period and not args.no_stop:
                        stop = bm.block_tokens - bm.block_tokens % period
                    stops.append(stop if stop > hit else 0)
                    upto = chunk_end(hit, min(len(p), hit + args.chunk), period, stops[-1])
                    got = m.admit([sid], [p[:upto]])
                    if len(got) == 0:
                        raise SystemExit(f"pool of {pool_blocks} blocks too small for a batch of {len(ids)}")
                    hits[min(turn, 1)] += (int(got[0]), len(p))
                    done.append(upto)
                step()
                prefill_steps += 1
                while True:  # the prompts' later chunks, every unfinished one each step
                    grow_ids, rows = [], []
                    for k, (sid, p) in enumerate(zip(ids, prompts)):
                        if done[k] < len(p):
                            end = chunk_end(done[k], min(len(p), done[k] + args.chunk), period, stops[k])
                            grow_ids.append(sid)
                            rows.append(p[done[k]:end])
                            done[k] = end
                    if not grow_ids:
                        break
                    m.grow_tokens(grow_ids, rows)
                    step()
                    prefill_steps += 1
                answer = rng.integers(1, 50000, (args.answer, len(ids)))
                for t in range(args.answer):
                    m.grow_tokens(ids, answer[t])
                    step()
                for i, s in enumerate(batch):
                    hist[s] = prompts[i] + answer[:, i].tolist()
                m.remove(ids)
        m.check()
    rate = lambda h: h[0] / max(h[1], 1)  # noqa: E731
    return rate(hits[1]), rate(hits[0]), rate(hits.sum(0)), prefill_steps


def hf_engine(pools):
    """The kvplug.hf engine workload of tests/python/test_hf_recurrent.py on each pool."""
    import pathlib

    import torch

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "python"))
    import test_hf_correctness as H
    import test_hf_recurrent as R

    model = R.tiny_qwen3_next()
    eng = H.load_engine()
    print("| pool blocks | prefix hits | cached / prompt tokens | preemptions |")
    print("| --- | --- | --- | --- |")
    for nb in pools:
        reqs = H.make_requests(eng, model.config.vocab_size)
        engine, rec = H.run_engine(model, torch.float32, "cpu", reqs, num_blocks=nb, block_size=R.BLOCK)
        st = engine.cache.stats
        print(f"| {nb} | {rec.prefix_hits} | {st['cached_tokens']} / {st['prompt_tokens']} | {engine.preemptions} |",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=1000, help="tokens of the shared system prompt")
    ap.add_argument("--user", type=int, default=300, help="mean new user tokens a turn")
    ap.add_argument("--answer", type=int, default=120, help="decoded tokens a turn")
    ap.add_argument("--batch", type=int, default=4, help="sessions in one step")
    ap.add_argument("--chunk", type=int, default=512, help="prompt tokens of a sequence in one step, at most")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--every", default="1,4", help="checkpoint intervals of the recurrent groups, in blocks")
    ap.add_argument("--fractions", default="0.05,0.1,0.25,0.5,1.0",
                    help="pool sizes, as fractions of the workload's full-attention KV")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hf-engine", default="", help="pool sizes (blocks) for the kvplug.hf engine run instead")
    ap.add_argument("--no-stop", action="store_true",
                    help="chunks do not end where a prompt's cached prefix ends past its hit (the rule before)")
    args = ap.parse_args()
    if args.hf_engine:
        hf_engine([int(p) for p in args.hf_engine.split(",")])
        return 0
    final = args.system + args.turns * (args.user + args.answer)
    per_group = args.sessions * (-(-final // args.block_size) + 1)
    print(f"{args.sessions} sessions x {args.turns} turns after a {args.system}-token system prompt, "
          f"~{args.user} user + {args.answer} answer tokens a turn (final context ~{final}), batches of "
          f"{args.batch}, chunks of {args.chunk}, block size {args.block_size}", flush=True)
    print("| model | pool (x full-attention KV) | blocks | hit rate, turns 2+ | first turns (system prompt) "
          "| all turns | prefill steps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for frac in (float(f) for f in args.fractions.split(",")):
        blocks = max(int(per_group * 4 * frac), 1)
        for name, groups in models([int(e) for e in args.every.split(",")]).items():
            t0 = time.perf_counter()
            try:
                later, first, both, steps = run(groups, blocks, args, args.seed)
            except (SystemExit, kvplug.OutOfBlocksError):
                print(f"| {name} | {frac:.2f} | {blocks} | (a batch does not fit) | | | |", flush=True)
                continue
            print(f"| {name} | {frac:.2f} | {blocks} | {later:.3f} | {first:.3f} | {both:.3f} | {steps} |", flush=True)
            print(f"  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
