"""Causal depthwise conv1d with a per-request state (the short convolution of Gated DeltaNet
layers), SiLU fused, beside its torch reference.

Layouts (channels packed, so one program reads BLOCK_D consecutive channels per token):
  x            [T, D]        tokens of a batch, sequences packed back to back (row stride free)
  weight       [D, K]        the conv taps; tap K-1 multiplies the current token
  bias         [D] or None
  conv_states  [S, K-1, D]   the pool: slot s holds the last K-1 inputs of its request, oldest
                             first (HF keeps K and never reads the oldest; K-1 is all the maths needs)
  slots        [N] int32     each sequence's slot; a negative slot reads zeros and writes nothing
                             (the padding rows of a CUDA-graph batch)
  has_state    [N] bool      False: the sequence starts fresh (its slot is read as zeros, so a
                             freshly allocated slot needs no zeroing)

Prefill: out[t] = act(bias + sum_j w[:, j] * in[p - (K-1) + j]) where in[] is the slot's state
followed by the sequence's tokens; then each slot gets the last K-1 entries of in[]. Tokens past
cu_seqlens[N] (a CUDA graph's token bucket beyond the step's tokens) belong to no sequence: their
outputs are zeros and nothing is read for them. Decode is the one-token case and reads nothing
from the host (graph-safe). Slots must be distinct.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _conv_prefill_kernel(
    X, W, B, States, Slots, HasState, Cu, SeqIds, Out,
    T, N, D, stride_x, stride_o, stride_ss, stride_sk,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < D
    seq = tl.load(SeqIds + offs_t, mask=offs_t < T, other=N)
    mt = (offs_t < T) & (seq < N)  # a token past cu_seqlens[N] (graph padding): no sequence, zeros out
    start = tl.load(Cu + seq, mask=mt, other=0)
    slot = tl.load(Slots + seq, mask=mt, other=-1).to(tl.int64)
    fresh = tl.load(HasState + seq, mask=mt, other=0) == 0
    pos0 = offs_t - start  # position inside the sequence
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(B + offs_d, mask=md, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        pos = pos0 - (K - 1) + j
        in_x = pos >= 0
        xv = tl.load(X + (offs_t - (K - 1) + j).to(tl.int64)[:, None] * stride_x + offs_d[None, :],
                     mask=(mt & in_x)[:, None] & md[None, :], other=0.0)
        # before the sequence's first token: the slot's saved inputs (none if fresh or padding)
        from_state = mt & (pos < 0) & (slot >= 0) & (~fresh)
        sv = tl.load(States + slot[:, None] * stride_ss + (K - 1 + pos)[:, None] * stride_sk + offs_d[None, :],
                     mask=from_state[:, None] & md[None, :], other=0.0)
        w = tl.load(W + offs_d * K + j, mask=md, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(mt[:, None], acc, 0.0)
    tl.store(Out + offs_t.to(tl.int64)[:, None] * stride_o + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=(offs_t < T)[:, None] & md[None, :])


@triton.jit
def _conv_save_state_kernel(
    X, States, Slots, HasState, Cu, D, stride_x, stride_ss, stride_sk,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < D
    slot = tl.load(Slots + n).to(tl.int64)
    if slot >= 0:
        start = tl.load(Cu + n)
        length = tl.load(Cu + n + 1) - start
        fresh = tl.load(HasState + n) == 0
        i = tl.arange(0, KP)
        pos = length - (K - 1) + i
        mi = i < K - 1
        xv = tl.load(X + (start + pos).to(tl.int64)[:, None] * stride_x + offs_d[None, :],
                     mask=(mi & (pos >= 0))[:, None] & md[None, :], other=0.0)
        sv = tl.load(States + slot * stride_ss + (K - 1 + pos)[:, None] * stride_sk + offs_d[None, :],
                     mask=(mi & (pos < tl.where(fresh, -K, 0)))[:, None] & md[None, :], other=0.0)
        # every load of this slot's rows precedes the store, so reading and writing one slot is safe
        new = tl.where((pos >= 0)[:, None], xv.to(States.dtype.element_ty), sv)
        tl.store(States + slot * stride_ss + i[:, None] * stride_sk + offs_d[None, :], new,
                 mask=mi[:, None] & md[None, :])


@triton.jit
def _conv_decode_kernel(
    X, W, B, States, Slots, Out, D, stride_x, stride_o, stride_ss, stride_sk,
    K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < D
    slot = tl.load(Slots + n).to(tl.int64)
    live = slot >= 0
    x = tl.load(X + n.to(tl.int64) * stride_x + offs_d, mask=md, other=0.0)
    i = tl.arange(0, KP)
    mi = i < K - 1
    # a padding row (negative slot) masks every state element: its row limit drops to 0
    mi_live = i < tl.where(live, K - 1, 0)
    st = tl.load(States + slot * stride_ss + i[:, None] * stride_sk + offs_d[None, :],
                 mask=mi_live[:, None] & md[None, :], other=0.0)
    w_old = tl.load(W + offs_d[None, :] * K + i[:, None], mask=mi[:, None] & md[None, :], other=0.0)
    acc = tl.sum(st.to(tl.float32) * w_old.to(tl.float32), axis=0)
    acc += x.to(tl.float32) * tl.load(W + offs_d * K + (K - 1), mask=md, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(B + offs_d, mask=md, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(Out + n.to(tl.int64) * stride_o + offs_d, acc.to(Out.dtype.element_ty), mask=md)
    # shift the window by one: row i takes row i+1, the last row takes x
    nxt = tl.load(States + slot * stride_ss + (i + 1)[:, None] * stride_sk + offs_d[None, :],
                  mask=(i + 1 < tl.where(live, K - 1, 0))[:, None] & md[None, :], other=0.0)
    new = tl.where((i == K - 2)[:, None], x.to(States.dtype.element_ty)[None, :], nxt)
    tl.store(States + slot * stride_ss + i[:, None] * stride_sk + offs_d[None, :], new,
             mask=mi_live[:, None] & md[None, :])


def _block_d(d: int) -> int:
    return min(256, triton.next_power_of_2(d))


def token_seq_ids(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """The sequence of each of t tokens, int32 [T], on the device (no host sync: capturable)."""
    tok = torch.arange(t, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], tok, right=True).to(torch.int32)


def causal_conv1d_prefill(x, weight, bias, conv_states, slots, cu_seqlens, has_state, silu: bool = True,
                          store_state: bool = True, seq_ids: torch.Tensor | None = None):
    """Triton prefill; arguments as in the module docstring (has_state as int32/bool [N]).
    store_state False: the slots keep their windows (a speculative verify step). `seq_ids`:
    token_seq_ids(cu_seqlens, T) when the caller made it once for several layers."""
    t, d = x.shape
    k = weight.shape[1]
    n = slots.shape[0]
    if t == 0 or n == 0:  # no sequence: every token is padding
        return torch.zeros((t, d), dtype=x.dtype, device=x.device)
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)  # the kernel writes every row
    if seq_ids is None:
        seq_ids = token_seq_ids(cu_seqlens, t)
    has = has_state.to(torch.int32)
    bd, bt = _block_d(d), 16
    b = bias if bias is not None else weight
    _conv_prefill_kernel[(triton.cdiv(t, bt), triton.cdiv(d, bd))](
        x, weight, b, conv_states, slots, has, cu_seqlens, seq_ids, out,
        t, n, d, x.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1),
        K=k, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=bt, BLOCK_D=bd,
    )
    if not store_state:
        return out
    _conv_save_state_kernel[(n, triton.cdiv(d, bd))](
        x, conv_states, slots, has, cu_seqlens, d, x.stride(0), conv_states.stride(0), conv_states.stride(1),
        K=k, KP=max(2, triton.next_power_of_2(k - 1)), BLOCK_D=bd,
    )
    return out


def causal_conv1d_decode(x, weight, bias, conv_states, slots, silu: bool = True):
    """Triton one-token update: x [N, D] -> out [N, D]; each live slot's window shifts in place."""
    n, d = x.shape
    k = weight.shape[1]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    bd = _block_d(d)
    _conv_decode_kernel[(n, triton.cdiv(d, bd))](
        x, weight, bias if bias is not None else weight, conv_states, slots, out,
        d, x.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1),
        K=k, KP=max(2, triton.next_power_of_2(k - 1)), HAS_BIAS=bias is not None, SILU=silu, BLOCK_D=bd,
    )
    return out


def causal_conv1d_reference(x, weight, bias, conv_states, slots, cu_seqlens, has_state, silu: bool = True,
                            store_state: bool = True):
    """fp32 torch reference of the prefill (and, with one token per sequence, of the decode):
    F.conv1d over each sequence's saved inputs followed by its tokens; updates conv_states."""
    k = weight.shape[1]
    out = torch.zeros_like(x)  # tokens past cu_seqlens[-1] (graph padding) stay zero
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        seq = x[cu[i]:cu[i + 1]].float()  # [L, D]
        if slot >= 0 and bool(has_state[i]):
            prev = conv_states[slot].float()
        else:
            prev = torch.zeros(k - 1, x.shape[1], dtype=torch.float32, device=x.device)
        full = torch.cat([prev, seq]).t().unsqueeze(0)  # [1, D, K-1+L]
        if len(seq):  # (an empty sequence: a graph's padding request)
            y = F.conv1d(full, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=x.shape[1])
            y = y[0].t()
            out[cu[i]:cu[i + 1]] = (F.silu(y) if silu else y).to(x.dtype)
        if slot >= 0 and store_state:
            conv_states[slot] = full[0, :, full.shape[2] - (k - 1):].t().to(conv_states.dtype)
    return out
