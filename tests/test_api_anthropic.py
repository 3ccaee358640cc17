"""Anthropic's Messages API through the real app, in-process (tests/api_fake.py): what reaches the
tokenizer worker (the chat messages, tools, grammar, template variables), the answer's content
blocks and stop reasons, streamed as Anthropic's events and not, count_tokens, and Anthropic's
error object on every refusal under /v1/messages (validation, model, capability, auth, size,
method), with the x-api-key header."""

from __future__ import annotations

import json

import pytest
from api_fake import REJECT, SAY, make_client

MSG = "/v1/messages"
BODY = {"model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CALL = 'plan</think>Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def events(client, body: dict) -> list[tuple[str, dict]]:  # noqa: ANN001
    """(event name, data) of a stream, checking Anthropic's framing: `event:` then `data:`, no [DONE]."""
    with client.stream("POST", MSG, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    out = []
    for name, data in zip(lines[::2], lines[1::2]):
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
        assert out[-1][1]["type"] == out[-1][0]
    return out


def anthropic_error(r, status: int) -> dict:  # noqa: ANN001
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


def test_text_answer_and_stop_reasons(plain_app) -> None:  # noqa: ANN001
    client, backend = plain_app
    msg = client.post(MSG, json=BODY).json()
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["id"].startswith("msg_")
    assert msg["content"] == [{"type": "text", "text": "ab\ufffdc"}] and msg["stop_reason"] == "max_tokens"
    assert msg["usage"] == {"input_tokens": 2, "output_tokens": 3}
    said = {**BODY, "messages": [{"role": "user", "content": SAY + "fine. STOP here"}]}
    msg = client.post(MSG, json=said).json()
    assert (msg["stop_reason"], msg["stop_sequence"], msg["content"][0]["text"]) == (
        "end_turn",
        None,
        "fine. STOP here",
    )
    msg = client.post(MSG, json={**said, "stop_sequences": ["STOP"], "temperature": 0.3, "top_k": 4}).json()
    assert (msg["stop_reason"], msg["stop_sequence"], msg["content"][0]["text"]) == ("stop_sequence", "STOP", "fine. ")
    sp = backend.seen[-1].sampling
    assert (sp.stop, sp.temperature, sp.top_k, sp.max_tokens) == (["STOP"], 0.3, 4, 10)


def test_conversation_reaches_the_template(tools_app) -> None:  # noqa: ANN001
    client, backend = tools_app
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "weather?", "cache_control": {"type": "ephemeral"}}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "thanks"},
            ],
        },
    ]
    body = {
        **BODY,
        "messages": msgs,
        "system": [{"type": "text", "text": "Be brief."}],
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "thinking": {"type": "disabled"},
        "metadata": {"user_id": "u"},
    }
    assert client.post(MSG, json=body).status_code == 200
    sent = backend.seen[-1]
    assert sent.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "thanks"},
    ]
    assert sent.tools[0]["function"]["parameters"] == TOOLS[0]["input_schema"]
    assert sent.chat_template_kwargs == {"enable_thinking": False} and "get_weather" in sent.sampling.structural_tag


def test_tool_use_and_thinking_whole_and_streamed(tools_app) -> None:  # noqa: ANN001
    client, _ = tools_app
    body = {
        **BODY,
        "messages": [{"role": "user", "content": SAY + CALL}],
        "tools": TOOLS,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    msg = client.post(MSG, json=body).json()
    kinds = [b["type"] for b in msg["content"]]
    assert kinds == ["thinking", "text", "tool_use"] and msg["stop_reason"] == "tool_use"
    assert msg["content"][0]["thinking"] == "plan" and msg["content"][2]["input"] == {"city": "Paris"}
    evs = events(client, body)
    names = [n for n, _ in evs]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"] for n, d in evs if n == "content_block_start"]
    assert [b["type"] for b in starts] == kinds and starts[2]["name"] == "get_weather" and starts[2]["input"] == {}
    deltas = [d for n, d in evs if n == "content_block_delta"]
    assert "".join(d["delta"]["partial_json"] for d in deltas if d["index"] == 2) == '{"city": "Paris"}'
    assert "".join(d["delta"].get("thinking", "") for d in deltas if d["index"] == 0) == "plan"
    assert [d["index"] for n, d in evs if n == "content_block_stop"] == [0, 1, 2]
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use" and evs[-2][1]["usage"]["output_tokens"] == 3


def test_count_tokens(tools_app) -> None:  # noqa: ANN001
    client, backend = tools_app
    r = client.post(f"{MSG}/count_tokens", json={"model": "tiny", "messages": BODY["messages"], "tools": TOOLS})
    assert r.json() == {"input_tokens": 2}
    assert backend.seen[-1].mode == "tokenize" and backend.seen[-1].tools[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    "body, kind, words",
    [
        ({"temperature": 1.5}, "invalid_request_error", "temperature"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "invalid_request_error",
            "messages[0]",
        ),
        ({"mystery": 1}, "invalid_request_error", "mystery: unknown field"),
        ({"model": "claude"}, "not_found_error", "`claude` does not exist"),
        ({"tools": TOOLS}, "invalid_request_error", "--tool-call-parser gpt-oss, hermes, llama3 or mistral"),
        ({"tool_choice": {"type": "any"}}, "invalid_request_error", "--tool-call-parser"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "invalid_request_error",
         "--reasoning-parser gpt-oss or qwen3"),
        ({"max_tokens": 1000}, "invalid_request_error", "max_tokens"),
    ],
)
def test_refusals_are_anthropic_errors(plain_app, body: dict, kind: str, words: str) -> None:  # noqa: ANN001
    err = anthropic_error(plain_app[0].post(MSG, json={**BODY, **body}), 404 if kind == "not_found_error" else 400)
    assert err["type"] == kind and words in err["message"], err
    assert plain_app[0].post(MSG, json={**BODY, "thinking": {"type": "disabled"}}).status_code == 200


def test_gate_errors_are_anthropic_errors_and_x_api_key_works() -> None:
    client, _ = make_client(api_key="k")
    assert anthropic_error(client.post(MSG, json=BODY), 401)["type"] == "authentication_error"
    assert client.post(MSG, json=BODY, headers={"x-api-key": "k"}).status_code == 200
    assert client.post(MSG, json=BODY, headers={"Authorization": "Bearer k"}).status_code == 200
    big = {**BODY, "system": "x" * 5000}
    assert anthropic_error(client.post(MSG, json=big, headers={"x-api-key": "k"}), 413)["type"] == "request_too_large"
    anthropic_error(client.get(MSG, headers={"x-api-key": "k"}), 405)
    assert client.post("/v1/chat/completions", json={}).json()["error"]["type"] == "authentication_error"  # OpenAI's


def test_grammar_refusal_names_tool_choice(tools_app) -> None:  # noqa: ANN001
    tools = [{"name": REJECT, "input_schema": {"type": "object"}}]
    body = {**BODY, "tools": tools, "tool_choice": {"type": "any"}}
    err = anthropic_error(tools_app[0].post(MSG, json=body), 400)
    assert err["message"].startswith("tool_choice: invalid"), err
    err = anthropic_error(
        tools_app[0].post(MSG, json={**BODY, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "other"}}), 400
    )
    assert err["message"] == "tool_choice: no tool named 'other' in tools"


def test_schema_states_the_capabilities(plain_app, tools_app) -> None:  # noqa: ANN001
    plain = plain_app[0].get("/openapi.json").json()
    props = plain["components"]["schemas"]["MessagesRequest"]["properties"]
    assert props["tools"]["type"] == "null" and "--tool-call-parser" in props["tools"]["description"]
    assert props["thinking"]["anyOf"] == [{"type": "null"}, {"const": {"type": "disabled"}}]
    assert props["max_tokens"]["maximum"] == 63
    err_ref = plain["paths"][MSG]["post"]["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
    assert err_ref.endswith("/AnthropicErrorResponse")
    full = tools_app[0].get("/openapi.json").json()["components"]["schemas"]["MessagesRequest"]["properties"]
    assert "anyOf" in full["tools"] and "discriminator" in str(full["thinking"])
