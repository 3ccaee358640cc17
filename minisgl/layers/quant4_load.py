"""Loading 4-bit linear weights: each checkpoint format's tensors of one module -> the layouts of
kernels/quant4.py, once, at load (core/quant_config.py describes the formats' packings).

INT4 (AutoAWQ, GPTQ v1/v2, compressed-tensors pack-quantized) -> qweight int32 [N, K / 8]
(K-contiguous nibbles), scales and zeros [N, K / G] (float; symmetric formats: zeros 8), and for
GPTQ act-order a permutation of K (groups made contiguous; the layer permutes x the same way).
MXFP4 (GPT-OSS) -> blocks uint8 [..., N, K / 2], e8m0 scales uint8 [..., N, K / 32].
"""

from __future__ import annotations

import torch

from minisgl.core.quant_config import QuantConfig
from minisgl.kernels.quant4 import pack_int4, unpack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column 8c + AWQ_ORDER[i]
_AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(8))  # column j of a word is nibble _AWQ_UNDO[j]


def checkpoint_kinds(q: QuantConfig) -> tuple[str, ...]:
    """The tensor suffixes one quantized module has in the checkpoint."""
    if q.packing == "awq":
        return ("qweight", "qzeros", "scales")
    if q.packing in ("gptq", "gptq_v2"):
        return ("qweight", "qzeros", "scales", "g_idx")
    if q.packing == "pack-quantized":
        return ("weight_packed", "weight_scale", "weight_shape") + (() if q.sym else ("weight_zero_point",))
    raise ValueError(f"no 4-bit linear layers in a {q.method} checkpoint")


def _int(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if t.dtype != torch.int32:
        raise ValueError(f"tensor {name} has dtype {t.dtype}; a packed 4-bit tensor is int32")
    if tuple(t.shape) != shape:
        raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
    return t


def _float(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if not t.is_floating_point():
        raise ValueError(f"tensor {name} has dtype {t.dtype}; scales are float")
    if tuple(t.shape) != shape:
        raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
    return t.float()


def _groups(name: str, k: int, group: int) -> tuple[int, int]:
    g = group or k
    if k % 8 or k % g:
        raise ValueError(f"{name}: K {k} must be a multiple of 8 and of the group size {g}")
    return g, k // g


def to_int4(q: QuantConfig, t: dict[str, torch.Tensor], name: str, n: int, k: int):
    """(qweight [n, k / 8] int32, scales [n, k / G] fp32, zeros [n, k / G] fp32, perm int64 [k] or
    None) of the module `name` (its checkpoint tensors by suffix) of a [n, k] weight."""
    g, ng = _groups(name, k, q.group)
    if n % 8 and q.packing != "pack-quantized":
        raise ValueError(f"{name}: N {n} must be a multiple of 8 (the checkpoint packs 8 columns per word)")
    perm = None
    if q.packing == "awq":
        qw = unpack_nibbles(_int(f"{name}.qweight", t["qweight"], (k, n // 8)), _AWQ_UNDO).t()
        zeros = unpack_nibbles(_int(f"{name}.qzeros", t["qzeros"], (ng, n // 8)), _AWQ_UNDO).t().float()
        scales = _float(f"{name}.scales", t["scales"], (ng, n)).t()
    elif q.packing in ("gptq", "gptq_v2"):
        words = _int(f"{name}.qweight", t["qweight"], (k // 8, n))
        qw = unpack_nibbles(words.t().contiguous())  # [n, k]: nibble j of word r is row 8r + j
        zeros = unpack_nibbles(_int(f"{name}.qzeros", t["qzeros"], (ng, n // 8))).t().float()
        if q.packing == "gptq":
            zeros = zeros + 1  # v1 stores z - 1
        scales = _float(f"{name}.scales", t["scales"], (ng, n)).t()
        g_idx = t["g_idx"].to(torch.int64).reshape(-1)
        if g_idx.numel() != k:
            raise ValueError(f"tensor {name}.g_idx has {g_idx.numel()} entries, expected {k}")
        contiguous = torch.arange(k) // g
        if not torch.equal(g_idx, contiguous):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], contiguous):
                raise ValueError(f"tensor {name}.g_idx does not give every group {g} rows")
            qw = qw[:, perm]
    elif q.packing == "pack-quantized":
        shape = tuple(int(v) for v in t["weight_shape"].reshape(-1).tolist())
        if shape != (n, k):
            raise ValueError(f"tensor {name}.weight_shape is {shape}, expected {(n, k)}")
        qw = unpack_nibbles(_int(f"{name}.weight_packed", t["weight_packed"], (n, k // 8)))
        scales = _float(f"{name}.weight_scale", t["weight_scale"], (n, ng))
        if q.sym:
            zeros = torch.full((n, ng), 8.0)
        else:
            zp = _int(f"{name}.weight_zero_point", t["weight_zero_point"], (-(-n // 8), ng))
            zeros = unpack_nibbles(zp.t().contiguous()).t()[:n].float()  # packed along N
    else:
        raise ValueError(f"{name}: packing {q.packing!r} is not an INT4 format")
    return pack_int4(qw), scales.contiguous(), zeros.contiguous(), perm


def mxfp4_layout(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS `*_blocks` uint8 [..., N, K / 32, 16] and `*_scales` uint8 [..., N, K / 32] -> the
    MXFP4 layout (blocks [..., N, K / 2], scales as they are: the same nibble order and exponents)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                         "match ([..., N, K / 32, 16] and [..., N, K / 32])")
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * 16).contiguous(), scales.contiguous()
