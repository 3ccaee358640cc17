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
from pathlib import Path

import torch
from torch import nn

from minisgl.core.batch import ForwardBatch
from minisgl.core.model_config import ModelConfig
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.kvcache.pool import RequestTable


@dataclass(frozen=True)
class DraftTarget:
    """What a drafter may know of the target engine it drafts for (the engine builds it; a
    drafter never sees the engine itself): the target's model shape and input embedding (an
    EAGLE-3 head may share it), where and how it runs, and the limits its buffers follow."""

    model_config: ModelConfig
    embed_tokens: nn.Module
    device: torch.device
    dtype: torch.dtype
    tp: TPInfo
    comm: Communicator
    max_model_len: int
    max_requests: int  # request-table rows in use at most (the table has one more: padding)
    seed: int
    dummy_weights: bool  # --load-format dummy: a drafter with a model fills random weights too
    attention_backend: str
    lm_head: nn.Module | None = None  # the target's LM head (an MTP head shares it)
    checkpoint: Path | None = None  # the target's safetensors folder (an MTP head loads from it); None: GGUF


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
    # The target must return its residual stream at these layers (EAGLE-3; (): its final normed
    # hidden states, for an MTP head), else None.
    aux_layers: tuple[int, ...] | None = None
    # Whether after_forward reads TargetStep.next_ids (building them costs a gather).
    needs_next_ids: bool = False
    # The engine runs `mirror(batch)` inside every target forward (CUDA graphs capture it with
    # the target); after_forward is then not called. For drafters whose pass needs nothing
    # but the batch (a draft model's K/V).
    mirrors_in_forward: bool = False

    def kv_bytes_per_token(self) -> int:
        """Bytes of draft KV per token slot (added to the target's when sizing the pool)."""
        return 0

    def allocate_kv(self, num_pages: int, page_size: int, table: RequestTable) -> None:
        """Create the draft's KV pool with the target's pages (same slot ids); `table` is the
        target's request table, which indexes both pools."""

    def after_forward(self, step: TargetStep) -> None:
        """Keep the draft's KV in step with a target forward (no-op without a draft model)."""

    def mirror(self, batch: ForwardBatch) -> None:
        """The draft's pass over a target forward's batch, inside it (mirrors_in_forward)."""

    def enable_cuda_graphs(self, batch_sizes: list[int], runner_cls: type) -> None:
        """Capture the draft chain's steps per decode batch size (drafters with a model)."""

    def describe_graphs(self) -> str:
        steps = getattr(self, "steps", None)
        return steps.describe() if steps is not None else ""

    @abstractmethod
    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        """Up to `k` draft tokens per request. Requests are in batch order; the slots of
        positions length - 1 .. length - 1 + k are already in the request table."""

    def release(self, key: int) -> None:
        """A request left (finished, aborted or retracted): drop per-request state."""
