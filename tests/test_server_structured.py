"""Structured output, tool calls and reasoning through the real server with the official openai
client (tiny random-weight Qwen3, CPU, its real chat template): JSON schemas validate, streamed
and not, n = 3, mixed with unconstrained requests; tool_choice "required" and a named function
give valid calls streamed as OpenAI streams them; a conversation with tool results goes through
the template; chat_template_kwargs reach it; grammars xgrammar rejects are 400s naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_harness import Server

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 20},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["id"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["kind", "age", "owner", "tags"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}},
]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}  # the grammar starts at once
MSGS = [{"role": "user", "content": "Describe a pet."}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_path: Callable[[str], Path]) -> Path:
    return tiny_model_path("qwen3")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    s = Server("--model", str(model_dir), "--served-model-name", "tiny", "--reasoning-parser", "qwen3",
               "--num-pages", "8192", cwd=tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_tool_parser_detected_from_template(server: Server) -> None:
    assert "tool-call parser: hermes (from the chat template)" in server.output


def test_json_schema_n3_streamed_and_not_mixed_with_plain(client: openai.OpenAI) -> None:
    def constrained(seed: int):
        return client.chat.completions.create(model="tiny", messages=MSGS, response_format=FORMAT, n=3, seed=seed,
                                              max_tokens=80, extra_body=NO_THINK)

    def plain(seed: int):
        return client.chat.completions.create(model="tiny", messages=MSGS, seed=seed, max_tokens=8)

    with ThreadPoolExecutor(3) as pool:  # constrained and plain requests share batches
        futs = [pool.submit(plain, 2), pool.submit(constrained, 1), pool.submit(plain, 4)]
        outs = [f.result() for f in futs]
    assert len(outs[1].choices) == 3
    for c in outs[1].choices:
        assert c.finish_reason == "stop" and c.message.reasoning_content is None
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert outs[0].choices[0].finish_reason == "length" and outs[2].choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model="tiny", messages=MSGS, response_format=FORMAT, seed=5,
                                            max_tokens=80, stream=True, extra_body=NO_THINK)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_regex_and_ebnf(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="tiny", messages=MSGS, response_format={"type": "json_object"},
                                         max_tokens=60, seed=1, temperature=0.0, extra_body=NO_THINK)
    text = out.choices[0].message.content  # free keys: a random model may not close them in time
    assert text.startswith("{") and (out.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=30, seed=2,
                                         extra_body={**NO_THINK, "regex": "(red|blue)-[0-9]{2}"})
    assert out.choices[0].message.content in {f"{c}-{i:02d}" for c in ("red", "blue") for i in range(100)}
    out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=30, seed=3,
                                         extra_body={**NO_THINK, "ebnf": 'root ::= "ok" | "no" " " [a-c]'})
    assert out.choices[0].message.content in ("ok", "no a", "no b", "no c")


def _check_call(call, names: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    for parallel in (False, True):
        out = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, tool_choice="required", seed=1,
                                             max_tokens=100, parallel_tool_calls=parallel, extra_body=NO_THINK)
        c = out.choices[0]
        calls = c.message.tool_calls
        assert calls and c.message.content is None
        if parallel and c.finish_reason == "length":  # a random model may go on calling: the last one is cut
            calls = calls[:-1]
        else:
            assert c.finish_reason == "tool_calls" and (parallel or len(calls) == 1)
        for call in calls:
            _check_call(call, {"get_weather", "get_time"})
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, tool_choice=named, seed=2,
                                         max_tokens=80, parallel_tool_calls=False, extra_body=NO_THINK)
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and out.choices[0].finish_reason == "tool_calls"
    _check_call(calls[0], {"get_time"})


def test_tool_calls_streamed_as_openai_does(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, seed=4, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True, extra_body=NO_THINK)
    pieces = [d for chunk in stream if chunk.choices for d in (chunk.choices[0].delta.tool_calls or [])]
    first = pieces[0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert first.function.arguments == "" and len(pieces) > 2  # id and name first, arguments in pieces
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    args = "".join(p.function.arguments for p in pieces)
    jsonschema.validate(json.loads(args), TOOLS[0]["function"]["parameters"])


def test_conversation_with_tool_results_renders(client: openai.OpenAI, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    out = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=4, seed=0,
                                         extra_body=NO_THINK)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    # What the server renders: content None as "", the arguments as an object.
    args = {"city": "Paris", "days": 1}
    rendered = [msgs[0], {**msgs[1], "content": "", "tool_calls": [{**call, "function": {"name": "get_weather",
                                                                                          "arguments": args}}]},
                msgs[2]]
    text = tok.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert "<tool_response>" in text and '"temp_c": 21' in text and "get_weather" in text
    assert out.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)
    thinking = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=4, seed=0)
    assert thinking.usage.prompt_tokens < out.usage.prompt_tokens  # no empty think block: the kwargs arrived


BAD_GRAMMARS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format"),
    ({"regex": "a("}, "regex"),
    ({"ebnf": "root ::= foo"}, "ebnf"),
]


@pytest.mark.parametrize(("bad", "param"), BAD_GRAMMARS, ids=[p for _, p in BAD_GRAMMARS])
def test_bad_grammar_is_400_naming_the_field_and_serving_goes_on(
    client: openai.OpenAI, bad: dict, param: str
) -> None:
    """xgrammar parses a grammar in the scheduler's compiler alone (the API process stays
    torch-free); the server still answers 400 naming the request's field, streamed or not,
    before anything is generated, and the grammar is never queued."""
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, stream=stream, extra_body=bad)
        body = e.value.body
        assert e.value.status_code == 400 and body["param"] == param, body
        assert body["message"].startswith(f"{param}: invalid ("), body
    out = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
    assert out.choices[0].finish_reason == "length"  # the server carries on


def test_completions_and_generate_constrained_over_many_seeds(server: Server, client: openai.OpenAI) -> None:
    """The same grammar machinery on /v1/completions (OpenAI's, SGLang's and vLLM's fields) and
    /generate (SGLang's sampling_params): every sample of many seeds follows its constraint."""
    regex = r"(red|blue)-[0-9]{2}"
    for extra in ({"response_format": FORMAT}, {"structured_outputs": {"json": SCHEMA}}):
        out = client.completions.create(model="tiny", prompt="A pet:", max_tokens=80, n=4, seed=11, extra_body=extra)
        for c in out.choices:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), SCHEMA)
    for extra in ({"regex": regex}, {"structured_outputs": {"regex": regex}}):
        out = client.completions.create(model="tiny", prompt="Color:", max_tokens=20, n=8, seed=21, extra_body=extra)
        assert all(re.fullmatch(regex, c.text) for c in out.choices), [c.text for c in out.choices]
    choices = ["yes", "no", 'a "quoted" maybe']
    out = client.completions.create(model="tiny", prompt="Answer:", max_tokens=20, n=8, seed=31,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices for c in out.choices)
    stream = client.completions.create(model="tiny", prompt="A pet:", max_tokens=80, seed=41, stream=True,
                                       extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream if c.choices)), SCHEMA)
    ebnf = 'root ::= "ok" | "no" " " [a-c]'
    kinds = {"json_schema": json.dumps(SCHEMA), "regex": regex, "ebnf": ebnf}

    def generate(key: str, seed: int) -> str:
        sp = {key: kinds[key], "max_new_tokens": 80, "seed": seed, "temperature": 1.0}
        r = httpx.post(f"{server.url}/generate", json={"text": "Describe a pet:", "sampling_params": sp}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["text"]

    with ThreadPoolExecutor(12) as pool:  # batched together, as clients would send them
        # JSON costs the CPU most (longest outputs): fewer seeds of it
        texts = {(k, s): pool.submit(generate, k, s) for k in kinds for s in range(4 if k == "json_schema" else 8)}
    for (key, _), fut in texts.items():
        text = fut.result()
        if key == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(regex if key == "regex" else "ok|no [a-c]", text), (key, text)


@pytest.mark.parametrize(("route", "bad", "param"), [
    ("/v1/completions", {"regex": "a("}, "regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar"),
    ("/generate", {"sampling_params": {"ebnf": "root ::= foo"}}, "sampling_params.ebnf"),
])
def test_bad_grammar_on_completions_and_generate_is_400_naming_the_field(
    server: Server, route: str, bad: dict, param: str
) -> None:
    prompt = {"text": "hi"} if route == "/generate" else {"prompt": "hi"}
    r = httpx.post(f"{server.url}{route}", json={**prompt, **bad}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
