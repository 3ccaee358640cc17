"""What a step does to its logits beyond temperature/top-k/top-p/min-p, and what it reports.

A request's `LogitsSpec` (core/logits_spec.py) is built once (at add) from its SamplingParams;
`LogitsPlan` once per step from the specs of the batch's rows: device tensors for the penalty
op (only the rows that need it), for the count update after sampling, for the top-k logprobs
of the rows that ask, and for prompt logprobs; plus the step's grammar mask (a host callback,
see core/logits_spec.py `LogitsMask`). A batch whose rows ask for none of it gets no plan at
all and pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minisgl import ops
from minisgl.core.logits_spec import LogitsMask, LogitsSpec
from minisgl.sampling.penalty_state import PenaltyState
from minisgl.sampling.sampler import SamplingTensors


def _pack(segments: Sequence[Sequence[float | int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy; each segment starts on a 16-byte boundary (Triton specializes
    kernels on pointer alignment: offsets that moved with the batch would recompile them)."""
    per = 16 // torch.tensor([], dtype=dtype).element_size()
    host: list[float | int] = []
    starts = []
    for seg in segments:
        starts.append(len(host))
        host.extend(seg)
        host.extend([0] * (-len(seg) % per))
    # Pinned: a copy from pageable memory may wait for the stream (for the step in flight).
    flat = torch.tensor(host, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    return [flat[s : s + len(seg)] for s, seg in zip(starts, segments)]


@dataclass
class PenaltyArgs:
    """The penalty op's per-step arguments (minisgl.ops.apply_penalties), for `rows` only."""

    rows: torch.Tensor  # int32 [n] batch rows that the op changes
    rows_long: torch.Tensor  # int64 [n] the same (for gathers)
    state_rows: torch.Tensor  # int32 [n] request-table rows (token history)
    rep: torch.Tensor  # f32 [n]
    pres: torch.Tensor
    freq: torch.Tensor
    bias_ptr: torch.Tensor  # int32 [n + 1]
    bias_ids: torch.Tensor  # int32 [nnz]
    bias_vals: torch.Tensor  # f32 [nnz]


@dataclass
class LogitsPlan:
    penalty: PenaltyArgs | None
    count_rows: torch.Tensor | None  # int64 [m] batch rows whose sampled token is counted
    count_state_rows: torch.Tensor | None  # int64 [m] their request-table rows
    top_rows: torch.Tensor | None  # int64 [q] batch rows that want top_logprobs
    top_rows_cpu: list[int]
    top_k: int  # the largest k among them (each row keeps its own first k)
    prompt_targets: torch.Tensor | None  # int64 [E]: the prompt token each extra logits row predicts
    prompt_k: int
    mask: LogitsMask | None = None
    # int64 [r] batch rows whose logits the penalty op changes and whose chosen token's logprob
    # is reported: they keep a raw copy for it (a mask alone needs none: see LogitsMask).
    raw_rows: torch.Tensor | None = None

    @staticmethod
    def build(
        specs: Sequence[LogitsSpec | None], generated: Sequence[int], samples: Sequence[bool],
        state_rows: Sequence[int], prompt_targets: Sequence[int], prompt_k: int, device: torch.device,
        mask: LogitsMask | None = None, reports: Sequence[bool] | None = None,
    ) -> LogitsPlan | None:
        """Row i of the batch: its spec, tokens generated before this step, whether it samples,
        its request-table row and whether its chosen token's logprob is reported (reports;
        None: every row's). `prompt_targets`: the extra logits rows' next prompt tokens."""
        pen: list[int] = []
        ptr, ids, vals = [0], [], []
        counted, tops, raw = [], [], []
        for i, (spec, gen, sampled) in enumerate(zip(specs, generated, samples)):
            if not sampled:  # a prefill chunk's token is dropped: nothing to do
                continue
            if spec is None:
                continue
            s_ids, s_vals = spec.sparse(gen)
            if spec.tracks_counts or s_ids:
                pen.append(i)
                ids.extend(s_ids)
                vals.extend(s_vals)
                ptr.append(len(ids))
                if reports is None or reports[i]:
                    raw.append(i)
            if spec.tracks_counts:
                counted.append(i)
            if spec.top_logprobs:
                tops.append(i)
        if not pen and not counted and not tops and not prompt_targets and mask is None:
            return None
        s_pen = [state_rows[i] for i in pen]
        rep = [specs[i].rep for i in pen]  # type: ignore[union-attr]
        pres = [specs[i].pres for i in pen]  # type: ignore[union-attr]
        freq = [specs[i].freq for i in pen]  # type: ignore[union-attr]
        i32 = _pack([pen, s_pen, ptr, ids], torch.int32, device)
        f32 = _pack([rep, pres, freq, vals], torch.float32, device)
        i64 = _pack([pen, counted, [state_rows[i] for i in counted], tops, prompt_targets, raw], torch.int64, device)
        penalty = PenaltyArgs(i32[0], i64[0], i32[1], *f32[:3], i32[2], i32[3], f32[3]) if pen else None
        return LogitsPlan(
            penalty=penalty,
            count_rows=i64[1] if counted else None, count_state_rows=i64[2] if counted else None,
            top_rows=i64[3] if tops else None, top_rows_cpu=tops,
            top_k=max((specs[i].top_logprobs for i in tops), default=0),  # type: ignore[union-attr]
            prompt_targets=i64[4] if prompt_targets else None, prompt_k=prompt_k,
            mask=mask, raw_rows=i64[5] if raw else None,
        )


@dataclass
class StepOutput:
    """What one step returns (device tensors, or their host copies after `to_host`)."""

    tokens: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor  # f32 [B], of the raw logits
    top_ids: torch.Tensor | None = None  # int64 [q, top_k] for LogitsPlan.top_rows
    top_logprobs: torch.Tensor | None = None  # f32 [q, top_k]
    prompt_logprobs: torch.Tensor | None = None  # f32 [E] of each extra row's target token
    prompt_top_ids: torch.Tensor | None = None  # int64 [E, prompt_k]
    prompt_top_logprobs: torch.Tensor | None = None  # f32 [E, prompt_k]

    def to_host(self) -> StepOutput:
        """Starts non-blocking copies to the CPU (the caller waits on an event before reading)."""
        if self.tokens.device.type == "cpu":
            return self
        fields = {k: (v.to("cpu", non_blocking=True) if v is not None else None) for k, v in vars(self).items()}
        return StepOutput(**fields)


def sample_with_plan(
    logits: torch.Tensor, st: SamplingTensors, plan: LogitsPlan, state: PenaltyState,
    sample: Callable[[torch.Tensor, SamplingTensors], tuple[torch.Tensor, torch.Tensor]],
) -> StepOutput:
    """logits fp32 [B + E, V]: the B sampled rows, then E extra rows for prompt logprobs.
    Logprobs are of the raw logits, so they are taken before the penalty op and the mask change
    them in place; a penalized row's chosen-token logprob comes from a copy of its raw row (only
    for the rows that report it: plan.raw_rows), a row the mask alone changed gets it from its
    chosen logit and the raw log-normalizer the mask returns (see LogitsMask; where the grammar
    allowed no token at all, a dead end that ends the request, that logprob is -inf).

    Order: raw logprobs (prompt, alternatives) -> raw copy -> penalties/bias/min_tokens in
    place -> mask in place on `logits[:b]` -> sample -> raw chosen logprobs (masked rows, then
    the raw copies, which win for rows both changed) -> count update.
    Another per-row logits processor goes beside the mask; a processor that must run on a row
    makes the step build a plan (LogitsPlan.build returns None only when no row needs
    anything): with no plan, Engine.run_batch just samples."""
    b = st.temperature.numel()
    out = StepOutput(tokens=logits.new_empty(0, dtype=torch.int64), logprobs=logits.new_empty(0))
    if plan.prompt_targets is not None:
        out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs = ops.top_logprobs(
            logits[b:], plan.prompt_k, plan.prompt_targets
        )
    logits = logits[:b]
    if plan.top_rows is not None:
        _, out.top_ids, out.top_logprobs = ops.top_logprobs(logits.index_select(0, plan.top_rows), plan.top_k)
    raw = logits.index_select(0, plan.raw_rows) if plan.raw_rows is not None else None
    pen = plan.penalty
    if pen is not None:
        counts, prompt = state.buffers()
        ops.apply_penalties(logits, pen.rows, pen.state_rows, counts, prompt, pen.rep, pen.pres, pen.freq,
                            pen.bias_ptr, pen.bias_ids, pen.bias_vals)
    masked = plan.mask(logits) if plan.mask is not None else None
    out.tokens, out.logprobs = sample(logits, st)
    if masked is not None:
        rows, raw_lse = masked
        out.logprobs.index_copy_(0, rows, logits[rows, out.tokens.index_select(0, rows)] - raw_lse)
    if raw is not None:
        assert plan.raw_rows is not None
        chosen = out.tokens.index_select(0, plan.raw_rows)[:, None]
        raw_lp = raw.gather(1, chosen).squeeze(1) - ops.logsumexp_rows(raw)
        out.logprobs.index_copy_(0, plan.raw_rows, raw_lp)
    if plan.count_rows is not None:
        assert plan.count_state_rows is not None
        state.record(plan.count_state_rows, out.tokens.index_select(0, plan.count_rows))
    return out
