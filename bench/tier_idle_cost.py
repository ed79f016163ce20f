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

import kvplug
from host_cost import per_call_us  # this script's folder is on sys.path when run as a script


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
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, {args.calls} calls x 5 rounds (median)")
    for name, us in rows:
        print(f"  {name:38s} {us:7.1f} us  ({us / 100:.3f} of the 0.1 ms target)")


if __name__ == "__main__":
    main()
