"""Log-probabilities of given tokens and the k most likely alternatives, for a block of rows at
once (one batched top-k, never a loop per row). Of the raw distribution: log_softmax(logits)."""

from __future__ import annotations

import torch

from minisgl.ops._checks import check_inner_contiguous, check_same_device, check_shape, check_tensor
from minisgl.ops.deterministic import logsumexp_rows


def top_logprobs(
    logits: torch.Tensor, k: int, targets: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """logits fp32 [n, V]; k in [0, V]; targets int64 [n] (optional).
    -> (log_softmax(logits)[i, targets[i]] f32 [n] or None, top ids int64 [n, k],
    top logprobs f32 [n, k]), most likely first.

    The top-k runs on the logits themselves, and the log-normalizer is subtracted from those
    k values only: no [n, V] log_softmax is written."""
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    check_inner_contiguous("logits", logits)
    n, v = logits.shape
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= v:
        raise ValueError(f"k must be an integer in [0, {v}], got {k!r}")
    if targets is not None:
        check_tensor("targets", targets, dtype=torch.int64, ndim=1)
        check_shape("targets", targets, (n,))
        check_same_device(logits=logits, targets=targets)
    lse = logsumexp_rows(logits)[:, None]
    vals, ids = logits.topk(k, dim=-1) if k else (logits.new_empty(n, 0), logits.new_empty(n, 0, dtype=torch.int64))
    chosen = None if targets is None else (logits.gather(1, targets[:, None]) - lse).squeeze(1)
    return chosen, ids, vals - lse


def top_logprobs_reference(
    logits: torch.Tensor, k: int, targets: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The same in fp64 through a full log_softmax and a sort (the test reference)."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    vals, ids = lp.sort(dim=-1, descending=True, stable=True)
    chosen = None if targets is None else lp.gather(1, targets[:, None]).squeeze(1)
    return chosen, ids[:, :k], vals[:, :k]
