"""QuantConfig: how a checkpoint's linear weights are quantized (config.json's
`quantization_config`), or that 16-bit weights are to be quantized on load (`--quantization fp8`).

Formats read (all FP8 e4m3, weight [N, K] next to its fp32 scale; dequantized W = w * scale):
- `quant_method: "fp8"` with `weight_block_size: [128, 128]` (Qwen3 / DeepSeek FP8 releases):
  `weight_scale_inv` [ceil(N/128), ceil(K/128)], one scale per 128 x 128 block (multiplied,
  despite the name). Not converted: `modules_to_not_convert` / `ignored_layers`.
- `quant_method: "fp8"` without a block size: per-tensor `weight_scale` (one value), optional
  static `input_scale` (activation_scheme "static").
- `quant_method: "compressed-tensors"` (llm-compressor), one FP8 scheme targeting Linear:
  `weight_scale` per channel [N, 1], per tensor [1] or per block [ceil(N/128), ceil(K/128)];
  `ignore` lists module names or "re:" regexes.
Anything else in a quantization_config is refused by name: never loaded as if it were bf16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

BLOCK = 128  # the one block size the kernels take (a scale per 128 x 128 weights)
ONLINE = "online-fp8"  # --quantization fp8 on a 16-bit checkpoint
QUANTIZATION_CHOICES = ("fp8",)


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8" | "compressed-tensors" | ONLINE
    weights: str  # the checkpoint's scale granularity: "tensor" | "channel" | "block"
    scale_name: str  # checkpoint tensor suffix of the scale: "weight_scale_inv" | "weight_scale" ("" online)
    ignore: tuple[str, ...] = ()  # modules kept in 16 bits: names or "re:" regexes
    static_input: bool = False  # the checkpoint ships per-tensor input_scale tensors

    @property
    def online(self) -> bool:
        return self.method == ONLINE

    @property
    def block_k(self) -> int:
        """K elements per scale in our layout (rows expanded): BLOCK, or 0 for one per row."""
        return BLOCK if self.weights == "block" else 0

    def quantizes(self, module: str) -> bool:
        """Whether the HF module `module` (e.g. model.layers.0.self_attn.q_proj) is FP8."""
        return not any(_matches(p, module) for p in self.ignore)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):  # compressed-tensors: a regex from the start of the name
        return re.match(pattern[3:], module) is not None
    # A dotted run of whole name components ("lm_head", "mlp.gate", "model.layers.0.mlp"),
    # as transformers' and vLLM's prefix/substring rules mean in practice.
    return f".{pattern}." in f".{module}."


def online_fp8() -> QuantConfig:
    return QuantConfig(method=ONLINE, weights="channel", scale_name="")


def from_hf(qc: dict[str, Any] | None) -> QuantConfig | None:
    """Parses config.json's quantization_config (None: a 16-bit checkpoint)."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported "
        "(supported: 'fp8' and 'compressed-tensors' with an FP8 scheme)"
    )


def _fp8(qc: dict[str, Any]) -> QuantConfig:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (FP8 checkpoints load as e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not 'dynamic' or 'static'")
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", "tensor", "weight_scale", ignore, scheme == "static")
    if list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"quantization_config.weight_block_size {list(block)} is not supported (only [128, 128])")
    if scheme == "static":
        raise ValueError("quantization_config: block-quantized FP8 with a static activation_scheme is not supported")
    return QuantConfig("fp8", "block", "weight_scale_inv", ignore)


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(
            f"compressed-tensors: {len(groups)} config_groups; only one FP8 scheme for all Linear layers is supported"
        )
    (name, group), = groups.items()
    targets = group.get("targets") or []
    if "Linear" not in targets:
        raise ValueError(f"compressed-tensors: config_groups.{name}.targets {targets} does not name 'Linear'")
    w = group.get("weights") or {}
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(
            f"compressed-tensors: config_groups.{name}.weights is {w.get('num_bits')}-bit {w.get('type')!r}; "
            "only the FP8 schemes (8-bit float) are supported"
        )
    if w.get("symmetric") is False or w.get("dynamic"):
        raise ValueError(f"compressed-tensors: config_groups.{name}.weights must be static and symmetric")
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"compressed-tensors: weight strategy {strategy!r} is not supported (tensor, channel, block)")
    if strategy == "block" and list(w.get("block_structure") or ()) != [BLOCK, BLOCK]:
        raise ValueError(
            f"compressed-tensors: block_structure {w.get('block_structure')} is not supported (only [128, 128])"
        )
    act = group.get("input_activations")
    static_input = False
    if act is not None:
        if act.get("type") != "float" or act.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors: config_groups.{name}.input_activations are not 8-bit float")
        static_input = not act.get("dynamic", False)
    if qc.get("sparsity_config"):
        raise ValueError("compressed-tensors: sparsity_config is not supported")
    return QuantConfig("compressed-tensors", strategy, "weight_scale", tuple(qc.get("ignore") or ()), static_input)


def resolve(checkpoint: QuantConfig | None, flag: str | None) -> QuantConfig | None:
    """The quantization a model runs with: the checkpoint's, or `--quantization fp8` on a
    16-bit checkpoint (a checkpoint that is FP8 already loads as it is)."""
    if flag is None:
        return checkpoint
    if flag not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {flag!r}; choose from {QUANTIZATION_CHOICES}")
    return checkpoint if checkpoint is not None else online_fp8()
