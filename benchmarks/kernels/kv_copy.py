"""Host KV tier copy microbenchmark: ops.kv_copy.copy_slots (the CUDA gather/scatter kernel
through the pinned host pool's device address, and the torch gather/transfer/scatter path)
against one pinned cudaMemcpy of the same bytes each way, measured in the same run.

    python benchmarks/kernels/kv_copy.py [--tokens 16384] [--layers 36 --heads 8 --dim 128] [--fp8]

Default: Qwen3-8B KV shapes (36 layers x 8 KV heads x 128, bf16: 144 KiB per token), 16,384
scattered tokens (page size 1: random GPU slots, host slots in allocation order) = 2.4 GB, pools
of twice that. Time: CUDA events around each call on the current stream (the copy's index
upload included), median of --reps after a warm-up; GB/s = K+V bytes moved / time.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from minisgl.ops import kv_copy


def timed(fn, reps: int) -> float:  # noqa: ANN001
    """Median seconds of `fn` on the current stream."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1000)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--fp8", action="store_true", help="an e4m3 KV cache (1 byte per element)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-torch", action="store_true", help="leave out the (slow) torch path")
    args = p.parse_args()
    dtype = torch.float8_e4m3fn if args.fp8 else torch.bfloat16
    n, slots = args.tokens, 2 * args.tokens
    shape = (args.layers, slots, args.heads, args.dim)
    gpu_k = torch.randn(shape, device="cuda").to(dtype)
    gpu_v = torch.randn(shape, device="cuda").to(dtype)
    host = kv_copy.pinned_empty((2, *shape), dtype)
    host_k, host_v = host[0], host[1]
    gen = torch.Generator().manual_seed(0)
    gpu_slots = torch.randperm(slots, generator=gen)[:n].tolist()  # scattered, as pages freed at random
    host_slots = list(range(n))  # the tier hands out host pages in order
    moved = 2 * args.layers * n * args.heads * args.dim * gpu_k.element_size()
    print(f"{n} tokens x {args.layers} layers x {args.heads} x {args.dim} {str(dtype)[6:]}: "
          f"{moved / 1e9:.2f} GB of K+V per copy")
    flat_dev = torch.empty(moved, dtype=torch.uint8, device="cuda")
    flat_host = kv_copy.pinned_empty((moved,), torch.uint8)
    rows = [
        ("GPU -> host", "cudaMemcpy ceiling", timed(lambda: flat_host.copy_(flat_dev, non_blocking=True), args.reps)),
        ("host -> GPU", "cudaMemcpy ceiling", timed(lambda: flat_dev.copy_(flat_host, non_blocking=True), args.reps)),
    ]
    path, why = kv_copy._pick(gpu_k, gpu_v, host_k, host_v)
    if path != "kernel":
        raise SystemExit(f"the kernel path is not taken here: {why}")
    saved = kv_copy._pick
    for name in ["kernel"] + ([] if args.skip_torch else ["torch"]):
        if name == "torch":
            kv_copy._pick = lambda *a: ("torch", "forced by the benchmark")
        try:
            rows.append(("GPU -> host", name, timed(
                lambda: kv_copy.copy_slots(gpu_k, gpu_v, gpu_slots, host_k, host_v, host_slots), args.reps)))
            rows.append(("host -> GPU", name, timed(
                lambda: kv_copy.copy_slots(host_k, host_v, host_slots, gpu_k, gpu_v, gpu_slots), args.reps)))
        finally:
            kv_copy._pick = saved
    ceiling = {d: moved / t for d, what, t in rows if what == "cudaMemcpy ceiling"}
    print("| direction | path | ms | GB/s | % of the pinned cudaMemcpy |")
    print("|---|---|---|---|---|")
    for direction, what, t in rows:
        gbs = moved / t
        print(f"| {direction} | {what} | {t * 1000:.1f} | {gbs / 1e9:.1f} | {100 * gbs / ceiling[direction]:.0f}% |")


if __name__ == "__main__":
    main()
