"""Speculative decoding through the real server (tiny model on the CPU, the target as its own
draft so several tokens are accepted per step) with the openai client: greedy text equals
the offline non-speculative text, several tokens arrive in one stream chunk, a stop string
inside an accepted run ends the text and the token count there, logprobs come for every
token, n > 1 works, and /metrics reports proposed and accepted draft tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import Server, greedy, metric

from minisgl import LLM

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_path: Callable[[str], Path]) -> Path:
    return tiny_model_path("llama3")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    s = Server("--model", str(model_dir), "--dtype", "float32", "--served-model-name", "tiny",
               "--speculative-algorithm", "draft", "--speculative-draft-model", str(model_dir),
               "--speculative-num-draft-tokens", "3", cwd=tmp_path_factory.mktemp("spec_server"))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32")


def test_greedy_text_streaming_and_logprobs(client: openai.OpenAI, llm: LLM) -> None:
    ref = greedy(llm, PROMPTS, 24, ignore_eos=True)
    kw = {"model": "tiny", "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    for prompt, want in zip(PROMPTS, ref, strict=True):
        out = client.completions.create(prompt=prompt, logprobs=0, **kw)
        assert out.choices[0].text == want["text"]
        assert out.usage.completion_tokens == 24
        assert len(out.choices[0].logprobs.token_logprobs) == 24
        chunks = [c for c in client.completions.create(prompt=prompt, stream=True, logprobs=0, **kw) if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == want["text"]
        per_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs]
        assert sum(per_chunk) == 24 and max(per_chunk) > 1, "an accepted run arrives as one chunk"
    out = client.completions.create(prompt=PROMPTS[0], n=2, **kw)
    assert [c.text for c in out.choices] == [ref[0]["text"]] * 2


def test_stop_string_inside_an_accepted_run(client: openai.OpenAI, llm: LLM) -> None:
    full = greedy(llm, [PROMPTS[2]], 24, ignore_eos=True)[0]
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = greedy(llm, [PROMPTS[2]], 24, ignore_eos=True, stop=[stop])[0]
    assert want["finish_reason"] == "stop" and len(want["token_ids"]) < 24
    out = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == want["text"] and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(want["token_ids"])


def test_metrics_report_speculation(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        proposed = metric(http, "minisgl_spec_draft_tokens_total")
        assert proposed > 0
        assert metric(http, "minisgl_spec_accepted_tokens_total") == proposed  # the target drafts for itself
        assert metric(http, "minisgl_spec_mean_accepted_length") > 2


def test_metrics_sum_the_replicas_counts() -> None:
    """With --dp every replica reports its own cumulative counts: /metrics adds them up."""
    from prometheus_client import generate_latest

    from minisgl.message import StatsMsg
    from minisgl.server.metrics import Metrics

    m = Metrics()
    for rank, proposed, accepted, verified in ((0, 10, 6, 4), (1, 20, 10, 5), (0, 12, 7, 5)):
        m.on_stats(StatsMsg(1, 0, 10, 100, 0, 0, dp_rank=rank, spec_proposed=proposed, spec_accepted=accepted,
                            spec_verified=verified))
    text = generate_latest(m.registry).decode()
    assert "minisgl_spec_draft_tokens_total 32.0" in text
    assert "minisgl_spec_accepted_tokens_total 17.0" in text
    assert "minisgl_spec_mean_accepted_length 2.7" in text
