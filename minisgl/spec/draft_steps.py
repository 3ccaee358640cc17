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
from typing import TYPE_CHECKING

import torch

from minisgl.engine.batch import ForwardBatch
from minisgl.engine.step_builder import StepBuilder
from minisgl.engine.step_layout import StepLayout, StepSpec

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine


class DraftSteps:
    def __init__(self, engine: Engine, token_buffer: torch.Tensor, step_fn: Callable[[ForwardBatch], None]) -> None:
        self.engine, self.token_buffer, self.step_fn = engine, token_buffer, step_fn
        self._steps: StepBuilder | None = None
        self.graphs = None

    @property
    def steps(self) -> StepBuilder:
        """Decode steps only (no extend tile map); built on first use: the drafter is made
        before the engine's request table."""
        if self._steps is None:
            eng = self.engine
            self._steps = StepBuilder(eng.table, self.token_buffer, eng.device, eng.max_model_len,
                                      eng.model_config.vocab_size, None)
        return self._steps

    def enable_cuda_graphs(self, batch_sizes: list[int], runner_cls: type) -> None:
        """Captures one graph per decode batch size (its own memory pool; small: decode-sized
        activations of the draft). `runner_cls`: the engine's CudaGraphRunner (class)."""
        eng, table, buf = self.engine, self.engine.table.req_to_slot, self.token_buffer

        def forward(batch: ForwardBatch, out: torch.Tensor) -> torch.Tensor:
            self.step_fn(batch)
            return out

        self.graphs = runner_cls(
            [StepLayout("decode", b, b) for b in batch_sizes], [],
            lambda layout, b: layout.views(b, table, buf, eng.max_model_len), forward, lambda spec, dk: 0,
            lambda layout, b: self.steps.upload(StepSpec(layout.mode, [], [], []), layout, b), 1, eng.device,
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
