"""4-bit weight GEMM microbenchmark: ops.gemm.w4 (INT4 group 128 and MXFP4) against bf16 cuBLAS
(torch.nn.functional.linear) on Llama-3.1-8B's weight shapes, M = 1..32, and at large M.

    python benchmarks/kernels/w4_gemm.py [--quick] [--m 1,2,4,8,16,32] [--large-m 64,256,2048] [--json FILE]
    python benchmarks/kernels/w4_gemm.py --sweep [--m 1,4,8]     (the skinny launch configs, see sweep())

Bytes per call (4-bit) = W (N x K / 2) + its scales (INT4: scales and zeros, 2 x 2 bytes per
group of 128; MXFP4: 1 byte per 32) + x + y (bf16); GB/s = bytes / time; "% read" is that
against the read ceiling measured in this run (1 GiB fp32 sum, _bench.ceilings). The issue's
targets: >= 85% of the read ceiling at M <= 8 and >= 3x bf16 cuBLAS at M = 1. Large M: TFLOP/s
of both (2 M N K / time), W4A16 within 20% of cuBLAS is the target. Every timed 4-bit op is checked
first against the dequantise-then-matmul reference (rel err column: the worst of the row's paths).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from _bench import ceilings, num_sets, print_ceilings, print_table, time_calls
from skinny_gemm import layer_shapes

from minisgl.kernels import w4a16_gemm as W
from minisgl.kernels.quant4 import pack_int4
from minisgl.ops.gemm import w4
from minisgl.ops.gemm.skinny import SkinnyConfig, default_config, num_tiles

MS = (1, 2, 4, 8, 16, 32)
GROUP = 128


def make_set(n: int, k: int, m: int) -> dict:
    dev, bf = "cuda", torch.bfloat16
    return dict(
        x=torch.randn(m, k, device=dev, dtype=bf),
        w=torch.randn(n, k, device=dev, dtype=bf) * 0.05,
        qweight=pack_int4(torch.randint(0, 16, (n, k), device=dev)),
        scales=torch.rand(n, k // GROUP, device=dev, dtype=bf) * 0.01 + 0.001,
        zeros=torch.randint(0, 16, (n, k // GROUP), device=dev).to(bf),
        blocks=torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8),
        e8m0=torch.randint(118, 124, (n, k // 32), device=dev, dtype=torch.uint8),
    )


def fns(s: dict, silu: bool) -> dict:
    out = {
        "int4": lambda: w4.int4_linear(s["x"], s["qweight"], s["scales"], s["zeros"], silu_and_mul=silu),
        "mxfp4": lambda: w4.mxfp4_linear(s["x"], s["blocks"], s["e8m0"], silu_and_mul=silu),
        "cublas": lambda: F.linear(s["x"], s["w"]),
        # ops' two large-M paths called directly (ops switches at DEQUANT_MIN_M rows), so the table
        # shows both at every M and the switch can be read off
        "int4_triton": lambda: W.w4_gemm(s["x"], s["qweight"], s["scales"], s["zeros"], W.INT4, silu_and_mul=silu),
        "int4_decode": lambda: w4.dequant_linear(W.INT4, s["x"], s["qweight"], s["scales"], s["zeros"], None, silu),
    }
    return out


def rel_err(s: dict, silu: bool, names: tuple[str, ...] = ("int4", "mxfp4")) -> float:
    """The worst error, relative to the reference's largest magnitude, of the 4-bit paths among `names`."""
    refs = {fmt: W.w4_gemm_reference(s["x"].float(), wq, sc.float() if z is not None else sc,
                                     z.float() if z is not None else None, fmt, None, silu)
            for fmt, (wq, sc, z) in {W.INT4: (s["qweight"], s["scales"], s["zeros"]),
                                     W.MXFP4: (s["blocks"], s["e8m0"], None)}.items()}
    worst = 0.0
    for name in names:
        if name == "cublas":
            continue
        ref = refs[W.MXFP4 if name == "mxfp4" else W.INT4]
        y = fns(s, silu)[name]().float()
        worst = max(worst, ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item())
    return worst


MAIN = ("int4", "mxfp4", "cublas")


def measure(n: int, k: int, m: int, silu: bool, reps: int, names: tuple[str, ...] = MAIN) -> dict:
    n_out = n // 2 if silu else n
    sets = [make_set(n, k, m) for _ in range(num_sets(n * k // 2))]
    r = {"err": rel_err(sets[0], silu, names)}
    for name in names:
        r[name] = time_calls([fns(s, silu)[name] for s in sets], reps=reps)
    r["bytes"] = measure_bytes(n, k, m, n_out)
    return r


SWEEP_WARPS, SWEEP_SPLITS = (2, 4, 8), (1, 2, 4, 8, 16, 32)


def skinny_call(fmt: int, s: dict, silu: bool, cfg: SkinnyConfig | None):
    wq, sc, z = (s["qweight"], s["scales"], s["zeros"]) if fmt == W.INT4 else (s["blocks"], s["e8m0"], None)
    return lambda: w4.skinny_linear(fmt, s["x"], wq, sc, z, None, silu, cfg)


def sweep_configs(m: int, n_out: int, silu: bool, name: str) -> list[SkinnyConfig]:
    out = []
    for tile, (_rt, _chunks, max_m) in enumerate(w4.skinny_w4_shapes()):
        if m <= max_m:
            out += [SkinnyConfig(tile, w, s) for w in SWEEP_WARPS for s in SWEEP_SPLITS
                    if num_tiles(n_out, silu, tile, name) * s <= 1 << 16]
    return out


def sweep(ms: list[int], reps: int, read_gbs: float) -> None:
    """Every compiled 4-bit skinny tile x SWEEP_WARPS x SWEEP_SPLITS at each M, INT4 and MXFP4, on
    the Llama-3.1-8B shapes: the best config's time and % of the read ceiling beside ops' default
    config (default_config; the 4-bit path has no measured table yet), to show what the launch
    alone leaves on the table before the loaders are changed."""
    rows, sms = [], torch.cuda.get_device_properties(0).multi_processor_count
    for layer, (n, k, silu) in layer_shapes("llama-3.1-8b", 1).items():
        if layer == "gate_up_proj":
            continue  # the same weight as gate_up+silu
        n_out = n // 2 if silu else n
        for m in ms:
            sets = [make_set(n, k, m) for _ in range(num_sets(n * k // 2))]
            for fmt, name in ((W.INT4, "int4"), (W.MXFP4, "mxfp4")):
                nbytes = measure_bytes(n, k, m, n_out)[name]
                default = default_config(m, n_out, k, silu, sms, name)
                times = {str(default): time_calls([skinny_call(fmt, s, silu, None) for s in sets], reps=reps)}
                for cfg in sweep_configs(m, n_out, silu, name):
                    times[str(cfg)] = time_calls([skinny_call(fmt, s, silu, cfg) for s in sets], reps=reps)
                best = min(times, key=times.get)
                rows.append([layer, f"{n}x{k}", str(m), name, str(default), f"{times[str(default)]:.1f}",
                             f"{100 * nbytes / times[str(default)] / 1e3 / read_gbs:.0f}%", best,
                             f"{times[best]:.1f}", f"{100 * nbytes / times[best] / 1e3 / read_gbs:.0f}%"])
    print_table(f"4-bit skinny launch sweep (config t<tile>w<warps>s<splits>; tiles (RT, 32-element chunks, max M) "
                f"{w4.skinny_w4_shapes()}): ops' default vs the best", ["layer", "N x K", "M", "format", "default",
                "us", "%read", "best", "us", "%read"], rows)


def measure_bytes(n: int, k: int, m: int, n_out: int) -> dict:
    act = (m * k + m * n_out) * 2
    return {"int4": n * k // 2 + 4 * n * (k // GROUP) + act, "mxfp4": n * k // 2 + n * (k // 32) + act,
            "cublas": n * k * 2 + act}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--large-m", default="64,256,2048")
    ap.add_argument("--json", default=None, help="write every timing here")
    ap.add_argument("--sweep", action="store_true", help="only the skinny launch sweep (sweep())")
    args = ap.parse_args()
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    reps = 15 if args.quick else 30
    if args.sweep:
        sweep([int(v) for v in args.m.split(",")] if args.m != ",".join(map(str, MS)) else [1, 4, 8], 10, read_gbs)
        return
    results: dict[str, dict] = {}
    rows = []
    for layer, (n, k, silu) in layer_shapes("llama-3.1-8b", 1).items():
        for m in (int(v) for v in args.m.split(",")):
            r = results[f"{layer},{m}"] = measure(n, k, m, silu, reps)
            gbs = {f: r["bytes"][f] / r[f] / 1e3 for f in ("int4", "mxfp4", "cublas")}
            rows.append([layer, f"{n}x{k}", str(m), f"{r['cublas']:.1f}", f"{100 * gbs['cublas'] / read_gbs:.0f}%",
                         f"{r['int4']:.1f}", f"{100 * gbs['int4'] / read_gbs:.0f}%",
                         f"{r['cublas'] / r['int4']:.2f}x", f"{r['mxfp4']:.1f}",
                         f"{100 * gbs['mxfp4'] / read_gbs:.0f}%", f"{r['cublas'] / r['mxfp4']:.2f}x",
                         f"{r['err']:.1e}"])
    print_table("Llama-3.1-8B TP 1: W4A16 (INT4 g128, MXFP4) vs bf16 cuBLAS (cuBLAS rows: no SiLU epilogue)",
                ["layer", "N x K", "M", "cuBLAS us", "%read", "INT4 us", "%read", "vs cuBLAS", "MXFP4 us",
                 "%read", "vs cuBLAS", "rel err"], rows)
    big = []
    for m in (int(v) for v in args.large_m.split(",")):
        for layer, (n, k, silu) in layer_shapes("llama-3.1-8b", 1).items():
            if silu:
                continue
            r = results[f"{layer},{m}"] = measure(n, k, m, False, max(5, reps // 3),
                                                  ("int4_triton", "int4_decode", "mxfp4", "cublas"))
            big.append([layer, f"{n}x{k}", str(m), f"{r['cublas']:.0f}", f"{2 * m * n * k / r['cublas'] / 1e6:.0f}"]
                       + [f"{r[f]:.0f} ({r[f] / r['cublas']:.2f})" for f in ("int4_triton", "int4_decode", "mxfp4")]
                       + [f"{r['err']:.1e}"])
    print_table(f"Large M: W4A16 vs bf16 cuBLAS, us (time / cuBLAS's; target <= 1.20). ops takes the Triton GEMM "
                f"below M = {w4.DEQUANT_MIN_M}, decode to 16 bits + cuBLAS from it (MXFP4: ops' path)",
                ["layer", "N x K", "M", "cuBLAS us", "TFLOP/s", "INT4 Triton", "INT4 decode+cuBLAS", "MXFP4",
                 "rel err (worst)"], big)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
