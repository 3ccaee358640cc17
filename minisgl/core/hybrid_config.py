"""The linear-attention half of a hybrid model's shape (Qwen3-Next, Qwen3.5): which layers are
Gated DeltaNet layers and their head sizes, read from the HF config (issue 34).

A hybrid model's full-attention layers are the gated kind (q_proj gives q and a per-head output
gate), rotate only `partial_rotary_factor` of each head, and every RMSNorm but the gated one
scales by (1 + w); the linear layers keep a per-request state (kvcache/state_pool.py) instead
of KV.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

QWEN3_NEXT = "Qwen3NextForCausalLM"
# Qwen3.5's text model, alone or inside the multimodal checkpoint (whose text config sits
# under text_config; its vision tower is not served).
QWEN3_5 = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
QWEN3_5_MOE = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
HYBRID = (QWEN3_NEXT, *QWEN3_5, *QWEN3_5_MOE)
MULTIMODAL = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


@dataclass(frozen=True)
class LinearAttnConfig:
    """Gated DeltaNet layers: per layer a causal depthwise conv of `conv_kernel` taps over
    q|k|v (conv_dim channels), then the delta rule with `num_v_heads` states [k_head_dim,
    v_head_dim] (fp32); q/k heads are shared by num_v_heads / num_k_heads v-heads."""

    layers: tuple[bool, ...]  # per layer: True = linear attention, False = full attention
    conv_kernel: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    # Qwen3-Next projects q|k|v|z interleaved per k-head group (in_proj_qkvz, in_proj_ba);
    # Qwen3.5 has one projection per part (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
    fused_qkvz: bool

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def num_linear_layers(self) -> int:
        return sum(self.layers)

    def shard(self, tp_size: int) -> LinearAttnConfig:
        """One rank's share under TP: whole k-heads, each with its v-heads (the sizes the layer's
        tensors and the state pool have on that rank)."""
        if self.num_k_heads % tp_size:
            raise ValueError(f"linear_num_key_heads ({self.num_k_heads}) is not divisible by the tensor-parallel "
                             f"size {tp_size}")
        return replace(self, num_k_heads=self.num_k_heads // tp_size, num_v_heads=self.num_v_heads // tp_size)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Qwen3.5 config's text_config lifted to the top (architectures kept)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    out = {**cfg, **{k: v for k, v in text.items() if v is not None}}
    out["architectures"] = cfg["architectures"]
    return out


def linear_attn_config(arch: str, cfg: dict[str, Any], num_layers: int) -> LinearAttnConfig:
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer is full
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"config.json has {len(types)} layer_types for {num_layers} layers")
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown} for {arch} (supported: linear_attention, "
                         "full_attention)")
    return LinearAttnConfig(
        layers=tuple(t == "linear_attention" for t in types),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        k_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        v_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        fused_qkvz=arch == QWEN3_NEXT,
    )


def partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """The share of each head that rotates (transformers 5 keeps it in rope_parameters; the
    configs' default is 0.25)."""
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))


def fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """ModelConfig's hybrid fields."""
    return {"linear_attn": linear_attn_config(arch, cfg, num_layers),
            "partial_rotary_factor": partial_rotary_factor(cfg)}
