"""The bf16 tie rule of the end-to-end tests. bf16 keeps 8 bits of mantissa: two
implementations of the same math may flip a greedy choice only where the reference's two
candidates are this close (relative to the logits' scale)."""

from __future__ import annotations

from collections.abc import Callable

import torch

BF16_TIE = 0.01


def assert_near_tie(logits: torch.Tensor, want: int, got: int, step: int, tie: float = BF16_TIE) -> None:
    """`got` may replace the reference's `want` only if `logits` (the reference's) nearly tie them."""
    gap = (logits[want] - logits[got]).abs().item()
    scale = logits.abs().max().item()
    assert gap <= tie * scale, f"step {step}: {want} vs {got} differ by {gap:.4g} (scale {scale:.3g})"


def assert_same_or_bf16_tie(
    score: Callable[[list[int]], torch.Tensor], want: list[list[int]], got: list[list[int]], prompts: list[list[int]],
    router_tie: Callable[[list[int]], bool] | None = None, tie: float = BF16_TIE,
) -> None:
    """Sequences must match up to their first difference, and that difference must be a near-tie
    in the reference's logits at that step (after it, the contexts differ). `score(ids)` gives
    the reference's next-token logits after `ids`. For an MoE model, `router_tie(ids)` (see
    `router_tie_in`) may instead show that some router nearly tied within `ids`."""
    assert len(want) == len(got) == len(prompts), (len(want), len(got), len(prompts))
    for prompt, w, g in zip(prompts, want, got):
        assert len(g) == len(w), f"{len(g)} tokens, want {len(w)}"  # a short or empty answer is no tie
        i = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), None)
        if i is not None and not (router_tie is not None and router_tie(prompt + w[:i])):
            assert_near_tie(score(prompt + w[:i]), w[i], g[i], i, tie)


def engine_scorer(llm) -> Callable[[list[int]], torch.Tensor]:  # noqa: ANN001 - a minisgl.LLM
    """Next-token logits from a minisgl LLM's engine."""
    return lambda ids: llm.engine.score([ids])[0][-1]


# An MoE router's k-th and (k+1)-th expert this close (relative to the position's largest
# router logit) may swap in bf16: the expert outputs differ wholesale, not by rounding. The
# swaps seen on the GPU (tiny GPT-OSS, H100) were at gaps of 0.05% and 0.4%; 3% marked a tie
# at nearly every position of that model (H200 run of 2026-11-27), leaving nothing to compare.
ROUTER_TIE = 0.01


def first_router_tie(hf, ids: list[int]) -> int:  # noqa: ANN001 - a transformers MoE model
    """The first position of `ids` at which some MoE router of `hf` (the reference, run here)
    nearly ties its top-k boundary; len(ids) if none does. From that position on, a bf16 engine
    may route differently (attention carries the difference forward), so logits compare before
    it only. Routers: transformers 5's `*TopKRouter` modules (weight, optional bias, top_k)."""
    first = len(ids)

    def hook(mod, inp, _out) -> None:  # noqa: ANN001
        nonlocal first
        x = inp[0].reshape(-1, inp[0].shape[-1]).float()
        bias = getattr(mod, "bias", None)
        logits = torch.nn.functional.linear(x, mod.weight.float(), None if bias is None else bias.float())
        k = getattr(mod, "top_k", None) or hf.config.num_experts_per_tok
        v = logits.sort(dim=-1, descending=True).values
        tied = (v[:, k - 1] - v[:, k]) <= ROUTER_TIE * v.abs().max(dim=-1).values
        if tied.any():
            first = min(first, int(tied.nonzero()[0]))

    routers = [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]
    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids], device=next(hf.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    return first


def router_tie_in(hf) -> Callable[[list[int]], bool]:  # noqa: ANN001 - a transformers MoE model
    """`router_tie(ids)`: whether some router of `hf` nearly ties at a position of `ids`. A
    greedy token that follows such a position may differ by more than a logit near-tie (the
    expert outputs differ wholesale), so the token tests excuse it; the logits test of
    test_quant4_gpu holds the positions before the tie to 5%."""
    return lambda ids: first_router_tie(hf, ids) < len(ids)
