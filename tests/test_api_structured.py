"""Chat's structured fields through the real app, in-process (tests/api_fake.py): what reaches
the tokenizer worker (grammar, tools, template variables, tool-call messages), the 400s naming
the field, the schema stating them (no tools without a parser), and tool calls / reasoning
rendered from output, streamed and not."""

from __future__ import annotations

import json

import jsonschema
import pytest
from api_fake import REJECT, SAY
from server_harness import sse_events

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALLS = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def stream(client, body: dict) -> list[dict]:  # noqa: ANN001
    with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        return sse_events(list(r.iter_lines()))


def error_of(r, status: int = 400) -> dict:  # noqa: ANN001
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_constraints_reach_the_worker(tools_app) -> None:  # noqa: ANN001
    client, backend = tools_app
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert client.post(CHAT, json={"messages": HI, "response_format": fmt}).status_code == 200
    assert json.loads(backend.seen[-1].sampling.json_schema) == schema
    client.post(CHAT, json={"messages": HI, "response_format": {"type": "json_object"}})
    assert json.loads(backend.seen[-1].sampling.json_schema) == {"type": "object"}
    client.post(CHAT, json={"messages": HI, "regex": "[ab]+"})
    assert backend.seen[-1].sampling.regex == "[ab]+"
    tag = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
           "triggers": ["<f>"]}
    assert client.post(CHAT, json={"messages": HI, "response_format": tag}).status_code == 200
    assert json.loads(backend.seen[-1].sampling.structural_tag)["structures"][0]["schema"] == schema
    kwargs = {"enable_thinking": False}
    body = {"messages": HI, "tools": TOOLS, "tool_choice": "required", "chat_template_kwargs": kwargs}
    assert client.post(CHAT, json=body).status_code == 200
    msg = backend.seen[-1]
    assert msg.tools == TOOLS and msg.chat_template_kwargs == {"enable_thinking": False} and msg.reasoning == "qwen3"
    assert "get_weather" in msg.sampling.structural_tag


def test_tool_messages_reach_the_template(tools_app) -> None:  # noqa: ANN001
    client, backend = tools_app
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert client.post(CHAT, json={"messages": msgs, "tools": TOOLS}).status_code == 200
    sent = backend.seen[-1].messages
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<f>"]}}, "response_format.structural_tag"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS * 2}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ],
)
def test_bad_structured_fields_are_400s_naming_them(tools_app, body: dict, param: str) -> None:  # noqa: ANN001
    err = error_of(tools_app[0].post(CHAT, json={"messages": HI, **body}))
    assert err["param"] == param and err["message"].startswith(param), err


def test_grammars_reach_the_worker_unparsed(tools_app) -> None:  # noqa: ANN001
    """The API checks a grammar's shape only: xgrammar (which imports torch) parses it in the
    scheduler's compiler (tests/test_server_structured.py goes through the real server)."""
    client, backend = tools_app
    assert client.post(CHAT, json={"messages": HI, "regex": "a("}).status_code == 200
    assert backend.seen[-1].sampling.regex == "a("
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}
    assert client.post(CHAT, json={"messages": HI, "response_format": fmt}).status_code == 200
    assert json.loads(backend.seen[-1].sampling.json_schema) == {"type": "nope"}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"regex": REJECT}, "regex"),
        ({"ebnf": f'root ::= "{REJECT}"'}, "ebnf"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"title": REJECT}}}},
         "response_format"),
        ({"response_format": {"type": "structural_tag", "format": {"type": REJECT}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": REJECT}}], "tool_choice": "required"}, "tool_choice"),
    ],
)
@pytest.mark.parametrize("streamed", [False, True])
def test_grammar_the_compiler_refuses_is_a_400_naming_the_request_field(
    tools_app, body: dict, param: str, streamed: bool  # noqa: ANN001
) -> None:
    """The scheduler names the engine field (json_schema, structural_tag, ...); Job.names maps it
    to the one the client sent, message and param, and a stream answers 400 before any event."""
    err = error_of(tools_app[0].post(CHAT, json={"messages": HI, **body, "stream": streamed}))
    assert err["param"] == param and err["message"] == f"{param}: invalid (the stand-in rejects it)", err


def test_schema_states_the_fields(tools_app, plain_app) -> None:  # noqa: ANN001
    defs = tools_app[0].get("/openapi.json").json()["components"]["schemas"]
    chat = defs["ChatCompletionRequest"]["properties"]
    assert chat["tools"]["anyOf"][0]["items"]["$ref"].endswith("/Tool")
    assert "tokenize" in chat["chat_template_kwargs"]["anyOf"][0]["propertyNames"]["not"]["enum"]
    assert "xgrammar" in chat["regex"]["description"] and "xgrammar" in chat["ebnf"]["description"]
    plain = plain_app[0].get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert plain["tools"]["type"] == "null" and "--tool-call-parser" in plain["tools"]["description"]
    err = error_of(plain_app[0].post(CHAT, json={"messages": HI, "tools": TOOLS}))
    assert err["param"] == "tools"


def test_tool_calls_rendered_streamed_and_not(tools_app) -> None:  # noqa: ANN001
    client, _ = tools_app
    body = {"messages": [{"role": "user", "content": SAY + CALLS}], "tools": TOOLS}
    whole = client.post(CHAT, json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Let me check."
    calls = whole["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    events = stream(client, body)
    deltas = [e["choices"][0]["delta"] for e in events]
    heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [h["function"]["name"] for h in heads] == ["get_weather"] * 2 and heads[0]["index"] == 0
    args = ["".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas
                    if "tool_calls" in d and d["tool_calls"][0]["index"] == k) for k in (0, 1)]
    assert [json.loads(a) for a in args] == [{"city": "Paris"}, {"city": "Rome"}]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_reasoning_rendered_streamed_and_not(tools_app) -> None:  # noqa: ANN001
    client, _ = tools_app
    body = {"messages": [{"role": "user", "content": SAY + "plan it</think>\n\nThe answer."}]}
    msg = client.post(CHAT, json=body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("plan it", "The answer.")
    events = stream(client, body)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "plan it"
    assert "".join(d.get("content") or "" for d in deltas) == "The answer."


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "route, body, field, text",
    [
        ("/v1/completions", {"regex": "[ab]+"}, "regex", "[ab]+"),
        ("/v1/completions", {"ebnf": 'root ::= "x"'}, "ebnf", 'root ::= "x"'),
        ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "json_schema", json.dumps(SCHEMA)),
        ("/v1/completions", {"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA)),
        ("/v1/completions", {"structured_outputs": {"regex": "a|b"}}, "regex", "a|b"),
        ("/v1/completions", {"structured_outputs": {"grammar": 'root ::= "y"'}}, "ebnf", 'root ::= "y"'),
        ("/v1/completions", {"structured_outputs": {"choice": ["yes", 'a "q"']}}, "ebnf",
         'root ::= "yes" | "a \\"q\\""'),
        (CHAT, {"structured_outputs": {"regex": "a|b"}}, "regex", "a|b"),
        ("/generate", {"sampling_params": {"json_schema": json.dumps(SCHEMA)}}, "json_schema", json.dumps(SCHEMA)),
        ("/generate", {"sampling_params": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ("/generate", {"sampling_params": {"ebnf": 'root ::= "z"'}}, "ebnf", 'root ::= "z"'),
    ],
)
def test_every_generate_route_takes_constraints(
    plain_app, route: str, body: dict, field: str, text: str  # noqa: ANN001
) -> None:
    client, backend = plain_app
    prompt = {CHAT: {"messages": HI}, "/generate": {"text": "hi"}}.get(route, {"prompt": "hi"})
    assert client.post(route, json={**prompt, **body}).status_code == 200
    assert getattr(backend.seen[-1].sampling, field) == text


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/completions", {"regex": REJECT}, "regex"),
        ("/v1/completions", {"structured_outputs": {"regex": REJECT}}, "structured_outputs.regex"),
        ("/v1/completions", {"structured_outputs": {"choice": [REJECT]}}, "structured_outputs.choice"),
        ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"title": REJECT}}}},
         "response_format"),
        ("/generate", {"sampling_params": {"ebnf": f'root ::= "{REJECT}"'}}, "sampling_params.ebnf"),
        ("/generate", {"sampling_params": {"json_schema": json.dumps({"title": REJECT})}},
         "sampling_params.json_schema"),
    ],
)
def test_compiler_refusal_names_the_field_on_every_route(
    plain_app, route: str, body: dict, param: str  # noqa: ANN001
) -> None:
    prompt = {"text": "hi"} if route == "/generate" else {"prompt": "hi"}
    err = error_of(plain_app[0].post(route, json={**prompt, **body}))
    assert err["param"] == param and err["message"] == f"{param}: invalid (the stand-in rejects it)", err


def test_schema_states_the_one_constraint_rule(plain_app) -> None:  # noqa: ANN001
    """A body with two constraints is invalid by /openapi.json, as the server says: a fuzzer finds
    no schema-valid body the server refuses for it (and one constraint stays valid)."""
    client = plain_app[0]
    comps = client.get("/openapi.json").json()["components"]

    def valid(model: str, body: dict) -> bool:
        schema = {"$ref": f"#/components/schemas/{model}", "components": comps}
        return jsonschema.Draft202012Validator(schema).is_valid(body)

    fmt = {"type": "json_object"}
    cases = [
        ("CompletionRequest", "/v1/completions", {"prompt": "x", "regex": "a", "ebnf": 'root ::= "a"'}, False),
        ("CompletionRequest", "/v1/completions", {"prompt": "x", "regex": "a", "response_format": fmt}, False),
        ("CompletionRequest", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a"}, "ebnf": "b"},
         False),
        ("CompletionRequest", "/v1/completions", {"prompt": "x", "regex": "a", "response_format": {"type": "text"}},
         True),
        ("CompletionRequest", "/v1/completions", {"prompt": "x", "regex": "a", "ebnf": None}, True),
        ("ChatCompletionRequest", CHAT, {"messages": HI, "regex": "a", "ebnf": "b"}, False),
        ("GenerateRequest", "/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": "b"}}, False),
        ("GenerateRequest", "/generate", {"text": "x", "sampling_params": {"regex": "a"}}, True),
    ]
    for model, route, body, ok in cases:
        assert valid(model, body) is ok, body
        assert (client.post(route, json=body).status_code == 200) is ok, body
    both = client.post("/generate", json={"text": "x", "sampling_params": {"regex": "a", "ebnf": "b"}}).json()["error"]
    assert both["param"] == "sampling_params.ebnf", both
    assert both["message"].startswith("sampling_params.ebnf: cannot be combined with sampling_params.regex"), both
