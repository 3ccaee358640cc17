"""Messages that carry a request toward the scheduler: API → tokenizer → scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.core.sampling_params import SamplingParams
from minisgl.message.codec import message, register

register(SamplingParams)  # requests carry it typed, validated once in the API process


@message
@dataclass
class TokenizeMsg:
    """API server → tokenizer worker: one prompt, generated `len(uids)` times (OpenAI `n`).

    Exactly one of text / input_ids / messages is set; messages (chat) are templated by the
    worker. `sampling` was validated by the API process (decoding does not validate again);
    its max_tokens None means "the rest of the context", which the worker resolves once it
    knows the prompt's length. Errors name SamplingParams fields and `prompt`; the API renames
    them to the request's own field names. mode "tokenize" (POST /tokenize) replies with the
    prompt's ids instead of generating.
    """

    uids: list[int]
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: bool = False  # the chosen tokens' logprobs (alternatives: sampling.top_logprobs)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = None  # None: the tokenizer's own decoding
    include_stop_str: bool = False  # keep the stop string / stop token's text in the output
    add_special_tokens: bool | None = None  # None: True for text, False for templated messages
    add_generation_prompt: bool = True  # messages: end the template with the assistant's turn
    return_prompt: bool = False  # the first reply carries the prompt's tokens (echo, prompt logprobs)
    mode: str = "generate"  # "generate" | "tokenize"
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": False}
    reasoning: str | None = None  # the reasoning parser: a grammar starts after its block
    trace: dict[str, float] | None = None  # hop timestamps when traced (message/trace.py)
    admit_by: float | None = None  # CLOCK_MONOTONIC deadline for admission (--max-queue-wait-s)
    pooling: str | None = None  # an embedding request: how its prompt's hidden states are pooled


@message
@dataclass
class DecodeMsg:
    """API server → tokenizer worker (POST /detokenize): the text of token ids, in a UserReply."""

    uid: int
    token_ids: list[int]


@message
@dataclass
class AbortMsg:
    """Ends a request early: `abort` (its client went away) or `stop` (the detokenizer found
    a stop string). Unknown or already finished uids are ignored."""

    uid: int
    reason: str = "abort"
    # `stop`: the output tokens up to the one that completed the stop string. A step can bring
    # several tokens (speculative decoding); the scheduler drops any after these.
    keep_tokens: int | None = None


@message
@dataclass
class DetokInit:
    """What the detokenizer needs about a request; it travels inside the request's first
    TokenOut, so it can never arrive after the tokens it describes."""

    prompt_tokens: int
    stop: list[str] | None = None
    skip_special_tokens: bool = True
    logprobs: bool = False
    spaces_between_special_tokens: bool | None = None
    include_stop_str: bool = False
    top_logprobs: int = 0  # alternatives per token the request asked for
    prompt_ids: list[int] | None = None  # set when the first reply must render the prompt
    prompt_logprobs: bool = False  # the first TokenOut carries prompt logprobs to render
    reasoning_open: bool = False  # the prompt ends inside a reasoning block (the output starts in it)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (set by the scheduler)


@message
@dataclass
class UserMsg:
    """Tokenizer → scheduler rank 0: a validated, tokenized request (max_tokens resolved). The
    seed is concrete (drawn by the tokenizer when the user gave none), so every rank that
    replays the input stream samples identically."""

    uid: int
    input_ids: list[int]
    sampling: SamplingParams
    seed: int
    detok: DetokInit
    trace: dict[str, float] | None = None  # hop timestamps when traced (message/trace.py)
    # Still waiting for admission at this CLOCK_MONOTONIC time: refused (scheduler/queue_bounds.py).
    admit_by: float | None = None
    # An embedding request ("last" | "mean" | "cls"): its prompt may fill the context (it
    # generates nothing); its one reply carries the pooled hidden state (UserReply.embedding).
    pooling: str | None = None
