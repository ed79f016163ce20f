"""e4m3 (token-head scales) and bf16 paged decode against num_splits at the
large shapes of the FP8 decode table (Llama-3-8B heads: 32 q, 8 kv, head_dim
128, block size 16), to see whether the split count the planner picks
(num_splits=0) leaves time on the table. Each cell: the median of triton's
do_bench (L2 cold, us) and the fraction of the floor (the bytes a decode
must read at the copy bandwidth measured in the same run).

Usage (a GPU machine): python3 bench/fp8_decode_splits.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_decode_bench import Batch, copy_bandwidth, timed  # noqa: E402

from kvplug import attn  # noqa: E402

SHAPES = [(32, 2048), (32, 4096), (64, 8192), (128, 2048)]
SPLITS = [0, 1, 2, 3, 4, 6, 8, 12, 16]


def main() -> None:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    for B, L in SHAPES:
        bt = Batch(B, L, gen)
        ws = torch.empty(attn.workspace_size(B, 32, 128, max(SPLITS) * 4), dtype=torch.uint8, device="cuda")
        out = torch.empty_like(bt.q)
        print(f"{B} x {L}:")
        for s in SPLITS:
            f8 = lambda: attn.paged_decode(bt.q, bt.k8, bt.v8, bt.table, bt.seq_lens, out=out, workspace=ws,  # noqa: E731
                                           max_seq_len=L, k_scale=bt.ks, v_scale=bt.vs, num_splits=s)
            f16 = lambda: attn.paged_decode(bt.q, bt.k, bt.v, bt.table, bt.seq_lens, out=out, workspace=ws,  # noqa: E731
                                            max_seq_len=L, num_splits=s)
            t8, t16 = timed(f8), timed(f16)
            name = "planner" if s == 0 else f"{s} splits"
            print(f"  {name:>9}: e4m3 {t8:7.1f} us ({bt.bytes8 / (t8 * 1e-6) / bw:.2f} of its floor)"
                  f"  bf16 {t16:7.1f} us ({bt.bytes16 / (t16 * 1e-6) / bw:.2f})", flush=True)
        del bt, ws, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
