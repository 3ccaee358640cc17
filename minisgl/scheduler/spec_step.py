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

import dataclasses
import time
from collections.abc import Callable

import torch

from minisgl.core.batch import ForwardBatch
from minisgl.core.logits_spec import LogitsMask
from minisgl.engine.engine import Engine
from minisgl.logging_setup import get_logger
from minisgl.sampling.sampler import SamplingTensors
from minisgl.sampling.verify_plan import VerifyPlan
from minisgl.scheduler.grammar_rows import GrammarRows
from minisgl.scheduler.kv import RequestKV
from minisgl.scheduler.request import Request
from minisgl.scheduler.step_sampling import rebuild_histories
from minisgl.speculative.drafter import DraftRequest, TargetStep
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
        self.drafter = self.engine.drafter
        assert self.cfg is not None and self.drafter is not None
        # A drafter with a model that the engine does not run inside its forward (EAGLE-3: it
        # needs the sampled tokens) runs after each target step here.
        self.mirrors = self.drafter.has_model and not self.drafter.mirrors_in_forward
        # Cumulative counters: draft tokens proposed / accepted, request-steps verified.
        self.proposed = self.accepted = self.verified = 0
        self.gate = SpecGate()  # pauses speculation while drafts are not accepted (spec/gate.py)
        self._logged = (time.monotonic(), 0, 0, 0, 0)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compiles the acceptance kernel now, not at the first verify step (which would then
        take seconds): once per specialization it can meet. Triton specializes the drafts' row
        stride (the step's longest draft) on == 1 and on multiples of 16."""
        from minisgl import ops

        dev, vocab = self.engine.device, self.engine.model_config.vocab_size
        top = max((k for _, k in self.cfg.table), default=self.cfg.num_draft_tokens)  # the longest K
        if top == 0:
            return
        gen = torch.Generator(device=dev).manual_seed(0)
        for k in sorted({1, min(2, top), *(16 * i for i in range(1, top // 16 + 1))}):
            st = SamplingTensors.build([0.0, 0.8], [-1, 20], [1.0, 0.9], [0.0, 0.05], [1, 2], [0, 0], dev)
            logits = torch.randn(2 * (k + 1), vocab, generator=gen, device=dev)
            cu = torch.tensor([0, k + 1, 2 * (k + 1)], dtype=torch.int32, device=dev)
            drafts = torch.randint(0, vocab, (2, k), generator=gen, device=dev)
            ops.spec_accept(logits, cu, drafts, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.steps)

    def draft_tokens(self, batch_size: int) -> int:
        return self.cfg.draft_tokens_for(batch_size)

    def should_verify(self, batch_size: int) -> bool:
        """Whether a decode step of `batch_size` requests speculates: the table gives K > 0 and
        the gate is open (it counts the steps it turns into plain ones)."""
        return self.draft_tokens(batch_size) > 0 and self.gate.open()

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
        self.drafter.after_forward(self._target_step(batch, next_ids, batch.sample_rows))

    def _target_step(self, batch: ForwardBatch, next_ids: torch.Tensor | None, last_rows: torch.Tensor) -> TargetStep:
        """A step that replayed a graph hands the drafter the graph's padded batch (its static
        tensors, valid until another graph of the pool replays), which the residual stream it
        left matches; next_ids are padded to it."""
        aux = self.engine.model.model.aux_hidden if self.drafter.aux_layers else None
        if batch.graph is None:
            return TargetStep(batch, next_ids, last_rows, aux)
        full = dataclasses.replace(self.engine.graphs.static[batch.graph])
        if next_ids is not None:
            padded = torch.zeros(full.num_tokens, dtype=next_ids.dtype, device=next_ids.device)
            padded[: next_ids.numel()] = next_ids
            next_ids = padded
        return TargetStep(full, next_ids, last_rows, aux)

    # ---- the speculative step ----

    def run(self, reqs: list[Request]) -> list[Request]:
        """One verify step for `reqs` (each has a KV slot for its next token); returns them
        with their accepted tokens appended (finished ones released)."""
        eng, kv = self.engine, self.kv
        k = self.draft_tokens(len(reqs))
        # A request may emit at most its remaining tokens: 1 sampled + k drafts. A grammar-
        # constrained request drafts nothing (its one row is masked like a plain decode's).
        ks = [0 if r.grammar is not None else max(0, min(k, r.max_total_len - r.seq_len - 1)) for r in reqs]
        # Slots for every position the drafter and the verify write, before drafting; no room
        # for the drafts: that request decodes plainly (its next token's slot is there).
        ks = [ki if ki == 0 or kv.grow(r, r.seq_len + ki) else 0 for r, ki in zip(reqs, ks)]
        kv.flush()
        drafts = self.drafter.propose([DraftRequest(r.uid, r.row, r.prompt, r.output, ki) for r, ki in zip(reqs, ks)])
        lens = [r.seq_len for r in reqs]
        batch = eng.build_batch("extend", [r.row for r in reqs], [n - 1 for n in lens],
                                [[r.output[-1] if r.output else r.prompt[-1], *d] for r, d in zip(reqs, drafts)],
                                all_rows=True)
        kmax = max(1, max(len(d) for d in drafts))
        drafts_t = torch.tensor([d + [0] * (kmax - len(d)) for d in drafts], dtype=torch.int64)
        st = SamplingTensors.build(
            [r.params.temperature for r in reqs], [r.params.top_k for r in reqs], [r.params.top_p for r in reqs],
            [r.params.min_p for r in reqs], [r.seed for r in reqs], [len(r.output) for r in reqs], eng.device,
        )
        rebuild_histories(eng, reqs)
        mask, masked = self._grammar_mask(reqs, drafts)
        plan = VerifyPlan.build([r.logits_spec for r in reqs], [len(r.output) for r in reqs], drafts,
                                [r.row for r in reqs], [r.report_logprobs for r in reqs], kmax + 1, eng.device,
                                mask, masked)
        for r, n in zip(reqs, lens):
            r.cached_len = n
        tokens, logprobs, num_acc, tops = eng.verify(batch, drafts_t.to(eng.device, non_blocking=True), st, plan)
        alternatives = plan.tops_by_request(tops) if plan is not None else {}
        if self.mirrors:
            self._after_verify(batch, drafts, tokens, num_acc)
        tokens_h, logprobs_h, num_h = tokens.tolist(), logprobs.tolist(), num_acc.tolist()
        self.gate.record(sum(num_h), sum(1 for d in drafts if d))
        for b, (r, d, n, toks, lps, start) in enumerate(zip(reqs, drafts, num_h, tokens_h, logprobs_h, lens)):
            self.proposed += len(d)
            self.accepted += n
            self.verified += 1
            for j, (tok, lp) in enumerate(zip(toks[: n + 1], lps[: n + 1])):
                top = alternatives.get((b, j))
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

    def _grammar_mask(self, reqs: list[Request], drafts: list[list[int]]
                      ) -> tuple[LogitsMask | None, list[bool] | None]:
        """The verify rows of the grammar-constrained requests (one each: they draft nothing)
        and the mask that fills and applies their grammars' bitmasks there."""
        masked = [r.grammar is not None for r in reqs]
        if not any(masked):
            return None, None
        first, rows = 0, {}  # request index -> its (only) verify row
        for b, d in enumerate(drafts):
            if masked[b]:
                rows[b] = first
            first += 1 + len(d)

        def mask(logits: torch.Tensor) -> None:
            live = [b for b in rows if not reqs[b].finished and reqs[b].grammar.needs_mask]
            if live:
                self.grammar.masks.apply(logits, [rows[b] for b in live], [reqs[b].grammar for b in live])

        return mask, masked

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
        self.drafter.after_forward(self._target_step(batch, next_ids, last_rows))

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
                self.drafter.name, p, a, 100.0 * a / max(1, p), (a + v) / v, s,
            )
        self._logged = (now, self.proposed, self.accepted, self.verified, self.gate.paused_steps)


def _token_at(req: Request, i: int) -> int:
    """The context's token at position i (a retracted request re-prefills its output too)."""
    return req.prompt[i] if i < len(req.prompt) else req.output[i - len(req.prompt)]
