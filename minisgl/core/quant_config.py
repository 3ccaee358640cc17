"""QuantConfig: how a checkpoint's linear weights are quantized (config.json's
`quantization_config`), or that 16-bit weights are to be quantized on load (`--quantization fp8`).

FP8 formats (e4m3 weight [N, K] next to its fp32 scale; dequantized W = w * scale):
- `quant_method: "fp8"` with `weight_block_size: [128, 128]` (Qwen3 / DeepSeek FP8 releases):
  `weight_scale_inv` [ceil(N/128), ceil(K/128)], one scale per 128 x 128 block (multiplied,
  despite the name). Not converted: `modules_to_not_convert` / `ignored_layers`.
- `quant_method: "fp8"` without a block size: per-tensor `weight_scale` (one value), optional
  static `input_scale` (activation_scheme "static").
- `quant_method: "compressed-tensors"` (llm-compressor), one FP8 scheme targeting Linear:
  `weight_scale` per channel [N, 1], per tensor [1] or per block [ceil(N/128), ceil(K/128)];
  `ignore` lists module names or "re:" regexes.
4-bit formats (repacked at load into kernels/quant4.py's INT4 or MXFP4 layout; G the group size,
-1 in a config: one group per row; W[n, k] = (q - z) * s):
- `quant_method: "awq"` (AutoAWQ, `version: "gemm"`): `qweight` int32 [K, N / 8] (eight output
  columns per word, nibble i holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]), `qzeros` int32
  [K / G, N / 8] (the same order), `scales` [K / G, N]; `modules_to_not_convert`.
- `quant_method: "gptq"` (AutoGPTQ / GPTQModel, 4 bits): `qweight` int32 [K / 8, N] (packed along
  K, nibble j holding row 8r + j), `qzeros` int32 [K / G, N / 8] (packed along N, nibble j holding
  column 8c + j; `checkpoint_format` "gptq" (v1) stores z - 1, "gptq_v2" z), `scales` [K / G, N],
  `g_idx` int32 [K] (row k's group; `desc_act`: act-order, K permuted at load), `sym`.
- `quant_method: "compressed-tensors"`, `format: "pack-quantized"`, a 4-bit int scheme (W4A16,
  strategy "group" or "channel"): `weight_packed` int32 [N, K / 8] (nibble j holding column
  8c + j, value q + 8), `weight_scale` [N, K / G], `weight_zero_point` int32 [N / 8, K / G]
  (asymmetric: packed along N, value z + 8), `weight_shape` [2]; `ignore`.
- `quant_method: "mxfp4"` (GPT-OSS): the MoE experts' `*_blocks` uint8 [E, N, K / 32, 16] (e2m1
  pairs, low nibble first) and `*_scales` uint8 [E, N, K / 32] (e8m0); everything else in 16 bits.
Anything else in a quantization_config is refused by name: never loaded as if it were bf16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

BLOCK = 128  # the one block size the kernels take (a scale per 128 x 128 weights)
ONLINE = "online-fp8"  # --quantization fp8 on a 16-bit checkpoint
QUANTIZATION_CHOICES = ("fp8",)
INT4_PACKINGS = ("awq", "gptq", "gptq_v2", "pack-quantized")  # QuantConfig.packing of the INT4 formats


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8" | "compressed-tensors" | ONLINE
    weights: str  # the checkpoint's scale granularity: "tensor" | "channel" | "block"
    scale_name: str  # checkpoint tensor suffix of the scale: "weight_scale_inv" | "weight_scale" ("" online)
    ignore: tuple[str, ...] = ()  # modules kept in 16 bits: names or "re:" regexes
    static_input: bool = False  # the checkpoint ships per-tensor input_scale tensors
    # 4-bit formats only:
    packing: str = ""  # one of INT4_PACKINGS, or "mxfp4"
    group: int = 0  # K elements per scale; 0: one per row (per channel)
    sym: bool = True  # symmetric (no stored zero points where the format allows that)
    desc_act: bool = False  # GPTQ act-order

    @property
    def fmt(self) -> str:
        """The layer format (ops/gemm/dispatch.py): "fp8", "int4" or "mxfp4"."""
        return "int4" if self.packing in INT4_PACKINGS else "mxfp4" if self.packing == "mxfp4" else "fp8"

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
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "mxfp4":
        ignore = tuple(qc.get("modules_to_not_convert") or ())
        return QuantConfig("mxfp4", "mxfp4", "", ignore, packing="mxfp4", group=32)
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported (supported: 'fp8', 'awq', 'gptq', "
        "'mxfp4', and 'compressed-tensors' with an FP8 or a 4-bit pack-quantized scheme)"
    )


def _group(qc: dict[str, Any], key: str, what: str) -> int:
    g = qc.get(key)
    if g in (-1, None):
        return 0
    if not isinstance(g, int) or g <= 0 or g % 8:
        raise ValueError(f"{what}: {key} {g!r} is not supported (a positive multiple of 8, or -1 for per-channel)")
    return g


def _bits4(qc: dict[str, Any], what: str) -> None:
    if qc.get("bits", 4) != 4:
        raise ValueError(f"{what}: {qc.get('bits')}-bit weights are not supported (only 4-bit)")


def _awq(qc: dict[str, Any]) -> QuantConfig:
    _bits4(qc, "awq")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq: version {version!r} is not supported (only AutoAWQ's 'gemm' packing)")
    if qc.get("zero_point") is False:
        raise ValueError("awq: zero_point false is not supported (AutoAWQ's gemm checkpoints carry zero points)")
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    return QuantConfig("awq", "int4", "", ignore, packing="awq", group=_group(qc, "group_size", "awq"), sym=False)


def _gptq(qc: dict[str, Any]) -> QuantConfig:
    _bits4(qc, "gptq")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported ('gptq' or 'gptq_v2')")
    if qc.get("dynamic"):
        raise ValueError("gptq: per-module 'dynamic' overrides are not supported (one bits / group_size for all)")
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    return QuantConfig("gptq", "int4", "", ignore, packing=fmt, group=_group(qc, "group_size", "gptq"),
                       sym=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)))


def _ct_int4(qc: dict[str, Any], name: str, group: dict[str, Any]) -> QuantConfig:
    """compressed-tensors W4A16: a 4-bit int weight scheme, pack-quantized, 16-bit activations."""
    w = group["weights"]
    fmt = group.get("format") or qc.get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"compressed-tensors: 4-bit int weights in format {fmt!r}; only 'pack-quantized' is supported")
    if group.get("input_activations") is not None:
        raise ValueError(f"compressed-tensors: config_groups.{name} quantizes activations; only W4A16 is supported")
    if w.get("dynamic") or w.get("actorder"):
        raise ValueError(f"compressed-tensors: config_groups.{name}.weights: dynamic or actorder "
                         f"({w.get('actorder')!r}) schemes are not supported")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors: 4-bit weight strategy {strategy!r} is not supported (group, channel)")
    g = _group(w, "group_size", "compressed-tensors") if strategy == "group" else 0
    if strategy == "group" and not g:
        raise ValueError("compressed-tensors: strategy 'group' needs a group_size")
    if qc.get("sparsity_config"):
        raise ValueError("compressed-tensors: sparsity_config is not supported")
    return QuantConfig("compressed-tensors", "int4", "", tuple(qc.get("ignore") or ()), packing="pack-quantized",
                       group=g, sym=w.get("symmetric", True) is not False)


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
    if w.get("type") == "int" and w.get("num_bits") == 4:
        return _ct_int4(qc, name, group)
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(
            f"compressed-tensors: config_groups.{name}.weights is {w.get('num_bits')}-bit {w.get('type')!r}; "
            "only the FP8 schemes (8-bit float) and 4-bit int pack-quantized (W4A16) are supported"
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
