"""The one place that picks an implementation per op: minisgl._C (CUDA), Triton, or the
torch reference. Each wrapper checks its arguments (ValueError naming the argument) first."""

from minisgl.ops.activation import gelu_tanh_and_mul, silu_and_mul
from minisgl.ops.attention import (
    decode_attention_triton,
    deterministic_decode_workspace_bytes,
    extend_attention,
    extend_block_m,
    extend_tile_capacity,
    extend_tile_map,
)
from minisgl.ops.decode_attention import paged_decode_attention, paged_decode_attention_reference
from minisgl.ops.deterministic import is_deterministic, logsumexp_rows, set_deterministic
from minisgl.ops.embedding import embedding_lookup, embedding_lookup_reference
from minisgl.ops.gemm import linear, skinny_gemm, skinny_gemm_reference
from minisgl.ops.linear_attention import (
    SequencePlan,
    causal_conv1d_decode,
    causal_conv1d_prefill,
    gated_delta_gates,
    gated_delta_norm,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
    plan_sequences,
)
from minisgl.ops.logprobs import top_logprobs
from minisgl.ops.moe import fused_experts, fused_moe, moe_align, moe_route
from minisgl.ops.moe_layer import fused_moe_layer
from minisgl.ops.norm import fused_add_rmsnorm, rmsnorm
from minisgl.ops.penalties import apply_penalties
from minisgl.ops.rope import apply_rope, apply_rope_and_store, qk_norm_rope
from minisgl.ops.sampling import greedy, sample
from minisgl.ops.spec_accept import spec_accept
from minisgl.ops.store import store_kv, store_kv_reference
from minisgl.ops.token_bitmask import apply_token_bitmask

__all__ = [
    "SequencePlan",
    "apply_penalties",
    "apply_token_bitmask",
    "apply_rope",
    "apply_rope_and_store",
    "causal_conv1d_decode",
    "causal_conv1d_prefill",
    "decode_attention_triton",
    "deterministic_decode_workspace_bytes",
    "embedding_lookup",
    "embedding_lookup_reference",
    "extend_attention",
    "extend_block_m",
    "extend_tile_capacity",
    "extend_tile_map",
    "fused_add_rmsnorm",
    "fused_experts",
    "fused_moe",
    "fused_moe_layer",
    "gated_delta_gates",
    "gated_delta_norm",
    "gated_delta_rule_decode",
    "gated_delta_rule_prefill",
    "gelu_tanh_and_mul",
    "is_deterministic",
    "linear",
    "logsumexp_rows",
    "moe_align",
    "moe_route",
    "paged_decode_attention",
    "plan_sequences",
    "paged_decode_attention_reference",
    "qk_norm_rope",
    "rmsnorm",
    "greedy",
    "sample",
    "set_deterministic",
    "silu_and_mul",
    "skinny_gemm",
    "skinny_gemm_reference",
    "spec_accept",
    "store_kv",
    "store_kv_reference",
    "top_logprobs",
]
