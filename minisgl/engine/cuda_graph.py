"""Decode through CUDA graphs captured for a ladder of batch sizes.

A decode batch of size bs replays the graph of the smallest captured size >= bs; the padding
rows use the request table's padding row (all dummy slots), write their K/V to the dummy
slot and attend over one token. Everything a captured kernel reads lives in static buffers
that `replay` refreshes; the attention kernels take `max_seq_len` = the context length, so
their launch configuration is fixed per captured size.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from minisgl.engine.batch import ForwardBatch
from minisgl.kvcache.pool import DUMMY_SLOT
from minisgl.logging_setup import get_logger

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine

log = get_logger("minisgl.engine")


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class CudaGraphRunner:
    def __init__(self, engine: Engine, max_bs: int) -> None:
        self.engine = engine
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs = max_bs
        dev = engine.device
        pad_row = engine.table.padding_row
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.out_slots = torch.full((max_bs,), DUMMY_SLOT, dtype=torch.int32, device=dev)
        self.req_rows = torch.full((max_bs,), pad_row, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.sample_rows = torch.arange(max_bs, dtype=torch.int64, device=dev)
        # One fp32 logits buffer for every captured size. Each graph's own output tensor would
        # stay allocated for the runner's lifetime: ~1.3 GiB over the ladder at 256 x 152k vocab.
        vocab = engine.model_config.vocab_size
        self.logits = torch.empty(max_bs, vocab, dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _static_batch(self, bs: int) -> ForwardBatch:
        eng = self.engine
        return ForwardBatch(
            mode="decode", input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_slots=self.out_slots[:bs], req_rows=self.req_rows[:bs], seq_lens=self.seq_lens[:bs],
            prefix_lens=self.prefix_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            sample_rows=self.sample_rows[:bs], req_to_slot=eng.table.req_to_slot,
            seq_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs,
            max_seq_len=eng.max_model_len, max_extend_len=1,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        eng = self.engine
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(eng.device)
        stream.wait_stream(torch.cuda.current_stream(eng.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first: later captures reuse its memory
                batch = self._static_batch(bs)
                for _ in range(2):  # warm up (Triton compiles, cuBLAS picks kernels) outside capture
                    eng.forward_eager(batch)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bs] = eng.forward_eager(batch, logits_out=self.logits[:bs])
                self.graphs[bs] = graph
        torch.cuda.current_stream(eng.device).wait_stream(stream)
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        gbs = self.sizes[bisect.bisect_left(self.sizes, bs)]
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_slots[:bs].copy_(batch.out_slots)
        self.req_rows[:bs].copy_(batch.req_rows)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        if gbs > bs:  # padding rows: stale values from a larger batch would read real slots
            self.out_slots[bs:gbs].fill_(DUMMY_SLOT)
            self.req_rows[bs:gbs].fill_(self.engine.table.padding_row)
            self.seq_lens[bs:gbs].fill_(1)
            self.positions[bs:gbs].zero_()
        self.graphs[gbs].replay()
        return self.outputs[gbs][:bs]
