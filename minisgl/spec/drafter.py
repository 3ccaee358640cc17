"""The drafter interface: what the speculative step asks of n-gram, draft-model and EAGLE-3
drafters.

A drafter proposes up to k tokens per request (a greedy chain, so q is one-hot). Drafters
with a model keep their own KV pool, indexed by the target's slots through the target's
request table: `after_forward` runs the draft over the same positions and slots as every
target forward (prefill chunks, decodes, verify steps), so the draft's KV covers exactly
the tokens the target's does, and a prefix the radix cache holds is valid for both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minisgl.engine.batch import ForwardBatch


@dataclass
class DraftRequest:
    """One request to draft for. Its context is prompt + output (the scheduler's lists, not
    copied: a step must not cost O(context) per request); the last token is not in the KV
    cache yet (the next step's first input, at position length - 1)."""

    key: int  # stable while the request lives (its uid)
    row: int  # request-table row
    prompt: list[int]
    output: list[int]
    k: int  # tokens wanted (0: none)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def tail(self, start: int) -> list[int]:
        """The context from position `start` on."""
        if start >= len(self.prompt):
            return self.output[start - len(self.prompt) :]
        return self.prompt[start:] + self.output


@dataclass
class TargetStep:
    """What a drafter with a model needs of a target forward that just ran. `next_ids[t]`: the
    token that follows input token t (t's successor in the batch, or the token sampled or
    accepted after a request's last input); `last_rows[b]`: index in the batch of request b's
    last valid input (verify: the last accepted position). `aux`: the target's residual
    stream at the drafter's layers, [T, layers x hidden], when it asked for them."""

    batch: ForwardBatch
    next_ids: torch.Tensor | None
    last_rows: torch.Tensor
    aux: torch.Tensor | None


class Drafter(ABC):
    name: str = "base"
    # A draft model with its own KV (after_forward runs it); False: drafts from tokens alone.
    has_model: bool = False
    # The target must return its residual stream at these layers (EAGLE-3), else None.
    aux_layers: tuple[int, ...] | None = None
    # Whether after_forward reads TargetStep.next_ids (building them costs a gather).
    needs_next_ids: bool = False

    def kv_bytes_per_token(self) -> int:
        """Bytes of draft KV per token slot (added to the target's when sizing the pool)."""
        return 0

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        """Create the draft's KV pool with the target's pages (same slot ids)."""

    def after_forward(self, step: TargetStep) -> None:
        """Keep the draft's KV in step with a target forward (no-op without a draft model)."""

    @abstractmethod
    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        """Up to `k` draft tokens per request. Requests are in batch order; the slots of
        positions length - 1 .. length - 1 + k are already in the request table."""

    def release(self, key: int) -> None:
        """A request left (finished, aborted or retracted): drop per-request state."""


def subset_index(live: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    """Device index of the `live` entries among `total` (a draft chain's requests that still
    want tokens), or None when every entry is live."""
    if len(live) == total:
        return None
    return torch.tensor(live, dtype=torch.int64).to(device, non_blocking=True)
