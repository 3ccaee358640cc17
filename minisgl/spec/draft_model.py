"""Draft-model drafting: any model minisgl loads, with the target's vocabulary, proposes k
tokens per request by k greedy decode steps.

KV: the draft keeps its own pool (its layers and heads) with the target's pages, so a slot
id means the same token position in both pools and the target's request table indexes both.
`after_forward` runs the draft over every target forward's positions and slots (prefill
chunks, plain decodes, verify steps), so the draft's KV always holds the tokens the target's
does; a draft chain then writes the positions of the next verify step, which that step's
mirror overwrites with the tokens the target actually took.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisgl.kvcache.pool import KVPool
from minisgl.spec.drafter import Drafter, DraftRequest, TargetStep, subset_index

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine


class DraftModelDrafter(Drafter):
    name = "draft"
    has_model = True

    def __init__(self, engine: Engine, path: str) -> None:
        from minisgl.engine.engine import load_model, load_model_config
        from minisgl.models.source import resolve_model

        self.engine = engine
        source = resolve_model(path)
        cfg = load_model_config(source)
        target_vocab = engine.model_config.vocab_size
        if cfg.vocab_size != target_vocab:
            raise ValueError(
                f"draft model {path!r} has a vocabulary of {cfg.vocab_size} tokens; the target has {target_vocab}"
            )
        cfg.check_tp(engine.tp.size)
        self.model_config = cfg
        # Another seed than the target's: dummy weights must not make the draft a copy.
        self.model = load_model(engine, source, cfg, engine.cfg.seed + 1)
        attn = self.model.model.layers[0].self_attn
        self.num_q_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.pool: KVPool | None = None

    def kv_bytes_per_token(self) -> int:
        mc = self.model_config
        return KVPool.bytes_per_token_for(mc.num_layers, self.num_kv_heads, mc.head_dim, self.engine.dtype)

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        from minisgl.attention.select import make_backend

        mc, eng = self.model_config, self.engine
        self.pool = KVPool(mc.num_layers, num_pages, page_size, self.num_kv_heads, mc.head_dim, eng.dtype, eng.device)
        self.attn = make_backend(eng.cfg.attention_backend, self.pool, self.num_q_heads, mc.head_dim**-0.5, eng.device)

    @torch.inference_mode()
    def after_forward(self, step: TargetStep) -> None:
        self.attn.prepare(step.batch)
        self.model.model(step.batch, self.attn)  # K/V only: no LM head

    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        active = [i for i, r in enumerate(reqs) if r.k > 0]
        out: list[list[int]] = [[] for _ in reqs]
        if not active:
            return out
        eng = self.engine
        kmax = max(reqs[i].k for i in active)
        dev = eng.device
        # drafts[s, a]: the s-th draft of active request a, kept on the device until the end.
        drafts = torch.zeros(kmax, len(active), dtype=torch.int64, device=dev)
        last = torch.tensor([reqs[i].last for i in active], dtype=torch.int64).to(dev, non_blocking=True)
        for s in range(kmax):
            live = [a for a, i in enumerate(active) if reqs[i].k > s]
            rows = [reqs[active[a]].row for a in live]
            # Step s feeds the request's last token (s = 0) or draft s at position len - 1 + s.
            batch = eng.build_batch(
                "decode", rows, [reqs[active[a]].length - 1 + s for a in live], [[0]] * len(live), use_graphs=False
            )
            index = subset_index(live, len(active), dev)
            prev = last if s == 0 else drafts[s - 1]
            batch.input_ids = prev if index is None else prev[index]
            self.attn.prepare(batch)
            logits = self.model(batch, self.attn)
            nxt = logits.argmax(dim=-1)
            if index is None:
                drafts[s] = nxt
            else:
                drafts[s, index] = nxt
        host = drafts.T.tolist()
        for a, i in enumerate(active):
            out[i] = host[a][: reqs[i].k]
        return out
