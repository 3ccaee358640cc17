"""Every step of the serving path through CUDA graphs captured at startup.

Two ladders of `StepLayout`s, each captured as one graph of the whole forward (embedding to
LM head) in one shared memory pool:
- decode: a batch-size ladder; the decode kernel's launch depends on the batch size and the
  context-length bound only;
- extend: a total-token ladder up to the largest prefill step (prefill, chunked prefill,
  prefix hits), with room for min(bucket, max requests) requests; extend attention runs in
  tile-map mode, so no launch depends on the step's lengths;
- mixed: the same up to the largest mixed step (every decode + a prefill chunk), plus the
  decode kernel over min(bucket, max requests) leading rows for the decodes (without this
  ladder, mixed steps take the extend graphs, their decodes as one-row tiles);
- verify (speculative decoding): extend layouts of b x (1 + K_b) tokens for the decode
  ladder's batch sizes b (K_b: the draft table's largest K up to b) whose sample rows are all
  T tokens (requests capacity T: one logits row per token), so one replay yields every
  position's logits. A verify step may also take an extend bucket that has T logits rows.

A step replays the smallest layout that fits it: the host fills the static index buffer (one
copy, see step/builder.py) and launches one graph. Padding tokens write K/V only to the dummy
slot, attend to nothing (no tile covers them) and are never sampled; padding requests have no
tokens. Everything here is handed in by the engine: this module does not know the Engine.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from minisgl import ops
from minisgl.core.batch import ForwardBatch
from minisgl.logging_setup import get_logger
from minisgl.ops.graph_capture import no_gc
from minisgl.step.layout import StepLayout, StepSpec

log = get_logger("minisgl.engine")


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


def token_bucket_ladder(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 256, then four buckets per octave (ratio <= 1.25: a padded step costs
    at most ~25% more; below 256 tokens a step costs about the same whatever its size)."""
    sizes = [16, 32, 64, 128, 256]
    p = 256
    while sizes[-1] < max_tokens:
        sizes += [p * 5 // 4, p * 3 // 2, p * 7 // 4, 2 * p]
        p *= 2
    return [s for s in sizes if s < max_tokens] + [max_tokens]


# Verify graphs hold one fp32 logits row per token: none past this many tokens (1024 x a 152k
# vocabulary is 0.6 GiB of logits); larger verify steps run eagerly.
VERIFY_GRAPH_MAX_TOKENS = 1024


def verify_layouts(batch_sizes: list[int], k_for: Callable[[int], int], block_m: int,
                   max_tokens: int = VERIFY_GRAPH_MAX_TOKENS) -> list[StepLayout]:
    """One verify layout per decode batch size b with K > 0: b x (1 + K) tokens, K the largest
    draft length of the sizes it serves (those above the previous ladder size), one logits row
    per token, the tile capacity of b requests (per request ceil((1 + K) / BLOCK_M) tiles)."""
    out, prev = [], 0
    for b in sorted(batch_sizes):
        k = max(k_for(x) for x in range(prev + 1, b + 1))
        prev = b
        t = b * (1 + k)
        if k > 0 and t <= max_tokens:
            out.append(StepLayout("extend", t, t, min(t, b * -(-(1 + k) // block_m)), 0, verify=True))
    return out


def graph_layouts(
    max_bs: int, max_tokens: int, max_mixed_tokens: int, max_requests: int, block_m: int, decode_kernel: bool,
    decode_tiles: bool = False,
) -> tuple[list[StepLayout], list[StepLayout]]:
    """(decode layouts, extend + mixed layouts) to capture. Without the decode kernel for a
    mixed step's decodes there is no mixed ladder: those steps take the extend graphs.
    `decode_tiles` (deterministic mode): the decode layouts carry one tile per request."""

    def ladder(mode: str, top: int, decodes: bool) -> list[StepLayout]:
        caps = [(t, min(t, max_requests)) for t in (token_bucket_ladder(top) if top > 0 else [])]
        return [StepLayout(mode, t, b, ops.extend_tile_capacity(t, b, block_m), b if decodes else 0) for t, b in caps]

    decode = [StepLayout("decode", b, b, b if decode_tiles else 0) for b in batch_size_ladder(max_bs)]
    if decode_kernel:
        return decode, ladder("extend", max_tokens, False) + ladder("mixed", max_mixed_tokens, True)
    return decode, ladder("extend", max(max_tokens, max_mixed_tokens), False)


class CudaGraphRunner:
    """`views(layout, buffer)` builds a layout's ForwardBatch over the static buffer (graph-safe);
    `forward(batch, logits_out)` runs the model; `count_tiles(spec, decode_kernel)` counts a
    step's extend tiles. Layouts: decode layouts for the batch sizes, extend ones per bucket."""

    def __init__(
        self, decode: list[StepLayout], extend: list[StepLayout],
        views: Callable[[StepLayout, torch.Tensor], ForwardBatch],
        forward: Callable[[ForwardBatch, torch.Tensor], torch.Tensor],
        count_tiles: Callable[[StepSpec, bool], int], fill_empty: Callable[[StepLayout, torch.Tensor], None],
        vocab_size: int, device: torch.device, verify: list[StepLayout] | None = None,
        extra: Callable[[], torch.Tensor | None] | None = None, verify_graphs_only: bool = False,
    ) -> None:
        """`extra`: called after each capture's forward; what it returns (a tensor the forward
        left, e.g. the residual stream EAGLE-3 reads) is kept as `extras[layout]`, refreshed by
        every replay of that layout. `verify_graphs_only`: a verify step replays only a graph
        captured as a verify step (a model whose layers keep per-request state captures a
        different forward for it), never an extend bucket."""
        self.decode = sorted(decode, key=lambda x: x.tokens)
        self.extend = sorted((x for x in extend if x.mode == "extend"), key=lambda x: x.tokens)
        self.mixed = sorted((x for x in extend if x.mode == "mixed"), key=lambda x: x.tokens)
        plain = set(self.extend)
        self.verify = sorted((x for x in verify or () if verify_graphs_only or replace(x, verify=False) not in plain),
                             key=lambda x: x.tokens)
        # A verify step takes the smallest verify (or extend) layout with a logits row per token.
        self._all_rows = sorted({*self.verify, *(() if verify_graphs_only else self.extend)},
                                key=lambda x: (x.tokens, x.requests))
        self._keys = {m: [x.tokens for x in getattr(self, m)] for m in ("decode", "extend", "mixed", "_all_rows")}
        self.views, self.forward, self.count_tiles, self.device = views, forward, count_tiles, device
        self.layouts = layouts = [*self.decode, *self.extend, *self.mixed, *self.verify]
        self.buffer = torch.zeros(max(x.size for x in layouts), dtype=torch.int64, device=device)
        # One fp32 logits buffer for every graph: each graph's own output would stay allocated
        # for the runner's lifetime (~1.3 GiB over the decode ladder at 256 x 152k vocab).
        self.logits = torch.empty(max(x.requests for x in layouts), vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[StepLayout, torch.cuda.CUDAGraph] = {}
        self.static: dict[StepLayout, ForwardBatch] = {}
        self.outputs: dict[StepLayout, torch.Tensor] = {}
        self.extra = extra
        self.extras: dict[StepLayout, torch.Tensor | None] = {}
        self.capture_seconds = 0.0
        self._capture_all(fill_empty)

    @torch.inference_mode()
    def _capture_all(self, fill_empty: Callable[[StepLayout, torch.Tensor], None]) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), no_gc():  # ops/graph_capture.py says why
            # Largest first: the smaller graphs reuse its pool memory.
            for layout in sorted(self.layouts, key=lambda x: -x.size):
                fill_empty(layout, self.buffer)  # a step of padding only: valid indices
                out = self.logits[: layout.requests]
                self.forward(self.views(layout, self.buffer), out)  # compiles, picks GEMMs: outside capture
                self._record(layout, out, pool, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def _record(self, layout: StepLayout, out: torch.Tensor, pool: object, stream: torch.cuda.Stream) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            batch = self.views(layout, self.buffer)
            self.outputs[layout] = self.forward(batch, out)
            self.extras[layout] = self.extra() if self.extra is not None else None
        self.graphs[layout], self.static[layout] = graph, batch

    def layout_for(self, spec: StepSpec) -> StepLayout | None:
        """The smallest captured layout `spec` fits, or None (run it eagerly)."""
        if spec.mode == "decode":
            i = bisect.bisect_left(self._keys["decode"], len(spec.rows))
            return self.decode[i] if i < len(self.decode) else None
        mode = "mixed" if spec.mode == "mixed" and self.mixed else "_all_rows" if spec.all_rows else "extend"
        i = bisect.bisect_left(self._keys[mode], spec.num_tokens)
        for layout in getattr(self, mode)[i:]:
            if layout.fits(spec, self.count_tiles(spec, layout.decodes > 0)):
                return layout
        return None

    def batch(self, layout: StepLayout, spec: StepSpec) -> ForwardBatch:
        """The step's batch: the captured batch's tensors (valid once the graph has replayed)
        cut to the step's own sizes."""
        s, b, n = self.static[layout], len(spec.rows), spec.num_tokens
        seq = spec.seq_lens
        return ForwardBatch(
            mode=spec.mode, input_ids=s.input_ids[:n], positions=s.positions[:n], out_slots=s.out_slots[:n],
            req_rows=s.req_rows[:b], seq_lens=s.seq_lens[:b], prefix_lens=s.prefix_lens[:b],
            cu_seqlens_q=s.cu_seqlens_q[: b + 1], sample_rows=s.sample_rows[: n if spec.all_rows else b],
            req_to_slot=s.req_to_slot, seq_lens_cpu=seq, prefix_lens_cpu=spec.prefix_lens, max_seq_len=max(seq),
            max_extend_len=max(spec.ext), tiles=s.tiles, decode_rows=s.decode_rows,
            decode_seq_lens=s.decode_seq_lens, graph=layout, all_rows=spec.all_rows,
            req_to_swa_slot=s.req_to_swa_slot, out_slots_swa=None if s.out_slots_swa is None else s.out_slots_swa[:n],
            state_slots=None if s.state_slots is None else s.state_slots[:b],
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits: [B, vocab], or [T, vocab] for an all-rows (verify) step."""
        self.graphs[batch.graph].replay()
        return self.outputs[batch.graph][: batch.num_tokens if batch.all_rows else batch.batch_size]

    def describe(self) -> str:
        k = self._keys
        verify = f", verify token counts {[x.tokens for x in self.verify]}" if self.verify else ""
        return (f"{len(self.graphs)} CUDA graphs (decode batch sizes {k['decode']}, prefill token buckets "
                f"{k['extend']}, mixed token buckets {k['mixed']}{verify}) in {self.capture_seconds:.1f} s")
