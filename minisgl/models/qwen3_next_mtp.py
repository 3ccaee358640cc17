"""The multi-token-prediction (MTP) head that Qwen3-Next and Qwen3.5 checkpoints ship beside the
model (`mtp.*` tensors; transformers does not load them), as a drafter's model.

One step at position t reads (token t + 1, the hidden state h at t), h being the target's final
normed hidden state, or down a draft chain the head's own output at t - 1:

    x = fc(cat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)))     fc: [H, 2H], no bias
    x -> one decoder layer of the model's own shape, gated full attention (its MLP: MoE when
         the model's layers are, else dense) -> norm -> out;  logits = the target's LM head(out)

Tensor names: mtp.fc.weight, mtp.pre_fc_norm_{embedding,hidden}.weight, mtp.norm.weight and
mtp.layers.0.* (a decoder layer's names). The embedding and the LM head are the target's. All
norms are zero-centred (1 + w), folded on load as in qwen3_next.py. Checkpoints with more than
one MTP layer are refused by name (none is published).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minisgl.attention.base import AttentionBackend
from minisgl.core.batch import ForwardBatch
from minisgl.core.model_config import ModelConfig
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.qwen3_next import _ONE_PLUS_W, MTP_PREFIXES, HybridDecoderLayer

_NORMS = (*_ONE_PLUS_W, "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


class MtpHead(LlamaForCausalLM):
    """Loads through the Llama loader (fused q/k/v and gate/up, MoE experts, the same checks)
    from the `mtp.*` tensors renamed to `model.*`."""

    def __init__(self, cfg: ModelConfig, embed: nn.Module, lm_head: nn.Module, tp: TPInfo, comm: Communicator,
                 max_positions: int, device: torch.device) -> None:
        nn.Module.__init__(self)
        cfg = dataclasses.replace(cfg, quantization=None)  # 4-bit checkpoints keep the MTP head in 16 bits
        self.cfg = cfg
        h = cfg.hidden_size
        self._rope = RotaryEmbedding(int(cfg.head_dim * cfg.partial_rotary_factor), max_positions, cfg.rope_theta,
                                     cfg.rope_scaling, device)
        self.model = nn.Module()
        self.model.fc = nn.Linear(2 * h, h, bias=False)  # replicated on every rank (small: 2 H^2)
        self.model.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.model.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.model.layers = nn.ModuleList([HybridDecoderLayer(cfg, 0, 0, tp, comm, self._rope, full=True)])
        self.model.norm = RMSNorm(h, cfg.rms_norm_eps)
        self._shared = (embed, lm_head)  # the target's (a tuple: not submodules, neither loaded nor ours)
        self.kv_scales: dict[tuple[int, str], float] = {}
        self.needs_lm_head = False

    @property
    def self_attn(self) -> nn.Module:
        """The layer's attention (its heads size the drafter's KV pool)."""
        return self.model.layers[0].self_attn

    def forward(self, batch: ForwardBatch, attn: AttentionBackend, input_ids: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        """input_ids [T] (token t + 1 at position t), hidden [T, H] -> out [T, H] (normed)."""
        m = self.model
        e = m.pre_fc_norm_embedding(self._shared[0](input_ids))
        x = m.fc(torch.cat([e, m.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        x, residual = m.layers[0](batch.positions, x, None, batch, attn)
        out, _ = m.norm.forward_with_residual(x, residual)
        return out

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """Greedy draft token for each row of `out` [n, H]."""
        return self._shared[1](out).argmax(dim=-1)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._mtp_tensors(tensors))

    @staticmethod
    def _mtp_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        found = False
        for name, tensor in tensors:
            prefix = next((p for p in MTP_PREFIXES if name.startswith(p)), None)
            if prefix is None:
                continue
            found = True
            name = "model." + name[len(prefix):]
            if name.startswith("model.layers.") and not name.startswith("model.layers.0."):
                raise ValueError(f"checkpoint tensor {prefix}{name[6:]}: MTP heads of more than one layer are not "
                                 "supported")
            if name.endswith(_NORMS) or name == "model.norm.weight":
                tensor = tensor.float() + 1.0  # zero-centred norms scale by 1 + w
            yield name, tensor
        if not found:
            raise ValueError("the checkpoint has no MTP head (no mtp.* tensors): --speculative-algorithm mtp drafts "
                             "with the one Qwen3-Next and Qwen3.5 checkpoints ship; use ngram or draft instead")
