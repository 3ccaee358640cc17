"""The routed experts of a decode step's few tokens: the skinny MoE kernel (ops/gemm/skinny_moe.py:
route + up + down, the top-k sum inside the down launch) against the Triton fused MoE (route and
align + up + down + sum) on the same router logits, bf16, per token count.

    python benchmarks/kernels/skinny_moe.py [--shapes gpt-oss-20b qwen3-30b-a3b] [--m 1 2 4 8] [--sweep]

GPT-OSS-20B's layer takes its expert biases and clamped SwiGLU in both paths. Both are CUDA-graph
replays over rotated input sets (_bench.py), so the weights come from HBM as in a real step.
Bytes floor = (bytes of the experts hit + x and out) / the read ceiling measured in the same run
(1 GiB fp32 sum); "% of floor" = floor time / time. For the skinny kernel the experts are read once
per (token, expert) pair, so at M > 1 its own bytes can exceed the floor's.
--sweep: at M = 1, every (tile, warps, splits) of the up and down launches (ops/gemm/skinny_moe.py's
default marked), to choose the defaults.
--deterministic: the whole fused_moe per M, the default mode against deterministic mode at each
candidate of skinny_moe.MIN_SPLIT_K (the experts' shortest K split there; the (up, down) splits it
gives in brackets), to choose it: the skinny kernel up to 2 tokens, the grouped GEMM above.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from _bench import ceilings, num_sets, print_ceilings, print_table, time_calls, time_two_paths
from _moe_cases import SHAPES, expert_bytes, make_case, make_weights

from minisgl import ops
from minisgl.kernels.fused_moe import ExpertAct
from minisgl.ops.gemm import skinny_moe
from minisgl.ops.gemm.skinny import SkinnyConfig, tile_shapes


def _biases(name: str, e: int, h: int, i: int):
    if name != "gpt-oss-20b":
        return None, None, None
    g = torch.Generator(device="cuda").manual_seed(9)
    b13 = torch.randn(e, 2 * i, device="cuda", generator=g).to(torch.bfloat16) * 0.1
    b2 = torch.randn(e, h, device="cuda", generator=g).to(torch.bfloat16) * 0.1
    return b13, b2, ExpertAct("gpt_oss", 1.702, 7.0)


def _layer_calls(name: str, m: int, w13, w2, b13, b2, act) -> tuple[list, list]:
    """M-token input sets, enough that their experts' bytes pass L2 (_bench.num_sets), and one
    ops.fused_moe call on each."""
    e, k, h, i = SHAPES[name]
    probe = make_case(e, k, h, m, 0)
    per_call = probe.hit * expert_bytes(h, i) + 2 * m * h * 2
    cases = [probe] + [make_case(e, k, h, m, s) for s in range(1, num_sets(per_call))]
    return cases, [lambda c=c: ops.fused_moe(c.x, c.logits, w13, w2, k, True, b13=b13, b2=b2, act=act)
                   for c in cases]


def bench_shape(name: str, ms: list[int], read_gbs: float) -> None:
    e, k, h, i = SHAPES[name]
    w13, w2 = make_weights(e, h, i)
    b13, b2, act = _biases(name, e, h, i)
    rows = []
    for m in ms:
        cases, fns = _layer_calls(name, m, w13, w2, b13, b2, act)
        hit = sum(c.hit for c in cases) / len(cases)
        floor_us = (hit * expert_bytes(h, i) + 2 * m * h * 2) / read_gbs / 1e3
        saved = skinny_moe.MAX_TOKENS
        try:
            t_skinny, t_triton, diff = time_two_paths(fns, lambda: setattr(skinny_moe, "MAX_TOKENS", 64),
                                                      lambda: setattr(skinny_moe, "MAX_TOKENS", 0))
        finally:
            skinny_moe.MAX_TOKENS = saved
        rows.append([str(m), f"{hit:.1f}", f"{t_triton:.1f}", f"{100 * floor_us / t_triton:.0f}%",
                     f"{t_skinny:.1f}", f"{100 * floor_us / t_skinny:.0f}%", f"{t_triton / t_skinny:.2f}x",
                     "skinny" if m <= saved else "triton", f"{diff:.1e}"])
    print_table(
        f"Routed experts, {name}: E={e}, top-{k}, H={h}, I={i}, bf16, from router logits "
        f"(skinny used up to M = {skinny_moe.MAX_TOKENS})",
        ["M", "experts hit", "Triton us", "% of floor", "skinny us", "% of floor", "speedup", "default path",
         "max rel diff"],
        rows,
    )


def sweep(name: str, read_gbs: float) -> None:
    """Every up and down configuration at M = 1, each launch timed alone on its own inputs."""
    e, k, h, i = SHAPES[name]
    w13, w2 = make_weights(e, h, i)
    b13, b2, act = _biases(name, e, h, i)
    cases = [make_case(e, k, h, 1, s) for s in range(num_sets(k * expert_bytes(h, i)))]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    d_up, d_down = skinny_moe.default_configs(k, h, i, sms)
    mids = [torch.randn(k, i, device="cuda", dtype=torch.bfloat16) for _ in cases]
    up_bytes, down_bytes = k * 2 * i * h * 2, k * h * i * 2
    rows = []
    for tile, warps, splits in itertools.product(range(len(tile_shapes())), (2, 4, 8), (1, 2, 4)):
        cfg = SkinnyConfig(tile, warps, splits)
        up = [lambda c=c, cfg=cfg: skinny_moe._launch(c.x, w13, b13, c.ids, c.weights, torch.empty(
              k, i, device="cuda", dtype=torch.bfloat16), False, act, cfg, None) for c in cases]
        down = [lambda c=c, mid=mid, cfg=cfg: skinny_moe._launch(mid, w2, b2, c.ids, c.weights, torch.empty(
                1, h, device="cuda", dtype=torch.bfloat16), True, None, cfg, None) for c, mid in zip(cases, mids)]
        try:
            t_up, t_down = time_calls(up, reps=20), time_calls(down, reps=20)
        except (RuntimeError, ValueError) as e:  # a launch the kernel refuses (too short a split, ...)
            rows.append([str(cfg), "refused", str(e).splitlines()[0][:60], "", ""])
            continue
        default = (" (default up)" if cfg == d_up else "") + (" (default down)" if cfg == d_down else "")
        rows.append([str(cfg) + default,
                     f"{t_up:.1f}", f"{100 * up_bytes / read_gbs / 1e3 / t_up:.0f}%", f"{t_down:.1f}",
                     f"{100 * down_bytes / read_gbs / 1e3 / t_down:.0f}%"])
    print_table(f"Skinny MoE launch configurations, {name}, M = 1 (% of the read ceiling for the launch's "
                "expert bytes)", ["config", "up us", "up % read", "down us", "down % read"], rows)


def deterministic(name: str, ms: list[int]) -> None:
    from minisgl.kernels.batch_invariant_gemm import splits_for

    e, k, h, i = SHAPES[name]
    w13, w2 = make_weights(e, h, i)
    b13, b2, act = _biases(name, e, h, i)
    cands = (512, 384, 256, 128)
    rows = []
    for m in ms:
        _, fns = _layer_calls(name, m, w13, w2, b13, b2, act)
        row = [str(m), f"{time_calls(fns, reps=10):.1f}"]
        saved = skinny_moe.MIN_SPLIT_K
        ops.set_deterministic(torch.device("cuda"), True)
        try:
            for c in cands:
                skinny_moe.MIN_SPLIT_K = c
                row.append(f"{time_calls(fns, reps=10):.1f} ({splits_for(h, c)}, {splits_for(i, c)})")
        finally:
            ops.set_deterministic(torch.device("cuda"), False)
            skinny_moe.MIN_SPLIT_K = saved
        rows.append(row)
    print_table(f"fused_moe, {name}: default mode against deterministic mode by MIN_SPLIT_K (us per call; in use: "
                f"{skinny_moe.MIN_SPLIT_K})", ["M", "default"] + [f"det, min {c}" for c in cands], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["gpt-oss-20b", "qwen3-30b-a3b"], choices=list(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--deterministic", action="store_true",
                    help="the mode's cost per M and MIN_SPLIT_K (no other table)")
    args = ap.parse_args()
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    for name in args.shapes:
        if args.deterministic:
            deterministic(name, args.m)
            continue
        bench_shape(name, args.m, read_gbs)
        if args.sweep:
            sweep(name, read_gbs)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
