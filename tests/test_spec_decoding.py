"""Speculative decoding through the offline LLM (CPU, fp32, tiny models): with every drafter
(n-gram, a smaller draft model, the target as its own draft, a random-weights EAGLE-3 head)
greedy output equals the non-speculative output token for token, in a batch of long and
short prompts with stop strings and max_tokens landing inside drafts; the target as its
own draft accepts every token; the scheduler's KV accounting holds under retraction,
chunked prefill, larger pages, aborts and a draft table that switches speculation off."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import spec_models

from minisgl import LLM, SamplingParams

K = 3


@pytest.fixture(scope="module")
def target(tiny_model_path) -> str:
    return str(tiny_model_path("llama3"))


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec")
    tok = spec_models.tokenizer_only(Path(target), root / "tok")
    small = spec_models.DRAFT
    import tiny_models

    return {
        "small": str(tiny_models.build_tiny_model(small, root / "draft", tok)),
        "eagle3": str(spec_models.build_eagle3_head(Path(target), root / "eagle3")),
    }


ALGOS = {
    "ngram": lambda t, d: {"speculative_algorithm": "ngram", "speculative_ngram_min": 2},
    "draft-small": lambda t, d: {"speculative_algorithm": "draft", "speculative_draft_model": d["small"]},
    "draft-self": lambda t, d: {"speculative_algorithm": "draft", "speculative_draft_model": t},
    "eagle3": lambda t, d: {"speculative_algorithm": "eagle3", "speculative_draft_model": d["eagle3"]},
}


def spec_llm(target: str, drafts: dict[str, str], algo: str, **options) -> LLM:
    opts = {"speculative_num_draft_tokens": K, **ALGOS[algo](target, drafts), **options}
    return LLM(target, device="cpu", dtype="float32", **opts)


@pytest.fixture(scope="module")
def workload() -> list[tuple[list[int], int]]:
    rng = random.Random(7)
    phrase = [rng.randrange(300, 3000) for _ in range(9)]
    return [
        (phrase * 5, 30),  # long and repetitive: the n-gram drafter proposes from the prompt
        ([rng.randrange(300, 3000) for _ in range(3)], 7),
        ([rng.randrange(300, 3000) for _ in range(61)], 1),  # one token: no verify step at all
        (phrase * 2 + [5, 6], 11),
        ([rng.randrange(300, 3000) for _ in range(20)], 25),
    ]


def params(workload, stops: dict[int, str] | None = None, stop_ids: dict[int, int] | None = None
           ) -> list[SamplingParams]:
    stops, stop_ids = stops or {}, stop_ids or {}
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, stop=stops.get(i),
                           stop_token_ids=[stop_ids[i]] if i in stop_ids else None)
            for i, (_, m) in enumerate(workload)]


@pytest.fixture(scope="module")
def plain(target, workload) -> LLM:
    return LLM(target, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference(plain, workload) -> tuple[list[dict], dict, list[dict]]:
    """Greedy outputs without speculation; stop strings cut from the middle of two of them and
    a stop token from the middle of a third, and the outputs with those stops."""
    out = plain.generate([p for p, _ in workload], params(workload), use_tqdm=False)
    stops = {}
    for i in (0, 4):
        text = out[i]["text"]
        assert len(text) > 12
        stops[i] = text[len(text) // 2 : len(text) // 2 + 3]
    stop_ids = {3: out[3]["token_ids"][5]}
    with_stops = plain.generate([p for p, _ in workload], params(workload, stops, stop_ids), use_tqdm=False)
    assert all(with_stops[i]["finish_reason"] == "stop" for i in [*stops, *stop_ids])
    return out, {"stops": stops, "stop_ids": stop_ids}, with_stops


@pytest.mark.parametrize("algo", list(ALGOS))
def test_greedy_output_is_lossless(target, drafts, workload, reference, algo: str) -> None:
    out, stops, with_stops = reference
    llm = spec_llm(target, drafts, algo)
    prompts = [p for p, _ in workload]
    # Prompts without a stop run to max_tokens: their outputs are `out`'s.
    alone = [i for i in range(len(out)) if i not in {*stops["stops"], *stops["stop_ids"]}]
    spec_models.assert_same_outputs([with_stops[i] for i in alone], [out[i] for i in alone])
    spec_models.assert_same_outputs(llm.generate(prompts, params(workload, **stops), use_tqdm=False), with_stops)
    st = llm.scheduler.stats()
    assert st["spec_verified"] > 0 and st["spec_proposed"] > 0
    if algo == "draft-self":
        assert st["spec_accepted"] == st["spec_proposed"], "the target as its own draft must accept every token"
    llm.scheduler.check_integrity()
    assert llm.engine.allocator.free_pages + llm.scheduler.cache.cached_pages == llm.engine.allocator.total_pages


@pytest.mark.parametrize("algo", ["ngram", "draft-self"])
def test_seeded_sampling_is_the_same_with_and_without_speculation(target, drafts, workload, plain, algo: str) -> None:
    """Every drafter is greedy (one-hot q): a verify row draws its token as the plain sampler draws
    it at (seed, step) and accepts the draft when they agree (kernels/spec_accept.py), so seeded
    sampled output is the plain output token for token (fp32 on the CPU: the verify and decode
    logits differ only in rounding, which a draw meets with negligible probability). A low
    temperature, so that the tiny random model's drafts are accepted at all, but not greedy."""
    sp = [SamplingParams(max_tokens=m, temperature=0.05, top_p=0.95, top_k=20, seed=100 + i, ignore_eos=True)
          for i, (_, m) in enumerate(workload)]
    prompts = [p for p, _ in workload]
    want = plain.generate(prompts, sp, use_tqdm=False)
    greedy = plain.generate(prompts, params(workload), use_tqdm=False)
    assert [o["token_ids"] for o in want] != [o["token_ids"] for o in greedy], "the sampling must not be greedy"
    llm = spec_llm(target, drafts, algo)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    st = llm.scheduler.stats()
    assert st["spec_verified"] > 0 and st["spec_accepted"] > 0, "no draft was accepted: the test shows nothing"


def test_target_as_own_draft_accepts_k_plus_one(target, drafts) -> None:
    """Prefill makes 1 token, then each verify step 1 + K: a mean accepted length of K + 1."""
    llm = spec_llm(target, drafts, "draft-self", speculative_num_draft_tokens=4)
    out = llm.generate([[400, 401, 402]], SamplingParams(max_tokens=1 + 6 * 5, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    st = llm.scheduler.stats()
    assert len(out[0]["token_ids"]) == 31
    assert st["spec_verified"] == 6 and st["spec_accepted"] == 6 * 4


def test_penalties_bias_min_tokens_in_verify_steps(target, drafts, workload, reference, plain) -> None:
    """Penalties, logit bias, min_tokens and top_logprobs apply at every verified row, the
    penalty counts of row j including the drafts before it: outputs equal speculation off
    (tokens, logprobs, alternatives), and the requests speculate. The first request repeats a
    biased token until its frequency penalty stops it; n-gram drafts the repetition, so a row
    that missed the drafts before it in its counts would repeat it too long."""
    out, _, _ = reference
    prompts = [[1500, 1600, 1700], workload[0][0], workload[4][0]]
    sp = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=1.0,
                         logit_bias={1234: 10.0}),
          SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, presence_penalty=0.5, top_logprobs=2,
                         logit_bias={out[0]["token_ids"][0]: -100.0}),
          SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, min_tokens=6,
                         stop_token_ids=[out[4]["token_ids"][2]])]
    want = plain.generate(prompts, sp, use_tqdm=False)
    assert want[0]["token_ids"][:4] == [1234] * 4 and want[0]["token_ids"].count(1234) < 24
    assert want[1]["token_ids"][0] != out[0]["token_ids"][0] and want[2]["token_ids"] != out[4]["token_ids"][:16]
    llm = spec_llm(target, drafts, "ngram", speculative_ngram_min=1)
    spec_models.assert_same_outputs(llm.generate(prompts[:1], sp[:1], use_tqdm=False), want[:1])
    st = llm.scheduler.stats()  # alone: its steps were verify steps, not a plain fallback
    assert st["spec_verified"] >= 10 and st["spec_accepted"] > 0
    spec_models.assert_same_outputs(llm.generate(prompts, sp, use_tqdm=False), want)
    llm.scheduler.check_integrity()


def test_grammar_rows_decode_plainly_beside_speculation(target, drafts, workload, plain) -> None:
    """A grammar-constrained request drafts nothing (its one verify row is masked) while the
    others in its batch speculate: greedy outputs equal speculation off (seeded sampling draws
    the same token on the GPU, where both paths run the Triton kernels)."""
    regex = r"(yes|no), [a-z]{1,6}@[a-z]{2,5}\.(com|org)"
    prompts = [workload[1][0], workload[0][0]]
    sp = [SamplingParams(max_tokens=40, temperature=0.0, regex=regex),
          SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    want = plain.generate(prompts, sp, use_tqdm=False)
    assert want[0]["finish_reason"] == "stop" and len(want[0]["token_ids"]) > 8
    llm = spec_llm(target, drafts, "draft-self")
    spec_models.assert_same_outputs(llm.generate(prompts, sp, use_tqdm=False), want)
    st = llm.scheduler.stats()
    assert st["spec_verified"] > 0 and st["spec_accepted"] > 0, "the unconstrained request speculated"
    llm.scheduler.check_integrity()


@pytest.mark.parametrize(
    "algo,options",
    [
        ("draft-self", {"num_pages": 21, "page_size": 4, "max_prefill_tokens": 16}),
        ("eagle3", {"num_pages": 81, "page_size": 1, "max_prefill_tokens": 32, "cache": "naive",
                    "disable_overlap": True}),
    ],
    ids=["self-radix-page4", "eagle3-naive-page1"],
)
def test_scheduler_pressure_matches_alone(target, drafts, plain, algo: str, options: dict) -> None:
    """Random arrivals, shared prefixes, aborts, a pool small enough to retract: every request
    that is not aborted finishes with its solo greedy tokens and log-probabilities."""
    rng = random.Random(3)
    shared = [rng.randrange(300, 3000) for _ in range(16)]
    work = [((shared[: rng.choice([4, 8])] if i % 2 else []) + [rng.randrange(300, 3000) for _ in range(
        rng.choice([2, 9, 12]))], rng.choice([3, 40, 40])) for i in range(8)]
    sp = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
    solo = []
    for (p, _), s in zip(work, sp):
        req = plain._make_request(p, s)
        plain.scheduler.add(req)
        while plain.scheduler.has_work:
            plain.scheduler.step()
        solo.append(req)
    llm = spec_llm(target, drafts, algo, **options)
    sched, pending, reqs, cancel = llm.scheduler, list(enumerate(work)), {}, {3, 6}
    steps = 0
    while pending or sched.has_work:
        for _ in range(rng.choice([0, 1, 2])):
            if pending:
                i, _ = pending.pop(0)
                reqs[i] = llm._make_request(work[i][0], sp[i])
                sched.add(reqs[i])
        for i in cancel:
            if i in reqs and not reqs[i].finished and rng.random() < 0.3:
                sched.finish(reqs[i], "abort")
        sched.step()
        sched.check_integrity()
        steps += 1
        assert steps < 2000
    for i, req in reqs.items():
        if req.finish_reason == "abort":
            continue
        assert req.output == solo[i].output, f"request {i}"
        assert max(abs(a - b) for a, b in zip(req.logprobs, solo[i].logprobs)) < 1e-4
    assert sched.num_retractions > 0, "the pool should have forced a retraction"
    assert llm.engine.allocator.free_pages + sched.cache.cached_pages == llm.engine.allocator.total_pages


@pytest.mark.parametrize("algo", ["draft-self", "eagle3"])
def test_draft_table_mixes_plain_overlapped_decodes(target, drafts, workload, reference, tmp_path, algo) -> None:
    """At 3+ running requests the table gives k = 0: plain decodes (overlapped, through the
    draft's KV mirror) alternate with verify steps as requests finish."""
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"num_draft_tokens": {"1": K, "3": 0}}))
    llm = spec_llm(target, drafts, algo, speculative_draft_table=str(table))
    out, _, _ = reference
    few = [0, 1, 3, 4]  # 4 requests: plain decodes at first, verify steps once two finished
    got = llm.generate([workload[i][0] for i in few], [params(workload)[i] for i in few], use_tqdm=False)
    spec_models.assert_same_outputs(got, [out[i] for i in few])
    st = llm.scheduler.stats()
    if algo == "draft-self":  # the mirror of plain decodes kept the draft's KV exact
        assert 0 < st["spec_accepted"] == st["spec_proposed"]


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="speculative_draft_model"):
        LLM(None, device="cpu", speculative_algorithm="draft")
    with pytest.raises(ValueError, match="speculative_algorithm"):
        LLM(None, device="cpu", speculative_algorithm="medusa")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        LLM(None, device="cpu", speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="speculative_ngram_min"):
        LLM(None, device="cpu", speculative_algorithm="ngram", speculative_ngram_min=3, speculative_ngram_max=2)


def test_draft_model_vocabulary_must_match(target, tmp_path) -> None:
    cfg = json.loads((Path(target) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        LLM(target, device="cpu", load_format="dummy", speculative_algorithm="draft",
            speculative_draft_model=str(tmp_path))


def test_tp2_equals_tp1(target, drafts, workload, reference) -> None:
    """Two ranks (gloo, CPU) draft, verify and accept alike: greedy and seeded sampling equal TP=1.

    Both run the served gate (the other rank runs in a spawned process, where conftest's open
    gate does not reach) and the same calls in the same order, since the gate's state carries
    from one call to the next: a seeded request's tokens depend on which of its steps verified
    (rejection sampling draws differently from a plain decode), only their distribution does not."""
    out, _, _ = reference
    few = [0, 1, 3]
    prompts = [workload[i][0] for i in few]
    greedy = [params(workload)[i] for i in few]
    sampled = [SamplingParams(max_tokens=workload[i][1], temperature=0.9, top_k=20, seed=i) for i in few]
    one = spec_llm(target, drafts, "draft-small")
    one.scheduler.spec.gate.min_accepted = 0.5  # gate.MIN_ACCEPTED as served
    spec_models.assert_same_outputs(one.generate(prompts, greedy, use_tqdm=False), [out[i] for i in few])
    want = one.generate(prompts, sampled, use_tqdm=False)
    two = spec_llm(target, drafts, "draft-small", tp_size=2)
    two.scheduler.spec.gate.min_accepted = 0.5
    try:
        spec_models.assert_same_outputs(two.generate(prompts, greedy, use_tqdm=False), [out[i] for i in few])
        spec_models.assert_same_outputs(two.generate(prompts, sampled, use_tqdm=False), want)
        schedule = ("spec_verified", "spec_paused_steps", "spec_proposed", "spec_accepted")
        st1, st2 = one.scheduler.stats(), two.scheduler.stats()
        assert st2["spec_paused_steps"] > 0, "the gate must have paused: the draft model is random"
        assert {k: st2[k] for k in schedule} == {k: st1[k] for k in schedule}
    finally:
        two.shutdown()
