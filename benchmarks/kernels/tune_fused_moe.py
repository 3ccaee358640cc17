"""Tile configs of the fused MoE GEMMs for this GPU: for each shape and token count M, every
BLOCK_M that suits M, and every candidate tile of the up (gate_up + SiLU-and-mul) and down GEMMs,
time it (CUDA-graph replays over rotated routings, _bench.py), keep the fastest up + down pair,
and write them under this GPU's name into the JSON that kernels/fused_moe_config.py reads.

    python benchmarks/kernels/tune_fused_moe.py [--shapes ...] [--tp 1 2] [--m 1 64 ...] [--out PATH]
        [--w4 int4|mxfp4 [--group 128]] [--jobs N]

--w4 tunes 4-bit experts (kernels/quant4.py's layouts, INT4 at --group; their own entries,
fused_moe_config.shape_key's w=int4g<group> or w=mxfp4). --jobs N compiles every candidate tile first in N processes
(Triton's disk cache then serves the timing process; one process compiles a 4-bit candidate in
~1-2 s, and a shape has ~150 of them).

--out defaults to the repository's kernels/fused_moe_configs.json (entries of other GPUs and
shapes are kept); it is rewritten after each M, so a cut-short run keeps what it finished.
Until the package is reinstalled, MINISGL_FUSED_MOE_CONFIGS=PATH makes the runtime use the file
(benchmarks/kernels/fused_moe.py reads the repository's file by default). Compiles dominate the
first shape's time; they are shared by the others (the row counts are not specialized on).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
from _bench import num_sets, print_table, time_calls
from _moe_cases import M_LIST, REPO_CONFIGS, SHAPES, expert_bytes, make_case, make_w4_weights, make_weights
from triton.errors import TritonError

from minisgl.kernels import fused_moe as G
from minisgl.kernels import moe_align
from minisgl.kernels.fused_moe_config import GemmTile, MoeTileConfig, default_config, shape_key, weights_key

SMEM_BYTES = 220 * 1024  # per-block shared memory the pipelined tiles may use (H100: 227 KB)
SAFE_TILE = GemmTile(64, 64)  # fills the intermediate the down GEMM candidates read


def block_ms(m: int, top_k: int, e: int) -> list[int]:
    """BLOCK_M up to twice the mean rows per expert: a larger block is mostly padding."""
    per_expert = m * top_k / e
    return [b for b in (16, 32, 64, 128) if b == 16 or b <= 2 * per_expert]


def tiles(block_m: int, gated: bool) -> list[GemmTile]:
    if block_m == 16:  # weight streaming: narrow N tiles for more programs, deep K
        grid = [(n, k, 4, s) for n in (16, 32, 64, 128) for k in (128, 256) for s in (3, 4)]
    elif block_m == 32:
        grid = [(n, k, 4, s) for n in (32, 64, 128) for k in (64, 128) for s in (3, 4)]
    else:
        grid = [(n, k, w, s) for n in (64, 128, 256) for k in (64, 128) for w in (4, 8) for s in (3, 4)]
    b_rows = 2 if gated else 1
    out = []
    for n, k, w, s in grid:
        smem = s * (block_m * k + b_rows * k * n) * 2
        regs = block_m * n * b_rows // (32 * w)  # fp32 accumulators per thread
        if smem <= SMEM_BYTES and regs <= 128:
            out.append(GemmTile(n, k, 1 if block_m <= 32 else 8, w, s))
    return out


def time_gemm(fns: list, reps: int = 10) -> float:
    try:
        return time_calls(fns, reps=reps)
    except (TritonError, RuntimeError) as e:  # a tile this GPU cannot hold (resources, ptxas, compile)
        print(f"  skipped a tile: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        return float("inf")


def tune_m(w13: torch.Tensor, w2: torch.Tensor, e: int, k: int, h: int, m: int, q13: G.W4 | None = None,
           q2: G.W4 | None = None) -> tuple[MoeTileConfig, float, float]:
    """(best config, its up + down time, the default config's) for M tokens, in us. q13 / q2: the
    4-bit experts' scales (w13 / w2 then hold the packed values)."""
    inter = w2.shape[2] if q2 is None else w13.shape[1] // 2
    probe = make_case(e, k, h, m, 0)
    sets = num_sets(probe.hit * expert_bytes(h, inter, q13 is not None))
    cases = [probe] + [make_case(e, k, h, m, s) for s in range(1, sets)]

    def measure(block_m: int, ups: list[GemmTile], downs: list[GemmTile]) -> tuple[GemmTile, float, GemmTile, float]:
        aligned = [moe_align.align(c.ids, e, block_m) for c in cases]
        inters = [G.up_gemm(c.x, w13, *a, k, block_m, SAFE_TILE, q13) for c, a in zip(cases, aligned)]
        up_us = {t: time_gemm([lambda c=c, a=a, t=t: G.up_gemm(c.x, w13, *a, k, block_m, t, q13)
                               for c, a in zip(cases, aligned)]) for t in ups}
        down_us = {t: time_gemm([lambda c=c, a=a, x=x, t=t: G.down_gemm(x, w2, c.weights, *a, block_m, t, q2)
                                 for c, a, x in zip(cases, aligned, inters)]) for t in downs}
        up, down = min(up_us, key=up_us.get), min(down_us, key=down_us.get)
        return up, up_us[up], down, down_us[down]

    d = default_config(e, k, m, torch.bfloat16)
    _, t_up, _, t_down = measure(d.block_m, [d.up], [d.down])
    default_us = t_up + t_down
    best, best_us = d, default_us
    for block_m in block_ms(m, k, e):
        up, t_up, down, t_down = measure(block_m, tiles(block_m, True), tiles(block_m, False))
        if t_up + t_down < best_us:
            best, best_us = MoeTileConfig(block_m, up, down), t_up + t_down
    return best, best_us, default_us


def _weights(e: int, h: int, inter: int, w4: str | None, group: int) -> tuple:
    """(w13, w2, q13, q2): 16-bit experts (q None) or 4-bit ones."""
    return (*make_weights(e, h, inter), None, None) if w4 is None else make_w4_weights(e, h, inter, w4, group)


def _warm(e: int, k: int, h: int, inter: int, w4: str | None, group: int, jobs: list[tuple[int, bool, GemmTile]]
          ) -> int:
    """A compile worker: run each (BLOCK_M, up?, tile) once, so Triton's disk cache holds it."""
    w13, w2, q13, q2 = _weights(e, h, inter, w4, group)
    case = make_case(e, k, h, 256, 0)
    done = 0
    for block_m, up, t in jobs:
        a = moe_align.align(case.ids, e, block_m)
        try:
            if up:
                G.up_gemm(case.x, w13, *a, k, block_m, t, q13)
            else:
                x = G.up_gemm(case.x, w13, *a, k, block_m, SAFE_TILE, q13)
                G.down_gemm(x, w2, case.weights, *a, block_m, t, q2)
            torch.cuda.synchronize()
            done += 1
        except (TritonError, RuntimeError):
            pass  # the timing process reports it
    return done


def precompile(e: int, k: int, h: int, inter: int, ms: list[int], w4: str | None, group: int, procs: int) -> None:
    jobs = {(b, up, t) for m in ms for b in block_ms(m, k, e) for up in (True, False) for t in tiles(b, up)}
    for m in ms:
        d = default_config(e, k, m, torch.bfloat16)
        jobs |= {(d.block_m, True, d.up), (d.block_m, False, d.down)}
    jobs = sorted(jobs, key=lambda j: (j[0], j[1], j[2].block_n, j[2].block_k, j[2].num_warps, j[2].num_stages))
    start = time.perf_counter()
    procs = min(procs, len(jobs))
    with ProcessPoolExecutor(procs, mp_context=get_context("spawn")) as pool:
        done = sum(pool.map(_warm, *zip(*[(e, k, h, inter, w4, group, jobs[i::procs]) for i in range(procs)])))
    print(f"compiled {done} of {len(jobs)} candidates in {procs} processes, {time.perf_counter() - start:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tp", nargs="+", type=int, default=[1], help="tensor-parallel sizes (I / tp per rank)")
    ap.add_argument("--m", nargs="+", type=int, default=M_LIST)
    ap.add_argument("--out", type=Path, default=REPO_CONFIGS)
    ap.add_argument("--w4", choices=("int4", "mxfp4"), default=None, help="4-bit experts in this format")
    ap.add_argument("--group", type=int, default=128, help="INT4 scale group (--w4 int4)")
    ap.add_argument("--jobs", type=int, default=0, help="compile the candidates first in this many processes")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    table = json.loads(args.out.read_text()) if args.out.exists() else {}
    start = time.perf_counter()
    for name in args.shapes:
        for tp in args.tp:
            e, k, h, i = SHAPES[name]
            if args.jobs > 0:
                precompile(e, k, h, i // tp, args.m, args.w4, args.group, args.jobs)
            w13, w2, q13, q2 = _weights(e, h, i // tp, args.w4, args.group)
            key = shape_key(e, k, i // tp, h, torch.bfloat16, weights_key(args.w4, args.group))
            entry = table.setdefault(device, {}).setdefault(key, {})
            rows = []
            for m in args.m:
                cfg, us, default_us = tune_m(w13, w2, e, k, h, m, q13, q2)
                entry[str(m)] = cfg.to_dict()
                rows.append([str(m), str(cfg.block_m), _fmt(cfg.up), _fmt(cfg.down), f"{us:.1f}", f"{default_us:.1f}",
                             f"{default_us / us:.2f}x", f"{time.perf_counter() - start:.0f}"])
                args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")  # a cut run keeps each M
                print(" | ".join(rows[-1]), flush=True)
            print_table(f"{name} TP={tp} (E={e}, top-{k}, H={h}, I/tp={i // tp}, {args.w4 or 'bf16'} experts) on "
                        f"{device}: up + down GEMM "
                        "time, tuned vs default tiles", ["M", "BLOCK_M", "up tile", "down tile", "tuned us",
                                                         "default us", "gain", "elapsed s"], rows)
            del w13, w2
            torch.cuda.empty_cache()
    print(f"wrote {args.out}")


def _fmt(t: GemmTile) -> str:
    return f"{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages} g{t.group_m}"


if __name__ == "__main__":
    main()
