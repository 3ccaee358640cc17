"""ModelConfig: the model's shape, read from a Hugging Face config.json (or GGUF metadata)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# architectures entry -> the flags of our one Llama-family implementation
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str | None = None
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_tp(self, tp_size: int) -> None:
        """A clear error at start when `tp_size` cannot shard this model."""
        for what, n in (("num_attention_heads", self.num_heads), ("intermediate_size", self.intermediate_size)):
            if n % tp_size != 0:
                raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {tp_size}")
        kv = self.num_kv_heads
        if (kv >= tp_size and kv % tp_size != 0) or (kv < tp_size and tp_size % kv != 0):
            raise ValueError(f"num_key_value_heads ({kv}) and the tensor-parallel size {tp_size} do not divide")

    @staticmethod
    def from_dict(cfg: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' field: cannot pick a model class")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {arch!r} in config.json; supported: {', '.join(ARCHITECTURES)}"
            )

        def need(name: str) -> Any:
            if cfg.get(name) is None:
                raise ValueError(f"config.json is missing the required field {name!r}")
            return cfg[name]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        if hidden % heads != 0 and cfg.get("head_dim") is None:
            raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads != 0:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        rope_theta, scaling = _rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return ModelConfig(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", ARCHITECTURES[arch]["qkv_bias"])),
            qk_norm=ARCHITECTURES[arch]["qk_norm"],
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=tuple(dict.fromkeys([*eos_ids, *extra_eos])),
        )

    @staticmethod
    def from_folder(path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise ValueError(f"no config.json in {path}")
        cfg = json.loads(cfg_file.read_text())
        extra: list[int] = []
        gen = path / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else list(eos or [])
        return ModelConfig.from_dict(cfg, tuple(extra))


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters` {rope_theta, rope_type, ...}; older configs have
    # top-level `rope_theta` and an optional `rope_scaling` dict. Read both.
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    merged = {**legacy, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3, linear)")
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )
    return theta, scaling
