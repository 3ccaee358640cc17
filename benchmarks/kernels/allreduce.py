"""All-reduce latency and bus bandwidth by message size, one process per GPU, in one run:
minisgl's one-shot all-reduce over peer memory (csrc/custom_all_reduce.cuh), minisgl's NCCL
bindings, what our communicator's all_reduce does (one-shot up to its threshold, NCCL above),
and torch.distributed (NCCL) as the named baseline.

    python benchmarks/kernels/allreduce.py --gpus 2
    python benchmarks/kernels/allreduce.py --gpus 1    # one GPU: the kernel's own floor


Bus bandwidth = 2 (n - 1) / n * bytes / time (NCCL's convention, comparable across n).
Ceiling, measured in the same run: every rank copies 256 MB to the next rank's GPU at the
same time (both directions of each link busy, as in a ring all-reduce); bus bandwidth cannot
exceed that per-direction copy rate.
Each size is captured in a CUDA graph of `calls` back-to-back all-reduces over rotating
buffers (bf16); the ranks meet at a gloo barrier before each replay; median of replays / calls.

It then prints the data the runtime takes (minisgl/distributed/custom_all_reduce.py): the
largest size up to which the one-shot kernel beats NCCL at every size (MAX_BYTES_BY_WORLD), and
the one-shot kernel's block cap (MAX_BLOCKS) swept over candidates.

With --gpus 1 it times the one-shot kernel at world size 1 (stage the message, the flag barrier
with itself, read it back: every step but the peer reads over the link) against a torch device
copy of the same bytes, 1 KB .. 2 MB: a floor under the two-GPU latency, and no more than that.
"""

from __future__ import annotations

import argparse
import math
import socket
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KB, MB = 1 << 10, 1 << 20
SIZES = [1 * KB, 2 * KB, 4 * KB, 8 * KB, 16 * KB, 32 * KB, 64 * KB, 128 * KB, 256 * KB, 512 * KB,
         1 * MB, 2 * MB, 4 * MB, 8 * MB, 16 * MB, 64 * MB, 256 * MB]
BLOCK_CANDIDATES = [8, 16, 32, 64, 128]
SWEEP_SIZES = [s for s in SIZES if s <= 2 * MB]


def time_graph(fn: Callable[[torch.Tensor], object], bufs: list[torch.Tensor], reps: int = 20) -> float:
    """Median µs per call of fn over bufs, captured in one graph."""
    for b in bufs[:2]:
        fn(b)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for b in bufs:
            fn(b)
    times = []
    for i in range(reps + 2):
        if dist.is_initialized():
            dist.barrier()  # gloo: the ranks start each replay within a few µs of each other
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        if i >= 2:
            times.append(s.elapsed_time(e) * 1000 / len(bufs))
    del g
    return statistics.median(times)


def peer_copy_gbs(rank: int, world: int, nbytes: int = 256 * MB, reps: int = 10) -> float:
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


def buffers(size: int, dev: torch.device) -> list[torch.Tensor]:
    """Calls per graph and their rotating bf16 buffers: many calls for small messages, so
    the ranks' start skew (a few µs) is spread thin."""
    calls = max(4, min(256, (1024 * MB) // size))
    distinct = min(calls, 8)  # rotate buffers so one message is not served from L2 alone
    return [torch.randn(size // 2, device=dev, dtype=torch.bfloat16) for _ in range(distinct)] * (calls // distinct)


def label(size: int) -> str:
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


def worker(rank: int, world: int, port: int) -> None:
    from minisgl.distributed.communicator import make_communicator
    from minisgl.distributed.custom_all_reduce import CustomAllReduce, max_bytes_for
    from minisgl.distributed.info import TPInfo

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    tp = TPInfo(rank, world)
    ours, cpu_group = make_communicator(tp, dev, f"127.0.0.1:{port}", custom_nccl=True, custom_all_reduce=True)
    nccl, _ = make_communicator(tp, dev, f"127.0.0.1:{port}", custom_nccl=True, custom_all_reduce=False)
    if ours.custom is None:
        raise SystemExit("the one-shot all-reduce is off on this machine (its reason is logged above)")

    def gather(obj: object) -> list[object]:
        out: list[object] = [None] * world
        dist.all_gather_object(out, obj, group=cpu_group)
        return out

    one_shot = CustomAllReduce(tp, dev, gather, max(SIZES))  # one-shot at every size, for the crossover
    torch_group = dist.new_group(backend="nccl")
    ceiling = peer_copy_gbs(rank, world)
    rows = []
    for size in SIZES:
        bufs = buffers(size, dev)
        t = {
            "one-shot": time_graph(one_shot.all_reduce, bufs),
            "nccl": time_graph(nccl.all_reduce, bufs),
            "ours": time_graph(ours.all_reduce, bufs),
            "torch": time_graph(lambda b: dist.all_reduce(b, group=torch_group), bufs),
        }
        rows.append((size, t))
    sweep = {}
    for blocks in BLOCK_CANDIDATES:
        one_shot.max_blocks = blocks
        sweep[blocks] = [time_graph(one_shot.all_reduce, buffers(size, dev)) for size in SWEEP_SIZES]
    if rank == 0:
        report(world, dev, ceiling, rows, sweep, max_bytes_for(world))
    one_shot.destroy()
    nccl.destroy()
    ours.destroy()
    dist.destroy_process_group()


def report(world: int, dev: torch.device, ceiling: float, rows: list, sweep: dict, threshold: int) -> None:
    print(f"all-reduce, bf16, {world} x {torch.cuda.get_device_name(dev)}; bus bandwidth = 2(n-1)/n * bytes / time")
    print(f"ceiling: peer copy {ceiling:.1f} GB/s per direction (256 MB, all ranks copying at once)")
    print(f"ours = our communicator's all_reduce: one-shot up to {label(threshold)} (the threshold now), NCCL above")
    print("| size | one-shot µs | our NCCL µs | ours µs | torch µs | one-shot / torch | ours / torch "
          "| ours busbw GB/s | of peer copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size, t in rows:
        bw = 2 * (world - 1) / world * size / 1e9 / (t["ours"] * 1e-6)
        print(f"| {label(size)} | {t['one-shot']:.1f} | {t['nccl']:.1f} | {t['ours']:.1f} | {t['torch']:.1f} | "
              f"{t['one-shot'] / t['torch']:.2f}x | {t['ours'] / t['torch']:.2f}x | {bw:.1f} | "
              f"{100 * bw / ceiling:.0f}% |")
    small = [t["ours"] / t["torch"] for s, t in rows if s <= 64 * KB]
    large = [t["ours"] / t["torch"] for s, t in rows if s > threshold]
    print(f"\ntarget: ours <= 0.70x torch's latency at <= 64 KB: worst {max(small):.2f}x "
          f"({'met' if max(small) <= 0.70 else 'NOT met'})")
    print(f"target: ours equal to torch above the threshold: {min(large):.2f}x .. {max(large):.2f}x")
    crossover = 0
    for size, t in rows:
        if t["one-shot"] >= t["nccl"]:
            break
        crossover = size
    print(f"data: the one-shot kernel beats our NCCL at every size up to {label(crossover) if crossover else 'none'} "
          f"-> MAX_BYTES_BY_WORLD for TP {world} (now {label(threshold)})")
    print(f"\none-shot µs by block cap (MAX_BLOCKS), {label(SWEEP_SIZES[0])} .. {label(SWEEP_SIZES[-1])}")
    print("| block cap | " + " | ".join(label(s) for s in SWEEP_SIZES) + " | geomean ≤ threshold |")
    print("|---|" + "---|" * (len(SWEEP_SIZES) + 1))
    within = [i for i, s in enumerate(SWEEP_SIZES) if s <= threshold]
    geo = {}
    for blocks, times in sweep.items():
        geo[blocks] = math.exp(statistics.mean(math.log(times[i]) for i in within))
        print(f"| {blocks} | " + " | ".join(f"{x:.1f}" for x in times) + f" | {geo[blocks]:.2f} |")
    print(f"data: MAX_BLOCKS = {min(geo, key=geo.get)} (lowest geometric mean up to the threshold)")


def one_gpu() -> None:
    """The kernel at world size 1 on GPU 0 (no process group): its fixed cost by size."""
    from minisgl import _C
    from minisgl.distributed.custom_all_reduce import MAX_BLOCKS

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    top = max(SWEEP_SIZES)
    base = _C.custom_all_reduce_alloc(0, top)

    def one_shot(b: torch.Tensor) -> None:
        _C.custom_all_reduce((base,), 0, b.data_ptr(), b.data_ptr(), b.numel(), _C.NCCL_BFLOAT16, top,
                             MAX_BLOCKS, torch.cuda.current_stream().cuda_stream)

    print(f"one-shot all-reduce at world size 1, bf16, {torch.cuda.get_device_name(dev)}, {MAX_BLOCKS} blocks at most")
    print("baseline: torch copy_ of the same bytes (one read + one write; the kernel does two of each)")
    print("| size | one-shot µs | torch copy µs | one-shot / copy |")
    print("|---|---|---|---|")
    for size in SWEEP_SIZES:
        bufs = buffers(size, dev)
        src = torch.randn(size // 2, device=dev, dtype=torch.bfloat16)
        t_one = time_graph(one_shot, bufs)
        t_copy = time_graph(lambda b, src=src: b.copy_(src), bufs)
        print(f"| {label(size)} | {t_one:.1f} | {t_copy:.1f} | {t_one / t_copy:.2f}x |")
    torch.cuda.synchronize()
    _C.custom_all_reduce_free(0, base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    args = ap.parse_args()
    if args.gpus == 1:
        one_gpu()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.gpus, port), nprocs=args.gpus)


if __name__ == "__main__":
    main()
