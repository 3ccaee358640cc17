"""GPT-OSS's "harmony" output, parsed incrementally into reasoning, content and tool calls.

A harmony answer is a run of messages, each `<|start|>ROLE` + header + `<|message|>` + body +
an end marker. The header holds `<|channel|>CHANNEL`, an optional recipient ` to=RECIPIENT`
(before or after the channel) and an optional ` <|constrain|>TYPE` (json for function args).
A message ends at `<|end|>`; the turn ends at `<|return|>` (after final) or `<|call|>` (after a
tool call); both are stop tokens, so the output may also just stop. The generation prompt ends
with `<|start|>assistant`, so the first message of an output starts at `<|channel|>`.

Mapping (our choices): analysis -> reasoning; final -> content; a message with a recipient
(`to=functions.NAME`, commentary) -> a tool call NAME whose arguments are the body as written;
commentary without a recipient (a "preamble" the model says before calling tools) -> content.
With no tools in the request (`calls=False`) a call's body is content. An output that does not
open with a harmony header (the special tokens were dropped, or the model ignored the format)
is all content. The markers are special tokens: the detokenizer must keep them (build.py asks
for skip_special_tokens false whenever this parser is in use).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from minisgl.parsers.tool_calls import ArgsDelta, CallStart, TextDelta, _partial_suffix
from minisgl.parsers.tool_formats import TOOL_FORMATS

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class ReasoningDelta:
    text: str


def _hold(text: str, markers: tuple[str, ...]) -> int:
    return max(_partial_suffix(text, m) for m in markers)


class HarmonyParser:
    def __init__(self, calls: bool = True, max_calls: int | None = None) -> None:
        self.calls_enabled = calls
        self.max_calls = max_calls
        self.buf = ""
        self.mode = "start"  # start | header | body | plain
        self.kind = "content"  # the open message's kind: reasoning | content | call | drop
        self.calls = 0
        self.content_started = False

    def feed(self, text: str) -> list[TextDelta | ReasoningDelta | CallStart | ArgsDelta]:
        self.buf += text
        out: list[TextDelta | ReasoningDelta | CallStart | ArgsDelta] = []
        while self.buf and getattr(self, "_" + self.mode)(out, False):
            pass
        return out

    def finish(self) -> list[TextDelta | ReasoningDelta | CallStart | ArgsDelta]:
        out: list[TextDelta | ReasoningDelta | CallStart | ArgsDelta] = []
        while self.buf and getattr(self, "_" + self.mode)(out, True):
            pass
        if self.mode == "start" and self.buf:  # a lone prefix of a marker: text after all
            self._emit(out, "content", self.buf)
        self.buf = ""  # an unfinished header is dropped: it names no channel yet
        return out

    def _emit(self, out: list, kind: str, text: str) -> None:
        if not text:
            return
        if kind == "reasoning":
            out.append(ReasoningDelta(text))
        elif kind == "content":
            if not self.content_started:  # leading whitespace of the answer is dropped
                text = text.lstrip()
                self.content_started = bool(text)
            if text:
                out.append(TextDelta(text))
        elif kind == "call":
            out.append(ArgsDelta(self.calls - 1, text))

    def _start(self, out: list, final: bool) -> bool:
        head = self.buf.lstrip()
        if head.startswith((CHANNEL, START)):
            self.buf, self.mode = head, "header"
            return True
        if not final and head and (CHANNEL.startswith(head) or START.startswith(head)):
            return False  # the first marker may still be arriving
        if not head and not final:
            return False
        self.mode = "plain"
        return True

    def _plain(self, out: list, final: bool) -> bool:
        self._emit(out, "content", self.buf)
        self.buf = ""
        return False

    def _header(self, out: list, final: bool) -> bool:
        at = self.buf.find(MESSAGE)
        if at < 0:
            return False  # headers are short: wait for the whole of it
        header, self.buf = self.buf[:at], self.buf[at + len(MESSAGE):]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and self.calls_enabled:
            name = recipient.group(1)
            name = name[len("functions."):] if name.startswith("functions.") else name
            if self.max_calls is None or self.calls < self.max_calls:
                self.kind = "call"
                out.append(CallStart(self.calls, TOOL_FORMATS["gpt-oss"].new_call_id(), name))
                self.calls += 1
            else:
                self.kind = "drop"  # parallel_tool_calls false: the first call only
        elif channel is not None and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"  # final, and commentary preambles
        self.mode = "body"
        return True

    def _body(self, out: list, final: bool) -> bool:
        found = [(i, m) for m in ENDS if (i := self.buf.find(m)) >= 0]
        if not found:
            hold = 0 if final else _hold(self.buf, ENDS)
            self._emit(out, self.kind, self.buf[: len(self.buf) - hold])
            self.buf = self.buf[len(self.buf) - hold:]
            return False
        at, marker = min(found)
        self._emit(out, self.kind, self.buf[:at])
        self.buf = self.buf[at + len(marker):]
        self.mode = "between"
        return True

    def _between(self, out: list, final: bool) -> bool:
        """After a message: the next one's `<|start|>`; anything else there is not harmony."""
        head = self.buf.lstrip()
        if head.startswith((START, CHANNEL)):
            self.buf, self.mode = head, "header"
            return True
        if not final and (START.startswith(head) or CHANNEL.startswith(head)):
            return False
        self.buf, self.mode = head, "plain"
        return True


def prompt_is_harmony(chat_template: str | None) -> bool:
    """The chat template writes harmony (GPT-OSS's): its channel and message markers."""
    return bool(chat_template) and CHANNEL in chat_template and MESSAGE in chat_template
