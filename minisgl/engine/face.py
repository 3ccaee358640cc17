"""The engine's face: what the scheduler hands the engine for one step, and what it gets back.

One call per step kind (engine/steps.py), each described in the request vocabulary:

  Engine.step(Step) -> StepResult
      a prefill (extend), decode or mixed step. The engine builds the batch (a captured
      graph's bucket when one fits), the sampling tensors and the logits plan, rebuilds the
      penalty histories of rows that start fresh, runs forward + sample, and feeds its drafter
      the target forward. Overlapped: the scheduler starts the result's host copy, launches
      the next step, and only then waits for it.
  Engine.verify_step(VerifyStep) -> VerifyResult
      a speculative step: draft, verify as one extend of 1 + k tokens per request, accept on
      the device, feed the drafter. Synchronous: it returns host values.
  Engine.pool_step(PoolStep) -> torch.Tensor
      an embedding model's step: prompt chunks whose final hidden states are pooled per
      request instead of sampled. Eager and synchronous: it returns host values.

The scheduler never builds an engine object (batch, sampling tensors, plans, penalty state,
drafter views): it says which requests run, with how many cached and which new tokens, and
what each asks of its logits; the engine says what came out. Request fields are read through
`StepRequest`, which the scheduler's Request satisfies as it is, so describing a step costs a
few lists, as building its sampling inputs did before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from minisgl.core.logits_spec import LogitsMask, LogitsSpec
from minisgl.core.sampling_params import SamplingParams
from minisgl.sampling.logits_plan import StepOutput

# A verify step's grammar mask: changes the fp32 [T, V] verify logits in place (after the
# penalties, before acceptance) at the rows of the requests VerifyStep.masked names.
# `first_rows[b]`: request b's first verify row (its last token's logits; a masked request
# drafts nothing, so it is its only row). Run on the host once the forward is launched. Returns
# (the masked rows int64 [k], their log-normalizers before the mask f32 [k]) as a decode step's
# mask does (the chosen tokens' logprobs come from them alike), or None when no row was masked.
VerifyMask = Callable[[torch.Tensor, list[int]], "tuple[torch.Tensor, torch.Tensor | None] | None"]


class StepRequest(Protocol):
    """What the engine reads of each request of a step (scheduler/request.py's Request)."""

    uid: int  # keys the drafter's per-request state
    row: int  # request-table row
    prompt: list[int]  # its context is prompt + output: the scheduler's lists, read, not copied
    output: list[int]
    params: SamplingParams  # temperature, top_k, top_p, min_p; prompt_logprobs (how many alternatives)
    seed: int
    logits_spec: LogitsSpec | None  # penalties, bias, min_tokens, top_logprobs (None: none)
    report_logprobs: bool  # whether its chosen tokens' logprobs are reported (raw copies need it)


@dataclass
class Step:
    """A plain step: batch row i is reqs[i]."""

    mode: str  # "extend" | "decode" | "mixed" (decodes first, then extends)
    reqs: Sequence[StepRequest]
    prefix_lens: list[int]  # tokens of each already in the KV cache (their slots are in the table)
    # Each request's new tokens; None: one token, its last sampled one, read on the device from
    # the token buffer (all of a decode step: new_tokens None; a mixed step's leading rows).
    new_tokens: list[list[int] | None] | None
    samples: list[bool]  # False: a prefill chunk's row (its sampled token is dropped)
    generated: list[int]  # tokens each has generated so far, those in flight included
    # Prompt logprobs: batch row -> the prompt token that follows each of its first len(...) new
    # tokens (the engine computes logits there too).
    prompt_targets: dict[int, list[int]] = field(default_factory=dict)
    # Batch rows starting on their table row (fresh, or back after a retraction): the engine
    # rebuilds their penalty history from prompt + output before the step.
    fresh_history: list[int] = field(default_factory=list)
    mask: LogitsMask | None = None  # the step's grammar mask (core/logits_spec.py)
    traced: bool = False  # stamp when the batch was built (StepResult.built)


@dataclass
class StepTokens:
    """A plain step's output on the host, per batch row (a chunk's row too: its token is junk)."""

    tokens: list[int]
    logprobs: list[float]  # of the raw logits
    alternatives: dict[int, list[tuple[int, float]]]  # batch row -> top (id, logprob), most likely first
    # Prompt logprobs, one entry per Step.prompt_targets token in batch-row order: the target's
    # logprob and the position's top ids and logprobs (None: the step had no targets).
    prompt_logprobs: list[float] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None


@dataclass
class StepResult:
    """A launched step: its output on the device, and what the trace line says of it."""

    output: StepOutput  # device tensors; host copies once copy_to_host ran (CUDA)
    top_rows: list[int]  # batch rows whose alternatives output.top_ids holds, in its order
    mode: str
    requests: int
    tokens: int
    graph: int | None  # the replayed graph's bucket (tokens or batch size); None: eager
    eager: str | None  # why it ran eagerly
    built: float = 0.0  # when its batch was built (message/trace.py's clock), when traced
    event: torch.cuda.Event | None = None

    def copy_to_host(self) -> None:
        """Starts the non-blocking copies of the output to the host (CUDA; the CPU's are there)."""
        if self.output.tokens.device.type == "cuda":
            self.output = self.output.to_host()
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        """Until the host copies are there."""
        if self.event is not None:
            self.event.synchronize()

    def read(self) -> StepTokens:
        """The host values (after wait)."""
        out = self.output
        alternatives = {}
        if self.top_rows and out.top_ids is not None and out.top_logprobs is not None:
            pairs = (list(zip(ids, lps)) for ids, lps in zip(out.top_ids.tolist(), out.top_logprobs.tolist()))
            alternatives = dict(zip(self.top_rows, pairs))
        host = StepTokens(out.tokens.tolist(), out.logprobs.tolist(), alternatives)
        if out.prompt_logprobs is not None:
            assert out.prompt_top_ids is not None and out.prompt_top_logprobs is not None
            host.prompt_logprobs = out.prompt_logprobs.tolist()
            host.prompt_top_ids = out.prompt_top_ids.tolist()
            host.prompt_top_logprobs = out.prompt_top_logprobs.tolist()
        return host


@dataclass
class VerifyStep:
    """A speculative step for decoding requests (each has KV slots for positions len - 1 ..
    len - 1 + draft_tokens[i], written to the table): batch row i is reqs[i]."""

    reqs: Sequence[StepRequest]
    draft_tokens: list[int]  # drafts each may propose (0: none, its one row samples as a decode)
    prefix_lens: list[int]  # len - 1: the last token is not in the KV cache yet
    generated: list[int]
    fresh_history: list[int] = field(default_factory=list)  # as Step's
    mask: VerifyMask | None = None
    masked: list[bool] | None = None  # the requests whose rows the mask may change


@dataclass
class VerifyResult:
    """A verify step's outcome on the host. Request b's new tokens are
    tokens[b][: num_accepted[b] + 1]: its accepted drafts, then the token sampled after them."""

    drafts: list[list[int]]
    tokens: list[list[int]]
    logprobs: list[list[float]]  # of the raw logits
    num_accepted: list[int]
    alternatives: dict[tuple[int, int], list[tuple[int, float]]]  # (request, j) -> top (id, logprob)


@dataclass
class PoolStep:
    """An embedding model's step: each request's next prompt chunk, its final hidden states (the
    last layer's, after the final norm) pooled instead of a token sampled. Batch row i is
    reqs[i]; engine/pooling.py says what each pooling gives for a chunk."""

    reqs: Sequence[StepRequest]
    prefix_lens: list[int]  # tokens of each already in the KV cache (its earlier chunks)
    new_tokens: list[list[int]]
    pooling: list[str]  # per request: "last" | "mean" | "cls"
