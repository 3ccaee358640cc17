"""Deterministic mode's kernel candidates on the GPU (issue 24), for benchmarks/determinism.py.

GEMM: kernels/batch_invariant_gemm.CANDIDATES (16-bit: the skinny K order and the shape's fixed
splits) and the mode's in-use path (ops.linear: the skinny kernel up to 32 rows) against cuBLAS on
Qwen3-0.6B's and Llama-3.1-8B's linear shapes at M = 1 ... 4096, timed as 10 back-to-back calls in a CUDA graph
(no launch overhead; the engine runs graphs): median us per call, and % = cuBLAS's time / ours.
Also the candidates' bit classes per shape (which configs give identical bits on the same
rows, at M = 1 and M = 300) and the proposed batch_invariant_gemm_configs.json: per shape the
best single config (sum over M of time / cuBLAS's), or per-M configs from one bit class where
that is >= 3% better.

Attention: kernels/extend_attention.DETERMINISTIC_CONFIGS (GQA-packed, one config for every
step) against the default path (split-K decode kernel; the default extend tiles), us per call.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent / "kernels"))
from _bench import num_sets, time_calls  # noqa: E402

SHAPES = {  # (N, K) of each linear: qkv, o, gate_up, down, lm head
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)],
    "llama-3.1-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}
MS = (1, 16, 64, 256, 1024, 4096)


def graph_us(fn, calls: int = 10) -> float:
    """Median us per call of `fn`, `calls` back to back in one CUDA graph (_bench.time_calls)."""
    return time_calls([fn] * calls, reps=5)


def bit_classes(outs: list[list[torch.Tensor]]) -> list[list[int]]:
    """Candidates grouped by bit-identical outputs (every probe equal)."""
    classes: list[list[int]] = []
    for i, o in enumerate(outs):
        for c in classes:
            if all(torch.equal(a, b) for a, b in zip(outs[c[0]], o)):
                c.append(i)
                break
        else:
            classes.append([i])
    return classes


def propose(times: dict[int, list[float]], base: dict[int, float], classes: list[list[int]], cands: list) -> tuple:
    """(entries [[min_m, config]], score, single score): score = sum over M of time / cuBLAS."""
    def score(pick: dict[int, int]) -> float:
        return sum(times[m][pick[m]] / base[m] for m in MS)

    single = min(range(len(cands)), key=lambda c: score({m: c for m in MS}))
    best, best_score = [[1, list(cands[single])]], score({m: single for m in MS})
    single_score = best_score
    for cls in classes:
        pick = {m: min(cls, key=lambda c: times[m][c]) for m in MS}
        if score(pick) < 0.97 * best_score:
            entries: list[list] = []
            for m in MS:
                if not entries or entries[-1][1] != list(cands[pick[m]]):
                    entries.append([1 if not entries else m, list(cands[pick[m]])])
            best, best_score = entries, score(pick)
    return best, best_score, single_score


def _time_gemms(gemm, x: torch.Tensor, w: torch.Tensor, cands: list) -> tuple[float, list[float], float]:
    """(cuBLAS us, each candidate's us, the mode's in-use path's us) for x @ w^T. The in-use
    path is ops.linear in deterministic mode: the skinny kernel in the batch-invariant order up
    to 32 rows, the Triton GEMM with the table's config above."""
    from minisgl import ops

    base = graph_us(lambda: torch.nn.functional.linear(x, w))
    cand = [graph_us(lambda c=c: gemm(x, w, None, c)) for c in cands]
    ops.set_deterministic(x.device, True)
    try:
        used = graph_us(lambda: ops.linear(x, w))
    finally:
        ops.set_deterministic(x.device, False)
    return base, cand, used


def gemm_candidates(out_dir: Path | None) -> None:
    from minisgl.kernels.batch_invariant_gemm import CANDIDATES, configs_for, gemm
    from minisgl.ops import skinny_gemm

    print("\n== batch-invariant GEMM candidates vs cuBLAS (bf16, us per call in CUDA graphs; full table in "
          f"{out_dir / 'gemm.txt' if out_dir else 'the lines below'})")
    lines = [f"{'shape':>12} {'M':>5} {'cuBLAS':>8} " + " ".join(f"{str(c[:4]):>18}" for c in CANDIDATES)]
    proposed: dict[str, list] = {}
    print(f"{'shape':>12} {'cuBLAS us':>9} {'in use':>8} {'single':>8} {'per-M':>8}  bit classes (candidate indices)")
    tot = {"cublas": 0.0, "use": 0.0, "single": 0.0, "best": 0.0}
    for shapes in SHAPES.values():
        for n, k in shapes:
            g = torch.Generator(device="cuda").manual_seed(n + k)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
            probes = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g) for m in (1, 300)]
            classes = bit_classes([[gemm(x, w, None, c) for x in probes] for c in CANDIDATES])
            times: dict[int, list[float]] = {}
            base: dict[int, float] = {}
            in_use = 0.0
            skinny_vs: list[str] = []
            for m in MS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
                base[m], times[m], used = _time_gemms(gemm, x, w, CANDIDATES)
                in_use += used / base[m]
                lines.append(f"{n:>6}x{k:<5} {m:5} {base[m]:8.1f} " + " ".join(
                    f"{t:9.1f} ({100 * base[m] / t:4.0f}%)" for t in times[m]) + f" in use {used:9.1f}")
                if m <= 32:  # the mode's skinny launch against the default mode's kernel (default config)
                    sk = graph_us(lambda x=x, w=w: skinny_gemm(x, w))
                    skinny_vs.append(f"M {m}: {used:.1f} vs {sk:.1f} us ({100 * (used / sk - 1):+.0f}%)")
                else:  # the skinny kernel's splits against one chain over K (same config)
                    one = graph_us(lambda x=x, w=w: gemm(x, w, None, None, splits=1))
                    skinny_vs.append(f"M {m}: {used:.1f} vs one split {one:.1f} us")
            print(f"{n:>6}x{k:<5} deterministic vs default skinny (M <= 32) / vs one split: "
                  + "; ".join(skinny_vs))
            entries, best, single = propose(times, base, classes, CANDIDATES)
            proposed[f"{n}x{k}"] = entries
            tot["cublas"] += len(MS)
            tot["use"] += in_use
            tot["single"] += single
            tot["best"] += best
            pct = [f"{100 * len(MS) / v:7.0f}%" for v in (in_use, single, best)]
            print(f"{n:>6}x{k:<5} {sum(base.values()):9.1f} {' '.join(pct)}  {classes}  (in use: {configs_for(n, k)})")
    print(f"mean over shapes and M of cuBLAS time / ours: in use {100 * tot['cublas'] / tot['use']:.0f}%, "
          f"best single config per shape {100 * tot['cublas'] / tot['single']:.0f}%, "
          f"per-M within a bit class {100 * tot['cublas'] / tot['best']:.0f}%")
    print("proposed batch_invariant_gemm_configs.json '16bit' entries:")
    print(json.dumps(proposed))
    if out_dir:
        (out_dir / "gemm.txt").write_text("\n".join(lines) + "\n")
        (out_dir / "gemm_proposed.json").write_text(json.dumps(proposed, indent=1))
    else:
        print("\n".join(lines))


FP8_TILES = [(64, 64, 4, 4), (128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 3), (128, 256, 8, 3)]


def fp8_gemms() -> None:
    """Deterministic mode's FP8 GEMM (W8A16: the skinny FP8 loader in warp ranges up to 32 rows,
    kernels/batch_invariant_fp8.py above) against the default mode's FP8 path with no measured table
    (so activation quantization + the FP8 GEMM at every M; the engine's table puts its skinny FP8
    launch at small M) on Llama-3.1-8B's shapes, per-channel scales; and the Triton kernel per tile
    (any tile gives the same bits): us per call in CUDA graphs."""
    from minisgl.ops.gemm import dispatch
    from minisgl.ops.gemm.fp8 import quantize_rows

    dispatch._tables.clear()  # an engine run before this one (--only fp8) installed its measured table
    print("\n== FP8 GEMM (per-channel e4m3, bf16 x): deterministic mode vs default mode, us per call in CUDA "
          "graphs; the mode's path before (W8A8 Triton FP8 GEMM in one launch); then the mode's Triton kernel "
          "per tile (BLOCK_M, BLOCK_N, warps, stages)")
    print(f"{'shape':>12} {'M':>5} {'default':>8} {'mode':>8} {'cost':>6}  {'before':>8}  "
          + " ".join(f"{str(t):>16}" for t in FP8_TILES))
    for n, k in SHAPES["llama-3.1-8b"]:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w, scale = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.05)
        for m in MS:
            print(_fp8_row(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g), w, scale))


def _fp8_row(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> str:
    from minisgl import ops
    from minisgl.kernels import batch_invariant_fp8
    from minisgl.ops.gemm.fp8 import fp8_gemm

    (m, k), n = x.shape, w.size(0)
    base = graph_us(lambda: ops.linear(x, w, fmt="fp8", scale=scale))
    ops.set_deterministic(x.device, True)
    try:
        used = graph_us(lambda: ops.linear(x, w, fmt="fp8", scale=scale))
    finally:
        ops.set_deterministic(x.device, False)
    splits = batch_invariant_fp8.splits_for(n, k)
    tiles = [graph_us(lambda t=t: batch_invariant_fp8.gemm(x, w, scale, splits, None, t)) for t in FP8_TILES]
    # the mode's FP8 GEMM before the twenty-first session: W8A8, the Triton FP8 GEMM in one launch
    before = graph_us(lambda: fp8_gemm(x, w, scale, k, backend="triton", tiles=(64, 64, 128, 4, 4)))
    return (f"{n:>6}x{k:<5} {m:5} {base:8.1f} {used:8.1f} {100 * (used / base - 1):+5.0f}%  {before:8.1f}  "
            + " ".join(f"{t:16.1f}" for t in tiles))


def fp8_skinny_tiles() -> None:
    """The mode's skinny FP8 launch (warp ranges: the splits as one block's warps, one K split) per
    (tile, warps), against the best default-mode launch of a sweep, on Llama-3.1-8B's shapes and
    1024x2048, per-channel scales, weights rotated past L2: us per call in CUDA graphs. What
    kernels/batch_invariant_fp8.splits_for and skinny.deterministic_fp8_tile were set from (every
    tile gives the same bits; the warps do not: they are the splits)."""
    from minisgl.kernels.batch_invariant_fp8 import splits_for
    from minisgl.ops.gemm.fp8 import quantize_rows
    from minisgl.ops.gemm.skinny import FP8_FORMAT, SkinnyConfig, deterministic_fp8_tile, launch, tile_shapes

    tiles = tile_shapes(FP8_FORMAT)
    print(f"\n== skinny FP8 launches: the mode's (t<tile>w<warps>, warp ranges) vs the best default one "
          f"(t<tile>w<warps>s<splits>), us per call; tiles (RT, 32-element chunks, max M) {tiles}")
    for n, k in SHAPES["llama-3.1-8b"] + [(1024, 2048)]:
        g = torch.Generator(device="cuda").manual_seed(n)
        ws = [quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.05) for _ in range(num_sets(n * k))]
        s = splits_for(n, k)
        for m in (1, 8, 16, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

            def us(cfg: SkinnyConfig, ranges: bool, x=x, y=y, ws=ws) -> float:
                return time_calls([lambda w=w, sc=sc: launch(x, w, None, y, False, cfg, scale=sc, warp_ranges=ranges)
                                   for w, sc in ws], reps=20)

            mode = {f"t{t}w{w}": us(SkinnyConfig(t, w, 1), True) for t, (_, ch, mm) in enumerate(tiles)
                    for w in (1, 2, 4, 8) if m <= mm and k % w == 0 and (k // w) % (ch * 32) == 0}
            default = {str(c): us(c, False) for t, (_, ch, mm) in enumerate(tiles) if m <= mm
                       for c in (SkinnyConfig(t, w, sp) for w in (4, 8) for sp in (1, 2, 4, 8))
                       if k // c.splits >= c.warps * ch * 32}
            best = min(default, key=default.get)
            pick = f"t{deterministic_fp8_tile(m, k, s)}w{s}"
            print(f"{n:>6}x{k:<5} M {m:2}  best default {default[best]:6.2f} ({best})  mode {pick} {mode[pick]:6.2f} "
                  f"({100 * (mode[pick] / default[best] - 1):+.0f}%)  all: "
                  + " ".join(f"{c} {v:.2f}" for c, v in mode.items()))


def attention_candidates() -> None:
    from minisgl.kernels.deterministic_attention import DETERMINISTIC_CONFIGS

    print("\n== attention: deterministic configs (GQA-packed, BLOCK_M, BLOCK_N, warps, stages) vs the default "
          "path (us per call in CUDA graphs)")
    cases = [("decode b256 ctx1024 16/8", 256, 1024, 1, 16, 8), ("decode b32 ctx4096 16/8", 32, 4096, 1, 16, 8),
             ("decode b1 ctx2048 32/8", 1, 2048, 1, 32, 8), ("prefill b4 1024 16/8", 4, 0, 1024, 16, 8)]
    print(f"{'case':>26} {'default':>9} " + " ".join(f"{str(c):>18}" for c in DETERMINISTIC_CONFIGS)
          + f" {'split decode':>18}")
    for name, b, prefix, ext, hq, hkv in cases:
        line, outs = _attention_case(b, prefix, ext, hq, hkv, DETERMINISTIC_CONFIGS)
        print(f"{name:>26} {line}  bit classes {bit_classes([[o] for o in outs])}")


def _attention_case(b: int, prefix: int, ext: int, hq: int, hkv: int, configs: list) -> tuple[str, list]:
    """(table cells, each config's output)."""
    from minisgl import ops
    from minisgl.kernels.deterministic_attention import SPLIT, heads_per_tile, split_decode
    from minisgl.kernels.extend_attention import extend_attention, tile_map

    d = 128
    g = torch.Generator(device="cuda").manual_seed(b)
    seq = prefix + ext
    kc = torch.randn(b * seq + 1, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(b * seq + 1, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(b * ext, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    table = (torch.arange(b * seq, device="cuda", dtype=torch.int32) + 1).view(b, seq)
    i32 = dict(dtype=torch.int32, device="cuda")
    rows, pre = torch.arange(b, **i32), torch.full((b,), prefix, **i32)
    cu = torch.arange(b + 1, **i32) * ext
    seqs = torch.full((b,), seq, **i32)
    if ext == 1:
        base = graph_us(lambda: ops.decode_attention_triton(q, kc, vc, table, rows, seqs, seq, d**-0.5))
    else:
        base = graph_us(lambda: extend_attention(q, kc, vc, table, rows, pre, cu, ext, d**-0.5))
    cells, outs = [], []
    for cfg in configs:
        heads = heads_per_tile(hq // hkv, cfg[0])
        tiles = torch.tensor(tile_map([prefix] * b, [ext] * b, cfg[0] // heads), **i32).view(-1, 2)
        t = graph_us(lambda cfg=cfg, heads=heads, tiles=tiles: extend_attention(
            q, kc, vc, table, rows, pre, cu, ext, d**-0.5, config=cfg, tiles=tiles, heads_per_tile=heads, split=SPLIT))
        cells.append(f"{t:9.1f} ({100 * base / t:4.0f}%)")
        outs.append(extend_attention(q, kc, vc, table, rows, pre, cu, ext, d**-0.5, config=cfg, tiles=tiles,
                                     heads_per_tile=heads, split=SPLIT))
    if ext == 1:  # the first config's splits in parallel (the engine's decode path while its workspace fits)
        cfg = configs[0]
        heads = heads_per_tile(hq // hkv, cfg[0])
        tiles = torch.tensor(tile_map([prefix] * b, [ext] * b, cfg[0] // heads), **i32).view(-1, 2)
        bound = max(seq, 4096)

        def run() -> torch.Tensor:
            return split_decode(q, kc, vc, table, rows, pre, seqs, cu, tiles, bound, d**-0.5, cfg, heads, SPLIT)

        t = graph_us(run)
        cells.append(f"{t:9.1f} ({100 * base / t:4.0f}%)")
        same = torch.equal(run(), outs[0])
        cells.append("= config 0" if same else "DIFFERS from config 0")
    return f"{base:9.1f} " + " ".join(cells), outs


def out_dir() -> Path | None:
    """$OUT/det when the GPU runner gives an $OUT folder (bulky tables go there)."""
    if not os.environ.get("OUT"):
        return None
    path = Path(os.environ["OUT"]) / "det"
    path.mkdir(parents=True, exist_ok=True)
    return path
