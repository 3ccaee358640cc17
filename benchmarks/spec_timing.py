"""Step timings for speculative decoding, shared by spec_verify.py and spec_tune.py: one
engine with dummy weights, B requests at context L with KV slots for the drafts, and the
median time of a plain decode step (CUDA-graph replay, as served), a verify step of 1 + K
tokens per request (forward over every position + the acceptance kernel), three ways:
  graph   its verify graph (b x (1 + K) tokens, one logits row per token: what the engine
          captures per decode batch size, minisgl/step/cuda_graph.py);
  bucket  the smallest extend bucket with a logits row per token (the alternative design,
          step_builder.VERIFY_VIA_EXTEND_BUCKETS);
  eager   no graph (layer by layer from Python);
and the drafting work of a step (a model drafter's chain, replayed from its graphs, and its
pass over the verified tokens)."""

from __future__ import annotations

import time

import torch
from profile_decode_step import time_ms  # benchmarks/ is on sys.path when run as a script

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.sampling.sampler import SamplingTensors
from minisgl.speculative.drafter import DraftRequest, TargetStep
from minisgl.step.cuda_graph import VERIFY_GRAPH_MAX_TOKENS
from minisgl.step.layout import StepLayout


class StepBench:
    def __init__(self, model: str, max_bs: int, max_k: int, context: int, dtype: str = "bfloat16",
                 device: str = "cuda", verify: list[tuple[int, int]] | None = None, bucket_tokens: int = 0,
                 **spec: object) -> None:
        """`verify`: the (batch, K) pairs to capture verify graphs for (up to the engine's cap
        of VERIFY_GRAPH_MAX_TOKENS tokens); `bucket_tokens`: capture the extend ladder up to
        that many tokens (the "bucket" design; 0: none)."""
        page = 16
        per_req = -(-(context + max_k + 2) // page)
        # Room for 256 requests in the table: an extend bucket of t tokens then has t logits rows.
        cfg = EngineConfig(model=model, device=device, dtype=dtype, load_format="dummy", page_size=page,
                           num_pages=max_bs * per_req + 2, max_running_requests=max(max_bs, 256),
                           max_model_len=context + max_k + 64, **spec)
        self.eng = eng = Engine(cfg)
        self.graphs = eng.device.type == "cuda"
        if self.graphs:
            block_m = eng.steps.block_m
            layouts = [StepLayout("extend", b * (1 + k), b * (1 + k), min(b * (1 + k), b * -(-(1 + k) // block_m)))
                       for b, k in (verify or []) if b * (1 + k) <= VERIFY_GRAPH_MAX_TOKENS]
            eng.enable_cuda_graphs(max_bs, bucket_tokens, verify=layouts)
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

    def _verify_batch(self, b: int, k: int, how: str = "graph"):
        """how: "graph" (the verify graph of exactly b x (1 + k) tokens), "bucket" (the smallest
        extend bucket with a logits row per token), "eager"; None when that graph is missing."""
        eng = self.eng
        tokens = torch.randint(0, 1000, (b, k + 1), generator=self.gen).tolist()
        drafts = torch.tensor([t[1:] for t in tokens], dtype=torch.int64, device=eng.device)
        prefix = [self.context - 1] * b
        if how == "eager" or not self.graphs:
            return eng.build_batch("extend", self.rows[:b], prefix, tokens, use_graphs=False), drafts
        runner = eng.graphs
        spec = eng.steps.spec("extend", self.rows[:b], prefix, tokens, all_rows=True)
        pool = runner.verify if how == "graph" else runner.extend
        fit = [x for x in pool if x.fits(spec, eng.steps.count_tiles(spec, False))]
        if how == "graph":
            fit = [x for x in fit if x.tokens == b * (1 + k)]
        if not fit:
            return None, drafts
        eng.steps.upload(spec, fit[0], runner.buffer)
        return runner.batch(fit[0], spec), drafts

    def verify_ms(self, b: int, k: int, how: str = "graph") -> float | None:
        """Median ms of a verify step (None: no such graph). "graph" falls back to eager past
        the engine's verify-graph cap, as served."""
        if how == "graph" and b * (1 + k) > VERIFY_GRAPH_MAX_TOKENS:
            how = "eager"
        batch, drafts = self._verify_batch(b, k, how)
        if batch is None:
            return None
        st = self.greedy(b)
        return time_ms(lambda: self.eng.verify(batch, drafts, st))

    def verify_host_ms(self, b: int, k: int, how: str) -> float | None:
        """Median host time to submit a verify step's forward (no wait for the device)."""
        batch, _ = self._verify_batch(b, k, how)
        if batch is None:
            return None
        times = []
        for _ in range(10):
            if self.graphs:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.eng.forward(batch, all_positions=True)
            times.append((time.perf_counter() - t0) * 1000)
        if self.graphs:
            torch.cuda.synchronize()
        return sorted(times)[len(times) // 2]

    def draft_ms(self, b: int, k: int) -> float:
        """A model drafter's work per step: propose k tokens (its chain's graphs), then its pass
        over the verify batch (a draft model's runs inside the target's forward: not here)."""
        eng, drafter = self.eng, self.eng.drafter
        if drafter is None or not drafter.has_model:
            return 0.0
        batch, drafts = self._verify_batch(b, k, "eager")
        reqs = [DraftRequest(i, row, [1] * self.context, [], k) for i, row in enumerate(self.rows[:b])]
        aux = eng.model.model.aux_hidden
        if drafter.aux_layers:  # the verify's residual streams, as the engine leaves them
            eng.forward(batch, all_positions=True)
            aux = eng.model.model.aux_hidden
        last = batch.cu_seqlens_q[:-1].long()
        step = TargetStep(batch, batch.input_ids, last, aux)

        def run() -> None:
            drafter.propose(reqs)
            if not drafter.mirrors_in_forward:
                drafter.after_forward(step)

        return time_ms(run, reps=10)
