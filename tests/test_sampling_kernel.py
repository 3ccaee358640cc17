"""Sampling kernel: kept sets equal the sort-based reference's, greedy is exactly argmax, draws
follow the filtered distribution (chi-square), and a row's draw depends only on (seed, step).

The interpreter is slow per program, so CPU tests use small vocabularies and a few hundred
draws; the `gpu` tests repeat the statistics at real sizes."""

from __future__ import annotations

import pytest
import torch

from minisgl import env, ops
from minisgl.kernels import sampling as K

# Triton kernels: on the CPU they run under TRITON_INTERPRET=1 (a separate pytest pass).
pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LOG2E = 1.4426950408889634


def params(temp, top_k, top_p, min_p, seeds=None, steps=None) -> dict:
    b = len(temp)
    f32 = dict(dtype=torch.float32, device=DEV)
    return dict(
        temperature=torch.tensor(temp, **f32), top_k=torch.tensor(top_k, dtype=torch.int32, device=DEV),
        top_p=torch.tensor(top_p, **f32), min_p=torch.tensor(min_p, **f32),
        seeds=torch.tensor(seeds if seeds is not None else list(range(b)), dtype=torch.int64, device=DEV),
        steps=torch.tensor(steps if steps is not None else [0] * b, dtype=torch.int64, device=DEV),
    )


def kernel_kept(logits: torch.Tensor, thr: torch.Tensor, p: dict) -> torch.Tensor:
    """The kernel's kept set from its reported threshold (same formula as the kernel)."""
    m = logits.max(dim=1, keepdim=True).values
    w = torch.exp2((logits - m) * (LOG2E / p["temperature"][:, None]))
    return (logits >= thr[:, None]) & (w >= p["min_p"][:, None]) & (w > 0)


def filtered(logits: torch.Tensor, p: dict) -> torch.Tensor:
    return K.filtered_probs_reference(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"])


# Rows: (temperature, top_k, top_p, min_p) covering each filter alone, combined, and no-ops.
ROWS = [
    (1.0, 50, 1.0, 0.0), (0.7, -1, 0.9, 0.0), (1.0, 10, 0.5, 0.0), (1.3, 20, 0.8, 0.1),
    (1.0, -1, 1.0, 0.05), (0.5, 5, 0.95, 0.0), (1.0, 299, 0.3, 0.0), (1.0, 1, 1.0, 0.0),
    (2.0, 1000, 0.999, 0.0), (0.9, 3, 1.0, 0.5), (0.3, -1, 0.9, 0.0), (0.25, 40, 0.7, 0.0),
]


@needs_triton
@pytest.mark.parametrize("per_lane", [1, 8])
def test_kept_set_equals_reference(per_lane: int) -> None:
    """With 1 slot per lane most copies overflow and the search scans the row again; with 8
    they fit. BLOCK 32 sends k > 32 down the no-bound path and k <= 32 down the bound path."""
    gen = torch.Generator().manual_seed(per_lane)
    logits = (torch.randn(len(ROWS), 333, generator=gen) * 2).to(DEV)
    p = params(*map(list, zip(*ROWS)))
    thr = torch.empty(len(ROWS), device=DEV)
    tokens, _ = K.sample(logits, **p, config={"PER_LANE": per_lane}, thresholds=thr)
    want = filtered(logits, p) > 0
    got = kernel_kept(logits, thr, p)
    bad = (want != got).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"kept sets differ on rows {[ROWS[i] for i in bad]}"
    assert want[torch.arange(len(ROWS)), tokens].all(), "a token outside the kept set was drawn"


@needs_triton
def test_awkward_logits() -> None:
    """-inf entries, huge negative finite logits, ties (all tied tokens are kept), tiny vocab."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 200, generator=gen) * 2
    logits[0, ::3] = float("-inf")
    logits[1, :150] = -1e30
    logits[2] = torch.randint(0, 6, (200,), generator=gen).float()  # heavy ties
    logits[3, :] = 0.25
    logits = logits.to(DEV)
    p = params([1.0, 1.0, 1.0, 1.0], [20, 10, 30, 5], [0.9, 0.8, 1.0, 0.5], [0, 0, 0, 0])
    thr = torch.empty(4, device=DEV)
    tokens, logprobs = K.sample(logits, **p, thresholds=thr)
    kept = kernel_kept(logits, thr, p)
    ref = filtered(logits, p) > 0
    assert torch.equal(kept[:2], ref[:2])
    kth = logits[2].sort(descending=True).values[29]
    assert torch.equal(kept[2], logits[2] >= kth), "top-k keeps every token tied with the k-th"
    assert kept[3].all(), "all-equal row: every token ties"
    assert kept[torch.arange(4), tokens].all()
    assert torch.isfinite(logprobs).all()


@needs_triton
def test_greedy_is_exact_argmax_and_logprobs() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 1000, generator=gen) * 4
    logits[1, 10] = logits[1, 900] = logits[1].max() + 1  # tie: the first index wins
    logits[2, :500] = float("-inf")
    logits = logits.to(DEV)
    p = params([0.0] * 4 + [1.0], [-1, 5, -1, -1, 3], [1.0, 0.5, 1.0, 1.0, 0.9], [0.0, 0, 0.3, 0, 0])
    tokens, logprobs = ops.sample(logits, **p)
    assert torch.equal(tokens[:4], logits[:4].argmax(dim=1))
    assert tokens[1].item() == 10
    want = torch.log_softmax(logits, dim=1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_draw_depends_only_on_seed_and_step() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 100, generator=gen).to(DEV)
    p = params([1.0, 0.8, 1.2], [-1, 30, -1], [1.0, 0.9, 1.0], [0, 0, 0.02], [11, 22, 33], [5, 6, 7])
    tokens, _ = K.sample(logits, **p)
    # The same rows in another batch, in another order, beside a stranger (seed 9).
    order = [2, 0]
    q = {k: torch.cat([v[order], v[:1]]) for k, v in p.items()}
    q["seeds"][-1] = 9
    stranger = torch.randn(1, 100, generator=gen).to(DEV)
    tokens2, _ = K.sample(torch.cat([logits[order], stranger]), **q)
    assert torch.equal(tokens2[:2], tokens[order])
    steps = params([1.0] * 12, [-1] * 12, [1.0] * 12, [0] * 12, [11] * 12, list(range(12)))
    draws = K.sample(logits[:1].expand(12, -1).contiguous(), **steps)[0]
    assert len(set(draws.tolist())) > 1, "different steps must give different draws"


def chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the drawn counts against probs (cells with expected < 5 pooled)."""
    from scipy.stats import chisquare

    n = tokens.numel()
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.cpu().double() * n
    assert counts[expected == 0].sum() == 0, "drew a token the filters remove"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@needs_triton
def test_chi_square_small_vocab_interpreted() -> None:
    """Temperature + min-p over 3 chunks (BLOCK 4): the lane-major inverse CDF draws p."""
    gen = torch.Generator().manual_seed(3)
    n, v = 300, 12
    logits = (torch.randn(v, generator=gen) * 0.6).to(DEV).expand(n, v).contiguous()
    p = params([0.8] * n, [-1] * n, [1.0] * n, [0.3] * n, list(range(1000, 1000 + n)), [4] * n)
    tokens, _ = K.sample(logits, **p, config={"BLOCK": 4, "NB": 4})
    assert chi_square_p(tokens, filtered(logits[:1], {k: t[:1] for k, t in p.items()})[0]) > 1e-3


def test_bad_arguments_name_the_argument() -> None:
    logits = torch.randn(2, 10)
    p = {k: v.cpu() for k, v in params([1.0, 1.0], [1, 1], [1.0, 1.0], [0, 0]).items()}
    with pytest.raises(ValueError, match="logits"):
        ops.sample(logits.half(), **p)
    with pytest.raises(ValueError, match="top_k"):
        ops.sample(logits, **{**p, "top_k": p["top_k"].long()})
    with pytest.raises(ValueError, match="seeds"):
        ops.sample(logits, **{**p, "seeds": p["seeds"][:1]})


GPU_CONFIGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, -1, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.0, -1, 0.8, 0.0), (1.2, 100, 0.9, 0.05),
    (1.0, -1, 1.0, 0.1),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CONFIGS)
def test_gpu_chi_square(cfg) -> None:
    gen = torch.Generator().manual_seed(hash(cfg) % 1000)
    n, v = 100_000, 3000  # 3000 spans several chunks of lanes
    logits = (torch.randn(v, generator=gen) * 1.5).to(DEV).expand(n, v)
    p = params(*[[x] * n for x in cfg], seeds=list(range(n)), steps=[17] * n)
    tokens, _ = ops.sample(logits.contiguous(), **p)
    assert chi_square_p(tokens, filtered(logits[:1], {k: t[:1] for k, t in p.items()})[0]) > 1e-4


@gpu
@pytest.mark.gpu
def test_gpu_kept_sets_at_real_vocab() -> None:
    gen = torch.Generator().manual_seed(5)
    b, v = 64, 151_936
    logits = (torch.randn(b, v, generator=gen) * 2.5).to(DEV)
    rows = [ROWS[i % len(ROWS)] for i in range(b)]
    p = params(*map(list, zip(*rows)))
    thr = torch.empty(b, device=DEV)
    tokens, _ = K.sample(logits, **p, thresholds=thr)
    want = filtered(logits, p) > 0
    got = kernel_kept(logits, thr, p)
    # fp32 sums in a different order may move a top-p boundary token by rounding: allow 1.
    assert (want != got).sum(dim=1).max().item() <= 1
    assert want[torch.arange(b), tokens].all()
    greedy = params([0.0] * b, [-1] * b, [1.0] * b, [0.0] * b)
    assert torch.equal(ops.sample(logits, **greedy)[0], logits.argmax(dim=1))


@gpu
@pytest.mark.gpu
def test_gpu_determinism_and_one_slot_per_lane_at_real_vocab() -> None:
    """Same (seed, step) -> same token in any batch; 1 slot per lane (re-scans) == default."""
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(32, 151_936, generator=gen) * 2).to(DEV)
    p = params([0.9] * 32, [50] * 16 + [-1] * 16, [0.9] * 32, [0.0] * 32, list(range(32)), [3] * 32)
    tokens, _ = K.sample(logits, **p)
    perm = torch.randperm(32, generator=gen).to(DEV)
    tokens_perm, _ = K.sample(logits[perm], **{k: v[perm] for k, v in p.items()})
    assert torch.equal(tokens_perm, tokens[perm])
    assert torch.equal(K.sample(logits, **p, config={"PER_LANE": 1})[0], tokens)
