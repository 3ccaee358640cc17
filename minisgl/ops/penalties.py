"""Penalties (repetition, presence, frequency), sparse logit bias and banned tokens, in place on
selected rows of a logits batch: Triton where it can run, else the torch reference."""

from __future__ import annotations

import torch

from minisgl.kernels import penalties as _k
from minisgl.ops._backend import log_cpu_reference_once, use_triton
from minisgl.ops._checks import check_contiguous, check_inner_contiguous, check_same_device, check_shape, check_tensor

_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def apply_penalties(
    logits: torch.Tensor, rows: torch.Tensor, state_rows: torch.Tensor, counts: torch.Tensor,
    prompt: torch.Tensor, rep: torch.Tensor, pres: torch.Tensor, freq: torch.Tensor,
    bias_ptr: torch.Tensor, bias_ids: torch.Tensor, bias_vals: torch.Tensor,
) -> None:
    """In place on logits [B, V] (fp32/fp16/bf16, last dim packed, row stride free), for the n
    selected rows `rows` (int32 [n], distinct, < B) only; every other row is left untouched.
    Row i reads the token history of `state_rows[i]` (int32 [n]): `counts` (int32 [R, V],
    generated-token counts) and `prompt` (uint8 [R, V], 1 where the token is in the prompt;
    read only for rows with rep != 1). Per row: `rep` (repetition, 1 = off), `pres`, `freq`
    (f32 [n]); sparse additions `bias_ids`/`bias_vals` (int32 / f32 [>= nnz]) at
    [bias_ptr[i], bias_ptr[i + 1]) (int32 [n + 1], bias_ptr[0] = 0), -inf to ban a token.
    Ids must be < V and unique within a row (not checked here: that would sync the host);
    the host-side builder (minisgl/sampling/logits_plan.py) guarantees both."""
    check_tensor("logits", logits, dtype=_LOGIT_DTYPES, ndim=2)
    check_inner_contiguous("logits", logits)
    v = logits.shape[1]
    check_tensor("rows", rows, dtype=torch.int32, ndim=1)
    n = rows.numel()
    for name, t, dtype in (("state_rows", state_rows, torch.int32), ("rep", rep, torch.float32),
                           ("pres", pres, torch.float32), ("freq", freq, torch.float32)):
        check_tensor(name, t, dtype=dtype, ndim=1)
        check_shape(name, t, (n,))
    check_tensor("bias_ptr", bias_ptr, dtype=torch.int32, ndim=1)
    check_shape("bias_ptr", bias_ptr, (n + 1,))
    check_tensor("bias_ids", bias_ids, dtype=torch.int32, ndim=1)
    check_tensor("bias_vals", bias_vals, dtype=torch.float32, ndim=1)
    check_shape("bias_vals", bias_vals, (bias_ids.numel(),))
    check_tensor("counts", counts, dtype=torch.int32, ndim=2)
    check_shape("counts", counts, (None, v))
    check_tensor("prompt", prompt, dtype=torch.uint8, ndim=2)
    check_shape("prompt", prompt, (None, v))
    for name, t in (("counts", counts), ("prompt", prompt)):
        check_inner_contiguous(name, t)
    for name, t in (("rows", rows), ("state_rows", state_rows), ("rep", rep), ("pres", pres), ("freq", freq),
                    ("bias_ptr", bias_ptr), ("bias_ids", bias_ids), ("bias_vals", bias_vals)):
        check_contiguous(name, t)
    check_same_device(logits=logits, rows=rows, state_rows=state_rows, counts=counts, prompt=prompt, rep=rep,
                      pres=pres, freq=freq, bias_ptr=bias_ptr, bias_ids=bias_ids, bias_vals=bias_vals)
    if n > logits.shape[0]:
        raise ValueError(f"rows selects {n} rows of a logits batch of {logits.shape[0]}")
    if use_triton("apply_penalties", logits):
        _k.apply_penalties(logits, rows, state_rows, counts, prompt, rep, pres, freq, bias_ptr, bias_ids, bias_vals)
        return
    log_cpu_reference_once("apply_penalties")
    _k.apply_penalties_reference(
        logits, rows, state_rows, counts, prompt, rep, pres, freq, bias_ptr, bias_ids, bias_vals
    )
