"""4-bit checkpoints on the CPU: a tiny random Llama quantised in the test (round-to-nearest into
each format's exact packing: tests/quant4_checkpoints.py) and loaded by minisgl, against
transformers on the same weights dequantized to fp32. On the CPU the 4-bit layers dequantize
through the fp32 reference and multiply in fp32, so greedy tokens are equal and prefill logits
within 1e-4 relative. Dims are multiples of 128 so every group size divides every K; q/k/v parts
of 256/64/64 rows; one case keeps layer 1's MLP in fp32 through the format's ignore list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import quant4_checkpoints as ck
import test_fp8_models as fp8_models
import tiny_models
import torch
from safetensors.torch import load_file, save_file
from test_fp8_models import GREEDY, _check_against

from minisgl import LLM

SPEC = dataclasses.replace(  # fp8's tiny Llama with every dim a multiple of 128
    fp8_models.SPEC, name="int4_llama", seed=13,
    overrides={**fp8_models.SPEC.overrides, "hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 8},
)
# (format, group (-1: per channel), symmetric, act-order)
CASES = [
    ("awq", 128, False, False), ("awq", -1, False, False),
    ("gptq", 32, True, False), ("gptq", 128, False, False), ("gptq_v2", 64, False, False),
    ("gptq", 64, True, True), ("gptq_v2", 32, False, True),
    ("compressed-tensors", 128, True, False), ("compressed-tensors", 32, False, False),
    ("compressed-tensors", -1, True, False), ("compressed-tensors", -1, False, False),
]


@pytest.fixture(scope="module")
def src(tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("int4")
    return tiny_models.build_tiny_model(SPEC, root / "src", tiny_model_path("llama3"))


@pytest.mark.parametrize(("fmt", "group", "sym", "desc_act"), CASES)
def test_int4_checkpoint_matches_transformers_on_dequantized_weights(
    src: Path, tmp_path: Path, fmt: str, group: int, sym: bool, desc_act: bool
) -> None:
    q, deq = ck.write_quant4(src, tmp_path / "q", tmp_path / "deq", fmt, group, sym, desc_act, seed=group)
    llm = LLM(str(q), device="cpu", dtype="float32")
    layer = llm.engine.model.model.layers[0]
    assert layer.mlp.gate_up_proj.weight.dtype == torch.int32 and layer.self_attn.qkv_proj.fmt == "int4"
    assert (layer.self_attn.qkv_proj.act_perm is not None) == desc_act
    _check_against(llm, deq)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "compressed-tensors"])
def test_ignored_modules_stay_16_bit(src: Path, tmp_path: Path, fmt: str) -> None:
    names = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]
    q, deq = ck.write_quant4(src, tmp_path / "q", tmp_path / "deq", fmt, 64, False, ignored=("layers.1.mlp",),
                             ignore=names)
    llm = LLM(str(q), device="cpu", dtype="float32")
    layers = llm.engine.model.model.layers
    assert layers[0].mlp.down_proj.fmt == "int4" and layers[1].mlp.down_proj.weight.dtype == torch.float32
    _check_against(llm, deq)


def test_fused_parts_half_ignored_are_refused(src: Path, tmp_path: Path) -> None:
    q, _ = ck.write_quant4(src, tmp_path / "q", tmp_path / "deq", "awq", 64, False, ignored=("layers.1.mlp.up",),
                           ignore=["model.layers.1.mlp.up_proj"])
    with pytest.raises(ValueError, match="must be all quantized or all 16-bit"):
        LLM(str(q), device="cpu", dtype="float32")


@pytest.mark.parametrize(("name", "fmt", "sym"), [
    ("qwen3_moe", "awq", False), ("qwen3_moe", "gptq", True), ("qwen3_moe", "compressed-tensors", False),
    ("qwen2_moe", "awq", False),
])
def test_int4_moe_experts_match_transformers(tiny_model_path: Callable[[str], Path], tmp_path: Path, name: str,
                                             fmt: str, sym: bool) -> None:
    """MoE models with 4-bit experts (stacked [E, ...] INT4 in minisgl, dequantized on the CPU),
    4-bit attention, dense MLPs and Qwen2-MoE's shared expert (with q/k/v biases); group 16
    divides every K (hidden 64, expert intermediate 48 or 32, shared 96)."""
    q, deq = ck.write_quant4(tiny_model_path(name), tmp_path / "q", tmp_path / "deq", fmt, 16, sym)
    llm = LLM(str(q), device="cpu", dtype="float32")
    mlp = llm.engine.model.model.layers[1 if name == "qwen2_moe" else 0].mlp
    assert mlp.experts.w13.dtype == torch.int32 and mlp.experts.w13.shape[2] == 8
    if name == "qwen2_moe":
        assert mlp.shared_expert.down_proj.fmt == "int4"
    _check_against(llm, deq)


@pytest.mark.parametrize(("name", "fmt", "sym"), [
    ("qwen3_next", "awq", False), ("qwen3_5_moe", "gptq", True), ("qwen3_5_moe", "compressed-tensors", False),
])
def test_int4_hybrid_moe_matches_transformers(tiny_model_path: Callable[[str], Path], tmp_path: Path, name: str,
                                              fmt: str, sym: bool) -> None:
    """Hybrid linear-attention MoE models (Qwen3-Next, Qwen3.5-MoE) from 4-bit checkpoints: the
    routed experts, the shared expert and the gated full attention in 4 bits, the Gated DeltaNet
    projections, router and shared-expert gate in 16 (as the released 4-bit checkpoints keep them)."""
    q, deq = ck.write_quant4(tiny_model_path(name), tmp_path / "q", tmp_path / "deq", fmt, 16, sym)
    llm = LLM(str(q), device="cpu", dtype="float32")
    layers = llm.engine.model.model.layers
    mlp = layers[0].mlp
    assert mlp.experts.w13.dtype == torch.int32 and mlp.shared_expert.down_proj.fmt == "int4"
    assert layers[3].self_attn.qkv_proj.fmt == "int4" and layers[3].self_attn.o_proj.fmt == "int4"
    assert layers[0].linear_attn.out_proj.weight.dtype == torch.float32
    _check_against(llm, deq)


def test_quantized_gated_deltanet_projections_are_refused_by_name(tiny_model_path: Callable[[str], Path],
                                                                 tmp_path: Path) -> None:
    q, _ = ck.write_quant4(tiny_model_path("qwen3_5_moe"), tmp_path / "q", tmp_path / "deq", "gptq", 16, True)
    tensors = load_file(q / "model.safetensors")
    w = tensors.pop("model.layers.0.linear_attn.out_proj.weight")
    tensors["model.layers.0.linear_attn.out_proj.qweight"] = torch.zeros(w.shape[1] // 8, w.shape[0],
                                                                         dtype=torch.int32)
    save_file(tensors, q / "model.safetensors")
    with pytest.raises(ValueError, match="linear_attn.out_proj.qweight: not a Gated DeltaNet tensor .*16 bits only"):
        LLM(str(q), device="cpu", dtype="float32")


def test_dummy_int4_weights_have_the_real_shapes(src: Path, tmp_path: Path) -> None:
    q, _ = ck.write_quant4(src, tmp_path / "q", tmp_path / "deq", "gptq", 128, True)
    llm = LLM(str(q), device="cpu", dtype="float32", load_format="dummy")
    layer = llm.engine.model.model.layers[1].mlp.down_proj
    assert layer.weight.shape == (256, 384 // 8) and layer.weight_scale.shape == (256, 3)
    assert bool((layer.weight_zero == 8).all()) and layer.weight.unique().numel() > 100
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens


def test_gpt_oss_mxfp4_experts_match_transformers(tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    """GPT-OSS's MXFP4 checkpoint form (experts' `*_blocks` / `*_scales`, rows interleaving gate
    and up, biases in 16 bits): loaded as MXFP4 experts, dequantized on the CPU, against
    transformers on the dequantized experts. Intermediate 64: K of the down projection a
    multiple of 32."""
    spec = dataclasses.replace(tiny_models.SPECS["gpt_oss"], name="gpt_oss_i64", seed=5,
                               overrides={**tiny_models.SPECS["gpt_oss"].overrides, "intermediate_size": 64})
    # A tiny model's folder holds its tokenizer's files: the source build_tiny_model copies them from.
    src = tiny_models.build_tiny_model(spec, tmp_path / "src", tiny_model_path("gpt_oss"))
    q, deq = ck.write_gpt_oss_mxfp4(src, tmp_path / "q", tmp_path / "deq")
    llm = LLM(str(q), device="cpu", dtype="float32")
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.uint8 and experts.w13.shape == (6, 128, 32) and experts.w2.shape == (6, 64, 32)
    _check_against(llm, deq)
    dummy = LLM(str(q), device="cpu", dtype="float32", load_format="dummy")
    assert len(dummy.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens
