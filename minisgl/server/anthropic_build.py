"""Second stage of a Messages request: the Anthropic body (anthropic_protocol.py) as the chat
request it means, which the chat stages then run (template, tools, grammar, parsers).

- `system` (a string or text blocks) is the first, system message;
- a user message's `tool_result` blocks become `role: "tool"` messages (they come first in a
  user turn), its text blocks the user message; an assistant's `tool_use` blocks become its
  `tool_calls` (input as JSON arguments), its thinking blocks are dropped (templates drop past
  reasoning);
- `tools` become function tools; `tool_choice` auto / any / tool / none become chat's "auto" /
  "required" / a named function / "none", and `disable_parallel_tool_use` parallel_tool_calls
  false; `stop_sequences` are the stop strings; `thinking` sets the template's enable_thinking.

`names` maps the chat fields an error may name back to the Anthropic ones.
"""

import json
from typing import Any

from minisgl.server.protocol_types import as_json_data

# chat field -> Anthropic field, for errors the chat stages and later hops name.
NAMES = {
    "stop": "stop_sequences",
    "messages": "messages",
    "max_tokens": "max_tokens",
    "tool_choice": "tool_choice",
    "tools": "tools",
    "chat_template_kwargs": "thinking",
}


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b["text"] for b in content)


def chat_messages(system: Any, messages: list[Any]) -> list[dict[str, Any]]:
    """The chat messages of a Messages request (dicts in chat's request shape)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(as_json_data(system))})
    for m in messages:
        m = as_json_data(m)
        role, content = m["role"], m["content"]
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        texts = [{"type": "text", "text": b["text"]} for b in content if b["type"] == "text"]
        if role == "user":
            out += [
                {"role": "tool", "tool_call_id": b["tool_use_id"], "content": _text(b.get("content"))}
                for b in content
                if b["type"] == "tool_result"
            ]
            if texts or not any(b["type"] == "tool_result" for b in content):
                out.append({"role": "user", "content": texts})
            continue
        calls = [
            {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
            for b in content
            if b["type"] == "tool_use"
        ]
        msg: dict[str, Any] = {"role": "assistant", "content": texts or (None if calls else "")}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice["type"]
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def chat_body(req: Any, max_tokens: int | None = None) -> dict[str, Any]:
    """The chat completions body a Messages (or count_tokens) request stands for."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req.system, req.messages)}
    tools = [as_json_data(t) for t in req.tools or []]
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in (
                        ("name", t["name"]),
                        ("description", t.get("description")),
                        ("parameters", t["input_schema"]),
                    )
                    if v is not None
                },
            }
            for t in tools
        ]
    choice, parallel = _tool_choice(as_json_data(req.tool_choice))
    if choice is not None:  # without tools chat's planning refuses all but "none", naming tool_choice
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    thinking = as_json_data(req.thinking)
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    body["max_tokens"] = max_tokens if max_tokens is not None else getattr(req, "max_tokens", 1)
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop", "stop_sequences"),
        ("stream", "stream"),
    ):
        value = getattr(req, theirs, None)
        if value is not None:
            body[ours] = value
    return body
