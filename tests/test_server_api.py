"""The real server (tiny random model, CPU) driven with the openai client and plain HTTP."""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import Server, alive, child_pids, greedy, metric, sse_events, wait_for

from minisgl import LLM, SamplingParams

pytestmark = pytest.mark.slow
KEY = "sk-test"
NAME = "tiny"
PROMPTS = ["Hello, my name is", "The capital of France is", "你好，世界！😀 emoji 🎉 and CJK 漢字", "def fib(n):",
           "Once upon a time", "Ünïcödé façade — naïve"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_path: Callable[[str], Path]) -> Path:
    return tiny_model_path("llama3")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    args = ["--model", str(model_dir), "--served-model-name", NAME, "--api-key", KEY, "--num-tokenizers", "2"]
    s = Server(*args, cwd=tmp_path_factory.mktemp("server"))
    yield s
    s.stop()  # a no-op when test_sigterm_stops_everything already stopped it


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu")


def test_models_and_health(server: Server, http: httpx.Client) -> None:
    assert http.get("/v1/models").json()["data"][0]["id"] == NAME
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed


def test_api_key_enforced(server: Server) -> None:
    for path, headers in (("/v1/models", {}), ("/metrics", {}), ("/v1/models", {"Authorization": "Bearer nope"})):
        assert httpx.get(server.url + path, headers=headers).status_code == 401
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_completions_greedy_match_offline(client: openai.OpenAI, llm: LLM) -> None:
    ref = greedy(llm, PROMPTS, 16)
    for prompt, want in zip(PROMPTS, ref, strict=True):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
        choice = out.choices[0]
        assert choice.text == want["text"]
        assert choice.finish_reason == ("length" if len(want["token_ids"]) == 16 else "stop")
        assert out.usage.prompt_tokens == len(llm.tokenizer(prompt).input_ids)
        assert out.usage.completion_tokens == len(want["token_ids"])
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        assert out.model == NAME and out.id.startswith("cmpl-") and out.created > 0
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want["text"]
    ids = llm.tokenizer(PROMPTS[0]).input_ids  # a prompt of token ids
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == greedy(llm, [ids], 8)[0]["text"]


def test_chat_matches_offline_and_streams(client: openai.OpenAI, http: httpx.Client, llm: LLM) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say it in 中文 🙂"}]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer(text, add_special_tokens=False).input_ids
    want = greedy(llm, [ids], 20)[0]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == want["text"]
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"

    body = {"model": NAME, "messages": messages, "max_tokens": 20, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(r.iter_lines()))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert content == want["text"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] in ("stop", "length")
    usage = events[-1]["usage"]
    # The second asking finds all of the prompt but its last token in the prefix cache (pages of 1).
    assert usage.pop("prompt_tokens_details") == {"cached_tokens": out.usage.prompt_tokens - 1}
    first = out.usage.model_dump(exclude_none=True, exclude={"prompt_tokens_details"})
    assert events[-1]["choices"] == [] and usage == first
    assert all(e["usage"] is None for e in events[:-1])


def test_stop_strings_across_tokens(client: openai.OpenAI, llm: LLM) -> None:
    prompt = PROMPTS[1]
    full = greedy(llm, [prompt], 32, ignore_eos=True)[0]
    tok = llm.tokenizer
    # A stop string straddling the boundary after a clean token prefix.
    for k in range(3, len(full["token_ids"])):
        b = len(tok.decode(full["token_ids"][:k]))
        if tok.decode(full["token_ids"][:k]) == full["text"][:b] and b >= 2:
            stop = full["text"][b - 2 : b + 2]
            if len(stop) == 4 and full["text"].find(stop) == b - 2 and "\ufffd" not in stop:
                break
    else:
        pytest.skip("no clean token boundary in the output")
    want = full["text"][: b - 2]
    assert greedy(llm, [prompt], 32, ignore_eos=True, stop=[stop])[0]["text"] == want
    kw = {"model": NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(stop=[stop, "never-seen"], **kw)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    chunks = client.completions.create(stop=stop, stream=True, **kw)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want


def test_stop_token_ids(client: openai.OpenAI, llm: LLM) -> None:
    full = greedy(llm, [PROMPTS[4]], 16, ignore_eos=True)[0]
    stop_id = full["token_ids"][3]
    first = full["token_ids"].index(stop_id)
    extra = {"stop_token_ids": [stop_id], "ignore_eos": True}
    out = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=16, temperature=0, extra_body=extra)
    assert out.usage.completion_tokens == first + 1
    assert out.choices[0].finish_reason == "stop"


def test_n_choices_and_seeds(client: openai.OpenAI, llm: LLM) -> None:
    kw = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "n": 3}
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    c = client.completions.create(seed=8, **kw)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    texts = [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) > 1  # each choice samples on its own
    assert texts == [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]  # seeded: reproducible
    assert texts != [ch.text for ch in sorted(c.choices, key=lambda ch: ch.index)]
    # The prompt counts once, the completions of every choice add up.
    d = client.completions.create(seed=9, extra_body={"ignore_eos": True}, **kw)
    assert d.usage.completion_tokens == 3 * 8
    assert d.usage.prompt_tokens == len(llm.tokenizer(PROMPTS[0]).input_ids)
    # Choice 0 uses the seed as given: the offline LLM with that seed agrees.
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    assert llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]["text"] == texts[0]


def test_sampling_options_reproducible(client: openai.OpenAI, llm: LLM) -> None:
    kw = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 123,
          "extra_body": {"top_k": 20, "min_p": 0.02}}
    a = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == a
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, seed=123)
    assert llm.generate([PROMPTS[3]], params, use_tqdm=False)[0]["text"] == a


def test_priority_under_fcfs(client: openai.OpenAI) -> None:
    """vLLM's request field: accepted at 0 (every request's priority under fcfs), else a 400 that
    says which policy it needs rather than an order the server would not keep."""
    out = client.completions.create(model=NAME, prompt="hi", max_tokens=1, extra_body={"priority": 0})
    assert out.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority") as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"priority": -1})
    assert e.value.body["param"] == "priority"


def test_logprobs(client: openai.OpenAI, http: httpx.Client) -> None:
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logprobs=True
    )
    lps = out.choices[0].logprobs.content
    assert len(lps) == out.usage.completion_tokens and all(t.logprob <= 0 for t in lps)
    assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token and t.top_logprobs == [] for t in lps)
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "logprobs": 0, "ignore_eos": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 5 and lp["text_offset"][0] == 0
    assert [list(d.values()) for d in lp["top_logprobs"]] == [[x] for x in lp["token_logprobs"]]  # the chosen one
    chat = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}  # without logprobs: true
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
BAD_FIELDS = (("max_tokens", 0), ("max_completion_tokens", 0), ("max_tokens", 100000), ("temperature", -1),
              ("top_p", 0), ("top_k", -5), ("min_p", 2), ("temperature", "hot"), ("presence_penalty", 2.5),
              ("frequency_penalty", -3), ("repetition_penalty", 0), ("n", 0), ("seed", 2**70), ("n", True),
              ("temperature", "0.5"), ("logit_bias", {"x": 1}), ("logit_bias", {"99999999": 1}),
              ("top_logprobs", 21), ("min_tokens", -1), ("stop_token_ids", [2**64]), ("tools", []))
BAD_INPUTS = [(CHAT, {"messages": HI, k: v}, k) for k, v in BAD_FIELDS] + [
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": HI, "stream": True, "max_tokens": 100000}, "max_tokens"),
    (CMPL, {"prompt": "hello " * 600}, "prompt"),
    (CMPL, {"prompt": "hello " * 600, "stream": True}, "prompt"),
    (CMPL, {"prompt": [10**9]}, "prompt"),
    (CMPL, {"prompt": ""}, "prompt"),
    (CMPL, {"prompt": "hi", "stop": [""]}, "stop[0]"),
    (CMPL, {"prompt": "hi", "suffix": "!"}, "suffix"),
    (CMPL, {"prompt": [5, 99999999999999999999999]}, "prompt"),
    (CMPL, {"prompt": [[5, 18446744073709551616]]}, "prompt"),
    (CMPL, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (CMPL, {"prompt": "hi", "best_of": 2}, "best_of"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ("/generate", {"sampling_params": {}}, "text"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "text"),
    ("/generate", {"input_ids": [2**64]}, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    (CMPL, {"prompt": "hi", "priority": 3}, "priority"),  # the scheduler's: this server schedules fcfs
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "priority": "high"}, "priority"),
    ("/generate", {"text": "hi", "priority": 2**40}, "priority"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_INPUTS, ids=[f"{p}:{param}" for p, _, param in BAD_INPUTS])
def test_bad_input_gets_400(http: httpx.Client, path: str, body: dict, param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or (param == "text" and err["param"] is None), err
    assert param.split(".")[-1].split("[")[0] in err["message"]
    assert err["type"] == "invalid_request_error"
    ok = http.post(CMPL, json={"prompt": "hi", "max_tokens": 2})  # the server still serves
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


# Sampling fields refused by the API process, with the exact 400 bodies the server gave before
# messages carried a typed SamplingParams (the request models, or SamplingParams' own checks).
REFUSED_SAMPLING = [
    (CHAT, {"temperature": -1}, "temperature: Input should be greater than or equal to 0", "temperature"),
    (CHAT, {"top_p": 2}, "top_p: Input should be less than or equal to 1", "top_p"),
    (CHAT, {"temprature": 0.5},
     "temprature: unknown field; the server refuses fields it does not implement rather than ignore them",
     "temprature"),
    (CMPL, {"min_tokens": 20, "max_tokens": 5}, "min_tokens must be an integer in [0, max_tokens=5], got 20",
     "min_tokens"),
    ("/generate", {"sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}},
     "sampling_params.min_new_tokens must be an integer in [0, max_tokens=3], got 9", "sampling_params.min_new_tokens"),
]


def test_malformed_sampling_is_refused_once_in_the_api(http: httpx.Client) -> None:
    """Refused in the API process, with the same body as always, and never sent on: no worker
    answers it (every reply from the workers is counted in minisgl_requests_total). The workers
    do not validate the sampling fields again (tests/test_server_units.py)."""

    def answered() -> float:
        text = http.get("/metrics").text
        return sum(float(v) for v in re.findall(r"^minisgl_requests_total\{[^}]*\} (\S+)$", text, re.M))

    before = answered()
    for path, fields, message, param in REFUSED_SAMPLING:
        prompt = {"messages": HI} if path == CHAT else {"prompt": "hi"} if path == CMPL else {"text": "hi"}
        for stream in (False, True):
            r = http.post(path, json={**prompt, **fields, "stream": stream})
            assert r.status_code == 400, r.text
            assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                          "code": None}}
    assert answered() == before
    assert http.post(CMPL, json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    assert answered() == before + 1  # the count does move when a worker answers


def test_malformed_json_and_wrong_model(http: httpx.Client) -> None:
    r = http.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http.post(CHAT, content=b'{"messages": "\xff"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    for r, status in ((http.get("/v1/nowhere"), 404), (http.put(CHAT), 405)):
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    err = http.post(CHAT, json={"model": "gpt-9", "messages": HI}).json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert http.post(CHAT, json={"model": "gpt-9", "messages": HI}).status_code == 404


def test_generate_native(http: httpx.Client, llm: LLM) -> None:
    want = greedy(llm, [PROMPTS[2]], 10)[0]
    sampling = {"max_new_tokens": 10, "temperature": 0}
    r = http.post("/generate", json={"text": PROMPTS[2], "sampling_params": sampling}).json()
    assert r["text"] == want["text"] and r["output_ids"] == want["token_ids"]
    ids = llm.tokenizer(PROMPTS[2]).input_ids
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 10, "temperature": 0}, "stream": True}
    with http.stream("POST", "/generate", json=body) as resp:
        events = sse_events(list(resp.iter_lines()))
    assert events[-1]["text"] == want["text"] and events[-1]["meta_info"]["finish_reason"]


def test_64_concurrent_streams(server: Server, llm: LLM) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(64)]
    want = [o["text"] for o in greedy(llm, prompts, 10)]

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)

        async def one(p: str) -> str:
            stream = await aclient.completions.create(model=NAME, prompt=p, max_tokens=10, temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(run()) == want


def test_disconnect_aborts_and_frees_slots(server: Server, http: httpx.Client) -> None:
    aborts = metric(http, "minisgl_requests_total", '{finish_reason="abort"}')
    body = {"prompt": "Hello", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", CMPL, json=body) as r:
        lines = r.iter_lines()
        _ = [next(lines) for _ in range(6)]  # a few tokens arrived: it is running
        assert wait_for(lambda: metric(http, "minisgl_kv_slots_used") > 0, 5)
    # Closing the stream closed the connection: the server aborts the request.
    assert wait_for(lambda: metric(http, "minisgl_kv_slots_used") == 0, 10)
    assert metric(http, "minisgl_num_requests_running") == 0
    assert metric(http, "minisgl_requests_total", '{finish_reason="abort"}') == aborts + 1
    # A non-streaming request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        http.post(CMPL, json={**body, "stream": False}, timeout=0.5)
    assert wait_for(lambda: metric(http, "minisgl_requests_total", '{finish_reason="abort"}') == aborts + 2, 10)
    assert wait_for(lambda: metric(http, "minisgl_kv_slots_used") == 0, 10)


def test_metrics(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    for name in ("minisgl_prompt_tokens_total", "minisgl_generation_tokens_total",
                 "minisgl_time_to_first_token_seconds_count", "minisgl_inter_token_latency_seconds_count",
                 "minisgl_kv_slots_total", "minisgl_num_requests_waiting", "minisgl_prefix_cache_hit_rate"):
        assert name in text
    assert metric(http, "minisgl_requests_total", '{finish_reason="length"}') > 0
    assert metric(http, "minisgl_generation_tokens_total") > 0
    assert metric(http, "minisgl_time_to_first_token_seconds_count") > 0
    assert metric(http, "minisgl_kv_slots_total") > 0


def test_sigterm_stops_everything(server: Server) -> None:
    """Last in the module: stops the shared server."""
    folder = re.search(r"IPC sockets in (\S+)", server.output).group(1)
    assert Path(folder).is_dir()
    kids = child_pids(server.proc.pid)
    assert len(kids) >= 4  # scheduler, detokenizer, 2 tokenizers
    assert server.stop(signal.SIGTERM) == 0
    assert wait_for(lambda: not any(alive(p) for p in kids), 10)
    assert not Path(folder).exists()
