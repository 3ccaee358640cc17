"""Exactness of speculative sampling through the LLM: on a tiny model with a 64-token
vocabulary, the joint distribution of the first two sampled tokens over many seeds, with
speculation (the target as its own greedy draft, so the draft is accepted with probability
p(argmax) and rejected otherwise), is the distribution plain sampling draws from: the model's
filtered next-token probabilities, P(t1) P(t2 | t1), computed exactly from its logits. For
temperature 1, top-p 0.9 and top-k 5; chi-square goodness of fit at significance 1e-3 each
(seeded: a pass is reproducible). The statistic has power: the same test rejects the draws
of plain sampling at another temperature."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import spec_models
import tiny_models
import torch

from minisgl import LLM, SamplingParams
from minisgl.kernels.sampling import filtered_probs_reference

N = 1500  # seeded requests per configuration
SIGNIFICANCE = 1e-3
PROMPT = [5, 9, 17]


@pytest.fixture(scope="module")
def spec(tiny_model_path, tmp_path_factory) -> LLM:
    root = tmp_path_factory.mktemp("small_vocab")
    tok = spec_models.tokenizer_only(Path(tiny_model_path("llama3")), root / "tok")
    path = str(tiny_models.build_tiny_model(spec_models.SMALL_VOCAB, root / "model", tok))
    return LLM(path, device="cpu", dtype="float32", max_running_requests=N, max_prefill_tokens=4 * N,
               speculative_algorithm="draft", speculative_draft_model=path, speculative_num_draft_tokens=2)


def exact_joint(llm: LLM, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """P(t1, t2) [V, V] of plain sampling after PROMPT, from the model's logits."""
    v = llm.engine.model_config.vocab_size
    logits = torch.stack([llm.engine.score([PROMPT])[0][-1]] + [s[-1] for s in llm.engine.score(
        [PROMPT + [t] for t in range(v)])])

    def filt(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return filtered_probs_reference(x, torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int32),
                                        torch.full((n,), top_p), torch.zeros(n)).double()

    p = filt(logits)
    return (p[0][:, None] * p[1:]).numpy()


def goodness_of_fit_p(pairs: list[tuple[int, int]], joint: np.ndarray, strict: bool = True) -> float:
    """Chi-square p-value of the observed pairs against `joint`; cells expected below 5 pooled.
    strict: a pair `joint` never draws fails at once."""
    from scipy.stats import chisquare

    counts = Counter(pairs)
    expected = joint.ravel() * len(pairs)
    observed = np.zeros_like(expected)
    for (a, b), c in counts.items():
        observed[a * joint.shape[1] + b] = c
    impossible = observed[expected == 0].sum()
    assert not (strict and impossible), "drew a pair plain sampling never draws"
    if impossible:
        return 0.0
    big, small = expected >= 5, (expected > 0) & (expected < 5)
    assert big.sum() >= 10, "too few cells for a meaningful test"
    obs, exp = observed[big], expected[big]
    if small.any():
        obs, exp = np.append(obs, observed[small].sum()), np.append(exp, expected[small].sum())
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (1.0, -1, 0.9), (1.0, 5, 1.0)],
                         ids=["temperature-1", "top-p-0.9", "top-k-5"])
def test_first_two_tokens_follow_plain_sampling(spec: LLM, temperature: float, top_k: int, top_p: float) -> None:
    before = spec.scheduler.stats()
    # max_tokens 3: t1 from the prefill, t2 from a verify step with one draft.
    sp = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, temperature=temperature, top_k=top_k, top_p=top_p)
          for s in range(N)]
    outs = [o["token_ids"] for o in spec.generate([PROMPT] * N, sp, use_tqdm=False)]
    st = {k: v - before.get(k, 0) for k, v in spec.scheduler.stats().items()}
    assert 0.2 < st["spec_accepted"] / st["spec_proposed"] < 0.9, st  # accepted and rejected drafts, often
    pairs = [(t[0], t[1]) for t in outs]
    joint = exact_joint(spec, temperature, top_k, top_p)
    assert goodness_of_fit_p(pairs, joint) > SIGNIFICANCE
    # Power: the same draws against plain sampling at temperature 1.5 (same filters) fail.
    assert goodness_of_fit_p(pairs, exact_joint(spec, 1.5, top_k, top_p), strict=False) < 1e-6
