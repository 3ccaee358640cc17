"""Where a decode step's device time goes: one decode batch (B requests at context L) through
the engine, timed as a CUDA-graph replay and profiled eagerly per kernel, against the
bandwidth floor (weights + KV bytes read / the measured copy bandwidth).

    python benchmarks/profile_decode_step.py --model benchmarks/configs/qwen3-0.6b --batch 128 --context 1024

--cublas-baseline also times the same step with every linear layer on cuBLAS (the skinny
GEMM dispatch table emptied and the graphs recaptured), in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from weight_floor import decode_kv_bytes, decode_weight_bytes

from minisgl import LLM


def time_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median time of fn() per call in ms, GPU work included (CUDA events). Without a GPU (a
    smoke run of a script on the CPU) host wall time."""
    fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill-requests", type=int, default=8)
    ap.add_argument("--cublas-baseline", action="store_true", help="also time the step with cuBLAS for every GEMM")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights (dummy FP8 values)")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", tokenizer=args.tokenizer, cuda_graph_max_bs=args.batch,
              quantization=args.quantization)
    eng = llm.engine
    rows = [eng.table.allocate_row() for _ in range(args.batch)]
    cols, slots, rr = [], [], []
    for row in rows:
        pages = eng.allocator.allocate(-(-args.context // eng.cfg.page_size))
        ids = eng.allocator.slot_ids(pages)[: args.context]
        rr += [row] * len(ids)
        cols += range(len(ids))
        slots += ids
    eng.write_slots(rr, cols, slots)
    # Each request's decode input: a distinct random token (the engine's token buffer starts at
    # zeros, so every request fed the same token and a MoE routed the whole batch to one token's
    # top-k experts: Qwen3-30B-A3B's batch 32 read 8 experts a layer, not ~100; RESULTS.md,
    # thirty-first session).
    tokens = torch.randperm(eng.model_config.vocab_size, generator=torch.Generator().manual_seed(0))[: args.batch]
    eng.token_buffer[torch.tensor(rows, device=eng.device)] = tokens.to(eng.device)
    batch = eng.build_batch("decode", rows, [args.context - 1] * args.batch, None)
    graph_ms = time_ms(lambda: eng.forward(batch))
    eager_ms = time_ms(lambda: eng.forward_eager(batch))
    kv_bytes = args.batch * decode_kv_bytes(eng, args.context)  # a sliding layer reads its window only
    w_bytes = decode_weight_bytes(eng.model, args.batch)
    big = torch.empty(1 << 28, dtype=torch.float32, device=eng.device)
    copy_ms = time_ms(lambda: big.clone(), reps=10)
    bw = 2 * big.numel() * 4 / (copy_ms * 1e-3)
    floor_ms = (kv_bytes + w_bytes) / bw * 1e3
    print(f"decode step, batch {args.batch} x context {args.context}: graph {graph_ms:.2f} ms, eager {eager_ms:.2f} ms")
    if args.cublas_baseline:
        cublas_ms = time_with_cublas_only(eng, batch, args.batch)
        print(f"  the same step with cuBLAS for every GEMM: graph {cublas_ms:.2f} ms "
              f"(skinny GEMM dispatch saves {cublas_ms - graph_ms:.2f} ms, {(1 - graph_ms / cublas_ms) * 100:.1f}%)")
    print(f"floor (weights {w_bytes / 1e9:.2f} GB + KV {kv_bytes / 1e9:.2f} GB at copy bw {bw / 1e9:.0f} GB/s): "
          f"{floor_ms:.2f} ms -> {floor_ms / graph_ms * 100:.0f}% of floor")
    profile(lambda: eng.forward_eager(batch))
    # A prefill step: the first `--prefill-requests` requests' whole contexts as one extend
    # (at most the batch's requests: there are no other rows to prefill).
    n = min(args.prefill_requests, args.batch)
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 10000, (n, args.context), generator=gen).tolist()
    extend = eng.build_batch("extend", rows[:n], [0] * n, toks)
    prefill_ms = time_ms(lambda: eng.forward(extend), reps=5)
    rate = n * args.context / prefill_ms
    print(f"prefill step, {n} x {args.context} tokens: {prefill_ms:.2f} ms ({rate:,.0f} tokens/ms)")
    profile(lambda: eng.forward(extend))


def time_with_cublas_only(eng, batch, max_bs: int) -> float:
    """Graph time of `batch` with an empty dispatch table (every GEMM on cuBLAS), then the
    measured table and the graphs are restored."""
    from minisgl.ops.gemm.dispatch import install_table, table_for
    from minisgl.ops.gemm.table import GemmTable

    tuned = table_for(eng.device)
    install_table(eng.device, GemmTable())
    try:
        eng.graphs = None
        torch.cuda.empty_cache()
        eng.enable_cuda_graphs(max_bs)
        return time_ms(lambda: eng.forward(batch))
    finally:
        install_table(eng.device, tuned if tuned is not None else GemmTable())
        eng.graphs = None
        torch.cuda.empty_cache()
        eng.enable_cuda_graphs(max_bs)


def profile(fn) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
