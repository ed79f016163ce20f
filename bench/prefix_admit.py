"""Admission with a prefix hit through the Python package, beside the bare
C call with the same arrays, in one process.

A 4096-token prompt whose first 2048 tokens are a cached (pinned) system
prompt is admitted N times per case (its token 2048 differs each time, so
the other half is new), with free blocks for it: the admitted sequences
are removed in rounds of 128 and what they cached is cleared, outside the
timing. The cases take turns call by call.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 bench/prefix_admit.py [--block-size 16] [-n 2000] [--repeat 3]

Cases:
  c-call       kvp_manager_admit through ctypes with arrays prepared
               beforehand: what any Python caller pays at least
  numpy-int32  Manager.admit([id], [arr]) with an int32 numpy prompt
  numpy-int64  ... with an int64 numpy prompt (converted)
  list         ... with a list of Python ints
  keys         numpy-int32 with Keys(salt, one image), built once (its
               system prompt is cached and pinned under the same keys)
  decode step  Manager.grow_tokens(ids, next_tokens) + describe_into for
               256 sequences of 1000-4000 tokens, numpy arrays reused
               (--decode-lists: next tokens as one list per sequence),
               beside the bare kvp_manager_grow_tokens + describe calls
Prints the median microseconds per call of each repetition.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

import kvplug
from kvplug._lib import C


def admit_cases(cases: list, bs: int, n: int) -> dict:
    """Median microseconds per admit of each case. The cases take turns
    call by call, so the machine's load falls on all of them alike."""
    plen, cached, rnd = 4096, 2048, 128
    rng = np.random.default_rng(1)
    base = rng.integers(0, 100_000, plen, dtype=np.int32)
    img = kvplug.Keys(salt=b"tenant", mm=[kvplug.MMItem(3000, 64, b"\x07" * 16)])
    m = kvplug.Manager((rnd + 4) * (plen // bs), bs, prefix_cache=True)

    def fresh() -> None:
        # Like the Go benchmark's fresh pool: drop what the last round
        # cached, then cache and pin the system prompt again.
        m.clear_prefix_cache()
        for k in (None, img):
            m.admit([-1], [base[: cached + 1]], k)
            m.mark_computed()  # its forward pass ran: the blocks stay cached
            m.remove([-1])
            m.pin(base[:cached], k)

    fresh()
    ids_arr = np.zeros(1, np.int64)
    offs = np.array([0, plen], np.int64)
    matched = np.zeros(1, np.int32)
    admitted = ctypes.c_int32()
    # The bare call's arguments, addresses taken once (the arrays stay put).
    c_args = (ids_arr.ctypes.data, base.ctypes.data, offs.ctypes.data, matched.ctypes.data, ctypes.byref(admitted))
    times: dict = {c: [] for c in cases}
    live = []
    sid = 0
    for i in range(n):
        for case in cases:
            base[cached] = sid  # a new second half every call
            if case == "list":
                p = base.tolist()
            elif case == "numpy-int64":
                p = base.astype(np.int64)
            else:
                p = base
            keys = img if case == "keys" else None
            t0 = time.perf_counter_ns()
            if case == "c-call":
                ids_arr[0] = sid
                st = C.kvp_manager_admit(m._h, c_args[0], 1, c_args[1], c_args[2], None, c_args[3], c_args[4])
                t1 = time.perf_counter_ns()
                assert st == 0 and matched[0] == cached
            else:
                got = m.admit([sid], [p], keys)
                t1 = time.perf_counter_ns()
                assert got[0] == cached, got
            times[case].append(t1 - t0)
            live.append(sid)
            sid += 1
            if len(live) == rnd:
                m.mark_computed()
                m.remove(live)
                live = []
                fresh()
    m.close()
    return {c: statistics.median(v) / 1e3 for c, v in times.items()}


def decode_case(n_steps: int, lists: bool) -> tuple:
    """Median microseconds of a decode step through the package and
    through the bare C calls (grow_tokens + describe), taking turns."""
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
    ones = np.ones(nseq, np.int32)
    num = ctypes.c_int32()
    a_ids, a_ones, a_toks = ids.ctypes.data, ones.ctypes.data, toks.ctypes.data
    a_table, a_lens, a_slots, p_num = table.ctypes.data, seq_lens.ctypes.data, slots.ctypes.data, ctypes.byref(num)
    py, c = [], []
    for step in range(n_steps):
        toks[:] = step
        t0 = time.perf_counter_ns()
        if step % 2:
            st = C.kvp_manager_grow_tokens(m._h, a_ids, a_ones, nseq, a_toks)
            st = st or C.kvp_manager_describe(m._h, a_ids, nseq, a_table, 512, a_lens, a_slots, nseq, p_num)
            t1 = time.perf_counter_ns()
            assert st == 0
            c.append(t1 - t0)
        else:
            m.grow_tokens(ids, [[t] for t in toks.tolist()] if lists else toks)
            k = m.describe_into(ids, table, seq_lens, slots)
            t1 = time.perf_counter_ns()
            assert k == nseq
            py.append(t1 - t0)
    m.close()
    return statistics.median(py) / 1e3, statistics.median(c) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-lists", action="store_true", help="decode tokens as one list per sequence")
    a = ap.parse_args()
    cases = ["c-call", "numpy-int32", "numpy-int64", "list", "keys"]
    for r in range(a.repeat):
        row = admit_cases(cases, a.block_size, a.n)
        dpy, dc = decode_case(1000, a.decode_lists)
        base = row["c-call"]
        print(
            f"run {r}: "
            + ", ".join(f"{c} {v:.1f} us" + (f" ({v / base:.2f}x)" if c != "c-call" else "") for c, v in row.items())
            + f"; decode step {dpy:.1f} us, bare C calls {dc:.1f} us ({dpy / dc:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
