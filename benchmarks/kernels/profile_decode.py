"""Runs one paged-decode shape a few times, eagerly, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        -k regex:'split_kernel|merge_kernel|flash' python benchmarks/kernels/profile_decode.py 64 2048

Each iteration runs our kernel, then torch SDPA over contiguous K/V of the same shape.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from decode_attention import MODELS, make_set

from minisgl.ops.decode_attention import paged_decode_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("batch", type=int)
    ap.add_argument("ctx", type=int)
    ap.add_argument("--model", default="Llama-3.1-8B", choices=list(MODELS))
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    hq, hkv, dim = MODELS[args.model]
    s = make_set(args.batch, args.ctx, hq, hkv, dim, seed=0)
    names = ("q", "k_cache", "v_cache", "req_to_slot", "req_rows", "seq_lens")
    for _ in range(args.iters):
        paged_decode_attention(**{n: s[n] for n in names}, scale=1 / math.sqrt(dim), max_seq_len=args.ctx)
        F.scaled_dot_product_attention(s["q"].unsqueeze(2), s["k"], s["v"], enable_gqa=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
