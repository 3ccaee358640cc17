"""The scheduler's bookkeeping around a step's sampling (the engine builds the sampling itself
from the step's description, engine/steps.py): which requests start a fresh penalty history,
which prompt positions of a step still need logprobs, and handing those back to the requests
that asked."""

from __future__ import annotations

from collections.abc import Sequence

from minisgl.engine.face import StepTokens
from minisgl.scheduler.request import Request


def fresh_histories(reqs: Sequence[Request]) -> list[int]:
    """Batch rows whose request tracks token counts and is new on its table row (fresh, or back
    after a retraction with the output it had: the host holds every token then). The engine
    rebuilds their penalty history before the step; from then on it keeps it on the device."""
    fresh = [i for i, r in enumerate(reqs)
             if r.logits_spec is not None and r.logits_spec.tracks_counts and not r.history_ready]
    for i in fresh:
        assert reqs[i].num_pending == 0, "a request starting on a row has no tokens in flight"
        reqs[i].history_ready = True
    return fresh


def prompt_logprob_targets(
    reqs: Sequence[Request], prefix: list[int], new: list[list[int] | None] | None,
) -> dict[int, list[int]]:
    """For the step's rows that still need prompt logprobs, in row order: batch row -> the
    prompt token each of its first new tokens predicts (what the engine computes logits for;
    its results come back in this order, add_prompt_logprobs)."""
    targets: dict[int, list[int]] = {}
    if new is None:
        return targets
    for i, (req, start, toks) in enumerate(zip(reqs, prefix, new)):
        if toks is None or not req.needs_prompt_logprobs:  # a mixed step's decode: one token, from the token buffer
            continue
        if start == 0:  # (re)starts from scratch: no prefix match was taken
            req.prompt_logprobs = [None]
        # Logits at position p give the logprob of prompt[p + 1].
        n = max(0, min(start + len(toks), len(req.prompt) - 1) - start)
        if n:
            targets[i] = req.prompt[start + 1 : start + 1 + n]
    return targets


def add_prompt_logprobs(reqs: list[Request], targets: dict[int, list[int]], out: StepTokens) -> None:
    """Appends this step's prompt-logprob entries to the requests' lists, in position order
    (the entries of the rows of `targets`, one after the other in row order)."""
    if not targets:
        return
    lps, ids, top_lps = out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs
    assert lps is not None and ids is not None and top_lps is not None
    first = 0
    for i, want in targets.items():
        start, n, req = first, len(want), reqs[i]
        first += n
        if req.finished or req.prompt_logprobs is None:
            continue
        k = req.params.prompt_logprobs or 0
        req.prompt_logprobs.extend((lps[j], list(zip(ids[j][:k], top_lps[j][:k]))) for j in range(start, start + n))
