"""Prefill admission: which waiting (or mid-prefill) requests run how many prompt tokens in
the next step, under a token budget and the KV pool's admission estimate.

`admit` moves requests between the scheduler's queues the way launching the step will need it
(requests leave `waiting`, get their table rows, prefix matches and KV slots; a chunked request
becomes `prefilling`; a request whose prompt completes joins `running`); `finish_admitted` does
the bookkeeping after the launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.scheduler.kv import RequestKV
from minisgl.scheduler.queues import RequestQueues
from minisgl.scheduler.request import Request


@dataclass
class PrefillPlan:
    reqs: list[Request] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # tokens each has cached before the step
    new: list[list[int]] = field(default_factory=list)  # prompt tokens each runs now
    samples: list[bool] = field(default_factory=list)  # False: a chunk that samples nothing

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.new)


def expected_pages(kv: RequestKV, req: Request, new_token_ratio: float) -> int:
    """The admission estimate: the pages `req` is expected to hold when it ends."""
    return kv.pages_for(req.seq_len + int(req.remaining_tokens * new_token_ratio))


def reserved_pages(queues: RequestQueues, kv: RequestKV, new_token_ratio: float) -> int:
    """Pages the running requests are expected to still need (the admission estimate)."""
    return sum(max(0, expected_pages(kv, r, new_token_ratio) - len(r.pages)) for r in queues.active)


def admit(queues: RequestQueues, kv: RequestKV, budget: int, new_token_ratio: float,
          prompt_logprob_rows: int) -> PrefillPlan:
    """Prompt tokens for the next step, at most `budget` in all: the request mid-prefill
    first, then waiting requests in order while the pool's estimate admits them (a request's
    remaining tokens count at `new_token_ratio`). `prompt_logprob_rows`: prompt positions whose
    logits the step may compute for prompt logprobs."""
    plan = PrefillPlan()
    reserved = reserved_pages(queues, kv, new_token_ratio)
    logit_rows = prompt_logprob_rows
    while budget > 0:
        waiting = queues.next_waiting()
        if queues.prefilling is not None:
            req = queues.prefilling
        elif waiting is not None and kv.free_rows > 0 and (logit_rows or not waiting.needs_prompt_logprobs):
            req = waiting
            match = kv.match_and_load(req)  # host-tier pages come back to the GPU here (the step waits per layer)
            need = expected_pages(kv, req, new_token_ratio) - len(match.pages)
            alone = not queues.running and not plan.reqs
            if not alone and need + reserved > kv.available_pages:
                break
            queues.take_waiting()
            kv.attach(req, match)
            req.history_ready = False  # a new table row: its penalty history is rebuilt
            reserved += need
        else:
            break
        tokens = req.tokens()
        chunk = min(len(tokens) - req.cached_len, budget)
        if req.snap_at > req.cached_len:  # a branch point to snapshot (kv.snapshot): the chunk ends there
            chunk = min(chunk, req.snap_at - req.cached_len)
        if req.needs_prompt_logprobs:
            chunk = min(chunk, logit_rows)
            logit_rows -= chunk
        if not kv.grow(req, req.cached_len + chunk):
            if req is not queues.prefilling:  # undo the admission; try again later
                kv.release(req)
                req.cached_len = 0
                queues.requeue(req)
            break
        plan.reqs.append(req)
        plan.prefix.append(req.cached_len)
        plan.new.append(tokens[req.cached_len : req.cached_len + chunk])
        req.cached_len += chunk
        budget -= chunk
        complete = req.cached_len == len(tokens)
        plan.samples.append(complete)
        if complete:
            queues.prefilled(req)
        else:
            queues.chunked(req)
            break  # a chunked request takes the rest of the budget by construction
    return plan


def finish_admitted(kv: RequestKV, plan: PrefillPlan) -> None:
    """After the launch: a completed prompt awaits its first token; a chunk's KV goes to the
    prefix cache (other requests sharing the prompt can reuse it); a hybrid model's state is
    snapshotted where the step ended at a snapshot point (kv.snapshot)."""
    for req, prefix, sampled in zip(plan.reqs, plan.prefix, plan.samples):
        if sampled:
            req.num_pending += 1
        else:
            kv.cache_progress(req)
        kv.snapshot(req, prefix)
