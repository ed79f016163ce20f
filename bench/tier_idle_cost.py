#!/usr/bin/env python3
"""What the host tier costs a step when it has nothing to copy, from Python:
Manager.flush_copies() alone, and kvplug.hf's HostTier.step() (poll, then
flush), on a manager whose demote-ahead the free blocks meet, beside
Manager.prefix_stats() (a call every engine makes) as a yardstick. The
core's own cost is BenchmarkTierIdleStep in core/kvmanager.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python python bench/tier_idle_cost.py [--calls N]

Target (issue 34): at most 0.1 ms per step when the tier has nothing to do.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import kvplug


def per_call(fn, calls: int, rounds: int = 5) -> float:
    """The median over rounds of a loop's time per call, in microseconds."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    m = kvplug.Manager(8192, 16, prefix_cache=True, kv_events=True, host_tier_slots=4096,
                       host_block_bytes=65536, demote_ahead=64)

    def flush():
        if m.flush_copies().ticket:
            raise SystemExit("the idle tier found work: the measurement is not of an idle tier")

    rows = [("Manager.flush_copies (idle)", per_call(flush, args.calls)),
            ("Manager.prefix_stats", per_call(m.prefix_stats, args.calls))]
    try:
        import torch
        from kvplug.hf.tier_copy import HostTier
    except ImportError as e:
        print(f"(kvplug.hf's HostTier not measured: {e})")
    else:
        tier = HostTier(m, torch.empty(1), copier=None, slot_bytes=65536)
        rows.append(("kvplug.hf HostTier.step (idle, CPU)", per_call(lambda: tier.step(None), args.calls)))
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, {args.calls} calls x 5 rounds (median)")
    for name, us in rows:
        print(f"  {name:38s} {us:7.1f} us  ({us / 100:.3f} of the 0.1 ms target)")


if __name__ == "__main__":
    main()
