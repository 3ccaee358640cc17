"""The tool-call formats of the model families we serve, as data: what the parser looks for and
what the grammar of `tool_choice` "required" / a named function makes the model write.

- hermes (Qwen2.5, Qwen3, Hermes 2/3, and Qwen's templates generally): each call is
  `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, text may surround calls.
- llama3 (Llama 3.1 / 3.2 JSON tool calling): the message is `{"name": NAME, "parameters": {...}}`,
  several calls separated by `;`, optionally after `<|python_tag|>`.
- mistral (Mistral 7B v0.3 and later v3 tokenizers): `[TOOL_CALLS][{"name": NAME, "arguments":
  {...}}, ...]`. `[TOOL_CALLS]` is a special token that decoding normally drops, so a message
  that starts with the bare array `[{"name": ...` is read as calls too.
- gpt-oss (GPT-OSS's harmony format): each call is its own message,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`; parsed by
  parsers/harmony.py (with reasoning and content, as the channels say), not ToolCallParser.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str | None  # marker before a call (hermes) or a group of calls (mistral)
    end: str  # hermes: closes each call; mistral: "]" closes the group; llama: ""
    separator: str  # between two calls of a group / message ("" for hermes: each has its marker)
    args_key: str  # the key the grammar writes; the parser also takes "arguments"/"parameters"
    bare_start: str | None  # a call group may open the message without the marker
    group_open: str  # opens the calls after the marker ("[" for mistral)

    def new_call_id(self) -> str:
        if self.name == "mistral":  # Mistral's chat template requires 9 alphanumerics
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return "call_" + secrets.token_hex(12)


TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>", "", "arguments", None, ""),
    "llama3": ToolFormat("llama3", None, "", ";", "parameters", "{", ""),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "]", ",", "arguments", "[", "["),
    "gpt-oss": ToolFormat("gpt-oss", "<|channel|>commentary to=functions.", "<|call|>", "", "", None, ""),
}
# Names other servers use for the same formats (vLLM/SGLang flags), for --tool-call-parser.
ALIASES = {"harmony": "gpt-oss", "openai": "gpt-oss",
           "qwen": "hermes", "qwen25": "hermes", "qwen3": "hermes", "llama3_json": "llama3", "llama": "llama3"}


def tool_format(name: str) -> ToolFormat:
    key = ALIASES.get(name, name)
    if key not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {sorted(TOOL_FORMATS) + sorted(ALIASES)}")
    return TOOL_FORMATS[key]


def detect_tool_format(chat_template: str | None) -> str | None:
    """The format a chat template's tool section uses, when exactly one matches."""
    if not chat_template:
        return None
    found = set()
    if "<|channel|>" in chat_template and "<|message|>" in chat_template:
        return "gpt-oss"  # harmony: its own markers; the others' words may appear in its text
    if "<tool_call>" in chat_template:
        found.add("hermes")
    if "[TOOL_CALLS]" in chat_template:
        found.add("mistral")
    if "<|python_tag|>" in chat_template or ('"parameters"' in chat_template and "ipython" in chat_template):
        found.add("llama3")
    return found.pop() if len(found) == 1 else None


def _call_tag(fmt: ToolFormat, name: str, schema: Any) -> dict[str, Any]:
    import json

    lead = "<tool_call>\n" if fmt.name == "hermes" else ""
    tail = "\n</tool_call>" if fmt.name == "hermes" else ""
    return {
        "type": "tag",
        "begin": f'{lead}{{"name": {json.dumps(name)}, "{fmt.args_key}": ',
        # At most one whitespace character in a row: a weak model cannot pad forever.
        "content": {"type": "json_schema", "json_schema": schema if schema is not None else True,
                    "max_whitespace_cnt": 1},
        "end": "}" + tail,
    }


def tool_call_structural_tag(fmt: ToolFormat, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """xgrammar structural tag that makes the model write one call (parallel False) or one or more
    calls to `tools` (OpenAI function tools) and nothing else: tool_choice "required", or a named
    function with `tools` holding just that one. The arguments follow each tool's JSON schema."""
    if fmt.name == "gpt-oss":
        return _harmony_calls(tools)
    tags = [_call_tag(fmt, t["function"]["name"], t["function"].get("parameters")) for t in tools]
    sep = {"hermes": "\n", "llama3": "; ", "mistral": ", "}[fmt.name]
    calls: dict[str, Any] = {
        "type": "tags_with_separator", "tags": tags, "separator": sep, "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if fmt.name == "mistral":
        calls = {"type": "sequence", "elements": [
            {"type": "const_string", "value": "["}, calls, {"type": "const_string", "value": "]"}]}
    return {"type": "structural_tag", "format": calls}


def _harmony_calls(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One harmony call: header, JSON arguments, then nothing but a stop token. `<|call|>` ends
    the turn and is a stop token (GPT-OSS's generation config), so the grammar leaves it to the
    stop: a grammar that spelled it out would only be met by plain-text pieces of it. One call a
    turn is harmony's way (the next comes after the tool's result), so parallel is not offered."""
    def tag(t: dict[str, Any]) -> dict[str, Any]:
        schema = t["function"].get("parameters")
        return {
            "type": "tag",
            "begin": f"<|channel|>commentary to=functions.{t['function']['name']} <|constrain|>json<|message|>",
            "content": {"type": "json_schema", "json_schema": schema if schema is not None else True,
                        "max_whitespace_cnt": 1},
            "end": "",
        }
    return {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": [tag(t) for t in tools], "separator": "",
        "at_least_one": True, "stop_after_first": True}}
