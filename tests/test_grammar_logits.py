"""A grammar beside the other logits processing (issue 14's penalties, logit_bias, logprobs):
bias and penalties apply first, the mask last, so a +100 bias on a token the grammar forbids
cannot leak and a bias on an allowed token still wins; the reported logprobs (chosen token and
alternatives) stay those of the model's raw distribution; a raw copy is kept only for the
penalized rows whose request reports logprobs (a masked row's comes from the mask's raw
log-normalizer)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import torch
from test_grammar import REGEX, SCHEMA

from minisgl import LLM, SamplingParams
from minisgl.core.logits_spec import LogitsSpec
from minisgl.sampling.logits_plan import LogitsPlan, sample_with_plan
from minisgl.sampling.penalty_state import PenaltyState
from minisgl.sampling.sampler import SamplingTensors

PROMPTS = [[5, 6, 7, 8, 9, 10], [42, 43, 44], [100, 7, 200, 9]]


def _assert_raw_logprobs(llm: LLM, prompt: list[int], out: dict, k: int) -> None:
    """out's logprobs (and top-k alternatives) equal log_softmax of the unconstrained model's
    logits at each generated position (one independent extend over prompt + output)."""
    ids = out["token_ids"]
    logits = llm.engine.score([prompt + ids])[0][len(prompt) - 1 : len(prompt) - 1 + len(ids)]
    raw = torch.log_softmax(logits.double(), dim=-1)
    want = raw.gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    assert out["logprobs"] == pytest.approx(want.tolist(), abs=2e-4)
    if k:
        top_v, top_i = raw.topk(k, dim=-1)
        assert [[t for t, _ in alts] for alts in out["top_logprobs"]] == top_i.tolist()
        got = [lp for alts in out["top_logprobs"] for _, lp in alts]
        assert got == pytest.approx(top_v.flatten().tolist(), abs=2e-4)


def test_grammar_with_bias_penalties_and_raw_logprobs(tiny_model_path: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model_path("llama3")), device="cpu", max_model_len=256, num_pages=2048)
    tok = llm.tokenizer
    (no,) = tok.encode("no", add_special_tokens=False)
    # Tokens REGEX never allows (capitalized words): a +100 bias on them must lose to the mask.
    forbidden = [i for i in range(1000, 20000) if re.fullmatch(r"[A-Z][a-z]{3,}", tok.decode([i]))][:30]
    assert len(forbidden) == 30
    bias = {no: 100.0, **{t: 100.0 for t in forbidden}}
    pen = dict(presence_penalty=2.0, frequency_penalty=1.0, repetition_penalty=1.3)
    params = [
        *(SamplingParams(max_tokens=40, seed=s, regex=REGEX, logit_bias=bias, top_logprobs=3) for s in range(2)),
        *(SamplingParams(max_tokens=120, seed=s, json_schema=SCHEMA, top_logprobs=2, **pen) for s in range(2)),
        SamplingParams(max_tokens=40, seed=8, regex=REGEX),  # only the mask changes its logits
        SamplingParams(max_tokens=12, seed=9, logit_bias={no: 5.0}, top_logprobs=1),  # unconstrained, biased
    ]
    prompts = [PROMPTS[i % 3] for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs[:2]:  # the allowed biased token wins where the grammar allows it
        assert out["finish_reason"] == "stop" and re.fullmatch(REGEX, out["text"]), out
        assert out["text"].startswith("no, ") and not set(out["token_ids"]) & set(forbidden)
    assert outs[4]["finish_reason"] == "stop" and re.fullmatch(REGEX, outs[4]["text"]), outs[4]
    for out in outs[2:4]:
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    # The penalties change what the grammar lets through (same seeds, none of them).
    bare = llm.generate(prompts[2:4], [SamplingParams(max_tokens=120, seed=s, json_schema=SCHEMA) for s in range(2)],
                        use_tqdm=False)
    assert any(a["token_ids"] != b["token_ids"] for a, b in zip(outs[2:4], bare))
    for prompt, p, out in zip(prompts, params, outs):
        _assert_raw_logprobs(llm, prompt, out, p.top_logprobs)


def test_raw_copy_only_for_penalized_rows_that_report() -> None:
    """sample_with_plan on hand-made logits: the mask runs after the bias; a masked row's chosen
    logprob is raw without a raw copy (its chosen logit minus the log-normalizer the mask
    returns), a biased row that reports keeps a raw copy, and a biased row that does not report
    gets no copy (its value is what sampling saw)."""
    torch.manual_seed(0)
    B, V = 4, 50
    logits = torch.randn(B, V)
    raw = torch.log_softmax(logits, dim=-1)
    spec = LogitsSpec.of(SamplingParams(logit_bias={3: 100.0}), frozenset(), V)
    calls = []

    def mask(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # rows 0, 1: only tokens 10..19
        calls.append(x[2, 3].item())  # the bias ran before the mask
        lse = x[:2].logsumexp(dim=-1)
        x[:2, :10] = float("-inf")
        x[:2, 20:] = float("-inf")
        return torch.tensor([0, 1]), lse

    def greedy(x: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.argmax(dim=-1)
        return t, torch.log_softmax(x, dim=-1).gather(1, t[:, None]).squeeze(1)

    # Row 0 masked + reports, row 1 masked only, row 2 biased + reports, row 3 biased only.
    plan = LogitsPlan.build([None, None, spec, spec], [0] * B, [True] * B, list(range(B)), [], 0,
                            torch.device("cpu"), mask, [True, False, True, False])
    assert plan is not None and plan.raw_rows is not None and plan.raw_rows.tolist() == [2]
    st = SamplingTensors.build([0.0] * B, [-1] * B, [1.0] * B, [0.0] * B, [0] * B, [0] * B, torch.device("cpu"))
    out = sample_with_plan(logits.clone(), st, plan, PenaltyState(B + 1, V, torch.device("cpu")), greedy)
    assert calls == [pytest.approx(float(logits[2, 3]) + 100.0)]
    want = [10 + int(logits[0, 10:20].argmax()), 10 + int(logits[1, 10:20].argmax()), 3, 3]
    assert out.tokens.tolist() == want
    lp = out.logprobs.tolist()
    for row in (0, 1, 2):
        assert lp[row] == pytest.approx(float(raw[row, want[row]]), abs=1e-5)
    assert lp[3] > -1e-3  # +100 on token 3: what sampling saw, not the raw value
    assert float(raw[3, 3]) < -1.0
    # A mask alone keeps no raw copy; no mask and nothing else: no plan (the plain path).
    alone = LogitsPlan.build([None] * B, [0] * B, [True] * B, list(range(B)), [], 0, torch.device("cpu"), mask)
    assert alone is not None and alone.raw_rows is None
    assert LogitsPlan.build([None] * B, [0] * B, [True] * B, list(range(B)), [], 0, torch.device("cpu")) is None
