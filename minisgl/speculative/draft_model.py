"""Draft-model drafting: any model minisgl loads, with the target's vocabulary, proposes k
tokens per request by k greedy decode steps.

KV: the draft keeps its own pool (its layers and heads) with the target's pages, so a slot
id means the same token position in both pools and the target's request table indexes both.
`mirror` runs the draft over every target forward's positions and slots (prefill chunks,
plain decodes, verify steps; the engine calls it inside its forward, so the target's CUDA
graphs hold it), so the draft's KV always holds the tokens the target's does; a draft chain
then writes the positions of the next verify step, which that step's mirror overwrites with
the tokens the target actually took. The chain's steps replay graphs per decode batch size
(spec/draft_steps.py).
"""

from __future__ import annotations

import torch

from minisgl.core.batch import ForwardBatch
from minisgl.kvcache.pool import KVPool, RequestTable
from minisgl.ops import _checks
from minisgl.speculative.draft_steps import DraftSteps
from minisgl.speculative.drafter import Drafter, DraftRequest, DraftTarget


class DraftModelDrafter(Drafter):
    name = "draft"
    has_model = True
    mirrors_in_forward = True

    def __init__(self, target: DraftTarget, path: str) -> None:
        from minisgl.models.loading import load_model, load_model_config
        from minisgl.models.source import resolve_model

        self.target = target
        source = resolve_model(path)
        cfg = load_model_config(source)
        target_vocab = target.model_config.vocab_size
        if cfg.vocab_size != target_vocab:
            raise ValueError(
                f"draft model {path!r} has a vocabulary of {cfg.vocab_size} tokens; the target has {target_vocab}"
            )
        if cfg.linear_attn is not None:
            raise ValueError(f"draft model {path!r} ({cfg.architecture}) keeps recurrent state: a draft model needs "
                             "attention layers only (its K/V follows the target's pages; a state would need the "
                             "target's verify commit too)")
        cfg.check_tp(target.tp.size)
        self.model_config = cfg
        # Another seed than the target's: dummy weights must not make the draft a copy.
        self.model = load_model(source, cfg, target.seed + 1, dtype=target.dtype, device=target.device, tp=target.tp,
                                comm=target.comm, max_model_len=target.max_model_len, dummy=target.dummy_weights)
        attn = self.model.model.layers[0].self_attn
        self.num_q_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.pool: KVPool | None = None
        # Per request-table row: the next input of a draft chain (a draft step writes its argmax).
        self.tokens = torch.zeros(target.max_requests + 1, dtype=torch.int64, device=target.device)
        self.steps = DraftSteps(target, self.tokens, self._step)

    def kv_bytes_per_token(self) -> int:
        mc = self.model_config
        return KVPool.bytes_per_token_for(mc.num_layers, self.num_kv_heads, mc.head_dim, self.target.dtype)

    def allocate_kv(self, num_pages: int, page_size: int, table: RequestTable) -> None:
        from minisgl.attention.select import make_backend

        mc, t = self.model_config, self.target
        self.pool = KVPool(mc.num_layers, num_pages, page_size, self.num_kv_heads, mc.head_dim, t.dtype, t.device)
        self.attn = make_backend(t.attention_backend, self.pool, self.num_q_heads, mc.head_dim**-0.5, t.device)
        self.steps.table = table

    def mirror(self, batch: ForwardBatch) -> None:
        """The draft's K/V over a target forward's positions and slots (no LM head). The engine
        calls it inside every target forward, so CUDA graphs capture it with the target."""
        self.attn.prepare(batch)
        self.model.model(batch, self.attn)

    def _step(self, batch: ForwardBatch) -> None:
        """One greedy draft step (graph-safe): next input token per row, from the argmax."""
        self.attn.prepare(batch)
        with _checks.trusted():
            logits = self.model(batch, self.attn)
        self.tokens[batch.req_rows.long()] = logits.argmax(dim=-1)

    def enable_cuda_graphs(self, batch_sizes: list[int], runner_cls: type) -> None:
        self.steps.enable_cuda_graphs(batch_sizes, runner_cls)

    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        # Step s feeds the last token (s = 0) or draft s, at position length - 1 + s.
        return self.steps.chain(reqs, first_step=0, offset=-1)
