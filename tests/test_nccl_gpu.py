"""Tensor parallelism on two GPUs: our NCCL collectives, TP=2 against TP=1 offline and through
the server (one host, and two "nodes" of one GPU each)."""

from __future__ import annotations

import pytest
import torch
from bf16_tie import assert_same_or_bf16_tie, engine_scorer
from rank_scripts import free_port, run_ranks

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 6, 7, 8, 9] * 5, list(range(300, 317)), [42]]


def _one_gpu(path: str, max_tokens: int):  # noqa: ANN202 - (LLM, greedy ids of PROMPTS)
    """The TP=1 reference: one GPU, bf16, and its greedy answers to PROMPTS."""
    from minisgl import LLM, SamplingParams

    one = LLM(path, device="cuda", dtype="bfloat16")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return one, [o["token_ids"] for o in one.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("one_shot", [True, False], ids=["one-shot on", "NCCL only"])
def test_nccl_collectives_two_gpus(one_shot: bool) -> None:
    """Our NCCL communicator on two GPUs (tests/nccl_collectives_worker.py, one process per
    rank): all-reduce and all-gather exact for every dtype, 1 element to 256 MB, eager and
    under CUDA-graph replay; with the one-shot all-reduce on (small messages take it) and off
    (every size through NCCL)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    outs = run_ranks("nccl_collectives_worker.py", 2, timeout=240, args=["one-shot" if one_shot else "nccl"])
    assert all(f"rank {r}: ok" in outs[r] for r in range(2)), outs


# MoE models: every expert's intermediate dim sharded, one all-reduce per MoE block.
@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("custom_nccl", [True, False])
def test_tp2_gpu_equals_tp1(tiny_model_path, name: str, custom_nccl: bool) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from minisgl import LLM, SamplingParams

    path = str(tiny_model_path(name))
    one, want = _one_gpu(path, 12)
    two = LLM(path, device="cuda", dtype="bfloat16", tp_size=2, custom_nccl=custom_nccl)
    try:
        # With our NCCL, the tiny models' all-reduces (a few KB) take the one-shot path.
        assert (getattr(two.engine.comm, "custom", None) is not None) == custom_nccl
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = [o["token_ids"] for o in two.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        two.shutdown()
    # bf16 partial sums reduced in another order: a flip is allowed only at a near-tie of the
    # TP=1 logits at the step where the sequences first differ.
    assert_same_or_bf16_tie(engine_scorer(one), want, got, PROMPTS)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe"])
def test_tp4_gpu_equals_tp1(tiny_model_path, name: str) -> None:
    """TP 4 on four GPUs (benchmarks/gpu_suite.sh --four-gpu tp4_tests): fewer KV heads than
    ranks (each rank keeps one replicated head), the one-shot all-reduce at world 4 and its
    fused add + RMSNorm."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    from minisgl import LLM, SamplingParams

    path = str(tiny_model_path(name))
    one, want = _one_gpu(path, 12)
    four = LLM(path, device="cuda", dtype="bfloat16", tp_size=4)
    try:
        assert getattr(four.engine.comm, "custom", None) is not None
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = [o["token_ids"] for o in four.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        four.shutdown()
    assert_same_or_bf16_tie(engine_scorer(one), want, got, PROMPTS)


def _server_ids(http, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:  # noqa: ANN001
    """Greedy output ids from the native /generate endpoint (the OpenAI API returns text only)."""
    out = []
    for ids in prompts:
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        out.append(r.json()["output_ids"])
    return out


def test_server_tp2_gpu_equals_one_gpu(tiny_model_path, tmp_path) -> None:
    """`python -m minisgl.serve --tp 2` on two GPUs (bf16, our CUDA attention, CUDA graphs, our
    NCCL) answers what one GPU answers, up to a bf16 near-tie; the openai client gets the same."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import httpx
    import openai
    from server_harness import Server, child_pids

    path = str(tiny_model_path("qwen3"))
    one, want = _one_gpu(path, 16)
    server = Server("--model", path, "--device", "cuda", "--tp", "2", "--dtype", "bfloat16", cwd=tmp_path)
    try:
        assert len(child_pids(server.proc.pid)) >= 4  # scheduler ranks 0 and 1, tokenizer, detokenizer
        with httpx.Client(base_url=server.url, timeout=120) as http:
            got = _server_ids(http, PROMPTS, 16)
            native = http.post("/generate", json={"text": "Hello there", "sampling_params": {
                "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}).json()["text"]
        assert_same_or_bf16_tie(engine_scorer(one), want, got, PROMPTS)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)
        model = client.models.list().data[0].id
        kw = dict(model=model, prompt="Hello there", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(**kw).choices[0].text == native
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == native
    finally:
        assert server.stop() == 0, server.output[-3000:]


def test_two_nodes_one_gpu_each(tiny_model_path, tmp_path) -> None:
    """--nnodes 2 on one host: node 0 (GPU 0) serves, node 1 (GPU 1) joins over the rendezvous;
    answers equal one GPU's up to a bf16 near-tie."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import os
    import re
    import subprocess
    import sys
    import time

    import httpx

    path = str(tiny_model_path("llama3"))
    one, want = _one_gpu(path, 12)
    addr = f"127.0.0.1:{free_port()}"
    common = [sys.executable, "-m", "minisgl.serve", "--model", path, "--dtype", "bfloat16", "--tp", "2",
              "--nnodes", "2", "--dist-init-addr", addr]
    procs = []
    try:
        for node in (1, 0):
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(node)}
            cmd = common + ["--node-rank", str(node)] + (["--port", "0"] if node == 0 else [])
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT))
        url = None
        deadline = time.monotonic() + 240
        lines: list[str] = []
        for line in procs[1].stdout:  # node 0
            lines.append(line)
            m = re.search(r"serving \S+ at (http://\S+)", line)
            if m:
                url = m.group(1)
                break
            if time.monotonic() > deadline:
                break
        assert url, "node 0 never became ready:\n" + "".join(lines[-30:])
        with httpx.Client(base_url=url, timeout=120) as http:
            got = _server_ids(http, PROMPTS, 12)
        assert_same_or_bf16_tie(engine_scorer(one), want, got, PROMPTS)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
