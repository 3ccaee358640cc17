"""Process-group setup and the torch.distributed communicator.

Every rank joins one torch.distributed group (rendezvous at `dist_init_addr`): gloo on the
CPU, NCCL on GPUs. A gloo group always exists beside it for host-side objects (the
scheduler's input broadcast, and the NCCL unique id of our own communicator).
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


def init_process_groups(tp: TPInfo, device: torch.device, init_addr: str) -> dist.ProcessGroup:
    """Joins the TP group; returns the gloo group for host objects."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{init_addr}", world_size=tp.size, rank=tp.rank,
            timeout=datetime.timedelta(minutes=10),
            **({"device_id": device} if device.type == "cuda" else {}),
        )
    return dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD


def make_communicator(tp: TPInfo, device: torch.device, init_addr: str | None) -> tuple[Communicator, object]:
    """(communicator, host group). World size 1 needs no process group."""
    if tp.size == 1:
        return Communicator(tp), None
    if init_addr is None:
        raise ValueError("tensor parallelism needs dist_init_addr (HOST:PORT) for the rendezvous")
    cpu_group = init_process_groups(tp, device, init_addr)
    return TorchDistCommunicator(tp), cpu_group
