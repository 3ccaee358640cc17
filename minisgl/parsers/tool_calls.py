"""Incremental tool-call parser: model text in (any chunking), events out:

- TextDelta(text): content outside calls;
- CallStart(index, id, name): a call, once its name is known (OpenAI streams id and name first);
- ArgsDelta(index, text): the next piece of that call's arguments (JSON text, as written).

Whole outputs are parsed by feeding them at once (`parse_tool_calls`), so streamed and
non-streamed results agree by construction. Arguments stream as the model writes them when
the call object starts with its name (every format's documented order); otherwise they are
sent whole, re-serialized, once the object closes. Whitespace-only content between or around
calls is dropped (held until non-space text follows). A call cut by max_tokens keeps what it
had; a marker not followed by a well-formed call is content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from minisgl.parsers.json_scan import JsonValueEnd
from minisgl.parsers.tool_formats import ToolFormat

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class TextDelta:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ArgsDelta:
    index: int
    text: str


Event = TextDelta | CallStart | ArgsDelta


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    def __init__(self, fmt: ToolFormat, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self.buf = ""  # text received and not yet consumed
        self.mode = "start"  # start | content | open | object | after
        self.region = ""  # raw text of the call region being read (content again if it fails)
        self.calls = 0
        self.held_ws = ""
        self.content_started = False
        self._obj: JsonValueEnd | None = None
        self._obj_text = ""
        self._named = False
        self._args_start = 0
        self._args: JsonValueEnd | None = None
        self._args_sent = 0
        self._keep_call = True
        self._group_opened = False

    # ---- output helpers ----

    def _text(self, out: list[Event], text: str) -> None:
        """Content, with whitespace before a call, between calls and at either end dropped."""
        core = text.rstrip()
        if core:
            out.append(TextDelta(self.held_ws + core if self.content_started else core.lstrip()))
            self.held_ws, self.content_started = "", True
        if self.content_started:
            self.held_ws += text[len(core) :]

    def _keep(self) -> bool:
        return self.max_calls is None or self.calls < self.max_calls

    # ---- feeding ----

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        progressed = True
        while progressed and self.buf:
            progressed = getattr(self, "_" + self.mode)(out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        for _ in range(64):  # each pass consumes or changes mode; bounded for safety
            if not self.buf and self.mode in ("content", "start", "after"):
                break
            if not getattr(self, "_" + self.mode)(out, final=True):
                break
        if self.mode in ("start", "open") or (self.mode == "object" and not self._named):
            self._text(out, self.region + self.buf)  # never became a call: it was content
        self.buf, self.region, self.held_ws = "", "", ""
        return out

    def _start(self, out: list[Event], final: bool) -> bool:
        """Message start: llama/mistral calls may begin here without a marker."""
        bare = self.fmt.bare_start
        head = self.buf.lstrip()
        if bare is not None and head and _PYTHON_TAG.startswith(head) and not final:
            return False  # maybe Llama's python tag, still arriving
        if head.startswith(_PYTHON_TAG):
            head = head[len(_PYTHON_TAG) :].lstrip()
        squeezed = re.sub(r"\s+", "", head)
        want = bare + '{"name":' if bare == "[" else '{"name":'
        if bare is not None and squeezed.startswith(want):
            self.buf, self.region = head, ""
            if bare == "[":
                self.mode = "open"
            else:
                self._begin_object()
            return True
        if bare is not None and want.startswith(squeezed) and not final:
            return False  # undecided: wait for more text
        self.mode = "content"
        return True

    def _content(self, out: list[Event], final: bool) -> bool:
        marker = self.fmt.start
        if marker is None:
            self._text(out, self.buf)
            self.buf = ""
            return False
        at = self.buf.find(marker)
        if at < 0:
            hold = 0 if final else _partial_suffix(self.buf, marker)
            self._text(out, self.buf[: len(self.buf) - hold])
            self.buf = self.buf[len(self.buf) - hold :]
            return False
        self._text(out, self.buf[:at])
        self.region, self.buf = marker, self.buf[at + len(marker) :]
        self.mode = "open"
        return True

    def _open(self, out: list[Event], final: bool) -> bool:
        """After a marker or a separator: whitespace, the group's "[" (mistral), then "{"."""
        stripped = self.buf.lstrip()
        if not stripped:
            return False
        skipped = len(self.buf) - len(stripped)
        opener = self.fmt.group_open
        if opener and not self._group_opened:
            if stripped[0] != opener:
                return self._fail(out)
            self._group_opened = True
            self.region += self.buf[: skipped + 1]
            self.buf = stripped[1:]
            return True
        if stripped[0] != "{":
            return self._fail(out)
        self.region += self.buf[:skipped]
        self.buf = stripped
        self._begin_object()
        return True

    def _fail(self, out: list[Event]) -> bool:
        self._text(out, self.region)
        self.region, self.mode, self._group_opened = "", "content", False
        return True

    def _begin_object(self) -> None:
        self.mode = "object"
        self._obj, self._obj_text, self._named, self._args, self._args_sent = JsonValueEnd(), "", False, None, 0

    def _object(self, out: list[Event], final: bool) -> bool:
        obj = self._obj
        assert obj is not None
        before = obj.seen
        obj.feed(self.buf)
        taken = obj.seen - before
        self._obj_text += self.buf[:taken]
        self.region += self.buf[:taken]
        self.buf = self.buf[taken:]
        self._stream_args(out)
        if obj.end is None:
            return False
        if not self._named:
            try:
                call = json.loads(self._obj_text)
                name = call["name"]
                args = call.get("arguments", call.get("parameters", {}))
                assert isinstance(name, str)
            except (ValueError, KeyError, TypeError, AssertionError):
                return self._fail(out)
            self._emit_start(out, name)
            if self._keep_call:
                out.append(ArgsDelta(self.calls - 1, args if isinstance(args, str) else json.dumps(args)))
        self.mode, self.region, self._obj = "after", "", None
        return True

    def _emit_start(self, out: list[Event], name: str) -> None:
        self._named = True
        self._keep_call = self._keep()
        self.held_ws = ""
        if self._keep_call:
            out.append(CallStart(self.calls, self.fmt.new_call_id(), name))
        self.calls += 1

    def _stream_args(self, out: list[Event]) -> None:
        text = self._obj_text
        if not self._named:
            m = _HEAD.match(text)
            if m is None or len(text) == m.end() or text[m.end()] not in "{[":
                return  # not yet, or arguments that are not an object: sent whole at the end
            self._emit_start(out, json.loads(f'"{m.group(1)}"'))
            self._args_start, self._args = m.end(), JsonValueEnd()
        if self._args is None:
            return
        new = text[self._args_start + self._args_sent :]
        self._args.feed(new)
        upto = (self._args.end if self._args.end is not None else self._args.seen) - self._args_sent
        if upto > 0 and self._keep_call:
            out.append(ArgsDelta(self.calls - 1, new[:upto]))
        self._args_sent += max(upto, 0)

    def _after(self, out: list[Event], final: bool) -> bool:
        """After a call object: the format's closing text, a separator, or (mistral) "]"."""
        stripped = self.buf.lstrip()
        if not stripped:
            self.buf = ""
            return False
        fmt = self.fmt
        if fmt.name == "hermes":
            at = stripped.find(fmt.end)
            if at < 0:
                if not final:
                    return False
                self.buf = ""
                return False
            self.buf, self.mode = stripped[at + len(fmt.end) :], "content"
            return True
        if fmt.separator and stripped.startswith(fmt.separator):
            self.buf, self.mode, self.region = stripped[len(fmt.separator) :], "open", ""
            return True
        if fmt.name == "mistral" and stripped.startswith("]"):
            self.buf, self.mode, self._group_opened = stripped[1:], "content", False
            return True
        self.buf, self.mode, self._group_opened = stripped, "content", False
        return True


def parse_tool_calls(
    fmt: ToolFormat, text: str, max_calls: int | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content or None, OpenAI tool_calls) of a whole output."""
    p = ToolCallParser(fmt, max_calls)
    events = p.feed(text) + p.finish()
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, ArgsDelta):
            calls[e.index]["function"]["arguments"] += e.text
    return (content or None), calls
