#!/usr/bin/env python3
"""The cost of one scheduler step through kvplug: grow 256 sequences of
about 1000 tokens by one token each, then describe their block table,
lengths and slots (block size 16), from Python through ctypes (the
zero-allocation path: preallocated numpy arrays, describe_into) and from C
(bench/step_cost.c, compiled here with cc against build/libkvplug.so).

Sequences are re-admitted every RESET steps, outside the timing, as in the
Go benchmark (core/kvmanager BenchmarkStep) and the C program, so lengths
stay near 1000 and the block table width fixed.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python python bench/step_cost.py [--steps N] [--no-c]

Targets: <= 25 us per step from Python, <= 10 us from C.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import kvplug

NUM_SEQS, PROMPT, BLOCK_SIZE, RESET = 256, 1000, 16, 128
MAX_BLOCKS = -(-(PROMPT + RESET) // BLOCK_SIZE)
ROOT = Path(__file__).resolve().parent.parent


def python_step_cost(steps: int) -> np.ndarray:
    m = kvplug.Manager(NUM_SEQS * (MAX_BLOCKS + 1), BLOCK_SIZE)
    ids = np.arange(NUM_SEQS, dtype=np.int64) * 7919 + 3  # arbitrary ids, not an index
    table = np.empty((NUM_SEQS, MAX_BLOCKS), np.int32)
    lens = np.empty(NUM_SEQS, np.int32)
    slots = np.empty(NUM_SEQS, np.int32)

    def admit() -> None:
        for i in ids.tolist():
            m.add(i, PROMPT)

    admit()
    grow, describe_into, clock = m.grow, m.describe_into, time.perf_counter_ns
    warmup = steps // 10
    out = np.empty(steps, np.float64)
    for i in range(steps + warmup):
        if i % RESET == RESET - 1:
            m.remove(ids)
            admit()
        t0 = clock()
        grow(ids, 1)
        n = describe_into(ids, table, lens, slots)
        t1 = clock()
        if n != NUM_SEQS:
            raise SystemExit(f"describe returned {n} slots, expected {NUM_SEQS}")
        if i >= warmup:
            out[i - warmup] = (t1 - t0) / 1e3
    m.check()
    m.close()
    return out


def c_step_cost(steps: int) -> str:
    lib = Path(kvplug.library_path()).resolve()
    exe = ROOT / "build" / "step_cost"
    exe.parent.mkdir(exist_ok=True)
    cc = os.environ.get("CC", "cc")
    subprocess.run(
        [cc, "-O2", "-std=c99", "-Wall", "-Wextra", "-I", str(ROOT / "include"), str(ROOT / "bench" / "step_cost.c"),
         "-o", str(exe), str(lib), f"-Wl,-rpath,{lib.parent}"],
        check=True,
    )
    return subprocess.run([str(exe), str(steps)], check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description="time one scheduler step through kvplug")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--no-c", action="store_true", help="skip the C measurement")
    args = ap.parse_args()
    print(f"kvplug {kvplug.version_string()} ({kvplug.library_path()}), {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, numpy {np.__version__}")
    t = python_step_cost(args.steps)
    print(f"Python step (grow + describe_into, {NUM_SEQS} seqs, ~{PROMPT} tokens, block size {BLOCK_SIZE}, "
          f"max_blocks {MAX_BLOCKS}): median {np.median(t):.2f} us, p99 {np.percentile(t, 99):.2f} us "
          f"over {len(t)} steps")
    if not args.no_c:
        print(c_step_cost(args.steps))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
