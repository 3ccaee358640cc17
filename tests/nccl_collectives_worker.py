"""One rank of tests/test_nccl_gpu.py::test_nccl_collectives_two_gpus, run as a script
(`python nccl_collectives_worker.py RANK PORT one-shot|nccl`) so that it needs nothing from
the test module.

Our NCCL communicator's all-reduce and all-gather must be exact for every dtype and for sizes
from 1 element to 256 MB, eagerly and under CUDA-graph replay; with `one-shot` the messages up
to the threshold go through the one-shot all-reduce, with `nccl` every one through NCCL."""

from __future__ import annotations

import sys

import torch

# Elements; 64 Mi fp32 = 256 MB. 512 KB (the one-shot threshold at TP 2) is 131072 fp32 or
# 262144 2-byte elements: one element more goes through NCCL.
SIZES = [1, 7, 1023, 65536 + 3, 131072, 131073, 262144, 262145, 1 << 20, 64 << 20]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def main(rank: int, port: int, one_shot: bool) -> None:
    from minisgl.distributed.communicator import make_communicator
    from minisgl.distributed.info import TPInfo

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    comm, _ = make_communicator(TPInfo(rank, 2), dev, f"127.0.0.1:{port}", custom_nccl=True,
                                custom_all_reduce=one_shot)
    assert (comm.custom is not None) == one_shot, "the one-shot all-reduce is not as asked (see the log)"
    for dtype in DTYPES:
        for n in SIZES:
            if dtype != torch.float32 and n == SIZES[-1]:
                n = 128 << 20  # 256 MB in 2-byte types too
            # Small integers are exact in every dtype, so the sum must match exactly. Both ranks
            # draw the same (2, n) tensor and keep their own row.
            gen = torch.Generator(device=dev).manual_seed(1000 + n)
            both = torch.randint(-8, 8, (2, n), generator=gen, device=dev).to(dtype)
            x = both[rank].clone()
            comm.all_reduce(x)
            torch.testing.assert_close(x, both[0] + both[1], rtol=0, atol=0, msg=f"all_reduce {dtype} n={n}")
            m = min(n, 4096)
            g = comm.all_gather(both[rank, :m].reshape(1, -1), dim=-1)
            torch.testing.assert_close(g, both[:, :m].reshape(1, -1), rtol=0, atol=0, msg=f"all_gather {dtype} n={m}")
            g0 = comm.all_gather(both[rank, :m].reshape(-1, 1), dim=0)
            torch.testing.assert_close(g0, both[:, :m].reshape(-1, 1), rtol=0, atol=0, msg=f"all_gather dim 0 {dtype}")
    # Under CUDA-graph replay, with new data each replay.
    buf = torch.empty(4097, device=dev)
    comm.all_reduce(buf)  # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_reduce(buf)
    for step in range(3):
        gen = torch.Generator(device=dev).manual_seed(step)
        both = torch.randn(2, 4097, generator=gen, device=dev).round()
        buf.copy_(both[rank])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(buf, both.sum(0), rtol=0, atol=0, msg=f"graph replay {step}")
    del graph
    comm.destroy()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "one-shot")
