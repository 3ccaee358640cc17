"""FP8 KV cache, decode attention: minisgl's CUDA kernel and the Triton kernel reading an e4m3
cache vs the same kernels on the bf16 cache, Llama-3.1-8B layer (Hq 32, Hkv 8, D 128), RESULTS.md
Table 1's (B, L), 16-token shuffled pages.

    python benchmarks/kernels/fp8_decode_attention.py

Bytes per call = K + V read (2 B L Hkv D x 1 for FP8, x 2 for bf16) + q read + out written;
GB/s (of the CUDA kernel on the FP8 cache) against the read ceiling measured in this run. max|d|
is the CUDA kernel on the FP8 cache vs the Triton one on it (the same dequantized math).
"""

from __future__ import annotations

import math

import torch
from _bench import ceilings, num_sets, print_ceilings, print_table, time_calls
from decode_attention import SHAPES, make_set, ours

from minisgl.ops import decode_attention_triton, paged_decode_attention
from minisgl.ops.store import quantize_kv

HQ, HKV, DIM = 32, 8, 128


def triton_call(s: dict, scale: float, ctx: int, fp8: bool):
    args = {n: s[n] for n in ("q", "req_to_slot", "req_rows", "seq_lens")}
    kc, vc = (s["k8"], s["v8"]) if fp8 else (s["k_cache"], s["v_cache"])
    return lambda: decode_attention_triton(k_cache=kc, v_cache=vc, **args, max_seq_len=ctx, scale=scale)


def ours_fp8(s: dict, scale: float, ctx: int):
    args = {n: s[n] for n in ("q", "req_to_slot", "req_rows", "seq_lens")}
    return lambda: paged_decode_attention(k_cache=s["k8"], v_cache=s["v8"], **args, scale=scale, max_seq_len=ctx)


def main() -> None:
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    scale = 1.0 / math.sqrt(DIM)
    rows = []
    for batch, ctx in SHAPES:
        kv16 = 2 * batch * ctx * HKV * DIM * 2
        sets = [make_set(batch, ctx, HQ, HKV, DIM, seed) for seed in range(num_sets(kv16 // 2))]
        for s in sets:
            s.pop("k"), s.pop("v")  # the contiguous copies are for another benchmark
            s["k8"], s["v8"] = quantize_kv(s["k_cache"], 1.0), quantize_kv(s["v_cache"], 1.0)
        diff = (triton_call(sets[0], scale, ctx, True)().float() - ours_fp8(sets[0], scale, ctx)().float()).abs().max()
        t_cuda = time_calls([ours(s, scale, ctx) for s in sets])
        t_tri = time_calls([triton_call(s, scale, ctx, False) for s in sets])
        t_fp8 = time_calls([triton_call(s, scale, ctx, True) for s in sets])
        t_cuda8 = time_calls([ours_fp8(s, scale, ctx) for s in sets])
        gbs = (kv16 // 2 + 2 * batch * HQ * DIM * 2) / t_cuda8 / 1e3
        rows.append([f"({batch}, {ctx})", f"{t_cuda:.1f}", f"{t_tri:.1f}", f"{t_cuda8:.1f}", f"{t_fp8:.1f}",
                     f"{gbs:,.0f}", f"{100 * gbs / read_gbs:.0f}%", f"{t_cuda / t_cuda8:.2f}x", f"{diff:.1e}"])
        del sets
        torch.cuda.empty_cache()
    print_table(
        "decode attention with an FP8 KV cache, Llama-3.1-8B layer (us per call)",
        ["(B, L)", "CUDA bf16", "Triton bf16", "CUDA fp8", "Triton fp8", "fp8 GB/s", "% read", "fp8 vs bf16 (CUDA)",
         "max|d|"],
        rows,
    )


if __name__ == "__main__":
    main()
