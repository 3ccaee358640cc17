"""ModelConfig: the model's shape, read from a Hugging Face config.json (or GGUF metadata)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisgl.core import hybrid_config as hybrid
from minisgl.core.hybrid_config import LinearAttnConfig
from minisgl.core.quant_config import QuantConfig, from_hf

# architectures entry -> the flags of our one Llama-family implementation (moe: sparse MLP
# blocks, see MoEConfig)
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False, "moe": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False, "moe": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False, "moe": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True, "moe": False},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False, "moe": True},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "qk_norm": False, "moe": True},
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True, "moe": True},
    # The Llama block with q/k/v/o biases, attention sinks and a biased, clamped-SwiGLU MoE.
    "GptOssForCausalLM": {"qkv_bias": True, "qk_norm": False, "moe": True},
    # models/gemma3.py: four norms per block, GeGLU, a rope per layer kind (the multimodal
    # checkpoint's text model only).
    "Gemma3ForCausalLM": {"qkv_bias": False, "qk_norm": True, "moe": False},
    "Gemma3ForConditionalGeneration": {"qkv_bias": False, "qk_norm": True, "moe": False},
    # models/qwen3_next.py: Gated DeltaNet layers beside gated full-attention ones (hybrid_config.py).
    "Qwen3NextForCausalLM": {"qkv_bias": False, "qk_norm": True, "moe": True},
    "Qwen3_5ForCausalLM": {"qkv_bias": False, "qk_norm": True, "moe": False},
    "Qwen3_5ForConditionalGeneration": {"qkv_bias": False, "qk_norm": True, "moe": False},
    "Qwen3_5MoeForCausalLM": {"qkv_bias": False, "qk_norm": True, "moe": True},
    "Qwen3_5MoeForConditionalGeneration": {"qkv_bias": False, "qk_norm": True, "moe": True},
}
GPT_OSS = "GptOssForCausalLM"
GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# transformers' Gemma3TextConfig defaults: a multimodal checkpoint's text_config leaves them out.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}
MIXTRAL = "MixtralForCausalLM"
BASE_MODELS = {name.removesuffix("ForCausalLM") + "Model": name for name in ARCHITECTURES}


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (GPT-OSS): the ramp between beta_fast and beta_slow rotations, cos/sin scaled by
    # attention_factor (None: 0.1 ln(factor) + 1)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP blocks (transformers' Qwen2-MoE, Qwen3-MoE and Mixtral routers): each token
    goes to its top_k experts by softmax score, weighted by those scores (renormalized to sum 1
    when `renormalize`: Qwen's norm_topk_prob, always for Mixtral)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert, before TP sharding
    renormalize: bool
    sparse_layers: tuple[bool, ...]  # per layer: a MoE block, else a dense MLP of intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none
    # GPT-OSS: the router and the experts have biases; the activation is "gpt_oss":
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit); its
    # checkpoint stacks experts transposed, gate and up interleaved (layers/moe.py).
    biases: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


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
    # Per layer: 0 = full attention; W > 0 = sliding-window attention over W tokens (a query at
    # position p sees keys p - W + 1 .. p, transformers' rule). () = every layer full.
    attention_windows: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoEConfig | None = None
    quantization: QuantConfig | None = None  # FP8 linear layers (models/quant_config.py); None: 16-bit
    o_bias: bool = False  # o_proj has a bias (GPT-OSS)
    attn_sinks: bool = False  # a learned sink logit per head (GPT-OSS)
    query_pre_attn_scalar: float | None = None  # Gemma: the softmax scale is its -1/2 power
    # Gemma 3: the sliding layers' rope (the full layers' is rope_theta / rope_scaling)
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh
    # Hybrid models (Qwen3-Next, Qwen3.5): the Gated DeltaNet layers; None: every layer attends.
    linear_attn: LinearAttnConfig | None = None
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotary rotates

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def is_gemma3(self) -> bool:
        return self.architecture in GEMMA3

    def rope_of(self, layer: int) -> tuple[float, RopeScaling]:
        """(theta, scaling) of layer `layer`'s rotary embedding."""
        if self.window_of(layer) and self.local_rope_theta is not None:
            return self.local_rope_theta, self.local_rope_scaling or RopeScaling()
        return self.rope_theta, self.rope_scaling

    def window_of(self, layer: int) -> int:
        """Layer `layer`'s attention window in tokens; 0: full attention."""
        return self.attention_windows[layer] if self.attention_windows else 0

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.attention_windows)

    def is_linear_layer(self, layer: int) -> bool:
        return self.linear_attn is not None and self.linear_attn.layers[layer]

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V in the KV pool (a hybrid model's full-attention layers)."""
        return self.num_layers - (self.linear_attn.num_linear_layers if self.linear_attn else 0)

    def is_sparse_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_tp(self, tp_size: int) -> None:
        """A clear error at start when `tp_size` cannot shard this model."""
        if self.linear_attn is not None:  # Gated DeltaNet layers shard whole k-heads with their v-heads
            self.linear_attn.shard(tp_size)
        sizes = [("num_attention_heads", self.num_heads)]
        moe = self.moe
        if moe is None or not all(moe.sparse_layers):
            sizes.append(("intermediate_size", self.intermediate_size))
        if moe is not None:
            # TP shards every expert's intermediate dimension (each rank holds all experts).
            name = "intermediate_size" if self.architecture == MIXTRAL else "moe_intermediate_size"
            sizes.append((name, moe.intermediate_size))
            if moe.shared_expert_intermediate_size:
                sizes.append(("shared_expert_intermediate_size", moe.shared_expert_intermediate_size))
        for what, n in sizes:
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
        if arch in GEMMA3:
            cfg = _gemma3_text(cfg)
        if arch in hybrid.MULTIMODAL:
            cfg = hybrid.text_config(cfg)
        # A base model's checkpoint (no LM head: an embedding model's, e.g. "Qwen3Model") is the
        # same decoder: its tensors load without the "model." prefix (models/llama.py).
        arch = BASE_MODELS.get(arch, arch)
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
        if arch in GEMMA3:
            rope_theta, scaling, local_theta, local_scaling = _gemma3_rope(cfg)
        else:
            (rope_theta, scaling), local_theta, local_scaling = _rope(cfg), None, None
        if cfg.get("attn_logit_softcapping"):
            raise ValueError("attn_logit_softcapping is not supported: minisgl's attention kernels do not cap "
                             "attention logits (Gemma 2 needs it; Gemma 3 sets it to null)")
        quant_method = (cfg.get("quantization_config") or {}).get("quant_method")
        if quant_method == "mxfp4" and arch != GPT_OSS:
            raise ValueError(f"quant_method 'mxfp4' is supported for GPT-OSS's experts only, not {arch}")
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            # Qwen3.5-MoE has no dense MLP (every layer sparse): its config may leave it out.
            intermediate_size=int(cfg.get("intermediate_size") or 0) if arch in hybrid.QWEN3_5_MOE
            else int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2-MoE's transformers config calls it qkv_bias; the others attention_bias.
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", ARCHITECTURES[arch]["qkv_bias"]))),
            qk_norm=ARCHITECTURES[arch]["qk_norm"],
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            attention_windows=_attention_windows(arch, cfg, int(need("num_hidden_layers"))),
            eos_token_ids=tuple(dict.fromkeys([*eos_ids, *extra_eos])),
            moe=_moe(arch, cfg, int(need("num_hidden_layers")), need) if ARCHITECTURES[arch]["moe"] else None,
            quantization=from_hf(cfg.get("quantization_config")),
            o_bias=arch == GPT_OSS and bool(cfg.get("attention_bias", True)),
            attn_sinks=arch == GPT_OSS,
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if arch in GEMMA3 else None,
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            final_logit_softcapping=float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping")
            else None,
            hidden_act=_hidden_act(cfg),
            **(hybrid.fields(arch, cfg, int(need("num_hidden_layers"))) if arch in hybrid.HYBRID else {}),
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


def _moe(arch: str, cfg: dict[str, Any], num_layers: int, need: Callable[[str], Any]) -> MoEConfig:
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts (Mixtral's name); the
    # Qwen checkpoints say num_experts.
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise ValueError("config.json is missing the required field 'num_experts' (or 'num_local_experts')")
    experts, top_k = int(experts), int(need("num_experts_per_tok"))
    if experts < 1:
        raise ValueError(f"num_experts must be >= 1 for {arch}, got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts = {experts}]")
    if arch == GPT_OSS:  # every layer sparse; top-k of the logits, softmax over them (= renormalize)
        return MoEConfig(experts, top_k, int(need("intermediate_size")), True, (True,) * num_layers,
                         biases=True, activation="gpt_oss", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                         swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    if arch == MIXTRAL:  # every layer sparse; softmax -> top-k -> renormalize
        return MoEConfig(experts, top_k, int(need("intermediate_size")), True, (True,) * num_layers)
    if arch in hybrid.QWEN3_5_MOE:  # every layer sparse, top-k renormalized, a shared expert
        return MoEConfig(experts, top_k, int(need("moe_intermediate_size")), True, (True,) * num_layers,
                         int(need("shared_expert_intermediate_size")))
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = set(cfg.get("mlp_only_layers") or ())
    # transformers' rule: layer i is sparse unless listed in mlp_only_layers or (i + 1) % step != 0.
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    shared = int(need("shared_expert_intermediate_size")) if arch in ("Qwen2MoeForCausalLM", hybrid.QWEN3_NEXT) else 0
    return MoEConfig(experts, top_k, int(need("moe_intermediate_size")), bool(cfg.get("norm_topk_prob", False)),
                     sparse, shared)


def _attention_windows(arch: str, cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Per layer 0 (full) or the sliding window, as transformers builds the masks: `layer_types`
    where the config has them (Qwen2/Qwen3 with use_sliding_window, newer configs), else
    Mistral's one `sliding_window` for every layer, else (an older Qwen2 config)
    use_sliding_window for the layers from max_window_layers on. () = every layer full."""
    window = int(cfg.get("sliding_window") or 0)
    types = None if arch in hybrid.HYBRID else cfg.get("layer_types")  # hybrid: linear | full (no windows)
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"config.json has {len(types)} layer_types for {num_layers} layers")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown} (supported: full_attention, sliding_attention)")
        if "sliding_attention" in types and window <= 0:
            raise ValueError("config.json has sliding_attention layers but no sliding_window size")
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif arch in GEMMA3:  # before layer_types: every sliding_window_pattern-th layer is full
        pattern = int(cfg.get("sliding_window_pattern", 6))
        windows = tuple(0 if (i + 1) % pattern == 0 else window for i in range(num_layers))
    elif arch == "MistralForCausalLM":
        windows = (window,) * num_layers
    elif cfg.get("use_sliding_window") and window:
        first = int(cfg.get("max_window_layers", num_layers))
        windows = tuple(window if i >= first else 0 for i in range(num_layers))
    else:
        windows = ()
    return windows if any(windows) else ()


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters` {rope_theta, rope_type, ...}; older configs have
    # top-level `rope_theta` and an optional `rope_scaling` dict. Read both.
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    return _rope_from({**legacy, **params}, float(cfg.get("rope_theta", 10000.0)))


def _rope_from(merged: dict[str, Any], default_theta: float) -> tuple[float, RopeScaling]:
    theta = float(merged.get("rope_theta", default_theta))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3", "linear", "yarn"):
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3, linear, yarn)")
    attention_factor = merged.get("attention_factor")
    if rope_type == "yarn" and (merged.get("mscale") or merged.get("mscale_all_dim")):
        raise ValueError("yarn rope with mscale / mscale_all_dim is not supported")
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(merged.get("factor") or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )
    return theta, scaling


def _gemma3_text(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 config with transformers' defaults filled in; a multimodal checkpoint's
    text_config (the only part minisgl serves) lifted to the top."""
    text = cfg.get("text_config")
    base = {**cfg, **text} if isinstance(text, dict) else dict(cfg)
    base["architectures"] = cfg["architectures"]
    return {**_GEMMA3_DEFAULTS, **{k: v for k, v in base.items() if v is not None}}


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling, float, RopeScaling]:
    """(full theta, full scaling, sliding theta, sliding scaling): transformers 5 writes
    rope_parameters per layer type; older configs rope_theta + rope_scaling for the full layers
    and rope_local_base_freq (no scaling) for the sliding ones."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = _rope_from(dict(params["full_attention"]), 1000000.0)
        local = _rope_from(dict(params.get("sliding_attention") or {}), 10000.0)
        return (*full, *local)
    theta, scaling = _rope(cfg)
    return theta, scaling, float(cfg.get("rope_local_base_freq", 10000.0)), RopeScaling()


def _hidden_act(cfg: dict[str, Any]) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"unsupported hidden activation {act!r} (supported: silu, gelu_pytorch_tanh)")
    return act
