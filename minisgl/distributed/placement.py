"""Where replicas run. GPUs: replica r's TP rank t on GPU base_gpu_id + r * tp + t
(ServerArgs.gpu_id, EngineConfig.base_gpu_id). CPU: replicas share the cores instead of each
starting a thread per core: N busy engines with a full thread pool each oversubscribe the
machine, and their spinning worker threads slow every one of them down (measured: a 64-request
burst on a 2-core box took 5x the CPU time with 2 threads per engine as with 1)."""

from __future__ import annotations

import os

import torch

from minisgl.logging_setup import get_logger


def cpu_threads(num_engines: int) -> int:
    """Intra-op threads for each of `num_engines` engines sharing this process's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // num_engines)


def share_cpu(device: str, num_engines: int) -> None:
    """On the CPU with several engines, gives this one its share of the cores."""
    if num_engines > 1 and torch.device(device).type == "cpu":
        n = cpu_threads(num_engines)
        torch.set_num_threads(n)
        get_logger("minisgl.dp").info("CPU: %d engines share the cores, %d threads each", num_engines, n)
