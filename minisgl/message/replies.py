"""Messages that carry results back: scheduler → detokenizer → API, plus process control."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.message.codec import message
from minisgl.message.requests import DetokInit


@message
@dataclass
class TokenOut:
    """New tokens of one request since its last TokenOut (one per step, usually one token)."""

    uid: int
    token_ids: list[int]
    logprobs: list[float] | None = None  # of the chosen tokens, when the request asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" (client gone: drop state)
    init: DetokInit | None = None  # set on the request's first TokenOut only


@message
@dataclass
class DetokenizeMsg:
    """Scheduler → detokenizer: everything one step produced."""

    items: list[TokenOut]


@message
@dataclass
class UserReply:
    """Detokenizer → API server: a text delta of one request (or an error for it)."""

    uid: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    token_texts: list[str] | None = None  # one string per token in token_ids, with logprobs
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    error: str | None = None
    error_param: str | None = None  # the request field to blame (OpenAI error `param`)
    reasoning_open: bool = False  # DetokInit.reasoning_open, on the request's first reply


@message
@dataclass
class ReplyBatch:
    replies: list[UserReply]


@message
@dataclass
class StatsMsg:
    """Scheduler → API server, a few times a second while busy and once when it idles."""

    running: int
    queued: int
    kv_used: int  # KV slots held by requests (and cached prefixes, where there is a cache)
    kv_total: int
    prompt_tokens: int  # cumulative prompt tokens admitted
    cache_hit_tokens: int  # cumulative prompt tokens served from the prefix cache


@message
@dataclass
class ReadyMsg:
    """Child → launcher once loaded (or with `error` when loading failed). The scheduler's
    info: max_model_len, vocab_size, kv_total, model; a tokenizer's: eos_token_id."""

    name: str
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@message
@dataclass
class StartMsg:
    """Launcher → every child once all are ready: facts only known after loading."""

    max_model_len: int
    vocab_size: int
    extra_eos_ids: list[int] = field(default_factory=list)  # the tokenizer's EOS, if not the model's
