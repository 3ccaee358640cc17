"""EAGLE-3 drafting: a one-layer head reads the target's residual stream at three layers.

After every target forward (`after_forward`) the head runs over the same positions and slots
(its own one-layer KV pool, the target's pages), position t taking the target's fused hidden
state at t and the token that followed t; at each request's last valid position it leaves the
first draft token and its pre-norm hidden state in per-row buffers. `propose` continues the
chain k - 1 steps on the head's own hidden states, one position further each step, each step
reading and writing those buffers (so it replays a graph per decode batch size, see
spec/draft_steps.py). Positions past the accepted tokens hold draft K/V only until the next
forward rewrites them. `after_forward` runs eagerly after the target's step (it needs the
sampled tokens), over the step's graph-padded batch when the target replayed a graph.

A prefix the radix cache shares is valid for the head too, except that the head's K/V at the
prefix's last position was computed with the token that followed it in the request that
cached it: another continuation drafts from a slightly stale entry there (acceptance, never
correctness, is at stake: the target verifies every token).
"""

from __future__ import annotations

import torch

from minisgl.core.batch import ForwardBatch
from minisgl.kvcache.pool import KVPool, RequestTable
from minisgl.models.eagle3 import Eagle3Config, Eagle3Head, has_own_embedding
from minisgl.ops import _checks
from minisgl.speculative.draft_steps import DraftSteps
from minisgl.speculative.drafter import Drafter, DraftRequest, DraftTarget, TargetStep


class Eagle3Drafter(Drafter):
    name = "eagle3"
    has_model = True
    needs_next_ids = True

    def __init__(self, target: DraftTarget, path: str) -> None:
        from pathlib import Path

        from minisgl.models.weights import fill_dummy, iter_safetensors

        self.target = target
        folder = Path(path).expanduser()
        cfg = Eagle3Config.from_folder(folder)
        tc = target.model_config
        lc = cfg.layer
        if lc.vocab_size != tc.vocab_size:
            raise ValueError(f"EAGLE-3 head {path!r} is for a vocabulary of {lc.vocab_size}; the target has "
                             f"{tc.vocab_size}")
        if cfg.target_hidden_size != tc.hidden_size:
            raise ValueError(f"EAGLE-3 head {path!r} reads hidden states of size {cfg.target_hidden_size}; the "
                             f"target's are {tc.hidden_size}")
        lc.check_tp(target.tp.size)
        self.aux_layers = cfg.aux_layers(tc.num_layers)
        dummy = target.dummy_weights
        own_embed = (not dummy and has_own_embedding(folder)) or lc.hidden_size != tc.hidden_size
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(target.dtype)
        try:
            with torch.device(target.device):
                self.head = Eagle3Head(cfg, None if own_embed else target.embed_tokens, target.tp, target.comm,
                                       target.max_model_len, target.device)
                rows = target.max_requests + 1
                # Per request-table row: the next chain's first draft token and hidden state.
                self.next_token = torch.zeros(rows, dtype=torch.int64)
                self.next_hidden = torch.zeros(rows, lc.hidden_size)
        finally:
            torch.set_default_dtype(default_dtype)
        if dummy:
            fill_dummy(self.head, target.seed + 1)  # d2t stays 0: the identity map
        else:
            self.head.load_weights(iter_safetensors(folder))
        self.head.eval()
        self.cfg = cfg
        attn = self.head.self_attn
        self.num_q_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.pool: KVPool | None = None
        self.steps = DraftSteps(target, self.next_token, self._step)

    def kv_bytes_per_token(self) -> int:
        return KVPool.bytes_per_token_for(1, self.num_kv_heads, self.cfg.layer.head_dim, self.target.dtype)

    def allocate_kv(self, num_pages: int, page_size: int, table: RequestTable) -> None:
        from minisgl.attention.select import make_backend

        t, d = self.target, self.cfg.layer.head_dim
        self.pool = KVPool(1, num_pages, page_size, self.num_kv_heads, d, t.dtype, t.device)
        self.attn = make_backend(t.attention_backend, self.pool, self.num_q_heads, d**-0.5, t.device)
        self.steps.table = table

    @torch.inference_mode()
    def after_forward(self, step: TargetStep) -> None:
        """`step.batch` may be a graph's padded batch (its tokens past the step's write only the
        dummy slot); its first last_rows.numel() requests are the step's."""
        assert step.next_ids is not None and step.aux is not None
        self.attn.prepare(step.batch)
        with _checks.trusted():
            normed, prenorm = self.head(step.batch, self.attn, step.next_ids, step.aux)
        rows = step.batch.req_rows[: step.last_rows.numel()].long()
        self.next_token[rows] = self.head.draft_tokens(normed[step.last_rows])
        self.next_hidden[rows] = prenorm[step.last_rows]

    def _step(self, batch: ForwardBatch) -> None:
        """One chain step (graph-safe): token and hidden state from the per-row buffers, the
        next ones written back there."""
        rows = batch.req_rows.long()
        self.attn.prepare(batch)
        with _checks.trusted():
            normed, prenorm = self.head(batch, self.attn, batch.input_ids, self.next_hidden[rows])
        self.next_token[rows] = self.head.draft_tokens(normed)
        self.next_hidden[rows] = prenorm

    def enable_cuda_graphs(self, batch_sizes: list[int], runner_cls: type) -> None:
        self.steps.enable_cuda_graphs(batch_sizes, runner_cls)

    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        # The first draft comes from the target's last forward (after_forward); step s writes
        # draft s at position length - 2 + s (the head's positions trail the tokens by one).
        return self.steps.chain(reqs, first_step=1, offset=-2)
