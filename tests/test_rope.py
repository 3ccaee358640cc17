"""RoPE (neox style, in place): the Triton kernel against its fp32 reference, llama3-scaled
tables from the model layer against transformers, and the op's checks."""

from __future__ import annotations

import pytest
import torch

from minisgl import env, ops
from minisgl.kernels import rope as K

# Triton kernels: on the CPU they run under TRITON_INTERPRET=1 (a separate pytest pass).
pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inv_freq(rot: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))


def _fused_qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """q, k as row-strided views of one [t, (hq + 2 hkv) d] projection output."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(DEV, dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    return qkv, q, k


def _check(
    dtype: torch.dtype, t: int, hq: int, hkv: int, d: int, rot: int, seed: int, norm: bool = False, wdtype=None
) -> None:
    """ops.apply_rope (or, with `norm`, the fused ops.qk_norm_rope) against the torch reference
    on strided views of one qkv output; v must stay untouched."""
    gen = torch.Generator().manual_seed(seed)
    max_pos = 4096
    cache = K.build_cos_sin_cache(_inv_freq(rot), max_pos).to(DEV)
    qkv, q, k = _fused_qkv(t, hq, hkv, d, dtype, gen)
    if norm:
        qkv.mul_(3.0)  # norms that are not 1, so a missing normalization shows
    positions = torch.randint(0, max_pos, (t,), generator=gen).to(DEV)
    ref_qkv = qkv.clone()
    rq, rk = ref_qkv[:, : hq * d].view(t, hq, d), ref_qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    eps = torch.finfo(dtype).eps
    if norm:
        wq = (1 + 0.5 * torch.randn(d, generator=gen)).to(DEV, wdtype or dtype)
        wk = (1 + 0.5 * torch.randn(d, generator=gen)).to(DEV, wdtype or dtype)
        K.qk_norm_rope_reference(rq, rk, positions, cache, wq, wk, 1e-6)
        ops.qk_norm_rope(q, k, positions, cache, wq, wk, 1e-6)
        # The norm's fp32 sum runs in another order: its rounding to the dtype may move one
        # step, and the rotation carries that step on.
        atol = 4 * eps
    else:
        K.apply_rope_reference(rq, rk, positions, cache)
        ops.apply_rope(q, k, positions, cache)
        atol = 2 * eps  # fp32 math in both; FMA contraction may move one step of the dtype
    torch.testing.assert_close(qkv.float(), ref_qkv.float(), rtol=2 * eps, atol=atol)
    v0 = (hq + hkv) * d
    assert torch.equal(qkv[:, v0:], ref_qkv[:, v0:]), "v must be untouched"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 2, 64), (7, 3, 1, 128), (19, 8, 8, 32), (5, 6, 2, 256)])
def test_rope_matches_reference(dtype: torch.dtype, t: int, hq: int, hkv: int, d: int) -> None:
    _check(dtype, t, hq, hkv, d, d, seed=t + hq + d)


@needs_triton
def test_partial_rotary_leaves_the_tail() -> None:
    _check(torch.float16, 11, 4, 2, 64, 32, seed=5)


@needs_triton
def test_llama3_scaled_table_matches_transformers() -> None:
    """Model layer's llama3 table + our kernel == transformers' Llama rotary at long positions."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from minisgl.core.model_config import RopeScaling
    from minisgl.layers import rotary

    d, theta, max_pos = 64, 500000.0, 32768
    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    layer = rotary.RotaryEmbedding(d, max_pos, theta, scaling, torch.device(DEV))
    cfg = LlamaConfig(
        hidden_size=4 * d, num_attention_heads=4, num_key_value_heads=2, rope_theta=theta,
        max_position_embeddings=max_pos,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                      "rope_theta": theta},
    )
    hf = LlamaRotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(1)
    t = 9
    positions = torch.tensor([0, 1, 7, 100, 2047, 8191, 8192, 20000, 32767])
    q = torch.randn(t, 4, d, generator=gen)
    k = torch.randn(t, 2, d, generator=gen)
    cos, sin = hf(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    qq, kk = q.to(DEV).clone(), k.to(DEV).clone()
    ops.apply_rope(qq, kk, positions.to(DEV), layer.cos_sin_cache)
    torch.testing.assert_close(qq.cpu(), want_q[0].transpose(0, 1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kk.cpu(), want_k[0].transpose(0, 1), rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 2, 64), (7, 3, 1, 128), (19, 8, 8, 32)])
def test_qk_norm_rope_matches_reference(dtype: torch.dtype, t: int, hq: int, hkv: int, d: int) -> None:
    _check(dtype, t, hq, hkv, d, d, seed=3 * t + hq + d, norm=True)


@needs_triton
def test_qk_norm_rope_fp32_weights() -> None:
    _check(torch.bfloat16, 5, 4, 2, 64, 64, seed=11, norm=True, wdtype=torch.float32)


def test_qk_norm_reference_is_rmsnorm_then_rope() -> None:
    """The reference against independent fp64 math (HF Qwen3: weight * normed, then rotate)."""
    gen = torch.Generator().manual_seed(2)
    t, hq, hkv, d = 6, 4, 2, 32
    cache = K.build_cos_sin_cache(_inv_freq(d), 64)
    q, k = torch.randn(t, hq, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    wq, wk = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    pos = torch.randint(0, 64, (t,), generator=gen)
    want = []
    for x, w in ((q, wq), (k, wk)):
        x64 = x.double()
        n = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        cos, sin = cache[pos].double()[:, None, : d // 2], cache[pos].double()[:, None, d // 2 :]
        a, b = n[..., : d // 2], n[..., d // 2 :]
        want.append(torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1))
    K.qk_norm_rope_reference(q, k, pos, cache, wq, wk, 1e-6)
    torch.testing.assert_close(q.double(), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.double(), want[1], rtol=1e-5, atol=1e-5)


def test_qk_norm_rope_bad_arguments() -> None:
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    cache = K.build_cos_sin_cache(_inv_freq(8), 16)
    pos, w = torch.arange(3), torch.ones(8)
    with pytest.raises(ValueError, match="k_weight"):
        ops.qk_norm_rope(q, k, pos, cache, w, torch.ones(6), 1e-6)
    with pytest.raises(ValueError, match="q_weight"):
        ops.qk_norm_rope(q, k, pos, cache, w.double(), w, 1e-6)
    with pytest.raises(ValueError, match="full rotary"):
        ops.qk_norm_rope(q, k, pos, K.build_cos_sin_cache(_inv_freq(4), 16), w, w, 1e-6)


def test_bad_arguments_name_the_argument() -> None:
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    cache = K.build_cos_sin_cache(_inv_freq(8), 16)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="positions"):
        ops.apply_rope(q, k, pos.int(), cache)
    with pytest.raises(ValueError, match="positions must be contiguous"):
        ops.apply_rope(q, k, torch.arange(6)[::2], cache)
    with pytest.raises(ValueError, match="k"):
        ops.apply_rope(q, torch.randn(3, 2, 6), pos, cache)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        ops.apply_rope(q, k, pos, cache.double())
    with pytest.raises(ValueError, match="cos_sin_cache width"):
        ops.apply_rope(q, k, pos, K.build_cos_sin_cache(_inv_freq(16), 16))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_bf16_real_sizes(d: int) -> None:
    _check(torch.bfloat16, 8192, 32, 8, d, d, seed=d)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_qk_norm_rope_bf16_real_sizes(d: int) -> None:
    _check(torch.bfloat16, 4096, 32, 8, d, d, seed=d, norm=True)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 64, 8, 64), (5, 4, 1, 16), (9, 6, 2, 128)])
def test_rope_and_store_in_one_kernel(dtype: torch.dtype, t: int, hq: int, hkv: int, d: int) -> None:
    """ops.apply_rope_and_store (one kernel for a 16-bit cache under full rotary; the two ops for
    fp32) against the torch references: q and k rotated in place on strided views of one qkv
    output, the rotated k and v in the cache rows of `slots`, every other cache row NaN as before."""
    gen = torch.Generator().manual_seed(t * 31 + d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(DEV, dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    positions = torch.randint(0, 2048, (t,), generator=gen).to(DEV)
    cache = K.build_cos_sin_cache(_inv_freq(d), 2048).to(DEV)
    want_q, want_k = q.clone(), k.clone()
    K.apply_rope_reference(want_q, want_k, positions, cache)
    want_v = v.clone()
    slots = torch.randperm(40, generator=gen)[:t].to(DEV, torch.int32)
    k_cache = torch.full((40, hkv, d), float("nan"), dtype=dtype, device=DEV)
    v_cache = torch.full((40, hkv, d), float("nan"), dtype=dtype, device=DEV)
    ops.apply_rope_and_store(q, k, v, positions, cache, k_cache, v_cache, slots)
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    assert torch.equal(v, want_v)
    rows = slots.long()
    assert torch.equal(k_cache[rows], k) and torch.equal(v_cache[rows], v), "the cache holds other than k and v"
    others = torch.ones(40, dtype=torch.bool, device=DEV)
    others[rows] = False
    assert k_cache[others].isnan().all() and v_cache[others].isnan().all(), "a row outside `slots` was written"
