"""One step of a draft chain (a draft model's or an EAGLE-3 head's greedy decode step) over a
batch of request-table rows, replayed from a CUDA graph per decode batch size when they are
captured (the engine's decode-ladder machinery: CudaGraphRunner + StepBuilder over the
target's request table), else run eagerly.

A step reads its input token of each row from `token_buffer` (the decode layout's token-buffer
inputs) and `step_fn(batch)` writes its results back into per-row device buffers (the next
input token, and for EAGLE-3 the hidden state), indexed by `batch.req_rows`: so every size
depends on the batch size only and nothing is read on the host. Padding requests sit on the
request table's padding row (its K/V go to the dummy slot; its buffer entries are scratch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.core.batch import ForwardBatch
from minisgl.kvcache.pool import RequestTable
from minisgl.speculative.drafter import DraftRequest, DraftTarget
from minisgl.step.builder import StepBuilder
from minisgl.step.layout import StepLayout, StepSpec


class DraftSteps:
    def __init__(self, target: DraftTarget, token_buffer: torch.Tensor,
                 step_fn: Callable[[ForwardBatch], None]) -> None:
        self.target, self.token_buffer, self.step_fn = target, token_buffer, step_fn
        self.table: RequestTable | None = None
        self._steps: StepBuilder | None = None
        self.graphs = None

    @property
    def steps(self) -> StepBuilder:
        """Decode steps only (no extend tile map) over the target's request table, which the
        engine hands over with the KV pool (`allocate_kv`), after the drafter is built."""
        if self._steps is None:
            t = self.target
            assert self.table is not None, "the draft's KV (and the target's request table) is not allocated yet"
            self._steps = StepBuilder(self.table, self.token_buffer, t.device, t.max_model_len,
                                      t.model_config.vocab_size, None)
        return self._steps

    def enable_cuda_graphs(self, batch_sizes: list[int], runner_cls: type) -> None:
        """Captures one graph per decode batch size (its own memory pool; small: decode-sized
        activations of the draft). `runner_cls`: the engine's CudaGraphRunner (class)."""
        t, buf = self.target, self.token_buffer
        table = self.steps.table.req_to_slot

        def forward(batch: ForwardBatch, out: torch.Tensor) -> torch.Tensor:
            self.step_fn(batch)
            return out

        self.graphs = runner_cls(
            [StepLayout("decode", b, b) for b in batch_sizes], [],
            lambda layout, b: layout.views(b, table, buf, t.max_model_len), forward, lambda spec, dk: 0,
            lambda layout, b: self.steps.upload(StepSpec(layout.mode, [], [], []), layout, b), 1, t.device,
        )
        self.steps.graphs = self.graphs

    @torch.inference_mode()
    def run(self, rows: list[int], prefix_lens: list[int]) -> None:
        """One step for requests at table rows `rows` whose input sits at position prefix_lens[i]
        (its K/V slot already in the request table) and in token_buffer[rows[i]]."""
        batch = self.steps.build("decode", rows, prefix_lens, None)
        if batch.graph is not None:
            self.graphs.graphs[batch.graph].replay()
        else:
            self.step_fn(batch)

    def describe(self) -> str:
        return "" if self.graphs is None else f"; draft-step graphs for {len(self.graphs.graphs)} batch sizes"

    @torch.inference_mode()
    def chain(self, reqs: list[DraftRequest], first_step: int, offset: int) -> list[list[int]]:
        """Up to reqs[i].k drafts per request, read from `token_buffer` after each chain step.
        Step s (from `first_step` on) runs each request that wants more than s drafts at
        position length + offset + s. A chain that starts at step 1 takes its first draft from
        the buffer as the target's last forward left it (EAGLE-3); one that starts at 0 first
        writes each request's last token there (a draft model)."""
        active = [i for i, r in enumerate(reqs) if r.k > 0]
        out: list[list[int]] = [[] for _ in reqs]
        if not active:
            return out
        dev = self.target.device
        kmax = max(reqs[i].k for i in active)
        rows = [reqs[i].row for i in active]
        rows_t = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
        if first_step == 0:
            last = torch.tensor([reqs[i].last for i in active], dtype=torch.int64)
            self.token_buffer[rows_t] = last.to(dev, non_blocking=True)
        drafts = [] if first_step == 0 else [self.token_buffer[rows_t]]  # [A] each: stale where k <= s
        for s in range(first_step, kmax):
            live = [a for a, i in enumerate(active) if reqs[i].k > s]
            self.run([rows[a] for a in live], [reqs[active[a]].length + offset + s for a in live])
            drafts.append(self.token_buffer[rows_t])
        host = torch.stack(drafts, dim=1).tolist()
        for a, i in enumerate(active):
            out[i] = host[a][: reqs[i].k]
        return out
