"""The one-shot all-reduce's Python side on the CPU: thresholds, the torch reference, the peer
access rule, and the collective set-up (handle exchange, failure on one rank, dispatch) with a
fake minisgl._C, the ranks as threads exchanging through a barrier. The kernel itself runs in
tests/test_custom_all_reduce_gpu.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from minisgl import env
from minisgl.distributed import custom_all_reduce as car
from minisgl.distributed.info import TPInfo


class FakeC:
    """minisgl._C's one-shot entry points, recording calls. Rank r's region is at 0x1000 (r + 1);
    its mapping in rank s's process at 0x100000 (r + 1) + s, so each pointer names both."""

    has_cuda = True
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_BFLOAT16 = 6, 7, 9
    CUSTOM_ALL_REDUCE_MAX_WORLD, CUSTOM_ALL_REDUCE_MAX_BLOCKS = 8, 128

    def __init__(self, rank: int, fail: str | None = None, log: list | None = None) -> None:
        self.rank, self.fail, self.calls = rank, fail, []
        self.log = [] if log is None else log  # (rank, call) of every rank, in time order

    def record(self, call: tuple) -> None:
        self.calls.append(call)
        self.log.append((self.rank, call))

    def custom_all_reduce_alloc(self, device: int, buffer_bytes: int) -> int:
        if self.fail == "alloc":
            raise RuntimeError("out of memory")
        self.record(("alloc", device, buffer_bytes, 0x1000 * (self.rank + 1)))
        return 0x1000 * (self.rank + 1)

    def peer_memory_handle(self, device: int, base: int) -> bytes:
        return f"rank{self.rank}:{base}".encode().ljust(64, b"\0")

    def peer_memory_open(self, device: int, handle: bytes) -> int:
        if self.fail == "open":
            raise RuntimeError("peer access is not supported")
        owner = int(handle.split(b":")[0].removeprefix(b"rank"))
        mapped = 0x100000 * (owner + 1) + self.rank
        self.record(("open", device, handle.rstrip(b"\0").decode(), mapped))
        return mapped

    def peer_memory_close(self, device: int, base: int) -> None:
        self.record(("close", device, base))

    def custom_all_reduce_free(self, device: int, base: int) -> None:
        self.record(("free", device, base))

    def custom_all_reduce(self, bases, rank, inp, out, n, dtype, buffer_bytes, max_blocks, stream) -> None:  # noqa: ANN001
        self.record(("reduce", tuple(bases), rank, inp == out, n, dtype, buffer_bytes, max_blocks, stream))

    def nccl_all_reduce(self, comm, send, recv, count, dtype, stream) -> None:  # noqa: ANN001
        self.record(("nccl", count, dtype))


def in_threads(world: int, fn: Callable[[int, car.Gather], Any]) -> list[Any]:
    """fn(rank, gather) on `world` threads; gather is an all-gather through a barrier."""
    barrier = threading.Barrier(world, timeout=20)
    slots: list[Any] = [None] * world
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        def gather(obj: Any) -> list[Any]:
            slots[rank] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        try:
            results[rank] = fn(rank, gather)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            results[rank] = e
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def gpus(world: int, host: Callable[[int], str] = lambda r: "box", access: bool = True) -> Callable[[int], Any]:
    """Rank r's view: GPUs GPU-0 .. GPU-(world-1) visible, one host per host(r)."""
    uuids = tuple(f"GPU-{i}" for i in range(world))
    return lambda r: car.LocalGpus(host(r), uuids, lambda a, b: access)


@pytest.fixture(autouse=True)
def _no_cuda_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(env, "CUSTOM_ALL_REDUCE_MAX_BYTES", None)


def set_up(world: int, libs: list[FakeC], local: Callable[[int], Any] | None = None,
           enabled: bool = True) -> list[Any]:
    local = local or gpus(world)
    return in_threads(world, lambda r, g: car.set_up_custom_all_reduce(
        TPInfo(r, world), torch.device("cuda", r), g, enabled, local(r), lib=libs[r]))


def test_threshold_by_tp_size_and_the_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [car.max_bytes_for(w) for w in (2, 3, 4, 6, 8, 16)] == [512 << 10, 256 << 10, 256 << 10,
                                                                   128 << 10, 128 << 10, 0]
    monkeypatch.setattr(env, "CUSTOM_ALL_REDUCE_MAX_BYTES", 4096)
    assert car.max_bytes_for(2) == car.max_bytes_for(8) == 4096
    for raw, want in (("", None), (" 1024 ", 1024), ("0", 0)):
        monkeypatch.setenv("MINISGL_CUSTOM_ALL_REDUCE_MAX_BYTES", raw)
        assert env._bytes_or_none("MINISGL_CUSTOM_ALL_REDUCE_MAX_BYTES") == want
    for raw in ("-1", "64KB"):
        monkeypatch.setenv("MINISGL_CUSTOM_ALL_REDUCE_MAX_BYTES", raw)
        with pytest.raises(ValueError, match="MINISGL_CUSTOM_ALL_REDUCE_MAX_BYTES must be a byte count"):
            env._bytes_or_none("MINISGL_CUSTOM_ALL_REDUCE_MAX_BYTES")


def test_reference_sums_in_fp32_in_rank_order() -> None:
    # bf16: 1 + 2^-8 + 2^-8 is 1 + 2^-7 in fp32 (a bf16 number); summed in bf16 it stays 1.
    one, half_ulp = torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0**-8], dtype=torch.bfloat16)
    assert car.rank_order_sum([one, half_ulp, half_ulp]).item() == 1 + 2.0**-7
    assert (one + half_ulp + half_ulp).item() == 1.0
    # fp32: the order is rank order, (2^24 + 1) + 1 = 2^24 but 1 + 1 + 2^24 = 2^24 + 2.
    big, unit = torch.tensor([2.0**24]), torch.tensor([1.0])
    assert car.rank_order_sum([big, unit, unit]).item() == 2.0**24
    assert car.rank_order_sum([unit, unit, big]).item() == 2.0**24 + 2
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(1000, generator=gen).to(torch.float16) for _ in range(4)]
    exact = sum(p.double() for p in parts)
    assert car.rank_order_sum(parts).dtype == torch.float16
    assert (car.rank_order_sum(parts).double() - exact).abs().max() <= 2.0**-10 * exact.abs().max()  # ~1 fp16 rounding


def test_peer_access_rule() -> None:
    local = car.LocalGpus("a", ("GPU-0", "GPU-1"), lambda x, y: (x, y) != (1, 0))
    assert car.peer_access_problem(["a", "a"], ["GPU-0", "GPU-1"], 0, local) is None
    assert car.peer_access_problem(["a", "a"], ["GPU-0", "GPU-0"], 1, local) is None  # two processes, one GPU
    assert "no peer access to GPU 0 (rank 0)" in car.peer_access_problem(["a", "a"], ["GPU-0", "GPU-1"], 1, local)
    assert "different hosts (a, b)" in car.peer_access_problem(["a", "b"], ["GPU-0", "GPU-1"], 0, local)
    assert "rank 1's GPU is not visible" in car.peer_access_problem(["a", "a"], ["GPU-0", "GPU-7"], 0, local)


@pytest.mark.parametrize("world", [2, 3])
def test_set_up_opens_every_peer_in_rank_order_and_dispatches_by_size(world: int) -> None:
    events: list = []
    libs = [FakeC(r, log=events) for r in range(world)]
    comms = set_up(world, libs)
    for r, (c, lib) in enumerate(zip(comms, libs)):
        assert isinstance(c, car.CustomAllReduce), c
        peers = [p for p in range(world) if p != r]
        want = tuple(0x1000 * (r + 1) if p == r else 0x100000 * (p + 1) + r for p in range(world))
        assert c.bases == want
        assert lib.calls[0] == ("alloc", r, car.max_bytes_for(world), 0x1000 * (r + 1))
        assert [call[2] for call in lib.calls[1:]] == [f"rank{p}:{0x1000 * (p + 1)}" for p in peers]
        lib.calls.clear()
        small = torch.ones(c.max_bytes // 2, dtype=torch.bfloat16)
        assert c.takes(small) and not c.takes(torch.ones(c.max_bytes // 2 + 1, dtype=torch.bfloat16))
        c.launch(small, c._codes[torch.bfloat16], 123)
        assert lib.calls == [("reduce", want, r, True, small.numel(), 9, c.buffer_bytes, car.MAX_BLOCKS, 123)]
        with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
            c.check(torch.ones(4, dtype=torch.int32))
        with pytest.raises(ValueError, match=f"contiguous tensor on cuda:{r}"):
            c.check(torch.ones(4, 4).t())
        lib.calls.clear()
    events.clear()
    in_threads(world, lambda r, g: comms[r].destroy())  # collective, as the engine's shutdown
    # No region is freed before every peer has unmapped it (cudaFree of a mapped region is undefined).
    frees = [i for i, (_, call) in enumerate(events) if call[0] == "free"]
    closes = [i for i, (_, call) in enumerate(events) if call[0] == "close"]
    assert len(closes) == world * (world - 1) and max(closes) < min(frees), events
    for r, (c, lib) in enumerate(zip(comms, libs)):
        peers = [p for p in range(world) if p != r]
        # Every mapping closed, then (after the ranks met) this rank's region freed.
        assert lib.calls == [("close", r, 0x100000 * (p + 1) + r) for p in peers] + [("free", r, 0x1000 * (r + 1))]
        small = torch.ones(4, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="destroyed"):
            c.all_reduce(small)
        assert not c.takes(small)
        c.destroy()  # again: nothing, and no collective
        assert len(lib.calls) == world


@pytest.fixture
def said() -> list[str]:
    """What the distributed logger says during the test."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("minisgl.distributed")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


@pytest.mark.parametrize(
    "case, local, enabled, why",
    [
        ("no P2P", gpus(2, access=False), True, "GPU 0 (rank 0) has no peer access to GPU 1 (rank 1)"),
        ("two hosts", gpus(2, host=lambda r: f"node{r}"), True, "ranks 0 and 1 are on different hosts"),
        ("disabled", gpus(2), False, "disabled (--disable-custom-all-reduce)"),
    ],
)
def test_every_rank_is_off_when_any_rank_cannot(case: str, local, enabled: bool, why: str, said) -> None:  # noqa: ANN001
    libs = [FakeC(r) for r in range(2)]
    assert set_up(2, libs, local, enabled) == [None, None]
    assert all(lib.calls == [] for lib in libs)
    assert len(said) == 1 and why in said[0] and "every all-reduce goes through NCCL" in said[0], said


def test_one_rank_only_refusing_turns_off_every_rank(said) -> None:  # noqa: ANN001
    """Rank 1 alone sees no peer access: rank 0, which sees it, must not set up either."""
    base = gpus(2)(0)
    local = [base, car.LocalGpus("box", base.uuids, lambda a, b: False)]
    assert set_up(2, [FakeC(0), FakeC(1)], lambda r: local[r]) == [None, None]
    assert "GPU 1 (rank 1) has no peer access" in said[0]


@pytest.mark.parametrize("fail", ["alloc", "open"])
def test_a_set_up_failure_on_one_rank_fails_every_rank(fail: str, said) -> None:  # noqa: ANN001
    libs = [FakeC(0), FakeC(1, fail=fail)]
    assert set_up(2, libs) == [None, None]
    assert "set-up failed: rank 1:" in said[0]
    for lib in libs:  # whatever was allocated or mapped was released again
        acquired = {c[3] for c in lib.calls if c[0] in ("alloc", "open")}
        released = {c[2] for c in lib.calls if c[0] in ("close", "free")}
        assert acquired == released, lib.calls
    assert any(c[0] == "alloc" for c in libs[0].calls)  # rank 0 got as far as allocating


def test_single_rank_is_the_identity() -> None:
    lib = FakeC(0)
    c = car.CustomAllReduce(TPInfo(0, 1), torch.device("cpu"), lambda o: [o], 1024, lib=lib)
    x = torch.randn(8)
    assert c.all_reduce(x) is x and lib.calls == [] and c.bases == ()
    assert car.set_up_custom_all_reduce(TPInfo(0, 1), torch.device("cpu"), None, True, None, lib=lib) is None


def test_nccl_communicator_sends_small_messages_one_shot(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.distributed import nccl

    monkeypatch.setattr(nccl, "current_stream", lambda device: 7)
    lib = FakeC(0)
    comm = object.__new__(nccl.NcclCommunicator)
    comm.tp, comm._C, comm.device, comm.comm = TPInfo(0, 2), lib, torch.device("cpu"), 1
    comm._codes = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}
    one_shot = car.CustomAllReduce(TPInfo(0, 1), torch.device("cpu"), None, 4096, lib=lib)
    one_shot.bases, one_shot.tp = (1, 2), TPInfo(0, 2)  # as if set up
    comm.custom = one_shot
    comm.all_reduce(torch.ones(1024))  # 4096 bytes: one-shot
    comm.all_reduce(torch.ones(1025))  # NCCL
    assert [c[0] for c in lib.calls] == ["reduce", "nccl"] and lib.calls[0][-1] == 7
    comm.custom = None
    comm.all_reduce(torch.ones(4))
    assert lib.calls[-1] == ("nccl", 4, 7)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        comm.all_reduce(torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="4100 bytes > the buffer's 4096"):
        one_shot.check(torch.ones(1025))  # the checked entry point refuses what takes() would not send


def test_the_flag_reaches_the_engine_config() -> None:
    from minisgl.launch.args import ServerArgs
    from minisgl.launch.cli import build_parser

    assert build_parser().parse_args(["--disable-custom-all-reduce"]).disable_custom_all_reduce
    args = ServerArgs(tp=2, dist_init_addr="127.0.0.1:1")
    assert args.engine_config(0).custom_all_reduce is True
    off = ServerArgs(tp=2, dist_init_addr="127.0.0.1:1", disable_custom_all_reduce=True)
    assert off.engine_config(1).custom_all_reduce is False
