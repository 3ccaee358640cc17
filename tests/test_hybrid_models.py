"""Hybrid linear-attention models (issue 34, first slice): Qwen3-Next and Qwen3.5's text model
(Qwen3.5's MoE text model in the prefill test) against transformers on the CPU in fp32, through
the step kinds the recurrent state can break: prefill, decode, chunked prefill continuing the
state across chunks, mixed steps with requests of different lengths, retraction and resume (the
state recomputed), no prefix-cache hits, and a multimodal Qwen3.5 checkpoint served as its text
model. Tiny models: 8 layers, 6 of them Gated DeltaNet, partial rotary 0.25, GQA in both layer kinds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from model_compare import greedy, hf_model, multimodal_folder, random_prompts, record_prefix_hits
from test_models_hf import hf_greedy

from minisgl import LLM, SamplingParams
from minisgl.core.model_config import ModelConfig

HYBRID = ["qwen3_next", "qwen3_5"]


@pytest.fixture(scope="module")
def hf_models() -> dict[str, object]:
    return {}


@pytest.mark.parametrize("name", [*HYBRID, "qwen3_5_moe"])
def test_prefill_logits_match_hf(name: str, tiny_model_path: Callable[[str], Path],
                                 hf_models: dict[str, object]) -> None:
    path = tiny_model_path(name)
    hf = hf_model(path, hf_models)
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.engine.pool.num_layers == 2, "the KV pool should hold the 2 full-attention layers only"
    prompts = random_prompts(1, (1, 7, 70))
    for prompt, ours in zip(prompts, llm.engine.score(prompts), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel <= 1e-4, f"{name}: prompt of {len(prompt)} ids, rel err {rel:.2e}"
    assert llm.engine.state_pool.free_slots == llm.engine.state_pool.num_slots


@pytest.mark.parametrize("name", HYBRID)
@pytest.mark.parametrize("chunk", [8, 24, 200])
def test_chunked_prefill_and_mixed_batches(name: str, chunk: int, tiny_model_path: Callable[[str], Path],
                                           hf_models: dict[str, object]) -> None:
    """Several requests of different lengths at once: chunks smaller than the prompts (the
    state continues across chunks), and one larger than all of them; offline, the decodes
    ride in mixed steps beside the next prompt's chunks."""
    path = tiny_model_path(name)
    llm = LLM(str(path), device="cpu", dtype="float32", max_prefill_tokens=chunk)
    prompts = random_prompts(chunk, (53, 17, 70, 1))
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o["token_ids"] == hf_greedy(hf_model(path, hf_models), p, 16), f"{name}, chunk {chunk}, {len(p)} tokens"
    llm.scheduler.check_integrity()
    pool = llm.engine.state_pool
    assert pool.free_slots == pool.num_slots, "a state slot leaked"


@pytest.mark.parametrize("snapshots", [0, None])
def test_prefix_hits_resume_snapshots_and_retraction_resumes(
        tiny_model_path: Callable[[str], Path], hf_models: dict[str, object], snapshots: int | None) -> None:
    """Requests sharing a 40-token prefix: with state snapshots (the default) later ones resume
    the recurrence from a snapshot (the second one recomputes up to the branch point and
    snapshots it there); with `state_snapshots=0` none takes a hit (the radix cache still holds
    the KV). A KV pool too small for all of them at once forces retractions: a retracted request
    recomputes (or resumes) its state. Either way every request gives transformers' tokens."""
    path = tiny_model_path("qwen3_next")
    hf = hf_model(path, hf_models)
    llm = LLM(str(path), device="cpu", dtype="float32", page_size=4, num_pages=41, max_running_requests=4,
              max_prefill_tokens=32, state_snapshots=snapshots)
    # Admit on the prompts alone (no room counted for the outputs): decodes then run the pool out.
    sched = llm.scheduler
    sched.cfg = dataclasses.replace(sched.cfg, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    sched.new_token_ratio = 0.0
    shared = random_prompts(5, (40,))[0]
    prompts = [shared + tail for tail in random_prompts(6, (3, 9, 5, 12))]
    hits = record_prefix_hits(llm)
    # The first two alone (the second caches the branch point), then all four at once.
    asked = [prompts[0], prompts[1], *prompts]
    groups = (prompts[:1], prompts[1:2], prompts)
    outs = [o for group in groups for o in llm.generate(group, greedy(40), use_tqdm=False)]
    want = {tuple(p): hf_greedy(hf, p, 40) for p in prompts}
    for p, o in zip(asked, outs, strict=True):
        assert o["token_ids"] == want[tuple(p)], f"prompt of {len(p)} tokens"
    if snapshots == 0:
        assert hits and set(hits) == {0}, f"a hybrid model took a prefix hit without snapshots: {hits}"
    else:
        assert max(hits) >= 40, f"no request resumed the shared prefix's snapshot: {hits}"
        assert sched.cache.num_snapshots > 0
    assert sched.cache.match_prefix(shared, whole=True).matched_tokens >= 36, "the shared prefix's KV was not cached"
    assert sched.num_retractions > 0, "the tight KV pool should have forced a retraction"
    sched.check_integrity()
    assert llm.engine.state_pool.free_slots == llm.engine.state_pool.num_slots


def test_state_pool_no_leak_after_random_requests(tiny_model_path: Callable[[str], Path]) -> None:
    """1,000 random requests (prompts on a few shared prefixes with random tails, random
    lengths and arrivals, aborts at random points, a tight KV pool: retractions) on 4 state
    slots and 3 snapshot slots (so snapshots are dropped LRU and evicted with their KV): after
    every few steps every state slot is free or held by exactly one admitted request and every
    snapshot slot free or held by one radix node; at the end all running slots are free."""
    import random

    llm = LLM(str(tiny_model_path("qwen3_next")), device="cpu", dtype="float32", page_size=4, num_pages=31,
              max_running_requests=4, max_prefill_tokens=16, state_snapshots=3, state_snapshot_interval=8)
    sched, pool = llm.scheduler, llm.engine.state_pool
    rng = random.Random(3)
    heads = [[rng.randrange(10, 900) for _ in range(k)] for k in (0, 8, 12, 24)]
    total, n, live, steps, peak, hits = 1000, 0, [], 0, 0, record_prefix_hits(llm)
    while n < total or sched.has_work:
        for _ in range(rng.choice([0, 1, 2, 3])):
            if n < total:
                tail = [rng.randrange(10, 900) for _ in range(rng.choice([1, 3, 9, 20]))]
                req = llm._make_request(rng.choice(heads) + tail, SamplingParams(
                    max_tokens=rng.choice([1, 2, 4, 20]), temperature=0.0, ignore_eos=True))
                sched.add(req)
                live.append(req)
                n += 1
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            if not victim.finished:
                sched.finish(victim, "abort")
        live = [r for r in live if not r.finished]
        sched.step()
        peak = max(peak, pool.num_slots - pool.free_slots)
        steps += 1
        assert steps < 100000, "scheduler made no progress"
        if steps % 5 == 0:
            sched.check_integrity()
    sched.check_integrity()
    assert pool.free_slots == pool.num_slots, "a state slot leaked"
    assert peak == pool.num_slots, "the state pool never filled"
    assert sum(h > 0 for h in hits) > 100, f"only {sum(h > 0 for h in hits)} snapshot hits"
    stats = sched.stats()
    assert stats["state_slots_total"] == 4 and stats["state_slots_used"] == 0
    assert stats["state_snapshots_total"] == 3 and stats["state_snapshots"] == sched.cache.num_snapshots > 0
    assert sched.num_retractions > 0, "the tight KV pool should have forced a retraction"
    llm.shutdown()


def test_multimodal_qwen3_5_checkpoint_serves_its_text_model(tiny_model_path: Callable[[str], Path], tmp_path: Path,
                                                              hf_models: dict[str, object]) -> None:
    """A Qwen3_5ForConditionalGeneration folder: the text config under text_config, the language
    model's tensors under model.language_model., a vision tower and an MTP head that are skipped."""
    from safetensors.torch import save_file

    src = tiny_model_path("qwen3_5")
    dst = tmp_path / "qwen3_5_mm"
    text = multimodal_folder(src, dst, "Qwen3_5ForConditionalGeneration", "qwen3_5", {"tie_word_embeddings": False})
    tensors = {(k if k.startswith("lm_head.") else "model.language_model." + k.removeprefix("model.")): v
               for k, v in text.items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    tensors["mtp.fc.weight"] = torch.randn(8, 8)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    mc = ModelConfig.from_folder(dst)
    assert mc.linear_attn is not None and mc.linear_attn.layers == (True, True, True, False) * 2
    llm = LLM(str(dst), device="cpu", dtype="float32")
    prompt = random_prompts(3, (37,))[0]
    assert llm.generate([prompt], greedy(10), use_tqdm=False)[0]["token_ids"] == \
        hf_greedy(hf_model(src, hf_models), prompt, 10)


def test_what_is_not_built_yet_is_refused_by_name(tiny_model_path: Callable[[str], Path]) -> None:
    path = tiny_model_path("qwen3_next")
    mc = ModelConfig.from_folder(path)
    assert mc.num_kv_layers == 2 and mc.partial_rotary_factor == 0.25 and mc.moe.shared_expert_intermediate_size
    mc.check_tp(2)  # whole k-heads per rank
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\) is not divisible by the tensor-parallel size 4"):
        mc.check_tp(4)


@pytest.mark.parametrize(("name", "chunk"), [("qwen3_next", None), ("qwen3_5", None), ("qwen3_next", 48)])
def test_shared_prefix_hits_its_snapshot_and_equals_no_hit(tiny_model_path: Callable[[str], Path], name: str,
                                                           chunk: int | None) -> None:
    """64 requests sharing a 100-token system prompt (the first alone, then the other 63 at
    once): the second recomputes up to the branch point and snapshots it, the other 62 resume
    there (hit rate > 90%). Tokens identical and logprobs within 1e-4 of the same requests with
    no snapshots (every prompt computed from its first token); also with prompts chunked by 48
    (snapshots every 32 tokens: the branch point is not a chunk boundary of the first request)."""
    path = str(tiny_model_path(name))
    opts = {} if chunk is None else {"max_prefill_tokens": chunk, "state_snapshot_interval": 32}
    system = random_prompts(11, (100,))[0]
    prompts = [system + tail for tail in random_prompts(12, tuple(3 + i % 7 for i in range(64)))]
    params = greedy(3)
    outs = {}
    for snaps in (None, 0):
        llm = LLM(path, device="cpu", dtype="float32", page_size=1, max_running_requests=64, state_snapshots=snaps,
                  **opts)
        hits = record_prefix_hits(llm)
        outs[snaps] = [o for group in (prompts[:1], prompts[1:]) for o in llm.generate(group, params, use_tqdm=False)]
        llm.scheduler.check_integrity()
        if snaps is None:
            rate = sum(h >= 100 for h in hits) / len(prompts)
            assert rate > 0.9, f"prefix-cache hit rate {rate:.2f} on the shared system prompt (hits {hits})"
        else:
            assert set(hits) == {0}
    for a, b in zip(outs[None], outs[0], strict=True):
        assert a["token_ids"] == b["token_ids"]
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("supersede", [True, False])
def test_long_prompts_interval_snapshots_leave_room_for_each_other(
        tiny_model_path: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, supersede: bool) -> None:
    """The documents workload (benchmarks/prefix_share.py --documents) in small: 4 documents of
    56 tokens, asked one question each (one after the other, so chunks end on multiples of 16),
    then a second one each, at once. Prompts are chunked by 16 with snapshots every 8 tokens, so
    each first question leaves interval snapshots at 16, 32 and 48 and one at its end: 16 for 12
    snapshot slots (the second questions, admitted two at a time by the prefill budget, take
    two each: at the branch point and the end). Each interval snapshot supersedes its prompt's
    previous one, so every document keeps its deepest (48) and every second question resumes
    there. Without that rule (the radix cache's `supersede_snapshot` disabled, the
    case this test must catch) plain LRU keeps only the last documents' snapshots. Tokens equal
    those of the same requests without snapshots."""
    from minisgl.kvcache.radix_cache import RadixCache

    if not supersede:
        monkeypatch.setattr(RadixCache, "supersede_snapshot", lambda self, token_ids: None)
    path = str(tiny_model_path("qwen3_next"))
    docs = random_prompts(21, (56,) * 4)
    firsts = [d + t for d, t in zip(docs, random_prompts(22, (5, 7, 4, 6)), strict=True)]
    seconds = [d + t for d, t in zip(docs, random_prompts(23, (6, 3, 8, 5)), strict=True)]
    outs = {}
    for snaps in (12, 0):
        llm = LLM(path, device="cpu", dtype="float32", page_size=1, max_running_requests=4, max_prefill_tokens=16,
                  state_snapshots=snaps, state_snapshot_interval=8)
        for first in firsts:
            llm.generate([first], greedy(2), use_tqdm=False)
        hits = record_prefix_hits(llm)
        outs[snaps] = llm.generate(seconds, greedy(4), use_tqdm=False)
        llm.scheduler.check_integrity()
        llm.shutdown()
        if snaps and supersede:
            assert hits == [48] * 4, f"second questions' hits {hits}: a document's deepest snapshot was dropped"
        elif snaps:
            assert min(hits) < 48, f"plain LRU kept every document's snapshot ({hits}): the test cannot tell"
    for a, b in zip(outs[12], outs[0], strict=True):
        assert a["token_ids"] == b["token_ids"]


@pytest.mark.parametrize("name", HYBRID)
def test_tp2_with_snapshot_hits_equals_tp1(tiny_model_path: Callable[[str], Path], name: str) -> None:
    """TP 2 over gloo (each rank one k-head with its two v-heads, its own state pool and
    snapshots): requests sharing a 40-token prefix, the first alone then the rest at once, give
    the TP 1 tokens, and rank 0 resumes the shared prefix's snapshot."""
    path = str(tiny_model_path(name))
    shared = random_prompts(21, (40,))[0]
    prompts = [shared + tail for tail in random_prompts(22, (3, 9, 5, 12))]
    groups = (prompts[:1], prompts[1:2], prompts)
    one = LLM(path, device="cpu", dtype="float32", page_size=1)
    want = [o["token_ids"] for g in groups for o in one.generate(g, greedy(12), use_tqdm=False)]
    two = LLM(path, device="cpu", dtype="float32", page_size=1, tp_size=2)
    try:
        assert two.engine.state_pool.state.shape[2] == 2, "a rank holds half the v-heads"
        hits = record_prefix_hits(two)
        got = [o["token_ids"] for g in groups for o in two.generate(g, greedy(12), use_tqdm=False)]
    finally:
        two.shutdown()
    assert got == want
    assert max(hits) >= 40, f"no request resumed the shared prefix's snapshot under TP: {hits}"


def test_a_state_pool_too_large_for_the_gpu_names_the_flags() -> None:
    """Qwen3.5-27B's shapes: a slot is 147 MiB, so 256 running requests + 256 snapshots do not fit
    the ~13 GiB an H100 leaves beside its weights; the error says how many do (the engine checks
    it at start on a GPU; here the function it calls)."""
    from minisgl.kvcache.state_pool import StatePool, state_pool_fit_error

    la = ModelConfig.from_folder(Path(__file__).resolve().parent.parent / "benchmarks/configs/qwen3.5-27b").linear_attn
    per_slot = StatePool.bytes_per_slot_for(la.num_linear_layers, la.conv_kernel, la.conv_dim, la.num_v_heads,
                                            la.k_head_dim, la.v_head_dim, torch.bfloat16)
    assert round(per_slot / 2**20) == 147
    why = state_pool_fit_error("Qwen3_5ForCausalLM", per_slot, 256, 256, True, 13 * 2**30)
    assert why is not None and "lower --max-running-requests" in why and "22 fit with as many snapshots" in why, why
    assert "--state-snapshots" in why
    assert "none fits" in state_pool_fit_error("X", per_slot, 4, 100, False, 13 * 2**30)
    assert state_pool_fit_error("X", per_slot, 20, 20, True, 13 * 2**30) is None
