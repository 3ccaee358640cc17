"""Copy of scattered KV slots between two pools: the GPU pool and the host KV tier's pool.

`src_k/src_v` and `dst_k/dst_v` are `[layers, slots, heads, dim]`; slot `src_slots[i]` of every
layer of K and V goes to `dst_slots[i]`. Work is enqueued on the current stream (the host tier
picks its copy stream); nothing here synchronises the host.

Paths, picked per call and logged once each with the reason:
- kernel (`csrc/kv_copy.cu`): one side a CUDA pool, the other a pool on the same GPU or in
  pinned host memory, same dtype and row shape, heads x dim contiguous. One launch moves every
  (tensor, layer, slot) row with 16-byte loads/stores, reading or writing the pinned host pool
  directly through its device address (UVA): no staging copy, no per-page cudaMemcpyAsync. The
  two slot lists travel to the GPU as one int32 [2, n] tensor, copied from a region of one pinned
  ring registered once (`_SlotRing`): a copy never allocates page-locked memory, because a fresh
  page-locked allocation (torch's pinned caching allocator, when its cache has no free block) is
  an implicit device synchronisation: the host would wait for every queued step.
- torch: anything else (the CPU engine's second CPU tensor, pageable host memory, a build
  without CUDA kernels). One gather (index_select over all layers), one transfer, one scatter
  (index_copy_) per tensor, on byte views so any dtype (FP8 too) copies bit-exactly. Measured
  on an H200 with pinned host memory (Qwen3-8B KV shapes, 2.4 GB of scattered slots): 1.1 GB/s
  to the host, 1.4 GB/s back, against 55 GB/s for one pinned copy; the host-side gather and
  scatter dominate. On CUDA a device-to-host copy here also blocks the host.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from minisgl.kernels.device import num_sms
from minisgl.logging_setup import log_once
from minisgl.ops._backend import compiled, current_stream, use_cuda_kernel

# cudaHostRegister flags: portable (every context) | mapped (a device address, UVA).
_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in page-locked, device-mapped memory of exactly its size.

    Not `torch.empty(..., pin_memory=True)`: torch's caching host allocator rounds every block up
    to a power of two (a 40 GB tier would pin 64 GB) and keeps it cached after it is freed. This
    registers a plain allocation instead (cudaHostRegister through torch's own cudart binding).
    The bytes belong to a numpy array that the tensor's storage keeps alive, so the registration
    is undone (a finalizer on the array) only once no view of it is left, before numpy frees it."""
    esize = torch.empty((), dtype=dtype).element_size()
    nbytes = esize * int(np.prod(shape, dtype=np.int64))
    buf = np.empty(max(nbytes, esize) + 64, dtype=np.uint8)
    start = -buf.ctypes.data % 64  # the kernel's 16-byte accesses need an aligned base
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buf.ctypes.data, buf.nbytes, _HOST_REGISTER_PORTABLE_MAPPED)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB of host memory failed ({err}): "
                           "lower --host-kv-cache-gb or raise the locked-memory limit (ulimit -l)")
    weakref.finalize(buf, cudart.cudaHostUnregister, buf.ctypes.data)
    return torch.from_numpy(buf)[start : start + nbytes].view(dtype).view(shape)


def copy_slots(src_k: torch.Tensor, src_v: torch.Tensor, src_slots: Sequence[int],
               dst_k: torch.Tensor, dst_v: torch.Tensor, dst_slots: Sequence[int],
               chunks: Sequence[tuple[int, int]] | None = None,
               after_chunk: Callable[[int], None] | None = None) -> None:
    """`chunks`: copy the layers [a, b) of each chunk in turn, calling `after_chunk(i)` after
    chunk i is enqueued (the host tier records chunk i's event there; no call without slots); the slot lists are
    staged once for all chunks. Default: all layers at once."""
    n = len(src_slots)
    if n != len(dst_slots):
        raise ValueError(f"copy_slots: {n} source slots for {len(dst_slots)} destination slots")
    for name, a, b in (("src_v", src_v, src_k), ("dst_k", dst_k, src_k), ("dst_v", dst_v, src_k)):
        if a.dim() != 4 or a.dtype != b.dtype or a.shape[0] != b.shape[0] or a.shape[2:] != b.shape[2:]:
            raise ValueError(f"copy_slots: {name} {tuple(a.shape)} {a.dtype} does not match src_k "
                             f"{tuple(b.shape)} {b.dtype} (layers, heads, dim and dtype must agree)")
    if src_k.shape != src_v.shape or dst_k.shape != dst_v.shape:
        raise ValueError("copy_slots: K and V of a pool must have the same shape")
    chunks = [(0, src_k.shape[0])] if chunks is None else list(chunks)
    if any(not 0 <= a < b <= src_k.shape[0] for a, b in chunks):
        raise ValueError(f"copy_slots: layer chunks {chunks} must be non-empty ranges within {src_k.shape[0]} layers")
    if not n:
        return
    idx = np.empty((2, n), dtype=np.int64)
    idx[0], idx[1] = src_slots, dst_slots
    # A bad slot would be a wild write into the other pool (host memory for the kernel).
    for row, pool, name in ((0, src_k, "source"), (1, dst_k, "destination")):
        lo, hi = int(idx[row].min()), int(idx[row].max())
        if lo < 0 or hi >= pool.shape[1]:
            raise ValueError(f"copy_slots: {name} slots span [{lo}, {hi}], the pool has {pool.shape[1]}")
    path, why = _pick(src_k, src_v, dst_k, dst_v)
    log_once(f"kv_copy:{path}:{why}", f"KV copy between the GPU pool and the host tier: {path} path ({why})",
             logging.INFO)
    dev_idx = _upload(idx, src_k, dst_k) if path == "kernel" else None
    for i, (a, b) in enumerate(chunks):
        sk, sv, dk, dv = src_k[a:b], src_v[a:b], dst_k[a:b], dst_v[a:b]
        if dev_idx is not None:
            _kernel_copy(sk, sv, dk, dv, dev_idx)
        else:
            _torch_copy(sk, sv, dk, dv, idx)
        if after_chunk is not None:
            after_chunk(i)


def _pick(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor) -> tuple[str, str]:
    """("kernel" | "torch", why)."""
    tensors = (src_k, src_v, dst_k, dst_v)
    gpus = {t.device for t in tensors if t.device.type == "cuda"}
    if not gpus:
        return "torch", "both pools on the CPU"
    if len(gpus) > 1:
        return "torch", f"pools on several GPUs {sorted(map(str, gpus))}"
    if any(t.device.type not in ("cuda", "cpu") for t in tensors):
        return "torch", "a pool on neither CUDA nor the CPU"
    if any(t.device.type == "cpu" and not t.is_pinned() for t in tensors):
        return "torch", "the host pool is pageable, not pinned: a kernel cannot reach it"
    if any(t.stride(3) != 1 or t.stride(2) != t.shape[3] for t in tensors):
        return "torch", "a pool whose heads x dim rows are not contiguous"
    if max(src_k.shape[1], dst_k.shape[1]) >= 2**31:
        return "torch", "a pool of 2^31 slots or more (the kernel's slot lists are int32)"
    if src_k.stride() != src_v.stride() or dst_k.stride() != dst_v.stride():
        return "torch", "K and V of a pool with different strides"
    if not use_cuda_kernel("kv_copy_slots", next(t for t in tensors if t.device.type == "cuda")):
        return "torch", "minisgl._C has no CUDA kernels (or MINISGL_DISABLE_KERNELS)"
    return "kernel", "CUDA gather/scatter through the pinned host pool's device address"


def _device_address(t: torch.Tensor) -> int:
    return compiled().host_device_pointer(t.data_ptr()) if t.device.type == "cpu" else t.data_ptr()


class _Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class _SlotRing:
    """Pinned int32 staging for the slot lists, reused in a ring: `take` hands out the next free
    region, `release` marks it in use until `event` (recorded after the copy that reads it) has
    run. A region still in flight when the ring comes round again is waited for (logged once:
    the ring is too small for the copies in flight); a request larger than the ring gets None."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.head = 0
        self.inflight: deque[tuple[int, int, _Event]] = deque()

    def take(self, count: int) -> tuple[torch.Tensor, int, int] | None:
        cap = self.buf.numel()
        if count > cap:
            return None
        start = self.head if self.head + count <= cap else 0
        end = start + count
        for s, e, event in self.inflight:
            if s < end and start < e and not event.query():
                log_once("kv_copy:ring", f"KV copy: the {cap}-slot pinned ring is full of copies in flight; "
                         "the host waits for the oldest", logging.WARNING)
                event.synchronize()
        self.inflight = deque(x for x in self.inflight if not x[2].query())
        self.head = end
        return self.buf[start:end], start, end

    def release(self, start: int, end: int, event: _Event) -> None:
        self.inflight.append((start, end, event))


SLOT_RING_INTS = 1 << 21  # 8 MiB: a million (source, destination) pairs in flight


@functools.cache
def _slot_ring() -> _SlotRing:
    return _SlotRing(pinned_empty((SLOT_RING_INTS,), torch.int32))


def prepare_kernel_copies() -> None:
    """Registers the slot ring now (the host tier's construction), not in the first copy: pinning
    memory may wait for the GPU."""
    _slot_ring()


def _upload(idx: np.ndarray, src_k: torch.Tensor, dst_k: torch.Tensor) -> torch.Tensor:
    """The int32 [2, n] slot lists on the GPU, through a region of the pinned ring."""
    gpu = next(t.device for t in (src_k, dst_k) if t.device.type == "cuda")
    n = idx.shape[1]
    ring = _slot_ring()
    region = ring.take(2 * n)
    # More slots than the ring holds: a one-off block of torch's pinned allocator (it may wait).
    staged = torch.empty((2, n), dtype=torch.int32, pin_memory=True) if region is None else region[0].view(2, n)
    staged.numpy()[:] = idx
    # Pinned -> device on the current stream; the ring region is free again once this copy ran.
    dev_idx = staged.to(gpu, non_blocking=True)
    if region is not None:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(gpu))
        ring.release(region[1], region[2], done)
    return dev_idx


def _kernel_copy(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                 dev_idx: torch.Tensor) -> None:
    gpu = dev_idx.device
    n = dev_idx.shape[1]
    es = src_k.element_size()
    compiled().kv_copy_slots(
        _device_address(src_k), _device_address(src_v), _device_address(dst_k), _device_address(dst_v),
        dev_idx[0].data_ptr(), dev_idx[1].data_ptr(), n, src_k.shape[0], src_k.shape[2] * src_k.shape[3] * es,
        src_k.stride(0) * es, src_k.stride(1) * es, dst_k.stride(0) * es, dst_k.stride(1) * es,
        num_sms(gpu.index if gpu.index is not None else torch.cuda.current_device()), current_stream(gpu),
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # [layers, slots, heads, dim * element size]: bit-exact for any dtype


def _torch_copy(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                idx: np.ndarray) -> None:
    si = torch.from_numpy(idx[0]).to(src_k.device, non_blocking=True)
    di = torch.from_numpy(idx[1]).to(dst_k.device, non_blocking=True)
    to_gpu = dst_k.device.type == "cuda" and src_k.device.type == "cpu"
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        staged = _bytes(src).index_select(1, si)
        if to_gpu:
            staged = staged.pin_memory()
        _bytes(dst).index_copy_(1, di, staged.to(dst.device, non_blocking=to_gpu))
