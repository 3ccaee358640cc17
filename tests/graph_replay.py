"""A CPU stand-in for CUDA graphs: the engine's real CudaGraphRunner (bucket choice, padded
index buffers, tile maps, a mixed step's decode rows) with "graphs" that replay by running the
captured step again over the static buffer and writing into the captured tensors, as a CUDA
graph's replay writes its static memory. The attention kernels run as their torch references
(the Triton backend's CPU path)."""

from __future__ import annotations

import torch

from minisgl import LLM
from minisgl.attention.triton_backend import TritonAttentionBackend
from minisgl.step.cuda_graph import CudaGraphRunner

FIELDS = ("input_ids", "positions", "out_slots", "req_rows", "seq_lens", "prefix_lens", "cu_seqlens_q",
          "sample_rows", "tiles", "decode_rows", "decode_seq_lens", "out_slots_swa", "state_slots")


class _Replay:
    def __init__(self, runner: ReplayRunner, layout, out: torch.Tensor) -> None:  # noqa: ANN001
        self.runner, self.layout, self.out = runner, layout, out

    def replay(self) -> None:
        r = self.runner
        r.replays["verify" if self.layout in r.verify else self.layout.mode] += 1
        fresh = r.views(self.layout, r.buffer)
        r.forward(fresh, self.out)
        if r.extras.get(self.layout) is not None:
            r.extras[self.layout].copy_(r.extra())
        static = r.static[self.layout]
        for name in FIELDS:
            if getattr(static, name) is not None:
                getattr(static, name).copy_(getattr(fresh, name))


class ReplayRunner(CudaGraphRunner):
    def _capture_all(self, fill_empty) -> None:  # noqa: ANN001
        self.replays = {"decode": 0, "extend": 0, "mixed": 0, "verify": 0}
        for layout in self.layouts:
            fill_empty(layout, self.buffer)
            out = self.logits[: layout.requests]
            batch = self.views(layout, self.buffer)
            self.outputs[layout] = self.forward(batch, out)
            self.extras[layout] = self.extra() if self.extra is not None else None
            self.static[layout], self.graphs[layout] = batch, _Replay(self, layout, out)


def graph_llm(path: str, decode_kernel: bool, max_bs: int = 4, **options) -> LLM:
    """A CPU LLM whose engine replays "graphs" (ReplayRunner) up to `max_bs` decodes."""
    llm = LLM(path, device="cpu", dtype="float32", **options)
    eng = llm.engine
    eng.attn = TritonAttentionBackend(eng.pool, eng.num_q_heads, eng.model_config.head_dim**-0.5)
    drafter = eng.drafter
    if drafter is not None and drafter.has_model:  # its own backend over its own pool: tile maps too
        drafter.attn = TritonAttentionBackend(drafter.pool, drafter.num_q_heads, drafter.attn.scale)
    eng.steps.block_m, eng.steps.decode_kernel = eng.attn.tile_block_m, decode_kernel
    eng.enable_cuda_graphs(max_bs, *llm.scheduler.graph_max_tokens, runner_cls=ReplayRunner)
    return llm
