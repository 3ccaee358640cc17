"""Prefill admission: which waiting (or mid-prefill) requests run how many prompt tokens in
the next step, under a token budget and the KV pool's admission estimate.

`admit` changes the scheduler's state the way launching the step will need it (requests leave
`waiting`, get their table rows, prefix matches and KV slots; a chunked request becomes
`prefilling`; a request whose prompt completes joins `running`); `finish_admitted` does the
bookkeeping after the launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minisgl.scheduler.request import Request

if TYPE_CHECKING:
    from minisgl.scheduler.scheduler import Scheduler


@dataclass
class PrefillPlan:
    reqs: list[Request] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # tokens each has cached before the step
    new: list[list[int]] = field(default_factory=list)  # prompt tokens each runs now
    samples: list[bool] = field(default_factory=list)  # False: a chunk that samples nothing

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.new)


def reserved_pages(sched: Scheduler) -> int:
    """Pages the running requests are expected to still need (the admission estimate)."""
    reqs = [*sched.running, *([sched.prefilling] if sched.prefilling else [])]
    kv = sched.kv
    return sum(
        max(0, kv.pages_for(r.seq_len + int(r.remaining_tokens * sched.new_token_ratio)) - len(r.pages))
        for r in reqs
    )


def admit(sched: Scheduler, budget: int) -> PrefillPlan:
    """Prompt tokens for the next step, at most `budget` in all: the request mid-prefill
    first, then waiting requests in order while the pool's estimate admits them."""
    plan = PrefillPlan()
    reserved = reserved_pages(sched)
    table, kv = sched.engine.table, sched.kv
    logit_rows = sched.prompt_logprob_rows  # prompt positions whose logits this step may compute
    while budget > 0:
        if sched.prefilling is not None:
            req = sched.prefilling
        elif sched.waiting and table.free_rows > 0 and (logit_rows or not sched.waiting[0].needs_prompt_logprobs):
            req = sched.waiting[0]
            match = kv.match(req)
            tokens_needed = req.seq_len + int(req.remaining_tokens * sched.new_token_ratio)
            need = kv.pages_for(tokens_needed) - len(match.pages)
            alone = not sched.running and not plan.reqs
            if not alone and need + reserved > kv.available_pages:
                break
            sched.waiting.popleft()
            kv.attach(req, match)
            req.history_ready = False  # a new table row: its penalty history is rebuilt
            reserved += need
        else:
            break
        tokens = req.tokens()
        chunk = min(len(tokens) - req.cached_len, budget)
        if req.needs_prompt_logprobs:
            chunk = min(chunk, logit_rows)
            logit_rows -= chunk
        if not kv.grow(req, req.cached_len + chunk):
            if req is not sched.prefilling:  # undo the admission; try again later
                kv.release(req)
                req.cached_len = 0
                sched.waiting.appendleft(req)
            break
        plan.reqs.append(req)
        plan.prefix.append(req.cached_len)
        plan.new.append(tokens[req.cached_len : req.cached_len + chunk])
        req.cached_len += chunk
        budget -= chunk
        complete = req.cached_len == len(tokens)
        plan.samples.append(complete)
        if complete:
            sched.running.append(req)
            sched.prefilling = None
        else:
            sched.prefilling = req
            break  # a chunked request takes the rest of the budget by construction
    return plan


def finish_admitted(sched: Scheduler, plan: PrefillPlan) -> None:
    """After the launch: a completed prompt awaits its first token; a chunk's KV goes to the
    prefix cache (other requests sharing the prompt can reuse it)."""
    for req, sampled in zip(plan.reqs, plan.samples):
        if sampled:
            req.num_pending += 1
        else:
            sched.kv.cache_progress(req)
