"""Messages that carry results back: scheduler → detokenizer → API, plus process control."""

from __future__ import annotations

from collections.abc import Callable
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
    # When the request asked (params.top_logprobs > 0): per token of token_ids, its
    # [[token_id, logprob], ...] alternatives, most likely first.
    top_logprobs: list[list[list]] | None = None
    # When asked (params.prompt_logprobs), on the first TokenOut only: per prompt position,
    # None at 0, else [logprob of the prompt token, [[token_id, logprob], ...] top-k].
    prompt_logprobs: list | None = None
    trace: dict[str, float] | None = None  # on the first TokenOut of a traced request (message/trace.py)


@message
@dataclass
class DetokenizeMsg:
    """Scheduler → detokenizer: everything one step produced."""

    items: list[TokenOut]


@message
@dataclass
class PromptEcho:
    """The prompt's tokens as the detokenizer renders them, in a request's first UserReply
    when it asked (echo, prompt logprobs, /tokenize's token strings)."""

    text: str  # the prompt decoded (special tokens kept)
    token_ids: list[int]
    token_texts: list[str]
    token_bytes: list[bytes]
    # Per position: None at 0 (nothing precedes it), else [logprob, alternatives] (see UserReply).
    logprobs: list | None = None


@message
@dataclass
class UserReply:
    """Detokenizer → API server: a text delta of one request (or an error for it).

    With logprobs, per token of token_ids: token_texts (display text: the token's bytes with
    U+FFFD for a partial character), token_bytes (its raw bytes) and, when asked, top_logprobs:
    alternatives as [token_id, text, logprob, bytes], most likely first."""

    uid: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    token_texts: list[str] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    error: str | None = None
    error_param: str | None = None  # the request field to blame (OpenAI error `param`)
    token_bytes: list[bytes] | None = None
    top_logprobs: list[list[list]] | None = None
    prompt: PromptEcho | None = None  # first reply only, when asked
    reasoning_open: bool = False  # DetokInit.reasoning_open, on the request's first reply
    trace: dict[str, float] | None = None  # on the first reply of a traced request (message/trace.py)
    cached_tokens: int = 0  # of the prompt tokens, those served from the prefix cache
    # Refused for load, not for its content ("queue_tokens", "queue_timeout"): the API answers
    # 503 with Retry-After (server/admission.py), not a 400.
    error_code: str | None = None
    matched_stop: str | None = None  # the stop string that ended it (Anthropic's stop_sequence), last reply
    # An embedding request's pooled hidden state, float32 little-endian (its one reply; the
    # scheduler sends it to the API directly: there is nothing to detokenize).
    embedding: bytes | None = None


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
    # Data parallelism: which replica reports, its load (tokens of its running and waiting
    # requests), and how many requests (UserMsg) it has received so far, so the DP controller
    # can add the requests it sent that this report does not include yet.
    dp_rank: int = 0
    load_tokens: int = 0
    received: int = 0
    # Speculative decoding, cumulative: draft tokens proposed and accepted, request-steps verified.
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_verified: int = 0
    # The sliding-window KV group (models with sliding layers; 0 without one): slots in use
    # (held by requests; evictable cached ones count as free) and in all.
    kv_swa_used: int = 0
    kv_swa_total: int = 0
    # The host KV tier (--host-kv-cache-gb): bytes held now; cumulative prefix hits served from
    # it, tokens loaded back and the seconds those loads took.
    host_kv_bytes: int = 0
    host_kv_hits: int = 0
    host_kv_tokens_loaded: int = 0
    host_kv_load_s: float = 0.0
    # A hybrid model's recurrent-state slots (kvcache/state_pool.py; 0 without): held by
    # requests, and in all.
    state_used: int = 0
    state_total: int = 0
    # Its state snapshots for prefix-cache hits (kvcache/radix_snap.py): held by the radix cache, and slots.
    state_snapshots: int = 0
    state_snapshots_total: int = 0

    @property
    def kv_usage(self) -> float:
        """The share of the KV pool in use, in [0, 1]."""
        return self.kv_used / self.kv_total if self.kv_total else 0.0

    @property
    def cache_hit_rate(self) -> float:
        """The share of admitted prompt tokens served from the prefix cache."""
        return self.cache_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


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


# What a worker process calls once it is loaded: it reports `info` to the launcher (ReadyMsg)
# and returns the StartMsg every child waits for. The launcher hands it to each worker, so no
# worker imports the launcher.
Ready = Callable[[dict[str, Any] | None], StartMsg]
