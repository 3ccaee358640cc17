"""Penalties, logit bias and min_tokens through the whole engine (tiny random-weight model,
fp32, CPU), against transformers: repetition_penalty equals transformers' generate with it;
presence/frequency penalties and logit_bias equal a hand-written greedy loop over
transformers' logits; min_tokens holds against an EOS forced by logit_bias; the reported
logprobs are of the raw distribution; a mixed batch gives each request its solo tokens, with
overlap on and off; penalty state survives retraction."""

from __future__ import annotations

import collections

import pytest
import torch

from minisgl import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9] * 4, list(range(300, 317)), [42, 43, 42, 43, 44]]
N = 8


@pytest.fixture(scope="module")
def path(tiny_model_path) -> str:
    return str(tiny_model_path("llama3"))


@pytest.fixture(scope="module")
def hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(path) -> LLM:
    return LLM(path, device="cpu", dtype="float32", disable_overlap=True)


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].double()


def reference_greedy(hf, prompt: list[int], n: int, pres: float = 0.0, freq: float = 0.0,
                     bias: dict[int, float] | None = None, banned_until: tuple[set[int], int] = (set(), 0)
                     ) -> tuple[list[int], list[float]]:
    """OpenAI's penalties and logit_bias, stated directly: greedy, one token at a time, over
    transformers' logits. Returns (tokens, raw logprobs of the tokens)."""
    ids, out, lps = list(prompt), [], []
    for _ in range(n):
        raw = hf_last_logits(hf, ids)
        x = raw.clone()
        for t, c in collections.Counter(out).items():
            x[t] -= pres + freq * c
        for t, b in (bias or {}).items():
            x[t] += b
        if len(out) < banned_until[1]:
            x[list(banned_until[0])] = float("-inf")
        tok = int(x.argmax())
        out.append(tok)
        lps.append(float(torch.log_softmax(raw, -1)[tok]))
        ids.append(tok)
    return out, lps


def gen(llm: LLM, prompts, params) -> list[dict]:
    return llm.generate(prompts, params, use_tqdm=False)


def test_repetition_penalty_equals_transformers_generate(hf, llm) -> None:
    from transformers import GenerationConfig

    plain = [o["token_ids"] for o in gen(llm, PROMPTS, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))]
    changed = 0
    for r, prompts in ((1.3, PROMPTS), (0.7, PROMPTS[:1])):
        got = gen(llm, prompts, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, repetition_penalty=r))
        cfg = GenerationConfig(
            max_new_tokens=N, do_sample=False, repetition_penalty=r, eos_token_id=None, pad_token_id=0
        )
        for prompt, o, p in zip(prompts, got, plain):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                want = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, len(prompt):]
            assert o["token_ids"] == want.tolist()
            changed += o["token_ids"] != p
    assert changed >= 2, "the penalty should change several continuations"


@pytest.mark.parametrize("pres, freq, with_bias", [(0.8, 0.6, False), (-0.5, -0.3, True), (0.0, 1.5, True)])
def test_presence_frequency_and_bias_equal_reference_loop(hf, llm, pres: float, freq: float, with_bias: bool) -> None:
    plain = gen(llm, PROMPTS, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
    changed = 0
    for prompt, p in zip(PROMPTS, plain):
        # Ban the plain run's third token and push a token the model does not favour; ids at
        # both ends of the vocabulary.
        bias = {p["token_ids"][2]: -100.0, 777: 1.5, 0: 0.25, 49151: -3.0} if with_bias else {}
        sp = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, presence_penalty=pres,
                            frequency_penalty=freq, logit_bias=bias or None)
        got = gen(llm, [prompt], sp)[0]
        want, want_lp = reference_greedy(hf, prompt, N, pres, freq, bias)
        assert got["token_ids"] == want
        # Logprobs are of the raw distribution, not of the penalized one.
        torch.testing.assert_close(got["logprobs"], want_lp, rtol=1e-4, atol=1e-4)
        changed += got["token_ids"] != p["token_ids"]
        assert not with_bias or p["token_ids"][2] not in got["token_ids"]
    assert changed, "the penalties should change a continuation"


def test_min_tokens_holds_against_a_forced_eos(hf, llm) -> None:
    eos = llm.model_config.eos_token_ids[0]
    prompt = PROMPTS[1]
    forced = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100.0})
    assert gen(llm, [prompt], forced)[0]["token_ids"] == [eos]  # the forced model stops at once
    for min_tokens in (1, 4):
        sp = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100.0}, min_tokens=min_tokens)
        got = gen(llm, [prompt], sp)[0]
        want, want_lp = reference_greedy(hf, prompt, min_tokens + 1, bias={eos: 100.0},
                                         banned_until=(set(llm.model_config.eos_token_ids), min_tokens))
        assert got["token_ids"] == want and want[-1] == eos and eos not in want[:-1]
        assert got["finish_reason"] == "stop"
        torch.testing.assert_close(got["logprobs"], want_lp, rtol=1e-4, atol=1e-4)
    # stop_token_ids are banned the same way; with temperature, whatever the draw.
    stop = 1234
    sp = SamplingParams(max_tokens=10, temperature=0.9, seed=3, logit_bias={stop: 100.0}, stop_token_ids=[stop],
                        min_tokens=3, ignore_eos=True)
    got = gen(llm, [prompt], sp)[0]["token_ids"]
    assert len(got) == 4 and got[-1] == stop and stop not in got[:-1]


MIXED = [
    SamplingParams(max_tokens=N, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, repetition_penalty=1.4, top_logprobs=3),
    SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, presence_penalty=0.7, frequency_penalty=0.4),
    SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logit_bias={900: 2.0, 5: -100.0}),
    SamplingParams(max_tokens=N, temperature=0.8, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=0.8, seed=12, top_k=50, repetition_penalty=0.8, frequency_penalty=0.9,
                   logit_bias={3: 1.0}, min_tokens=N, top_logprobs=2),
    SamplingParams(max_tokens=N, temperature=0, min_tokens=5, logit_bias={2: 50.0}),
]


MIXED_PROMPTS = [PROMPTS[i % len(PROMPTS)] for i in range(len(MIXED))]


@pytest.fixture(scope="module")
def alone(llm) -> list[dict]:
    return [gen(llm, [p], sp)[0] for p, sp in zip(MIXED_PROMPTS, MIXED)]


def assert_same(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"]
    torch.testing.assert_close(got["logprobs"], want["logprobs"], rtol=1e-5, atol=1e-5)
    assert ("top_logprobs" in got) == ("top_logprobs" in want)
    for g, w in zip(got.get("top_logprobs", []), want.get("top_logprobs", [])):
        assert [t for t, _ in g] == [t for t, _ in w]
        torch.testing.assert_close([lp for _, lp in g], [lp for _, lp in w], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_batch_equals_alone(path, llm, alone, overlap: bool) -> None:
    """Requests with and without penalties, bias, min_tokens and top_logprobs in one batch
    (each twice: n > 1 requests are independent, with their own token history) give each
    request its solo tokens and logprobs, with overlap scheduling on and off."""
    if overlap:
        llm = LLM(path, device="cpu", dtype="float32", max_prefill_tokens=24)  # chunked prefill too
    out = gen(llm, MIXED_PROMPTS * 2, MIXED * 2)
    for i, o in enumerate(out):
        assert_same(o, alone[i % len(alone)])
    llm.scheduler.check_integrity()


RETRACT = [  # strong pulls toward (or away from) generated tokens: lost counts change the output
    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, presence_penalty=-1.5, frequency_penalty=-0.5),
    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=0.5),
    SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True, frequency_penalty=1.5,
                   repetition_penalty=1.3),
]
RETRACT_PROMPTS = [[42, 43, 44], [5, 6, 7, 8, 9], [300, 301]]


def test_penalty_state_survives_retraction(path, llm, monkeypatch) -> None:
    """A KV pool too small for the batch retracts requests (long outputs beat the admission
    estimate); a retracted request recomputes its prompt + output and must get its token
    counts back (not lose or double them)."""
    want = [gen(llm, [p], sp)[0] for p, sp in zip(RETRACT_PROMPTS, RETRACT)]
    tight = LLM(path, device="cpu", dtype="float32", num_pages=10, page_size=4)
    retracted = []
    real = tight.scheduler._retract

    def spy(req) -> None:
        retracted.append(req.logits_spec is not None and req.logits_spec.tracks_counts and len(req.output) > 0)
        real(req)

    monkeypatch.setattr(tight.scheduler, "_retract", spy)
    out = gen(tight, RETRACT_PROMPTS * 2, RETRACT * 2)
    assert any(retracted), "the tight pool should have retracted a penalized request that had output"
    for i, o in enumerate(out):
        assert_same(o, want[i % len(want)])
    tight.scheduler.check_integrity()


def test_no_penalty_buffers_or_ops_without_asking(path, monkeypatch) -> None:
    from minisgl.sampling import logits_plan

    calls = collections.Counter()

    def counted(name: str):
        real = getattr(logits_plan.ops, name)

        def call(*args, **kwargs):
            calls.update([name])
            return real(*args, **kwargs)

        return call

    for name in ("apply_penalties", "top_logprobs"):
        monkeypatch.setattr(logits_plan.ops, name, counted(name))
    llm = LLM(path, device="cpu", dtype="float32")
    plain = SamplingParams(max_tokens=4, temperature=0.5, top_p=0.9, ignore_eos=True)
    pres = SamplingParams(max_tokens=4, temperature=0, presence_penalty=0.5, ignore_eos=True)
    gen(llm, PROMPTS, plain)
    assert not calls and llm.engine.penalties.counts is None and llm.engine.penalties.prompt is None
    gen(llm, PROMPTS, [plain, pres, plain])
    assert calls["apply_penalties"] == 4 and not calls["top_logprobs"]  # 1 prefill + 3 decode steps
    assert llm.engine.penalties.counts is not None and llm.engine.penalties.prompt is None


def test_bad_fields_are_refused_by_name(llm) -> None:
    vocab = llm.model_config.vocab_size
    with pytest.raises(ValueError, match="^logit_bias: token id"):
        gen(llm, [PROMPTS[0]], SamplingParams(logit_bias={vocab: 1.0}))
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, logit_bias={vocab - 1: 1.0}), use_tqdm=False)
    bad = [
        ("presence_penalty", {"presence_penalty": 2.5}), ("frequency_penalty", {"frequency_penalty": float("nan")}),
        ("repetition_penalty", {"repetition_penalty": 0.0}), ("logit_bias", {"logit_bias": {-1: 1.0}}),
        ("logit_bias", {"logit_bias": {"5": 1.0}}), ("logit_bias", {"logit_bias": {5: 101.0}}),
        ("logit_bias", {"logit_bias": [1, 2]}), ("min_tokens", {"min_tokens": 17}), ("min_tokens", {"min_tokens": -1}),
        ("top_logprobs", {"top_logprobs": 21}), ("top_logprobs", {"top_logprobs": True}),
        ("prompt_logprobs", {"prompt_logprobs": -1}), ("prompt_logprobs", {"prompt_logprobs": 21}),
    ]
    for name, kw in bad:
        with pytest.raises(ValueError, match=f"^{name}"):
            SamplingParams(max_tokens=16, **kw)


def test_penalty_state_reset_and_record() -> None:
    from minisgl.sampling.penalty_state import PenaltyState

    st = PenaltyState(4, 10, torch.device("cpu"))
    st.reset([1, 2], [[3, 3, 4], []], [[5, 6, 5], None])
    assert st.counts[1].tolist() == [0, 0, 0, 2, 1, 0, 0, 0, 0, 0] and not st.counts[2].any()
    assert st.prompt[1].tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]
    st.record(torch.tensor([1, 2]), torch.tensor([9, 3]))
    assert st.counts[1, 9] == 1 and st.counts[2, 3] == 1
    st.reset([1], [[0]], [[7]])  # a row reused: its old history is gone
    assert st.counts[1].tolist() == [1] + [0] * 9 and st.prompt[1].nonzero().flatten().tolist() == [7]
