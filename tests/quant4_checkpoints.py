"""A reference 4-bit quantiser and writers of 4-bit checkpoints in the real on-disk formats, from a
16/32-bit HF folder, and of the same weights dequantized to fp32 as a plain HF folder (the
transformers reference). Written from the formats' descriptions, independently of minisgl's
loaders (minisgl/core/quant_config.py lists the same facts):

- AutoAWQ gemm: qweight int32 [K, N/8], nibble i of a word = column 8c + [0,2,4,6,1,3,5,7][i];
  qzeros int32 [K/G, N/8] packed the same way; scales [K/G, N]; W = (q - z) s.
- GPTQ: qweight int32 [K/8, N], nibble j = row 8r + j; qzeros int32 [K/G, N/8], nibble j =
  column 8c + j, v1 storing z - 1, v2 z; scales [K/G, N]; g_idx [K] (act-order: a permutation's
  runs of G rows share a group).
- compressed-tensors pack-quantized: weight_packed int32 [N, K/8], nibble j = column 8c + j,
  value q_signed + 8; weight_scale [N, K/G]; weight_zero_point int32 [ceil(N/8), K/G] packed
  along N (value zp_signed + 8); weight_shape [N, K].
Round-to-nearest, scales stored in fp16 (as the real checkpoints do), so the dequantized
reference uses exactly the stored values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR


def rtn(w: torch.Tensor, group: int, sym: bool, zmin: int = 0):
    """w [N, K] -> (q [N, K] 0..15, scales fp16 [N, K/G], zeros int [N, K/G], dequantized fp32 [N, K])."""
    n, k = w.shape
    g = group if group > 0 else k
    wg = w.float().reshape(n, k // g, g)
    if sym:
        s = (wg.abs().amax(-1) / 7.0).clamp_min(1e-6).half()
        z = torch.full_like(s, 8, dtype=torch.int64)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15.0).clamp_min(1e-6).half()
        z = (-lo / s.float()).round().clamp(zmin, 15).to(torch.int64)
    q = (wg / s.float()[..., None]).round().to(torch.int64) + z[..., None]
    q = q.clamp(0, 15)
    deq = (q - z[..., None]).float() * s.float()[..., None]
    return q.reshape(n, k), s, z, deq.reshape(n, k)


def _word(nibbles: torch.Tensor) -> torch.Tensor:
    """int64 [..., 8] -> int32 [...]: nibble j at bits 4j."""
    v = (nibbles << (4 * torch.arange(8))).sum(-1)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_cols(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, C] -> [R, C/8]: word c's nibble i = column 8c + order[i]."""
    r, c = q.shape
    return _word(q.reshape(r, c // 8, 8)[..., list(order)])


def quant_config(fmt: str, group: int, sym: bool, desc_act: bool, ignore: list[str]) -> dict[str, Any]:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": ignore}
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": fmt, "modules_to_not_convert": ignore}
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False, "actorder": None,
               "strategy": "group" if group > 0 else "channel", "group_size": group if group > 0 else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head", *ignore]}


def _module(fmt: str, w: torch.Tensor, group: int, sym: bool, perm: torch.Tensor | None):
    """(checkpoint tensors by suffix, dequantized fp32 weight) of one [N, K] weight."""
    n, k = w.shape
    if perm is not None:  # act-order: quantize in the permuted order, groups of G permuted rows
        q, s, z, deq = rtn(w[:, perm], group, sym, zmin=1)
        inv = torch.argsort(perm)
        q, deq = q[:, inv], deq[:, inv]
        g_idx = (torch.arange(k) // group)[inv]
    else:
        q, s, z, deq = rtn(w, group, sym, zmin=1 if fmt == "gptq" else 0)
        g_idx = torch.arange(k) // (group if group > 0 else k)
    if fmt == "awq":
        out = {"qweight": pack_cols(q.t().contiguous(), AWQ_ORDER), "qzeros": pack_cols(z.t().contiguous(), AWQ_ORDER),
               "scales": s.t().contiguous()}
    elif fmt in ("gptq", "gptq_v2"):
        stored_z = z - 1 if fmt == "gptq" else z
        out = {"qweight": pack_cols(q.contiguous()).t().contiguous(),  # K-packed: the rows of [K/8, N]
               "qzeros": pack_cols(stored_z.t().contiguous()), "scales": s.t().contiguous(),
               "g_idx": g_idx.to(torch.int32)}
    else:
        out = {"weight_packed": pack_cols(q), "weight_scale": s, "weight_shape": torch.tensor([n, k])}
        if not sym:
            zp = torch.zeros(-(-n // 8) * 8, z.size(1), dtype=torch.int64)
            zp[:n] = z
            out["weight_zero_point"] = pack_cols(zp.t().contiguous()).t().contiguous()
    return out, deq


def write_quant4(src: Path, out: Path, deq_out: Path, fmt: str, group: int, sym: bool = True,
                 desc_act: bool = False, ignored: tuple[str, ...] = (), ignore: list[str] | None = None,
                 seed: int = 0) -> tuple[Path, Path]:
    """`src` quantized to `fmt` in `out`, and its dequantized fp32 weights as a plain folder in
    `deq_out`; modules whose name contains one of `ignored` stay as they are (listed as `ignore`)."""
    shutil.copytree(src, out)
    shutil.copytree(src, deq_out)
    tensors = load_file(str(src / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    perms: dict[int, torch.Tensor] = {}  # one act-order per K: modules sharing their input share it
    for name, t in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # stacked experts [E, N, K]
            projs = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            halves = [w.chunk(len(projs)) for w in t]
            deq_e = []
            for e, ws in enumerate(halves):
                for proj, w in zip(projs, ws, strict=True):
                    parts, d = _module(fmt, w, group, sym, None)
                    deq_e.append(d)
                    base = f"{name.rpartition('.')[0]}.{e}.{proj}"
                    written.update({f"{base}.{kind}": v for kind, v in parts.items()})
            deq[name] = torch.cat(deq_e).reshape(t.shape)
            continue
        if not is_linear(name) or any(i in name for i in ignored):
            written[name] = deq[name] = t
            continue
        k = t.size(1)
        perm = perms.setdefault(k, torch.randperm(k, generator=gen)) if desc_act else None
        parts, deq[name] = _module(fmt, t, group, sym, perm)
        base = name.removesuffix(".weight")
        written.update({f"{base}.{kind}": v for kind, v in parts.items()})
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, str(deq_out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quant_config(fmt, group, sym, desc_act, list(ignore or ()))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, deq_out


# OCP MX e2m1: code (sign << 3) | i holds +-E2M1[i].
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_rtn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K/32, 16] with element 2j in
    the low nibble of byte j, e8m0 scales uint8 [..., N, K/32], dequantized fp32 [..., N, K]).
    Each 32-block's exponent is the smallest e with max|w| / 2^e <= 6; values round to the nearest
    e2m1 magnitude."""
    *lead, n, k = w.shape
    wb = w.float().reshape(*lead, n, k // 32, 32)
    amax = wb.abs().amax(-1).clamp_min(2.0**-100)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-126, 127)
    v = wb / torch.exp2(e)[..., None]
    idx = (v.abs()[..., None] - E2M1).abs().argmin(-1)  # nearest magnitude
    code = idx + 8 * (v < 0).long()
    deq = torch.where(v < 0, -E2M1[idx], E2M1[idx]) * torch.exp2(e)[..., None]
    pairs = code.reshape(*lead, n, k // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (e + 127).to(torch.uint8), deq.reshape(*lead, n, k)


def write_gpt_oss_mxfp4(src: Path, out: Path, deq_out: Path) -> tuple[Path, Path]:
    """A GPT-OSS folder's experts as the MXFP4 checkpoints ship them (`*_blocks` / `*_scales` of
    gate_up_proj [E, H, 2I] and down_proj [E, I, H] taken as rows of their transposes, biases as
    they are, `quant_method: "mxfp4"`), and the dequantized experts as a plain folder."""
    shutil.copytree(src, out)
    shutil.copytree(src, deq_out)
    tensors = load_file(str(src / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales, d = mxfp4_rtn(t.transpose(1, 2))
            written[f"{name}_blocks"], written[f"{name}_scales"] = blocks, scales
            deq[name] = d.transpose(1, 2).contiguous()
        else:
            written[name] = deq[name] = t
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, str(deq_out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, deq_out
