"""FP8 GEMM microbenchmark on Llama-3.1-8B's linear shapes: bf16 cuBLAS (F.linear) vs the FP8
paths, each including the per-token activation quantization it needs:
  triton-block: our Triton GEMM with 128 x 128 block weight scales (activations per 128 group);
  triton-chan:  our Triton GEMM with per-channel weight scales (activations per token);
  scaled_mm:    torch._scaled_mm (cuBLASLt) with the same per-channel/per-token scales;
  quant:        the activation quant kernel alone (per 128 group).

    python benchmarks/kernels/fp8_gemm.py [--quick]

The second table (M <= 32, batch-1..32 decode) sets the weight-only FP8 skinny GEMM (ours,
csrc/skinny_weights.cuh (Fp8W); x stays bf16) with per-channel and with 128 x 128 block scales against our
bf16 skinny GEMM, bf16 cuBLAS and the best FP8 path above, all in this run; each skinny column
is the fastest of the candidate configurations the engine times at start (its config named).
"floor" is the FP8 bytes (W 1 byte/element + block scales 4 bytes per row and 128 K + x + y) at
the read ceiling; "% read" is the faster FP8 skinny kernel's GB/s against that ceiling.

TFLOP/s = 2 M N K / time; GB/s = (N K (1 byte fp8, 2 bf16) + M K 2 + M N 2) / time, against the
read ceiling measured in this run. "best fp8" names the fastest FP8 path and its speedup over
bf16: the data behind ops/gemm/fp8.py's choice (scaled_mm for per-channel, Triton for block).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _bench import ceilings, gemm_tflops, num_sets, print_ceilings, print_table, time_calls

from minisgl.kernels.fp8_gemm import quantize_tokens
from minisgl.ops.gemm.fp8 import fp8_gemm, quantize_blocks, quantize_rows
from minisgl.ops.gemm.skinny import FP8_FORMAT, launch, tile_shapes
from minisgl.ops.gemm.table import CANDIDATE_PAIRS, FP8_CANDIDATE_PAIRS, candidate_configs

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down_proj": (4096, 14336)}
MS = (1, 16, 32, 512, 2048, 8192)


COLUMNS = ("bf16", "triton-block", "triton-chan", "scaled_mm", "quant")
SKINNY_MS = (1, 3, 16, 32)


def best_config(x: torch.Tensor, n: int, k: int, fp8_sets: list | None, w16: list, sms: int) -> tuple[float, str]:
    """(us, config) of the fastest candidate: ours bf16 (fp8_sets None) or FP8 over the given sets."""
    m = x.size(0)
    fp8 = fp8_sets is not None
    shapes, pairs = (tile_shapes(FP8_FORMAT), FP8_CANDIDATE_PAIRS) if fp8 else (tile_shapes(), CANDIDATE_PAIRS)
    out = torch.empty(m, n, dtype=x.dtype, device="cuda")
    best = (float("inf"), "-")
    for cfg in candidate_configs(m, n, k, False, shapes, sms, pairs):
        if fp8_sets is not None:
            fns = [lambda c=c, g=cfg: launch(x, c[0], None, out, False, g, pdl=False, scale=c[1]) for c in fp8_sets]
        else:
            fns = [lambda w=w, g=cfg: launch(x, w, None, out, False, g, pdl=False) for w in w16]
        best = min(best, (time_calls(fns, reps=20), str(cfg)))
    return best


def skinny_row(name: str, n: int, k: int, m: int, w16: list, blocks: list, chans: list, read_gbs: float) -> list[str]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    t16 = time_calls([lambda w=w: F.linear(x, w) for w in w16])
    ours16, cfg16 = best_config(x, n, k, None, w16, sms)
    chan, cfg_c = best_config(x, n, k, chans, w16, sms)
    block, cfg_b = best_config(x, n, k, blocks, w16, sms)
    big = min(time_calls([lambda c=c: fp8_gemm(x, c[0], c[1], k) for c in chans]),
              time_calls([lambda b=b: fp8_gemm(x, b[0], b[1], 128) for b in blocks]))
    fp8_bytes = n * k + 2 * m * k + 2 * m * n
    floor = (fp8_bytes + 4 * n * -(-k // 128)) / read_gbs / 1e3
    fastest = min(chan, block)
    return [name, str(m), f"{t16:.1f}", f"{ours16:.1f} {cfg16}", f"{chan:.1f} {cfg_c}", f"{block:.1f} {cfg_b}",
            f"{big:.1f}", f"{floor:.1f}", f"{100 * fp8_bytes / fastest / 1e3 / read_gbs:.0f}%",
            f"{ours16 / fastest:.2f}x"]


def measure(x: torch.Tensor, k: int, w16: list, blocks: list, chans: list) -> dict[str, float]:
    """Microseconds per call of each path; the weight sets rotate (inputs from HBM)."""
    return {
        "bf16": time_calls([lambda w=w: F.linear(x, w) for w in w16]),
        "triton-block": time_calls([lambda b=b: fp8_gemm(x, b[0], b[1], 128, backend="triton") for b in blocks]),
        "triton-chan": time_calls([lambda c=c: fp8_gemm(x, c[0], c[1], k, backend="triton") for c in chans]),
        "scaled_mm": scaled_mm_time(x, k, chans),
        "quant": time_calls([lambda: quantize_tokens(x, 128)]),
    }


def scaled_mm_time(x: torch.Tensor, k: int, chans: list) -> float:
    """inf where this torch build's torch._scaled_mm refuses the shape (its rules vary)."""
    try:
        return time_calls([lambda c=c: fp8_gemm(x, c[0], c[1], k, backend="scaled_mm") for c in chans])
    except RuntimeError as e:
        print(f"torch._scaled_mm refused M={x.size(0)} K={k}: {str(e).splitlines()[0]}")
        return float("inf")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M = 1, 32, 2048 only")
    args = ap.parse_args()
    ms = (1, 32, 2048) if args.quick else MS
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    print(f"bf16 dense GEMM ceiling: {gemm_tflops():,.0f} TFLOP/s (cuBLAS 8192^3)")
    rows, skinny = [], []
    for name, (n, k) in SHAPES.items():
        sets = num_sets(n * k)
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(sets)]
        blocks = []
        for w in w16:
            q, s = quantize_blocks(w)
            blocks.append((q, s.repeat_interleave(128, 0)[:n].contiguous()))
        chans = [quantize_rows(w) for w in w16]
        for m in SKINNY_MS if not args.quick else (1, 16, 32):
            skinny.append(skinny_row(name, n, k, m, w16, blocks, chans, read_gbs))
        for m in ms:
            t = measure(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), k, w16, blocks, chans)
            fp8 = {key: v for key, v in t.items() if key not in ("bf16", "quant")}
            best = min(fp8, key=fp8.get)
            flops = 2 * m * n * k
            gbs = (n * k + 2 * m * k + 2 * m * n) / fp8[best] / 1e3
            rows.append([
                name, str(m), *(f"{t[key]:.1f}" for key in COLUMNS),
                best, f"{t['bf16'] / fp8[best]:.2f}x", f"{flops / fp8[best] / 1e6:.0f}", f"{gbs:,.0f}",
                f"{100 * gbs / read_gbs:.0f}%",
            ])
    print_table(
        "FP8 GEMM vs bf16 cuBLAS (us per call, median of CUDA-graph replays; FP8 paths include activation quant)",
        ["layer", "M", "bf16", "triton-block", "triton-chan", "scaled_mm", "quant", "best fp8", "vs bf16",
         "TFLOP/s", "GB/s", "% read"],
        rows,
    )

    print_table(
        "FP8 weight-only skinny GEMM (ours) vs bf16 (us per call, median of CUDA-graph replays; bf16 x)",
        ["layer", "M", "bf16 cuBLAS", "bf16 skinny", "fp8 skinny chan", "fp8 skinny block", "fp8 GEMM", "floor",
         "% read", "vs bf16 skinny"],
        skinny,
    )


if __name__ == "__main__":
    main()
