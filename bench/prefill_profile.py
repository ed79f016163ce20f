"""One paged prefill launch per system, for Nsight Compute (ncu) to profile: kvplug's
kernel (the Hopper one on an H100, or the sm_80 one with --sm80) and FlashInfer's fa3 or
fa2 on the same batch (32 q / 8 kv heads, d 128, block 16, fp16); with --fp8 kvplug's
kernel reads the batch's K/V quantised into an e4m3 cache by kv_write (per-token-head
scales), and with --fp8-qkv too in the FP8 Q/K/V mode. Each runs twice (a warm-up, then the launch to profile with --launch-skip 1
--launch-count 1).

    ncu --target-processes all -k regex:kvp_paged_prefill --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 bench/prefill_profile.py kvplug
    ncu ... -k regex:Prefill python3 bench/prefill_profile.py fa3
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill_bench import Case  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("system", choices=["kvplug", "sm80", "fa3", "fa2"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--fp8", action="store_true", help="kvplug over an e4m3 copy of the cache")
    ap.add_argument("--fp8-qkv", action="store_true", help="with --fp8: the FP8 Q/K/V mode")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    c = Case(torch.float16, [args.new] * args.batch, [args.prefix + args.new] * args.batch, gen)
    if args.system in ("kvplug", "sm80"):
        if args.fp8:
            from kvplug import attn

            shape = c.k_cache.shape
            k8 = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
            v8 = torch.empty_like(k8)
            ks = torch.empty(shape[:3], dtype=torch.float32, device="cuda")
            vs = torch.empty_like(ks)
            slots = torch.arange(shape[0] * shape[1], dtype=torch.int32, device="cuda")
            attn.kv_write(c.k_cache.view(-1, *shape[2:]), c.v_cache.view(-1, *shape[2:]), k8, v8, slots,
                          k_scale=ks, v_scale=vs)
            c.k_cache, c.v_cache = k8, v8
            fn, _, _ = c.kvplug(hopper=args.system == "kvplug", k_scale=ks, v_scale=vs, fp8_qkv=args.fp8_qkv)
        else:
            fn, _, _ = c.kvplug(hopper=args.system == "kvplug")
    else:
        fn, _ = c.flashinfer(args.system)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
