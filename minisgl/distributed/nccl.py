"""Our NCCL communicator: minisgl._C's run-time-loaded NCCL bindings, on torch's current
stream, safe inside CUDA-graph capture (NCCL kernels are captured like any other). Small
all-reduces take the one-shot path over peer memory where the GPUs allow it
(custom_all_reduce.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist

from minisgl import env
from minisgl.distributed.custom_all_reduce import CustomAllReduce, current_stream, make_custom_all_reduce
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.logging_setup import get_logger

log = get_logger("minisgl.distributed")


def find_libnccl() -> str:
    """The libnccl torch uses: MINISGL_NCCL_LIBRARY, else the nvidia-nccl-cu12/cu13 package's,
    else "" (the dynamic loader's search path)."""
    if env.NCCL_LIBRARY:
        return env.NCCL_LIBRARY
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            for lib in sorted(Path(folder, "lib").glob("libnccl.so*")):
                return str(lib)
    return ""


class NcclCommunicator(Communicator):
    def __init__(self, tp: TPInfo, device: torch.device, cpu_group: object, custom_all_reduce: bool = True) -> None:
        super().__init__(tp)
        from minisgl import _C

        self._C = _C
        # NCCL's dtype values, from the one place that declares them (csrc/nccl.h).
        self._codes = {torch.float16: _C.NCCL_FLOAT16, torch.float32: _C.NCCL_FLOAT32, torch.bfloat16: _C.NCCL_BFLOAT16}
        _C.nccl_load(find_libnccl())
        box = [_C.nccl_unique_id() if tp.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=cpu_group)  # rendezvous over gloo
        self.device = device
        with torch.cuda.device(device):
            self.comm = _C.nccl_comm_init_rank(tp.size, box[0], tp.rank)
        if tp.rank == 0:
            log.info("NCCL %s communicator over %d ranks (minisgl._C bindings)", _C.nccl_version(), tp.size)
        # Registered now, before any CUDA graph is captured.
        self.custom: CustomAllReduce | None = make_custom_all_reduce(tp, device, cpu_group, custom_all_reduce)

    def _code(self, x: torch.Tensor) -> int:
        if x.dtype not in self._codes:
            raise ValueError(f"NCCL collectives take float16, bfloat16 or float32, got {x.dtype}")
        if not x.is_contiguous() or x.device != self.device:
            raise ValueError(f"NCCL collectives need a contiguous tensor on {self.device}")
        return self._codes[x.dtype]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In-place sum across ranks; returns x. Messages the one-shot path takes go there (the
        decision depends on the size only, so every rank decides alike)."""
        if self.tp.size > 1:
            code, stream = self._code(x), current_stream(self.device)
            if self.custom is not None and self.custom.takes(x):
                self.custom.launch(x, code, stream)
            else:
                self._C.nccl_all_reduce(self.comm, x.data_ptr(), x.data_ptr(), x.numel(), code, stream)
        return x

    def all_reduce_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The one-shot all-reduce fused with the residual add and RMSNorm, where it takes x."""
        if self.tp.size > 1 and self.custom is not None and self.custom.takes_rmsnorm(x, residual, weight):
            return self.custom.all_reduce_rmsnorm(x, residual, weight, eps)
        return None

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation of every rank's x along `dim`."""
        if self.tp.size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.tp.size, *x.shape), dtype=x.dtype, device=x.device)
        stream = current_stream(self.device)
        self._C.nccl_all_gather(self.comm, x.data_ptr(), out.data_ptr(), x.numel(), self._code(x), stream)
        dim = dim % x.dim()
        # [tp, d0, ..., dn] -> rank blocks side by side along `dim`
        return torch.cat(out.unbind(0), dim=dim) if dim != 0 else out.reshape(-1, *x.shape[1:])

    def destroy(self) -> None:
        if self.custom is not None:
            self.custom.destroy()
            self.custom = None
        if self.comm:
            self._C.nccl_comm_destroy(self.comm)
            self.comm = 0
