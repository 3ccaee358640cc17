"""Enabling the engine's CUDA graphs: which ladders to capture and how the runner reaches the
engine's model, buffers and step builder.

Part of Engine (engine.py mixes it in and builds every attribute used here). It is apart from
construction because it runs later and only when asked (the scheduler, once it knows the
largest steps it forms; tests and benchmarks with their own runner or layouts), and from the
step calls because a step only replays what this captured. The ladders and the runner itself
are step/cuda_graph.py, which does not know the Engine: everything it needs is handed in here.
"""

from __future__ import annotations

import torch

from minisgl.logging_setup import get_logger
from minisgl.step.builder import VERIFY_VIA_EXTEND_BUCKETS
from minisgl.step.cuda_graph import CudaGraphRunner, graph_layouts, verify_layouts
from minisgl.step.layout import StepSpec

log = get_logger("minisgl.engine")


class GraphCapture:
    def enable_cuda_graphs(self, max_bs: int | None, max_tokens: int = 0, max_mixed_tokens: int = 0,
                           runner_cls: type | None = None, verify: list | None = None) -> None:
        """Captures decode graphs up to `max_bs` requests (default: from GPU memory), extend
        graphs up to `max_tokens` tokens per step and mixed ones (decodes + a prefill chunk) up
        to `max_mixed_tokens` (0: none of that kind; mixed steps then take the extend graphs,
        decodes as one-row tiles). `runner_cls`: a CudaGraphRunner subclass (tests replay
        "graphs" on the CPU with one). `verify`: the verify layouts to capture (default: one per
        decode batch size with the draft table's K when speculating; benchmarks pass their own)."""
        runner_cls = runner_cls or CudaGraphRunner
        cuda = self.device.type == "cuda"
        if self.attn.name == "torch":
            raise ValueError("CUDA graphs need the 'triton' or 'cuda' attention backend (or disable CUDA graphs)")
        if max_bs is None:
            total = torch.cuda.get_device_properties(self.device).total_memory if cuda else 0
            max_bs = 256 if total >= 40 * (1 << 30) else 128
        decode, extend = graph_layouts(min(max_bs, self.cfg.max_running_requests), max_tokens, max_mixed_tokens,
                                       self.cfg.max_running_requests, self.steps.block_m, self.steps.decode_kernel,
                                       self.steps.decode_tiles)
        if verify is None and self.cfg.spec is not None and not VERIFY_VIA_EXTEND_BUCKETS:
            verify = verify_layouts([x.tokens for x in decode], self.cfg.spec.draft_tokens_for, self.steps.block_m)
        table, buffer, bound = self.table.req_to_slot, self.token_buffer, self.max_model_len
        swa_table, state_table = self.table.req_to_swa_slot, self.table.req_to_state
        mem = (lambda: (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))) if cuda \
            else (lambda: (0, 0))
        alloc, reserved = mem()
        self.graphs = runner_cls(
            decode, extend, lambda layout, buf: layout.views(buf, table, buffer, bound, swa_table, state_table),
            lambda batch, out: self.forward_eager(batch, logits_out=out), self.steps.count_tiles,
            lambda layout, buf: self.steps.upload(StepSpec(layout.mode, [], [], []), layout, buf),
            self.model_config.vocab_size, self.device, verify, lambda: self.model.model.aux_hidden,
            verify_graphs_only=self.state_pool is not None,  # Gated DeltaNet layers verify without storing
        )
        self.steps.graphs = self.graphs
        if self.drafter is not None:
            self.drafter.enable_cuda_graphs([x.tokens for x in decode], runner_cls)
        gib = 1 << 30
        alloc2, reserved2 = mem()
        drafting = self.drafter.describe_graphs() if self.drafter is not None else ""
        log.info("captured %s%s; graph memory +%.2f GiB allocated, +%.2f GiB reserved", self.graphs.describe(),
                 drafting, (alloc2 - alloc) / gib, (reserved2 - reserved) / gib)

    def mixed_graph_tokens(self) -> list[int]:
        """The token buckets of the captured mixed graphs (none: empty), which the scheduler
        fills when it sizes a mixed step's prefill chunk."""
        return [] if self.graphs is None else [x.tokens for x in self.graphs.mixed]
