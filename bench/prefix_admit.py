"""Admission with a prefix hit through the Python package, beside the bare
C call with the same arrays, in one process.

A 4096-token prompt whose first 2048 tokens are a cached (pinned) system
prompt is admitted N times (its token 2048 differs each time, so the
other half is new), in a pool with free blocks for all of them; the
admitted sequences are removed in rounds of 128, outside the timing.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 bench/prefix_admit.py [--block-size 16] [-n 2000] [--repeat 3]

Cases:
  c-call       kvp_manager_admit through ctypes with arrays prepared
               beforehand: what any Python caller pays at least
  numpy-int32  Manager.admit([id], [arr]) with an int32 numpy prompt
  numpy-int64  ... with an int64 numpy prompt (converted)
  list         ... with a list of Python ints
  keys         numpy-int32 with Keys(salt, one image), built once
  decode-step  Manager.grow_tokens(ids, next_tokens) + describe_into for
               256 sequences of 1000-4000 tokens, numpy arrays reused
               (--decode-lists: next tokens as one list per sequence)
Prints the median microseconds per call of each repetition.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

import kvplug
from kvplug import prefix as _prefix


def admit_case(case: str, bs: int, n: int) -> float:
    plen, cached, rnd = 4096, 2048, 128
    rng = np.random.default_rng(1)
    base = rng.integers(0, 100_000, plen, dtype=np.int32)
    keys = None
    if case == "keys":
        keys = kvplug.Keys(salt=b"tenant", mm=[kvplug.MMItem(3000, 64, b"\x07" * 16)])
    m = kvplug.Manager((n + 4) * (plen // bs), bs, prefix_cache=True)
    m.admit([-1], [base[: cached + 1]], keys)
    m.remove([-1])
    m.pin(base[:cached], keys)
    F = _prefix._sig()
    ids_arr = np.zeros(1, np.int64)
    offs = np.array([0, plen], np.int64)
    matched = np.zeros(1, np.int32)
    admitted = ctypes.c_int32()
    times = []
    live = []
    prompts_list = None
    for i in range(n):
        base[cached] = i
        if case == "list":
            p = base.tolist()
        elif case == "numpy-int64":
            p = base.astype(np.int64)
        else:
            p = base
        t0 = time.perf_counter_ns()
        if case == "c-call":
            ids_arr[0] = i
            st = F["admit"](m._h, ids_arr.ctypes.data, 1, base.ctypes.data, offs.ctypes.data, None, matched.ctypes.data, ctypes.byref(admitted))
            assert st == 0 and matched[0] == cached
        else:
            got = m.admit([i], [p], keys)
        t1 = time.perf_counter_ns()
        if case != "c-call":
            assert got[0] == cached, got
        times.append(t1 - t0)
        live.append(i)
        if len(live) == rnd:
            m.remove(live)
            live = []
    del prompts_list
    m.close()
    return statistics.median(times) / 1e3


def decode_case(n_steps: int, lists: bool) -> float:
    bs, nseq = 16, 256
    rng = np.random.default_rng(2)
    lens = rng.integers(1000, 4000, nseq)
    m = kvplug.Manager(int((lens.sum() + nseq * (n_steps + bs)) // bs) + nseq, bs, prefix_cache=True)
    ids = np.arange(nseq, dtype=np.int64)
    for i in range(nseq):
        m.admit([i], [rng.integers(0, 100_000, int(lens[i]), dtype=np.int32)])
    table = np.empty((nseq, 512), np.int32)
    seq_lens = np.empty(nseq, np.int32)
    slots = np.empty(nseq, np.int32)
    toks = np.empty(nseq, np.int32)
    times = []
    for step in range(n_steps):
        toks[:] = step
        t0 = time.perf_counter_ns()
        m.grow_tokens(ids, [[t] for t in toks.tolist()] if lists else toks)
        k = m.describe_into(ids, table, seq_lens, slots)
        t1 = time.perf_counter_ns()
        assert k == nseq
        times.append(t1 - t0)
    m.close()
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-lists", action="store_true", help="decode tokens as one list per sequence")
    a = ap.parse_args()
    cases = ["c-call", "numpy-int32", "numpy-int64", "list", "keys"]
    for r in range(a.repeat):
        row = {c: admit_case(c, a.block_size, a.n) for c in cases}
        row["decode-step"] = decode_case(500, a.decode_lists)
        base = row["c-call"]
        print(
            f"run {r}: "
            + ", ".join(f"{c} {v:.1f} us" + (f" ({v / base:.2f}x)" if c not in ("c-call", "decode-step") else "") for c, v in row.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
