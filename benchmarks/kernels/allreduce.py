"""All-reduce bus bandwidth by message size: minisgl's NCCL bindings vs torch.distributed
(NCCL) in the same run, one process per GPU.

    python benchmarks/kernels/allreduce.py --gpus 2

Bus bandwidth = 2 (n - 1) / n * bytes / time (NCCL's convention, comparable across n).
Ceiling, measured in the same run: every rank copies 256 MB to the next rank's GPU at the
same time (both directions of each link busy, as in a ring all-reduce); bus bandwidth cannot
exceed that per-direction copy rate.
Each size is captured in a CUDA graph of `calls` back-to-back all-reduces over rotating
buffers; median of replays / calls.
"""

from __future__ import annotations

import argparse
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def time_graph(fn, bufs: list[torch.Tensor], reps: int = 20) -> float:
    """Median µs per call of fn over bufs, captured in one graph."""
    for b in bufs:
        fn(b)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for b in bufs:
            fn(b)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000 / len(bufs))
    return statistics.median(times)


def peer_copy_gbs(rank: int, world: int, nbytes: int = 256 << 20, reps: int = 10) -> float:
    """GB/s of this rank's copy to the next rank's GPU while every rank copies at once."""
    src = torch.randn(nbytes // 4, device=torch.device("cuda", rank))
    dst = torch.empty(nbytes // 4, device=torch.device("cuda", (rank + 1) % world))
    times = []
    for i in range(reps + 2):
        dist.barrier()
        torch.cuda.synchronize(src.device)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src, non_blocking=True)
        e.record()
        e.synchronize()
        if i >= 2:
            times.append(s.elapsed_time(e))
    return nbytes / (statistics.median(times) * 1e-3) / 1e9


def worker(rank: int, world: int, port: int) -> None:
    from minisgl.distributed.communicator import make_communicator
    from minisgl.distributed.info import TPInfo

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    ours, _ = make_communicator(TPInfo(rank, world), dev, f"127.0.0.1:{port}", custom_nccl=True)
    torch_group = dist.new_group(backend="nccl")
    ceiling = peer_copy_gbs(rank, world)
    rows = []
    for size in SIZES:
        n = size // 2  # bf16 elements
        calls = max(2, min(64, (512 << 20) // size))
        distinct = min(calls, 8)  # rotate buffers so one message is not served from L2
        bufs = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(distinct)] * (calls // distinct)
        t_ours = time_graph(ours.all_reduce, bufs)
        t_torch = time_graph(lambda b: dist.all_reduce(b, group=torch_group), bufs)
        factor = 2 * (world - 1) / world * size / 1e9
        rows.append((size, t_ours, factor / (t_ours * 1e-6), t_torch, factor / (t_torch * 1e-6)))
    if rank == 0:
        print(f"all-reduce, bf16, {world} x {torch.cuda.get_device_name(dev)}; bus bandwidth = 2(n-1)/n * bytes / time")
        print(f"ceiling: peer copy {ceiling:.1f} GB/s per direction (256 MB, all ranks copying at once)")
        print("| size | ours µs | ours busbw GB/s | of peer copy | torch µs | torch busbw GB/s | ours / torch speed |")
        print("|---|---|---|---|---|---|---|")
        for size, a, abw, b, bbw in rows:
            label = f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"
            share = f"{100 * abw / ceiling:.0f}%"
            print(f"| {label} | {a:.1f} | {abw:.1f} | {share} | {b:.1f} | {bbw:.1f} | {b / a:.2f}x |")
    ours.destroy()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.gpus, port), nprocs=args.gpus)


if __name__ == "__main__":
    main()
