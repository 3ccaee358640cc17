"""The API's per-choice output shaping (ChatOutput) and request planning (plan_chat), without a
server: stream deltas rebuild the whole message; finish_reason becomes "tool_calls" only when
the model stopped by itself after a call; structured fields map to grammars or 400-style errors."""

from __future__ import annotations

import json

import pytest

from minisgl.parsers.tool_formats import TOOL_FORMATS
from minisgl.server.chat_output import ChatOutput
from minisgl.server.chat_request import plan_chat, template_messages

TEXT = ('<think>\nplan\n</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, "}"]}}\n</tool_call>'
        '\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')


def test_stream_deltas_rebuild_the_message() -> None:
    whole = ChatOutput("qwen3", False, TOOL_FORMATS["hermes"], None)
    whole.feed(TEXT)
    _, reason = whole.finish("stop")
    msg = whole.message()
    assert reason == "tool_calls" and msg["reasoning_content"] == "\nplan\n" and msg["content"] == "Sure."
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"a": [1, "}"]}, {}]
    stream = ChatOutput("qwen3", False, TOOL_FORMATS["hermes"], None)
    deltas = [d for i in range(0, len(TEXT), 3) for d in stream.feed(TEXT[i : i + 3])]
    tail, reason2 = stream.finish("stop")
    deltas += tail
    assert reason2 == "tool_calls"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["function"]["arguments"] == "" and tc["index"] not in calls  # id and name first
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "args": ""}
            else:
                calls[tc["index"]]["args"] += tc["function"]["arguments"]
    assert [(c["name"], c["args"]) for c in calls.values()] == [  # ids are fresh per response
        (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_finish_reason_and_no_parsers() -> None:
    out = ChatOutput(None, False, TOOL_FORMATS["hermes"], None)
    out.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1')
    assert out.finish("length")[1] == "length"  # cut: not "tool_calls"
    plain = ChatOutput(None, False, None, None)
    assert plain.feed("<think>x</think>") == [{"content": "<think>x</think>"}]
    assert plain.message() == {"role": "assistant", "content": "<think>x</think>"}


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_plan_chat_fields_and_errors() -> None:
    hermes = TOOL_FORMATS["hermes"]
    plan = plan_chat({"type": "json_object"}, None, None, None, None, True, None)
    assert plan.grammar == {"json_schema": '{"type": "object"}'} and plan.tool_format is None
    plan = plan_chat(None, None, None, TOOLS, "required", False, hermes)
    assert "structural_tag" in plan.grammar and plan.max_calls == 1 and plan.template_tools == TOOLS
    plan = plan_chat(None, None, None, TOOLS, None, True, hermes)
    assert plan.grammar == {} and plan.tool_format is hermes  # auto: parsed, not forced
    assert plan_chat(None, None, None, TOOLS, "none", True, hermes).template_tools is None
    # The API does not parse grammars (xgrammar would load torch there): a bad regex passes
    # through to the scheduler's compiler, which refuses it naming this field (test_server_structured).
    plan = plan_chat(None, "a(", None, None, None, True, None)
    assert plan.grammar == {"regex": "a("} and plan.grammar_field == "regex"
    for args, msg in [
        (({"type": "xml"}, None, None, None, None, True, None), "^response_format: type 'xml'"),
        ((None, None, None, TOOLS, "auto", True, None), "^tools: this server has no tool-call parser"),
        ((None, None, None, TOOLS, {"type": "function", "function": {"name": "x"}}, True, hermes), "^tool_choice:"),
        (({"type": "json_object"}, None, None, TOOLS, "required", True, hermes), "^tool_choice: cannot be combined"),
        ((None, None, None, [{"type": "function", "function": {"name": "f"}}] * 2, None, True, hermes),
         r"^tools\[1\]\.function\.name: 'f' is defined twice"),
    ]:
        with pytest.raises(ValueError, match=msg):
            plan_chat(*args)


def test_template_messages_parse_arguments() -> None:
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    assert template_messages(msgs)[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    for text in ("{nope", "[1, 2]"):  # not a JSON object: templates print the text as it is
        odd = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": text}}]}]
        assert template_messages(odd)[0]["tool_calls"][0]["function"]["arguments"] == text
