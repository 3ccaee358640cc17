"""Measures the GEMM dispatch table on the device at engine start, one tuner for every weight
format the skinny template loads: for each distinct linear-layer (format, shape) and each M of
the CUDA-graph ladder up to 32, the format's large-batch path (cuBLAS for 16-bit weights; for FP8
ones activation quant + the FP8 GEMM, then SiLU where fused; for 4-bit ones the decode to 16 bits
+ cuBLAS) and our kernel's candidate configurations are timed as CUDA-graph replays over the
model's own weights (several layers' weights in rotation, so W comes from HBM as in a decode
step), within a time budget; the result is cached on disk keyed by the GPU and software versions,
so the next start only measures what is missing. Entries the budget leaves out take the
large-batch path (4-bit ones: default_config's launch of our kernel, ops/gemm/w4.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from minisgl import env
from minisgl.logging_setup import get_logger
from minisgl.ops.gemm import w4 as _w4
from minisgl.ops.gemm.dispatch import fp8_large_batch, install_table, skinny_enabled
from minisgl.ops.gemm.skinny import (
    DENSE,
    FP8_FORMAT,
    SkinnyConfig,
    cublas_linear,
    default_config,
    fp8_fits,
    launch,
    tile_shapes,
    vector_aligned,
)
from minisgl.ops.gemm.table import (
    CUBLAS,
    INT4,
    MXFP4,
    PAIRS,
    SPLITS,
    TABLE_VERSION,
    GemmCall,
    GemmShape,
    GemmTable,
    candidate_configs,
    choose,
    load_cache,
    save_cache,
    shape_format,
    table_dtype,
    w4_shape,
)
from minisgl.ops.graph_capture import no_gc

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
    """What the timings depend on: the GPU, torch and CUDA (cuBLAS), the candidate sets."""
    p = torch.cuda.get_device_properties(device)
    return (
        f"{p.name}|sm_{p.major}{p.minor}|{p.multi_processor_count} SMs|torch {torch.__version__}|"
        f"cuda {torch.version.cuda}|candidates {sorted(PAIRS.items())} splits {SPLITS}|v{TABLE_VERSION}"
    )


def shape_fmt(shape: GemmShape) -> str:
    return shape_format(shape.dtype)


def call_shape(c: GemmCall, dtype: torch.dtype | None) -> GemmShape | None:
    """The table key of a layer's GEMM with `dtype` activations (16-bit weights: their own dtype),
    or None where the skinny template cannot take it (the dispatch would not ask the table)."""
    w = c.weight
    if w.dim() != 2 or (c.silu and w.size(0) % 2):
        return None
    if c.fmt == DENSE:
        if w.dtype not in (torch.float16, torch.bfloat16) or not vector_aligned(w[:1], w):  # w[:1] stands for x
            return None
        return GemmShape(table_dtype(w.dtype, DENSE), w.size(0), w.size(1), c.silu)
    if c.fmt == FP8_FORMAT and dtype in (torch.float16, torch.bfloat16):
        if not fp8_fits(torch.empty(1, w.size(1), dtype=dtype, device=w.device), w, c.scale, c.block_k):
            return None
        return GemmShape(table_dtype(dtype, FP8_FORMAT, c.scale.size(1) > 1), w.size(0), w.size(1), c.silu)
    if c.fmt in (INT4, MXFP4) and dtype in (torch.float16, torch.bfloat16):
        shape = w4_shape(dtype, c.fmt, w.size(0), w.size(1), c.scale.size(1), c.silu)  # the dispatch's key
        x = torch.empty(1, shape.k, dtype=dtype, device=w.device)  # the engine's buffers are aligned alike
        return None if _w4.skinny_misfit(x, w, c.scale, _w4.FORMATS[c.fmt]) else shape
    return None


def baseline(x: torch.Tensor, c: GemmCall) -> torch.Tensor:
    """The format's large-batch path (the table's "cublas" choice)."""
    if c.fmt == DENSE:
        return cublas_linear(x, c.weight, None, c.silu, None)
    if c.fmt in (INT4, MXFP4):
        return _w4.dequant_linear(_w4.FORMATS[c.fmt], x, c.weight, c.scale, c.zeros, None, c.silu)
    return fp8_large_batch(x, c.weight, c.scale, c.block_k, None, c.silu)


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
    """Times a choice over a rotation of the model's GEMMs of one shape (fresh random x)."""

    def __init__(self, calls: dict[GemmShape, list[GemmCall]], device: torch.device) -> None:
        self.calls = calls
        self.device = device

    def __call__(self, shape: GemmShape, m: int, choice: str) -> float:
        cs = self.calls[shape]
        dtype = getattr(torch, shape.dtype.split("-")[0])
        x = torch.randn(m, shape.k, dtype=dtype, device=self.device)
        if choice == CUBLAS:
            return time_graph([lambda c=c: baseline(x, c) for c in cs])
        cfg = SkinnyConfig.parse(choice)
        if shape_fmt(shape) in (INT4, MXFP4):
            return time_graph([lambda c=c: _w4.skinny_linear(_w4.FORMATS[c.fmt], x, c.weight, c.scale, c.zeros, None,
                                                             c.silu, config=cfg) for c in cs])
        out = torch.empty(m, shape.n // 2 if shape.silu else shape.n, dtype=x.dtype, device=self.device)
        return time_graph([lambda c=c: launch(x, c.weight, None, out, c.silu, cfg, pdl=False, scale=c.scale)
                           for c in cs])


def rotation(calls: list[GemmCall]) -> list[GemmCall]:
    """Distinct weights (tied ones once) until ROTATE_BYTES are covered, or all of them."""
    out, seen, total = [], set(), 0
    for c in calls:
        w = c.weight
        if w.data_ptr() in seen:
            continue
        seen.add(w.data_ptr())
        out.append(c)
        total += w.numel() * w.element_size()
        if total >= ROTATE_BYTES:
            break
    return out


@torch.no_grad()
def tune_gemms(
    calls: list[GemmCall | tuple], device: torch.device, ms: list[int], dtype: torch.dtype | None = None,
    budget_s: float = BUDGET_S,
) -> GemmTable | None:
    """Measures (or loads) and installs the dispatch table of `device` for the GEMMs in `calls`
    (GemmCall, or (weight, silu) for 16-bit ones) at the given M, with `dtype` activations for
    the quantized formats. Returns the table, or None where our kernel cannot run."""
    if not skinny_enabled(device) or not tile_shapes():
        return None
    by_shape: dict[GemmShape, list[GemmCall]] = {}
    for c in calls:
        c = GemmCall(*c)
        shape = call_shape(c, dtype)
        if shape is not None and tile_shapes(c.fmt):
            by_shape.setdefault(shape, []).append(c)
    sets = {shape: rotation(cs) for shape, cs in by_shape.items()}
    if not sets:
        return None
    key = device_key(device)
    path = Path(env.CACHE_DIR) / CACHE_FILE
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def candidates(shape: GemmShape, m: int) -> list[SkinnyConfig]:
        n_out = shape.n // 2 if shape.silu else shape.n
        fmt = shape_fmt(shape)
        out = candidate_configs(m, n_out, shape.k, shape.silu, tile_shapes(fmt), sms, PAIRS[fmt])
        if fmt in (INT4, MXFP4):  # what a 4-bit call ran before the table (it may split K more)
            default = default_config(m, n_out, shape.k, shape.silu, sms, fmt)
            out += [] if default in out else [default]
        return out

    with torch.cuda.device(device):
        cached = load_cache(path, key)
        if any(not cached.has(s, m) for s in sets for m in ms):
            # Outside the budget: cuBLAS's handle, the SiLU kernel's and the FP8 path's first compiles.
            for shape in {s for s in sets if s.silu or shape_fmt(s) != DENSE} | {min(sets)}:
                x = torch.ones(1, shape.k, dtype=getattr(torch, shape.dtype.split("-")[0]), device=device)
                baseline(x, sets[shape][0])
        start = time.perf_counter()
        table, fresh, skipped = build_table(sets, ms, cached, candidates, GraphTimer(sets, device), budget_s)
        took = time.perf_counter() - start
    save_measured(path, key, fresh, "skinny GEMM")
    install_table(device, table)
    summary = table_summary(table, sets)
    reused = sum(cached.has(s, m) for s in sets for m in set(ms))
    log.info(
        "skinny GEMM table: %d shapes x M %s, %d entries measured in %.2f s, %d from %s%s. %s",
        len(sets), sorted(set(ms)), sum(len(v) for v in fresh.choices.values()), took, reused, path,
        f"; {skipped} left to the large-batch path by the {budget_s:.1f} s budget (measured at the next start)"
        if skipped else "",
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


def table_summary(table: GemmTable, shapes: Iterable[GemmShape]) -> str:
    """The log's line: per shape, the M at which the skinny kernel serves it."""
    return "; ".join(
        f"{s.dtype} {s.n}x{s.k}{'+silu' if s.silu else ''}: ours at M "
        + (",".join(str(m) for m in sorted(table.choices.get(s, {})) if table.lookup(s, m)) or "none")
        for s in sorted(shapes)
    )
