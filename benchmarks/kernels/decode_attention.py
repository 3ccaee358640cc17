"""Paged decode attention microbenchmark: minisgl's CUDA kernel against torch baselines.

    python benchmarks/kernels/decode_attention.py [--quick]

Bytes per call = K + V read (2 * B * L * Hkv * D * 2) + q read + out written (B * Hq * D * 2
each); slot-table reads (4 bytes per token, 0.2% at D = 128) are not counted. Baselines, in
the same run: (a) torch SDPA with enable_gqa over contiguous [B, Hkv, L, D] K/V (no paging:
the best case), (b) gathering K/V through the slot table, then SDPA.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from _bench import ceilings, num_sets, print_ceilings, print_table, time_calls

from minisgl.ops.decode_attention import _KERNEL_DTYPES, _num_splits, paged_decode_attention

MODELS = {  # q heads, KV heads, dim
    "Llama-3.1-8B": (32, 8, 128), "Qwen3-0.6B": (16, 8, 128), "GPT-OSS-20B": (64, 8, 64), "Gemma-3-27B": (32, 16, 128),
}
SHAPES = [(1, 4096), (1, 32768), (16, 4096), (64, 2048), (256, 512), (256, 4096)]
PAGE = 16  # --page overrides (the engine's default is 1)


def make_set(batch: int, ctx: int, hq: int, hkv: int, dim: int, seed: int, sequential: bool = False) -> dict:
    """One input set: a paged cache with shuffled 16-token pages (or, `sequential`, each
    request's slots in order: the paged kernel over an unfragmented cache), and contiguous K/V."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = batch * ctx // PAGE + 1
    kc = torch.randn(pages * PAGE, hkv, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(pages * PAGE, hkv, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    order = torch.randperm(pages - 1, device="cuda", generator=g) + 1  # page 0: dummy
    if sequential:
        order = torch.arange(1, pages, device="cuda")
    per_req = order.view(batch, ctx // PAGE)
    offs = torch.arange(PAGE, device="cuda")
    table = (per_req[:, :, None] * PAGE + offs).reshape(batch, ctx).to(torch.int32)
    return dict(
        q=torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16, generator=g),
        k_cache=kc,
        v_cache=vc,
        req_to_slot=table,
        req_rows=torch.arange(batch, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), ctx, device="cuda", dtype=torch.int32),
        k=torch.randn(batch, hkv, ctx, dim, device="cuda", dtype=torch.bfloat16, generator=g),
        v=torch.randn(batch, hkv, ctx, dim, device="cuda", dtype=torch.bfloat16, generator=g),
    )


def ours(s: dict, scale: float, ctx: int, splits: int | None = None):
    args = {n: s[n] for n in ("q", "k_cache", "v_cache", "req_to_slot", "req_rows", "seq_lens")}
    return lambda: paged_decode_attention(**args, scale=scale, max_seq_len=ctx, num_splits=splits)


def triton_split(s: dict, scale: float, ctx: int):
    from minisgl import ops

    args = [s[n] for n in ("q", "k_cache", "v_cache", "req_to_slot", "req_rows", "seq_lens")]
    return lambda: ops.decode_attention_triton(*args, ctx, scale)


def sdpa_contiguous(s: dict):
    q4 = s["q"].unsqueeze(2)
    return lambda: F.scaled_dot_product_attention(q4, s["k"], s["v"], enable_gqa=True)


def gather_sdpa(s: dict):
    q4, idx = s["q"].unsqueeze(2), s["req_to_slot"].long()

    def f() -> torch.Tensor:
        k = s["k_cache"][idx].transpose(1, 2)  # [B, Hkv, L, D]
        v = s["v_cache"][idx].transpose(1, 2)
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    return f


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="Llama shapes only, fewer repetitions")
    ap.add_argument("--sweep", action="store_true", help="also time other split counts")
    ap.add_argument("--sequential-slots", action="store_true", help="unfragmented cache (slots in order)")
    ap.add_argument("--models", nargs="*", default=None, help=f"a subset of {list(MODELS)}")
    ap.add_argument("--triton-sweep", action="store_true", help="sweep the Triton split kernel's launch")
    ap.add_argument("--page", type=int, default=PAGE, help="page size of the shuffled cache")
    args = ap.parse_args()
    globals()["PAGE"] = args.page
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    reps = 20 if args.quick else 50
    models = {"Llama-3.1-8B": MODELS["Llama-3.1-8B"]} if args.quick else MODELS
    if args.models:
        models = {m: MODELS[m] for m in args.models}
    sweeps: list[str] = []
    for model, (hq, hkv, dim) in models.items():
        scale = 1.0 / math.sqrt(dim)
        rows = []
        for batch, ctx in SHAPES:
            kv_bytes = 2 * batch * ctx * hkv * dim * 2
            total = kv_bytes + 2 * batch * hq * dim * 2
            sets = [
                make_set(batch, ctx, hq, hkv, dim, seed, args.sequential_slots) for seed in range(num_sets(kv_bytes))
            ]
            s0 = sets[0]
            diff = (ours(s0, scale, ctx)().float() - gather_sdpa(s0)().squeeze(2).float()).abs().max()
            splits = _num_splits(0, batch, hkv, hq // hkv, dim, _KERNEL_DTYPES[torch.bfloat16], ctx, False)
            t_ours = time_calls([ours(s, scale, ctx) for s in sets], reps)
            t_sdpa = time_calls([sdpa_contiguous(s) for s in sets], reps)
            t_gather = time_calls([gather_sdpa(s) for s in sets], max(5, reps // 5))
            if args.sweep and splits > 1:
                alt = sorted({max(1, splits // 4), max(1, splits // 2), min(256, splits * 2), max(1, splits * 3 // 4)})
                times = [f"{n}: {time_calls([ours(s, scale, ctx, n) for s in sets], reps):.1f}" for n in alt]
                t_tri = time_calls([triton_split(s, scale, ctx) for s in sets], reps)
                sweeps.append(f"{model} ({batch}, {ctx}) policy {splits}: {t_ours:.1f} us; " + ", ".join(times)
                              + f"; Triton split kernel {t_tri:.1f} us")
            gbs = total / t_ours / 1e3
            rows.append(
                [
                    f"({batch}, {ctx})",
                    str(splits),
                    f"{t_ours:.1f}",
                    f"{gbs:,.0f}",
                    f"{100 * gbs / read_gbs:.0f}%",
                    f"{t_sdpa:.1f}",
                    f"{t_sdpa / t_ours:.2f}x",
                    f"{t_gather:.1f}",
                    f"{t_gather / t_ours:.1f}x",
                    f"{diff:.1e}",
                ]
            )
            del sets, s0
            torch.cuda.empty_cache()
        print_table(
            f"paged decode attention, {model} layer (Hq {hq}, Hkv {hkv}, D {dim}), bf16, page {PAGE}, "
            f"{'sequential' if args.sequential_slots else 'shuffled'} pages",
            [
                "(B, L)",
                "splits",
                "ours us",
                "GB/s",
                "% read",
                "SDPA-contig us",
                "vs SDPA",
                "gather+SDPA us",
                "vs gather",
                "max|d| vs gather",
            ],
            rows,
        )

    for line in sweeps:
        print("split sweep (us):", line)
    if args.triton_sweep:
        triton_sweep(models, reps, read_gbs)


def triton_call(args: list, ctx: int, scale: float, splits: int, cfg: dict):
    from minisgl.kernels.decode_attention import decode_attention

    return lambda: decode_attention(*args, ctx, scale, num_splits=splits, launch=cfg)


def triton_sweep(models: dict, reps: int, read_gbs: float) -> None:
    """The Triton split kernel's launch choices (keys per block, warps, stages, splits) at batch 1
    and 16, against the CUDA kernel's policy, to pick where each one should decode."""
    for model, (hq, hkv, dim) in models.items():
        scale = 1.0 / math.sqrt(dim)
        for batch, ctx in [(1, 4096), (1, 32768), (16, 4096), (64, 2048)]:
            kv_bytes = 2 * batch * ctx * hkv * dim * 2
            sets = [make_set(batch, ctx, hq, hkv, dim, seed) for seed in range(num_sets(kv_bytes))]
            names = ("q", "k_cache", "v_cache", "req_to_slot", "req_rows", "seq_lens")
            t_cuda = time_calls([ours(s, scale, ctx) for s in sets], reps)
            best = (float("inf"), "")
            for bn in (64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        for splits in (16, 32, 64):
                            if splits * 128 > ctx * 2:
                                continue
                            cfg = {"block_n": bn, "num_warps": warps, "num_stages": stages}
                            try:
                                t = time_calls([triton_call([s[n] for n in names], ctx, scale, splits, cfg)
                                                for s in sets], reps)
                            except Exception as e:  # out of shared memory etc.
                                print(f"  {model} ({batch},{ctx}) {cfg} splits {splits}: {type(e).__name__}")
                                continue
                            if t < best[0]:
                                best = (t, f"block_n {bn}, warps {warps}, stages {stages}, splits {splits}")
            print(f"triton sweep {model} ({batch}, {ctx}): CUDA policy {t_cuda:.1f} us "
                  f"({100 * kv_bytes / t_cuda / 1e3 / read_gbs:.0f}% read); best Triton {best[0]:.1f} us "
                  f"({100 * kv_bytes / best[0] / 1e3 / read_gbs:.0f}% read) at {best[1]}")
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
