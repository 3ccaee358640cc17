"""Paged attention ops in Triton (extend/prefill and split-K decode), torch reference fallback.

Both read K/V only through the request table: slot = req_to_slot[req_rows[b], position].
"""

from __future__ import annotations

import torch

from minisgl.kernels import decode_attention as _dec
from minisgl.kernels import deterministic_attention as _det
from minisgl.kernels import extend_attention as _ext
from minisgl.ops import _checks
from minisgl.ops._backend import log_cpu_reference_once, use_triton
from minisgl.ops._checks import (
    check_contiguous,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    check_tensor,
    check_window_sinks,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = torch.float8_e4m3fn


def _check_cache(q: torch.Tensor, k_cache: object, v_cache: object, req_to_slot: object) -> None:
    """The cache is q's dtype, or FP8 e4m3 (K / k_scale, V / v_scale) for 16/32-bit q."""
    check_tensor("k_cache", k_cache, dtype=(q.dtype, _FP8), ndim=3)
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, ndim=3)
    check_shape("k_cache", k_cache, (None, None, q.shape[2]))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if k_cache.shape[1] == 0 or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k_cache.shape[1]})")
    check_tensor("req_to_slot", req_to_slot, dtype=torch.int32, ndim=2)
    check_inner_contiguous("req_to_slot", req_to_slot)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_inner_contiguous(name, t)


def _check_lens(batch: int, **lens: object) -> None:
    for name, t in lens.items():
        check_tensor(name, t, dtype=torch.int32, ndim=1)
        check_shape(name, t, (batch,))
        check_contiguous(name, t)


def _check_out(out: object, q: torch.Tensor) -> None:
    check_tensor("out", out, dtype=q.dtype, ndim=3)
    check_shape("out", out, tuple(q.shape))
    check_inner_contiguous("out", out)


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slot: torch.Tensor,
    req_rows: torch.Tensor, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor, max_extend_len: int, scale: float, out: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None, deterministic: bool = False, decode_max_seq_len: int | None = None,
    k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] (head dim packed, row/head strides free); k_cache, v_cache [S, Hkv, D]
    holding every position's K/V, the new tokens' included; req_rows, prefix_lens, seq_lens
    int32 [B]; cu_seqlens_q int32 [B+1] (new tokens of request b: rows cu[b]..cu[b+1]-1 of q,
    at positions prefix_lens[b]..seq_lens[b]-1); max_extend_len >= every request's new-token
    count. Causal attention per request; returns [T, Hq, D] in q's dtype (into `out` if given).

    `tiles` (int32 [capacity, 2], from `extend_tile_map` with `extend_block_m(...)`) switches
    to the launch a CUDA graph can hold: grid (Hq, capacity), each program reading its
    (request, first query) on the device; `max_extend_len` is then unused, and rows of q past
    cu_seqlens_q[B] (bucket padding) are left unwritten. Batch-level checks are the caller's.

    `deterministic`: the one fixed launch configuration of deterministic mode, with GQA packing
    and fixed key splits (kernels/deterministic_attention.py); its tiles then come from
    `extend_block_m(..., group, deterministic=True)`. With `decode_max_seq_len` (a decode step:
    one token per request, seq_lens <= that bound) the launch may take the mode's decode tile
    (kernels/deterministic_attention.py DECODE_TILE, the same bits) and the splits run in parallel while their
    workspace fits `SPLIT_DECODE_WORKSPACE_BYTES`; the bits are the same either way. An FP8
    e4m3 cache holds K / k_scale and V / v_scale.
    `window` > 0: each query sees its last `window` keys only (older slots are never read);
    `sinks` fp32 [Hq]: a logit per head in every softmax denominator (GPT-OSS)."""
    if not _checks.enabled():
        return _extend(q, k_cache, v_cache, req_to_slot, req_rows, prefix_lens, seq_lens, cu_seqlens_q,
                       max_extend_len, scale, out, tiles, deterministic, decode_max_seq_len, k_scale, v_scale,
                       window, sinks)
    check_tensor("q", q, dtype=_DTYPES, ndim=3)
    check_window_sinks(q, window, sinks)
    _check_cache(q, k_cache, v_cache, req_to_slot)
    b = req_rows.shape[0] if isinstance(req_rows, torch.Tensor) else -1
    _check_lens(b, req_rows=req_rows, prefix_lens=prefix_lens, seq_lens=seq_lens)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, ndim=1)
    check_shape("cu_seqlens_q", cu_seqlens_q, (b + 1,))
    check_contiguous("cu_seqlens_q", cu_seqlens_q)
    t = q.shape[0]
    if tiles is not None:
        check_tensor("tiles", tiles, dtype=torch.int32, ndim=2)
        check_shape("tiles", tiles, (None, 2))
        check_contiguous("tiles", tiles)
        check_same_device(q=q, tiles=tiles)
    # The kernel's grid covers max_extend_len rows per request: too small leaves rows unwritten.
    elif t and (b < 1 or not -(-t // b) <= max_extend_len <= t):
        raise ValueError(
            f"max_extend_len ({max_extend_len}) must be the longest request's new-token count: "
            f"between ceil(T/B) and T for T={t} tokens in B={b} requests"
        )
    if out is not None:
        _check_out(out, q)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, req_to_slot=req_to_slot,
                      req_rows=req_rows, prefix_lens=prefix_lens, seq_lens=seq_lens,
                      cu_seqlens_q=cu_seqlens_q)
    return _extend(q, k_cache, v_cache, req_to_slot, req_rows, prefix_lens, seq_lens, cu_seqlens_q, max_extend_len,
                   scale, out, tiles, deterministic, decode_max_seq_len, k_scale, v_scale, window, sinks)


def _extend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slot: torch.Tensor,
    req_rows: torch.Tensor, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
    max_extend_len: int, scale: float, out: torch.Tensor | None, tiles: torch.Tensor | None,
    deterministic: bool = False, decode_max_seq_len: int | None = None, k_scale: float = 1.0,
    v_scale: float = 1.0, window: int = 0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if use_triton("extend_attention", q):
        if not deterministic:
            return _ext.extend_attention(q, k_cache, v_cache, req_to_slot, req_rows, prefix_lens,
                                         cu_seqlens_q, max_extend_len, scale, out, tiles=tiles,
                                         k_scale=k_scale, v_scale=v_scale, window=window, sinks=sinks)
        decode_batch = req_rows.shape[0] if decode_max_seq_len is not None else 0
        config, heads, split = _det.deterministic_config(q.shape[2], q.dtype, q.device, q.shape[1] // k_cache.shape[1],
                                                         decode_batch)
        if decode_max_seq_len is not None and tiles is not None and _det.use_split_decode(
                req_rows.shape[0], q.shape[1], q.shape[2], decode_max_seq_len, split):
            return _det.split_decode(q, k_cache, v_cache, req_to_slot, req_rows, prefix_lens, seq_lens, cu_seqlens_q,
                                     tiles, decode_max_seq_len, scale, config, heads, split, out, k_scale, v_scale,
                                     window, sinks)
        return _ext.extend_attention(q, k_cache, v_cache, req_to_slot, req_rows, prefix_lens,
                                     cu_seqlens_q, max_extend_len, scale, out, config=config, tiles=tiles,
                                     heads_per_tile=heads, split=split, k_scale=k_scale, v_scale=v_scale,
                                     window=window, sinks=sinks)
    log_cpu_reference_once("extend_attention")
    if tiles is None:
        ref = _ext.extend_attention_reference(q, k_cache, v_cache, req_to_slot, req_rows, prefix_lens,
                                              cu_seqlens_q, scale * k_scale, window=window, sinks=sinks) * v_scale
        return ref.to(q.dtype) if out is None else out.copy_(ref)
    # As the kernel: only the requests the tiles cover, only their rows (a mixed step's decode
    # rows and the bucket's padding rows are left as they are).
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b in sorted(set(tiles[:, 0].tolist()) - {-1}):
        lo, hi = cu[b], cu[b + 1]
        one = torch.tensor([0, hi - lo], dtype=cu_seqlens_q.dtype, device=q.device)
        out[lo:hi] = _ext.extend_attention_reference(q[lo:hi], k_cache, v_cache, req_to_slot, req_rows[b : b + 1],
                                                     prefix_lens[b : b + 1], one, scale * k_scale, window=window,
                                                     sinks=sinks) * v_scale
    return out


def extend_block_m(head_dim: int, dtype: torch.dtype, device: torch.device, group: int = 1,
                   deterministic: bool = False) -> int:
    """Query tokens per tile of `extend_attention` for these inputs (the `tiles` unit); `group`:
    q heads per KV head (deterministic mode packs a group's heads into a tile's rows)."""
    if not deterministic:
        return _ext.default_config(head_dim, dtype, device)[0]
    config, heads, _ = _det.deterministic_config(head_dim, dtype, device, group)
    return config[0] // heads


def deterministic_decode_workspace_bytes() -> int:
    """The most memory a deterministic-mode decode step's parallel splits take (their fp32
    partials): the engine keeps it out of the KV budget when the mode is on."""
    return _det.SPLIT_DECODE_WORKSPACE_BYTES


extend_tile_map = _ext.tile_map
extend_tile_capacity = _ext.tile_capacity


def decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_slot: torch.Tensor,
    req_rows: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
    out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]: one new token per request (its K/V already stored), attending to
    positions 0..seq_lens[b]-1 (the last `window` of them when > 0; `sinks` fp32 [Hq] join
    the denominators); seq_lens[b] <= max_seq_len (a fixed bound keeps a captured CUDA graph
    valid). Split-K flash decoding; returns [B, Hq, D] in q's dtype."""
    if _checks.enabled():
        check_tensor("q", q, dtype=_DTYPES, ndim=3)
        check_window_sinks(q, window, sinks)
        _check_cache(q, k_cache, v_cache, req_to_slot)
        _check_lens(q.shape[0], req_rows=req_rows, seq_lens=seq_lens)
        if out is not None:
            _check_out(out, q)
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, req_to_slot=req_to_slot,
                          req_rows=req_rows, seq_lens=seq_lens)
    if use_triton("decode_attention_triton", q):
        return _dec.decode_attention(q, k_cache, v_cache, req_to_slot, req_rows, seq_lens,
                                     max_seq_len, scale, out, k_scale=k_scale, v_scale=v_scale, window=window,
                                     sinks=sinks)
    log_cpu_reference_once("decode_attention_triton")
    ref = _dec.decode_attention_reference(q, k_cache, v_cache, req_to_slot, req_rows, seq_lens,
                                          scale * k_scale, window=window, sinks=sinks) * v_scale
    if out is None:
        return ref.to(q.dtype)
    out.copy_(ref)
    return out
