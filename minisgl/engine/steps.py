"""The engine's face, its calls: one per step kind (the types are face.py).

Part of Engine (engine.py mixes it in and builds every attribute used here). Each call turns
the scheduler's description of a step into the engine's own objects, in the order the device
needs them (the sampling tensors, the penalty histories of fresh rows, the logits plan, the
batch, whose graph replay comes next), runs it with the primitives of forward.py, and feeds
the drafter (the engine's) the target forward it just ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import accumulate

import torch

from minisgl.core.batch import ForwardBatch
from minisgl.engine.face import Step, StepRequest, StepResult, VerifyResult, VerifyStep
from minisgl.message import trace
from minisgl.sampling.logits_plan import LogitsPlan
from minisgl.sampling.sampler import SamplingTensors
from minisgl.sampling.verify_plan import VerifyPlan
from minisgl.speculative.drafter import DraftRequest, TargetStep


class StepCalls:
    def step(self, s: Step) -> StepResult:
        """Launches one plain step; the sampled tokens also go to the token buffer (the next
        decode's inputs). The mask, if any, runs on the host once the forward is launched."""
        reqs, rows = s.reqs, [r.row for r in s.reqs]
        st = self._sampling_tensors(reqs, s.generated)
        self._rebuild_histories(reqs, s.fresh_history)
        extra, targets, k = _prompt_rows(s)
        plan = None
        if targets or s.mask is not None or any(r.logits_spec is not None for r in reqs):
            plan = LogitsPlan.build(
                [r.logits_spec for r in reqs], s.generated, s.samples, rows, targets, k, self.device, s.mask,
                [r.report_logprobs for r in reqs],
            )
        batch = self.build_batch(s.mode, rows, s.prefix_lens, s.new_tokens, extra_logit_rows=extra)
        built = trace.now() if s.traced else 0.0
        out = self.run_batch(batch, st, plan)
        drafter = self.drafter
        if drafter is not None and drafter.has_model and not drafter.mirrors_in_forward:
            self._draft_after_step(batch, s, out.tokens)  # its KV follows every target step
        return StepResult(
            out, plan.top_rows_cpu if plan is not None else [], batch.mode, batch.batch_size, batch.num_tokens,
            None if batch.graph is None else batch.graph.tokens, self.steps.eager_reason, built,
        )

    def verify_step(self, v: VerifyStep) -> VerifyResult:
        """Drafts, verifies and accepts; the last accepted token goes to the token buffer (a
        plain decode may follow). Reads its results on the host before it returns: the next
        step's drafts and shape depend on them."""
        reqs, rows = v.reqs, [r.row for r in v.reqs]
        drafts = self.drafter.propose([DraftRequest(r.uid, r.row, r.prompt, r.output, k)
                                       for r, k in zip(reqs, v.draft_tokens)])
        batch = self.build_batch("extend", rows, v.prefix_lens,
                                 [[r.output[-1] if r.output else r.prompt[-1], *d] for r, d in zip(reqs, drafts)],
                                 all_rows=True)
        kmax = max(1, max(len(d) for d in drafts))
        drafts_t = torch.tensor([d + [0] * (kmax - len(d)) for d in drafts], dtype=torch.int64)
        st = self._sampling_tensors(reqs, v.generated)
        self._rebuild_histories(reqs, v.fresh_history)
        mask = masked = None
        if v.mask is not None:  # (a mask comes only with a request it masks: SpecStep._grammar_mask)
            first_rows = list(accumulate((1 + len(d) for d in drafts[:-1]), initial=0))  # each request's first row
            mask, masked = (lambda logits: v.mask(logits, first_rows)), v.masked
        plan = VerifyPlan.build([r.logits_spec for r in reqs], v.generated, drafts, rows,
                                [r.report_logprobs for r in reqs], kmax + 1, self.device, mask, masked)
        tokens, logprobs, num_acc, tops = self.verify(batch, drafts_t.to(self.device, non_blocking=True), st, plan)
        alternatives = plan.tops_by_request(tops) if plan is not None else {}
        drafter = self.drafter
        if drafter.has_model and not drafter.mirrors_in_forward:
            self._draft_after_verify(batch, drafts, tokens, num_acc)
        return VerifyResult(drafts, tokens.tolist(), logprobs.tolist(), num_acc.tolist(), alternatives)

    def release_request(self, uid: int) -> None:
        """A request left (finished, aborted or retracted): the drafter drops its state."""
        if self.drafter is not None:
            self.drafter.release(uid)

    # ---- what a step builds from its description ----

    def _sampling_tensors(self, reqs: Sequence[StepRequest], generated: list[int]) -> SamplingTensors:
        return SamplingTensors.build(
            [r.params.temperature for r in reqs], [r.params.top_k for r in reqs],
            [r.params.top_p for r in reqs], [r.params.min_p for r in reqs],
            [r.seed for r in reqs], generated, self.device,
        )

    def _rebuild_histories(self, reqs: Sequence[StepRequest], fresh: list[int]) -> None:
        """The penalty token history of each fresh row, from its request's host lists (every
        token is on the host then), in stream order before the step that reads it."""
        if not fresh:
            return
        self.penalties.reset(
            [reqs[i].row for i in fresh], [reqs[i].output for i in fresh],
            [reqs[i].prompt if reqs[i].logits_spec.needs_prompt else None for i in fresh],  # type: ignore[union-attr]
        )

    # ---- the drafter's view of the target forward (drafters with a model it runs after a step) ----

    def _draft_after_step(self, batch: ForwardBatch, s: Step, sampled: torch.Tensor) -> None:
        """After a prefill chunk, a plain decode or a mixed step: the draft runs the same positions."""
        next_ids = None
        if self.drafter.needs_next_ids:
            # Token after each input: the next input of the request, at its end the sampled
            # token (or, for a prefill chunk that samples nothing, the prompt's next token).
            next_ids = torch.roll(batch.input_ids, -1)
            ends = batch.sample_rows
            after = sampled
            if not all(s.samples):
                host = [0 if sampled_ else _token_at(r, p + len(new))  # type: ignore[arg-type]
                        for r, sampled_, p, new in zip(s.reqs, s.samples, s.prefix_lens, s.new_tokens)]
                keep = torch.tensor(s.samples, device=sampled.device)
                after = torch.where(keep, sampled, torch.tensor(host, device=sampled.device))
            next_ids[ends] = after
        self.drafter.after_forward(self._target_step(batch, next_ids, batch.sample_rows))

    def _draft_after_verify(self, batch: ForwardBatch, drafts: list[list[int]], tokens: torch.Tensor,
                            num_acc: torch.Tensor) -> None:
        kmax1 = tokens.shape[1]
        last_rows = batch.cu_seqlens_q[:-1].long() + num_acc.long()
        next_ids = None
        if self.drafter.needs_next_ids:
            # Input j of request b is followed by tokens[b, j] (a draft if accepted, else the
            # token sampled there): positions past the first rejection are rewritten later.
            flat = [b * kmax1 + j for b, d in enumerate(drafts) for j in range(len(d) + 1)]
            next_ids = tokens.view(-1)[torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True)]
        self.drafter.after_forward(self._target_step(batch, next_ids, last_rows))

    def _target_step(self, batch: ForwardBatch, next_ids: torch.Tensor | None, last_rows: torch.Tensor) -> TargetStep:
        """A step that replayed a graph hands the drafter the graph's padded batch (its static
        tensors, valid until another graph of the pool replays), which the residual stream it
        left matches; next_ids are padded to it."""
        aux = self.model.model.aux_hidden if self.drafter.aux_layers is not None else None
        if batch.graph is None:
            return TargetStep(batch, next_ids, last_rows, aux)
        full = dataclasses.replace(self.graphs.static[batch.graph])
        if next_ids is not None:
            padded = torch.zeros(full.num_tokens, dtype=next_ids.dtype, device=next_ids.device)
            padded[: next_ids.numel()] = next_ids
            next_ids = padded
        return TargetStep(full, next_ids, last_rows, aux)


def _prompt_rows(s: Step) -> tuple[list[int], list[int], int]:
    """(extra logits rows: indices into the step's new tokens, the prompt token each predicts,
    the most alternatives a row asks for) of the step's prompt-logprob targets."""
    extra: list[int] = []
    targets: list[int] = []
    k = 0
    if not s.prompt_targets or s.new_tokens is None:
        return extra, targets, k
    offset = 0  # of row i's first new token in the step's tokens
    for i, toks in enumerate(s.new_tokens):
        want = s.prompt_targets.get(i)
        if want:
            extra.extend(range(offset, offset + len(want)))
            targets.extend(want)
            k = max(k, s.reqs[i].params.prompt_logprobs or 0)
        offset += 1 if toks is None else len(toks)
    return extra, targets, k


def _token_at(req: StepRequest, i: int) -> int:
    """The context's token at position i (a retracted request re-prefills its output too)."""
    return req.prompt[i] if i < len(req.prompt) else req.output[i - len(req.prompt)]
