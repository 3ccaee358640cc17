"""The window-sized KV pool group (issue 33): sliding-window layers keep only their window.

End to end on the tiny SWA models (W = 16) against transformers, a pool unit check (what a
running request holds), and the KV-capacity claim for Gemma-3-27B shapes."""

from __future__ import annotations

import pytest
import torch
from test_models_hf import hf_greedy

from minisgl import LLM, SamplingParams
from minisgl.kvcache.pool import KVPool, split_kv_budget, swa_tokens_needed

W = 16
N_REQ = 1000


def _llm(path, page_size: int, chunk: int, **kw) -> LLM:
    llm = LLM(str(path), device="cpu", dtype="float32", page_size=page_size, max_prefill_tokens=chunk,
              max_running_requests=4, **kw)
    pool = llm.engine.pool
    assert pool.swa_pages > 0 and pool.num_swa_layers > 0, "the sliding group was not built"
    # NaN everywhere: a sliding layer that read a freed (dummy) slot would poison the logits.
    pool._k_swa.fill_(float("nan"))
    pool._v_swa.fill_(float("nan"))
    return llm


@pytest.mark.parametrize("name,page_size,chunk", [("qwen2_swa", 1, 8), ("qwen2_swa", 4, 40), ("mistral_swa", 4, 12)])
def test_window_pool_matches_hf(tiny_model_path, name: str, page_size: int, chunk: int) -> None:
    """Greedy tokens equal transformers' with chunks below and above W, a sliding pool far
    smaller than the tokens run (its pages are recycled), and prefix-cache hits before and
    after the window moved."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_path(name)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # Sliding pool: about 3 windows' worth of pages per request (full pool: 320 tokens).
    llm = _llm(path, page_size, chunk, num_pages=320 // page_size + 1, swa_full_tokens_ratio=0.5)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (70, 45, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    sched = llm.scheduler
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs, strict=True):
        assert o["token_ids"] == hf_greedy(hf, p, 30), f"{name}: prompt of {len(p)}"
    swa_total = llm.engine.swa_allocator.total_pages * page_size
    assert swa_total < sum(len(p) + 30 for p in prompts), "the sliding pool never had to recycle"
    sched.check_integrity()
    # Hits: a prompt extending a finished request's tokens (its window is cached: a full hit),
    # and one ending inside the first prompt (its window's sliding KV was freed: recomputed).
    longer = prompts[0] + outs[0]["token_ids"] + [5, 6, 7]
    inside = prompts[0][:40]
    assert sched.cache.match_prefix(longer[:-1]).matched_tokens >= len(prompts[0])
    cut, whole = sched.cache.match_prefix(inside[:-1]), sched.cache.match_prefix(inside[:-1], whole=True)
    assert cut.matched_tokens < whole.matched_tokens, "the hit inside the moved window was not truncated"
    outs2 = llm.generate([longer, inside], params)
    assert outs2[0]["token_ids"] == hf_greedy(hf, longer, 30)
    assert outs2[1]["token_ids"] == hf_greedy(hf, inside, 30)
    sched.check_integrity()
    llm.shutdown()


def test_request_holds_only_its_window(tiny_model_path) -> None:
    """After 10 x W generated tokens a running request holds all its full-layer pages and only
    the sliding pages of its window: ceil-to-pages of W..W+page positions."""
    for ps in (1, 4):
        llm = _llm(tiny_model_path("qwen2_swa"), ps, 64, num_pages=400 // ps + 1, swa_full_tokens_ratio=0.5)
        sched = llm.scheduler
        prompt = list(range(3, 3 + 2 * W))
        from minisgl.scheduler.request import Request

        req = Request(uid=0, prompt=prompt, params=SamplingParams(temperature=0.0, max_tokens=10 * W + 5,
                                                                  ignore_eos=True),
                      seed=0, eos_ids=frozenset(), max_total_len=len(prompt) + 10 * W + 5)
        sched.add(req)
        while len(req.output) < 10 * W:
            sched.step()
        sched.check_integrity()
        assert len(req.pages) * ps >= req.seq_len - 1  # every full-layer slot
        held = [p for p in req.swa_pages if p]
        # Before the next step (prefix = seq_len - 1) it needs positions >= prefix - W + 1,
        # plus at most the page the last token is written to.
        lo = ((req.seq_len - 1) - W + 1) // ps
        assert len(held) <= len(req.pages) - lo + 1 and len(held) * ps <= W + 2 * ps, (ps, len(held))
        assert len(held) * ps >= W - ps
        assert all(p == 0 for p in req.swa_pages[: max(0, lo - 1)])
        llm.shutdown()


def test_gemma3_27b_capacity_at_least_4x() -> None:
    """Gemma-3-27B shapes (62 layers: 52 sliding of W = 1024 and 10 full, 16 KV heads of 128,
    bf16), the same bytes: the two groups hold >= 4x the tokens of one full pool, with the
    flag the benchmark sets (0.1) and with the default for 8 running requests at 32k."""
    dt = torch.bfloat16
    full_bpt = KVPool.bytes_per_token_for(10, 16, 128, dt)
    swa_bpt = KVPool.bytes_per_token_for(52, 16, 128, dt)
    one = KVPool.bytes_per_token_for(62, 16, 128, dt)
    budget = 20 * (1 << 30)
    single = budget / one
    for ratio, requests in ((0.1, 256), (None, 8)):
        full, swa = split_kv_budget(budget, full_bpt, swa_bpt, 16, ratio, swa_tokens_needed(requests, 1024, 16))
        assert (full * full_bpt + swa * swa_bpt) * 16 <= budget + 2 * 16 * (full_bpt + swa_bpt)
        assert (full - 1) * 16 >= 4 * single, (ratio, full * 16 / single)


@pytest.mark.parametrize("cache,page_size", [("radix", 4), ("naive", 1)])
def test_no_leak_after_1000_random_requests(tiny_model_path, cache: str, page_size: int) -> None:
    """1,000 random requests (shared prefixes, random arrivals, aborts at random points) on
    tight pools (evictions and retractions): after every step free + cached + in use == total
    in both groups, and at the end everything is free or cached, nothing locked."""
    import random

    llm = LLM(str(tiny_model_path("qwen2_swa")), device="cpu", dtype="float32", page_size=page_size,
              cache=cache, num_pages=160 // page_size + 1, swa_full_tokens_ratio=0.6, max_running_requests=8,
              max_prefill_tokens=24)
    sched, eng = llm.scheduler, llm.engine
    rng = random.Random(page_size)
    shared = [rng.randrange(10, 900) for _ in range(48)]
    n, live, steps = 0, [], 0
    while n < N_REQ or sched.has_work:
        for _ in range(rng.choice([0, 1, 2, 3])):
            if n < N_REQ:
                own = [rng.randrange(10, 900) for _ in range(rng.choice([1, 3, 9, 14]))]
                prompt = shared[: rng.choice([0, 8, 20, 48])] + own
                req = llm._make_request(prompt, SamplingParams(max_tokens=rng.choice([1, 2, 4, 20]),
                                                               temperature=0.0, ignore_eos=True))
                sched.add(req)
                live.append(req)
                n += 1
        if live and rng.random() < 0.15:  # abort one at a random point
            victim = rng.choice(live)
            if not victim.finished:
                sched.finish(victim, "abort")
        live = [r for r in live if not r.finished]
        sched.step()
        steps += 1
        assert steps < 20000, "scheduler made no progress"
        if steps % 7 == 0:
            sched.check_integrity()
    sched.check_integrity()
    assert sched.cache.protected_pages == 0
    assert eng.allocator.free_pages + sched.cache.cached_pages == eng.allocator.total_pages
    assert eng.swa_allocator.free_pages + sched.cache.cached_swa_pages == eng.swa_allocator.total_pages
    if cache == "radix" and page_size == 4:
        assert sched.num_retractions > 0, "the tight pools should have forced a retraction"
    llm.shutdown()


def test_radix_window_rule_tombstones_and_trim() -> None:
    """The radix cache's sliding pages: a hit only as far as the window's sliding KV exists,
    tombstones filled by a later insert, trim_swa frees what no reader's window reaches, and
    eviction frees both kinds."""
    from minisgl.kvcache.radix_cache import RadixCache

    c = RadixCache(2, window=4)  # pages of 2 tokens, W = 4
    ids = list(range(100, 112))  # 6 pages
    assert c.insert(ids, [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 15, 16]) == 0
    c.check_integrity()
    assert c.match_prefix(ids).matched_tokens == 12  # window [9, 12): pages 4, 5 held
    assert c.match_prefix(ids[:10]).matched_tokens == 0  # [7, 10) needs page 3: a tombstone
    assert c.match_prefix(ids[:10], whole=True).matched_tokens == 10
    # A second request computed the first 8 tokens: its sliding pages fill the tombstones
    # (its full pages are duplicates: the cache keeps its own).
    assert c.insert(ids[:8], [7, 8, 9, 10], [21, 22, 23, 24]) == 8
    assert c.swa_taken == frozenset({21, 22, 23, 24})
    assert c.match_prefix(ids[:10]).matched_tokens == 10
    c.check_integrity()
    # A sole reader with 12 tokens cached: sliding pages below 12 - 4 + 1 = 9 go (pages 0..3).
    m = c.match_prefix(ids)
    c.lock(m.handle)
    c.trim_swa(m.handle, 12)
    assert sorted(c.take_freed_swa()) == [21, 22, 23, 24]
    assert c.match_prefix(ids, whole=True).swa_pages == [0, 0, 0, 0, 15, 16]
    # A second reader that matched only 8 tokens: nothing it reads may go.
    c.insert(ids[:8], [7, 8, 9, 10], [31, 32, 33, 34])
    c.take_freed_swa()
    short = c.match_prefix(ids[:8])
    assert short.matched_tokens == 8
    c.lock(short.handle)
    c.trim_swa(m.handle, 12)
    assert sorted(c.take_freed_swa()) == [31, 32]  # below 8 - 4 + 1 = 5 only
    assert c.match_prefix(ids[:8], whole=True).swa_pages == [0, 0, 33, 34]  # [5, 8) still held
    c.check_integrity()
    c.unlock(short.handle)
    c.unlock(m.handle)
    assert c.cached_swa_pages == c.evictable_swa_pages
    held = set(c.cached_swa_page_ids())
    assert sorted(c.evict(100)) == [1, 2, 3, 4, 5, 6]
    assert set(c.take_freed_swa()) == held and c.cached_swa_pages == 0
    c.check_integrity()
