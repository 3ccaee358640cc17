"""Deterministic mode's kernel candidates on the GPU (issue 24), for benchmarks/determinism.py.

GEMM: kernels/batch_invariant_gemm.CANDIDATES (16-bit: the skinny K order and the shape's fixed
splits), the mode's skinny launch (up to 32 rows) and the mode's in-use path (ops.linear) against
cuBLAS on Qwen3-0.6B's, Qwen3-8B's and Llama-3.1-8B's linear shapes at M = 1 ... 4096, the weights
rotated past L2 (as a decode step reads them; timing the same weight over and over let the
smaller shapes run from L2 and chose tiles that lose from HBM): median us per call in CUDA
graphs. Every option's bits are compared with the in-use path's, and the proposed
batch_invariant_gemm_configs.json is per shape the fastest option per M (propose_entries).

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


def graph_us(fn, calls: int = 10) -> float:
    """Median us per call of `fn`, `calls` back to back in one CUDA graph (_bench.time_calls)."""
    return time_calls([fn] * calls, reps=5)


def rotated_us(calls: list, m: int) -> float:
    """Median us per call of `calls` (one per weight set, rotated past L2) in one CUDA graph; fewer
    replays at large M, where one call is long."""
    return time_calls(calls, reps=10 if m >= 256 else 20)


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


GEMM_SHAPES = {**SHAPES, "qwen3-8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)],
               "llama-3.1-8b lm head": [(128256, 4096)]}
GEMM_MS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096)
STICK, SKINNY_STICK = 0.02, 0.03  # keep the previous M's choice within 2%; the skinny kernel within 3%


def propose_entries(per_m: dict[int, dict[str, float]], skinny_rows: int = 32) -> list[list]:
    """batch_invariant_gemm_configs.json entries [[min_m, config or "skinny"], ...] from
    {M: {choice: us}} (a choice: json.dumps(list(config)) or "skinny"): per M the fastest, kept on the
    previous M's choice within STICK (no flapping between near-equal tiles) and on the skinny
    kernel within SKINNY_STICK (the batch-1 path the mode's cost rows were measured on); "skinny"
    never past `skinny_rows`, so a config follows it by then."""
    out: list[list] = []
    prev = None
    for m in sorted(per_m):
        opts = {c: t for c, t in per_m[m].items() if c != "skinny" or m <= skinny_rows}
        if not opts:  # nothing measured with the in-use path's bits at this M: no entry from it
            continue
        best = min(opts, key=opts.get)
        pick = prev if prev in opts and opts[prev] <= opts[best] * (1 + STICK) else best
        if "skinny" in opts and opts["skinny"] <= opts[best] * (1 + SKINNY_STICK):
            pick = "skinny"
        if not out or out[-1][1] != pick:
            out.append([1 if not out else m, pick])
        prev = pick
    # "skinny" entries start at most at skinny_rows (its times past that were dropped above); if one is
    # still in force at skinny_rows + 1, the config after it starts there instead (or, past the
    # last entry, the fastest config at the largest M measured).
    at = max((i for i, (lo, _) in enumerate(out) if lo <= skinny_rows + 1), default=None)
    if at is not None and out[at][1] == "skinny":
        if at + 1 < len(out):
            out[at + 1][0] = skinny_rows + 1
        else:
            top = per_m[max(m for m in per_m if any(c != "skinny" for c in per_m[m]))]
            out.append([skinny_rows + 1, min((c for c in top if c != "skinny"), key=top.get)])
    return [[lo, c if c == "skinny" else json.loads(c)] for lo, c in out]


def gemm_candidates(out_dir: Path | None) -> None:
    """Per shape and M, with the weights rotated past L2 as in a decode step (_bench.num_sets):
    cuBLAS, the mode's skinny launch (M <= 32), each CANDIDATES config and the mode's in-use path
    (ops.linear in the mode); every option's bits against the in-use path's at that M; the proposed
    table (propose_entries) and, per shape, summed over M, in use / cuBLAS and proposed / cuBLAS."""
    from minisgl import ops
    from minisgl.kernels.batch_invariant_gemm import CANDIDATES, SKINNY_ROWS, configs_for, gemm
    from minisgl.ops.gemm.dispatch import deterministic_skinny

    def timed(f, xs: list, ws: list, m: int) -> float:
        return rotated_us([lambda x=x, w=w: f(x, w) for x, w in zip(xs, ws)], m)

    def skinny(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return deterministic_skinny(x, w, None, torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype))

    dev = torch.device("cuda")
    print("\n== deterministic mode's 16-bit GEMM vs cuBLAS (bf16, us per call in CUDA graphs, weights from HBM; "
          f"full table in {out_dir / 'gemm.txt' if out_dir else 'the lines below'})")
    lines, proposed, differ = [], {}, []
    seen = set()
    for shapes in GEMM_SHAPES.values():
        for n, k in shapes:
            if (n, k) in seen:
                continue
            seen.add((n, k))
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(num_sets(n * k * 2))]
            per_m, sums = {}, {"cublas": 0.0, "use": 0.0}
            for m in GEMM_MS:
                if n > 100_000 and m > 256:  # an LM head sees a decode batch's rows only
                    continue
                xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _ in ws]
                base = timed(torch.nn.functional.linear, xs, ws, m)
                ops.set_deterministic(dev, True)
                try:
                    ref, used = ops.linear(xs[0], ws[0]), timed(ops.linear, xs, ws, m)
                finally:
                    ops.set_deterministic(dev, False)
                opts = {json.dumps(list(c)): lambda x, w, c=c: gemm(x, w, None, c) for c in CANDIDATES}
                if m <= SKINNY_ROWS:
                    opts["skinny"] = skinny
                per_m[m] = {}
                for name, f in opts.items():
                    if not torch.equal(f(xs[0], ws[0]), ref):
                        differ.append(f"{n}x{k} M {m} {name}")
                        continue
                    per_m[m][name] = timed(f, xs, ws, m)
                sums["cublas"] += base
                sums["use"] += used
                top = sorted(per_m[m], key=per_m[m].get)[:3]
                lines.append(f"{n:>6}x{k:<5} M {m:5}: cuBLAS {base:8.1f} in use {used:8.1f} | "
                             + ", ".join(f"{per_m[m][c]:.1f} {c}" for c in top))
            entries = propose_entries(per_m)
            proposed[f"{n}x{k}"] = entries
            new = sum(per_m[m]["skinny" if c == "skinny" else json.dumps(c)] for m in per_m
                      for c in [[cc for lo, cc in entries if lo <= m][-1]])
            print(f"{n:>6}x{k:<5} summed over M, / cuBLAS: in use {sums['use'] / sums['cublas']:.2f}, proposed "
                  f"{new / sums['cublas']:.2f}  (in use: {configs_for(n, k)})")
            print(f"  proposed {n}x{k}: {json.dumps(entries)}", flush=True)
            del ws
            torch.cuda.empty_cache()
    print("options whose bits differ from the in-use path (must be none):", differ or "none")
    print("proposed batch_invariant_gemm_configs.json '16bit' entries (add 'default' by hand):")
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
    (any tile gives the same bits, the skinny launch's too): us per call in CUDA graphs, the weights
    rotated past L2 as a decode step reads them (as gemm_candidates; until the twenty-ninth session
    one weight was timed over and over, so the smaller shapes ran from L2)."""
    from minisgl.ops.gemm import dispatch
    from minisgl.ops.gemm.fp8 import quantize_rows

    dispatch._tables.clear()  # an engine run before this one (--only fp8) installed its measured table
    print("\n== FP8 GEMM (per-channel e4m3, bf16 x): deterministic mode vs default mode, us per call in CUDA "
          "graphs, weights from HBM; the mode's path before (W8A8 Triton FP8 GEMM in one launch); then the mode's "
          "Triton kernel per tile (BLOCK_M, BLOCK_N, warps, stages)")
    print(f"{'shape':>12} {'M':>5} {'default':>8} {'mode':>8} {'cost':>6}  {'before':>8}  "
          + " ".join(f"{str(t):>16}" for t in FP8_TILES))
    for n, k in SHAPES["llama-3.1-8b"]:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        ws = [quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.05) for _ in range(num_sets(n * k))]
        for m in FP8_MS:
            print(_fp8_row(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g), ws))


FP8_MS = (1, 8, 16, 24, 32, 64, 256, 1024, 4096)  # 8-32: where the mode's skinny launch may lose to a tile


def _fp8_row(x: torch.Tensor, ws: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    from minisgl import ops
    from minisgl.kernels import batch_invariant_fp8
    from minisgl.ops.gemm.fp8 import fp8_gemm

    (m, k), n = x.shape, ws[0][0].size(0)

    def rotated(f) -> float:  # us per call, each call on the next weight set
        return rotated_us([lambda w=w, sc=sc: f(w, sc) for w, sc in ws], m)

    base = rotated(lambda w, sc: ops.linear(x, w, fmt="fp8", scale=sc))
    ops.set_deterministic(x.device, True)
    try:
        used = rotated(lambda w, sc: ops.linear(x, w, fmt="fp8", scale=sc))
    finally:
        ops.set_deterministic(x.device, False)
    splits = batch_invariant_fp8.splits_for(n, k)
    tiles = [rotated(lambda w, sc, t=t: batch_invariant_fp8.gemm(x, w, sc, splits, None, t)) for t in FP8_TILES]
    # the mode's FP8 GEMM before the twenty-first session: W8A8, the Triton FP8 GEMM in one launch
    before = rotated(lambda w, sc: fp8_gemm(x, w, sc, k, backend="triton", tiles=(64, 64, 128, 4, 4)))
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
