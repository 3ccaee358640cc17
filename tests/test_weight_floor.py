"""benchmarks/weight_floor.py: the bytes a batch-1 decode step must move, on tiny models (CPU):
KV of the full-attention layers only (a hybrid model's linear layers keep none), and a hybrid
model's recurrent state read and written once."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import weight_floor  # noqa: E402

from minisgl import LLM  # noqa: E402
from minisgl.kvcache.pool import KVPool  # noqa: E402


def _per_layer_token(engine) -> int:  # noqa: ANN001 - a minisgl Engine
    pool = engine.pool
    return KVPool.bytes_per_token_for(1, pool.kv_heads, pool.head_dim, pool.dtype)


def test_decode_floor_bytes_of_a_hybrid_and_a_dense_model(tiny_model_path) -> None:
    hybrid = LLM(str(tiny_model_path("qwen3_next")), device="cpu", dtype="float32").engine
    mc, ctx = hybrid.model_config, 100
    assert mc.num_kv_layers == 2 and mc.num_layers == 8
    assert weight_floor.decode_kv_bytes(hybrid, ctx) == 2 * ctx * _per_layer_token(hybrid)
    pool = hybrid.state_pool
    la = mc.linear_attn
    per_layer = (la.conv_kernel - 1) * la.conv_dim * 4 + la.num_v_heads * la.k_head_dim * la.v_head_dim * 4
    assert pool.bytes_per_slot == la.num_linear_layers * per_layer
    assert weight_floor.decode_state_bytes(hybrid) == 2 * pool.bytes_per_slot
    dense = LLM(str(tiny_model_path("llama3")), device="cpu", dtype="float32").engine
    assert weight_floor.decode_state_bytes(dense) == 0.0
    assert weight_floor.decode_kv_bytes(dense, ctx) == dense.model_config.num_layers * ctx * _per_layer_token(dense)
