"""One Llama-family decoder covering Llama (incl. llama3 rope scaling), Mistral, Qwen2
(q/k/v bias) and Qwen3 (q/k RMSNorm, explicit head_dim), tied or untied embeddings, and their
mixture-of-experts variants Qwen2-MoE, Qwen3-MoE and Mixtral (a sparse MLP block per layer
where the config says so: layers/moe.py).

Module names mirror the Hugging Face checkpoints (model.layers.N.self_attn...), except the
fused projections: q/k/v -> qkv_proj, gate/up -> gate_up_proj, which load() assembles, and the
routed experts, stacked into mlp.experts.w13 / w2 on load (Mixtral's block_sparse_moe and
w1/w3/w2 are read as mlp and gate/up/down_proj).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from minisgl import ops
from minisgl.attention.base import AttentionBackend
from minisgl.core.batch import ForwardBatch
from minisgl.core.model_config import ModelConfig
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.fp8_load import experts_quant, layer_quant
from minisgl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minisgl.layers.moe import SparseMoeBlock
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.logging_setup import log_once
from minisgl.ops.gemm.fp8 import FP8


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPInfo, comm: Communicator, rope: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        p, q = f"model.layers.{layer_id}.self_attn", cfg.quantization
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp,
            quant=layer_quant(q, [f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"]),
        )
        self.num_heads = self.qkv_proj.local_q_heads
        self.num_kv_heads = self.qkv_proj.local_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp, comm, quant=layer_quant(q, [f"{p}.o_proj"])
        )
        # GPT-OSS: a learned logit per head in every softmax denominator (fp32, this rank's heads).
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False) \
            if cfg.attn_sinks else None
        self.q_head_start = tp.rank * self.num_heads
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rope = rope  # shared by all layers; not a parameter

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
        partial: bool = False,
    ) -> torch.Tensor:
        """partial: return this rank's unreduced o_proj output (the caller reduces it)."""
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        # Views into qkv (row stride = qkv width): rope and the KV store take strided rows.
        q = qkv[:, :q_size].view(t, self.num_heads, d)
        k = qkv[:, q_size : q_size + kv_size].view(t, self.num_kv_heads, d)
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, d)
        rope = None
        if self.qk_norm:  # in place on the qkv views: no copies of q and k, one launch
            self.rope.forward_with_qk_norm(positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        else:  # the backend's KV store rotates q and k (one kernel for both where it can)
            rope = (positions, self.rope.cos_sin_cache)
        o = attn.forward(q, k, v, self.layer_id, batch, sinks=self.sinks, rope=rope).reshape(t, q_size)
        return self.o_proj.partial(o) if partial else self.o_proj(o)


    def load_sinks(self, name: str, full: torch.Tensor) -> None:
        """GPT-OSS's sinks [num_heads]: this rank's heads."""
        if self.sinks is None:
            raise ValueError(f"unexpected tensor {name} in the checkpoint")
        start, n = self.q_head_start, self.sinks.shape[0]
        if full.dim() != 1 or full.shape[0] < start + n:
            raise ValueError(f"tensor {name} has shape {tuple(full.shape)}, expected one logit per attention head")
        self.sinks.data.copy_(full[start : start + n])


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, comm: Communicator, prefix: str = "mlp"):
        super().__init__()
        inter, q = cfg.intermediate_size, cfg.quantization
        # gate_up_proj gives silu(gate) * up: the activation is its GEMM's epilogue. Gemma's
        # gelu-tanh runs after the GEMM (ops.gelu_tanh_and_mul).
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter, inter], False, tp, silu_and_mul=not self.gelu,
            quant=layer_quant(q, [f"{prefix}.gate_proj", f"{prefix}.up_proj"]),
        )
        self.down_proj = RowParallelLinear(
            inter, cfg.hidden_size, False, tp, comm, quant=layer_quant(q, [f"{prefix}.down_proj"])
        )

    def forward(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """partial: return this rank's unreduced down_proj output (the caller reduces it)."""
        h = self.gate_up_proj(x)
        if self.gelu:
            h = ops.gelu_tanh_and_mul(h)
        return self.down_proj.partial(h) if partial else self.down_proj(h)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPInfo, comm: Communicator, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, tp, comm, rope)
        if cfg.is_sparse_layer(layer_id):  # 16-bit or INT4 experts (FP8 experts are not built)
            p, q = f"model.layers.{layer_id}.mlp", cfg.quantization
            shared = [f"{p}.shared_expert.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
            self.mlp = SparseMoeBlock(cfg, tp, comm, experts_quant(q, f"{p}.experts"), layer_quant(q, shared))
        else:
            self.mlp = LlamaMLP(cfg, tp, comm, f"model.layers.{layer_id}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.comm = comm
        # With TP the row-parallel outputs (o_proj, a dense down_proj) stay unreduced partial
        # sums: the norm after each reduces them, where it can in the same kernel as its
        # residual add (RMSNorm.forward_with_residual). An MoE block reduces its own output.
        self.attn_partial = tp.size > 1 and not cfg.o_bias  # a biased o_proj reduces itself
        self.mlp_partial = self.attn_partial and isinstance(self.mlp, LlamaMLP)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        attn: AttentionBackend,
        x_partial: bool = False,
        aux: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual); the output is a partial sum where self.mlp_partial. x_partial: x
        is the previous layer's partial sum. aux: gets a copy of the residual stream entering
        this layer (x + residual, reduced), for EAGLE-3."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual, self.comm if x_partial else None)
        if aux is not None:
            aux.append(residual.clone())  # residual is updated in place by the norms below
        h = self.self_attn(positions, h, batch, attn, partial=self.attn_partial)
        reduce = self.comm if self.attn_partial else None
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual, reduce)
        return (self.mlp(h, partial=True) if self.mlp_partial else self.mlp(h)), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, comm: Communicator, rope: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, comm)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp, comm, rope) for i in range(cfg.num_layers))
        if cfg.local_rope_theta is not None:
            raise ValueError(f"{cfg.architecture}: a rope per layer kind is built by its own model (gemma3.py)")
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # EAGLE-3 drafting reads the residual stream entering these layers (len(layers): the
        # stream after the last one), concatenated in this order into aux_hidden [T, n * hidden]
        # by every forward. None (the default): nothing is captured and nothing is copied.
        self.aux_layers: tuple[int, ...] | None = None
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        residual, x_partial = None, False
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            want = self.aux_layers is not None and i in self.aux_layers
            x, residual = layer(batch.positions, x, residual, batch, attn, x_partial, aux if want else None)
            x_partial = layer.mlp_partial
        comm = self.layers[-1].comm if x_partial else None
        out, residual = self.norm.forward_with_residual(x, residual, comm)
        if self.aux_layers is not None:
            if len(self.layers) in self.aux_layers:
                aux.append(residual)
            self.aux_hidden = torch.cat(aux, dim=-1)
        return out


# HF tensor name part -> (our fused module name, part index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Per-tensor KV-cache scales of FP8 checkpoints (self_attn.k_scale / v_scale; older: kv_scale).
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.|attn\.)?(k_scale|v_scale|kv_scale)$")
# Routed experts: one tensor per expert and projection, or (transformers 5's in-memory form)
# all experts stacked per projection. Names as canonical_name() gives them.
_EXPERT = re.compile(
    r"^(.+\.mlp\.experts)\.(?:(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)|(gate_up_proj|down_proj)(_bias|_blocks|_scales)?)$"
)
_MIXTRAL_EXPERT = re.compile(r"^(.+\.mlp\.experts\.\d+)\.(w1|w2|w3)\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def canonical_name(name: str) -> str:
    """Mixtral's block_sparse_moe.experts.N.w1/w3/w2 -> mlp.experts.N.gate/up/down_proj."""
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")  # GPT-OSS's router
    m = _MIXTRAL_EXPERT.match(name)
    return f"{m[1]}.{_MIXTRAL_PROJ[m[2]]}.weight" if m else name


def _expert_names(experts: str, num_experts: int, projs: tuple[str, ...], kinds=("weight",)) -> list[str]:
    return [f"{experts}.{e}.{p}.{k}" for e in range(num_experts) for p in projs for k in kinds]


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, comm: Communicator, max_positions: int, device: torch.device):
        super().__init__()
        self.cfg = cfg
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device)
        self.model = LlamaModel(cfg, tp, comm, rope)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, cfg.tie_word_embeddings)
        self._rope = rope
        # FP8 checkpoints' KV-cache scales by (layer, "k_scale" | "v_scale"); 1.0 where absent.
        self.kv_scales: dict[tuple[int, str], float] = {}
        # False for an embedding model (its steps pool hidden states, never compute logits): an
        # untied LM head is then neither expected nor loaded (a base model's checkpoint has none).
        self.needs_lm_head = True

    def forward(
        self, batch: ForwardBatch, attn: AttentionBackend, all_positions: bool = False,
        logits_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 logits of each request's last new token [B, vocab] (every token: [T, vocab];
        `batch.logit_rows` when set: [B + E, vocab]), written into `logits_out` when given (CUDA
        graphs: one buffer shared by every size)."""
        h = self.model(batch, attn)
        if not all_positions:
            h = h[batch.sample_rows if batch.logit_rows is None else batch.logit_rows]
        logits = self.lm_head(h)
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if logits_out is None:
            return logits.float()
        return logits_out.copy_(logits)

    def expected_tensors(self) -> set[str]:
        """Checkpoint tensor names this model needs (unsharded HF names)."""
        names = set()
        inverse = {(fused, part): src for src, (fused, part) in _FUSED.items()}
        for pname, _ in self.named_parameters():
            if pname.startswith("lm_head.embedding.") or (pname.startswith("lm_head.") and not self.needs_lm_head):
                continue
            if pname.endswith(".weight_scale") and getattr(self.cfg.quantization, "online", False):  # computed on load
                continue
            mod, _, kind = pname.rpartition(".")
            head, _, last = mod.rpartition(".")
            if last == "experts" and kind in ("b13", "b2"):  # GPT-OSS's expert biases
                names.add(f"{mod}.{'gate_up_proj_bias' if kind == 'b13' else 'down_proj_bias'}")
                continue
            if last == "experts":  # the stacked w13 / w2 of a MoE block (4-bit: and their scales, zeros)
                if kind in ("w13", "w2"):
                    projs = ("gate_proj", "up_proj") if kind == "w13" else ("down_proj",)
                    experts = self.get_submodule(mod)
                    kinds = experts.checkpoint_kinds or ("weight",)
                    names.update(_expert_names(mod, experts.num_experts, projs, kinds))
                continue
            ckpt = getattr(self.get_submodule(mod), "checkpoint_kinds", None)
            if ckpt is not None:  # a 4-bit layer: its parameters are repacked from these tensors
                if kind not in ("weight", "bias"):
                    continue
                kinds = ckpt if kind == "weight" else ("bias",)
            else:
                kinds = (kind,)
            parts = 3 if last == "qkv_proj" else 2 if last == "gate_up_proj" else 0
            if parts:
                names.update(f"{head}.{inverse[(last, p)]}.{k}" for p in range(parts) for k in kinds)
            else:
                names.update(f"{mod}.{k}" for k in kinds)
        return names

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Streams (HF name, full tensor) pairs into this rank's shards. Every expected tensor
        must come exactly once; an unknown tensor or a wrong shape is an error naming it."""
        modules = dict(self.named_modules())
        expected = self.expected_tensors()
        seen: set[str] = set()
        quant = self.cfg.quantization
        for hf_name, tensor in tensors:
            if not hf_name.startswith(("model.", "lm_head.")):  # a base model's checkpoint (Qwen3Model)
                hf_name = "model." + hf_name
            if hf_name.endswith(_IGNORED_SUFFIXES) or (
                hf_name == "lm_head.weight" and (self.cfg.tie_word_embeddings or not self.needs_lm_head)
            ):
                continue
            if quant is not None and self._fp8_extra(hf_name, tensor):
                continue
            name = canonical_name(hf_name)
            if quant is not None and quant.scale_name and name.endswith(f".{quant.scale_name}"):  # our name
                name = name.removesuffix(f".{quant.scale_name}") + ".weight_scale"
            if tensor.dtype == FP8 and (_EXPERT.match(name) or ".experts." in name):
                raise ValueError(f"tensor {hf_name}: FP8 MoE experts are not supported (only dense linear layers)")
            expert = _EXPERT.match(name)
            covers = [name]
            if expert and expert[6] == "_bias":  # a stacked bias (GPT-OSS) stands for itself
                pass
            elif expert and expert[5]:  # stacked: stands for every expert's tensors of its projections
                projs = ("gate_proj", "up_proj") if expert[5] == "gate_up_proj" else ("down_proj",)
                kinds = (expert[6][1:],) if expert[6] else ("weight",)  # GPT-OSS MXFP4: blocks, scales
                covers = _expert_names(expert[1], getattr(modules.get(expert[1]), "num_experts", 0), projs, kinds)
            if not covers or any(c not in expected for c in covers):
                raise ValueError(f"unexpected tensor {hf_name} in the checkpoint")
            owner = name.rpartition(".")[0].rpartition(".")[2]
            if tensor.dtype == FP8 and owner not in (*_FUSED, "o_proj", "down_proj"):
                raise ValueError(f"tensor {hf_name} is FP8, but minisgl loads this module in 16 bits only")
            if any(c in seen for c in covers):
                raise ValueError(f"tensor {hf_name} appears twice in the checkpoint")
            seen.update(covers)
            if expert and expert[5]:
                modules[expert[1]].load_stacked(hf_name, expert[5] + (expert[6] or ""), tensor)
                continue
            if name.endswith(".self_attn.sinks"):
                modules[name.removesuffix(".sinks")].load_sinks(hf_name, tensor)
                continue
            if expert:
                modules[expert[1]].load_expert(hf_name, int(expert[2]), expert[3], tensor, expert[4])
                continue
            mod_name, _, kind = name.rpartition(".")
            head, _, last = mod_name.rpartition(".")
            if last in _FUSED:
                fused, part = _FUSED[last]
                modules[f"{head}.{fused}"].load_part(name, kind, tensor, part)
            elif last in ("o_proj", "down_proj"):
                modules[mod_name].load(name, kind, tensor)
            elif mod_name in ("model.embed_tokens", "lm_head"):
                modules[mod_name].load(name, tensor)
            else:
                param = getattr(modules[mod_name], kind)
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                param.data.copy_(tensor)
        missing = sorted(expected - seen)
        if missing and quant is not None and quant.scale_name:  # name scales as the checkpoint does
            missing = [m.removesuffix(".weight_scale") + f".{quant.scale_name}" if m.endswith(".weight_scale") else m
                       for m in missing]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"tensor {missing[0]} is missing from the checkpoint{more}")

    def _fp8_extra(self, name: str, tensor: torch.Tensor) -> bool:
        """Consumes an FP8 checkpoint's tensors that are not weights: KV-cache scales (kept in
        kv_scales) and static activation scales (we quantize activations per token instead)."""
        m = _KV_SCALE.match(name)
        if m:
            value = float(tensor.float().reshape(-1).max())
            kinds = ("k_scale", "v_scale") if m[2] == "kv_scale" else (m[2],)
            for kind in kinds:
                self.kv_scales[(int(m[1]), kind)] = value
            return True
        if name.endswith(".input_scale"):
            log_once("fp8:input_scale", "FP8 checkpoint: static input_scale tensors are not used; activations are "
                     "quantized per token on the GPU (weight-only dequantization on the CPU)")
            return True
        return False
