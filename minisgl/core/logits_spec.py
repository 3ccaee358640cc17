"""What a request asks of its logits beyond temperature/top-k/top-p/min-p, in the form every
step consumes (`LogitsSpec`), and the contract of a step's logits mask (`LogitsMask`).

Both are request vocabulary that the scheduler and the engine share: the scheduler compiles a
request's spec once (at add) and makes a step's grammar mask; the engine turns the specs of a
batch into its per-step logits plan (sampling/logits_plan.py) and runs the mask. They live on
the ground floor so that neither side imports the other's modules for them. No torch here at
run time: the tensors in LogitsMask's signature are named for the type checker only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from minisgl.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

# Changes the fp32 [B, V] sampled rows' logits in place (a grammar's token mask), after the
# penalties and before sampling. It runs on the host once the step's forward is launched, so it
# may wait for the host state it needs (the scheduler's in-flight tokens) while the forward runs.
# It returns the batch rows it masked (int64 [k], on the device) and their log-normalizers as
# they were before the mask (f32 [k]), or None when it masked nothing: a mask only sets
# forbidden logits to -inf, so a masked row's chosen (allowed) token keeps its logit, and its raw
# logprob is that logit minus the raw log-normalizer, without a raw copy of the row.
LogitsMask = Callable[["torch.Tensor"], "tuple[torch.Tensor, torch.Tensor] | None"]


class LogitsSpec:
    """One request's penalties, bias, min_tokens ban and top_logprobs, in the form the plan
    builder consumes every step (lists prepared once, ids deduplicated and < vocab)."""

    __slots__ = ("rep", "pres", "freq", "min_tokens", "top_logprobs", "_open", "_banned")

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int], vocab_size: int) -> None:
        self.rep = float(params.repetition_penalty)
        self.pres = float(params.presence_penalty)
        self.freq = float(params.frequency_penalty)
        self.min_tokens = params.min_tokens
        self.top_logprobs = params.top_logprobs
        bias = {int(t): float(b) for t, b in (params.logit_bias or {}).items() if b != 0.0}
        self._open = (list(bias), list(bias.values()))
        # While fewer than min_tokens tokens exist, EOS (unless ignored) and the stop token ids
        # are banned. An id outside the vocabulary can never be sampled: nothing to ban.
        stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_ids))
        banned = {**bias, **{t: float("-inf") for t in stops if 0 <= t < vocab_size}}
        self._banned = (list(banned), list(banned.values()))

    @staticmethod
    def of(params: SamplingParams, eos_ids: frozenset[int], vocab_size: int) -> LogitsSpec | None:
        """None for a request that needs none of it (the common case: no per-step work)."""
        spec = LogitsSpec(params, eos_ids, vocab_size)
        if spec.tracks_counts or spec._open[0] or spec.min_tokens > 0 or spec.top_logprobs > 0:
            return spec
        return None

    @property
    def tracks_counts(self) -> bool:
        """Needs the row's token history (counts; prompt presence too with a repetition penalty)."""
        return self.rep != 1.0 or self.pres != 0.0 or self.freq != 0.0

    @property
    def needs_prompt(self) -> bool:
        return self.rep != 1.0

    def sparse(self, generated: int) -> tuple[list[int], list[float]]:
        """The (ids, additions) of a step that samples the request's token number `generated`."""
        return self._banned if generated < self.min_tokens else self._open
