"""The Gated DeltaNet layer's pointwise steps before and after the delta rule, one launch each, beside
the torch references (the model's former code, in its order and dtypes) they are tested against:

- `gates`: from the projections' a and b [T, Hv] (a token's row may be a strided view), the layer's
  A_log and dt_bias [Hv]: the log decay g = -exp(A_log) * softplus(a + dt_bias) (fp32, softplus
  linear above 20 as torch's) and beta = sigmoid(b) (b's dtype), both [T, Hv] contiguous.
- `gated_norm`: from the delta rule's o [T, Hv, Dv] and the gate z [T, Hv, Dv] (strided views
  allowed, last dim packed): per head, n = o * rsqrt(mean(o^2) + eps) in fp32, then
  (weight * n rounded to the output dtype) rounded again, times silu(z) in fp32, rounded: the
  [T, Hv * Dv] input of out_proj.

In torch these were about 8 and 12 kernels per layer (casts, a softplus, exps, a mean, an rsqrt,
the multiplies): a Qwen3.5-35B-A3B batch-1 decode step ran ~25 elementwise launches per Gated
DeltaNet layer, ~0.9 ms of a 4.5 ms step on an H200 (RESULTS.md, thirty-fourth session).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _gates_kernel(A, B, ALog, DtBias, G, Beta, H, sa_t, sb_t, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    a = tl.load(A + t * sa_t + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(B + t * sb_t + offs, mask=m, other=0.0).to(tl.float32)
    x = a + tl.load(DtBias + offs, mask=m, other=0.0).to(tl.float32)
    w = tl.exp(x)
    # softplus as torch's: x itself above 20, else log1p(exp(x)). log(1 + w) alone loses w's low
    # bits in the rounding of 1 + w (1.8e-5 relative at x = -6); log(u) * w / (u - 1), u = 1 + w,
    # cancels that rounding (Goldberg's log1p; u == 1 where w is below half an ulp of 1: w itself)
    u = 1.0 + w
    sp = tl.where(x > 20.0, x, tl.where(u == 1.0, w, tl.log(u) * (w / (u - 1.0))))
    g = -tl.exp(tl.load(ALog + offs, mask=m, other=0.0).to(tl.float32)) * sp
    beta = 1.0 / (1.0 + tl.exp(-b))
    tl.store(G + t * H + offs, g, mask=m)
    tl.store(Beta + t * H + offs, beta.to(Beta.dtype.element_ty), mask=m)


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g fp32 [T, Hv], beta [T, Hv] in b's dtype); a, b [T, Hv] with packed rows."""
    t, h = a.shape
    g = torch.empty(t, h, dtype=torch.float32, device=a.device)
    beta = torch.empty(t, h, dtype=b.dtype, device=b.device)
    if t:
        _gates_kernel[(t,)](a, b, a_log, dt_bias, g, beta, h, a.stride(0), b.stride(0),
                            BLOCK=triton.next_power_of_2(h), num_warps=1)
    return g, beta


def gates_reference(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    beta = b.sigmoid().contiguous()
    g = (-a_log.float().exp() * F.softplus(a.float() + dt_bias.float())).contiguous()
    return g, beta


@triton.jit
def _gated_norm_kernel(O, Z, W, Out, D, so_t, so_h, sz_t, sz_h, eps, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    o = tl.load(O + t * so_t + h * so_h + offs, mask=m, other=0.0).to(tl.float32)
    n = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    # (weight * n in the output dtype) rounded there, as the torch layer's 16-bit multiply
    y = (w * n.to(Out.dtype.element_ty).to(tl.float32)).to(Out.dtype.element_ty).to(tl.float32)
    z = tl.load(Z + t * sz_t + h * sz_h + offs, mask=m, other=0.0).to(tl.float32)
    y = y * (z / (1.0 + tl.exp(-z)))
    tl.store(Out + t * (tl.num_programs(1) * D) + h * D + offs, y.to(Out.dtype.element_ty), mask=m)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o, z [T, Hv, Dv] (packed last dim), weight [Dv] -> [T, Hv * Dv] in weight's dtype."""
    t, h, d = o.shape
    out = torch.empty(t, h * d, dtype=weight.dtype, device=o.device)
    if t:
        _gated_norm_kernel[(t, h)](o, z, weight, out, d, o.stride(0), o.stride(1), z.stride(0), z.stride(1), eps,
                                   BLOCK=triton.next_power_of_2(d), num_warps=1)
    return out


def gated_norm_reference(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' order: normalise in fp32, weight in the weight's (the model's) dtype, then
    silu(z) in fp32."""
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    y = (weight * of.to(weight.dtype)) * F.silu(z.float())
    return y.to(weight.dtype).reshape(o.shape[0], -1)
