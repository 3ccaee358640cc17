"""The EAGLE-3 draft head (checkpoints with `"architectures": ["LlamaForCausalLMEagle3"]`).

Layout (as SGLang, vLLM and the EAGLE repository read it; tensor names without a "model."
prefix, which is stripped where present):
  fc.weight [H, 3 * H_target]   fuses the target's residual stream at three layers
  midlayer.*                    one Llama decoder layer whose q/k/v take 2H inputs:
                                cat(input_layernorm(embed(token)), hidden_norm(hidden))
  norm.weight, lm_head.weight [draft_vocab, H]
  d2t [draft_vocab] int64       target id = draft id + d2t[draft id]  (t2d is not needed)
  embed_tokens.weight           optional; without it the target's embedding is shared
Config: the Llama fields, draft_vocab_size (default vocab_size), target_hidden_size (default
hidden_size), norm_before_residual, and the target layers to read: SGLang/SpecForge's
eagle_config.eagle_aux_hidden_state_layer_ids (outputs of those layers: +1 here) or vLLM's
top-level eagle_aux_hidden_state_layer_ids (inputs of those layers), else 2, L / 2, L - 3.

One step at position t reads (token t + 1, hidden at t): the target's fused residual stream
[T, 3 H_target] (through fc), or, down a draft chain, the head's own pre-norm output [T, H].
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.attention.base import AttentionBackend
from minisgl.core.batch import ForwardBatch
from minisgl.core.model_config import ModelConfig
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import QKVParallelLinear, _check_shape
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.llama import LlamaAttention, LlamaMLP

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the midlayer's shape (vocab_size: the target's)
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    aux_layer_ids: tuple[int, ...] | None  # inputs of these target layers; None: the default

    @staticmethod
    def from_folder(path: Path) -> Eagle3Config:
        f = path / "config.json"
        if not f.is_file():
            raise ValueError(f"no config.json in the EAGLE-3 folder {path}")
        return Eagle3Config.from_dict(json.loads(f.read_text()))

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> Eagle3Config:
        archs = cfg.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise ValueError(f"an EAGLE-3 head needs architectures [{ARCHITECTURE!r}], got {archs}")
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"EAGLE-3 heads with {cfg['num_hidden_layers']} layers are not supported (only 1)")
        layer = ModelConfig.from_dict({**cfg, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        top = cfg.get("eagle_aux_hidden_state_layer_ids")
        ids = [int(i) + 1 for i in nested] if nested else ([int(i) for i in top] if top else None)
        if ids is not None and len(ids) != 3:
            raise ValueError(f"EAGLE-3 reads 3 target layers, the config names {len(ids)}")
        return Eagle3Config(
            layer=layer,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or layer.vocab_size),
            target_hidden_size=int(cfg.get("target_hidden_size") or layer.hidden_size),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            aux_layer_ids=tuple(ids) if ids is not None else None,
        )

    def aux_layers(self, target_layers: int) -> tuple[int, ...]:
        ids = self.aux_layer_ids or (2, target_layers // 2, target_layers - 3)
        if any(not 0 <= i <= target_layers for i in ids):
            raise ValueError(f"EAGLE-3 layer ids {ids} do not fit a target of {target_layers} layers")
        return tuple(ids)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, target_embed: VocabParallelEmbedding | None, tp: TPInfo,
                 comm: Communicator, max_positions: int, device: torch.device) -> None:
        super().__init__()
        lc = cfg.layer
        h = lc.hidden_size
        self.cfg = cfg
        # Own embedding only when the checkpoint has one (set by the loader), else the target's.
        self.embed_tokens = VocabParallelEmbedding(lc.vocab_size, h, tp, comm) if target_embed is None else None
        self._target_embed = [target_embed]  # a list: not a submodule (not loaded, not ours)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        rope = RotaryEmbedding(lc.head_dim, max_positions, lc.rope_theta, lc.rope_scaling, device)
        self.self_attn = LlamaAttention(lc, 0, tp, comm, rope)
        self.self_attn.qkv_proj = QKVParallelLinear(2 * h, lc.head_dim, lc.num_heads, lc.num_kv_heads, False, tp)
        self.mlp = LlamaMLP(lc, tp, comm)
        self.input_layernorm = RMSNorm(h, lc.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, lc.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, lc.rms_norm_eps)
        self.norm = RMSNorm(h, lc.rms_norm_eps)
        self.lm_weight = VocabParallelEmbedding(cfg.draft_vocab_size, h, tp, comm)  # the LM head's rows
        self.lm_head = ParallelLMHead(self.lm_weight, tied=True)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), persistent=False)
        self._rope = rope

    def forward(self, batch: ForwardBatch, attn: AttentionBackend, input_ids: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (token t + 1 at position t); hidden [T, 3 H_target] (the target's) or
        [T, H] (the head's previous pre-norm output). -> (normed [T, H], pre-norm [T, H])."""
        embed = self.embed_tokens or self._target_embed[0]
        e = self.input_layernorm(embed(input_ids))
        if hidden.shape[-1] != self.fc.out_features:
            hidden = F.linear(hidden.to(self.fc.weight.dtype), self.fc.weight)
        if self.cfg.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        x = self.self_attn(batch.positions, torch.cat([e, hidden], dim=-1), batch, attn)
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        return self.norm.forward_with_residual(self.mlp(x), residual)

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy draft token, as a target id, for each row of `normed` [n, H]."""
        best = self.lm_head(normed).argmax(dim=-1)
        return best + self.d2t[best]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names (see the module docstring); every needed tensor exactly once."""
        from minisgl.models.llama import _FUSED

        modules = dict(self.named_modules())
        expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "midlayer.input_layernorm.weight",
                    "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
                    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
        if self.embed_tokens is not None:
            expected.add("embed_tokens.weight")
        seen: set[str] = set()
        for name, t in tensors:
            name = name.removeprefix("model.")
            if name == "t2d":
                continue
            if name not in expected or name in seen:
                raise ValueError(f"{'unexpected' if name not in expected else 'repeated'} tensor {name} in the "
                                 "EAGLE-3 checkpoint")
            seen.add(name)
            local = name.removeprefix("midlayer.")
            mod, _, kind = local.rpartition(".")
            head, _, last = mod.rpartition(".")
            if name == "d2t":
                _check_shape(name, t.shape, tuple(self.d2t.shape))
                target_ids = torch.arange(len(t)) + t.long()
                if target_ids.min() < 0 or target_ids.max() >= self.cfg.layer.vocab_size:
                    raise ValueError(f"d2t maps draft ids outside the vocabulary of {self.cfg.layer.vocab_size}")
                self.d2t.copy_(t.long())
            elif name == "lm_head.weight":
                self.lm_weight.load(name, t)
            elif name == "embed_tokens.weight":
                self.embed_tokens.load(name, t)
            elif last in _FUSED:
                fused, part = _FUSED[last]
                modules[f"{head}.{fused}"].load_part(name, kind, t, part)
            elif last in ("o_proj", "down_proj"):
                modules[mod].load(name, kind, t)
            else:
                param = getattr(modules[mod], kind)
                _check_shape(name, t.shape, tuple(param.shape))
                param.data.copy_(t)
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(f"tensor {missing[0]} is missing from the EAGLE-3 checkpoint")


def has_own_embedding(path: Path) -> bool:
    from safetensors import safe_open

    from minisgl.models.weights import safetensors_files

    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            if any(k.removeprefix("model.") == "embed_tokens.weight" for k in fh.keys()):
                return True
    return False

