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
from minisgl.models.eagle3 import Eagle3Config, Eagle3Head, has_own_embedding
from minisgl.speculative.drafter import DraftTarget
from minisgl.speculative.head_drafter import HeadDrafter


class Eagle3Drafter(HeadDrafter):
    name = "eagle3"

    def __init__(self, target: DraftTarget, path: str) -> None:
        from pathlib import Path

        from minisgl.models.weights import iter_safetensors

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
        self.cfg = cfg
        # (dummy weights: d2t stays 0, the identity map)
        self._build(target, lambda: Eagle3Head(cfg, None if own_embed else target.embed_tokens, target.tp, target.comm,
                                               target.max_model_len, target.device),
                    lc.hidden_size, lambda: iter_safetensors(folder))

    @property
    def _head_dim(self) -> int:
        return self.cfg.layer.head_dim

    @property
    def _scale(self) -> float:
        return self.cfg.layer.head_dim ** -0.5

    def _run(self, batch: ForwardBatch, input_ids: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(batch, self.attn, input_ids, hidden)  # (normed, pre-norm)
