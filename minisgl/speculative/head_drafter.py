"""What the drafters with a one-layer head on the target's hidden states share (EAGLE-3,
speculative/eagle3.py; MTP, speculative/mtp.py): the head's own one-layer KV pool with the
target's pages; after every target forward the head runs over the same positions and leaves
each request's first draft token and next hidden state in per-row buffers; `propose` continues
the chain k - 1 steps on the head's own hidden states, each step replaying a graph per decode
batch size (spec/draft_steps.py). A subclass builds its head through `_build` and says how it
runs (`_run`) and its attention shape (`_head_dim`, `_scale`)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable

import torch
from torch import nn

from minisgl.core.batch import ForwardBatch
from minisgl.kvcache.pool import KVPool, RequestTable
from minisgl.ops import _checks
from minisgl.speculative.draft_steps import DraftSteps
from minisgl.speculative.drafter import Drafter, DraftRequest, DraftTarget, TargetStep


class HeadDrafter(Drafter):
    has_model = True
    needs_next_ids = True

    def _build(self, target: DraftTarget, make_head: Callable[[], nn.Module], hidden_size: int,
               tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        """The head in the target's dtype on its device (random weights under --load-format dummy,
        else `tensors()` loaded), the per-row buffers and the chain's steps."""
        from minisgl.models.weights import fill_dummy

        self.target = target
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(target.dtype)
        try:
            with torch.device(target.device):
                self.head = make_head()
                rows = target.max_requests + 1
                # Per request-table row: the next chain step's input token and hidden state.
                self.next_token = torch.zeros(rows, dtype=torch.int64)
                self.next_hidden = torch.zeros(rows, hidden_size)
        finally:
            torch.set_default_dtype(default_dtype)
        if target.dummy_weights:
            fill_dummy(self.head, target.seed + 1)
        else:
            self.head.load_weights(tensors())
        self.head.eval()
        attn = self.head.self_attn
        self.num_q_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.pool: KVPool | None = None
        self.steps = DraftSteps(target, self.next_token, self._step)

    @abstractmethod
    def _run(self, batch: ForwardBatch, input_ids: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows the LM head reads [T, H], the next chain step's hidden state [T, H])."""

    @property
    @abstractmethod
    def _head_dim(self) -> int: ...

    @property
    @abstractmethod
    def _scale(self) -> float: ...

    def kv_bytes_per_token(self) -> int:
        return KVPool.bytes_per_token_for(1, self.num_kv_heads, self._head_dim, self.target.dtype)

    def allocate_kv(self, num_pages: int, page_size: int, table: RequestTable) -> None:
        from minisgl.attention.select import make_backend

        t = self.target
        self.pool = KVPool(1, num_pages, page_size, self.num_kv_heads, self._head_dim, t.dtype, t.device)
        self.attn = make_backend(t.attention_backend, self.pool, self.num_q_heads, self._scale, t.device)
        self.steps.table = table

    @torch.inference_mode()
    def after_forward(self, step: TargetStep) -> None:
        """`step.batch` may be a graph's padded batch (its tokens past the step's write only the
        dummy slot); its first last_rows.numel() requests are the step's."""
        assert step.next_ids is not None and step.aux is not None
        self.attn.prepare(step.batch)
        with _checks.trusted():
            normed, hidden = self._run(step.batch, step.next_ids, step.aux)
        rows = step.batch.req_rows[: step.last_rows.numel()].long()
        self.next_token[rows] = self.head.draft_tokens(normed[step.last_rows])
        self.next_hidden[rows] = hidden[step.last_rows]

    def _step(self, batch: ForwardBatch) -> None:
        """One chain step (graph-safe): token and hidden state from the per-row buffers, the
        next ones written back there."""
        rows = batch.req_rows.long()
        self.attn.prepare(batch)
        with _checks.trusted():
            normed, hidden = self._run(batch, batch.input_ids, self.next_hidden[rows])
        self.next_token[rows] = self.head.draft_tokens(normed)
        self.next_hidden[rows] = hidden

    def enable_cuda_graphs(self, batch_sizes: list[int], runner_cls: type) -> None:
        self.steps.enable_cuda_graphs(batch_sizes, runner_cls)

    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        # The first draft comes from the target's last forward (after_forward); step s writes
        # draft s at position length - 2 + s (the head's positions trail the tokens by one).
        return self.steps.chain(reqs, first_step=1, offset=-2)
