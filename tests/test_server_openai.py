"""Issue 14 against the real server (tiny random model, CPU) with the official openai client:
the model's sampling defaults, the utility routes, stop handling, large inputs that neither
stall other requests nor leave memory behind, and logprobs, penalties, logit_bias and
min_tokens (issue 14's device side) against transformers references, alone and in mixed batches.

The model folder is the tiny llama3 with a generation_config.json that says temperature 0 and
a 64k context (so large prompts reach the tokenizer instead of being refused by length).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_harness import Server, model_variant

pytestmark = pytest.mark.slow
NAME = "tiny"
CONTEXT = 65536


@pytest.fixture(scope="module")
def model_dir(tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("greedy_default") / "llama3"
    return model_variant(tiny_model_path("llama3"), out, {"temperature": 0.0, "top_k": 5},
                         {"max_position_embeddings": CONTEXT})


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    args = ["--model", str(model_dir), "--served-model-name", NAME, "--num-tokenizers", "1",
            "--max-running-requests", "16"]
    s = Server(*args, cwd=tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=120)


@pytest.fixture(scope="module")
def tok(model_dir: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def hf(model_dir: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_defaults_come_from_generation_config(server: Server, client: openai.OpenAI, http: httpx.Client) -> None:
    card = http.get(f"/v1/models/{NAME}").json()
    assert card["sampling_defaults"]["temperature"] == 0.0 and card["sampling_defaults"]["top_k"] == 5
    assert re.search(r"sampling defaults \(--sampling-defaults model\): temperature=0.0 \(model\)", server.output)
    # No temperature in the request: the model's 0 applies, so it is greedy (n choices agree).
    kw = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(n=3, **kw)
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    assert [c.text for c in out.choices] == [greedy] * 3
    hot = client.completions.create(temperature=1.5, top_p=1, n=3, seed=1, **kw)  # the request wins
    assert len({c.text for c in hot.choices}) > 1


def test_tokenize_detokenize_match_the_tokenizer(http: httpx.Client, tok) -> None:  # noqa: ANN001
    text = "Hello, 世界 😀"
    r = http.post("/tokenize", json={"prompt": text}).json()
    assert r == {"count": len(tok(text).input_ids), "max_model_len": CONTEXT, "tokens": tok(text).input_ids}
    messages = [{"role": "user", "content": "hi"}]
    want = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids
    assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == want
    assert http.post("/detokenize", json={"tokens": want}).json() == {"prompt": tok.decode(want)}
    assert http.get("/version").json()["version"]
    assert http.get("/v1/models/other").json()["error"]["code"] == "model_not_found"


def test_include_stop_str_and_stop_tokens(client: openai.OpenAI, tok) -> None:  # noqa: ANN001
    kw = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text
    stop = full[3:6]
    cut = client.completions.create(stop=[stop], extra_body={"ignore_eos": True}, **kw).choices[0]
    kept = client.completions.create(
        stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True}, **kw
    ).choices[0]
    at = full.index(stop)
    assert (cut.text, cut.finish_reason) == (full[:at], "stop")
    assert (kept.text, kept.finish_reason) == (full[: at + len(stop)], "stop")
    ids = tok(full, add_special_tokens=False).input_ids
    stop_id = ids[2]
    first = client.completions.create(extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}, **kw)
    with_it = client.completions.create(
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "include_stop_str_in_output": True}, **kw
    )
    assert with_it.choices[0].text == first.choices[0].text + tok.decode([stop_id])  # the stop token's text
    assert first.usage.completion_tokens == with_it.usage.completion_tokens  # counted either way


def test_echo(client: openai.OpenAI) -> None:
    kw = {"model": NAME, "prompt": "Echo this:", "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**kw).choices[0].text
    assert client.completions.create(echo=True, **kw).choices[0].text == "Echo this:" + plain
    stream = client.completions.create(echo=True, stream=True, **kw)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "Echo this:" + plain


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def test_large_input_neither_stalls_nor_bloats(server: Server, http: httpx.Client) -> None:
    tokenizer_pid = int(re.search(r"tokenizer0 ready \(pid (\d+)\)", server.output).group(1))
    assert http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2}).status_code == 200
    idle = rss_mb(tokenizer_pid)
    # ~3.5 MB: under the body limit and the length bound, so it is tokenized (in a child), and
    # then refused: it is ~600k tokens, past the 64k context.
    big = {"prompt": "hello world " * 300_000, "max_tokens": 2}
    result: dict[str, object] = {}

    def send_big() -> None:
        result["r"] = http.post("/v1/completions", json=big)
        result["done"] = time.monotonic()

    thread = threading.Thread(target=send_big)
    thread.start()
    time.sleep(0.5)  # the big one is being tokenized now
    t0 = time.monotonic()
    small = http.post("/v1/completions", json={"prompt": "small", "max_tokens": 2})
    took = time.monotonic() - t0
    thread.join(120)
    assert small.status_code == 200 and took < 2.0, took
    assert result["done"] > t0 + took  # the small one did pass the big one
    err = result["r"].json()["error"]
    assert result["r"].status_code == 400 and err["param"] == "prompt" and "context" in err["message"], err
    assert rss_mb(tokenizer_pid) < idle + 50, (idle, rss_mb(tokenizer_pid))
    # 50 MB: refused from its Content-Length (413) before it is read.
    body = json.dumps({"prompt": "x" * 50_000_000}).encode()
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert http.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2}).status_code == 200


def hf_top(hf, ids: list[int], k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """log_softmax of transformers' logits at every position of `ids`: (values, indices) top-k."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    return [lp[i].topk(k) for i in range(len(ids))], lp


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_match_transformers(client: openai.OpenAI, hf, tok, stream: bool) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3, stream=stream, extra_body={"ignore_eos": True})
    if stream:
        content = [c for chunk in out if chunk.choices and chunk.choices[0].logprobs
                   for c in chunk.choices[0].logprobs.content]
    else:
        content = out.choices[0].logprobs.content
    gen = hf_greedy(hf, prompt, 6)  # temperature 0: the tokens the server chose
    tops, lp = hf_top(hf, prompt + gen, 3)
    assert len(content) == 6
    for j, c in enumerate(content):
        at = len(prompt) - 1 + j
        values, indices = tops[at]
        text = tok.decode([gen[j]])
        if "\ufffd" not in text:  # a whole character: text and bytes are the plain ones
            assert c.token == text and bytes(c.bytes) == text.encode()
        assert c.logprob == pytest.approx(lp[at, gen[j]].item(), abs=1e-4)
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert c.top_logprobs[0].logprob == pytest.approx(lp[at, indices[0]].item(), abs=1e-4)


def test_echo_prompt_logprobs_match_transformers(http: httpx.Client, hf, tok) -> None:  # noqa: ANN001
    ids = tok("The quick brown fox jumps", add_special_tokens=False).input_ids
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}
    lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    _, ref = hf_top(hf, ids, 2)
    assert lp["token_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert sorted(lp["top_logprobs"][i].values())[-1] == pytest.approx(ref[i - 1].max().item(), abs=1e-4)


def hf_greedy(hf, ids: list[int], steps: int, presence: float = 0.0, frequency: float = 0.0,  # noqa: ANN001
              bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding with OpenAI's penalties and logit_bias written out by hand."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0, -1].double()
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        for t, b in (bias or {}).items():
            logits[t] += b
        out.append(int(logits.argmax()))
    return out


def test_penalties_bias_and_min_tokens(http: httpx.Client, hf, tok, model_dir: Path) -> None:  # noqa: ANN001
    ids = tok("the the the the", add_special_tokens=False).input_ids
    first = hf_greedy(hf, ids, 1)[0]
    cases = [
        ({"presence_penalty": 1.5}, {"presence": 1.5}),
        ({"frequency_penalty": 2.0}, {"frequency": 2.0}),
        ({"logit_bias": {str(first): -100}}, {"bias": {first: -100.0}}),
    ]
    for fields, ref in cases:
        want = hf_greedy(hf, ids, 6, **ref)
        sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, **fields}
        assert http.post("/generate", json={"input_ids": ids, "sampling_params": sp}).json()["output_ids"] == want
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **fields}
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == tok.decode(want)
    # min_tokens: an EOS forced by logit_bias comes only once min_tokens are out.
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    bias = {str(e): 100 for e in (eos if isinstance(eos, list) else [eos])}
    for min_tokens, want in ((0, 1), (4, 5)):
        body = {"prompt": ids, "max_tokens": 10, "logit_bias": bias, "min_tokens": min_tokens}
        r = http.post("/v1/completions", json=body).json()
        assert r["usage"]["completion_tokens"] == want and r["choices"][0]["finish_reason"] == "stop", r


def test_mixed_batch_equals_alone_and_repetition_penalty(server: Server, hf, tok) -> None:  # noqa: ANN001
    """Both halves of issue 14 end to end: requests with and without penalties, bias, logprob
    alternatives and prompt logprobs, sent at once, each get what they get alone; greedy with
    repetition_penalty equals transformers' generate with it."""
    from transformers import GenerationConfig

    ids = tok("the cat sat on the mat and the cat", add_special_tokens=False).input_ids
    base = {"model": NAME, "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    variants = [  # (OpenAI fields, vLLM extension fields)
        ({}, {}), ({"presence_penalty": 1.2, "frequency_penalty": 0.5}, {}), ({}, {"repetition_penalty": 0.5}),
        ({"logit_bias": {str(ids[-1]): -100}}, {}), ({}, {"prompt_logprobs": 1, "min_tokens": 3}),
    ]

    async def run(kws: list[tuple[dict, dict]]) -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(c.completions.create(**base, **kw, extra_body={"ignore_eos": True, **ext})
                                          for kw, ext in kws))

    alone = [asyncio.run(run([kw]))[0] for kw in variants]
    together = asyncio.run(run(variants * 2))
    for i, got in enumerate(together):
        want = alone[i % len(variants)].choices[0]
        assert got.choices[0].text == want.text and got.choices[0].logprobs.tokens == want.logprobs.tokens
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-4)
    cfg = GenerationConfig(max_new_tokens=6, do_sample=False, repetition_penalty=0.5, eos_token_id=None, pad_token_id=0)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)[0, len(ids):].tolist()
    assert alone[2].choices[0].text == tok.decode(ref) and alone[2].choices[0].text != alone[0].choices[0].text
    # vLLM's prompt_logprobs: per position None, else {id: {logprob, rank, decoded_token}}.
    prompt_lps = alone[4].choices[0].model_extra["prompt_logprobs"]
    _, lp = hf_top(hf, ids, 1)
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for i in range(1, len(ids)):
        assert prompt_lps[i][str(ids[i])]["logprob"] == pytest.approx(lp[i - 1, ids[i]].item(), abs=1e-4)
