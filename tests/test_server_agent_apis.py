"""Anthropic's Messages API and OpenAI's Responses API through the real server (tiny random-weight
Qwen3, CPU, its real chat template, hermes tool calls, qwen3 reasoning parser) with the official
clients: the `anthropic` SDK's messages.create, messages.stream, a tool-use round trip and
count_tokens; the `openai` SDK's responses.create, streamed and not, a function-call round trip and
a JSON-schema format. Greedy where a streamed and a whole answer must agree; tool calls and JSON
forced by their grammars, so the random model's output is checked against its schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from server_harness import Server

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
PET = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 20}},
    "required": ["kind", "age"],
}
NO_THINK = {"type": "disabled"}  # the template's thinking off: the grammar starts at once
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Server:
    s = Server(
        "--model",
        str(tiny_model_path("qwen3")),
        "--served-model-name",
        "tiny",
        "--reasoning-parser",
        "qwen3",
        "--api-key",
        "sk-test",
        "--num-pages",
        "8192",
        cwd=tmp_path_factory.mktemp("server"),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0, timeout=300)  # x-api-key


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0, timeout=300)


def test_messages_create_and_stream_agree(claude: anthropic.Anthropic) -> None:
    # This SDK no longer sends sampling fields (Anthropic's newer models take none); the server does.
    kw = {
        "model": "tiny",
        "max_tokens": 12,
        "messages": ASK,
        "extra_body": {"temperature": 0.0},
        "thinking": NO_THINK,
        "system": "You are terse.",
    }
    msg = claude.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason in ("max_tokens", "end_turn")
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert msg.usage.output_tokens >= 1 and msg.usage.input_tokens > 10
    with claude.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == msg.stop_reason
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in msg.content]
    assert final.usage.input_tokens == msg.usage.input_tokens
    count = claude.messages.count_tokens(model="tiny", messages=ASK, system="You are terse.", thinking=NO_THINK)
    assert count.input_tokens == msg.usage.input_tokens


def test_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tools = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER}]
    kw = {"model": "tiny", "max_tokens": 60, "tools": tools, "thinking": NO_THINK}
    msg = claude.messages.create(**kw, messages=ASK, tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    with claude.messages.stream(
        **kw, messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True}
    ) as stream:
        streamed = stream.get_final_message()
    (use,) = [b for b in streamed.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER)
    follow = [
        *ASK,
        {"role": "assistant", "content": msg.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": '{"temp_c": 21, "sky": "clear"}'}
            ],
        },
    ]
    answer = claude.messages.create(**{**kw, "max_tokens": 8}, messages=follow, extra_body={"temperature": 0.0})
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use")
    counted = claude.messages.count_tokens(model="tiny", messages=follow, tools=tools, thinking=NO_THINK)
    assert counted.input_tokens == answer.usage.input_tokens > msg.usage.input_tokens  # the result went in


def test_anthropic_errors(claude: anthropic.Anthropic, server: Server) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-x", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="tiny",
            max_tokens=4,
            messages=ASK,
            tool_choice={"type": "tool", "name": "x"},
            tools=[{"name": "y", "input_schema": {"type": "object"}}],
        )
    assert "tool_choice" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=ASK
        )


def test_responses_create_and_stream_agree(oai: openai.OpenAI) -> None:
    kw = {
        "model": "tiny",
        "input": "Say something.",
        "instructions": "You are terse.",
        "max_output_tokens": 12,
        "temperature": 0.0,
        "reasoning": {"effort": "none"},
    }
    resp = oai.responses.create(**kw)
    assert resp.status in ("completed", "incomplete") and resp.output[-1].type == "message"
    assert resp.usage.input_tokens > 5 and resp.usage.output_tokens >= 1
    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == resp.output_text == events[-1].response.output_text
    with oai.responses.stream(**kw) as stream:  # the SDK's accumulator checks the events' order
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(texts) == resp.output_text


def test_function_call_round_trip(oai: openai.OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": WEATHER,
            "strict": True,
        }
    ]
    kw = {"model": "tiny", "tools": tools, "reasoning": {"effort": "none"}, "max_output_tokens": 60}
    resp = oai.responses.create(**kw, input=ASK, tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [i for i in resp.output if i.type == "function_call"]
    assert call.name == "get_weather" and resp.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = [*ASK, *resp.output, {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}]
    answer = oai.responses.create(**{**kw, "max_output_tokens": 8}, input=follow, temperature=0.0)
    assert answer.status in ("completed", "incomplete") and answer.usage.input_tokens > resp.usage.input_tokens
    streamed = list(
        oai.responses.create(**kw, input=ASK, tool_choice="required", parallel_tool_calls=False, stream=True)
    )
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done and all(json.loads(e.arguments)["city"] in ("Paris", "Rome") for e in done)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="tiny", input="hi", store=True)
    assert e.value.body["param"] == "store"


def test_json_schema_format(oai: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}
    for seed_temperature in (0.0, 1.0):
        resp = oai.responses.create(
            model="tiny",
            input="Describe a pet.",
            text={"format": fmt},
            max_output_tokens=60,
            temperature=seed_temperature,
            reasoning={"effort": "none"},
        )
        assert resp.status == "completed", resp
        jsonschema.validate(json.loads(resp.output_text), PET)
    with oai.responses.stream(
        model="tiny", input="Describe a pet.", text={"format": fmt}, max_output_tokens=60, reasoning={"effort": "none"}
    ) as stream:
        final = stream.get_final_response()  # the SDK's accumulation of the events, up to response.completed
    jsonschema.validate(json.loads(final.output_text), PET)
