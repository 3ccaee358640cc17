"""The scheduler's speculative step: which requests draft how many tokens, the KV slots they
need, and the accepted tokens handed back to the requests (the engine drafts, verifies as one
extend of 1 + k tokens per request and accepts on the device: Engine.verify_step).

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
from collections.abc import Callable

import torch

from minisgl.engine.engine import Engine
from minisgl.engine.face import VerifyMask, VerifyStep
from minisgl.logging_setup import get_logger
from minisgl.scheduler.grammar_rows import GrammarRows
from minisgl.scheduler.kv import RequestKV
from minisgl.scheduler.request import Request
from minisgl.scheduler.step_sampling import fresh_histories
from minisgl.speculative.gate import SpecGate

log = get_logger("minisgl.scheduler")
LOG_INTERVAL_S = 10.0


class SpecStep:
    """`release(req)`: the scheduler's way to end a request that finished in a verify step
    (its KV and queue place go)."""

    def __init__(self, engine: Engine, kv: RequestKV, grammar: GrammarRows,
                 release: Callable[[Request], None]) -> None:
        self.engine, self.kv, self.grammar, self.release_request = engine, kv, grammar, release
        self.cfg = self.engine.cfg.spec
        assert self.cfg is not None
        # Cumulative counters: draft tokens proposed / accepted, request-steps verified.
        self.proposed = self.accepted = self.verified = 0
        self.gate = SpecGate()  # pauses speculation while drafts are not accepted (speculative/gate.py)
        self._logged = (time.monotonic(), 0, 0, 0, 0)

    def draft_tokens(self, batch_size: int) -> int:
        return self.cfg.draft_tokens_for(batch_size)

    def should_verify(self, batch_size: int) -> bool:
        """Whether a decode step of `batch_size` requests speculates: the table gives K > 0 and
        the gate is open (it counts the steps it turns into plain ones)."""
        return self.draft_tokens(batch_size) > 0 and self.gate.open()

    # ---- the speculative step ----

    def run(self, reqs: list[Request]) -> list[Request]:
        """One verify step for `reqs` (each has a KV slot for its next token); returns them
        with their accepted tokens appended (finished ones released)."""
        kv = self.kv
        k = self.draft_tokens(len(reqs))
        # A request may emit at most its remaining tokens: 1 sampled + k drafts. A grammar-
        # constrained request drafts nothing (its one row is masked like a plain decode's).
        ks = [0 if r.grammar is not None else max(0, min(k, r.max_total_len - r.seq_len - 1)) for r in reqs]
        # Slots for every position the drafter and the verify write, before drafting; no room
        # for the drafts: that request decodes plainly (its next token's slot is there).
        ks = [ki if ki == 0 or kv.grow(r, r.seq_len + ki) else 0 for r, ki in zip(reqs, ks)]
        kv.flush()
        lens = [r.seq_len for r in reqs]
        mask, masked = self._grammar_mask(reqs)
        step = VerifyStep(reqs, ks, [n - 1 for n in lens], [len(r.output) for r in reqs], fresh_histories(reqs),
                          mask, masked)
        for r, n in zip(reqs, lens):
            r.cached_len = n
        out = self.engine.verify_step(step)
        self.gate.record(sum(out.num_accepted), sum(1 for d in out.drafts if d))
        for b, (r, d, n, toks, lps, start) in enumerate(zip(reqs, out.drafts, out.num_accepted, out.tokens,
                                                            out.logprobs, lens)):
            self.proposed += len(d)
            self.accepted += n
            self.verified += 1
            for j, (tok, lp) in enumerate(zip(toks[: n + 1], lps[: n + 1])):
                top = out.alternatives.get((b, j))
                r.append(tok, lp, top[: r.params.top_logprobs] if top is not None else None)
                if r.grammar is not None and not r.finished:
                    self.grammar.advance([r], [tok])  # an ended grammar sets finish_reason
                if r.finished:  # EOS, a stop token or the length limit: the rest is dropped
                    break
            # K/V now holds positions < start + n (the last input and the accepted drafts).
            r.cached_len = min(start + n, r.total_len)
            if r.finished:
                self.release_request(r)
            else:
                kv.shrink(r, r.cached_len)
        self._maybe_log()
        return reqs

    def _grammar_mask(self, reqs: list[Request]) -> tuple[VerifyMask | None, list[bool] | None]:
        """The mask that fills and applies the grammars' bitmasks at the verify rows of the
        grammar-constrained requests (one row each: they draft nothing), and which those are."""
        masked = [r.grammar is not None for r in reqs]
        if not any(masked):
            return None, None
        constrained = [b for b, m in enumerate(masked) if m]

        def mask(logits: torch.Tensor, first_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
            live = [b for b in constrained if not reqs[b].finished and reqs[b].grammar.needs_mask]
            if not live:
                return None
            return self.grammar.masks.apply(logits, [first_rows[b] for b in live], [reqs[b].grammar for b in live],
                                            with_lse=True)

        return mask, masked

    def stats(self) -> dict[str, int]:
        return {"spec_proposed": self.proposed, "spec_accepted": self.accepted, "spec_verified": self.verified,
                "spec_paused_steps": self.gate.paused_steps}

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._logged[0] < LOG_INTERVAL_S:
            return
        t0, p0, a0, v0, s0 = self._logged
        p, a, v, s = self.proposed - p0, self.accepted - a0, self.verified - v0, self.gate.paused_steps - s0
        if v:
            log.info(
                "speculative (%s): %d draft tokens proposed, %d accepted (%.0f%%), mean accepted length %.2f; "
                "%d decode steps plain while drafts were not accepted",
                self.cfg.algorithm, p, a, 100.0 * a / max(1, p), (a + v) / v, s,
            )
        self._logged = (now, self.proposed, self.accepted, self.verified, self.gate.paused_steps)

