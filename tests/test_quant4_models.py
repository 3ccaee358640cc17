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
from test_fp8_models import _check_against

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


@pytest.mark.parametrize(("fmt", "sym"), [("awq", False), ("gptq", True), ("compressed-tensors", False)])
def test_int4_moe_experts_match_transformers(tiny_model_path: Callable[[str], Path], tmp_path: Path, fmt: str,
                                             sym: bool) -> None:
    """Qwen3-MoE with 4-bit experts (stacked [E, ...] INT4 in minisgl, dequantized on the CPU) and
    4-bit attention and dense MLP; group 16 divides every K (hidden 64, expert intermediate 48)."""
    q, deq = ck.write_quant4(tiny_model_path("qwen3_moe"), tmp_path / "q", tmp_path / "deq", fmt, 16, sym)
    llm = LLM(str(q), device="cpu", dtype="float32")
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.int32 and experts.w13.shape == (8, 96, 8)
    _check_against(llm, deq)
