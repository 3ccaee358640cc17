"""EAGLE-3 drafting: a one-layer head reads the target's residual stream at three layers.

After every target forward (`after_forward`) the head runs over the same positions and slots
(its own one-layer KV pool, the target's pages), position t taking the target's fused hidden
state at t and the token that followed t; at each request's last valid position it leaves the
first draft token and its pre-norm hidden state in per-row buffers. `propose` continues the
chain k - 1 steps on the head's own hidden states, one position further each step. Positions
past the accepted tokens hold draft K/V only until the next forward rewrites them.

A prefix the radix cache shares is valid for the head too, except that the head's K/V at the
prefix's last position was computed with the token that followed it in the request that
cached it: another continuation drafts from a slightly stale entry there (acceptance, never
correctness, is at stake: the target verifies every token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisgl.kvcache.pool import KVPool
from minisgl.models.eagle3 import Eagle3Config, Eagle3Head, has_own_embedding
from minisgl.spec.drafter import Drafter, DraftRequest, TargetStep, subset_index

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine


class Eagle3Drafter(Drafter):
    name = "eagle3"
    has_model = True
    needs_next_ids = True

    def __init__(self, engine: Engine, path: str) -> None:
        from pathlib import Path

        from minisgl.models.weights import fill_dummy, iter_safetensors

        self.engine = engine
        folder = Path(path).expanduser()
        cfg = Eagle3Config.from_folder(folder)
        tc = engine.model_config
        lc = cfg.layer
        if lc.vocab_size != tc.vocab_size:
            raise ValueError(f"EAGLE-3 head {path!r} is for a vocabulary of {lc.vocab_size}; the target has "
                             f"{tc.vocab_size}")
        if cfg.target_hidden_size != tc.hidden_size:
            raise ValueError(f"EAGLE-3 head {path!r} reads hidden states of size {cfg.target_hidden_size}; the "
                             f"target's are {tc.hidden_size}")
        lc.check_tp(engine.tp.size)
        self.aux_layers = cfg.aux_layers(tc.num_layers)
        dummy = engine.cfg.load_format == "dummy"
        own_embed = (not dummy and has_own_embedding(folder)) or lc.hidden_size != tc.hidden_size
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(engine.dtype)
        try:
            with torch.device(engine.device):
                self.head = Eagle3Head(cfg, None if own_embed else engine.model.model.embed_tokens, engine.tp,
                                       engine.comm, engine.max_model_len, engine.device)
                rows = engine.cfg.max_running_requests + 1
                # Per request-table row: the next chain's first draft token and hidden state.
                self.next_token = torch.zeros(rows, dtype=torch.int64)
                self.next_hidden = torch.zeros(rows, lc.hidden_size)
        finally:
            torch.set_default_dtype(default_dtype)
        if dummy:
            fill_dummy(self.head, engine.cfg.seed + 1)  # d2t stays 0: the identity map
        else:
            self.head.load_weights(iter_safetensors(folder))
        self.head.eval()
        self.cfg = cfg
        attn = self.head.self_attn
        self.num_q_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.pool: KVPool | None = None

    def kv_bytes_per_token(self) -> int:
        return KVPool.bytes_per_token_for(1, self.num_kv_heads, self.cfg.layer.head_dim, self.engine.dtype)

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        from minisgl.attention.select import make_backend

        eng, d = self.engine, self.cfg.layer.head_dim
        self.pool = KVPool(1, num_pages, page_size, self.num_kv_heads, d, eng.dtype, eng.device)
        self.attn = make_backend(eng.cfg.attention_backend, self.pool, self.num_q_heads, d**-0.5, eng.device)

    @torch.inference_mode()
    def after_forward(self, step: TargetStep) -> None:
        assert step.next_ids is not None and step.aux is not None
        self.attn.prepare(step.batch)
        normed, prenorm = self.head(step.batch, self.attn, step.next_ids, step.aux)
        rows = step.batch.req_rows.long()
        self.next_token[rows] = self.head.draft_tokens(normed[step.last_rows])
        self.next_hidden[rows] = prenorm[step.last_rows]

    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        active = [i for i, r in enumerate(reqs) if r.k > 0]
        out: list[list[int]] = [[] for _ in reqs]
        if not active:
            return out
        eng, dev = self.engine, self.engine.device
        kmax = max(reqs[i].k for i in active)
        rows = torch.tensor([reqs[i].row for i in active], dtype=torch.int64).to(dev, non_blocking=True)
        drafts = torch.zeros(kmax, len(active), dtype=torch.int64, device=dev)
        drafts[0] = self.next_token[rows]
        hidden = self.next_hidden[rows]
        for s in range(1, kmax):
            live = [a for a, i in enumerate(active) if reqs[i].k > s]
            index = subset_index(live, len(active), dev)
            # Step s: draft s at position len - 2 + s (the head's positions trail the tokens by one).
            batch = eng.build_batch("decode", [reqs[active[a]].row for a in live],
                                    [reqs[active[a]].length - 2 + s for a in live], [[0]] * len(live),
                                    use_graphs=False)
            batch.input_ids = drafts[s - 1] if index is None else drafts[s - 1][index]
            h = hidden if index is None else hidden[index]
            self.attn.prepare(batch)
            normed, prenorm = self.head(batch, self.attn, batch.input_ids, h)
            nxt = self.head.draft_tokens(normed)
            if index is None:
                drafts[s], hidden = nxt, prenorm
            else:
                drafts[s, index] = nxt
                hidden = hidden.clone()
                hidden[index] = prenorm
        host = drafts.T.tolist()
        for a, i in enumerate(active):
            out[i] = host[a][: reqs[i].k]
        return out
