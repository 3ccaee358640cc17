"""The scheduler's speculative step: draft, verify as one extend of 1 + k tokens per request,
accept on the device, then hand the scheduler only accepted tokens.

A verify step is not overlapped with the next step: drafting and the next batch's shape
(positions, KV slots) depend on how many tokens this step accepted, so the host reads them
first. At batch sizes where the draft table gives k = 0 the step is a plain decode, with
overlap. KV: slots for positions len - 1 .. len - 1 + k are reserved before the step; after
it, the pages past the accepted tokens go back to the allocator at once (page size 1: the
rejected tokens' slots; larger pages keep the partial page, whose stale slots are rewritten
before they are read), so the radix cache only ever receives accepted tokens.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from minisgl.engine.batch import ForwardBatch
from minisgl.engine.sampler import SamplingTensors
from minisgl.logging_setup import get_logger
from minisgl.scheduler.request import Request
from minisgl.spec.drafter import DraftRequest, TargetStep

if TYPE_CHECKING:
    from minisgl.scheduler.scheduler import Scheduler

log = get_logger("minisgl.scheduler")
LOG_INTERVAL_S = 10.0


class SpecStep:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.engine = sched.engine
        self.cfg = self.engine.cfg.spec
        self.drafter = self.engine.drafter
        assert self.cfg is not None and self.drafter is not None
        self.mirrors = self.drafter.has_model
        # Cumulative counters: draft tokens proposed / accepted, request-steps verified.
        self.proposed = self.accepted = self.verified = 0
        self._logged = (time.monotonic(), 0, 0, 0)

    def draft_tokens(self, batch_size: int) -> int:
        return self.cfg.draft_tokens_for(batch_size)

    def release(self, req: Request) -> None:
        self.drafter.release(req.uid)

    # ---- the draft's KV after plain target steps ----

    def after_plain_step(self, batch: ForwardBatch, reqs: list[Request], samples: list[bool],
                         new: list[list[int]] | None, sampled: torch.Tensor) -> None:
        """After a prefill chunk or plain decode: the draft processes the same positions."""
        if not self.mirrors:
            return
        next_ids = None
        if self.drafter.needs_next_ids:
            # Token after each input: the next input of the request, at its end the sampled
            # token (or, for a prefill chunk that samples nothing, the prompt's next token).
            next_ids = torch.roll(batch.input_ids, -1)
            ends = batch.sample_rows
            after = sampled
            if not all(samples):
                host = [0 if s else _token_at(r, r.cached_len) for r, s in zip(reqs, samples)]
                keep = torch.tensor(samples, device=sampled.device)
                after = torch.where(keep, sampled, torch.tensor(host, device=sampled.device))
            next_ids[ends] = after
        self.drafter.after_forward(TargetStep(batch, next_ids, batch.sample_rows, self._aux()))

    def _aux(self) -> torch.Tensor | None:
        return self.engine.model.model.aux_hidden if self.drafter.aux_layers else None

    # ---- the speculative step ----

    def run(self, reqs: list[Request]) -> list[Request]:
        """One verify step for `reqs` (each has a KV slot for its next token); returns them
        with their accepted tokens appended (finished ones released)."""
        sched, eng, kv = self.sched, self.engine, self.sched.kv
        k = self.draft_tokens(len(reqs))
        # A request may emit at most its remaining tokens: 1 sampled + k drafts.
        ks = [max(0, min(k, r.max_total_len - r.seq_len - 1)) for r in reqs]
        # Slots for every position the drafter and the verify write, before drafting; no room
        # for the drafts: that request decodes plainly (its next token's slot is there).
        ks = [ki if ki == 0 or kv.grow(r, r.seq_len + ki) else 0 for r, ki in zip(reqs, ks)]
        kv.flush()
        drafts = self.drafter.propose([DraftRequest(r.uid, r.row, r.prompt, r.output, ki) for r, ki in zip(reqs, ks)])
        lens = [r.seq_len for r in reqs]
        batch = eng.build_batch("extend", [r.row for r in reqs], [n - 1 for n in lens],
                                [[r.output[-1] if r.output else r.prompt[-1], *d] for r, d in zip(reqs, drafts)],
                                use_graphs=False)  # eager until verify graphs: every position's logits
        kmax = max(1, max(len(d) for d in drafts))
        drafts_t = torch.tensor([d + [0] * (kmax - len(d)) for d in drafts], dtype=torch.int64)
        st = SamplingTensors.build(
            [r.params.temperature for r in reqs], [r.params.top_k for r in reqs], [r.params.top_p for r in reqs],
            [r.params.min_p for r in reqs], [r.seed for r in reqs], [len(r.output) for r in reqs], eng.device,
        )
        for r, n in zip(reqs, lens):
            r.cached_len = n
        tokens, logprobs, num_acc = eng.verify(batch, drafts_t.to(eng.device, non_blocking=True), st)
        if self.mirrors:
            self._after_verify(batch, drafts, tokens, num_acc)
        tokens_h, logprobs_h, num_h = tokens.tolist(), logprobs.tolist(), num_acc.tolist()
        for r, d, n, toks, lps, start in zip(reqs, drafts, num_h, tokens_h, logprobs_h, lens):
            self.proposed += len(d)
            self.accepted += n
            self.verified += 1
            for tok, lp in zip(toks[: n + 1], lps[: n + 1]):
                r.append(tok, lp)
                if r.finished:  # EOS, a stop token or the length limit: the rest is dropped
                    break
            # K/V now holds positions < start + n (the last input and the accepted drafts).
            r.cached_len = min(start + n, r.total_len)
            if r.finished:
                sched._release(r)
            else:
                kv.shrink(r, r.cached_len)
        self._maybe_log()
        return reqs

    def _after_verify(self, batch: ForwardBatch, drafts: list[list[int]], tokens: torch.Tensor,
                      num_acc: torch.Tensor) -> None:
        dev = self.engine.device
        kmax1 = tokens.shape[1]
        last_rows = batch.cu_seqlens_q[:-1].long() + num_acc.long()
        next_ids = None
        if self.drafter.needs_next_ids:
            # Input j of request b is followed by tokens[b, j] (a draft if accepted, else the
            # token sampled there): positions past the first rejection are rewritten later.
            flat = [b * kmax1 + j for b, d in enumerate(drafts) for j in range(len(d) + 1)]
            next_ids = tokens.view(-1)[torch.tensor(flat, dtype=torch.int64).to(dev, non_blocking=True)]
        self.drafter.after_forward(TargetStep(batch, next_ids, last_rows, self._aux()))

    def stats(self) -> dict[str, int]:
        return {"spec_proposed": self.proposed, "spec_accepted": self.accepted, "spec_verified": self.verified}

    def _maybe_log(self) -> None:
        now = time.monotonic()
        t0, p0, a0, v0 = self._logged
        if now - t0 < LOG_INTERVAL_S:
            return
        p, a, v = self.proposed - p0, self.accepted - a0, self.verified - v0
        if v:
            log.info(
                "speculative (%s): %d draft tokens proposed, %d accepted (%.0f%%), mean accepted length %.2f",
                self.drafter.name, p, a, 100.0 * a / max(1, p), (a + v) / v,
            )
        self._logged = (now, self.proposed, self.accepted, self.verified)


def _token_at(req: Request, i: int) -> int:
    """The context's token at position i (a retracted request re-prefills its output too)."""
    return req.prompt[i] if i < len(req.prompt) else req.output[i - len(req.prompt)]
