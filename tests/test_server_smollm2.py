"""The server with its built-in default model (SmolLM2-135M-Instruct, no --model), on CPU,
with --num-tokenizers 0 (the detokenizer tokenizes)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import Server

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    s = Server("--num-tokenizers", "0", "--max-model-len", "2048", cwd=tmp_path_factory.mktemp("smollm2"))
    yield s
    assert s.stop(signal.SIGTERM) == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Any:
    from minisgl.models.source import resolve_model
    from minisgl.tokenizer.load import load_tokenizer

    return load_tokenizer(resolve_model(None))


def test_default_model_answers(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    assert model.startswith("SmolLM2-135M-Instruct")
    out = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    answer = out.choices[0].message.content
    assert "Paris" in answer and out.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer


def test_non_ascii_round_trip(server: Server, tok: Any) -> None:
    messages = [{"role": "user", "content": "Translate into Chinese, then add two emoji: thank you 谢谢 🙂"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    out = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
    # The prompt's CJK and emoji arrived intact: the server counted the same tokens.
    assert out["meta_info"]["prompt_tokens"] == len(tok(prompt).input_ids)
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["text"] == out["text"]
    assert all("\ufffd" not in e["text"] for e in events) or "\ufffd" in out["text"]


def test_model_card_defaults_make_the_readme_curl_answer(server: Server, client: openai.OpenAI) -> None:
    """SmolLM2's GGUF has no generation config: its model card's temperature 0.2 / top_p 0.9
    apply to requests that leave them out (the README's curl), not OpenAI's temperature 1."""
    model = client.models.list().data[0].id
    card = httpx.get(f"{server.url}/v1/models/{model}", timeout=60).json()
    assert (card["sampling_defaults"]["temperature"], card["sampling_defaults"]["top_p"]) == (0.2, 0.9)
    assert "temperature=0.2 (model), top_p=0.9 (model)" in server.output
    out = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, seed=1)
    assert "Paris" in out.choices[0].message.content
