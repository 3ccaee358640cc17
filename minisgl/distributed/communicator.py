"""Process-group setup and the torch.distributed communicator.

Every rank joins one gloo group (rendezvous at `dist_init_addr`, possibly across machines):
it carries host-side objects (the scheduler's input broadcast, our NCCL unique id) and the
CPU's collectives. GPU tensors go through our own NCCL communicator, or through a
torch.distributed NCCL group with `custom_nccl=False` (--disable-custom-nccl).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from minisgl.distributed.info import Communicator, TPInfo


class TorchDistCommunicator(Communicator):
    """All-reduce / all-gather through torch.distributed (gloo on CPU, NCCL on GPU)."""

    def __init__(self, tp: TPInfo, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(tp)
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.tp.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


def min_across_ranks(value: int, group: object) -> int:
    """The smallest of every rank's `value`, over the host (gloo) group."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def make_communicator(
    tp: TPInfo, device: torch.device, init_addr: str | None, custom_nccl: bool = True,
    custom_all_reduce: bool = True,
) -> tuple[Communicator, object]:
    """(communicator, host group). World size 1 needs no process group. custom_all_reduce: let
    our NCCL communicator send small all-reduces through the one-shot peer-memory path."""
    if tp.size == 1:
        return Communicator(tp), None
    if init_addr is None:
        raise ValueError("tensor parallelism needs dist_init_addr (HOST:PORT) for the rendezvous")
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://{init_addr}", world_size=tp.size, rank=tp.rank,
            timeout=datetime.timedelta(minutes=10),
        )
    cpu_group = dist.group.WORLD
    if device.type != "cuda":
        return TorchDistCommunicator(tp, cpu_group), cpu_group
    if custom_nccl:
        from minisgl.distributed.nccl import NcclCommunicator

        return NcclCommunicator(tp, device, cpu_group, custom_all_reduce), cpu_group
    return TorchDistCommunicator(tp, dist.new_group(backend="nccl")), cpu_group
