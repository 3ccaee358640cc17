"""Messages that carry a request toward the scheduler: API → tokenizer → scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.message.codec import message


@message
@dataclass
class TokenizeMsg:
    """API server → tokenizer worker: one prompt, generated `len(uids)` times (OpenAI `n`).

    Exactly one of text / input_ids / messages is set; messages (chat) are templated by the
    worker. `sampling` holds SamplingParams fields; a missing max_tokens means "the rest of
    the context". The *_field names say how errors should name the culprit to this caller.
    """

    uids: list[int]
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False
    skip_special_tokens: bool = True
    prompt_field: str = "prompt"
    max_tokens_field: str = "max_tokens"
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": False}
    reasoning: str | None = None  # the reasoning parser: a grammar starts after its block


@message
@dataclass
class AbortMsg:
    """Ends a request early: `abort` (its client went away) or `stop` (the detokenizer found
    a stop string). Unknown or already finished uids are ignored."""

    uid: int
    reason: str = "abort"


@message
@dataclass
class DetokInit:
    """What the detokenizer needs about a request; it travels inside the request's first
    TokenOut, so it can never arrive after the tokens it describes."""

    prompt_tokens: int
    stop: list[str] | None = None
    skip_special_tokens: bool = True
    logprobs: bool = False
    reasoning_open: bool = False  # the prompt ends inside a reasoning block (the output starts in it)


@message
@dataclass
class UserMsg:
    """Tokenizer → scheduler rank 0: a validated, tokenized request. The seed is concrete
    (drawn by the tokenizer when the user gave none), so every rank that replays the input
    stream samples identically."""

    uid: int
    input_ids: list[int]
    sampling: dict[str, Any]
    seed: int
    detok: DetokInit
