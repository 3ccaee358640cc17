"""Measures the FP8 dispatch table at engine start, as ops/gemm_tuning.py does for 16-bit
weights: for each FP8 layer shape and each M of the CUDA-graph ladder up to 32, the FP8
large-batch path (fp8_gemm: activation quant + torch._scaled_mm or our Triton GEMM, then SiLU
where fused) and our weight-only FP8 skinny kernel's candidate configurations are timed as
CUDA-graph replays over the model's own weights, within a time budget; cached on disk. In the
table the baseline choice is spelled "cublas" (gemm_table.CUBLAS): for these shapes it means
the FP8 large-batch path.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from minisgl import env
from minisgl.logging_setup import get_logger
from minisgl.ops.gemm_table import (
    CUBLAS,
    SPLITS,
    TABLE_VERSION,
    GemmShape,
    GemmTable,
    candidate_configs,
    load_cache,
)
from minisgl.ops.gemm_tuning import BUDGET_S, build_table, rotation, save_measured, table_summary, time_graph
from minisgl.ops.linear import skinny_enabled
from minisgl.ops.skinny_fp8 import fp8_tile_shapes, install_fp8_table, is_block, kernel_fits, launch_fp8, table_dtype
from minisgl.ops.skinny_gemm import SkinnyConfig

log = get_logger("minisgl.ops")

CACHE_FILE = "skinny_gemm_fp8.json"
# (tile, warps) pairs timed at start: every FP8 tile at 4 warps, and tile 0 at 8. Not yet swept
# on a GPU (benchmarks/kernels/fp8_gemm.py prints the best of each per shape and M).
FP8_CANDIDATE_PAIRS: tuple[tuple[int, int], ...] = ((0, 4), (1, 4), (2, 4), (3, 4), (0, 8))
Fp8Call = tuple[torch.Tensor, torch.Tensor, int, bool]  # (weight e4m3, scale, block_k, silu)


def baseline(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block_k: int, silu: bool) -> torch.Tensor:
    """The FP8 large-batch path of ops.linear.fp8_linear, without the skinny dispatch."""
    from minisgl.ops.activation import silu_and_mul
    from minisgl.ops.fp8_gemm import fp8_gemm

    y = fp8_gemm(x, w, s, block_k)
    return silu_and_mul(y) if silu else y


class Fp8GraphTimer:
    def __init__(self, sets: dict[GemmShape, list[Fp8Call]], dtype: torch.dtype, device: torch.device) -> None:
        self.sets, self.dtype, self.device = sets, dtype, device

    def __call__(self, shape: GemmShape, m: int, choice: str) -> float:
        calls = self.sets[shape]
        x = torch.randn(m, shape.k, dtype=self.dtype, device=self.device)
        if choice == CUBLAS:
            return time_graph([lambda c=c: baseline(x, c[0], c[1], c[2], c[3]) for c in calls])
        cfg = SkinnyConfig.parse(choice)
        out = torch.empty(m, shape.n // 2 if shape.silu else shape.n, dtype=x.dtype, device=self.device)
        return time_graph([lambda c=c: launch_fp8(x, c[0], c[1], None, out, c[3], cfg, pdl=False) for c in calls])


def device_key(device: torch.device) -> str:
    p = torch.cuda.get_device_properties(device)
    return (
        f"{p.name}|sm_{p.major}{p.minor}|{p.multi_processor_count} SMs|torch {torch.__version__}|"
        f"cuda {torch.version.cuda}|fp8 candidates {FP8_CANDIDATE_PAIRS} splits {SPLITS}|v{TABLE_VERSION}"
    )


@torch.no_grad()
def tune_fp8_gemms(
    calls: list[Fp8Call], device: torch.device, ms: list[int], dtype: torch.dtype, budget_s: float = BUDGET_S
) -> GemmTable | None:
    """Measures (or loads) and installs the FP8 dispatch table of `device` for the FP8 layers in
    `calls` with `dtype` activations. None where our kernel cannot run (FP8 layers then always
    take the large-batch path)."""
    shapes_ = fp8_tile_shapes()
    if not calls or not skinny_enabled(device) or not shapes_ or dtype not in (torch.float16, torch.bfloat16):
        return None
    by_shape: dict[GemmShape, list[Fp8Call]] = {}
    for w, s, block_k, silu in calls:
        probe = torch.empty(1, w.size(1), dtype=dtype, device=device)
        if (silu and w.size(0) % 2) or not kernel_fits(probe, w, s, block_k):
            continue
        shape = GemmShape(table_dtype(dtype, is_block(w, s)), w.size(0), w.size(1), silu)
        by_shape.setdefault(shape, []).append((w, s, block_k, silu))
    sets = {}
    for shape, cs in by_shape.items():  # as many layers as gemm_tuning.rotation keeps
        kept = {w.data_ptr() for w in rotation([c[0] for c in cs])}
        sets[shape] = list({c[0].data_ptr(): c for c in cs if c[0].data_ptr() in kept}.values())
    if not sets:
        return None
    key = device_key(device)
    path = Path(env.CACHE_DIR) / CACHE_FILE
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def candidates(shape: GemmShape, m: int) -> list[SkinnyConfig]:
        n_out = shape.n // 2 if shape.silu else shape.n
        return candidate_configs(m, n_out, shape.k, shape.silu, shapes_, sms, FP8_CANDIDATE_PAIRS)

    with torch.cuda.device(device):
        cached = load_cache(path, key)
        if any(not cached.has(s, m) for s in sets for m in ms):
            for shape in sets:  # outside the budget: Triton compiles, cuBLASLt's first call
                w, s, block_k, silu = sets[shape][0]
                baseline(torch.ones(1, shape.k, dtype=dtype, device=device), w, s, block_k, silu)
        start = time.perf_counter()
        table, fresh, skipped = build_table(sets, ms, cached, candidates, Fp8GraphTimer(sets, dtype, device), budget_s)
        took = time.perf_counter() - start
    save_measured(path, key, fresh, "FP8 skinny GEMM")
    install_fp8_table(device, table)
    summary = table_summary(table, sets, with_dtype=True)
    log.info(
        "FP8 skinny GEMM table: %d shapes x M %s, %d entries measured in %.2f s%s. %s",
        len(sets), sorted(set(ms)), sum(len(v) for v in fresh.choices.values()), took,
        f"; {skipped} left to the FP8 GEMM by the {budget_s:.1f} s budget" if skipped else "", summary,
    )
    return table
