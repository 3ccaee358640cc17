"""Reasoning blocks (Qwen3 `<think> ... </think>`) split from the answer, incrementally.

The block is reasoning_content; what follows `</think>` is content (its leading whitespace
dropped). A block may open in the output (`<think>` first) or in the prompt (a template that
ends the generation prompt with `<think>`: pass `in_reasoning=True`); a block cut by
max_tokens is all reasoning. An output that does not open with a block is all content.
"""

from __future__ import annotations

# gpt-oss: harmony's analysis message; ChatOutput hands harmony output to parsers/harmony.py
# (the markers here only serve reasoning_gate, which lets a grammar start at once for it).
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"), "gpt-oss": ("<|channel|>analysis<|message|>", "<|end|>")}


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    def __init__(self, name: str = "qwen3", in_reasoning: bool = False) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose from {sorted(REASONING_PARSERS)}")
        self.open, self.close = REASONING_PARSERS[name]
        self.mode = "reasoning" if in_reasoning else "start"  # start | reasoning | answer
        self.buf = ""
        self.answer_started = False
        self.saw_block = in_reasoning

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of output."""
        self.buf += text
        reasoning, content = "", ""
        if self.mode == "start":
            head = self.buf.lstrip()
            if head.startswith(self.open):
                self.buf, self.mode, self.saw_block = head[len(self.open) :], "reasoning", True
            elif self.open.startswith(head) and not final:
                return "", ""  # could still be the opening tag
            else:
                self.mode = "answer"
        if self.mode == "reasoning":
            at = self.buf.find(self.close)
            if at < 0:
                hold = 0 if final else _partial_suffix(self.buf, self.close)
                reasoning, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold :]
                return reasoning, ""
            reasoning, self.buf, self.mode = self.buf[:at], self.buf[at + len(self.close) :], "answer"
        if self.mode == "answer":
            content, self.buf = self.buf, ""
            if not self.answer_started:
                content = content.lstrip()
                self.answer_started = bool(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


def split_reasoning(text: str, name: str = "qwen3", in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning_content or None, content) of a whole output."""
    p = ReasoningParser(name, in_reasoning)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2 if p.saw_block else None), c1 + c2


def prompt_opens_reasoning(prompt_text: str, name: str = "qwen3") -> bool:
    """True when the rendered prompt ends inside an open reasoning block (the template wrote
    `<think>` itself), so the output starts with reasoning."""
    open_tag, close_tag = REASONING_PARSERS[name]
    tail = prompt_text.rstrip()
    return tail.endswith(open_tag)


def prompt_closes_reasoning(prompt_text: str, name: str = "qwen3") -> bool:
    """True when the prompt already holds an empty, closed block after the last turn (Qwen3 with
    enable_thinking=False): the output has no reasoning, and a grammar starts at once."""
    return prompt_text.rstrip().endswith(REASONING_PARSERS[name][1])
