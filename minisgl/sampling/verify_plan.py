"""Penalties, logit bias, min_tokens and logprob alternatives at every row of a speculative
verify step, so that it samples exactly as plain decoding would.

Row j of request b (b's last token, then its drafts d_1..d_k) gives the distribution of b's
generated token number g_b + j (g_b: tokens generated before the step). Plain decoding would
sample that token with d_1..d_j already generated, so:
- min_tokens bans EOS and the stop ids at row j while g_b + j < min_tokens;
- the presence / frequency / repetition penalties at row j count b's history plus d_1..d_j:
  each such row reads a scratch copy of b's token counts with those drafts added (R rows x V
  int32, only for the rows of requests that use a penalty), built on the device per step;
- logit bias is the same at every row; a grammar's mask (requests with one draft nothing: one
  row each) runs after the penalties, as in plain decoding; logprobs are of the raw logits
  (a changed row keeps a raw copy when its request reports logprobs), and alternatives are
  one batched top-k over the rows that ask.
After acceptance, each request's accepted tokens (its new tokens, num_accepted + 1) are added
to its history on the device (no host round trip), as the plain sampler's count update does.
The rows past a rejection are computed and dropped; they cost a few [V] vectors each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minisgl import ops
from minisgl.core.logits_spec import LogitsMask, LogitsSpec
from minisgl.sampling.logits_plan import LogitsPlan
from minisgl.sampling.penalty_state import PenaltyState


def _dev(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


@dataclass
class VerifyPlan:
    plan: LogitsPlan  # over the T verify rows; penalty state rows index the scratch histories
    width: int  # K + 1: the acceptance kernel's tokens are [B, width]
    row_bj: list[tuple[int, int]]  # (request, j) of each verify row
    scratch_src: torch.Tensor | None  # int64 [R]: the request-table row each scratch history copies
    draft_rows: torch.Tensor | None  # int64 [n]: scratch row of each (row, earlier draft) pair
    draft_ids: torch.Tensor | None  # int64 [n]: that draft token
    raw_flat: torch.Tensor | None  # int64 [r]: b * width + j of plan.raw_rows
    count_batch: torch.Tensor | None  # int64 [m]: requests whose accepted tokens are counted
    count_state: torch.Tensor | None  # int64 [m]: their request-table rows
    slot_of_row: torch.Tensor | None = None  # int64 [T]: b * width + j of each verify row (masked rows')

    @staticmethod
    def build(specs: Sequence[LogitsSpec | None], generated: Sequence[int], drafts: Sequence[Sequence[int]],
              state_rows: Sequence[int], reports: Sequence[bool], width: int, device: torch.device,
              mask: LogitsMask | None = None, masked: Sequence[bool] | None = None) -> VerifyPlan | None:
        """Per request: its LogitsSpec (None: nothing), tokens generated before the step, its
        drafts, its request-table row, whether it reports logprobs; `mask` (a grammar's, on the
        [T, V] verify logits after the penalties) may change the rows of the requests `masked`
        says. None when no row needs anything."""
        masked = masked if mask is not None and masked is not None else [False] * len(specs)
        if all(s is None for s in specs) and not any(masked):
            return None
        row_specs, row_gen, row_state, row_reports, row_bj = [], [], [], [], []
        src, d_rows, d_ids, count_b = [], [], [], []
        for b, (spec, gen, d, srow, rep) in enumerate(zip(specs, generated, drafts, state_rows, reports)):
            tracks = spec is not None and spec.tracks_counts
            if tracks:
                count_b.append(b)
            for j in range(len(d) + 1):
                row_specs.append(spec)
                row_gen.append(gen + j)
                row_reports.append(rep)
                row_bj.append((b, j))
                if tracks:
                    d_rows.extend([len(src)] * j)
                    d_ids.extend(d[:j])
                    row_state.append(len(src))
                    src.append(srow)
                else:
                    row_state.append(0)  # its counts are never read (no penalty on this row)
        plan = LogitsPlan.build(row_specs, row_gen, [True] * len(row_specs), row_state, [], 0, device, mask,
                                row_reports)
        if plan is None:
            return None
        plan.count_rows = plan.count_state_rows = None  # counted after acceptance instead
        # Raw copies of the reporting rows that the penalties change. The mask hands back its rows'
        # raw log-normalizers as a decode step's does (the same formula, so the same bits: the
        # deterministic mode's guarantee); a row both penalized and masked takes its raw copy, as in
        # a decode step.
        raw = [t for t, (spec, gen, rep) in enumerate(zip(row_specs, row_gen, row_reports))
               if rep and spec is not None and (spec.tracks_counts or spec.sparse(gen)[0])]
        plan.raw_rows = _dev(raw, device) if raw else None
        raw_flat = _dev([row_bj[t][0] * width + row_bj[t][1] for t in raw], device) if raw else None
        return VerifyPlan(
            plan, width, row_bj, _dev(src, device) if src else None, _dev(d_rows, device) if d_rows else None,
            _dev(d_ids, device) if d_ids else None, raw_flat, _dev(count_b, device) if count_b else None,
            _dev([state_rows[b] for b in count_b], device) if count_b else None,
            _dev([b * width + j for b, j in row_bj], device) if any(masked) else None,
        )

    def apply(self, logits: torch.Tensor, state: PenaltyState) -> tuple[tuple, tuple | None]:
        """In place on the verify logits [T, V], before the acceptance kernel. Returns (what
        `finish` needs: the raw copies of plan.raw_rows and the mask's (logits, rows, raw
        normalizers), each or None; (top ids, top logprobs) of plan.top_rows or None)."""
        plan = self.plan
        tops = None
        if plan.top_rows is not None:
            _, ids, lps = ops.top_logprobs(logits.index_select(0, plan.top_rows), plan.top_k)
            tops = (ids, lps)
        raw = logits.index_select(0, plan.raw_rows) if plan.raw_rows is not None else None
        pen = plan.penalty
        if pen is not None:
            counts, prompt = state.buffers()
            if self.scratch_src is not None:
                counts = counts.index_select(0, self.scratch_src)
                if self.draft_rows is not None:
                    ones = torch.ones_like(self.draft_ids, dtype=torch.int32)
                    counts.index_put_((self.draft_rows, self.draft_ids), ones, accumulate=True)
                if state.prompt is not None:
                    prompt = state.prompt.index_select(0, self.scratch_src)
            ops.apply_penalties(logits, pen.rows, pen.state_rows, counts, prompt, pen.rep, pen.pres, pen.freq,
                                pen.bias_ptr, pen.bias_ids, pen.bias_vals)
        masked = None
        if plan.mask is not None:
            out = plan.mask(logits)
            if out is not None and out[1] is not None:
                masked = (logits, out[0], out[1])
        return (raw, masked), tops

    def finish(self, tokens: torch.Tensor, logprobs: torch.Tensor, num_acc: torch.Tensor, kept: tuple,
               state: PenaltyState) -> None:
        """After acceptance: raw logprobs of the changed rows' chosen tokens, and the accepted
        tokens added to the histories of the requests that count them (device only)."""
        raw, masked = kept
        if masked is not None:  # a masked row's logprob as a decode step takes it (sampling/logits_plan.py)
            logits, rows, lse = masked
            slots = self.slot_of_row.index_select(0, rows)
            chosen = tokens.view(-1).index_select(0, slots)
            logprobs.view(-1).index_copy_(0, slots, logits[rows, chosen] - lse)
        if raw is not None:
            assert self.raw_flat is not None
            chosen = tokens.view(-1).index_select(0, self.raw_flat)
            # Each row reduced alone in deterministic mode, as a decode step's raw rows are.
            raw_lp = raw.gather(1, chosen[:, None]).squeeze(1) - ops.logsumexp_rows(raw)
            logprobs.view(-1).index_copy_(0, self.raw_flat, raw_lp)
        if self.count_batch is not None:
            assert self.count_state is not None and state.counts is not None
            toks = tokens.index_select(0, self.count_batch)  # [m, width]; past num_accepted: unspecified
            keep = torch.arange(self.width, device=toks.device)[None, :] <= num_acc.index_select(0, self.count_batch)[
                :, None].long()
            toks = torch.where(keep, toks, 0)
            rows = self.count_state[:, None].expand_as(toks)
            state.counts.index_put_((rows.reshape(-1), toks.reshape(-1)), keep.reshape(-1).to(torch.int32),
                                    accumulate=True)

    def tops_by_request(self, tops: tuple | None) -> dict[tuple[int, int], list[tuple[int, float]]]:
        """(request, j) -> its row's alternatives (host copies; plan.top_k of them)."""
        if tops is None:
            return {}
        ids, lps = tops[0].tolist(), tops[1].tolist()
        return {self.row_bj[t]: list(zip(i, lp)) for t, i, lp in zip(self.plan.top_rows_cpu, ids, lps)}
