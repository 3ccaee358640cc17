"""The 4-bit weight layouts every 4-bit kernel reads, and their torch references (fp32).

Each checkpoint format (AutoAWQ, GPTQ v1/v2, compressed-tensors pack-quantized, GPT-OSS MXFP4)
is repacked once at load into one of two layouts, so kernels know two layouts, not five:

- INT4 (AWQ, GPTQ, W4A16): `qweight` int32 [N, K // 8], column k's unsigned value q (0..15) in
  nibble NIBBLE_OF[k % 8] of word [n, k // 8] (K-contiguous, like a 16-bit weight's rows: a
  16-byte load is 32 consecutive K values of one row). Columns 2j and 2j + 1 of a word sit in
  nibbles j and j + 4, so one shift and one mask by 0x000F000F put both in a 16-bit pair in K
  order, the order of x's pairs (csrc/skinny_w4.cuh Int4W); `scales` and `zeros`
  [N, K // group] in the activation dtype: w[n, k] = (q - zeros[n, k // group]) * scales[n, k // group]
  (symmetric formats: zeros = 8). group divides K (per-channel: group = K). GPTQ's act-order
  (g_idx) is undone at load by permuting K (the layer permutes x's columns the same way).
- MXFP4 (OCP microscaling): `blocks` uint8 [N, K // 2], byte j holding e2m1 values of columns
  2j (low nibble) and 2j + 1 (high nibble); `scales` uint8 [N, K // 32], e8m0 exponents:
  w[n, k] = e2m1(nibble) * 2 ** (scales[n, k // 32] - 127).

Expert weights stack these on a leading [E] dimension.
"""

from __future__ import annotations

import functools
import math

import torch

# e2m1: sign, 2 exponent bits, 1 mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# The INT4 layout's nibble of column k % 8 (module docstring): 2j -> j, 2j + 1 -> j + 4.
NIBBLE_OF = (0, 4, 1, 5, 2, 6, 3, 7)
_SEQUENTIAL = tuple(range(8))


def unpack_nibbles(words: torch.Tensor, order: tuple[int, ...] = _SEQUENTIAL) -> torch.Tensor:
    """int32 [..., C] -> int64 [..., 8 C] values 0..15: value i of word c is its nibble order[i]
    (default: lowest first, as checkpoints pack them)."""
    shifts = 4 * torch.tensor(order, device=words.device)
    q = (words.to(torch.int64)[..., None] >> shifts) & 0xF
    return q.reshape(*words.shape[:-1], words.shape[-1] * 8)


def pack_nibbles(q: torch.Tensor, order: tuple[int, ...] = _SEQUENTIAL) -> torch.Tensor:
    """int [..., 8 C] values 0..15 -> int32 [..., C]: the inverse of unpack_nibbles."""
    if q.shape[-1] % 8:
        raise ValueError(f"int4 packing needs K divisible by 8, got {q.shape[-1]}")
    q = q.to(torch.int64).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    shifts = 4 * torch.tensor(order, device=q.device)
    word = (q << shifts).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The INT4 layout's int32 [..., K // 8] -> int64 [..., K] values 0..15."""
    return unpack_nibbles(qweight, NIBBLE_OF)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [..., K] values 0..15 -> the INT4 layout's int32 [..., K // 8]: the inverse of unpack_int4."""
    return pack_nibbles(q, NIBBLE_OF)


def dequant_int4_reference(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """fp32 [..., N, K] from the INT4 layout; the group size is K // scales.shape[-1]."""
    q = unpack_int4(qweight).float()
    group = q.shape[-1] // scales.shape[-1]
    s = scales.float().repeat_interleave(group, dim=-1)
    z = zeros.float().repeat_interleave(group, dim=-1)
    return (q - z) * s


def dequant_mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., N, K] from the MXFP4 layout (blocks uint8 [..., N, K // 2], scales uint8 [..., N, K // 32])."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    vals = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    exp = _e8m0_values(blocks.device)[scales.to(torch.int64)].repeat_interleave(32, dim=-1)
    return vals * exp


@functools.cache
def _e8m0_values(device: torch.device) -> torch.Tensor:
    """fp32 2^(e - 127) for every e8m0 byte, exact: built by math.ldexp (e 0 the subnormal 2^-127, 255
    +inf as fp32's rounding of 2^128, so 0 x it is NaN). torch.exp2 on CUDA was one ulp (2^-149) off
    at e 0 on an H200 (the bit-exact Triton loader's test showed 6 x 2^-127 off by 6 x 2^-149).
    Cached per device: the CPU model tests dequantise every MoE call."""
    return torch.tensor([math.ldexp(1.0, e - 127) for e in range(256)], dtype=torch.float32, device=device)
