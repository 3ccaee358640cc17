"""Tool-call and reasoning parsers on recorded outputs of each family (tests/fixtures), whole and
streamed in random pieces (the pieces must rebuild exactly the whole-output result, ids and
names before arguments, arguments in several pieces), plus the tool grammars."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from minisgl.parsers.reasoning import ReasoningParser, prompt_closes_reasoning, prompt_opens_reasoning, split_reasoning
from minisgl.parsers.tool_calls import ArgsDelta, CallStart, TextDelta, ToolCallParser, parse_tool_calls
from minisgl.parsers.tool_formats import TOOL_FORMATS, detect_tool_format, tool_call_structural_tag, tool_format

FIXTURES = Path(__file__).parent / "fixtures"
CASES = [
    pytest.param(fmt, case, id=f"{fmt}-{i}")
    for fmt in ("hermes", "llama3", "mistral")
    for i, case in enumerate(json.loads((FIXTURES / "tool_calls" / f"{fmt}.json").read_text()))
]


def pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8])
        out.append(text[i : i + n])
        i += n
    return out


def check_calls(calls: list[dict], want: list[dict], fmt: str) -> None:
    assert [c["function"]["name"] for c in calls] == [w["name"] for w in want]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [w["arguments"] for w in want]
    for c in calls:
        assert c["type"] == "function"
        assert (len(c["id"]) == 9 and c["id"].isalnum()) if fmt == "mistral" else c["id"].startswith("call_")
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize(("fmt", "case"), CASES)
def test_whole_output(fmt: str, case: dict) -> None:
    content, calls = parse_tool_calls(TOOL_FORMATS[fmt], case["text"])
    assert content == case["content"]
    check_calls(calls, case["calls"], fmt)


@pytest.mark.parametrize(("fmt", "case"), CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_in_pieces_equals_whole(fmt: str, case: dict, seed: int) -> None:
    parser = ToolCallParser(TOOL_FORMATS[fmt])
    events = []
    for piece in pieces(case["text"], seed):
        events += parser.feed(piece)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert (content or None) == case["content"]
    calls: list[dict] = []
    for e in events:
        if isinstance(e, CallStart):
            assert e.index == len(calls)  # id and name first, in order
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, ArgsDelta):
            assert e.index == len(calls) - 1 and e.text
            calls[e.index]["function"]["arguments"] += e.text
    check_calls(calls, case["calls"], fmt)
    in_order = '"name"' in case["text"] and case["text"].find('"name"') < case["text"].find('"a')
    if calls and in_order:  # arguments stream as written: in several pieces
        assert sum(isinstance(e, ArgsDelta) for e in events) > len(calls)


def test_cut_call_and_broken_marker() -> None:
    fmt = TOOL_FORMATS["hermes"]
    content, calls = parse_tool_calls(fmt, '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2')
    assert content is None and calls[0]["function"]["arguments"] == '{"x": [1, 2'  # max_tokens cut it
    assert parse_tool_calls(fmt, "see <tool_call> for details") == ("see <tool_call> for details", [])
    content, calls = parse_tool_calls(fmt, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
                                           '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', max_calls=1)
    assert [c["function"]["name"] for c in calls] == ["a"] and content is None  # parallel_tool_calls false


def test_format_names_and_detection() -> None:
    assert tool_format("qwen25") is TOOL_FORMATS["hermes"] and tool_format("llama3_json") is TOOL_FORMATS["llama3"]
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        tool_format("nope")
    assert detect_tool_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_tool_format("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert detect_tool_format("<|python_tag|> {{ x }}") == "llama3"
    assert detect_tool_format("plain") is None and detect_tool_format("<tool_call> [TOOL_CALLS]") is None


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
        "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


# gpt-oss (harmony) is parsed by parsers/harmony.py, its grammar tested in test_harmony.py.
@pytest.mark.parametrize("fmt", sorted(set(TOOL_FORMATS) - {"gpt-oss"}))
@pytest.mark.parametrize("parallel", [True, False])
def test_tool_grammar_accepts_what_the_parser_reads(fmt: str, parallel: bool) -> None:
    """The grammar of tool_choice "required" accepts exactly the format the parser reads (one call
    when parallel_tool_calls is false), and refuses text and wrong arguments."""
    xgr = pytest.importorskip("xgrammar")
    f = TOOL_FORMATS[fmt]
    tag = json.dumps(tool_call_structural_tag(f, TOOLS, parallel))
    grammar = xgr.Grammar.from_structural_tag(tag)
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n"])  # one character per token
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)
    one = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
           "llama3": '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}',
           "mistral": '[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]'}[fmt]
    two = {"hermes": one + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
           "llama3": one + '; {"name": "now", "parameters": {}}',
           "mistral": one[:-1] + ', {"name": "now", "arguments": {}}]'}[fmt]

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.is_completed()

    assert accepts(one)
    assert accepts(two) == parallel
    assert not accepts("Sure! " + one)
    assert not accepts(one.replace('"days": 2', '"days": 9'))
    content, calls = parse_tool_calls(f, two if parallel else one)
    assert content is None and [c["function"]["name"] for c in calls] == (["get_weather", "now"] if parallel
                                                                           else ["get_weather"])


REASONING = json.loads((FIXTURES / "reasoning" / "qwen3.json").read_text())


@pytest.mark.parametrize("case", REASONING, ids=[c["family"] for c in REASONING])
def test_reasoning_whole_and_streamed(case: dict) -> None:
    assert split_reasoning(case["text"], in_reasoning=case["in_reasoning"]) == (case["reasoning"], case["content"])
    for seed in range(3):
        p = ReasoningParser("qwen3", case["in_reasoning"])
        got_r, got_c = "", ""
        for piece in pieces(case["text"], seed):
            r, c = p.feed(piece)
            got_r, got_c = got_r + r, got_c + c
        r, c = p.finish()
        assert (got_r + r, got_c + c) == (case["reasoning"] or "", case["content"])


def test_reasoning_prompt_detection() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert prompt_closes_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n") and not prompt_closes_reasoning("x")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("nope")
