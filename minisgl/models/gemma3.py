"""Gemma 3's text model (`Gemma3ForCausalLM`, and the language model of a
`Gemma3ForConditionalGeneration` checkpoint).

The Llama block's attention and gated MLP, arranged differently: four RMSNorms per block
(input, post-attention, pre- and post-feedforward; each scales by 1 + w, folded into the weight
on load so the common norm kernels run), GeGLU (gelu-tanh), the embedding scaled by
sqrt(hidden) in the model's dtype, q/k RMSNorm, a rope per layer kind (the sliding layers'
base differs from the global layers'), the softmax scale query_pre_attn_scalar ** -0.5 (the
engine takes it from ModelConfig.attention_scale) and optional final-logit soft-capping.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minisgl.attention.base import AttentionBackend
from minisgl.core.batch import ForwardBatch
from minisgl.core.model_config import ModelConfig
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.logging_setup import log_once
from minisgl.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

# A multimodal checkpoint's language model, as transformers 5 and 4.5x name it; its vision
# tower and projector are not served.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")
_ONE_PLUS_W = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPInfo, comm: Communicator, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, tp, comm, rope)
        self.mlp = LlamaMLP(cfg, tp, comm, f"model.layers.{layer_id}.mlp")
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(post-feedforward-normed MLP output, residual): the next layer adds them."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, batch, attn))
        h, residual = self.pre_feedforward_layernorm.forward_with_residual(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, comm: Communicator, ropes: dict[int, RotaryEmbedding]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, comm)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, tp, comm, ropes[cfg.window_of(i)]) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.aux_layers = None  # no EAGLE-3 heads for Gemma
        self.aux_hidden = None

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        # transformers multiplies by the scale rounded to the weights' dtype (a host float here:
        # a tensor made per step would be a host-to-device copy inside CUDA-graph capture).
        x = x * _rounded(self.embed_scale, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(batch.positions, x, residual, batch, attn)
        out, _ = self.norm.forward_with_residual(x, residual)
        return out


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loads as the Llama model does (same fused q/k/v and gate/up, same checks), after the
    renames and the 1 + w folding of `_text_tensors`."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, comm: Communicator, max_positions: int, device: torch.device):
        nn.Module.__init__(self)
        self.cfg = cfg
        # One rotary table per layer kind (keyed by window: 0 the global layers).
        ropes: dict[int, RotaryEmbedding] = {}
        for i in range(cfg.num_layers):
            w = cfg.window_of(i)
            if w not in ropes:
                theta, scaling = cfg.rope_of(i)
                ropes[w] = RotaryEmbedding(cfg.head_dim, max_positions, theta, scaling, device)
        self.model = Gemma3Model(cfg, tp, comm, ropes)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, cfg.tie_word_embeddings)
        self._ropes = list(ropes.values())
        self.kv_scales: dict[tuple[int, str], float] = {}
        self.needs_lm_head = True

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._text_tensors(tensors))

    @staticmethod
    def _text_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if name.startswith(_VISION):
                log_once("gemma3:vision", "Gemma 3 checkpoint: serving its text model; the vision tower and "
                         "projector are not loaded")
                continue
            for old, new in _TEXT_PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if name.endswith(_ONE_PLUS_W):
                tensor = tensor.float() + 1.0  # Gemma's norms scale by 1 + w
            yield name, tensor
