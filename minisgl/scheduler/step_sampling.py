"""A step's sampling inputs, built once per step from its requests (where the batch is built):
SamplingTensors, the LogitsPlan (penalties, bias, min_tokens, top_logprobs, the grammar mask),
the extra logits rows of prompt logprobs, and the rebuild of penalty token histories on fresh table rows; and
the logprob alternatives of its output, handed back to the requests that asked."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.core.logits_spec import LogitsMask
from minisgl.engine.engine import Engine
from minisgl.sampling.logits_plan import LogitsPlan, StepOutput
from minisgl.sampling.sampler import SamplingTensors
from minisgl.scheduler.request import Request


@dataclass
class StepSampling:
    tensors: SamplingTensors
    plan: LogitsPlan | None
    extra_logit_rows: list[int]  # indices into the step's new tokens (prompt logprobs)
    # (batch row, first extra row, count): which extra rows' logprobs belong to which request.
    prompt_spans: list[tuple[int, int, int]]


def prepare_step_sampling(
    engine: Engine, reqs: list[Request], samples: list[bool], prefix: list[int],
    new: list[list[int] | None] | None, mask: LogitsMask | None = None,
) -> StepSampling:
    """`mask`: the step's grammar mask (None: no row has one)."""
    generated = [len(r.output) + r.num_pending for r in reqs]  # exact under overlap: values unknown
    tensors = SamplingTensors.build(
        [r.params.temperature for r in reqs], [r.params.top_k for r in reqs],
        [r.params.top_p for r in reqs], [r.params.min_p for r in reqs],
        [r.seed for r in reqs], generated, engine.device,
    )
    rebuild_histories(engine, reqs)
    extra: list[int] = []
    targets: list[int] = []
    spans: list[tuple[int, int, int]] = []
    k = 0
    if new is not None:
        offset = 0  # of row i's first new token in the step's tokens
        for i, (req, start, toks) in enumerate(zip(reqs, prefix, new)):
            if toks is None:  # a mixed step's decode: one token, from the token buffer
                offset += 1
                continue
            if req.needs_prompt_logprobs:
                if start == 0:  # (re)starts from scratch: no prefix match was taken
                    req.prompt_logprobs = [None]
                # Logits at position p give the logprob of prompt[p + 1].
                n = max(0, min(start + len(toks), len(req.prompt) - 1) - start)
                if n:
                    spans.append((i, len(targets), n))
                    extra.extend(range(offset, offset + n))
                    targets.extend(req.prompt[start + 1 : start + 1 + n])
                    k = max(k, req.params.prompt_logprobs or 0)
            offset += len(toks)
    plan = None
    if targets or mask is not None or any(r.logits_spec is not None for r in reqs):
        plan = LogitsPlan.build(
            [r.logits_spec for r in reqs], generated, samples, [r.row for r in reqs], targets, k, engine.device,
            mask, [r.report_logprobs for r in reqs],
        )
    return StepSampling(tensors, plan, extra, spans)


def rebuild_histories(engine: Engine, reqs: list[Request]) -> None:
    """A request that tracks token counts and is new on its table row (fresh, or back after a
    retraction with the output it had: the host holds every token then) gets its row's history
    rebuilt before its first step there, in stream order."""
    fresh = [r for r in reqs if r.logits_spec is not None and r.logits_spec.tracks_counts and not r.history_ready]
    if not fresh:
        return
    engine.penalties.reset(
        [r.row for r in fresh], [r.output for r in fresh],
        [r.prompt if r.logits_spec.needs_prompt else None for r in fresh],  # type: ignore[union-attr]
    )
    for r in fresh:
        assert r.num_pending == 0, "a request starting on a row has no tokens in flight"
        r.history_ready = True


def top_logprobs_by_row(sampling: StepSampling, out: StepOutput) -> dict[int, list[tuple[int, float]]]:
    """Batch row -> its (token id, logprob) alternatives, most likely first (plan.top_k of them:
    each request keeps its own first top_logprobs). Host copies only."""
    if sampling.plan is None or out.top_ids is None or out.top_logprobs is None:
        return {}
    pairs = (list(zip(ids, lps)) for ids, lps in zip(out.top_ids.tolist(), out.top_logprobs.tolist()))
    return dict(zip(sampling.plan.top_rows_cpu, pairs))


def add_prompt_logprobs(reqs: list[Request], sampling: StepSampling, out: StepOutput) -> None:
    """Appends this step's prompt-logprob entries to the requests' lists, in position order."""
    if not sampling.prompt_spans:
        return
    assert out.prompt_logprobs is not None and out.prompt_top_ids is not None and out.prompt_top_logprobs is not None
    lps, ids, top_lps = out.prompt_logprobs.tolist(), out.prompt_top_ids.tolist(), out.prompt_top_logprobs.tolist()
    for i, start, n in sampling.prompt_spans:
        req = reqs[i]
        if req.finished or req.prompt_logprobs is None:
            continue
        k = req.params.prompt_logprobs or 0
        req.prompt_logprobs.extend((lps[j], list(zip(ids[j][:k], top_lps[j][:k]))) for j in range(start, start + n))
