"""One rank of tests/test_custom_all_reduce_gpu.py's two-rank test, run as a script:
`python custom_all_reduce_worker.py RANK PORT [--same-gpu] [--world N]` (N ranks, default 2).
With --same-gpu every rank runs on GPU 0 (processes exchanging IPC handles on one device: the
whole protocol on one GPU); otherwise rank r runs on GPU r.

The one-shot all-reduce must give, on every rank: exactly the sum for small integers in every
dtype; bit for bit the torch reference (fp32 sum in rank order) for random data; for sizes from
1 element to the threshold, including sizes that are not a multiple of the 16-byte vector and
unaligned views (whose NaN-poisoned neighbours must stay untouched); eagerly, back to back
without synchronising (the staging buffers' reuse), and under CUDA-graph replay interleaved
with eager calls (the epoch lives in device memory). The fused all-reduce + residual add +
RMSNorm kernel (check_fused) against the torch reference of the two steps it replaces: the
residual bit for bit, the normed output within one rounding (rsqrt), eagerly and in a graph
interleaved with plain all-reduces (they share the epochs)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

SIZES = [1, 7, 8, 9, 15, 17, 1023, 4099, 65537]  # elements; plus the largest the threshold allows
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


class DeviceWords:
    """A torch view of raw device memory (__cuda_array_interface__): the signal words."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i8", "data": (ptr, False), "strides": None,
                                         "version": 3}


def epoch_of(base: int) -> tuple[int, int]:
    """(calls completed, blocks of a running call finished) of the region at `base`."""
    words = torch.as_tensor(DeviceWords(base, 2), device="cuda")
    return int(words[0]), int(words[1])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got.view(BITS[got.dtype]), want.view(BITS[want.dtype])):
        bad = (got.float() != want.float()).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"{what}: differs at {bad}: {got[bad].tolist()} vs {want[bad].tolist()}")


def main(rank: int, port: int, same_gpu: bool, world: int) -> None:
    from minisgl.distributed.custom_all_reduce import make_custom_all_reduce, rank_order_sum
    from minisgl.distributed.info import TPInfo

    dev = torch.device("cuda", 0 if same_gpu else rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    car = make_custom_all_reduce(TPInfo(rank, world), dev, dist.group.WORLD)
    assert car is not None, "the one-shot all-reduce did not set up (its reason is logged above)"
    calls = 0
    for dtype in DTYPES:
        for n in SIZES + [car.max_bytes // dtype.itemsize]:
            gen = torch.Generator(device=dev).manual_seed(1000 + n)  # both ranks draw the same parts
            ints = torch.randint(-8, 8, (world, n), generator=gen, device=dev).to(dtype)
            x = ints[rank].clone()
            car.all_reduce(x)
            assert_same_bits(x, ints.float().sum(0).to(dtype), f"integers {dtype} n={n}")  # exact: small ints
            real = torch.randn(world, n, generator=gen, device=dev).to(dtype)
            want = rank_order_sum(list(real))
            y = real[rank].clone()
            car.all_reduce(y)
            assert_same_bits(y, want, f"random {dtype} n={n}")
            poisoned = torch.full((n + 2,), float("nan"), dtype=dtype, device=dev)
            view = poisoned[1 : n + 1]  # one element off the 16-byte alignment
            view.copy_(real[rank])
            car.all_reduce(view)
            assert_same_bits(view, want, f"unaligned {dtype} n={n}")
            assert poisoned[0].isnan() and poisoned[-1].isnan(), f"unaligned {dtype} n={n} wrote outside"
            calls += 3

    # Back to back, no synchronisation: the staging buffers are reused while the other rank
    # may still be a call behind; the sizes (hence grids) change every call.
    top = car.max_bytes // 2
    sizes = [[1, 4099, top, 8, 65537, 17][i % 6] for i in range(48)]
    gen = torch.Generator(device=dev).manual_seed(7)
    parts = [torch.randn(world, n, generator=gen, device=dev).to(torch.bfloat16) for n in sizes]
    outs = [p[rank].clone() for p in parts]
    torch.cuda.synchronize()
    for o in outs:
        car.all_reduce(o)
    calls += len(outs)
    torch.cuda.synchronize()
    for i, (o, p) in enumerate(zip(outs, parts)):
        assert_same_bits(o, rank_order_sum(list(p)), f"back-to-back call {i} n={p.shape[1]}")

    # CUDA graph: three sizes (three grids) per replay, eager calls between replays.
    sizes = [1, 4099, top]
    bufs = [torch.randn(n, device=dev).to(torch.bfloat16) for n in sizes]
    for b in bufs:
        car.all_reduce(b)  # warm-up outside capture, as the engine does
    calls += len(bufs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b in bufs:
            car.all_reduce(b)
    for step in range(4):
        gen = torch.Generator(device=dev).manual_seed(100 + step)
        parts = [torch.randn(world, n, generator=gen, device=dev).to(torch.bfloat16) for n in sizes]
        for b, p in zip(bufs, parts):
            b.copy_(p[rank])
        graph.replay()
        calls += len(bufs)
        if step % 2:
            eager = parts[1][rank].clone()
            car.all_reduce(eager)
            calls += 1
            torch.cuda.synchronize()
            assert_same_bits(eager, rank_order_sum(list(parts[1])), f"eager between replays {step}")
        torch.cuda.synchronize()
        for b, p in zip(bufs, parts):
            assert_same_bits(b, rank_order_sum(list(p)), f"graph replay {step} n={p.shape[1]}")
    calls += check_fused(car, rank, dev, world)
    assert epoch_of(car.bases[rank]) == (calls, 0), (epoch_of(car.bases[rank]), calls)
    del graph
    car.destroy()
    dist.destroy_process_group()
    print(f"rank {rank}: ok, {calls} calls", flush=True)


def fused_reference(parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):  # noqa: ANN201
    """What the engine computed before the fused kernel: all-reduce, then fused_add_rmsnorm."""
    from minisgl.distributed.custom_all_reduce import rank_order_sum
    from minisgl.kernels.norm import fused_add_rmsnorm_reference

    return fused_add_rmsnorm_reference(rank_order_sum(list(parts)), residual, weight, eps)


def assert_fused(got: tuple, want: tuple, what: str) -> None:
    out, res = got
    ref_out, ref_res = want
    assert_same_bits(res, ref_res, f"{what}: residual")
    assert not out.isnan().any(), f"{what}: NaN in the output"
    # One bf16/fp16 rounding apart at most (the kernel's rsqrtf against torch's).
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-7, atol=1e-5, msg=lambda m: f"{what}: {m}")


def check_fused(car, rank: int, dev: torch.device, world: int) -> int:  # noqa: ANN001
    """The fused kernel; returns the number of calls made (each advances the epoch)."""
    calls, eps = 0, 1e-6
    cases = [(1, 16), (1, 4096), (3, 2048), (64, 4096), (100, 2048), (1, 16384), (7, 8192)]
    for dtype in (torch.bfloat16, torch.float16):
        for rows, hidden in cases:
            gen = torch.Generator(device=dev).manual_seed(rows * 100003 + hidden)  # the same draws on both ranks
            parts = torch.randn(world, rows, hidden, generator=gen, device=dev).to(dtype)
            residual = torch.randn(rows, hidden, generator=gen, device=dev).to(dtype)
            weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=dev)).to(dtype)
            want = fused_reference(parts, residual, weight, eps)
            x, res = parts[rank].clone(), residual.clone()
            assert car.takes_rmsnorm(x, res, weight), (rows, hidden, dtype)
            got = car.all_reduce_rmsnorm(x, res, weight, eps)
            calls += 1
            torch.cuda.synchronize()
            assert got[1] is res
            assert_fused(got, want, f"fused {dtype} {rows}x{hidden}")
            assert torch.equal(x, parts[rank]), "the fused kernel wrote into its input"
    x = torch.randn(4, 4096, device=dev).to(torch.bfloat16)
    w = torch.ones(4096, device=dev).to(torch.bfloat16)
    assert not car.takes_rmsnorm(x[:, :4000], x[:, :4000].clone(), w[:4000])  # hidden % 8 == 0 but strided rows
    assert not car.takes_rmsnorm(x.float(), x.float(), w.float())  # 16-bit only
    assert not car.takes_rmsnorm(torch.randn(1, 16392, device=dev).to(torch.bfloat16),
                                 torch.randn(1, 16392, device=dev).to(torch.bfloat16),
                                 torch.ones(16392, device=dev).to(torch.bfloat16))  # longer than a block holds

    # A decode step's pattern in a graph: fused, plain, fused, with fresh inputs each replay.
    rows, hidden = 2, 4096
    xs = [torch.randn(rows, hidden, device=dev).to(torch.bfloat16) for _ in range(3)]
    res = torch.randn(rows, hidden, device=dev).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, device=dev)).to(torch.bfloat16)
    car.all_reduce_rmsnorm(xs[0], res, weight, eps)  # warm-up outside capture
    calls += 1
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out0, _ = car.all_reduce_rmsnorm(xs[0], res, weight, eps)
        car.all_reduce(xs[1])
        out2, _ = car.all_reduce_rmsnorm(xs[2], res, weight, eps)
    for step in range(3):
        gen = torch.Generator(device=dev).manual_seed(500 + step)
        parts = [torch.randn(world, rows, hidden, generator=gen, device=dev).to(torch.bfloat16) for _ in range(3)]
        start = torch.randn(rows, hidden, generator=gen, device=dev).to(torch.bfloat16)
        for x, p in zip(xs, parts):
            x.copy_(p[rank])
        res.copy_(start)
        graph.replay()
        calls += 3
        torch.cuda.synchronize()
        want0 = fused_reference(parts[0], start, weight, eps)
        want2 = fused_reference(parts[2], want0[1].clone(), weight, eps)
        assert_same_bits(xs[1], rank_order_sum_of(parts[1]), f"graph step {step}: plain all-reduce")
        assert_fused((out2, res), want2, f"graph step {step}: second fused call")
        torch.testing.assert_close(out0.float(), want0[0].float(), rtol=2**-7, atol=1e-5)
    del graph
    return calls


def rank_order_sum_of(parts: torch.Tensor) -> torch.Tensor:
    from minisgl.distributed.custom_all_reduce import rank_order_sum

    return rank_order_sum(list(parts))


if __name__ == "__main__":
    world = int(sys.argv[sys.argv.index("--world") + 1]) if "--world" in sys.argv else 2
    main(int(sys.argv[1]), int(sys.argv[2]), "--same-gpu" in sys.argv[3:], world)
