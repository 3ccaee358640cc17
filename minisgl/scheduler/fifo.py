"""A plain FIFO scheduler: admit waiting requests in order while their worst-case KV need
fits, prefill them together, otherwise decode every running request. (The radix-cache
scheduler with chunked prefill and retraction replaces it.)"""

from __future__ import annotations

from collections import deque

from minisgl.engine.engine import Engine
from minisgl.engine.sampler import SamplingTensors
from minisgl.scheduler.request import Request


class FifoScheduler:
    def __init__(self, engine: Engine, max_prefill_tokens: int = 8192) -> None:
        self.engine = engine
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        need = self._pages_for(req)
        if need > self.engine.allocator.total_pages:
            raise ValueError(
                f"request needs {req.max_total_len} tokens of KV cache but the pool holds "
                f"{self.engine.allocator.total_pages * self.engine.cfg.page_size}"
            )
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Ends a request early (stop string or abort) and frees its KV slots."""
        if req.finished and req not in self.running:
            return
        req.finish_reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
        self._release_finished()

    def _pages_for(self, req: Request) -> int:
        return -(-req.max_total_len // self.engine.cfg.page_size)

    def _admit(self) -> list[Request]:
        eng, admitted, budget = self.engine, [], self.max_prefill_tokens
        while self.waiting:
            req = self.waiting[0]
            pages = self._pages_for(req)
            fits_budget = len(req.prompt) <= budget or not admitted
            if not (fits_budget and eng.table.free_rows and eng.allocator.can_allocate(pages)):
                break
            self.waiting.popleft()
            req.row = eng.table.allocate_row()
            req.pages = eng.allocator.allocate(pages)
            eng.set_slots(req.row, 0, eng.allocator.slots_of(req.pages)[: req.max_total_len])
            budget -= len(req.prompt)
            admitted.append(req)
        return admitted

    def step(self) -> list[Request]:
        """Runs one forward step; returns the requests that got a token (some may be finished)."""
        batch_reqs = self._admit()
        if batch_reqs:
            mode, prefix, new = "extend", [0] * len(batch_reqs), [r.prompt for r in batch_reqs]
            self.running.extend(batch_reqs)
        elif self.running:
            batch_reqs = list(self.running)
            mode = "decode"
            prefix = [r.total_len - 1 for r in batch_reqs]
            new = [[r.output[-1]] for r in batch_reqs]
        else:
            return []
        eng = self.engine
        batch = eng.build_batch(mode, [r.row for r in batch_reqs], prefix, new)
        logits = eng.forward(batch)
        st = SamplingTensors.build(
            [r.params.temperature for r in batch_reqs], [r.params.top_k for r in batch_reqs],
            [r.params.top_p for r in batch_reqs], [r.params.min_p for r in batch_reqs],
            [r.seed for r in batch_reqs], [len(r.output) for r in batch_reqs], eng.device,
        )
        tokens, logprobs = eng.sample(logits, st)
        for req, tok, lp in zip(batch_reqs, tokens.tolist(), logprobs.tolist()):
            req.cached_len = req.total_len
            req.append(tok, lp)
        self._release_finished()
        return batch_reqs

    def _release_finished(self) -> None:
        keep = []
        for req in self.running:
            if req.finished:
                self.engine.allocator.free(req.pages)
                self.engine.table.free_row(req.row)
                req.pages, req.row = [], -1
            else:
                keep.append(req)
        self.running = keep
