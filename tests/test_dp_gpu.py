"""Data parallelism on two GPUs (skipped with fewer): each replica on its own GPU, and the
same tokens as one replica (fp32 on the tiny model, whose greedy margins are wide)."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]
PROMPTS = [[5, 6, 7, 8, 9] * 9, list(range(300, 377)), [42], "Hello, my name is", "def fib(n):", [7] * 33]


def test_offline_dp2_uses_gpu_1_and_equals_dp1(tiny_model_path) -> None:
    path = str(tiny_model_path("llama3"))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = LLM(path, device="cuda", dtype="float32")
    want = one.generate(PROMPTS, params, use_tqdm=False)
    one.shutdown()
    free_before = torch.cuda.mem_get_info(1)[0]
    two = LLM(path, device="cuda", dtype="float32", dp_size=2)
    try:
        assert torch.cuda.mem_get_info(1)[0] < free_before  # replica 1 holds memory on GPU 1
        assert two.engine.device == torch.device("cuda", 0)
        got = two.generate(PROMPTS, params, use_tqdm=False)
    finally:
        two.shutdown()
    # Equal results; the logprobs within rounding (the replicas' batches differ).
    assert [{k: v for k, v in r.items() if k != "logprobs"} for r in got] == [
        {k: v for k, v in r.items() if k != "logprobs"} for r in want]
    assert [r["logprobs"] for r in got] == [pytest.approx(r["logprobs"], abs=1e-3) for r in want]


def test_server_dp2_places_replicas_on_gpus_0_and_1(tiny_model_path, tmp_path) -> None:
    import httpx
    from server_harness import Server

    path = str(tiny_model_path("llama3"))
    want = LLM(path, device="cuda", dtype="float32").generate(
        ["Hello there", "The quick brown fox"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    # Server() adds --device cpu; a later --device wins in argparse.
    server = Server("--model", path, "--dp", "2", "--dtype", "float32", "--device", "cuda", cwd=tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            assert http.get("/server_info").json()["devices"] == ["cuda:0", "cuda:1"]
            for prompt, ref in zip(["Hello there", "The quick brown fox"], want):
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                       "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == ref["text"]
    finally:
        assert server.stop() == 0
