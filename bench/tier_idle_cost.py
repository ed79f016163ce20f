#!/usr/bin/env python3
"""What the host tier costs a step when it has nothing to copy, from Python:
Manager.flush_copies() alone, and kvplug.hf's HostTier.step() (poll, then
flush), on a manager whose demote-ahead the free blocks meet, beside
Manager.prefix_stats() (a call every engine makes) as a yardstick. The
core's own cost is BenchmarkTierIdleStep in core/kvmanager.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python python bench/tier_idle_cost.py [--calls N]

Target (issue 34): at most 0.1 ms per step when the tier has nothing to do.

A last row is a tier in write-through that does have work: 256 sequences
decoding one token a step (every block they fill stored to the host tier),
HostTier.step with a copier that copies nothing, so the row is the host
work of the stores' flush and bookkeeping, not the copies themselves.
"""

from __future__ import annotations

import argparse
import platform
import time

import kvplug
from host_cost import per_call_us  # this script's folder is on sys.path when run as a script


def write_through_step_us(torch, HostTier, steps: int, batch: int = 256) -> float:
    """Mean host microseconds of HostTier.step (a no-op copier) over a
    decode step of `batch` sequences in write-through, the step's tokens
    grown and marked computed outside the timing; blocks fill on one step
    in 16 (block size 16), whose flush stores them."""
    import numpy as np

    class NoCopies:
        def run(self, batch, stream):
            pass

    steps = min(steps, 4000)
    with kvplug.Manager(batch * (steps // 16 + 16), 16, prefix_cache=True, host_tier_slots=batch * (steps // 16 + 16),
                        host_block_bytes=4096, demote_ahead=0, write_through=batch) as m:
        rng = np.random.default_rng(0)
        ids = np.arange(batch, dtype=np.int64)
        m.admit(ids, [rng.integers(1, 30000, 100).tolist() for _ in range(batch)])
        m.mark_computed()
        tier = HostTier(m, torch.empty(1), copier=NoCopies(), slot_bytes=4096)
        total = 0.0
        for _ in range(steps):
            m.grow_tokens(ids, rng.integers(1, 30000, batch).tolist())
            m.mark_computed()
            t0 = time.perf_counter()
            tier.step(None)
            total += time.perf_counter() - t0
        stored = m.tier_stats().write_through_stored
        if stored < batch * (steps // 16 - 1):
            raise SystemExit(f"write-through stored {stored} blocks in {steps} steps: the row would not measure stores")
        m.remove(ids)
    return total / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    m = kvplug.Manager(8192, 16, prefix_cache=True, kv_events=True, host_tier_slots=4096,
                       host_block_bytes=65536, demote_ahead=64)

    def flush():
        if m.flush_copies().ticket:
            raise SystemExit("the idle tier found work: the measurement is not of an idle tier")

    rows = [("Manager.flush_copies (idle)", per_call_us(flush, args.calls, 5)),
            ("Manager.prefix_stats", per_call_us(m.prefix_stats, args.calls, 5))]
    try:
        import torch
        from kvplug.hf.tier_copy import HostTier
    except ImportError as e:
        print(f"(kvplug.hf's HostTier not measured: {e})")
    else:
        tier = HostTier(m, torch.empty(1), copier=None, slot_bytes=65536)
        rows.append(("kvplug.hf HostTier.step (idle, CPU)", per_call_us(lambda: tier.step(None), args.calls, 5)))
        rows.append(("HostTier.step, write-through, 256 seqs", write_through_step_us(torch, HostTier, args.calls)))
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, {args.calls} calls x 5 rounds (median)")
    for name, us in rows:
        idle = "write-through" not in name  # the target is the idle tier's
        print(f"  {name:38s} {us:7.1f} us" + (f"  ({us / 100:.3f} of the 0.1 ms target)" if idle else "  (a tier with work)"))


if __name__ == "__main__":
    main()
