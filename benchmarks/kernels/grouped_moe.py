"""4-bit routed experts of tens of tokens: the grouped skinny MoE kernel (ops/gemm/grouped_moe.py:
align + up + down + top-k sum) against the Triton fused MoE (align + up + down + sum, its tuned
tiles for this GPU) on the same routing, per token count.

    python benchmarks/kernels/grouped_moe.py [--shapes qwen3-30b-a3b:int4 gpt-oss-20b:mxfp4] [--m 4 8 ... 256] [--sweep]

Both are ops.gemm.w4.fused_moe_w4 with the path forced (skinny_moe.MAX_TOKENS 0, grouped_moe.MAX_TOKENS
0 or all), timed as CUDA-graph replays over rotated input sets (_bench.py), so the experts come from
HBM as in a real step. GPT-OSS-20B's layer takes its expert biases and clamped SwiGLU. Floor =
(4-bit bytes of the experts hit, scales included, + x and out) / the read ceiling measured in the
same run; "% of floor" = floor time / time.
--sweep: per M, every (block size, tile) of the up and the down launch in blocks of 1, 2 and 4 warps,
one K split (splits only cost in a first sweep), each timed alone (the default's marked), to choose
grouped_moe.configs.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from _bench import ceilings, num_sets, print_ceilings, print_table, time_calls, time_two_paths
from _moe_cases import SHAPES, make_case, make_w4_weights

from minisgl.kernels.fused_moe import ExpertAct
from minisgl.kernels.moe_align import align
from minisgl.kernels.w4a16_gemm import INT4, MXFP4
from minisgl.ops.gemm import grouped_moe, skinny_moe
from minisgl.ops.gemm import w4 as w4_ops
from minisgl.ops.gemm.skinny import SkinnyConfig, tile_shapes

M_LIST = [3, 4, 8, 16, 32, 64, 128, 256]


def _layer(name: str, fmt: str):
    e, k, h, i = SHAPES[name]
    w13, w2, q13, q2 = make_w4_weights(e, h, i, fmt)
    quant = skinny_moe.Quant4(INT4 if fmt == "int4" else MXFP4, q13.scales, q13.zeros, q2.scales, q2.zeros)
    per_expert = sum(t.numel() * t.element_size() for t in (w13, w2, q13.scales, q2.scales)
                     + (() if q13.zeros is None else (q13.zeros, q2.zeros))) / e
    b13 = b2 = act = None
    if name == "gpt-oss-20b":
        g = torch.Generator(device="cuda").manual_seed(9)
        b13 = (torch.randn(e, 2 * i, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        b2 = (torch.randn(e, h, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        act = ExpertAct("gpt_oss", 1.702, 7.0)
    return (e, k, h, i), w13, w2, quant, per_expert, b13, b2, act


def _cases(shape, m: int, per_expert: float):
    e, k, h, _ = shape
    probe = make_case(e, k, h, m, 0)
    return [probe] + [make_case(e, k, h, m, s) for s in range(1, num_sets(probe.hit * per_expert))]


def bench(name: str, fmt: str, ms: list[int], read_gbs: float) -> None:
    shape, w13, w2, q, per_expert, b13, b2, act = _layer(name, fmt)
    h = shape[2]
    rows = []
    for m in ms:
        cases = _cases(shape, m, per_expert)
        fns = [lambda c=c: w4_ops.fused_moe_w4(c.x, fmt, w13, q.s13, q.z13, w2, q.s2, q.z2, c.weights, c.ids,
                                               b13=b13, b2=b2, act=act) for c in cases]
        hit = sum(c.hit for c in cases) / len(cases)
        floor_us = (hit * per_expert + 2 * m * h * 2) / read_gbs / 1e3
        saved = skinny_moe.MAX_TOKENS, grouped_moe.MAX_TOKENS
        skinny_moe.MAX_TOKENS = 0
        try:
            t_grouped, t_triton, diff = time_two_paths(fns, lambda: setattr(grouped_moe, "MAX_TOKENS", 1 << 20),
                                                       lambda: setattr(grouped_moe, "MAX_TOKENS", 0))
        finally:
            skinny_moe.MAX_TOKENS, grouped_moe.MAX_TOKENS = saved
        cfg = grouped_moe.configs(m, shape[1], shape[0])
        rows.append([str(m), f"{hit:.1f}", f"{t_triton:.1f}", f"{100 * floor_us / t_triton:.0f}%",
                     f"{t_grouped:.1f}", f"{100 * floor_us / t_grouped:.0f}%", f"{t_triton / t_grouped:.2f}x",
                     f"{cfg.block_m} {cfg.up} {cfg.down}", f"{diff:.1e}"])
    print_table(f"4-bit routed experts, {name} {fmt}: E={shape[0]}, top-{shape[1]}, H={h}, I={shape[3]}, bf16 x "
                f"(grouped used for {skinny_moe.MAX_TOKENS} < M <= {grouped_moe.MAX_TOKENS})",
                ["M", "experts hit", "Triton us", "% of floor", "grouped us", "% of floor", "speedup",
                 "grouped config", "max rel diff"], rows)


def sweep(name: str, fmt: str, ms: list[int], read_gbs: float) -> None:
    """Each launch alone: up over the aligned routing, down over a random intermediate."""
    shape, w13, w2, q, per_expert, b13, b2, act = _layer(name, fmt)
    e, k, h, i = shape
    for m in ms:
        cases = _cases(shape, m, per_expert)
        hit = sum(c.hit for c in cases) / len(cases)
        mids = [torch.randn(m * k, i, device="cuda", dtype=torch.bfloat16) for _ in cases]
        default = grouped_moe.configs(m, k, e)
        rows = []
        for block_m in grouped_moe.BLOCK_SIZES:
            aligned = [align(c.ids, e, block_m) for c in cases]
            tiles = [t for t, shp in enumerate(tile_shapes(fmt)) if shp[2] >= block_m]
            for tile, warps, splits in itertools.product(tiles, (1, 2, 4), (1,)):
                cfg = SkinnyConfig(tile, warps, splits)
                up = [lambda c=c, a=a, b=block_m, cfg=cfg: grouped_moe.up(c.x, w13, b13, a[0], a[1], k, b, act, cfg, q)
                      for c, a in zip(cases, aligned)]
                down = [lambda c=c, a=a, mid=mid, b=block_m, cfg=cfg: grouped_moe.down(
                        mid, w2, b2, a[0], a[1], c.weights, k, b, cfg, q) for c, a, mid in zip(cases, aligned, mids)]
                try:
                    t_up, t_down = time_calls(up, reps=10), time_calls(down, reps=10)
                except (RuntimeError, ValueError) as err:
                    rows.append([f"{block_m} {cfg}", "refused", str(err).splitlines()[0][:50], "", ""])
                    continue
                mark = (" (default up)" if (block_m, cfg) == (default.block_m, default.up) else "") + (
                    " (default down)" if (block_m, cfg) == (default.block_m, default.down) else "")
                up_bytes, down_bytes = hit * per_expert * 2 / 3, hit * per_expert / 3
                rows.append([f"{block_m} {cfg}{mark}", f"{t_up:.1f}", f"{100 * up_bytes / read_gbs / 1e3 / t_up:.0f}%",
                             f"{t_down:.1f}", f"{100 * down_bytes / read_gbs / 1e3 / t_down:.0f}%"])
        print_table(f"Grouped MoE launches, {name} {fmt}, M = {m} ({hit:.1f} experts hit; % of the read ceiling for "
                    "the launch's expert bytes)", ["block config", "up us", "up % read", "down us", "down % read"],
                    rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b:int4", "gpt-oss-20b:mxfp4"],
                    help="SHAPE:FORMAT, SHAPE of _moe_cases.SHAPES, FORMAT int4 (group 128) or mxfp4")
    ap.add_argument("--m", nargs="+", type=int, default=M_LIST)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    for spec in args.shapes:
        name, _, fmt = spec.partition(":")
        if name not in SHAPES or fmt not in ("int4", "mxfp4"):
            raise SystemExit(f"--shapes takes SHAPE:FORMAT with SHAPE in {sorted(SHAPES)} and FORMAT int4 or mxfp4, "
                             f"got {spec!r}")
        bench(name, fmt, args.m, read_gbs)
        if args.sweep:
            sweep(name, fmt, args.m, read_gbs)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
