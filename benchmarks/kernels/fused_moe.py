"""Fused MoE (issue 20): our Triton path against a grouped torch reference, bf16, per token count.

    python benchmarks/kernels/fused_moe.py [--shapes qwen3-30b-a3b mixtral-8x7b] [--m 1 8 64 ...]
                                           [--configs PATH]

Shapes: Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert intermediate 768) and
Mixtral-8x7B (hidden 4096, 8 experts, top-2, intermediate 14336); random router logits.
"ours" = ops.fused_moe from the router logits: routing + alignment + both expert GEMMs + the
top-k sum. "torch" = per expert hit, torch.matmul over its routed tokens (token lists built
outside the timing: the baseline gets its routing for free). Both are CUDA-graph replays over
rotated input sets (_bench.py), so the weights come from HBM as in a real step.
Floors, measured in the same run:
  bytes floor = (experts hit * 3 * H * I + 2 * M * H) * 2 bytes / read ceiling (1 GiB fp32 sum);
  "of floor" = floor time / our time (target >= 80% at M <= 64).
  GEMM ceiling = bf16 8192^3 torch.matmul TFLOP/s; ours = 2 * M * top_k * 3 * H * I / time
  (target >= 50% of the ceiling at M >= 4096).
Tile configs: --configs (default: the repository's kernels/fused_moe_configs.json), else defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _bench import ceilings, gemm_tflops, num_sets, print_ceilings, print_table, time_calls
from _moe_cases import M_LIST, REPO_CONFIGS, SHAPES, expert_bytes, grouped_reference, make_case, make_weights

from minisgl import ops
from minisgl.kernels import fused_moe_config


def timed(fns: list) -> float:
    try:
        return time_calls(fns, reps=20)
    except RuntimeError:  # a capture failure: time eagerly rather than not at all
        return time_calls(fns, reps=20, use_graph=False)


def bench_shape(name: str, ms: list[int], read_gbs: float, peak: float) -> None:
    e, k, h, i = SHAPES[name]
    w13, w2 = make_weights(e, h, i)
    dev_name = torch.cuda.get_device_name()
    rows = []
    for m in ms:
        probe = make_case(e, k, h, m, 0)
        per_call = probe.hit * expert_bytes(h, i) + 2 * m * h * 2
        cases = [probe] + [make_case(e, k, h, m, s) for s in range(1, num_sets(per_call))]
        ours = [lambda c=c: ops.fused_moe(c.x, c.logits, w13, w2, k, True) for c in cases]
        refs = [grouped_reference(c, w13, w2) for c in cases]
        want = refs[0]().float()
        diff = (ours[0]().float() - want).abs().max().item() / want.abs().max().item()
        t_ours, t_ref = timed(ours), timed(refs)
        hit = sum(c.hit for c in cases) / len(cases)
        floor_us = (hit * expert_bytes(h, i) + 2 * m * h * 2) / read_gbs / 1e3
        tflops = 2 * m * k * 3 * h * i / t_ours / 1e6
        cfg = fused_moe_config.get_config(e, k, i, h, m, torch.bfloat16, dev_name)
        rows.append([
            str(m), f"{hit:.1f}", f"{t_ours:.1f}", f"{t_ref:.1f}", f"{t_ref / t_ours:.2f}x",
            f"{hit * expert_bytes(h, i) / t_ours / 1e3:,.0f}", f"{100 * floor_us / t_ours:.0f}%",
            f"{tflops:.0f}", f"{100 * tflops / peak:.0f}%",
            f"{cfg.block_m}|{cfg.up.block_n}x{cfg.up.block_k}|{cfg.down.block_n}x{cfg.down.block_k}"
            + ("" if fused_moe_config.is_tuned(e, k, i, h, torch.bfloat16, dev_name) else " (default)"),
            f"{diff:.1e}",
        ])
    print_table(
        f"Fused MoE, {name}: E={e}, top-{k}, H={h}, I={i}, bf16 (ours: routing + align + GEMMs + sum; "
        "GB/s = expert bytes hit / t; of floor = bytes floor / t; of GEMM = TFLOP/s / bf16 GEMM ceiling)",
        ["M", "experts hit", "ours us", "torch us", "vs torch", "GB/s", "of floor", "TFLOP/s", "of GEMM",
         "tiles bm|up|down", "max rel diff"],
        rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=M_LIST)
    ap.add_argument("--configs", type=Path, default=REPO_CONFIGS)
    args = ap.parse_args()
    if args.configs.exists():
        fused_moe_config.use_config_file(args.configs)
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    peak = gemm_tflops()
    print(f"bf16 GEMM ceiling: {peak:.0f} TFLOP/s (8192^3 torch.matmul); tile configs: {args.configs}")
    for name in args.shapes:
        bench_shape(name, args.m, read_gbs, peak)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
