"""Step timings for speculative decoding, shared by spec_verify.py and spec_tune.py: one
engine with dummy weights, B requests at context L with KV slots for the drafts, and the
median time of a plain decode step (CUDA-graph replay, as served), a verify step of 1 + K
tokens per request (forward over every position + the acceptance kernel) and the drafting
work of a step (a model drafter's K - 1 or K decode steps and its mirror of the verify)."""

from __future__ import annotations

import torch
from profile_decode_step import time_ms  # benchmarks/ is on sys.path when run as a script

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.engine.sampler import SamplingTensors
from minisgl.spec.drafter import DraftRequest, TargetStep


class StepBench:
    def __init__(self, model: str, max_bs: int, max_k: int, context: int, dtype: str = "bfloat16",
                 device: str = "cuda", **spec: object) -> None:
        page = 16
        per_req = -(-(context + max_k + 2) // page)
        cfg = EngineConfig(model=model, device=device, dtype=dtype, load_format="dummy", page_size=page,
                           num_pages=max_bs * per_req + 2, max_running_requests=max_bs,
                           max_model_len=context + max_k + 64, **spec)
        self.eng = eng = Engine(cfg)
        self.graphs = eng.device.type == "cuda"
        if self.graphs:
            eng.enable_cuda_graphs(max_bs)
        self.context, self.max_k = context, max_k
        self.rows = [eng.table.allocate_row() for _ in range(max_bs)]
        rr, cols, slots = [], [], []
        for row in self.rows:
            ids = eng.allocator.slot_ids(eng.allocator.allocate(per_req))[: context + max_k + 1]
            rr += [row] * len(ids)
            cols += range(len(ids))
            slots += ids
        eng.write_slots(rr, cols, slots)
        for layer in range(eng.pool.num_layers):  # stale pool memory may hold NaNs: small values
            eng.pool.k_cache(layer).normal_(0, 0.5)
            eng.pool.v_cache(layer).normal_(0, 0.5)
        if eng.drafter is not None and eng.drafter.has_model:
            eng.drafter.pool._k.normal_(0, 0.5)
            eng.drafter.pool._v.normal_(0, 0.5)
        eng.token_buffer.random_(0, 1000)
        self.gen = torch.Generator().manual_seed(0)

    def greedy(self, b: int) -> SamplingTensors:
        return SamplingTensors.build([0.0] * b, [-1] * b, [1.0] * b, [0.0] * b, list(range(b)), [0] * b,
                                     self.eng.device)

    def decode_ms(self, b: int, graph: bool = True) -> float:
        eng = self.eng
        batch = eng.build_batch("decode", self.rows[:b], [self.context - 1] * b, None, use_graphs=graph)
        st = self.greedy(b)
        if graph and self.graphs:
            return time_ms(lambda: eng.run_batch(batch, st))
        return time_ms(lambda: eng.sample(eng.forward_eager(batch), st))

    def _verify_batch(self, b: int, k: int):
        tokens = torch.randint(0, 1000, (b, k + 1), generator=self.gen).tolist()
        batch = self.eng.build_batch("extend", self.rows[:b], [self.context - 1] * b, tokens, use_graphs=False)
        drafts = torch.tensor([t[1:] for t in tokens], dtype=torch.int64, device=self.eng.device)
        return batch, drafts

    def verify_ms(self, b: int, k: int) -> float:
        batch, drafts = self._verify_batch(b, k)
        st = self.greedy(b)
        return time_ms(lambda: self.eng.verify(batch, drafts, st))

    def draft_ms(self, b: int, k: int) -> float:
        """A model drafter's work per step: propose k tokens, then mirror the verify batch."""
        eng, drafter = self.eng, self.eng.drafter
        if drafter is None or not drafter.has_model:
            return 0.0
        batch, drafts = self._verify_batch(b, k)
        reqs = [DraftRequest(i, row, [1] * self.context, [], k) for i, row in enumerate(self.rows[:b])]
        aux = eng.model.model.aux_hidden
        if drafter.aux_layers:  # the verify's residual streams, as the engine leaves them
            eng.forward(batch, all_positions=True)
            aux = eng.model.model.aux_hidden
        last = batch.cu_seqlens_q[:-1].long()
        step = TargetStep(batch, batch.input_ids, last, aux)

        def run() -> None:
            drafter.propose(reqs)
            drafter.after_forward(step)

        return time_ms(run, reps=10)
