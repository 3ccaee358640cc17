"""Hybrid linear-attention models (issue 34): Qwen3-Next (`Qwen3NextForCausalLM`) and the text
models of Qwen3.5 (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the language model of
their `...ForConditionalGeneration` checkpoints). One block shape for all of them:

    x -> (1+w)-RMSNorm -> Gated DeltaNet (3 of 4 layers) | gated full attention -> + residual
      -> (1+w)-RMSNorm -> dense MLP (Qwen3.5) | MoE with a sigmoid-gated shared expert -> + residual

Gated DeltaNet (the maths: transformers' qwen3_next / qwen3_5 modeling): project q|k|v (and z,
b, a), a causal depthwise conv with SiLU over q|k|v (state: the last K-1 inputs), the gated
delta rule over per-v-head fp32 states with l2-normed q and k, beta = sigmoid(b), log decay
g = -exp(A_log) * softplus(a + dt_bias), then an RMSNorm per head gated by silu(z) (its weight
plain, not 1 + w), out_proj. The states live in the engine's StatePool (kvcache/state_pool.py),
one slot per request, read through `batch.state_slots`; a sequence continues its slot's state
when its prefix is not empty (chunked prefill, decodes) and starts from zeros otherwise.

Gated attention: q_proj gives per head [q | gate] (loaded as 2 x num_heads "q heads" of the
fused qkv_proj, so a TP shard keeps each head's pair), q/k (1+w)-RMSNorm, rotary over the first
partial_rotary_factor of each head, attention through the backend on the KV pool (which holds
only these layers: each uses its index among them), output * sigmoid(gate), o_proj.

The (1 + w) norms are folded into their weights on load, so the common norm kernels run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minisgl import ops
from minisgl.attention.base import AttentionBackend
from minisgl.core.batch import ForwardBatch
from minisgl.core.model_config import ModelConfig
from minisgl.core.quant_config import QuantConfig
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.kvcache.state_pool import StatePool
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.fp8_load import experts_quant, layer_quant
from minisgl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minisgl.layers.moe import SparseMoeBlock
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.logging_setup import log_once
from minisgl.models.llama import LlamaForCausalLM, LlamaMLP

_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
MTP_PREFIXES = ("mtp.", "model.mtp.")
_SKIPPED = ("model.visual.", "visual.", *MTP_PREFIXES)  # the vision tower; the MTP head (a drafter's: qwen3_next_mtp)
_LINEAR_ATTN = re.compile(r"(?:model\.)?layers\.(\d+)\.linear_attn\.(.+)$")  # a base model's names lack model.
# The Gated DeltaNet layer's checkpoint tensors (names after `linear_attn.`): Qwen3-Next's fused
# projections, Qwen3.5's split ones, all 16-bit (GatedDeltaNet.local).
_GDN_TENSORS = ("in_proj_qkvz.weight", "in_proj_ba.weight", "in_proj_qkv.weight", "in_proj_z.weight",
                "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
                "out_proj.weight")
_ONE_PLUS_W = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
               "self_attn.k_norm.weight")


class GatedDeltaNet(nn.Module):
    """TP shards whole k-heads, each with its v-heads: every tensor below holds this rank's
    heads (`self.la` is its share of the config; `local` slices a checkpoint tensor to it), the
    state pool holds them, and out_proj reduces over the ranks."""

    def __init__(self, cfg: ModelConfig, index: int, tp: TPInfo, comm: Communicator):
        super().__init__()
        full = cfg.linear_attn
        la = full.shard(tp.size)
        self.index = index  # this layer's plane in the state pool
        self.full, self.la, self.eps, self.tp = full, la, cfg.rms_norm_eps, tp
        h = cfg.hidden_size
        if la.fused_qkvz:  # Qwen3-Next: per k-head group [q | k | v.. | z..] and [b.. | a..]
            self.in_proj_qkvz = MergedColumnParallelLinear(h, [full.conv_dim + full.value_dim], False, tp)
            self.in_proj_ba = MergedColumnParallelLinear(h, [2 * full.num_v_heads], False, tp)
        else:
            self.in_proj_qkv = MergedColumnParallelLinear(h, [full.key_dim, full.key_dim, full.value_dim], False, tp)
            self.in_proj_z = MergedColumnParallelLinear(h, [full.value_dim], False, tp)
            self.in_proj_b = MergedColumnParallelLinear(h, [full.num_v_heads], False, tp)
            self.in_proj_a = MergedColumnParallelLinear(h, [full.num_v_heads], False, tp)
        self.conv1d = nn.Module()  # HF's depthwise Conv1d weight [conv_dim, 1, K], no bias
        self.conv1d.weight = nn.Parameter(torch.empty(la.conv_dim, 1, la.conv_kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(la.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(la.num_v_heads), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(la.v_head_dim), requires_grad=False)
        self.out_proj = RowParallelLinear(full.value_dim, h, False, tp, comm)
        self.pool: StatePool | None = None  # bound by the engine (Qwen3NextForCausalLM.bind_state_pool)

    def local(self, name: str, param: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the checkpoint tensor `name` (`param`: its name after `linear_attn.`),
        by the rule of the TP linear layers (TPInfo.shard of each part): every tensor is laid out
        by k-head group (Qwen3-Next's fused projections) or in q | k | v parts of k-, k- and
        v-heads (the conv channels, Qwen3.5's in_proj_qkv), so contiguous shares keep whole heads.
        Any other tensor is refused at every TP size: a 4-bit or FP8 checkpoint's quantized
        projection (its qweight, scales, ...) would otherwise reach the loader as an unknown name."""
        if param not in _GDN_TENSORS:
            raise ValueError(f"tensor {name}: not a Gated DeltaNet tensor minisgl loads ({', '.join(_GDN_TENSORS)}); "
                             "the linear_attn projections load in 16 bits only (4-bit hybrid checkpoints that keep "
                             "them in 16 bits load: their routed experts, shared expert and attention)")
        if self.tp.size == 1 or param == "norm.weight":
            return t
        full = self.full
        sizes = [full.key_dim, full.key_dim, full.value_dim] if param in ("in_proj_qkv.weight", "conv1d.weight") \
            else None
        dim = 1 if param == "out_proj.weight" else 0
        parts = t.split(sizes or [t.shape[dim]], dim)
        return torch.cat([p.narrow(dim, *self.tp.shard(p.shape[dim], f"Gated DeltaNet {param}")) for p in parts], dim)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q|k|v [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv])."""
        la, t = self.la, x.shape[0]
        if not la.fused_qkvz:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, la.num_v_heads, la.v_head_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        r = la.num_v_heads // la.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, la.num_k_heads, -1)
        q, k, v, z = qkvz.split([la.k_head_dim, la.k_head_dim, r * la.v_head_dim, r * la.v_head_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, la.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return (mixed, z.reshape(t, la.num_v_heads, la.v_head_dim), b.reshape(t, la.num_v_heads),
                a.reshape(t, la.num_v_heads))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, plan: ops.SequencePlan | None = None) -> torch.Tensor:
        """`plan`: ops.plan_sequences of the step (None: each op derives it)."""
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        if batch.all_rows:  # a verify step: keep the inputs: the accepted tokens advance the states later (commit)
            saved = self.pool.verify_inputs
            if saved is None or t > saved.shape[1]:
                raise ValueError(f"a verify step of {t} tokens exceeds the verify scratch "
                                 f"({0 if saved is None else saved.shape[1]} tokens)")
            torch.cat([mixed, b, a], dim=-1, out=saved[self.index, :t])
        # A verify runs the delta rule on fp32 operands, as the commit after it and the decode
        # step do: its outputs are the logits plain decoding would give (16-bit operands put a
        # greedy token 5.3% of the logit scale from plain bf16 decoding, tiny Qwen3.5, H100).
        # (a decode continues every state: no has_state, and no comparison kernel in each layer)
        has_state = None if batch.is_decode else batch.prefix_lens > 0
        o = self._recur(mixed, b, a, batch.state_slots, batch.cu_seqlens_q, has_state, batch.is_decode,
                        store=not batch.all_rows, fp32_rule=batch.all_rows, plan=plan)
        # The gated RMSNorm in transformers' order (one kernel: kernels/gated_delta_pointwise.py)
        return self.out_proj(ops.gated_delta_norm(o, z, self.norm.weight, self.eps))

    def _recur(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
               cu_seqlens: torch.Tensor, has_state: torch.Tensor | None, decode: bool, store: bool,
               fp32_rule: bool = False, plan: ops.SequencePlan | None = None) -> torch.Tensor:
        """The conv and the delta rule over the step's sequences (a decode: one token each,
        continuing its state); `store` False reads the states and writes none. `fp32_rule`: the
        chunked delta rule on fp32 operands (ieee dots; 16-bit ones round the state at each
        chunk). o [T, Hv, Dv]."""
        la, t, pool = self.la, mixed.shape[0], self.pool
        conv_w = self.conv1d.weight.view(la.conv_dim, la.conv_kernel)
        conv, states = pool.conv[self.index], pool.state[self.index]
        if decode:
            y = ops.causal_conv1d_decode(mixed, conv_w, None, conv, slots)
        else:  # a mixed step's decodes are one-token sequences that continue their state
            y = ops.causal_conv1d_prefill(mixed, conv_w, None, conv, slots, cu_seqlens, has_state, store_state=store,
                                          plan=plan)
        kd = la.key_dim
        q = y[:, :kd].view(t, la.num_k_heads, la.k_head_dim)
        k = y[:, kd : 2 * kd].view(t, la.num_k_heads, la.k_head_dim)
        v = y[:, 2 * kd :].view(t, la.num_v_heads, la.v_head_dim)
        g, beta = ops.gated_delta_gates(a, b, self.A_log, self.dt_bias)
        if decode:
            return ops.gated_delta_rule_decode(q, k, v, g, beta, states, slots)
        if fp32_rule:
            q, k, v, beta = q.float(), k.float(), v.float(), beta.float()
        return ops.gated_delta_rule_prefill(q, k, v, g, beta, states, slots, cu_seqlens, has_state, store_state=store,
                                            plan=plan)

    def commit(self, order: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
               has_state: torch.Tensor, plan: ops.SequencePlan | None = None) -> None:
        """After a verify step: advance the states over the accepted tokens, whose inputs the
        verify kept; `order` puts them first, packed per request as `cu_seqlens` says (the
        rejected ones after cu_seqlens[-1] are padding to the kernels: nothing read for them).
        The delta rule runs on fp32 operands, as the decode step's recurrence does: with 16-bit
        ones the states of a speculating request drifted from a plain decode's (bf16 on the
        H100: a greedy token 5% of the logit scale apart after 10 steps, tiny Qwen3.5)."""
        la = self.la
        saved = self.pool.verify_inputs[self.index, : order.numel()][order]
        mixed, b, a = saved.split([la.conv_dim, la.num_v_heads, la.num_v_heads], dim=-1)
        self._recur(mixed, b, a, slots, cu_seqlens, has_state, decode=False, store=True, fp32_rule=True, plan=plan)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_index: int, tp: TPInfo, comm: Communicator, rope: RotaryEmbedding,
                 prefix: str = "", quant: QuantConfig | None = None):
        """`prefix`: the layer's HF name (model.layers.i.self_attn), whose projections `quant` may
        quantize (a 4-bit checkpoint's quantization_config and its ignore list)."""
        super().__init__()
        self.kv_index, d = kv_index, cfg.head_dim
        self.head_dim = d
        # q_proj's [q | gate] per head as 2 x num_heads heads of head_dim.
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, 2 * cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp,
                                          quant=layer_quant(quant, [f"{prefix}.{m}" for m in ("q_proj", "k_proj",
                                                                                              "v_proj")]))
        self.num_heads = self.qkv_proj.local_q_heads // 2
        self.num_kv_heads = self.qkv_proj.local_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.qkv_bias, tp, comm,
                                        quant=layer_quant(quant, [f"{prefix}.o_proj"]))
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rope = rope

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                attn: AttentionBackend) -> torch.Tensor:
        t, d, nh, nkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        qg = qkv[:, : 2 * nh * d].view(t, nh, 2 * d)
        q = self.q_norm(qg[..., :d].reshape(t * nh, d)).view(t, nh, d)
        k = self.k_norm(qkv[:, 2 * nh * d : (2 * nh + nkv) * d].reshape(t * nkv, d)).view(t, nkv, d)
        v = qkv[:, (2 * nh + nkv) * d :].view(t, nkv, d)
        self.rope(positions, q, k)
        o = attn.forward(q, k, v, self.kv_index, batch).reshape(t, nh * d)
        return self.o_proj(o * torch.sigmoid(qg[..., d:].reshape(t, nh * d)))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, index: int, tp: TPInfo, comm: Communicator,
                 rope: RotaryEmbedding, full: bool = False):
        """`full`: gated full attention whatever the config says of layer_id (the MTP head's layer).
        A 4-bit checkpoint (cfg.quantization) quantizes the routed experts, the shared expert, the
        full attention's and the dense MLP's projections unless its ignore list names them; the
        Gated DeltaNet projections, the router and the shared expert's gate load in 16 bits (a
        quantized Gated DeltaNet tensor is refused by name: GatedDeltaNet.local)."""
        super().__init__()
        p, quant = f"model.layers.{layer_id}", cfg.quantization
        if cfg.is_linear_layer(layer_id) and not full:
            self.linear_attn = GatedDeltaNet(cfg, index, tp, comm)
        else:
            self.self_attn = GatedAttention(cfg, index, tp, comm, rope, f"{p}.self_attn", quant)
        if cfg.is_sparse_layer(layer_id):
            shared = [f"{p}.mlp.shared_expert.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
            self.mlp = SparseMoeBlock(cfg, tp, comm, experts_quant(quant, f"{p}.mlp.experts"),
                                      layer_quant(quant, shared))
        else:
            self.mlp = LlamaMLP(cfg, tp, comm, f"{p}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_partial = False  # each block reduces its own output under TP (no fused reduce + norm yet)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                attn: AttentionBackend, plan: ops.SequencePlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual)
        if hasattr(self, "linear_attn"):
            h = self.linear_attn(h, batch, plan)
        else:
            h = self.self_attn(positions, h, batch, attn)
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        return self.mlp(h), residual


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, comm: Communicator, rope: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, comm)
        counts = [0, 0]  # (full, linear) layers so far: each kind's index in its own pool
        layers = []
        for i in range(cfg.num_layers):
            kind = int(cfg.is_linear_layer(i))
            layers.append(HybridDecoderLayer(cfg, i, counts[kind], tp, comm, rope))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # No EAGLE-3 heads for these models; () when an MTP head drafts: it reads the final
        # normed hidden state of every token (aux_hidden [T, H]).
        self.aux_layers: tuple[int, ...] | None = None
        self.aux_hidden = None

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        residual = None
        # once per step, not in each Gated DeltaNet layer: the sequences' token map and chunk table
        plan = None if batch.is_decode else ops.plan_sequences(batch.cu_seqlens_q, x.shape[0])
        for layer in self.layers:
            x, residual = layer(batch.positions, x, residual, batch, attn, plan)
        out, _ = self.norm.forward_with_residual(x, residual)
        if self.aux_layers is not None:
            self.aux_hidden = out
        return out


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Loads as the Llama model does (fused q/k/v and gate/up, stacked or per-expert experts,
    the same checks), after the renames and the 1 + w folding of `_text_tensors`."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, comm: Communicator, max_positions: int, device: torch.device):
        nn.Module.__init__(self)
        self.cfg = cfg
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self._rope = RotaryEmbedding(rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device)
        self.model = HybridModel(cfg, tp, comm, self._rope)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, cfg.tie_word_embeddings)
        self.kv_scales: dict[tuple[int, str], float] = {}
        self.needs_lm_head = True

    @property
    def verify_width(self) -> int:
        """Values a verify step keeps per token and Gated DeltaNet layer (StatePool.reserve_verify)."""
        la = next(x.linear_attn.la for x in self.model.layers if hasattr(x, "linear_attn"))  # this rank's share
        return la.conv_dim + 2 * la.num_v_heads

    @torch.inference_mode()
    def commit_verify(self, batch: ForwardBatch, num_accepted: torch.Tensor) -> None:
        """After a verify step's acceptance (on the device, no host values): each request's
        first num_accepted + 1 tokens (its last token and accepted drafts) advance its states."""
        cu, t = batch.cu_seqlens_q, batch.num_tokens
        lens = num_accepted.to(torch.int32) + 1
        tok = torch.arange(t, device=cu.device, dtype=cu.dtype)
        seq = torch.searchsorted(cu[1:], tok, right=True).clamp(max=lens.numel() - 1)
        keep = (tok - cu[seq]) < lens[seq]
        order = torch.argsort((~keep).to(torch.int8), stable=True)
        new_cu = torch.zeros_like(cu)
        torch.cumsum(lens, 0, out=new_cu[1:])
        has_state = batch.prefix_lens > 0
        plan = ops.plan_sequences(new_cu, t)
        for layer in self.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.commit(order, new_cu, batch.state_slots, has_state, plan)

    def bind_state_pool(self, pool: StatePool) -> None:
        for layer in self.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.pool = pool

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._local(self._text_tensors(tensors)))

    def _local(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The Gated DeltaNet tensors sliced to this rank's heads (the Llama loader copies them
        as they come; its own sharded layers slice theirs)."""
        layers = self.model.layers
        for name, tensor in tensors:
            m = _LINEAR_ATTN.match(name)
            if m and int(m[1]) < len(layers) and hasattr(layers[int(m[1])], "linear_attn"):
                tensor = layers[int(m[1])].linear_attn.local(name, m[2], tensor)
            yield name, tensor

    @staticmethod
    def _text_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if name.startswith(_SKIPPED):
                log_once("qwen3_next:skipped", "hybrid checkpoint: serving its text model; the vision tower is not "
                         "loaded, nor the MTP head but by --speculative-algorithm mtp")
                continue
            for old, new in _TEXT_PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if name.endswith(_ONE_PLUS_W) or name == "model.norm.weight":
                tensor = tensor.float() + 1.0  # zero-centred norms scale by 1 + w
            yield name, tensor
