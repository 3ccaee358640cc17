"""Logprobs through the whole engine (tiny random-weight model, fp32, CPU) against transformers:
top_logprobs equal the log-softmax top-k of transformers' logits at every generated position
(also with penalties and sampling: alternatives are of the raw distribution); prompt_logprobs
equal transformers' prompt log-softmax, with chunked prefill and with a warm radix cache
holding the prompt (the request computes every position anyway); the scheduler's TokenOut
fields carry them as msgpack lists."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.scheduler.process import logprob_extras

PROMPTS = [[5, 6, 7, 8, 9] * 4, list(range(300, 317)), [42]]


@pytest.fixture(scope="module")
def path(tiny_model_path) -> str:
    return str(tiny_model_path("llama3"))


@pytest.fixture(scope="module")
def hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(path) -> LLM:
    # Chunked prefill (7 tokens a step), pages of 4, radix cache, overlap on.
    return LLM(path, device="cpu", dtype="float32", max_prefill_tokens=7, page_size=4)


def hf_log_softmax(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def assert_pairs(got: list[tuple[int, float]], lp_row: torch.Tensor, k: int) -> None:
    want_vals, want_ids = lp_row.topk(k)
    assert [t for t, _ in got] == want_ids.tolist()
    torch.testing.assert_close([v for _, v in got], want_vals.tolist(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=5),
        SamplingParams(max_tokens=6, temperature=0.7, seed=4, ignore_eos=True, top_logprobs=20,
                       repetition_penalty=1.6, presence_penalty=0.5, logit_bias={11: 3.0}),
    ],
    ids=["greedy", "sampled-penalized"],
)
def test_top_logprobs_equal_transformers(hf, llm, params: SamplingParams) -> None:
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, o in zip(PROMPTS, out):
        full = prompt + o["token_ids"]
        lp = hf_log_softmax(hf, full)[len(prompt) - 1 : len(full) - 1]
        assert len(o["top_logprobs"]) == len(o["token_ids"]) == len(o["logprobs"]) == params.max_tokens
        for j, (tok, chosen, top) in enumerate(zip(o["token_ids"], o["logprobs"], o["top_logprobs"])):
            assert_pairs(top, lp[j], params.top_logprobs)
            torch.testing.assert_close(chosen, float(lp[j, tok]), rtol=1e-4, atol=1e-4)


def check_prompt_logprobs(hf, prompt: list[int], got: list, k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    lp = hf_log_softmax(hf, prompt)
    for j in range(1, len(prompt)):
        value, top = got[j]
        torch.testing.assert_close(value, float(lp[j - 1, prompt[j]]), rtol=1e-4, atol=1e-4)
        if k:
            assert_pairs(top, lp[j - 1], k)
        else:
            assert top == []


def test_prompt_logprobs_chunked_and_with_a_warm_cache(hf, llm, monkeypatch) -> None:
    prompt = list(range(200, 223))  # 23 tokens: 4 chunks of at most 7
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    want = llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"]  # now the cache holds the prompt
    sched = llm.scheduler
    assert sched.cache.cached_pages >= len(prompt) // 4
    extra_rows: list[int] = []  # logits rows each step computed for prompt logprobs
    build = llm.engine.build_batch

    def spy(*args, **kwargs):
        extra_rows.append(len(args[4] if len(args) > 4 else kwargs.get("extra_logit_rows") or []))
        return build(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "build_batch", spy)
    for k, rows in ((0, 512), (3, 5)):  # prefill chunks of 7 (the budget), then of 5 (logits rows)
        sched.prompt_logprob_rows = rows
        extra_rows.clear()
        asking = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=k)
        req = llm._make_request(prompt, asking)
        other = llm._make_request(PROMPTS[1], greedy)  # shares the extend steps, asks nothing
        sched.add(req)
        sched.add(other)
        while sched.has_work:
            sched.step()
        assert req.cache_hit_tokens == 0, "a prompt_logprobs request computes every position"
        assert req.output == want and other.prompt_logprobs is None
        check_prompt_logprobs(hf, prompt, req.prompt_logprobs, k)
        assert sum(extra_rows) == len(prompt) - 1 and max(extra_rows) == min(7, rows)
    # Its KV still went to the cache: a plain repeat hits it.
    again = llm._make_request(prompt, greedy)
    sched.add(again)
    while sched.has_work:
        sched.step()
    assert again.cache_hit_tokens >= 20 and again.output == want
    sched.check_integrity()


def test_prompt_logprobs_through_generate(hf, llm) -> None:
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2, top_logprobs=1)
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, o in zip(PROMPTS, out):
        check_prompt_logprobs(hf, prompt, o["prompt_logprobs"], 2)
    assert out[2]["prompt_logprobs"] == [None]  # a one-token prompt has nothing to score
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert "prompt_logprobs" not in plain and "top_logprobs" not in plain and len(plain["logprobs"]) == 2


def test_token_out_fields_as_msgpack_lists(llm) -> None:
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=1, top_logprobs=2)
    req = llm._make_request([7, 8, 9, 10], params)
    llm.scheduler.add(req)
    while llm.scheduler.has_work:
        llm.scheduler.step()
    top, prompt = logprob_extras(req, 1, first=True)
    assert top == [[list(p) for p in alts] for alts in req.top_logprobs[1:]] and len(top) == 2
    assert prompt[0] is None and len(prompt) == 4
    assert all(isinstance(e, list) and isinstance(e[1][0], list) for e in prompt[1:])
    assert logprob_extras(req, 0, first=False)[1] is None
    plain = llm._make_request([7, 8], SamplingParams(max_tokens=1))
    assert logprob_extras(plain, 0, first=True) == (None, None)
