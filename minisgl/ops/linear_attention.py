"""Linear-attention ops (Gated DeltaNet layers): the causal conv1d with a state pool, the gated
delta rule (chunked prefill, one-token decode) and the pointwise steps around it (the gates, the
gated norm). Triton where it can run, else the torch references (logged once). Layouts and maths:
kernels/causal_conv1d.py, kernels/gated_delta_rule.py (and kernels/gated_delta_prefill.py),
kernels/gated_delta_pointwise.py.

State pools are indexed by `slots` (int32 [N], one per sequence, distinct; negative = a
padding row that reads zeros and writes nothing). `has_state` (bool or int32 [N]) says which
sequences continue from their slot; the others start from zeros without reading it, so a
fresh slot needs no clearing. Sequence bounds are never read on the host by the kernels.
cu_seqlens[-1] <= T: tokens past it are a CUDA graph's padding (its token bucket beyond the
step's tokens), in no sequence: their outputs are zeros and nothing is read or written for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.kernels import causal_conv1d as _conv
from minisgl.kernels import gated_delta_pointwise as _gpw
from minisgl.kernels import gated_delta_prefill as _gdp
from minisgl.kernels import gated_delta_rule as _gdr
from minisgl.kernels.chunk_table import chunk_table
from minisgl.ops import _checks
from minisgl.ops._backend import log_cpu_reference_once, use_triton
from minisgl.ops._checks import check_contiguous, check_inner_contiguous, check_same_device, check_shape, check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # a head's [Dk, 64] state tile and [64, Dk] chunk tiles live in registers


def _check_seqs(n: int, slots, cu_seqlens, has_state) -> None:
    check_tensor("slots", slots, dtype=torch.int32, ndim=1)
    check_shape("slots", slots, (n,) if n >= 0 else (None,))
    check_contiguous("slots", slots)
    n = slots.shape[0]
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtype=torch.int32, ndim=1)
        check_shape("cu_seqlens", cu_seqlens, (n + 1,))
        check_contiguous("cu_seqlens", cu_seqlens)
    if has_state is not None:
        check_tensor("has_state", has_state, dtype=(torch.bool, torch.int32), ndim=1)
        check_shape("has_state", has_state, (n,))
        check_contiguous("has_state", has_state)


def _check_conv(x, weight, bias, conv_states) -> None:
    check_tensor("x", x, dtype=_DTYPES, ndim=2)
    check_inner_contiguous("x", x)
    d = x.shape[1]
    check_tensor("weight", weight, dtype=_DTYPES, ndim=2)
    check_shape("weight", weight, (d, None))
    check_contiguous("weight", weight)
    k = weight.shape[1]
    if k < 2:
        raise ValueError(f"weight must have at least 2 taps (shape [D, K], K >= 2), got K={k}")
    if bias is not None:
        check_tensor("bias", bias, dtype=_DTYPES, ndim=1)
        check_shape("bias", bias, (d,))
        check_contiguous("bias", bias)
    check_tensor("conv_states", conv_states, dtype=_DTYPES, ndim=3)
    check_shape("conv_states", conv_states, (None, k - 1, d))
    check_inner_contiguous("conv_states", conv_states)
    check_same_device(x=x, weight=weight, conv_states=conv_states, **({} if bias is None else {"bias": bias}))


@dataclass(frozen=True)
class SequencePlan:
    """What every Gated DeltaNet layer of a step derives from the same packed sequences, made
    once per step (plan_sequences) rather than in each layer: the conv's sequence of each
    token and the chunked delta rule's chunk table (kernels/chunk_table.py)."""
    cu_seqlens: torch.Tensor
    num_tokens: int
    seq_ids: torch.Tensor
    chunks: tuple[torch.Tensor, ...]


def plan_sequences(cu_seqlens: torch.Tensor, num_tokens: int) -> SequencePlan | None:
    """The plan of a step's packed sequences for its T = num_tokens tokens; None where the torch
    references run (they need none) or there is no sequence."""
    if cu_seqlens.shape[0] < 2 or not use_triton("plan_sequences", cu_seqlens):
        return None
    return SequencePlan(cu_seqlens, num_tokens, _conv.token_seq_ids(cu_seqlens, num_tokens),
                        chunk_table(cu_seqlens, num_tokens, _gdp.CHUNK))


def _check_plan(plan: SequencePlan | None, cu_seqlens: torch.Tensor, t: int) -> None:
    if plan is not None and (plan.cu_seqlens is not cu_seqlens or plan.num_tokens != t):
        raise ValueError(f"plan was made for other sequences ({plan.num_tokens} tokens) than this call's "
                         f"cu_seqlens and {t} tokens: make it with plan_sequences(cu_seqlens, T)")


def causal_conv1d_prefill(x, weight, bias, conv_states, slots, cu_seqlens, has_state, silu: bool = True,
                          store_state: bool = True, plan: SequencePlan | None = None):
    """x [T, D] packed sequences, weight [D, K], bias [D] or None, conv_states [S, K-1, D];
    returns act(conv(x)) [T, D] and leaves each live slot holding its sequence's last K-1 inputs
    (store_state False: the slots are read, not written; a speculative verify step). `plan`:
    plan_sequences(cu_seqlens, T), made once for a step's layers."""
    if _checks.enabled():
        _check_conv(x, weight, bias, conv_states)
        _check_seqs(-1, slots, cu_seqlens, has_state)
        check_same_device(x=x, slots=slots, cu_seqlens=cu_seqlens, has_state=has_state)
        _check_plan(plan, cu_seqlens, x.shape[0])
    if use_triton("causal_conv1d_prefill", x):
        return _conv.causal_conv1d_prefill(x, weight, bias, conv_states, slots, cu_seqlens, has_state, silu,
                                           store_state, None if plan is None else plan.seq_ids)
    log_cpu_reference_once("causal_conv1d_prefill")
    return _conv.causal_conv1d_reference(x, weight, bias, conv_states, slots, cu_seqlens, has_state, silu,
                                         store_state)


def causal_conv1d_decode(x, weight, bias, conv_states, slots, silu: bool = True):
    """One token per request: x [N, D]; each live slot's window shifts in place. Graph-safe."""
    if _checks.enabled():
        _check_conv(x, weight, bias, conv_states)
        _check_seqs(x.shape[0], slots, None, None)
        check_same_device(x=x, slots=slots)
    if use_triton("causal_conv1d_decode", x):
        return _conv.causal_conv1d_decode(x, weight, bias, conv_states, slots, silu)
    log_cpu_reference_once("causal_conv1d_decode")
    n = x.shape[0]
    cu = torch.arange(n + 1, dtype=torch.int32, device=x.device)
    ones = torch.ones(n, dtype=torch.bool, device=x.device)
    return _conv.causal_conv1d_reference(x, weight, bias, conv_states, slots, cu, ones, silu)


def _check_gdr(q, k, v, g, beta, states) -> None:
    check_tensor("q", q, dtype=_DTYPES, ndim=3)
    t, hk, dk = q.shape
    check_tensor("k", k, dtype=q.dtype, ndim=3)
    check_shape("k", k, (t, hk, dk))
    check_tensor("v", v, dtype=q.dtype, ndim=3)
    check_shape("v", v, (t, None, None))
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk:
        raise ValueError(f"v's head count ({hv}) must be a multiple of q/k's ({hk})")
    if dk > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be <= {MAX_HEAD_DIM}, got d_k={dk}, d_v={dv}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_inner_contiguous(name, x)
    check_tensor("g", g, dtype=torch.float32, ndim=2)
    check_shape("g", g, (t, hv))
    check_tensor("beta", beta, dtype=(q.dtype, torch.float32), ndim=2)
    check_shape("beta", beta, (t, hv))
    for name, x in (("g", g), ("beta", beta)):
        check_inner_contiguous(name, x)
    check_tensor("states", states, dtype=torch.float32, ndim=4)
    check_shape("states", states, (None, hv, dk, dv))
    check_inner_contiguous("states", states, inner_dims=2)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, states=states)


def gated_delta_rule_prefill(q, k, v, g, beta, states, slots, cu_seqlens, has_state, l2norm: bool = True,
                             store_state: bool = True, plan: SequencePlan | None = None):
    """Chunked prefill over packed sequences: q, k [T, Hk, Dk], v [T, Hv, Dv], g fp32 [T, Hv],
    beta [T, Hv], states fp32 [S, Hv, Dk, Dv]. Continues each sequence from its slot (where
    has_state) and writes its final state back (store_state False: reads only; a speculative
    verify step). `plan`: plan_sequences(cu_seqlens, T), made once for a step's layers.
    Returns o [T, Hv, Dv] in v's dtype."""
    if _checks.enabled():
        _check_gdr(q, k, v, g, beta, states)
        _check_seqs(-1, slots, cu_seqlens, has_state)
        check_same_device(q=q, slots=slots, cu_seqlens=cu_seqlens, has_state=has_state)
        _check_plan(plan, cu_seqlens, q.shape[0])
    if use_triton("gated_delta_rule_prefill", q):
        return _gdp.gated_delta_rule_prefill(q, k, v, g, beta, states, slots, cu_seqlens, has_state, l2norm,
                                             store_state, None if plan is None else plan.chunks)
    log_cpu_reference_once("gated_delta_rule_prefill")
    return _gdr.gated_delta_rule_reference(q, k, v, g, beta, states, slots, cu_seqlens, has_state, l2norm,
                                           store_state)


def gated_delta_rule_decode(q, k, v, g, beta, states, slots, l2norm: bool = True):
    """One token per request (shapes as the prefill with T = N): reads and updates each live
    slot's state in place. Graph-safe (no host values)."""
    if _checks.enabled():
        _check_gdr(q, k, v, g, beta, states)
        _check_seqs(q.shape[0], slots, None, None)
        check_same_device(q=q, slots=slots)
    if use_triton("gated_delta_rule_decode", q):
        return _gdr.gated_delta_rule_decode(q, k, v, g, beta, states, slots, l2norm)
    log_cpu_reference_once("gated_delta_rule_decode")
    n = q.shape[0]
    cu = torch.arange(n + 1, dtype=torch.int32, device=q.device)
    ones = torch.ones(n, dtype=torch.bool, device=q.device)
    return _gdr.gated_delta_rule_reference(q, k, v, g, beta, states, slots, cu, ones, l2norm)


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] (packed rows, any row stride), A_log and dt_bias [Hv] -> (g fp32 [T, Hv] =
    -exp(A_log) * softplus(a + dt_bias), beta [T, Hv] = sigmoid(b) in b's dtype), contiguous: the
    delta rule's log decay and write strength."""
    if _checks.enabled():
        check_tensor("a", a, dtype=_DTYPES, ndim=2)
        check_tensor("b", b, dtype=_DTYPES, ndim=2)
        check_shape("b", b, tuple(a.shape))
        for name, x in (("A_log", a_log), ("dt_bias", dt_bias)):
            check_tensor(name, x, dtype=_DTYPES, ndim=1)
            check_shape(name, x, (a.shape[1],))
            check_contiguous(name, x)
        check_inner_contiguous("a", a)
        check_inner_contiguous("b", b)
        check_same_device(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    if use_triton("gated_delta_gates", a):
        return _gpw.gates(a, b, a_log, dt_bias)
    log_cpu_reference_once("gated_delta_gates")
    return _gpw.gates_reference(a, b, a_log, dt_bias)


def gated_delta_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o, z [T, Hv, Dv] (packed last dim, any token / head strides), weight [Dv] -> [T, Hv * Dv] in
    weight's dtype: per head (weight * rmsnorm(o)) * silu(z), out_proj's input."""
    if _checks.enabled():
        check_tensor("o", o, dtype=_DTYPES, ndim=3)
        check_tensor("z", z, dtype=_DTYPES, ndim=3)
        check_shape("z", z, tuple(o.shape))
        check_tensor("weight", weight, dtype=_DTYPES, ndim=1)
        check_shape("weight", weight, (o.shape[2],))
        check_contiguous("weight", weight)
        check_inner_contiguous("o", o)
        check_inner_contiguous("z", z)
        check_same_device(o=o, z=z, weight=weight)
    if use_triton("gated_delta_norm", o):
        return _gpw.gated_norm(o, z, weight, eps)
    log_cpu_reference_once("gated_delta_norm")
    return _gpw.gated_norm_reference(o, z, weight, eps)
