"""Deterministic (batch-invariant) mode: which devices run it, and its GEMM.

An engine built with `deterministic=True` switches its device into this mode (and out again at
shutdown); `ops.linear` then sends every GEMM through `batch_invariant_linear` instead of the
M-dependent skinny / cuBLAS choice. The other ops need no switch: RMSNorm, RoPE, SiLU-and-mul,
the embedding and the sampler are per row on every path (one program per row, or elementwise),
and attention's mode lives in the attention backend (minisgl/attention/). What torch reduces
over a row (the log-normalizer of the logprob features) goes through `logsumexp_rows`.

Per device, not per call: the layers stay free of the flag, and a CUDA graph captured in the
mode records the mode's kernels. Two engines on one device share it (the last one set wins).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.ops.activation import silu_and_mul

_devices: set[str] = set()


def _key(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def set_deterministic(device: torch.device, on: bool) -> None:
    (_devices.add if on else _devices.discard)(_key(device))


def is_deterministic(device: torch.device) -> bool:
    return bool(_devices) and _key(device) in _devices


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool
) -> torch.Tensor:
    """ops.linear's contract, each output row a function of its input row alone (bitwise).
    GPU: kernels/batch_invariant_gemm.py (one fixed reduction order for every M, tiles from its
    measured table; for 16-bit weights, where that table names it (a few rows, at most 32),
    ops/gemm/dispatch.py runs the skinny kernel in the same order instead). CPU: one
    M = 1 call per row: the CPU BLAS takes a different path at M = 1 than at M > 1 (measured:
    rows of a batch differ in the last bits from the same row alone), and M = 1 is the one
    shape every batch can use."""
    if x.device.type == "cuda":
        from minisgl.kernels.batch_invariant_gemm import gemm

        if x.dim() != 2 or x.stride(1) != 1 or weight.stride(1) != 1:
            raise ValueError(f"deterministic linear needs 2-D inputs packed in K, got x {tuple(x.shape)} "
                             f"strides {x.stride()}, weight strides {weight.stride()}")
        y = gemm(x, weight, bias)
    else:
        y = torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])]) if x.shape[0] else (
            F.linear(x, weight, bias))
    return silu_and_mul(y) if silu else y


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, V] -> logsumexp of each row, [n]. In deterministic mode each row is reduced alone,
    as a fresh [1, V] tensor: torch's reduction splits a row over more blocks when fewer rows
    share the launch (and vectorizes by the row's alignment), so a row's bits would depend on
    n. Used only by the logprob features (top / prompt logprobs, penalized rows' logprobs)."""
    if not is_deterministic(x.device) or x.shape[0] == 0:
        return x.logsumexp(dim=-1)
    return torch.cat([x[i : i + 1].clone().logsumexp(dim=-1) for i in range(x.shape[0])])
