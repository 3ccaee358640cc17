"""Builds each step's ForwardBatch: checks the step once, picks its layout (a captured
graph's bucket, or its own sizes for an eager forward), fills the index array on the host in
pinned memory and sends it in one asynchronous copy.

Pinned memory matters: a copy from pageable memory may wait for the stream (the driver stages
it), which would make the host wait for step N before it can launch step N+1. Pinned blocks
come from torch's caching host allocator, which reuses a block only after the copies that read
it have run, so the next step can fill a new one while the GPU still works.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch

from minisgl.core.batch import ForwardBatch
from minisgl.kvcache.pool import RequestTable
from minisgl.logging_setup import log_once
from minisgl.ops.transfer import host_to_device, pinned_host
from minisgl.step.layout import StepLayout, StepSpec, count_tiles, exact_layout

# A mixed step's decodes take the paged decode kernel (over min(bucket, max requests) rows in
# the captured graph) rather than one-row extend tiles. From benchmarks/graph_designs.py on an
# H100: see DESIGN.md §4 ("a-decode" vs "a-tiles").
MIXED_DECODES_VIA_DECODE_KERNEL = True
# A speculative verify step (b requests x (1 + K) tokens, logits at every token) replays a
# verify graph of exactly b x (1 + K) tokens (False), or the smallest extend bucket with a
# logits row per token (True: no verify graphs are captured). benchmarks/spec_verify.py times
# both on the same steps ("verify graph" vs "extend bucket" columns).
VERIFY_VIA_EXTEND_BUCKETS = False


class StepBuilder:
    def __init__(self, table: RequestTable, token_buffer: torch.Tensor, device: torch.device, max_model_len: int,
                 vocab_size: int, block_m: int | None, deterministic: bool = False) -> None:
        self.table, self.token_buffer, self.device = table, token_buffer, device
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.block_m = block_m  # extend tile height; None: the backend takes no tile map
        # Deterministic mode (README "Determinism"): no step reaches the decode kernels, whose
        # split count depends on the batch. Decode steps carry a tile map (one one-row tile per
        # request) and run the extend kernel; a mixed step's decodes are one-row tiles too.
        self.decode_tiles = deterministic and block_m is not None
        self.decode_kernel = MIXED_DECODES_VIA_DECODE_KERNEL and block_m is not None and not deterministic
        self.graphs = None  # a CudaGraphRunner: steps that fit one of its layouts replay it
        self.eager_reason: str | None = None  # why the last step built runs eagerly (None: a graph)

    def spec(self, mode: str, rows: list[int], prefix_lens: list[int],
             new_tokens: Sequence[list[int] | None] | None, all_rows: bool = False) -> StepSpec:
        """The step, checked once (the ops skip their own checks in the forward)."""
        if mode not in ("decode", "extend", "mixed"):
            raise ValueError(f"unknown step mode {mode!r}")
        if new_tokens is None:
            if mode != "decode":
                raise ValueError("only decode batches may take their inputs from the token buffer")
            new_tokens = [None] * len(rows)
        if not rows or not len(rows) == len(prefix_lens) == len(new_tokens):
            raise ValueError(f"a step needs rows, prefix_lens and new_tokens of one length >= 1, got "
                             f"{len(rows)}, {len(prefix_lens)}, {len(new_tokens)}")
        if all_rows and mode != "extend":
            raise ValueError("only an extend step computes logits at every new token (all_rows)")
        spec = StepSpec(mode, list(rows), list(prefix_lens), list(new_tokens), all_rows)
        nd = spec.num_decodes if mode == "mixed" else 0
        if mode == "decode" and max(spec.ext) != 1:
            raise ValueError("a decode step takes exactly one new token per request")
        if any(t is None for t in spec.new_tokens[nd:]) and mode != "decode":
            raise ValueError("token-buffer inputs (None) may only lead a mixed step or make a decode step")
        if min(spec.ext) < 1 or min(spec.prefix_lens) < 0 or max(spec.seq_lens) > self.max_model_len:
            raise ValueError(f"every request needs >= 1 new token, a prefix >= 0 and at most "
                             f"{self.max_model_len} tokens in all")
        if min(rows) < 0 or max(rows) >= self.table.max_requests or len(set(rows)) != len(rows):
            raise ValueError(f"request rows must be distinct and in [0, {self.table.max_requests})")
        ids = spec.host_ids()
        if ids.max() >= self.vocab_size or (ids < -1).any():
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return spec

    def build(self, mode: str, rows: list[int], prefix_lens: list[int],
              new_tokens: Sequence[list[int] | None] | None, use_graphs: bool = True,
              extra_logit_rows: list[int] | None = None, all_rows: bool = False) -> ForwardBatch:
        """`all_rows`: the step needs every position's logits (a verify step); a graph that fits
        computes them all, an eager batch via forward(all_positions=True); `batch.all_rows` marks
        the verify step either way."""
        spec = self.spec(mode, rows, prefix_lens, new_tokens, all_rows)
        if extra_logit_rows and (min(extra_logit_rows) < 0 or max(extra_logit_rows) >= spec.num_tokens):
            raise ValueError(f"extra_logit_rows must index the step's {spec.num_tokens} new tokens")
        layout, self.eager_reason = self._pick_graph(spec, use_graphs, bool(extra_logit_rows))
        if layout is not None:
            self.upload(spec, layout, self.graphs.buffer)
            return self.graphs.batch(layout, spec)
        spec.all_rows = False  # eager: the caller asks the forward for all positions
        layout = exact_layout(spec, self.block_m, self.decode_kernel, self.decode_tiles)
        buf = self.upload(spec, layout, None)
        batch = layout.views(buf, self.table.req_to_slot, self.token_buffer, max(spec.seq_lens),
                             self.table.req_to_swa_slot, self.table.req_to_state)
        batch.mode, batch.max_extend_len, batch.all_rows = spec.mode, max(spec.ext), all_rows
        batch.seq_lens_cpu, batch.prefix_lens_cpu = spec.seq_lens, spec.prefix_lens
        if extra_logit_rows:
            last = [c - 1 for c in itertools.accumulate(spec.ext)]
            batch.logit_rows = host_to_device([last + list(extra_logit_rows)], torch.int64, self.device)[0]
        return batch

    def _pick_graph(self, spec: StepSpec, use_graphs: bool, extra_rows: bool) -> tuple[StepLayout | None, str | None]:
        """(the captured layout the step replays, None) or (None, why it runs eagerly). With
        graphs captured, an eager step is logged once per reason: on the serving path it costs
        the whole forward's host time (DESIGN.md §4)."""
        if self.graphs is None:
            return None, "CUDA graphs off"
        if not use_graphs:
            why, key = "the caller asked for an eager forward (prompt scoring)", "caller"
        elif extra_rows:  # a graph computes the sampled rows' logits only
            why, key = "prompt logprobs need logits at more rows than the sampled ones", "extra_rows"
        else:
            layout = self.graphs.layout_for(spec)
            if layout is not None:
                return layout, None
            why = f"no captured {spec.mode} graph fits {spec.num_tokens} tokens of {len(spec.rows)} requests"
            key = f"fit-{spec.mode}"
        log_once(f"eager-step-{key}", f"a {spec.mode} step runs eagerly (logged once per reason): {why}",
                 logging.INFO)
        return None, why

    def count_tiles(self, spec: StepSpec, decode_kernel: bool) -> int:
        if self.block_m is None or (spec.mode == "decode" and not self.decode_tiles):
            return 0
        return count_tiles(spec, self.block_m, decode_kernel)

    def upload(self, spec: StepSpec, layout: StepLayout, dest: torch.Tensor | None) -> torch.Tensor:
        """Fills `layout` for `spec` and copies it into `dest` (or a new device tensor)."""
        host = pinned_host(layout.size, self.device)
        layout.fill(host.numpy(), spec, self.table.padding_row, self.block_m or 1)
        if self.device.type != "cuda":
            return host if dest is None else dest[: layout.size].copy_(host)
        if dest is None:
            dest = torch.empty(layout.size, dtype=torch.int64, device=self.device)
        return dest[: layout.size].copy_(host, non_blocking=True)
