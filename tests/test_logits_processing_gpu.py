"""On the GPU, through the engine: penalties, bias, min_tokens and logprobs with CUDA graphs and
overlap equal eager; the Triton penalty kernel inside the fp32 engine gives the CPU's tokens."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9] * 7, list(range(300, 317)), [42], list(range(1000, 1100))]


def params(eos_ids: tuple[int, ...], sampled: bool = True) -> list[SamplingParams]:
    out = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3, top_logprobs=5),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5,
                       logit_bias={7: -100.0, 11: 2.0}, prompt_logprobs=2),
        SamplingParams(max_tokens=16, temperature=0, min_tokens=6, logit_bias={t: 30.0 for t in eos_ids}),
    ]
    if sampled:  # the GPU and CPU samplers draw differently (Philox vs torch.Generator)
        out.append(SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=3, ignore_eos=True,
                                  frequency_penalty=1.0, repetition_penalty=0.8))
    return out


def run(llm: LLM, ps: list[SamplingParams]) -> list[dict]:
    prompts = [p for p in PROMPTS for _ in ps] * 2  # up to 40 requests: several graph sizes, padding
    return llm.generate(prompts, ps * len(PROMPTS) * 2, use_tqdm=False)


def assert_equal_runs(a: list[dict], b: list[dict], tol: float) -> None:
    for x, y in zip(a, b):
        assert x["token_ids"] == y["token_ids"]
        torch.testing.assert_close(x["logprobs"], y["logprobs"], rtol=tol, atol=tol)
        if "top_logprobs" in x:
            assert len(x["top_logprobs"]) == len(y["top_logprobs"])
            for ax, ay in zip(x["top_logprobs"], y["top_logprobs"]):
                dx, dy = dict(ax), dict(ay)
                # Alternatives within `tol` of each other may swap places (bf16 rounding), and
                # one within `tol` of the k-th may fall out; every other one must be there.
                assert {t for t, lp in dx.items() if lp > min(dx.values()) + tol} <= set(dy), (ax, ay)
                for t in set(dx) & set(dy):
                    assert abs(dx[t] - dy[t]) <= tol * (1 + abs(dx[t])), (t, dx[t], dy[t])
        if "prompt_logprobs" in x:
            torch.testing.assert_close([e[0] for e in x["prompt_logprobs"][1:]],
                                       [e[0] for e in y["prompt_logprobs"][1:]], rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_cuda_graphs_and_overlap_with_penalties_equal_eager(tiny_model_path, name: str) -> None:
    path = str(tiny_model_path(name))
    # fp32 (with triton attention: the CUDA decode kernel is 16-bit only). A graph pads the step
    # to its bucket, so the GEMMs see another M and may run another kernel (the skinny table);
    # in bf16 that rounding flipped near-tied tokens on the H100. In fp32 the paths agree to
    # ~1e-6, so tokens must be equal and logprobs within 1e-4.
    eager = LLM(path, device="cuda", dtype="float32", attention_backend="triton", disable_cuda_graph=True,
                disable_overlap=True)
    fast = LLM(path, device="cuda", dtype="float32", attention_backend="triton", cuda_graph_max_bs=8)
    assert fast.engine.graphs is not None and fast.scheduler.cfg.overlap
    ps = params(eager.model_config.eos_token_ids)
    a, b = run(eager, ps), run(fast, ps)
    assert_equal_runs(a, b, 1e-4)
    # min_tokens held on the graph path too: 6 tokens, then the forced EOS.
    for o in b[3 :: len(ps)]:
        assert len(o["token_ids"]) == 7 and o["finish_reason"] == "stop"
    fast.scheduler.check_integrity()


def test_triton_penalty_kernel_in_the_engine_equals_cpu(tiny_model_path) -> None:
    path = str(tiny_model_path("llama3"))
    cpu = LLM(path, device="cpu", dtype="float32")
    gpu = LLM(path, device="cuda", dtype="float32", attention_backend="torch")
    ps = params(cpu.model_config.eos_token_ids, sampled=False)
    assert_equal_runs(run(cpu, ps), run(gpu, ps), 1e-4)
