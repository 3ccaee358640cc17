"""Models for the speculative-decoding tests, built next to a tiny target (tiny_models.py):
a smaller draft model with the target's tokenizer, a random-weights EAGLE-3 head in the real
checkpoint layout (config fields and tensor names as SGLang, vLLM and the EAGLE repository
read them), and a small-vocabulary model for the sampling statistics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tiny_models
import torch
from safetensors.torch import save_file

_NOT_TOKENIZER = {"config.json", "generation_config.json", "model.safetensors"}


def assert_same_outputs(got: list[dict], want: list[dict], tol: float = 1e-4) -> None:
    """LLM.generate results equal: text, tokens and finish reason exactly; logprobs (and the
    alternatives' logprobs) within `tol`, since fp32 sums in another order (a verify step's
    extend, a cached prefix, another batch) round differently."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), f"output {i}"
        for key in g.keys() - {"logprobs", "top_logprobs"}:
            assert g[key] == w[key], f"output {i}: {key}"
        torch.testing.assert_close(torch.tensor(g["logprobs"]), torch.tensor(w["logprobs"]), atol=tol, rtol=0)
        if "top_logprobs" in g:
            assert [[t for t, _ in a] for a in g["top_logprobs"]] == [[t for t, _ in a] for a in w["top_logprobs"]]
            torch.testing.assert_close(torch.tensor([[lp for _, lp in a] for a in g["top_logprobs"]]),
                                       torch.tensor([[lp for _, lp in a] for a in w["top_logprobs"]]), atol=tol, rtol=0)


def tokenizer_only(model_dir: Path, out: Path) -> Path:
    """A folder with the tokenizer files of `model_dir` (for build_tiny_model)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name not in _NOT_TOKENIZER:
            shutil.copy(f, out / f.name)
    return out


DRAFT = tiny_models.TinySpec(
    "llama_draft", "llama", "smollm2",
    {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
     "num_key_value_heads": 1, "tie_word_embeddings": True,
     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    seed=11,
)
# A small vocabulary, so that the distribution of two sampled tokens has few cells. Weights
# are scaled up: flat random logits over 64 tokens would make every test weak.
SMALL_VOCAB = tiny_models.TinySpec(
    "llama_small_vocab", "llama", "smollm2",
    {"vocab_size": 64, "num_hidden_layers": 1, "tie_word_embeddings": False, "initializer_range": 0.3,
     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    seed=12,
)


def build_eagle3_head(target_dir: Path, out: Path, seed: int = 13, draft_vocab: int = 4096,
                      own_embedding: bool = False) -> Path:
    """An EAGLE-3 checkpoint for the target in `target_dir`: one midlayer (q/k/v over 2H), fc
    3H -> H, and a draft vocabulary of `draft_vocab` target ids spread over the vocabulary (d2t)."""
    t = json.loads((target_dir / "config.json").read_text())
    h, heads, kv = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    hd = h // heads
    inter, vocab = t["intermediate_size"], t["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    # Draft id i -> target id chosen[i] (sorted, spread over the vocabulary): d2t = chosen - i.
    chosen = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "midlayer.input_layernorm.weight": 1 + w(h),
        "midlayer.hidden_norm.weight": 1 + w(h),
        "midlayer.post_attention_layernorm.weight": 1 + w(h),
        "norm.weight": 1 + w(h),
        "lm_head.weight": w(draft_vocab, h),
        "d2t": chosen - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, chosen, True),
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = w(vocab, h)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": t["max_position_embeddings"], "vocab_size": vocab,
        "draft_vocab_size": draft_vocab, "tie_word_embeddings": False,
        # SGLang/SpecForge form: outputs of layers -1 (the embedding), 0 and 1 of a 2-layer target.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 0, 1]},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
