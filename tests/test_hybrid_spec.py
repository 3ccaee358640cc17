"""Speculative decoding on hybrid linear-attention models (CPU, fp32, tiny random qwen3_next and
qwen3_5): a verify step runs the Gated DeltaNet layers without storing their states and the
accepted tokens advance them afterwards (Qwen3NextForCausalLM.commit_verify), so greedy output
equals speculation off with drafts accepted in part, eagerly and through verify graphs (the CPU
replay runner), and seeded sampling is the plain sampler's token for token. States and
snapshots do not leak. The tiny random models never repeat themselves (the n-gram drafter
would propose nothing), so an oracle drafter proposes the known continuation with a wrong
token at every third step: every verify accepts some drafts and rejects others."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import spec_models
from graph_replay import graph_llm

from minisgl import LLM, SamplingParams
from minisgl.speculative.drafter import Drafter, DraftRequest

K = 3
NGRAM = {"speculative_algorithm": "ngram", "speculative_ngram_min": 2, "speculative_num_draft_tokens": K}


def workload() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(3)
    phrase = [rng.randrange(300, 3000) for _ in range(7)]
    prompts = [phrase * 6, [rng.randrange(300, 3000) for _ in range(5)], phrase * 2 + [9, 10],
               [rng.randrange(300, 3000) for _ in range(23)]]
    return prompts, [40, 9, 24, 30]


class OracleDrafter(Drafter):
    """Proposes each request's known continuation (`want`: prompt -> output ids), the second
    draft made wrong whenever the output length is 1 mod 3."""

    name = "oracle"

    def __init__(self, want: dict[tuple[int, ...], list[int]]) -> None:
        self.want = want

    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        out = []
        for r in reqs:
            n = len(r.output)
            d = list(self.want[tuple(r.prompt)][n : n + r.k])
            if len(d) > 1 and n % 3 == 1:
                d[1] = d[1] + 1
            out.append(d)
        return out


def with_oracle(llm: LLM, prompts: list[list[int]], outs: list[dict]) -> LLM:
    llm.engine.drafter = OracleDrafter({tuple(p): o["token_ids"] for p, o in zip(prompts, outs, strict=True)})
    return llm


def greedy(lens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]


def check_no_leaks(llm: LLM) -> None:
    llm.scheduler.check_integrity()
    pool = llm.engine.state_pool
    assert pool.free_slots == pool.num_slots, "a state slot leaked"


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_greedy_ngram_equals_plain_with_partial_acceptance(name: str,
                                                             tiny_model_path: Callable[[str], Path]) -> None:
    path = str(tiny_model_path(name))
    prompts, lens = workload()
    want = LLM(path, device="cpu", dtype="float32").generate(prompts, greedy(lens), use_tqdm=False)
    llm = with_oracle(LLM(path, device="cpu", dtype="float32", **NGRAM), prompts, want)
    spec_models.assert_same_outputs(llm.generate(prompts, greedy(lens), use_tqdm=False), want)
    st = llm.scheduler.stats()
    assert st["spec_accepted"] > 0, "no draft accepted: the commit of accepted tokens is not shown"
    assert st["spec_accepted"] < st["spec_proposed"], "every draft accepted: the rollback is not shown"
    check_no_leaks(llm)


def test_verify_graphs_equal_plain_and_take_verify_layouts_only(tiny_model_path: Callable[[str], Path]) -> None:
    """Through the graph path: verify steps replay graphs captured as verify steps (never an
    extend bucket, whose captured forward stores the states), and the output equals plain."""
    path = str(tiny_model_path("qwen3_next"))
    prompts, lens = workload()
    opts = dict(max_prefill_tokens=48, max_running_requests=4, page_size=2)
    want = LLM(path, device="cpu", dtype="float32", **opts).generate(prompts, greedy(lens), use_tqdm=False)
    llm = with_oracle(graph_llm(path, decode_kernel=True, **NGRAM, **opts), prompts, want)
    runner = llm.engine.graphs
    assert runner.verify and all(x.verify for x in runner.verify)
    assert all(x.verify for x in runner._all_rows), "a verify step may take an extend bucket"
    spec_models.assert_same_outputs(llm.generate(prompts, greedy(lens), use_tqdm=False), want)
    assert runner.replays["verify"] > 0 and llm.scheduler.stats()["spec_accepted"] > 0
    check_no_leaks(llm)


def test_seeded_sampling_is_the_same_with_and_without_speculation(tiny_model_path: Callable[[str], Path]) -> None:
    path = str(tiny_model_path("qwen3_5"))
    prompts, lens = workload()
    sp = [SamplingParams(max_tokens=n, temperature=0.05, top_k=20, top_p=0.95, seed=50 + i, ignore_eos=True)
          for i, n in enumerate(lens)]
    plain = LLM(path, device="cpu", dtype="float32")
    want = plain.generate(prompts, sp, use_tqdm=False)
    assert [o["token_ids"] for o in want] != [o["token_ids"] for o in plain.generate(prompts, greedy(lens),
                                                                                      use_tqdm=False)]
    llm = with_oracle(LLM(path, device="cpu", dtype="float32", **NGRAM), prompts, want)
    assert [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)] == [o["token_ids"] for o in want]
    st = llm.scheduler.stats()
    assert 0 < st["spec_accepted"] < st["spec_proposed"]
    check_no_leaks(llm)


def test_what_cannot_draft_for_a_hybrid_is_refused_by_name(tiny_model_path: Callable[[str], Path]) -> None:
    path = str(tiny_model_path("qwen3_next"))
    with pytest.raises(ValueError, match="draft model .* keeps recurrent state"):
        LLM(path, device="cpu", dtype="float32", speculative_algorithm="draft", speculative_draft_model=path)
    with pytest.raises(ValueError, match="EAGLE-3 heads read Llama-family hidden states"):
        LLM(path, device="cpu", dtype="float32", speculative_algorithm="eagle3", speculative_draft_model=path)
