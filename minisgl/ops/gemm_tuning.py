"""Measures the skinny-GEMM dispatch table on the device at engine start: for each distinct
linear-layer weight shape and each M of the CUDA-graph ladder up to 32, cuBLAS and our
candidate configurations are timed as CUDA-graph replays over the model's own weights
(several layers' weights in rotation, so W comes from HBM as in a decode step), within a
time budget; the result is cached on disk keyed by the GPU and software versions, so the
next start only measures what is missing. Entries the budget leaves out go to cuBLAS.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from minisgl import env
from minisgl.logging_setup import get_logger
from minisgl.ops.gemm_table import (
    CANDIDATE_PAIRS,
    CUBLAS,
    SPLITS,
    TABLE_VERSION,
    GemmShape,
    GemmTable,
    candidate_configs,
    choose,
    load_cache,
    save_cache,
)
from minisgl.ops.graph_capture import no_gc
from minisgl.ops.linear import install_table, skinny_enabled
from minisgl.ops.skinny_gemm import SkinnyConfig, cublas_linear, launch, tile_shapes, vector_aligned

log = get_logger("minisgl.ops")

BUDGET_S = 2.0
ROTATE_BYTES = 128 << 20  # weights in one timed graph: ~2.5x the H100's 50 MB L2
CACHE_FILE = "skinny_gemm.json"
Timer = Callable[[GemmShape, int, str], float]  # (shape, M, choice) -> microseconds per call


def build_table(
    shapes: Iterable[GemmShape],
    ms: Iterable[int],
    cached: GemmTable,
    candidates: Callable[[GemmShape, int], list[SkinnyConfig]],
    timer: Timer,
    budget_s: float = BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[GemmTable, GemmTable, int]:
    """(table, newly measured part, entries skipped by the budget). Entries already `cached`
    are kept as they are; the rest are measured smallest M first (batch 1 matters most),
    largest weight first, until `budget_s` has passed (an entry once started is finished)."""
    table = GemmTable()
    table.merge(cached)
    fresh = GemmTable()
    todo = sorted(
        ((shape, m) for shape in set(shapes) for m in set(ms) if not cached.has(shape, m)),
        key=lambda sm: (sm[1], -sm[0].n * sm[0].k, sm[0]),
    )
    start = clock()
    for i, (shape, m) in enumerate(todo):
        if clock() - start > budget_s:
            return table, fresh, len(todo) - i
        times = {CUBLAS: timer(shape, m, CUBLAS)}
        for cfg in candidates(shape, m):
            times[str(cfg)] = timer(shape, m, str(cfg))
        choice = choose(times)
        table.set(shape, m, choice)
        fresh.set(shape, m, choice)
    return table, fresh, 0


def device_key(device: torch.device) -> str:
    """What the timings depend on: the GPU, torch and CUDA (cuBLAS), the candidate set."""
    p = torch.cuda.get_device_properties(device)
    return (
        f"{p.name}|sm_{p.major}{p.minor}|{p.multi_processor_count} SMs|torch {torch.__version__}|"
        f"cuda {torch.version.cuda}|candidates {CANDIDATE_PAIRS} splits {SPLITS}|v{TABLE_VERSION}"
    )


def time_graph(fns: list[Callable[[], object]], replays: int = 5, rounds: int = 3) -> float:
    """Best-of-`rounds` microseconds per call of `fns`, captured once into a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up: cuBLAS picks its kernel, split-K counters exist
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with no_gc(collect=False), torch.cuda.graph(graph):  # ops/graph_capture.py says why
        for f in fns:
            f()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000.0 / (replays * len(fns)))
    return best


class GraphTimer:
    """Times a choice over a rotation of the model's weights of one shape (fresh random x)."""

    def __init__(self, weights: dict[GemmShape, list[torch.Tensor]], device: torch.device) -> None:
        self.weights = weights
        self.device = device

    def __call__(self, shape: GemmShape, m: int, choice: str) -> float:
        ws = self.weights[shape]
        x = torch.randn(m, shape.k, dtype=ws[0].dtype, device=self.device)
        if choice == CUBLAS:
            return time_graph([lambda w=w: cublas_linear(x, w, None, shape.silu, None) for w in ws])
        cfg = SkinnyConfig.parse(choice)
        out = torch.empty(m, shape.n // 2 if shape.silu else shape.n, dtype=x.dtype, device=self.device)
        return time_graph([lambda w=w: launch(x, w, None, out, shape.silu, cfg, pdl=False) for w in ws])


def rotation(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Distinct weights (tied ones once) until ROTATE_BYTES are covered, or all of them."""
    out, seen, total = [], set(), 0
    for w in weights:
        if w.data_ptr() in seen:
            continue
        seen.add(w.data_ptr())
        out.append(w)
        total += w.numel() * w.element_size()
        if total >= ROTATE_BYTES:
            break
    return out


@torch.no_grad()
def tune_gemms(
    calls: list[tuple[torch.Tensor, bool]], device: torch.device, ms: list[int], budget_s: float = BUDGET_S
) -> GemmTable | None:
    """Measures (or loads) and installs the dispatch table of `device` for the (weight, silu)
    GEMMs in `calls` at the given M. Returns the table, or None where our kernel cannot run."""
    if not skinny_enabled(device) or not tile_shapes():
        return None
    by_shape: dict[GemmShape, list[torch.Tensor]] = {}
    for w, silu in calls:
        if w.dtype not in (torch.float16, torch.bfloat16) or w.dim() != 2 or (silu and w.size(0) % 2):
            continue
        if not vector_aligned(w[:1], w):  # (w[:1] stands in for x: same K, aligned like w)
            continue  # linear() would fall back for it anyway
        shape = GemmShape(str(w.dtype).removeprefix("torch."), w.size(0), w.size(1), silu)
        by_shape.setdefault(shape, []).append(w)
    weights = {shape: rotation(ws) for shape, ws in by_shape.items()}
    if not weights:
        return None
    key = device_key(device)
    path = Path(env.CACHE_DIR) / CACHE_FILE
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def candidates(shape: GemmShape, m: int) -> list[SkinnyConfig]:
        n_out = shape.n // 2 if shape.silu else shape.n
        return candidate_configs(m, n_out, shape.k, shape.silu, tile_shapes(), sms)

    with torch.cuda.device(device):
        cached = load_cache(path, key)
        if any(not cached.has(s, m) for s in weights for m in ms):
            # Outside the budget: cuBLAS's handle and the SiLU kernel's first compile.
            for shape in {s for s in weights if s.silu} | {min(weights)}:
                w = weights[shape][0]
                cublas_linear(torch.ones(1, shape.k, dtype=w.dtype, device=device), w, None, shape.silu, None)
        start = time.perf_counter()
        table, fresh, skipped = build_table(weights, ms, cached, candidates, GraphTimer(weights, device), budget_s)
        took = time.perf_counter() - start
    save_measured(path, key, fresh, "skinny GEMM")
    install_table(device, table)
    summary = table_summary(table, weights, with_dtype=False)
    reused = sum(cached.has(s, m) for s in weights for m in set(ms))
    log.info(
        "skinny GEMM table: %d shapes x M %s, %d entries measured in %.2f s, %d from %s%s. %s",
        len(weights), sorted(set(ms)), sum(len(v) for v in fresh.choices.values()), took, reused, path,
        f"; {skipped} left to cuBLAS by the {budget_s:.1f} s budget (measured at the next start)" if skipped else "",
        summary,
    )
    return table


def save_measured(path: Path, key: str, fresh: GemmTable, label: str) -> None:
    """Adds the entries measured in this run to the cache file; an unwritable cache is logged."""
    if not fresh.choices:
        return
    try:
        save_cache(path, key, fresh)
    except OSError as e:
        log.warning("%s: could not write the table cache %s (%s)", label, path, e)


def table_summary(table: GemmTable, shapes: Iterable[GemmShape], with_dtype: bool) -> str:
    """The log's line: per shape, the M at which the skinny kernel serves it."""
    return "; ".join(
        f"{f'{s.dtype} ' if with_dtype else ''}{s.n}x{s.k}{'+silu' if s.silu else ''}: ours at M "
        + (",".join(str(m) for m in sorted(table.choices.get(s, {})) if table.lookup(s, m)) or "none")
        for s in sorted(shapes)
    )
