"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # Structured output (xgrammar), at most one of: a JSON schema (dict or JSON text), a regex,
    # an EBNF grammar, or an xgrammar structural tag (dict or JSON text).
    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict | None = None
    # The grammar constrains only what follows the first occurrence of this token (a reasoning
    # model's end of thinking, e.g. Qwen3's `</think>`); None: from the first token.
    grammar_after_token: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self._validate_grammar()

    def _validate_grammar(self) -> None:
        from minisgl.grammar.spec import GRAMMAR_FIELDS, normalize_grammar_field

        given = []
        for name in GRAMMAR_FIELDS:
            setattr(self, name, normalize_grammar_field(name, getattr(self, name)))
            if getattr(self, name) is not None:
                given.append(name)
        if len(given) > 1:
            raise ValueError(f"{given[0]}: only one of {', '.join(GRAMMAR_FIELDS)} may be set, got {', '.join(given)}")
        t = self.grammar_after_token
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ValueError(f"grammar_after_token must be a token id or None, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
