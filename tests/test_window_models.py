"""Sliding-window and sink models (issue 33) against transformers, through the step kinds a
window can break: chunked prefill with chunks below and above the window, prefix-cache hits
taken before and after the window moved past the shared prefix, and a multimodal Gemma 3
checkpoint served as its text model. CPU, fp32, tiny models with W = 16."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from model_compare import greedy, hf_model, multimodal_folder, random_prompts, record_prefix_hits
from test_models_hf import hf_greedy

from minisgl import LLM
from minisgl.core.model_config import ModelConfig

WINDOW_MODELS = ["gemma3", "gpt_oss", "qwen2_swa"]


@pytest.fixture(scope="module")
def hf_models() -> dict[str, object]:
    return {}


@pytest.mark.parametrize("name", WINDOW_MODELS)
@pytest.mark.parametrize("chunk", [8, 24])
def test_chunked_prefill_below_and_above_the_window(name: str, chunk: int, tiny_model_path: Callable[[str], Path],
                                                     hf_models: dict[str, object]) -> None:
    path = tiny_model_path(name)
    llm = LLM(str(path), device="cpu", dtype="float32", max_prefill_tokens=chunk)
    prompts = random_prompts(chunk, (53, 17, 70))  # several windows long, and one shorter than a window + chunk
    outs = llm.generate(prompts, greedy(20), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o["token_ids"] == hf_greedy(hf_model(path, hf_models), p, 20), f"{name}, chunk {chunk}, {len(p)} tokens"


@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_prefix_hits_before_and_after_the_window_moved(name: str, tiny_model_path: Callable[[str], Path],
                                                       hf_models: dict[str, object]) -> None:
    """A first request of 43 + 48 tokens, then followers: two that diverge inside the first
    request's prompt (after 40 and 10 tokens) and one 30 tokens past it, all places the first
    request's window has left (the window-sized pool kept only its last window of sliding KV:
    the hit is cut back and the rest recomputed), and one that continues the whole first
    sequence (its last window still held: a hit). Every follower's tokens are transformers'."""
    path = tiny_model_path(name)
    hf = hf_model(path, hf_models)
    llm = LLM(str(path), device="cpu", dtype="float32")
    base = random_prompts(7, (40,))[0]
    first = llm.generate([base + [11, 12, 13]], greedy(48), use_tqdm=False)[0]
    assert first["token_ids"] == hf_greedy(hf, base + [11, 12, 13], 48)
    followers = [base + [21, 22], base[:10] + [31, 32, 33, 34], base + [11, 12, 13] + first["token_ids"][:30],
                 base + [11, 12, 13] + first["token_ids"] + [41, 42]]
    hits = record_prefix_hits(llm)
    outs = llm.generate(followers, greedy(12), use_tqdm=False)
    for p, o in zip(followers, outs, strict=True):
        assert o["token_ids"] == hf_greedy(hf, p, 12), f"{name}: follower of {len(p)} tokens"
    assert hits[-1] >= 80, f"{name}: the follower of the whole first sequence missed its cached window ({hits})"


def test_multimodal_gemma3_checkpoint_serves_its_text_model(tiny_model_path: Callable[[str], Path],
                                                            tmp_path: Path, hf_models: dict[str, object]) -> None:
    """A Gemma3ForConditionalGeneration folder: the text config under text_config, the language
    model's tensors under model.language_model., a vision tower that is skipped."""
    from safetensors.torch import save_file

    src = tiny_model_path("gemma3")
    dst = tmp_path / "gemma3_mm"
    text = multimodal_folder(src, dst, "Gemma3ForConditionalGeneration", "gemma3", {"eos_token_id": None})
    tensors = {("model.language_model." + k.removeprefix("model.")): v
               for k, v in text.items() if k != "lm_head.weight"}
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.randn(8, 3, 2, 2)
    tensors["model.multi_modal_projector.mm_input_projection_weight"] = torch.randn(8, 64)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(dst), device="cpu", dtype="float32")
    prompt = random_prompts(3, (37,))[0]
    assert llm.generate([prompt], greedy(10), use_tqdm=False)[0]["token_ids"] == \
        hf_greedy(hf_model(src, hf_models), prompt, 10)


def test_benchmark_configs_parse_as_the_checkpoints_write_them() -> None:
    """The real checkpoints' config forms (Gemma 3's sliding_window_pattern and
    rope_local_base_freq; GPT-OSS's yarn rope_scaling): the layer kinds and ropes they mean."""
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
    g = ModelConfig.from_folder(root / "gemma-3-27b")
    assert g.attention_windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(62))
    assert g.rope_of(0)[0] == 10000.0 and g.rope_of(0)[1].rope_type == "default"
    assert g.rope_of(5)[0] == 1000000.0 and g.rope_of(5)[1].rope_type == "linear"
    assert g.attention_scale == 168**-0.5 and g.hidden_act == "gelu_pytorch_tanh"
    o = ModelConfig.from_folder(root / "gpt-oss-20b")
    assert o.attention_windows == (128, 0) * 12 and o.attn_sinks and o.o_bias
    assert o.rope_scaling.rope_type == "yarn" and not o.rope_scaling.truncate and o.moe.activation == "gpt_oss"


def test_mxfp4_parses_for_gpt_oss_and_is_refused_elsewhere() -> None:
    """GPT-OSS's MXFP4 checkpoints load (tests/test_quant4_models.py); MXFP4 on another family is
    refused by name."""
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
    cfg = json.loads((root / "gpt-oss-20b" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    assert ModelConfig.from_dict(cfg).quantization.fmt == "mxfp4"
    llama = json.loads((root / "llama-3.1-8b" / "config.json").read_text())
    llama["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="mxfp4.*GPT-OSS"):
        ModelConfig.from_dict(llama)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
@pytest.mark.parametrize("algo", ["ngram", "draft-self"])
def test_speculative_decoding_with_windows(name: str, algo: str, tiny_model_path: Callable[[str], Path],
                                           hf_models: dict[str, object]) -> None:
    """n-gram and draft-model speculation (the model its own draft: the draft's window-sized
    pool follows the target's) give transformers' greedy tokens past several windows."""
    path = tiny_model_path(name)
    spec = ({"speculative_algorithm": "ngram", "speculative_ngram_min": 2} if algo == "ngram" else
            {"speculative_algorithm": "draft", "speculative_draft_model": str(path)})
    llm = LLM(str(path), device="cpu", dtype="float32", speculative_num_draft_tokens=3, **spec)
    prompts = [[5, 6, 7, 8] * 6, random_prompts(21, (30,))[0]]  # a repeating prompt gives n-gram drafts
    outs = llm.generate(prompts, greedy(40), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o["token_ids"] == hf_greedy(hf_model(path, hf_models), p, 40), f"{name} {algo}: {len(p)} tokens"
    assert llm.scheduler.stats().get("spec_verified", 0) > 0, "no verify step ran"
