"""4-bit checkpoints on the GPU, end to end: the INT4 linear layers (skinny template or the Triton
W4A16 GEMM, by M) and the 4-bit fused MoE (INT4 experts; GPT-OSS's MXFP4 ones), in bf16, against
transformers running the same weights dequantized, in fp32. Greedy tokens must agree up to a
bf16 near-tie of the reference (tests/bf16_tie.py), and prefill logits within 5% (max abs error over max |logit|)
up to the first position where an MoE router of the reference nearly ties (bf16 may pick another expert:
the tiny GPT-OSS in transformers itself moves 0.74 of its logit scale in bf16 at such a prompt)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import bf16_tie
import pytest
import quant4_checkpoints as ck
import tiny_models
import torch
from test_fp8_models import GREEDY, PROMPTS
from test_quant4_models import SPEC

from minisgl import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _check(q: Path, deq: Path) -> None:
    from test_models_hf import hf_greedy

    hf = _hf(deq)
    with torch.no_grad():
        want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
        want_logits = [hf(torch.tensor([p])).logits[0].float() for p in PROMPTS]
    llm = LLM(str(q), device="cuda", dtype="bfloat16")
    try:
        got = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        scores = llm.engine.score(PROMPTS)
    finally:
        llm.shutdown()
    # MoE: positions from a near-tied routing on compare through the tokens' tie rule only.
    ends = [bf16_tie.first_router_tie(hf, p) for p in PROMPTS]
    assert 3 * sum(ends) >= sum(map(len, PROMPTS)), f"routing near-ties leave under a third of the positions: {ends}"
    for ours, ref, end in zip(scores, want_logits, ends, strict=True):
        rel = (ours[:end].float().cpu() - ref[:end]).abs().max() / ref[:end].abs().max() if end else 0.0
        assert rel <= 0.05, f"prefill logits: rel err {rel:.3f} over the first {end} positions"

    def score(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1].float()

    bf16_tie.assert_same_or_bf16_tie(score, want, got, PROMPTS, bf16_tie.router_tie_in(hf))


@pytest.mark.parametrize(("fmt", "group", "sym", "desc_act"), [
    ("awq", 128, False, False), ("gptq", 64, True, True), ("compressed-tensors", 32, False, False),
    ("gptq_v2", -1, False, False),
])
def test_int4_dense_model_on_the_gpu(tiny_model_path: Callable[[str], Path], tmp_path: Path, fmt: str,
                                     group: int, sym: bool, desc_act: bool) -> None:
    src = tiny_models.build_tiny_model(SPEC, tmp_path / "src", tiny_model_path("llama3"))
    q, deq = ck.write_quant4(src, tmp_path / "q", tmp_path / "deq", fmt, group, sym, desc_act, seed=7)
    _check(q, deq)


@pytest.mark.parametrize(("name", "fmt", "sym"), [("qwen3_moe", "awq", False), ("qwen2_moe", "gptq", True)])
def test_int4_moe_model_on_the_gpu(tiny_model_path: Callable[[str], Path], tmp_path: Path, name: str, fmt: str,
                                   sym: bool) -> None:
    """The experts through the 4-bit fused MoE (no dequantized copy on the GPU)."""
    q, deq = ck.write_quant4(tiny_model_path(name), tmp_path / "q", tmp_path / "deq", fmt, 16, sym)
    _check(q, deq)


def test_gpt_oss_mxfp4_on_the_gpu(tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    """GPT-OSS's MXFP4 experts through the 4-bit fused MoE with biases and the clamped SwiGLU."""
    import dataclasses

    base = tiny_models.SPECS["gpt_oss"]
    # seed 10: its routers tie (within bf16_tie.ROUTER_TIE) late in the prompts, so the logits
    # compare over 25 of their 27 positions (seed 5: 8)
    spec = dataclasses.replace(base, name="gpt_oss_i64", seed=10, overrides={**base.overrides, "intermediate_size": 64})
    src = tiny_models.build_tiny_model(spec, tmp_path / "src", tiny_model_path("gpt_oss"))
    _check(*ck.write_gpt_oss_mxfp4(src, tmp_path / "q", tmp_path / "deq"))
