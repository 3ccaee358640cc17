"""The structured parts of a chat request, validated and turned into what the engine and the
chat template take: `response_format` (and the SGLang-style `regex` / `ebnf` fields, vLLM's
`structured_outputs`; completions take the same) into one grammar field of SamplingParams;
`tools` / `tool_choice` / `parallel_tool_calls` into the tools the template renders, the grammar
that enforces "required" or a named function, and the parser settings; assistant `tool_calls`
and `role: "tool"` messages into the form templates expect.

Every error is a ValueError("<field>: ...") (the API turns it into a 400 naming the field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from minisgl.parsers.tool_formats import ToolFormat, tool_call_structural_tag
from minisgl.server.capabilities import NO_TOOL_PARSER


@dataclass(frozen=True)
class ChatFeatures:
    """Server-wide output parsing: the tool-call format (--tool-call-parser, or detected from
    the chat template; None: tools are refused) and the reasoning parser (--reasoning-parser)."""

    tool_format: ToolFormat | None = None
    reasoning: str | None = None


@dataclass
class ChatPlan:
    grammar: dict[str, str] = field(default_factory=dict)  # SamplingParams grammar field -> text
    # The request field the grammar came from (response_format, regex, ebnf, tool_choice): a
    # grammar xgrammar rejects is refused by the scheduler's compiler, naming this field.
    grammar_field: str | None = None
    template_tools: list[dict[str, Any]] | None = None  # passed to apply_chat_template(tools=...)
    tool_format: ToolFormat | None = None  # parse the output for calls with this format
    max_calls: int | None = None  # 1 when parallel_tool_calls is false


def _grammar_from_response_format(rf: dict[str, Any] | None) -> dict[str, str]:
    if rf is None:
        return {}
    kind = rf.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ValueError('response_format: "json_schema" must be an object holding a "schema" object')
        return {"json_schema": json.dumps(spec.get("schema", {"type": "object"}))}
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items() if k != "type"}
        if "format" in tag:
            tag = {"type": "structural_tag", "format": tag["format"]}
        elif "structures" not in tag:
            raise ValueError('response_format: a structural_tag needs "format" (or "structures" and "triggers")')
        return {"structural_tag": json.dumps(tag)}
    raise ValueError(
        f"response_format: type {kind!r} is not one of text, json_object, json_schema, structural_tag"
    )


def _grammar_from_structured_outputs(so: dict[str, Any] | None) -> tuple[str, dict[str, str]] | None:
    """(the request field, the grammar) of vLLM's structured_outputs: its one key (protocol.py)."""
    if not so:
        return None
    if "json" in so:
        schema = so["json"]
        return "structured_outputs.json", {"json_schema": schema if isinstance(schema, str) else json.dumps(schema)}
    if "regex" in so:
        return "structured_outputs.regex", {"regex": so["regex"]}
    if "grammar" in so:
        return "structured_outputs.grammar", {"ebnf": so["grammar"]}
    if "choice" in so:  # one string literal per choice, JSON-escaped (EBNF reads the same escapes)
        return "structured_outputs.choice", {"ebnf": "root ::= " + " | ".join(json.dumps(c) for c in so["choice"])}
    raise ValueError("structured_outputs: give exactly one of json, regex, grammar, choice")


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools: must be a non-empty list of function tools")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f'tools[{i}]: must be {{"type": "function", "function": {{...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name: must be a non-empty string")
        if name in names:
            raise ValueError(f"tools[{i}].function.name: {name!r} is defined twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
    return tools


def _chosen_tools(tools: list[dict[str, Any]], choice: Any) -> tuple[str, list[dict[str, Any]]]:
    """("none" | "auto" | "required" | "named", the tools a grammar allows)."""
    if choice in (None, "auto", "none", "required"):
        return choice or "auto", tools
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice: no tool named {name!r} in tools")
        return "named", chosen
    raise ValueError(
        'tool_choice: must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    )


def plan_chat(
    response_format: dict[str, Any] | None, regex: str | None, ebnf: str | None, tools: Any, tool_choice: Any,
    parallel_tool_calls: bool, tool_format: ToolFormat | None, structured_outputs: dict[str, Any] | None = None,
) -> ChatPlan:
    plan = ChatPlan()
    grammars = [(name, g) for name, g in (
        ("response_format", _grammar_from_response_format(response_format)),
        ("regex", {"regex": regex} if regex else {}),
        ("ebnf", {"ebnf": ebnf} if ebnf else {}),
        _grammar_from_structured_outputs(structured_outputs) or ("", {}),
    ) if g]
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice: needs tools")
    else:
        mode, allowed = _chosen_tools(_check_tools(tools), tool_choice)
        if mode != "none":
            if tool_format is None:
                raise ValueError(f"tools: {NO_TOOL_PARSER}")
            plan.template_tools, plan.tool_format = tools, tool_format
            plan.max_calls = None if parallel_tool_calls else 1
        if mode in ("required", "named"):
            tag = tool_call_structural_tag(tool_format, allowed, parallel_tool_calls and mode == "required")
            grammars.append(("tool_choice", {"structural_tag": json.dumps(tag)}))
    one_constraint([field for field, _ in grammars])
    if grammars:
        plan.grammar_field, plan.grammar = grammars[0]
    return plan


def one_constraint(fields: list[str]) -> None:
    """The one-output-constraint rule: a ValueError naming the second of `fields` and the first."""
    if len(fields) > 1:
        raise ValueError(f"{fields[1]}: cannot be combined with {fields[0]} (one output constraint at most)")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as objects where they are JSON objects
    (templates render them with tojson; OpenAI sends JSON text); other arguments stay text,
    which templates print as it is. Tool results pass as they came."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                                     for c in calls]}
        out.append(m)
    return out


def _arguments(fn: dict[str, Any]) -> Any:
    args = fn.get("arguments", "")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args
    return parsed if isinstance(parsed, dict) else args
