"""Second stage of a Responses request: the body (responses_protocol.py) as the chat request it
means, which the chat stages then run (template, tools, grammar, parsers).

- `instructions` is the first, system message; `input` a user message (a string) or the
  conversation's items: messages as they are (developer as system), an earlier answer's
  `function_call` items as its assistant message's tool_calls (a run of them, and the message
  before them, one assistant turn), `function_call_output` items as `role: "tool"` messages,
  reasoning items dropped (templates drop past reasoning);
- `tools` / `tool_choice` / `parallel_tool_calls` as chat's; `text.format` as response_format;
  `reasoning.effort` "none" turns the template's thinking off; `max_output_tokens` is max_tokens.

`NAMES` maps the chat fields an error may name back to the Responses ones.
"""

from typing import Any

from minisgl.server.protocol_types import as_json_data

NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tool_choice": "tool_choice",
    "tools": "tools",
    "chat_template_kwargs": "reasoning",
}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] if "text" in p else p.get("refusal", "") for p in content)


def chat_messages(instructions: str | None, input: Any) -> list[dict[str, Any]]:  # noqa: A002 - the API's name
    """The chat messages of a Responses request (dicts in chat's request shape)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    items = [{"type": "message", "role": "user", "content": input}] if isinstance(input, str) else as_json_data(input)
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the same turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
    return out


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt["type"] != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def chat_body(req: Any) -> dict[str, Any]:
    """The chat completions body a Responses request stands for."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req.instructions, req.input),
        "stream": req.stream,
    }
    tools = as_json_data(req.tools) or []
    if tools:
        body["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    choice = as_json_data(req.tool_choice)
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fields = {
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(as_json_data(req.text)),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
    }
    reasoning = as_json_data(req.reasoning)
    if reasoning and reasoning.get("effort") is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": reasoning["effort"] != "none"}
    body.update({k: v for k, v in fields.items() if v is not None})
    return body
