"""SpecConfig: which drafter proposes tokens, how many per step, and at which batch sizes.

The draft length per batch size comes from a table (vLLM's num_speculative_tokens_per_batch_size
idea) that benchmarks/spec_tune.py measures on the GPU: a JSON object
`{"num_draft_tokens": {"1": 4, "16": 2, "64": 0}}`, where a key is the smallest batch size its
value applies to; 0 turns speculation off there (the step is a plain, overlappable decode).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

ALGORITHMS = ("ngram", "draft", "eagle3", "mtp")
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str
    num_draft_tokens: int = 4  # K: tokens proposed per request per step (chain drafts)
    draft_model: str | None = None  # `draft`: a model with the target's vocabulary; `eagle3`: the head
    ngram_min: int = 1  # shortest suffix of the context that may match (tokens)
    ngram_max: int = 4  # longest suffix tried first
    # batch size -> K (sorted by batch size); empty: K at every batch size
    table: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown speculative_algorithm {self.algorithm!r}; choose from {', '.join(ALGORITHMS)}")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"speculative_num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}"
            )
        if self.algorithm in ("draft", "eagle3") and not self.draft_model:
            raise ValueError(f"speculative_algorithm {self.algorithm!r} needs speculative_draft_model (a path)")
        if self.algorithm == "ngram" and self.draft_model:
            raise ValueError("speculative_draft_model is for 'draft' and 'eagle3'; ngram drafts from the context")
        if self.algorithm == "mtp" and self.draft_model:
            raise ValueError("speculative_draft_model is for 'draft' and 'eagle3'; mtp drafts with the MTP head of "
                             "the model's own checkpoint")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"speculative_ngram_min ({self.ngram_min}) and _max ({self.ngram_max}) need 1 <= min <= max"
            )
        if any(k < 0 or k > self.num_draft_tokens for _, k in self.table):
            raise ValueError(f"the draft table's values must be in [0, {self.num_draft_tokens}]: {dict(self.table)}")

    def draft_tokens_for(self, batch_size: int) -> int:
        """K for a decode batch of `batch_size` requests (0: no speculation at that size)."""
        if not self.table:
            return self.num_draft_tokens
        i = bisect.bisect_right([b for b, _ in self.table], batch_size) - 1
        return self.table[max(i, 0)][1]  # below the smallest size: the smallest size's K


def load_table(path: str | None, num_draft_tokens: int) -> tuple[tuple[int, int], ...]:
    """The `{"num_draft_tokens": {batch size: K}}` file, values capped at `num_draft_tokens`."""
    if path is None:
        return ()
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"speculative draft table {path!r} does not exist")
    try:
        raw = json.loads(p.read_text())["num_draft_tokens"]
        table = sorted((int(b), min(int(k), num_draft_tokens)) for b, k in raw.items())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"speculative draft table {path!r} is not {{\"num_draft_tokens\": {{size: K}}}}: {e}") from e
    if not table or table[0][0] < 1:
        raise ValueError(f"speculative draft table {path!r} needs batch sizes >= 1")
    return tuple(table)


def make_spec_config(
    algorithm: str | None, num_draft_tokens: int, draft_model: str | None, ngram_min: int, ngram_max: int,
    draft_table: str | None,
) -> SpecConfig | None:
    """The speculative options as EngineConfig and ServerArgs name them (speculative_*)."""
    if algorithm is None:
        if draft_model is not None or draft_table is not None:
            raise ValueError(
                "speculative_draft_model / speculative_draft_table need speculative_algorithm: "
                f"{', '.join(ALGORITHMS[:-1])} or {ALGORITHMS[-1]}"
            )
        return None
    return SpecConfig(
        algorithm, num_draft_tokens, draft_model, ngram_min, ngram_max, load_table(draft_table, num_draft_tokens)
    )
