"""Embedding requests in the scheduler: their prompt chunks are admitted like any prefill's (the
same budget, KV pages and chunking; no prefix-cache match, and their KV is freed, not cached,
when they end: kv.py), but run as the engine's pool step (engine/pooling.py), and a request whose
prompt is done ends there with its embedding, generating nothing. A prefill plan holding both
kinds runs as two steps; generation's never waits on an embedding's device work (it is synchronous
and has no tokens in flight)."""

from __future__ import annotations

from minisgl.engine.engine import Engine
from minisgl.engine.face import PoolStep
from minisgl.scheduler.prefill import PrefillPlan
from minisgl.scheduler.request import Request


def split_pooling(plan: PrefillPlan) -> tuple[PrefillPlan, PrefillPlan]:
    """(the plan's embedding requests, the rest), each in the plan's order."""
    parts = (PrefillPlan(), PrefillPlan())
    for req, prefix, new, sample in zip(plan.reqs, plan.prefix, plan.new, plan.samples):
        part = parts[req.pooling is None]
        part.reqs.append(req)
        part.prefix.append(prefix)
        part.new.append(new)
        part.samples.append(sample)
    return parts


def run_pool_step(engine: Engine, plan: PrefillPlan) -> list[Request]:
    """Runs the chunks of `plan` (embedding requests only) and adds each to its request's pooled
    state; returns the requests whose prompt is done, finished ("stop") with their embedding."""
    rows = engine.pool_step(PoolStep(plan.reqs, plan.prefix, plan.new, [r.pooling for r in plan.reqs]))
    done = []
    for req, prefix, row, complete in zip(plan.reqs, plan.prefix, rows, plan.samples):
        if prefix == 0:  # its first chunk (again, after a retraction): start over
            req.pooled = None
        if req.pooling == "mean":
            req.pooled = row if req.pooled is None else req.pooled + row
        elif req.pooling == "last" or prefix == 0:  # cls: the first chunk's first token
            req.pooled = row
        if complete:
            if req.pooling == "mean":
                req.pooled = req.pooled / len(req.prompt)
            req.finish_reason = "stop"
            done.append(req)
    return done
