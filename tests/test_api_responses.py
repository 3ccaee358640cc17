"""OpenAI's Responses API through the real app, in-process (tests/api_fake.py): the input items as
the chat messages that reach the tokenizer worker, tools and text.format as the grammar, the
output items whole and as the numbered streaming events, and the refusals of what a stateless
server (store, previous_response_id) or one without parsers (tools, reasoning) cannot do."""

from __future__ import annotations

import json

import pytest
from api_fake import REJECT, SAY

RESP = "/v1/responses"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CALL = 'plan</think>Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def events(client, body: dict) -> list[dict]:  # noqa: ANN001
    with client.stream("POST", RESP, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    out = []
    for name, data in zip(lines[::2], lines[1::2]):
        out.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {out[-1]['type']}"
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_text_response_whole_and_streamed(plain_app) -> None:  # noqa: ANN001
    client, backend = plain_app
    resp = client.post(RESP, json={"model": "tiny", "input": "hi", "max_output_tokens": 3, "temperature": 0.5}).json()
    assert resp["object"] == "response" and resp["status"] == "incomplete" and resp["store"] is False
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = resp["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "ab\ufffdc"
    assert resp["usage"]["input_tokens"] == 2 and resp["usage"]["total_tokens"] == 5
    assert backend.seen[-1].sampling.max_tokens == 3 and backend.seen[-1].messages == [
        {"role": "user", "content": "hi"}
    ]
    evs = events(client, {"input": SAY + "all good"})
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") == "all good"
    assert evs[-1]["response"]["output"][0]["content"][0]["text"] == "all good"


def test_input_items_and_instructions_reach_the_template(tools_app) -> None:  # noqa: ANN001
    client, backend = tools_app
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    body = {
        "input": items,
        "instructions": "You help.",
        "tools": TOOLS,
        "reasoning": {"effort": "none"},
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
    }
    assert client.post(RESP, json=body).status_code == 200
    sent = backend.seen[-1]
    assert sent.messages == [
        {"role": "system", "content": "You help."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert sent.chat_template_kwargs == {"enable_thinking": False} and "get_weather" in sent.sampling.structural_tag
    fmt = {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}
    assert client.post(RESP, json={"input": "hi", "text": {"format": fmt}}).status_code == 200
    assert json.loads(backend.seen[-1].sampling.json_schema) == SCHEMA


def test_function_calls_and_reasoning_whole_and_streamed(tools_app) -> None:  # noqa: ANN001
    client, _ = tools_app
    body = {"input": SAY + CALL, "tools": TOOLS, "reasoning": {"effort": "medium"}}
    out = client.post(RESP, json=body).json()["output"]
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "plan"}]
    call = out[2]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    evs = events(client, body)
    added = [e["item"]["type"] for e in evs if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    args = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
    assert json.loads(args) == {"city": "Paris"} and done["arguments"] == args and done["output_index"] == 2
    assert "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta") == "plan"
    assert [i["type"] for i in evs[-1]["response"]["output"]] == ["reasoning", "message", "function_call"]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"store": True}, "store", "stateless"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ({"tools": TOOLS}, "tools", "--tool-call-parser"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "--reasoning-parser gpt-oss or qwen3"),
        ({"max_output_tokens": 64}, "max_output_tokens", "less than or equal to 63"),
        ({"input": []}, "input", ""),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"title": REJECT}}}},
            "text.format",
            "invalid",
        ),
        ({"truncation": "auto"}, "truncation", ""),
    ],
)
def test_refusals_name_the_field(plain_app, body: dict, param: str, words: str) -> None:  # noqa: ANN001
    r = plain_app[0].post(RESP, json={"input": "hi", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert plain_app[0].post(RESP, json={"input": "hi", "store": False}).status_code == 200


def test_tool_choice_naming_no_tool(tools_app) -> None:  # noqa: ANN001
    r = tools_app[0].post(
        RESP, json={"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "other"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
