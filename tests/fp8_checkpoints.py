"""Writers of FP8 checkpoints in the real on-disk formats, from a 16-bit/fp32 HF folder, and of
the same weights dequantized to fp32 as a plain HF folder (the transformers reference).

Formats (as the published checkpoints have them; see minisgl/core/quant_config.py):
- "block": quant_method fp8, weight_block_size [128, 128], `weight_scale_inv` per block;
- "tensor": quant_method fp8 (static activations), scalar `weight_scale` and `input_scale`,
  plus per-layer `self_attn.k_scale` / `v_scale`;
- "channel": compressed-tensors FP8-dynamic, `weight_scale` [N, 1], `ignore` list.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from minisgl.ops.gemm.fp8 import FP8_MAX, MIN_SCALE, dequantize, expand_block_scale, quantize_blocks, quantize_rows

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax() / FP8_MAX).clamp_min(MIN_SCALE)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quant_config(fmt: str, ignore: list[str]) -> dict[str, Any]:
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ignore}
    if fmt == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ignore}
    scheme = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
                    "observer": "minmax", "group_size": None, "block_structure": None},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True, "observer": None},
        "output_activations": None,
    }
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": ignore, "kv_cache_scheme": None}


def write_fp8(src: Path, out: Path, fmt: str, ignored: tuple[str, ...] = (), ignore: list[str] | None = None,
              ) -> Path:
    """`src` quantized to `fmt` in `out`; modules whose name contains one of `ignored` stay as
    they are (listed in the config's ignore field as `ignore`)."""
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not is_linear(name) or any(i in name for i in ignored):
            written[name] = t
            continue
        base = name.removesuffix(".weight")
        if fmt == "block":
            written[name], written[f"{base}.weight_scale_inv"] = quantize_blocks(t)
        elif fmt == "tensor":
            written[name], written[f"{base}.weight_scale"] = quantize_tensor(t)
            written[f"{base}.input_scale"] = torch.tensor(0.05)
        else:
            written[name], written[f"{base}.weight_scale"] = quantize_rows(t)
    if fmt == "tensor":
        for name in list(written):
            if name.endswith("self_attn.q_proj.weight"):
                layer = name.removesuffix(".q_proj.weight")
                written[f"{layer}.k_scale"] = torch.tensor(1.0)
                written[f"{layer}.v_scale"] = torch.tensor(1.0)
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quant_config(fmt, list(ignore or ()))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def dequantize_tensor(name: str, t: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    n, k = t.shape
    if fmt == "block":
        return dequantize(t, expand_block_scale(scale.float(), n), 128)
    return dequantize(t, scale.float().reshape(-1, 1).expand(n, 1), k)


def write_dequantized(fp8: Path, out: Path, fmt: str) -> Path:
    """The FP8 folder's weights dequantized to fp32, without a quantization_config."""
    shutil.copytree(fp8, out)
    tensors = load_file(str(fp8 / "model.safetensors"))
    scale_suffix = ".weight_scale_inv" if fmt == "block" else ".weight_scale"
    written = {}
    for name, t in tensors.items():
        if name.endswith((scale_suffix, ".input_scale", ".k_scale", ".v_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[name.removesuffix(".weight") + scale_suffix]
            written[name] = dequantize_tensor(name, t, scale, fmt)
        else:
            written[name] = t
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_online_reference(src: Path, out: Path) -> Path:
    """What `--quantization fp8` computes (per-channel e4m3), dequantized to fp32, as a plain folder."""
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    written = {}
    for name, t in tensors.items():
        if is_linear(name):
            q, s = quantize_rows(t)
            t = dequantize(q, s, t.size(1))
        written[name] = t
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
