"""One-shot all-reduce for small messages over peer memory (csrc/custom_all_reduce.cuh).

NCCL's latency floor (~12 µs an all-reduce on two H200s, benchmarks/RESULTS.md issue 7) is
most of the cost of a decode step's all-reduces (two a layer, a few KB each at small batch).
Here every rank stages its message in a buffer that every peer has mapped (CUDA IPC), and one
kernel per rank reads them all and sums them in rank order: every rank gets the same bits.
The NCCL communicator owns one and sends messages up to `max_bytes` through it.

Set-up is collective over the host (gloo) group and happens before any CUDA graph is
captured: each rank allocates a region, exports its IPC handle, gathers everyone's and opens
the peers'. It is only attempted where every rank can map every peer's memory (one host, peer
access between every pair of GPUs); otherwise the communicator says why, once, and uses NCCL.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from minisgl import env
from minisgl.distributed.info import TPInfo
from minisgl.logging_setup import get_logger

log = get_logger("minisgl.distributed")

# Largest message in bytes that takes the one-shot path, by TP size (the first row whose size
# is >= the TP size). 512 KB at TP 2 is the starting point until benchmarks/kernels/allreduce.py
# measures the crossover with NCCL on two GPUs. A rank reads (TP - 1) whole peer messages, so
# larger groups cross over earlier: halved per doubling (not measured yet).
MAX_BYTES_BY_WORLD = ((2, 512 << 10), (4, 256 << 10), (8, 128 << 10))
# Blocks per call at most: every block must be resident (blocks wait on their peers), so this
# stays below the SM count. benchmarks/kernels/allreduce.py sweeps it.
MAX_BLOCKS = 64

Gather = Callable[[Any], list[Any]]  # every rank's object, in rank order (a collective)


def max_bytes_for(world: int) -> int:
    """The one-shot threshold for a TP size (0: off); MINISGL_CUSTOM_ALL_REDUCE_MAX_BYTES wins."""
    if env.CUSTOM_ALL_REDUCE_MAX_BYTES is not None:
        return env.CUSTOM_ALL_REDUCE_MAX_BYTES
    return next((limit for size, limit in MAX_BYTES_BY_WORLD if world <= size), 0)


def rank_order_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The torch reference: what the kernel computes from every rank's message, i.e. an fp32
    sum in rank order 0, 1, ..., cast back to the messages' dtype once."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


@dataclass(frozen=True)
class LocalGpus:
    """What this process knows of its GPUs: its host, every visible GPU's UUID (by CUDA
    ordinal) and whether GPU a can map GPU b's memory."""

    host: str
    uuids: tuple[str, ...]
    can_access: Callable[[int, int], bool]

    @staticmethod
    def probe() -> LocalGpus:
        uuids = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))
        return LocalGpus(socket.gethostname(), uuids, torch.cuda.can_device_access_peer)


def peer_access_problem(hosts: Sequence[str], uuids: Sequence[str], rank: int, local: LocalGpus) -> str | None:
    """Why rank `rank` cannot map every peer's memory, or None. hosts / uuids: every rank's."""
    mine = local.uuids.index(uuids[rank])
    for r, (host, uuid) in enumerate(zip(hosts, uuids)):
        if r == rank or uuid == uuids[rank]:  # two ranks on one GPU: IPC within one device works
            continue
        if host != hosts[rank]:
            return f"ranks {rank} and {r} are on different hosts ({hosts[rank]}, {host})"
        if uuid not in local.uuids:
            return f"rank {r}'s GPU is not visible to rank {rank} (CUDA_VISIBLE_DEVICES)"
        other = local.uuids.index(uuid)
        if not local.can_access(mine, other):
            return f"GPU {mine} (rank {rank}) has no peer access to GPU {other} (rank {r})"
    return None


def current_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


class CustomAllReduce:
    """In-place sum across the TP group of messages of at most `max_bytes`, over peer memory.
    TP size 1 is the identity and allocates nothing. Every rank must make the same calls."""

    def __init__(
        self, tp: TPInfo, device: torch.device, gather: Gather, max_bytes: int,
        max_blocks: int = MAX_BLOCKS, lib: Any = None,
    ) -> None:
        if lib is None:
            from minisgl import _C as lib
        self._C = lib
        self.tp, self.device, self.max_bytes, self.max_blocks = tp, device, max_bytes, max_blocks
        self.buffer_bytes = -(-max_bytes // 16) * 16
        self._codes = {torch.float16: lib.NCCL_FLOAT16, torch.float32: lib.NCCL_FLOAT32,
                       torch.bfloat16: lib.NCCL_BFLOAT16}
        self.bases: tuple[int, ...] = ()  # every rank's region, in rank order
        self._own = 0
        self._opened: list[int] = []
        self._gather = gather
        self._live = False  # set up (or being set up) and not yet destroyed: destroy() is collective
        if tp.size == 1:
            return
        if max_bytes <= 0 or not 1 <= max_blocks <= lib.CUSTOM_ALL_REDUCE_MAX_BLOCKS:
            raise ValueError(f"max_bytes must be > 0 and max_blocks in [1, {lib.CUSTOM_ALL_REDUCE_MAX_BLOCKS}]")
        if tp.size > lib.CUSTOM_ALL_REDUCE_MAX_WORLD:
            raise ValueError(f"the one-shot all-reduce takes at most {lib.CUSTOM_ALL_REDUCE_MAX_WORLD} ranks")
        self._ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self._live = True
        self._set_up(gather)

    def _set_up(self, gather: Gather) -> None:
        """Allocate, export, gather, open. A failure on any rank fails every rank alike (each
        step's errors are gathered), so no rank is left waiting on a peer that gave up."""
        handle, err = None, None
        try:
            self._own = self._C.custom_all_reduce_alloc(self._ordinal, self.buffer_bytes)
            handle = self._C.peer_memory_handle(self._ordinal, self._own)
        except RuntimeError as e:
            err = f"rank {self.tp.rank}: {e}"
        shared = gather((handle, err))
        errors = [e for _, e in shared if e]
        bases = []
        if not errors:
            try:
                for r, (h, _) in enumerate(shared):
                    if r == self.tp.rank:
                        bases.append(self._own)
                    else:
                        self._opened.append(self._C.peer_memory_open(self._ordinal, h))
                        bases.append(self._opened[-1])
            except RuntimeError as e:
                err = f"rank {self.tp.rank}: {e}"
            errors = [e for e in gather(err) if e]
        if errors:
            self.destroy()
            raise RuntimeError("one-shot all-reduce set-up failed: " + "; ".join(errors))
        self.bases = tuple(bases)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x goes through the one-shot path (the same answer on every rank)."""
        return bool(self.bases) and x.numel() * x.element_size() <= self.max_bytes

    def check(self, x: torch.Tensor) -> int:
        """x's dtype code, after checking that the one-shot path can take it."""
        if x.dtype not in self._codes:
            raise ValueError(f"the one-shot all-reduce takes float16, bfloat16 or float32, got {x.dtype}")
        if not x.is_contiguous() or x.device != self.device:
            raise ValueError(f"the one-shot all-reduce needs a contiguous tensor on {self.device}, got {x.device}")
        if x.numel() * x.element_size() > self.max_bytes:
            raise ValueError(f"message of {x.numel() * x.element_size()} bytes > the buffer's {self.max_bytes}")
        return self._codes[x.dtype]

    def launch(self, x: torch.Tensor, code: int, stream: int) -> None:
        """The kernel, in place on x, for a caller that has checked x (check())."""
        self._C.custom_all_reduce(self.bases, self.tp.rank, x.data_ptr(), x.data_ptr(), x.numel(), code,
                                  self.buffer_bytes, self.max_blocks, stream)

    def takes_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the fused all-reduce + add + RMSNorm kernel takes these (the same answer on
        every rank: shapes, dtypes and layouts are the same everywhere)."""
        hidden = x.shape[-1] if x.dim() == 2 else 0
        return (
            self.takes(x) and x.dtype in (torch.float16, torch.bfloat16) and hidden % 8 == 0
            and 0 < hidden <= self._C.CUSTOM_ALL_REDUCE_NORM_MAX_HIDDEN
            and residual.shape == x.shape and residual.dtype == x.dtype and weight.dtype == x.dtype
            and weight.shape == (hidden,) and all(t.is_contiguous() and t.device == self.device
                                                  and t.data_ptr() % 16 == 0 for t in (x, residual, weight))
        )

    def all_reduce_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rmsnorm(r), r), r = sum of x across ranks + residual, written into residual
        (kernel: csrc/all_reduce_norm.cuh), for a caller that has checked takes_rmsnorm()."""
        out = torch.empty_like(x)
        self._C.custom_all_reduce_rmsnorm(
            self.bases, self.tp.rank, x.data_ptr(), residual.data_ptr(), out.data_ptr(), weight.data_ptr(),
            x.shape[0], x.shape[1], self._codes[x.dtype], eps, self.buffer_bytes, self.max_blocks,
            current_stream(self.device),
        )
        return out, residual

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In-place sum across ranks; returns x."""
        if self.tp.size == 1:
            return x
        if not self.bases:
            raise RuntimeError("the one-shot all-reduce was destroyed")
        self.launch(x, self.check(x), current_stream(self.device))
        return x

    def destroy(self) -> None:
        """Unmaps the peers' regions and frees this rank's. Collective (every rank calls it, as
        NCCL's teardown): a region is freed only once every peer has unmapped it, since
        cudaFree of a region still mapped in another process is undefined."""
        if not self._live:
            return
        self._live = False
        self.bases = ()
        torch.cuda.synchronize(self.device)  # this rank's last kernel has finished with every region
        for p in self._opened:
            self._C.peer_memory_close(self._ordinal, p)
        self._opened = []
        try:
            self._gather(None)  # every rank has unmapped this rank's region
        except RuntimeError as e:  # a peer is gone: keep the region (the process is ending anyway)
            log.warning("one-shot all-reduce teardown: the ranks did not meet (%s); region not freed", e)
            return
        if self._own:
            self._C.custom_all_reduce_free(self._ordinal, self._own)
            self._own = 0


def set_up_custom_all_reduce(
    tp: TPInfo, device: torch.device, gather: Gather, enabled: bool, local: LocalGpus, lib: Any = None
) -> CustomAllReduce | None:
    """The one-shot all-reduce for this TP group, or None where it cannot or should not run;
    rank 0 says which, once. Collective: every rank reaches the same answer."""
    if tp.size == 1:
        return None
    if lib is None:
        from minisgl import _C as lib
    max_bytes = max_bytes_for(tp.size)
    why = None
    if not enabled:
        why = "disabled (--disable-custom-all-reduce)"
    elif max_bytes <= 0:
        why = f"no size threshold for TP {tp.size} (or MINISGL_CUSTOM_ALL_REDUCE_MAX_BYTES=0)"
    elif not getattr(lib, "has_cuda", False):
        why = "minisgl._C was built without CUDA"
    elif tp.size > lib.CUSTOM_ALL_REDUCE_MAX_WORLD:
        why = f"TP {tp.size} > {lib.CUSTOM_ALL_REDUCE_MAX_WORLD} ranks"
    me = local.uuids[device.index if device.index is not None else torch.cuda.current_device()]
    everyone = gather((local.host, me, why))
    why = next((w for _, _, w in everyone if w), None)
    if why is None:
        why = peer_access_problem([h for h, _, _ in everyone], [u for _, u, _ in everyone], tp.rank, local)
        why = next((w for w in gather(why) if w), None)
    if why is not None:
        if tp.rank == 0:
            log.info("one-shot all-reduce off: %s; every all-reduce goes through NCCL", why)
        return None
    try:
        custom = CustomAllReduce(tp, device, gather, max_bytes, lib=lib)
    except RuntimeError as e:
        if tp.rank == 0:
            log.warning("%s; every all-reduce goes through NCCL", e)
        return None
    if tp.rank == 0:
        log.info("one-shot all-reduce over peer memory for messages <= %d KB (TP %d), NCCL above",
                 max_bytes >> 10, tp.size)
    return custom


def make_custom_all_reduce(
    tp: TPInfo, device: torch.device, cpu_group: object, enabled: bool = True
) -> CustomAllReduce | None:
    """set_up_custom_all_reduce over the host (gloo) group, with this machine's GPUs."""

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * tp.size
        dist.all_gather_object(out, obj, group=cpu_group)
        return out

    return set_up_custom_all_reduce(tp, device, gather, enabled, LocalGpus.probe())

