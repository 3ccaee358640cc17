"""The one-shot all-reduce kernel (csrc/custom_all_reduce.cuh) on the GPU: world size 1 in this
process, then two ranks as two processes, on one GPU (IPC within one device: the whole
protocol) and on two GPUs (tests/custom_all_reduce_worker.py)."""

from __future__ import annotations

import pytest
import torch
from custom_all_reduce_worker import BITS, epoch_of
from rank_scripts import run_ranks

pytestmark = pytest.mark.gpu
BUFFER = 64 << 10


@pytest.fixture
def region():  # noqa: ANN201 - one rank's region (signals + 2 staging buffers of BUFFER bytes)
    from minisgl import _C

    base = _C.custom_all_reduce_alloc(torch.cuda.current_device(), BUFFER)
    yield base
    torch.cuda.synchronize()
    _C.custom_all_reduce_free(torch.cuda.current_device(), base)


def run(base: int, src: torch.Tensor, out: torch.Tensor, max_blocks: int = 64) -> None:
    from minisgl import _C

    code = {torch.float16: _C.NCCL_FLOAT16, torch.bfloat16: _C.NCCL_BFLOAT16, torch.float32: _C.NCCL_FLOAT32}
    _C.custom_all_reduce((base,), 0, src.data_ptr(), out.data_ptr(), src.numel(), code[src.dtype], BUFFER,
                         max_blocks, torch.cuda.current_stream().cuda_stream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_world_one_is_an_exact_copy(region: int, dtype: torch.dtype) -> None:
    """With one rank the kernel stages and reads back its own message: out == in bit for bit,
    for every size up to the buffer, aligned or not, in place or not, and nothing beside out
    is written. The epoch advances once per call, and no block count is left behind."""
    calls = 0
    for n in [1, 7, 8, 9, 1023, 4099, BUFFER // dtype.itemsize]:
        for offset in (0, 1):
            for in_place in (True, False):
                for max_blocks in (1, 3, 128):  # one block looping over every slot .. one slot a thread
                    src_buf = torch.full((n + 2,), float("nan"), dtype=dtype, device="cuda")
                    src = src_buf[offset : offset + n]
                    src.copy_(torch.randn(n, device="cuda"))
                    want = src.clone()
                    out_buf = src_buf if in_place else torch.full_like(src_buf, float("nan"))
                    out = out_buf[offset : offset + n]
                    run(region, src, out, max_blocks)
                    calls += 1
                    assert torch.equal(out.view(BITS[dtype]), want.view(BITS[dtype])), (n, offset, in_place)
                    rest = torch.cat([out_buf[:offset], out_buf[offset + n :]])
                    assert rest.isnan().all(), (n, offset, in_place, max_blocks)
    torch.cuda.synchronize()
    assert epoch_of(region) == (calls, 0)


def test_world_one_under_graph_replay(region: int) -> None:
    sizes = [1, 4099, BUFFER // 2]
    bufs = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in sizes]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b in bufs:
            run(region, b, b)
    assert epoch_of(region) == (0, 0)  # capture runs nothing
    for step in range(3):
        fresh = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in sizes]
        for b, f in zip(bufs, fresh):
            b.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(b, f) for b, f in zip(bufs, fresh)), step
        assert epoch_of(region) == (3 * (step + 1), 0)


def test_bad_arguments_are_refused(region: int) -> None:
    from minisgl import _C
    from minisgl.distributed.custom_all_reduce import CustomAllReduce
    from minisgl.distributed.info import TPInfo

    x = torch.randn(BUFFER // 4 + 1, device="cuda")  # one element more than the buffer holds
    with pytest.raises(RuntimeError, match="custom_all_reduce: CUDA launch failed: invalid argument"):
        run(region, x, x)
    with pytest.raises(RuntimeError, match="invalid argument"):
        run(region, x[:8], x[:8], max_blocks=129)
    with pytest.raises(ValueError, match="1 to 8 ranks"):
        _C.custom_all_reduce((region,) * 9, 0, x.data_ptr(), x.data_ptr(), 8, _C.NCCL_FLOAT32, BUFFER, 8, 0)
    with pytest.raises(ValueError, match="64 bytes"):
        _C.peer_memory_open(0, b"\0" * 63)
    with pytest.raises(RuntimeError, match="peer_memory_open"):  # a handle from no allocation
        _C.peer_memory_open(0, b"\1" * 64)
    assert epoch_of(region) == (0, 0)  # a refused call launches nothing
    y = torch.randn(8, device="cuda")
    run(region, y, y)  # the failed IPC call above left no stale error for this launch to report
    torch.cuda.synchronize()
    assert epoch_of(region) == (1, 0)
    one = CustomAllReduce(TPInfo(0, 1), torch.device("cuda", 0), None, BUFFER)
    assert one.all_reduce(y) is y and one.bases == ()  # TP 1: the identity, nothing allocated


@pytest.mark.parametrize("placement", ["one GPU, two processes", "two GPUs"])
def test_two_ranks(placement: str) -> None:
    if placement == "two GPUs" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    args = ["--same-gpu"] if placement.startswith("one GPU") else []
    outs = run_ranks("custom_all_reduce_worker.py", 2, timeout=240, args=args)
    assert all(f"rank {r}: ok" in outs[r] for r in range(2)), outs


def test_four_ranks() -> None:
    """World 4 on four GPUs (benchmarks/gpu_suite.sh --four-gpu allreduce_tests)."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    outs = run_ranks("custom_all_reduce_worker.py", 4, timeout=240, args=["--world", "4"])
    assert all(f"rank {r}: ok" in outs[r] for r in range(4)), outs
