"""GPT-OSS harmony output parsing (parsers/harmony.py through ChatOutput): channels to
reasoning_content / content / tool_calls, the same whether whole or split at every character
boundary; the tool_choice structural tag; template detection."""

from __future__ import annotations

import json

import pytest

from minisgl.parsers.harmony import prompt_is_harmony
from minisgl.parsers.tool_formats import TOOL_FORMATS, detect_tool_format, tool_call_structural_tag
from minisgl.server.chat_output import ChatOutput

GPT = TOOL_FORMATS["gpt-oss"]
# The output starts at <|channel|>: the generation prompt ended with <|start|>assistant.
FULL = (
    "<|channel|>analysis<|message|>User wants weather. <|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
    # the recipient may also sit in the role part, before the channel
    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>'
)
FINAL = ("<|channel|>analysis<|message|>think <|> hard<|end|>"
         "<|start|>assistant<|channel|>final<|message|>  Hi <|there|>.<|return|>")


def run(text: str, step: int | None, tools=GPT, max_calls=None, reasoning="gpt-oss"):
    out = ChatOutput(reasoning, False, tools, max_calls)
    deltas = []
    if step is None:
        deltas += out.feed(text)
    else:
        for i in range(0, len(text), step):
            deltas += out.feed(text[i:i + step])
    tail, reason = out.finish("stop")
    deltas += tail
    return out.message(), deltas, reason


def rebuild(deltas):
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                calls[tc["index"]] = {"name": tc["function"]["name"], "args": ""}
            else:
                calls[tc["index"]]["args"] += tc["function"]["arguments"]
    return ("".join(d.get("reasoning_content", "") for d in deltas),
            "".join(d.get("content", "") for d in deltas), calls)


def test_channels_whole() -> None:
    msg, _, reason = run(FULL, None)
    assert reason == "tool_calls"
    assert msg["reasoning_content"] == "User wants weather. "
    assert msg["content"] == "Checking both."  # commentary without a recipient: a preamble, content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    msg, _, reason = run(FINAL, None)
    assert reason == "stop" and msg["reasoning_content"] == "think <|> hard"
    assert msg["content"] == "Hi <|there|>." and "tool_calls" not in msg


@pytest.mark.parametrize("text", [FULL, FINAL])
def test_split_at_every_boundary(text: str) -> None:
    whole, _, _ = run(text, None)
    want = (whole["reasoning_content"], whole["content"] or "",
            {i: {"name": c["function"]["name"], "args": c["function"]["arguments"]}
             for i, c in enumerate(whole.get("tool_calls", []))})
    for cut in range(1, len(text)):  # two pieces, cut at every character
        out = ChatOutput("gpt-oss", False, GPT, None)
        deltas = out.feed(text[:cut]) + out.feed(text[cut:])
        tail, _ = out.finish("stop")
        assert rebuild(deltas + tail) == want, cut
        assert out.message() == {**whole, "tool_calls": [
            {**c, "id": m["id"]} for c, m in zip(whole.get("tool_calls", []), out.message().get("tool_calls", []))
        ]} if whole.get("tool_calls") else out.message() == whole
    for step in (1, 2, 5):
        _, deltas, _ = run(text, step)
        assert rebuild(deltas) == want


def test_streamed_arguments_arrive_incrementally() -> None:
    _, deltas, _ = run(FULL, 1)
    args = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert len(args) > 4 and all(len(a) <= 1 for a in args)  # not held until the call ends
    marks = [d for d in deltas if "<|" in json.dumps(d)]
    assert not marks  # no marker leaks, even fed one character at a time


def test_cut_outputs_and_plain_text() -> None:
    msg, _, reason = run("<|channel|>analysis<|message|>still thin", None)  # max_tokens in analysis
    assert msg["reasoning_content"] == "still thin" and msg["content"] == ""
    msg, _, _ = run('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a":', None)
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"a":'  # kept as cut, like other parsers
    msg, _, _ = run("<|channel|>analysis<|mess", None)  # header cut: names no channel, dropped
    assert msg["content"] == "" and msg["reasoning_content"] is None
    msg, _, _ = run("Just text, no harmony.", None)  # special tokens dropped / format ignored
    assert msg["content"] == "Just text, no harmony." and msg["reasoning_content"] is None
    msg, _, _ = run("<|", None)
    assert msg["content"] == "<|"


def test_parallel_false_and_no_tools() -> None:
    msg, _, _ = run(FULL, None, max_calls=1)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    msg, _, reason = run(FULL, 3, tools=None)  # no tools in the request: a call's body is content
    assert "tool_calls" not in msg and reason == "stop"
    assert msg["content"] == 'Checking both.{"city":"Paris"}{"tz": "CET"}'
    msg, _, _ = run(FULL, 4, reasoning=None)  # --tool-call-parser gpt-oss alone parses it all too
    assert msg["reasoning_content"] == "User wants weather. " and len(msg["tool_calls"]) == 2


HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}"
                    "<|end|>{% endfor %}")


def test_detection() -> None:
    assert detect_tool_format(HARMONY_TEMPLATE) == "gpt-oss" and prompt_is_harmony(HARMONY_TEMPLATE)
    assert detect_tool_format("{{ '<tool_call>' }}") == "hermes" and not prompt_is_harmony("<tool_call>")


def test_structural_tag_matches_what_the_parser_reads() -> None:
    xgr = pytest.importorskip("xgrammar")
    from minisgl.grammar.spec import structural_tag_json

    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        for n in ("get_weather", "get_time")]
    head = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
    good = head.format("get_weather") + '{"city": "P"}'
    for parallel in (True, False):  # harmony: one call a turn either way (<|call|> is a stop token)
        tag = tool_call_structural_tag(GPT, tools, parallel=parallel)
        grammar = xgr.Grammar.from_structural_tag(structural_tag_json(json.dumps(tag)))
        assert _accepts(xgr, grammar, good) and _accepts(xgr, grammar, head.format("get_time") + '{"city":"Q"}')
        assert not _accepts(xgr, grammar, head.format("get_date") + '{"city": "P"}')  # not a tool
        assert not _accepts(xgr, grammar, head.format("get_weather") + '{"town": "P"}')  # schema
        assert not _accepts(xgr, grammar, good + good) and not _accepts(xgr, grammar, "Sure. " + good)
    msg, _, _ = run(good, 2)  # the stop token <|call|> is not in the text: the output just ends
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"city": "P"}]


def _accepts(xgr, grammar, text: str) -> bool:
    """Whether the grammar accepts exactly `text` (a byte-level matcher, no tokenizer)."""
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(grammar, text)


def test_reasoning_effort_reaches_the_template() -> None:
    from minisgl.server.build import _template_kwargs
    from minisgl.server.protocol import ChatCompletionRequest

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert _template_kwargs(ChatCompletionRequest(**base)) is None
    assert _template_kwargs(ChatCompletionRequest(**base, reasoning_effort="low")) == {"reasoning_effort": "low"}
    both = ChatCompletionRequest(**base, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert _template_kwargs(both) == {"reasoning_effort": "high"}
    with pytest.raises(ValueError):
        ChatCompletionRequest(**base, reasoning_effort="max")
