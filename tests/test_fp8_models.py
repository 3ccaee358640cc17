"""FP8 checkpoints and --quantization fp8 on the CPU: our engine on an FP8 folder vs transformers
on the same weights dequantized to fp32. On the CPU the FP8 layers dequantize and multiply in
fp32 (activations unquantized), so the weights are bit-identical to the reference's: greedy
tokens equal and prefill logits within 1e-4 relative (the bound of tests/test_models_hf.py).

The tiny model has K = 192 and 320 (not multiples of 128: blocks straddle the edge), q/k/v parts
of 192/64/64 rows (fused parts not 128-aligned), and one MLP kept 16-bit by the ignore list.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import fp8_checkpoints as ck
import pytest
import tiny_models
import torch

from minisgl import LLM, SamplingParams
from minisgl.ops.gemm.fp8 import FP8

SPEC = tiny_models.TinySpec(
    "fp8_llama", "llama", "smollm2",
    {"hidden_size": 192, "intermediate_size": 320, "num_attention_heads": 6, "num_key_value_heads": 2,
     "head_dim": 32, "num_hidden_layers": 2, "tie_word_embeddings": False,
     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    seed=11,
)
PROMPTS = [[5, 6, 7, 8, 9] * 3, list(range(300, 311)), [42]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
IGNORE = {  # layer 1's MLP stays fp32, named as each format names it
    "block": ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"],
    "tensor": ["model.layers.1.mlp"],
    "channel": ["lm_head", "re:.*layers\\.1\\.mlp\\..*_proj$"],
}


@pytest.fixture(scope="module")
def src(tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    return tiny_models.build_tiny_model(SPEC, root / "src", tiny_model_path("llama3"))


def _hf_greedy_and_logits(folder: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    from test_models_hf import hf_greedy
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [hf(torch.tensor([p])).logits[0].float() for p in PROMPTS]
    return [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS], logits


def _check_against(llm: LLM, reference: Path) -> None:
    want_tokens, want_logits = _hf_greedy_and_logits(reference)
    got = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want_tokens
    for ours, ref in zip(llm.engine.score(PROMPTS), want_logits, strict=True):
        rel = (ours.cpu() - ref).abs().max() / ref.abs().max()
        assert rel <= 1e-4, f"rel err {rel:.2e}"


@pytest.mark.parametrize("fmt", ["block", "tensor", "channel"])
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(src: Path, tmp_path: Path, fmt: str) -> None:
    fp8 = ck.write_fp8(src, tmp_path / "fp8", fmt, ignored=("layers.1.mlp",), ignore=IGNORE[fmt])
    llm = LLM(str(fp8), device="cpu", dtype="float32")
    layers = llm.engine.model.model.layers
    assert layers[0].mlp.gate_up_proj.weight.dtype == FP8 and layers[0].self_attn.qkv_proj.weight.dtype == FP8
    assert layers[1].mlp.down_proj.weight.dtype == torch.float32  # ignored: 16-bit
    if fmt == "tensor":
        assert llm.engine.model.kv_scales[(1, "v_scale")] == 1.0
    _check_against(llm, ck.write_dequantized(fp8, tmp_path / "deq", fmt))


def test_online_fp8_matches_our_dequantized_weights(src: Path, tmp_path: Path) -> None:
    llm = LLM(str(src), device="cpu", dtype="float32", quantization="fp8")
    assert llm.engine.model.model.layers[1].mlp.down_proj.weight.dtype == FP8
    _check_against(llm, ck.write_online_reference(src, tmp_path / "ref"))


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_dummy_fp8_weights_have_the_real_shapes(src: Path, tmp_path: Path, quantization: str | None) -> None:
    folder = src if quantization else ck.write_fp8(src, tmp_path / "fp8", "block")
    llm = LLM(str(folder), device="cpu", dtype="float32", load_format="dummy", quantization=quantization)
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and tuple(qkv.weight.shape) == (192 + 64 + 64, 192)
    assert tuple(qkv.weight_scale.shape) == ((320, 2) if quantization is None else (320, 1))
    assert qkv.weight.float().abs().max() > 100  # drawn over the e4m3 range, not zeros
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]
    assert len(out) == GREEDY.max_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_fp8_checkpoint_on_the_gpu(src: Path, tmp_path: Path, fmt: str) -> None:
    """The GPU path quantizes activations too (lossy): prefill logits within 10% (max abs error
    over max |logit|) of transformers on the dequantized weights in fp32; greedy agreement is
    printed (FP8 activations may flip near-ties of a random tiny model)."""
    fp8 = ck.write_fp8(src, tmp_path / "fp8", fmt, ignored=("layers.1.mlp",), ignore=IGNORE[fmt])
    want_tokens, want_logits = _hf_greedy_and_logits(ck.write_dequantized(fp8, tmp_path / "deq", fmt))
    llm = LLM(str(fp8), device="cuda", dtype="bfloat16")
    try:
        got = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        scores = llm.engine.score(PROMPTS)
    finally:
        llm.shutdown()
    for ours, ref, g in zip(scores, want_logits, got, strict=True):
        err = (ours.float().cpu() - ref).abs().max()
        assert err / ref.abs().max() <= 0.1, f"{fmt}: rel err {err / ref.abs().max():.3f}"
        # Our first token is the reference's argmax, or a near-tie within twice the logit error
        # (the only way a greedy pick can flip under that error).
        last = ref[-1]
        assert last[g[0]] >= last.max() - 2 * err, f"{fmt}: first token {g[0]} not a near-tie of {last.argmax()}"
    same = sum(a == b for g, w in zip(got, want_tokens, strict=True) for a, b in zip(g, w, strict=True))
    print(f"{fmt}: greedy agreement with fp32 dequantized transformers {same}/{sum(map(len, want_tokens))}")
