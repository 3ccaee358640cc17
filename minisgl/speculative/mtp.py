"""MTP drafting (`--speculative-algorithm mtp`): the multi-token-prediction head a Qwen3-Next or
Qwen3.5 checkpoint ships (models/qwen3_next_mtp.py) drafts for the model it came with.

It runs as EAGLE-3's head does (speculative/head_drafter.py): after every target forward the
head runs over the same positions and slots in its own one-layer KV pool (the target's pages),
position t taking the target's final normed hidden state at t and the token that followed t;
`propose` continues the chain k - 1 steps on the head's own outputs.
The target's verify step keeps the Gated DeltaNet states of rejected drafts out of its pool
(Qwen3NextForCausalLM.commit_verify); the head itself has full attention only.
"""

from __future__ import annotations

import torch

from minisgl.core.batch import ForwardBatch
from minisgl.speculative.drafter import DraftTarget
from minisgl.speculative.head_drafter import HeadDrafter


class MtpDrafter(HeadDrafter):
    name = "mtp"
    aux_layers = ()  # the target's final normed hidden states

    def __init__(self, target: DraftTarget) -> None:
        from minisgl.models.qwen3_next_mtp import MtpHead
        from minisgl.models.weights import iter_safetensors

        tc = target.model_config
        if tc.linear_attn is None:
            raise ValueError(f"--speculative-algorithm mtp drafts with the MTP head of Qwen3-Next and Qwen3.5 "
                             f"checkpoints; {tc.architecture} has none (use ngram, draft or eagle3)")
        if target.checkpoint is None and not target.dummy_weights:
            raise ValueError("--speculative-algorithm mtp loads the MTP head from the model's safetensors folder; "
                             "a GGUF file has none")
        self._build(target, lambda: MtpHead(tc, target.embed_tokens, target.lm_head, target.tp, target.comm,
                                            target.max_model_len, target.device),
                    tc.hidden_size, lambda: iter_safetensors(target.checkpoint))

    @property
    def _head_dim(self) -> int:
        return self.target.model_config.head_dim

    @property
    def _scale(self) -> float:
        return self.target.model_config.attention_scale

    def _run(self, batch: ForwardBatch, input_ids: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(batch, self.attn, input_ids, hidden)
        return out, out  # the LM head and the next step both read the normed output
