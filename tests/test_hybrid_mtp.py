"""MTP speculation (`speculative_algorithm="mtp"`, CPU, fp32): tiny qwen3_next (MoE) and qwen3_5
checkpoints given an MTP head (tests/mtp_models.py). The head's drafts equal an independent
computation with transformers' decoder layer; greedy output equals speculation off, eagerly
and with the draft chain and verify steps replaying graphs (the CPU replay runner); seeded
sampling is the plain sampler's; on a 64-token vocabulary the first two sampled tokens follow
plain sampling's exact distribution (test_spec_sampling's chi-square test). Options that cannot
work are refused by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mtp_models
import pytest
import spec_models
import tiny_models
import torch
from graph_replay import graph_llm
from model_compare import hf_model
from test_hybrid_spec import greedy, workload
from test_spec_sampling import PROMPT, SIGNIFICANCE, exact_joint, goodness_of_fit_p

from minisgl import LLM, SamplingParams

K = 3
MTP = {"speculative_algorithm": "mtp", "speculative_num_draft_tokens": K}


@pytest.fixture(scope="module")
def mtp_path(tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = mtp_models.add_mtp_head(tiny_model_path(name), tmp_path_factory.mktemp("mtp") / name)
        return built[name]

    return get


def record_proposals(llm: LLM) -> list[tuple[list[int], int, list[int]]]:
    """(context, k, drafts) of every request at every propose call, copied at the call."""
    drafter, seen = llm.engine.drafter, []
    propose = drafter.propose

    def wrapped(reqs):  # noqa: ANN001, ANN202
        out = propose(reqs)
        seen.extend((list(r.prompt) + list(r.output), r.k, d) for r, d in zip(reqs, out, strict=True) if r.k)
        return out

    drafter.propose = wrapped
    return seen


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_drafts_equal_the_reference_and_greedy_is_lossless(name: str, mtp_path: Callable[[str], Path]) -> None:
    path = mtp_path(name)
    prompts, lens = workload()
    want = LLM(str(path), device="cpu", dtype="float32").generate(prompts, greedy(lens), use_tqdm=False)
    llm = LLM(str(path), device="cpu", dtype="float32", **MTP)
    seen = record_proposals(llm)
    spec_models.assert_same_outputs(llm.generate(prompts, greedy(lens), use_tqdm=False), want)
    assert llm.scheduler.stats()["spec_verified"] > 0 and len(seen) > 8
    ref = mtp_models.MtpReference(path, hf_model(path, {}))
    # Not the request that shares prompt 0's prefix: after a radix hit the head's K/V at the
    # prefix's last position is the one computed with the first request's next token (as
    # EAGLE-3's, speculative/eagle3.py): its drafts may differ, never its output.
    seen = [x for x in seen if x[0][: len(prompts[2])] != prompts[2]]
    for context, k, drafts in seen[:: max(1, len(seen) // 8)]:
        assert drafts == ref.drafts(context, k), f"{name}: drafts after a context of {len(context)} tokens"
    llm.scheduler.check_integrity()
    assert llm.engine.state_pool.free_slots == llm.engine.state_pool.num_slots


def test_graph_path_equals_plain(mtp_path: Callable[[str], Path]) -> None:
    """Verify steps replay verify graphs, the draft chain its own; after_forward reads the
    target's final hidden states that the graph left."""
    path = str(mtp_path("qwen3_next"))
    prompts, lens = workload()
    opts = dict(max_prefill_tokens=48, max_running_requests=4, page_size=2)
    want = LLM(path, device="cpu", dtype="float32", **opts).generate(prompts, greedy(lens), use_tqdm=False)
    llm = graph_llm(path, decode_kernel=True, **MTP, **opts)
    seen = record_proposals(llm)
    spec_models.assert_same_outputs(llm.generate(prompts, greedy(lens), use_tqdm=False), want)
    assert llm.engine.graphs.replays["verify"] > 0
    assert llm.engine.drafter.steps.graphs.replays["decode"] > 0, "the draft chain replays its graphs"
    ref = mtp_models.MtpReference(Path(path), hf_model(Path(path), {}))
    seen = [x for x in seen if x[0][: len(prompts[2])] != prompts[2]]  # (the radix hit: see above)
    for context, k, drafts in seen[:: max(1, len(seen) // 6)]:
        assert drafts == ref.drafts(context, k), f"drafts after a context of {len(context)} tokens"
    llm.scheduler.check_integrity()


def test_seeded_sampling_is_the_same_with_and_without_mtp(mtp_path: Callable[[str], Path]) -> None:
    path = str(mtp_path("qwen3_5"))
    prompts, lens = workload()
    sp = [SamplingParams(max_tokens=n, temperature=0.7, top_k=20, seed=70 + i, ignore_eos=True)
          for i, n in enumerate(lens)]
    want = LLM(path, device="cpu", dtype="float32").generate(prompts, sp, use_tqdm=False)
    llm = LLM(path, device="cpu", dtype="float32", **MTP)
    assert [o["token_ids"] for o in llm.generate(prompts, sp, use_tqdm=False)] == [o["token_ids"] for o in want]
    assert llm.scheduler.stats()["spec_verified"] > 0


SMALL_HYBRID = tiny_models.TinySpec(
    "qwen3_5_small_vocab", "qwen3_5_text", "smollm2",
    {**tiny_models._HYBRID, "vocab_size": 64, "tie_word_embeddings": False, "initializer_range": 0.3},
    seed=15,
)
N = 1500


def test_first_two_sampled_tokens_follow_plain_sampling(tiny_model_path: Callable[[str], Path],
                                                        tmp_path: Path) -> None:
    """Temperature 1 on a 64-token vocabulary: the (t1, t2) pairs of N seeded requests with MTP
    (t2 from a verify step with one draft) against P(t1) P(t2 | t1) from the model's logits."""
    tok = spec_models.tokenizer_only(Path(tiny_model_path("llama3")), tmp_path / "tok")
    base = tiny_models.build_tiny_model(SMALL_HYBRID, tmp_path / "base", tok)
    path = str(mtp_models.add_mtp_head(base, tmp_path / "mtp"))
    llm = LLM(path, device="cpu", dtype="float32", max_running_requests=N, max_prefill_tokens=4 * N,
              speculative_algorithm="mtp", speculative_num_draft_tokens=2)
    sp = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, temperature=1.0) for s in range(N)]
    outs = [o["token_ids"] for o in llm.generate([PROMPT] * N, sp, use_tqdm=False)]
    st = llm.scheduler.stats()
    assert st["spec_verified"] >= N and st["spec_accepted"] > 0, st
    pairs = [(t[0], t[1]) for t in outs]
    joint = exact_joint(llm, 1.0, -1, 1.0)
    assert goodness_of_fit_p(pairs, joint) > SIGNIFICANCE
    assert goodness_of_fit_p(pairs, exact_joint(llm, 1.5, -1, 1.0), strict=False) < 1e-6  # the test has power


def test_what_mtp_cannot_do_is_refused_by_name(tiny_model_path: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="has no MTP head"):
        LLM(str(tiny_model_path("qwen3_next")), device="cpu", dtype="float32", **MTP)
    with pytest.raises(ValueError, match="LlamaForCausalLM has none"):
        LLM(str(tiny_model_path("llama3")), device="cpu", dtype="float32", **MTP)
    with pytest.raises(ValueError, match="mtp drafts with the MTP head"):
        LLM(str(tiny_model_path("qwen3_next")), device="cpu", dtype="float32", **MTP,
            speculative_draft_model=str(tiny_model_path("llama3")))


def test_dummy_weights_build_a_head(tiny_model_path: Callable[[str], Path]) -> None:
    """--load-format dummy (benchmarks on real shapes): a random head of the checkpoint's shape."""
    llm = LLM(str(tiny_model_path("qwen3_next")), device="cpu", dtype="float32", load_format="dummy", **MTP)
    out = llm.generate([[5, 6, 7, 8]], greedy([6]), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 6 and torch.isfinite(llm.engine.drafter.head.model.fc.weight).all()
