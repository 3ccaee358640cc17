"""Shared timing for the kernel microbenchmarks: hardware ceilings measured in the same run,
CUDA-graph timing of rotated input sets, and table printing.

Method: every timed op is captured once per input set into one CUDA graph (so Python and
launch overhead stay out of the numbers), the sets rotate so that the working set is several
times the L2 cache (inputs come from HBM, as in a real decode step), and the graph is replayed
many times after warm-up; the reported time is the median replay time over the number of
calls in the graph.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

ROTATE_BYTES = 512 << 20  # rotate input sets until ~10x the H100's 50 MB L2 is touched
MAX_SETS = 32


def num_sets(bytes_per_call: int) -> int:
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / max(bytes_per_call, 1))))


def time_calls(fns: list[Callable[[], object]], reps: int = 50, use_graph: bool = True) -> float:
    """Median microseconds per call of `fns` (each called once per timed replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = None
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()

    def run() -> None:
        if graph is not None:
            graph.replay()
        else:
            for f in fns:
                f()

    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(fns))
    return statistics.median(times)


def time_two_paths(fns: list[Callable[[], torch.Tensor]], path_a: Callable[[], None], path_b: Callable[[], None],
                   reps: int = 20) -> tuple[float, float, float]:
    """(us of A, us of B, max |A - B| / max |B|) of `fns` (time_calls) under each of two settings:
    path_a() / path_b() switch the op's path (e.g. a module bound) before it is timed and run once."""
    path_a()
    t_a, y_a = time_calls(fns, reps=reps), fns[0]().float()
    path_b()
    t_b, y_b = time_calls(fns, reps=reps), fns[0]().float()
    return t_a, t_b, (y_a - y_b).abs().max().item() / y_b.abs().max().item()


def ceilings(gib: float = 1.0) -> tuple[float, float]:
    """(copy GB/s counting bytes read + written, read GB/s of a full reduction) on the device."""
    n = int(gib * (1 << 30)) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    # A captured copy_ becomes a graph memcpy node, which measured ~20% slower than the same
    # copy launched eagerly (a copy kernel on the SMs): take the faster of the two.
    t_copy = min(time_calls([lambda: dst.copy_(src)], reps=20, use_graph=g) for g in (True, False))
    t_read = min(time_calls([lambda: src.sum()], reps=20, use_graph=g) for g in (True, False))
    return 2 * n * 4 / t_copy / 1e3, n * 4 / t_read / 1e3


def gemm_tflops(n: int = 8192) -> float:
    """Dense bf16 matmul throughput (cuBLAS, n x n x n, 2n^3 FLOPs): the compute ceiling that
    attention's tensor-core work is held against."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    t = time_calls([lambda: torch.matmul(a, b, out=out)], reps=20)
    return 2 * n**3 / t / 1e6


def print_ceilings(copy_gbs: float, read_gbs: float) -> None:
    dev = torch.cuda.get_device_properties(0)
    print(f"device: {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}")
    print(
        f"ceilings: copy {copy_gbs:,.0f} GB/s (1 GiB fp32 copy_, read + write bytes); "
        f"read {read_gbs:,.0f} GB/s (1 GiB fp32 sum)"
    )


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("| " + " | ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
