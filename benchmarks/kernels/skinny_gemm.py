"""Skinny GEMM microbenchmark: our kernel against cuBLAS (torch.nn.functional.linear) on the
weight shapes of Llama-3.1-8B, Qwen3-8B and Qwen3-0.6B (TP 1 and 2 shards), M = 1..32.

    python benchmarks/kernels/skinny_gemm.py [--quick] [--sweep] [--json FILE]

Bytes per call = W (N x K x 2) + x (M x K x 2) + y (M x N_out x 2); GB/s = bytes / time;
"% read" is that against the read ceiling measured in this run (1 GiB fp32 sum). "ours" is
the fastest of the candidate configurations the engine times at start (ops/gemm/table.py), as the
dispatch would pick it, timed without programmatic dependent launch as the dispatch times it;
"PDL us" is the same launch as the model makes it (sm_90: each call's launch and first W loads
overlap the previous call's tail; in the model only down_proj follows one of ours). The SiLU
table compares gate_up with the fused SiLU-and-mul epilogue against the same GEMM followed
by the SiLU-and-mul kernel (ours and cuBLAS).

--sweep times every launch configuration (tile x warps x splits) per shape and M, prints the
best per (shape, M), the configurations that win most, and a small "candidate set" of
(tile, warps) pairs that stays within 1% of the sweep's best everywhere: the data for
gemm_table.CANDIDATE_PAIRS.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _bench import ceilings, num_sets, print_ceilings, print_table, time_calls

from minisgl.ops import silu_and_mul
from minisgl.ops.gemm.reference import skinny_gemm_reference
from minisgl.ops.gemm.skinny import SkinnyConfig, launch, tile_shapes
from minisgl.ops.gemm.table import CANDIDATE_PAIRS, candidate_configs, split_counts

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODELS = ("llama-3.1-8b", "qwen3-8b", "qwen3-0.6b")
MS = (1, 2, 4, 8, 16, 32)
SWEEP_WARPS = (2, 4, 8)
SWEEP_SPLITS = (1, 2, 4, 8, 16)


def layer_shapes(model: str, tp: int) -> dict[str, tuple[int, int, bool]]:
    """Layer -> (weight rows N, K, SiLU epilogue) of one TP rank's shard."""
    c = json.loads((CONFIGS / model / "config.json").read_text())
    h, d = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv, inter = c["num_attention_heads"] // tp, max(1, c["num_key_value_heads"] // tp), c["intermediate_size"] // tp
    return {
        "qkv_proj": ((q + 2 * kv) * d, h, False),
        "o_proj": (h, q * d, False),
        "gate_up_proj": (2 * inter, h, False),
        "gate_up+silu": (2 * inter, h, True),
        "down_proj": (h, inter, False),
        "lm_head": (-(-c["vocab_size"] // tp), h, False),
    }


def make_sets(n: int, k: int, m: int, silu: bool, count: int) -> list[dict]:
    n_out = n // 2 if silu else n
    return [
        dict(
            w=torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05,
            x=torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
            y=torch.empty(m, n_out, device="cuda", dtype=torch.bfloat16),
            tmp=torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(count)
    ]


def ours(s: dict, silu: bool, cfg: SkinnyConfig, pdl: bool = False):
    return lambda: launch(s["x"], s["w"], None, s["y"], silu, cfg, pdl=pdl)


def ours_unfused(s: dict, cfg: SkinnyConfig):
    def f() -> torch.Tensor:
        launch(s["x"], s["w"], None, s["tmp"], False, cfg, pdl=False)
        return silu_and_mul(s["tmp"])

    return f


def cublas(s: dict, silu: bool):
    if silu:
        return lambda: silu_and_mul(F.linear(s["x"], s["w"]))
    return lambda: F.linear(s["x"], s["w"], out=s["y"])


def sweep_configs(m: int, n_out: int, k: int, silu: bool, sms: int) -> list[SkinnyConfig]:
    out = []
    for tile, (rt, chunks, max_m) in enumerate(tile_shapes()):
        if m > max_m:
            continue
        tiles = -(-n_out // (rt * (8 if silu else 16)))
        for warps in SWEEP_WARPS:
            for s in SWEEP_SPLITS:
                if s == 1 or (tiles * s <= 16 * sms and -(-k // s) >= warps * chunks * 32):
                    out.append(SkinnyConfig(tile, warps, s))
    return out


def check(s: dict, silu: bool, cfg: SkinnyConfig) -> float:
    """Max |ours - fp32 reference| / max |reference| on one set: a broken config shows here."""
    launch(s["x"], s["w"], None, s["y"], silu, cfg, pdl=False)
    ref = skinny_gemm_reference(s["x"], s["w"], None, silu).float()
    return ((s["y"].float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()


def candidate_set(results: dict, tol: float = 0.01) -> list[tuple[int, int]]:
    """Greedy: add the (tile, warps) pair that most lowers the summed best time (each pair at
    its best allowed split count) until every (shape, M) is within `tol` of its sweep best."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_pair: dict[tuple[int, int], dict[str, float]] = {}
    best: dict[str, float] = {}
    for key, r in results.items():
        best[key] = min(r["sweep"].values())
        shape = r["shape"]
        for text, t in r["sweep"].items():
            cfg = SkinnyConfig.parse(text)
            rt, chunks, _ = tile_shapes()[cfg.tile]
            tiles = -(-shape[1] // (rt * (8 if shape[3] else 16)))
            if cfg.splits not in split_counts(tiles, shape[2], cfg.warps, chunks * 32, sms):
                continue  # the engine would not time this split count
            slot = per_pair.setdefault((cfg.tile, cfg.warps), {})
            slot[key] = min(slot.get(key, float("inf")), t)
    chosen: list[tuple[int, int]] = []

    def score(pairs: list[tuple[int, int]]) -> tuple[int, float]:
        worse, total = 0, 0.0
        for key in best:
            t = min((per_pair[p].get(key, float("inf")) for p in pairs), default=float("inf"))
            worse += t > best[key] * (1 + tol)
            total += min(t, 10 * best[key])
        return worse, total

    while per_pair and len(chosen) < len(per_pair):
        pick = min((p for p in per_pair if p not in chosen), key=lambda p: score(chosen + [p]))
        chosen.append(pick)
        if score(chosen)[0] == 0:
            break
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Llama-3.1-8B TP 1 only, fewer repetitions")
    ap.add_argument("--sweep", action="store_true", help="time every launch configuration (tile x warps x splits)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--json", default=None, help="write every timing here")
    args = ap.parse_args()
    if not tile_shapes():
        sys.exit("minisgl._C has no CUDA kernels: build with nvcc")
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"tile shapes (row tiles, chunks per group, max M): {list(tile_shapes())}; candidates {CANDIDATE_PAIRS}")
    models = ("llama-3.1-8b",) if args.quick else tuple(args.models.split(","))
    tps = (1,) if args.quick else tuple(int(t) for t in args.tp.split(","))
    ms = tuple(int(m) for m in args.m.split(","))
    reps = 15 if args.quick else 30
    results: dict[str, dict] = {}  # "N,K,silu,M" -> timings (shapes repeat across models)
    for model in models:
        for tp in tps:
            rows, silu_rows = [], []
            for layer, (n, k, silu) in layer_shapes(model, tp).items():
                n_out = n // 2 if silu else n
                for m in ms:
                    key = f"{n},{k},{int(silu)},{m}"
                    if key not in results:
                        results[key] = measure(n, k, m, silu, sms, reps, args.sweep)
                    r = results[key]
                    gbs = (n * k + m * k + m * n_out) * 2 / r["ours"] / 1e3
                    cb_gbs = (n * k + m * k + m * n_out) * 2 / r["cublas"] / 1e3
                    if silu:
                        silu_rows.append([layer, f"{n}x{k}", str(m), f"{r['ours']:.1f}", f"{r['unfused']:.1f}",
                                          f"{r['cublas']:.1f}", f"{r['unfused'] / r['ours']:.2f}x",
                                          f"{r['cublas'] / r['ours']:.2f}x", r["config"]])
                        continue
                    rows.append([layer, f"{n}x{k}", str(m), f"{r['cublas']:.1f}", f"{100 * cb_gbs / read_gbs:.0f}%",
                                 f"{r['ours']:.1f}", f"{gbs:,.0f}", f"{100 * gbs / read_gbs:.0f}%",
                                 f"{r['cublas'] / r['ours']:.2f}x", r["config"], f"{r['pdl']:.1f}",
                                 f"{r['err']:.1e}"])
            print_table(f"{model} TP {tp}, bf16: ours (best candidate) vs cuBLAS",
                        ["layer", "N x K", "M", "cuBLAS us", "cuBLAS %read", "ours us", "GB/s", "% read",
                         "speedup", "config", "PDL us", "rel err"], rows)
            print_table(f"{model} TP {tp}: gate_up with the fused SiLU-and-mul vs GEMM then silu_and_mul",
                        ["layer", "N x K", "M", "fused us", "ours+silu us", "cuBLAS+silu us", "vs ours+silu",
                         "vs cuBLAS+silu", "config"], silu_rows)
    if args.sweep:
        report_sweep(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def measure(n: int, k: int, m: int, silu: bool, sms: int, reps: int, sweep: bool) -> dict:
    n_out = n // 2 if silu else n
    sets = make_sets(n, k, m, silu, num_sets(n * k * 2))
    cands = candidate_configs(m, n_out, k, silu, tile_shapes(), sms)
    times = {str(c): time_calls([ours(s, silu, c) for s in sets], reps) for c in cands}
    best = min(times, key=lambda c: times[c])
    cfg = SkinnyConfig.parse(best)
    r = {"shape": [n, n_out, k, silu], "m": m, "ours": times[best], "config": best, "candidates": times,
         "cublas": time_calls([cublas(s, silu) for s in sets], reps),
         "pdl": time_calls([ours(s, silu, cfg, pdl=True) for s in sets], reps), "err": check(sets[0], silu, cfg)}
    if silu:  # the plain GEMM has as many row tiles (2 * inter / 16 == inter / 8): same config
        r["unfused"] = time_calls([ours_unfused(s, cfg) for s in sets], reps)
    if sweep:
        r["sweep"] = {str(c): time_calls([ours(s, silu, c) for s in sets], 10)
                      for c in sweep_configs(m, n_out, k, silu, sms)}
        r["sweep"].update({c: t for c, t in times.items() if c not in r["sweep"]})
    del sets
    torch.cuda.empty_cache()
    return r


def report_sweep(results: dict) -> None:
    rows, wins = [], {}
    for key, r in results.items():
        sw = r["sweep"]
        best = min(sw, key=lambda c: sw[c])
        wins[best] = wins.get(best, 0) + 1
        rows.append([key, f"{r['cublas']:.1f}", best, f"{sw[best]:.1f}", r["config"], f"{r['ours']:.1f}",
                     f"{100 * (r['ours'] / sw[best] - 1):.1f}%"])
    print_table("sweep: best of every configuration vs the best candidate (N,K,silu,M)",
                ["shape", "cuBLAS us", "sweep best", "us", "candidate best", "us", "candidate loss"], rows)
    ranked = sorted(wins.items(), key=lambda kv: -kv[1])
    print("sweep winners (config: shapes won):", ", ".join(f"{c}: {w}" for c, w in ranked[:12]))
    pairs = candidate_set(results)
    print(f"candidate set (tile, warps) within 1% of the sweep best: {tuple(pairs)}  (now {CANDIDATE_PAIRS})")


if __name__ == "__main__":
    main()
