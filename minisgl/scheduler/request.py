"""A request as the scheduler tracks it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.core.logits_spec import LogitsSpec
from minisgl.core.sampling_params import SamplingParams
from minisgl.kvcache.prefix_cache import MatchResult


@dataclass(eq=False)  # identity: the scheduler finds requests in its lists by identity, not by value
class Request:
    uid: int
    prompt: list[int]
    params: SamplingParams
    seed: int  # every request has one (drawn at random when the user gave none)
    eos_ids: frozenset[int]
    max_total_len: int  # prompt + generated may not exceed this (context or max_tokens)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    row: int = -1  # request-table row while it holds KV slots
    pages: list[int] = field(default_factory=list)
    # With a sliding-window KV group: each page's sliding page (0: freed, out of the window),
    # and the page index below which its sliding table entries are the dummy slot.
    swa_pages: list[int] = field(default_factory=list)
    swa_lo: int = 0
    # A hybrid model's recurrent-state slot (kvcache/state_pool.py) while it holds one; -1: none.
    state_slot: int = -1
    # With state snapshots: the prompt position where its KV match went past its snapshot (a
    # branch point): its prefill chunk ends there and the state is snapshotted (0: none).
    snap_at: int = 0
    # Where its prefill took its last interval snapshot (kv.snapshot; 0: none): the next one
    # supersedes it.
    interval_snap: int = 0
    cached_len: int = 0  # tokens whose K/V are in the cache (or being computed in flight)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # Prefix-cache state: the locked match whose pages start `pages`.
    match: MatchResult | None = None
    # Tokens sampled on the GPU whose values the host has not read yet (overlap scheduling).
    num_pending: int = 0
    cache_hit_tokens: int = 0  # prompt tokens served by the prefix cache (metrics, usage.cached_tokens)
    arrival: int = 0  # the order the scheduler received it in (ties between equal priorities)
    # Whether the chosen tokens' logprobs are reported (the server: when the request asked;
    # offline LLM results always carry them). Only then must a row whose logits a penalty or
    # a grammar mask changes keep a raw copy for them (`logprobs` holds whatever sampling saw
    # otherwise).
    report_logprobs: bool = True
    # Per generated token, when params.top_logprobs > 0: (token id, logprob), most likely first.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # When params.prompt_logprobs is set: per prompt position, None at 0, else (logprob of the
    # prompt token, [(token id, logprob), ...] top-k). Filled chunk by chunk during prefill.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    logits_spec: LogitsSpec | None = None  # penalties/bias/min_tokens/top_logprobs (set at add)
    history_ready: bool = False  # its penalty token history is built on its current table row
    # Structured output: this request's grammar state (minisgl.grammar.RowGrammar), set by the
    # scheduler at add on each rank (never broadcast: every rank builds its own).
    grammar: Any = None
    # Hop timestamps of a traced request (message/trace.py), until its first token is sent.
    trace: dict[str, float] | None = None
    # An embedding request ("last" | "mean" | "cls"): its prompt's final hidden states are pooled
    # (scheduler/pooling.py) and it generates nothing; `pooled` holds the result so far (fp32
    # [hidden] on the host), then the embedding.
    pooling: str | None = None
    pooled: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def total_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def seq_len(self) -> int:
        """Length including tokens still in flight: what the next step extends."""
        return self.total_len + self.num_pending

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_total_len - self.seq_len)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs that are not all computed yet. Such a request takes no
        prefix-cache match: every prompt position's logits must be computed."""
        p = self.prompt_logprobs
        return self.params.prompt_logprobs is not None and (p is None or len(p) < len(self.prompt))

    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def append(self, token: int, logprob: float, top: list[tuple[int, float]] | None = None) -> None:
        """Adds a sampled token (with its alternatives, when asked) and decides whether the
        request is done (EOS, a stop token id, max_tokens or the context). Stop strings are
        found on text, by the caller."""
        self.output.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
        p = self.params
        if not p.ignore_eos and token in self.eos_ids:
            self.finish_reason = "stop"
        elif p.stop_token_ids and token in p.stop_token_ids:
            self.finish_reason = "stop"
        elif self.total_len >= self.max_total_len:
            self.finish_reason = "length"
