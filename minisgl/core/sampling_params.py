"""SamplingParams: how one request's tokens are chosen and when it stops.

Logits pipeline of one sampled token (all per request, on the device):
  raw logits ──▶ repetition penalty ──▶ presence/frequency penalties ──▶ logit_bias
            ──▶ min_tokens mask ──▶ grammar mask ──▶ temperature ──▶ top-k ──▶ top-p ──▶ min-p ──▶ draw.
Reported log-probabilities (the chosen token's, `top_logprobs`, `prompt_logprobs`) are those of
the raw logits: log_softmax before any of the steps above (vLLM's default "raw_logprobs").
`priority` is no sampling field but travels with them: where the request queues (the scheduler's
priority policy), never which tokens it gets.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20  # alternatives per position, as OpenAI allows for top_logprobs
PRIORITY_MAX = 2**31 - 1  # |priority| bound: a 32-bit integer, as any client sends it
_UNEXPECTED_KWARG = re.compile(r"unexpected keyword argument '(\w+)'")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    # None: the rest of the context, resolved by `resolve_max_tokens` where the prompt's length
    # is known (the server's tokenizer worker, the offline LLM).
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # OpenAI: logit[t] -= presence * (count[t] > 0) + frequency * count[t], counts over the
    # tokens this request generated.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL / transformers, over prompt + generated tokens: a seen token's logit l becomes
    # l / r if l > 0 else l * r.
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100 bans)
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    top_logprobs: int = 0  # alternatives returned per generated token
    prompt_logprobs: int | None = None  # None: off; k: every prompt token's logprob + k alternatives
    # Structured output (xgrammar), at most one of: a JSON schema (dict or JSON text), a regex,
    # an EBNF grammar, or an xgrammar structural tag (dict or JSON text).
    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict | None = None
    # The grammar constrains only what follows the first occurrence of this token (a reasoning
    # model's end of thinking, e.g. Qwen3's `</think>`); None: from the first token.
    grammar_after_token: int | None = None
    # Scheduling, as vLLM's: smaller runs first under `scheduling_policy="priority"`; the fcfs
    # policy refuses any value but 0 (a request asking for an order it would not get).
    priority: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError whose message starts with the offending field's name."""
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop_token_ids is not None and not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        self._validate_logit_bias()
        most = float("inf") if self.max_tokens is None else self.max_tokens
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= most:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        self._validate_grammar()
        if not _is_int(self.priority) or not -PRIORITY_MAX <= self.priority <= PRIORITY_MAX:
            raise ValueError(f"priority must be an integer in [-{PRIORITY_MAX}, {PRIORITY_MAX}], got {self.priority!r}")

    def resolve_max_tokens(self, room: int) -> None:
        """Sets max_tokens None to `room` (the tokens the context leaves after the prompt) and
        checks min_tokens against it: the one check that needs the prompt's length. In place,
        without validating anything else (these params were validated where they were made)."""
        if self.max_tokens is not None:
            return
        if self.min_tokens > room:
            raise ValueError(f"min_tokens: {self.min_tokens} asked for but the prompt leaves room for {room} tokens")
        self.max_tokens = room

    def _validate_logit_bias(self) -> None:
        """Token ids must be ints >= 0 (the vocabulary bound is checked where the vocabulary is
        known: the API's request models, the offline LLM); biases finite numbers in [-100, 100]."""
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for tok, bias in self.logit_bias.items():
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            if not _is_real(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {tok}")

    def _validate_grammar(self) -> None:
        from minisgl.core.grammar_fields import GRAMMAR_FIELDS, normalize_grammar_field

        given = []
        for name in GRAMMAR_FIELDS:
            setattr(self, name, normalize_grammar_field(name, getattr(self, name)))
            if getattr(self, name) is not None:
                given.append(name)
        if len(given) > 1:
            raise ValueError(f"{given[0]}: only one of {', '.join(GRAMMAR_FIELDS)} may be set, got {', '.join(given)}")
        t = self.grammar_after_token
        if t is not None and (not _is_int(t) or t < 0):
            raise ValueError(f"grammar_after_token must be a token id or None, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def checked_sampling(fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams(**fields), its errors as RequestError naming the field (its messages
    start with the field's name; a field this engine build lacks is named too)."""
    try:
        return SamplingParams(**fields)
    except TypeError as e:
        m = _UNEXPECTED_KWARG.search(str(e))
        name = m.group(1) if m else None
        raise RequestError(f"{name}: not supported by this engine build", name) from e
    except ValueError as e:
        name = str(e).split(" ", 1)[0].rstrip(":")
        raise RequestError(str(e), name if name in SamplingParams.__dataclass_fields__ else None) from e
