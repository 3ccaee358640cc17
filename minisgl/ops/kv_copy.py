"""Batched copy of scattered KV slots between two pools, possibly on different devices.

`src_k/src_v` and `dst_k/dst_v` are `[layers, slots, heads, dim]`. One gather on the source
device (index_select over all layers at once), one transfer, one scatter (index_copy_) on the
destination: three operations per tensor however scattered the slots, instead of one small
cudaMemcpyAsync per page (page size 1 today), which cannot reach PCIe speed. A device-to-host
copy is synchronous (the source slots are freed right after); a host-to-device copy goes
through pinned memory and is stream ordered before later work on the current stream.
Measured (H200, 2.4 GB of scattered bf16 KV): 1.1 GB/s down, 1.4 GB/s up, against 55 GB/s for
one pinned copy: the CPU-side gather/scatter dominates. Correct, not yet fast: the planned
replacement is a GPU kernel that reads and writes the pinned host pool directly (mapped memory).
"""

from __future__ import annotations

import torch


def copy_slots(src_k: torch.Tensor, src_v: torch.Tensor, src_slots: list[int],
               dst_k: torch.Tensor, dst_v: torch.Tensor, dst_slots: list[int]) -> None:
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"copy_slots: {len(src_slots)} source slots for {len(dst_slots)} destination slots")
    if not src_slots:
        return
    if src_k.shape[0] != dst_k.shape[0] or src_k.shape[2:] != dst_k.shape[2:] or src_k.dtype != dst_k.dtype:
        raise ValueError(f"copy_slots: pools differ: {tuple(src_k.shape)} {src_k.dtype} vs "
                         f"{tuple(dst_k.shape)} {dst_k.dtype}")
    si = torch.tensor(src_slots, dtype=torch.long).to(src_k.device, non_blocking=True)
    di = torch.tensor(dst_slots, dtype=torch.long).to(dst_k.device, non_blocking=True)
    to_gpu = dst_k.device.type == "cuda" and src_k.device.type == "cpu"
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        staged = src.index_select(1, si)
        if to_gpu:
            staged = staged.pin_memory()
        dst.index_copy_(1, di, staged.to(dst.device, non_blocking=to_gpu))
