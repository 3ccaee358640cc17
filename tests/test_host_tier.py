"""The host KV tier (kvcache/host_tier.py): evicted prefixes keep their KV in a second pool
(a CPU tensor here, pinned host memory on CUDA; same code path) and come back on a hit."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.kvcache.host_tier import HostKVTier
from minisgl.kvcache.pool import KVPool, PageAllocator, RequestTable
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.ops.kv_copy import copy_slots
from minisgl.scheduler.kv import RequestKV

LAYERS, HEADS, DIM = 2, 2, 4


def _gb(pages: int, page_size: int) -> float:
    return pages * page_size * 2 * LAYERS * HEADS * DIM * 4 / 2**30


def _value(tokens, i: int) -> float:
    return float(tokens[i] * 1000 + i)  # the "KV" of position i: a function of its prefix's end


@pytest.mark.parametrize("chunks", [1, 2], ids=["one-chunk", "chunks-of-layers"])
def test_store_load_roundtrip_and_lru_order(chunks) -> None:
    ps = 2
    pool = KVPool(LAYERS, 16, ps, HEADS, DIM, torch.float32, torch.device("cpu"))
    pool._k.normal_()
    pool._v.normal_()
    tier = HostKVTier(pool, _gb(3, ps))
    assert tier.num_pages == 3 and tier._chunks == [(0, LAYERS, None)]
    if chunks > 1:  # as on CUDA, where a load lands in chunks of layers (without events here)
        tier._chunks = [(0, 1, None), (1, LAYERS, None)]
    a, b, c = (1, 2, 3, 4), (1, 2, 5, 6), (7, 8)
    want = {p: (pool._k[:, p * ps : (p + 1) * ps].clone(), pool._v[:, p * ps : (p + 1) * ps].clone())
            for p in (1, 2, 3, 4)}
    tier.on_evict(a, [1, 2])  # both pages of a
    tier.on_evict(b, [3])  # b's own page; its first page (shared with a) is already on the host
    assert tier.used_pages == 3 and tier.pages_stored == 3
    tier.check_integrity()
    # Copies are exact: load them into other GPU pages.
    nodes = tier.lookup(b, 0)
    assert len(nodes) == 2
    tier.load(nodes, [10, 11])
    torch.testing.assert_close(pool._k[:, 20:22], want[1][0], rtol=0, atol=0)
    torch.testing.assert_close(pool._v[:, 22:24], want[3][1], rtol=0, atol=0)
    # LRU: b was touched last, so a's own leaf page (3, 4) is the one evicted for c.
    tier.on_evict(c, [4])
    tier.check_integrity()
    assert len(tier.lookup(a, 0)) == 1 and len(tier.lookup(b, 0)) == 2 and len(tier.lookup(c, 0)) == 1
    # Those lookups left (1, 2) oldest, then b's (5, 6), then c: an inner page is never evicted
    # before its leaves, so b's own page goes.
    tier.on_evict((9, 9), [5])
    assert len(tier.lookup(c, 0)) == 1 and len(tier.lookup(b, 0)) == 1 and len(tier.lookup((9, 9), 0)) == 1
    tier.check_integrity()
    tier.reset()
    tier.check_integrity()
    assert tier.used_pages == 0


class _Req:
    needs_prompt_logprobs = False
    pooling = None
    state_slot = -1  # no linear-attention state (scheduler/request.Request's default)

    def __init__(self, toks: list[int]) -> None:
        self.toks = self.prompt = toks
        self.cache_hit_tokens = 0
        self.match = None

    def tokens(self) -> list[int]:
        return self.toks


@pytest.mark.parametrize("page_size", [1, 2])
def test_random_requests_no_leak_and_exact_kv(page_size) -> None:
    """1,000 requests (some cancelled mid-way) on a pool holding a small part of the working
    set: every prefix served from either tier holds exactly its KV, and no page or host slot
    leaks."""
    ps, num_pages = page_size, 48 // page_size
    pool = KVPool(LAYERS, num_pages, ps, HEADS, DIM, torch.float32, torch.device("cpu"))
    pool._k.fill_(float("nan"))
    pool._v.fill_(float("nan"))
    alloc = PageAllocator(num_pages, ps)
    engine = SimpleNamespace(
        cfg=SimpleNamespace(page_size=ps, speculative_algorithm=None), allocator=alloc, pool=pool,
        table=RequestTable(8, 64, torch.device("cpu")), write_slots=lambda *a: None,
        model_config=SimpleNamespace(has_sliding_layers=False), drafter=None)
    cache = RadixCache(ps)
    kv = RequestKV(engine, cache, _gb(40 // ps, ps))
    rng = random.Random(7)
    convs = [[rng.randrange(1, 50) for _ in range(4)] for _ in range(12)]
    loaded_hits = 0
    for n in range(1000):
        conv = convs[rng.randrange(len(convs))]
        if len(conv) > 40:
            conv[4:] = []  # a new conversation on the same system prompt
        conv.extend(rng.randrange(1, 50) for _ in range(rng.randrange(1, 6)))
        req = _Req(list(conv))
        before = kv.tier.hits
        match = kv.match_and_load(req)
        loaded_hits += kv.tier.hits > before
        kv.attach(req, match)
        slots = alloc.slot_ids(req.pages)
        for i in range(req.cached_len):  # the matched prefix holds its exact KV
            assert pool._k[0, slots[i], 0, 0].item() == _value(req.toks, i), f"request {n}, position {i}"
        end = len(req.toks) if rng.random() > 0.1 else rng.randrange(req.cached_len, len(req.toks) + 1)  # cancel
        assert kv.grow(req, end), "the pool holds one request"
        slots = alloc.slot_ids(req.pages)
        for i in range(req.cached_len, end):  # "compute" the rest
            pool._k[:, slots[i]] = _value(req.toks, i)
            pool._v[:, slots[i]] = -_value(req.toks, i)
        req.cached_len = end
        kv.release(req)
        kv.check_integrity([])
    assert alloc.free_pages + cache.cached_pages == alloc.total_pages
    assert loaded_hits > 50, "the workload should hit host copies often"
    used = kv.tier.used_pages
    assert used + len(kv.tier._free) == kv.tier.num_pages and used > 0


def test_multi_turn_greedy_tokens_identical_with_tier(tiny_model_path) -> None:
    path = str(tiny_model_path("qwen3"))
    rng = random.Random(3)
    system = [rng.randrange(100, 4000) for _ in range(10)]
    outs = {}
    for gb in (0.0, 0.01):
        llm = LLM(path, device="cpu", dtype="float32", num_pages=90, page_size=1, host_kv_cache_gb=gb)
        rng = random.Random(5)
        convs = [list(system) for _ in range(4)]
        got = []
        for _turn in range(3):
            for c in convs:  # one conversation at a time: each turn's prefix was evicted meanwhile
                c.extend(rng.randrange(100, 4000) for _ in range(12))
                res = llm.generate([c], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                   use_tqdm=False)[0]
                c.extend(res["token_ids"])
                got.append((res["token_ids"], res["logprobs"]))
        llm.scheduler.check_integrity()
        tier = llm.scheduler.kv.tier
        if gb:
            assert tier.hits > 0 and tier.tokens_loaded > 0, "the tier should have served later turns"
        else:
            assert tier is None
        outs[gb] = got
    # Greedy tokens identical; logprobs equal up to fp32 reassociation (a hit computes fewer
    # positions per step than a recompute, so the matmul shapes differ).
    assert [t for t, _ in outs[0.0]] == [t for t, _ in outs[0.01]]
    torch.testing.assert_close(torch.tensor([lp for _, lp in outs[0.01]]), torch.tensor([lp for _, lp in outs[0.0]]),
                               rtol=1e-4, atol=1e-4)


def test_a_loaded_request_is_admitted_in_the_step_of_its_load(tiny_model_path) -> None:
    """A request whose prefix comes back from the host tier is admitted in the step that starts
    its load (its attention waits per chunk of layers; on the CPU the copy is synchronous) and
    gives the tier-off run's tokens; a request needing the same pages then matches them on the
    GPU (one load); every extend step, and no decode step, passes the pool's load wait of every
    layer; a request aborted right after the step that loaded it leaks no page or host slot."""
    path = str(tiny_model_path("qwen3"))
    rng = random.Random(11)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 4000) for _ in range(n)]

    llm = LLM(path, device="cpu", dtype="float32", num_pages=160, page_size=1, host_kv_cache_gb=0.01)
    sched, kv = llm.scheduler, llm.scheduler.kv
    pool = kv.engine.pool
    a = prompt(30)
    a2 = a + llm.generate([a], params, use_tqdm=False)[0]["token_ids"] + prompt(8)
    twin_prompt = a2[:-8] + prompt(8)  # needs the same host pages
    ref = LLM(path, device="cpu", dtype="float32", num_pages=160, page_size=1)
    want, want_twin = (o["token_ids"] for o in ref.generate([a2, twin_prompt], params, use_tqdm=False))

    waits: list[tuple[str, int]] = []
    modes: list[str] = []
    prepare = kv.engine.attn.prepare

    def seen_prepare(batch):  # noqa: ANN001, ANN202 - the step's mode, then its layers' waits
        modes.append(batch.mode)
        return prepare(batch)

    kv.engine.attn.prepare = seen_prepare
    pool.wait_loaded = lambda layer: waits.append((modes[-1], layer))
    llm.generate([prompt(40) for _ in range(4)], params, use_tqdm=False)  # a's KV is evicted to the host tier
    assert sched.cache.match_prefix(a2[:-1]).matched_tokens < len(a), "a's prefix should have left the GPU pool"
    layers = list(range(kv.engine.model_config.num_layers))
    assert "decode" in modes and not any(m == "decode" for m, _ in waits), "a decode step waited for loads"
    for mode in {m for m in modes if m != "decode"}:
        per_step = [layer for m, layer in waits if m == mode]
        assert per_step and per_step[: len(layers)] == layers, f"a {mode} step skipped a layer's load wait"

    hits = kv.tier.hits
    req = llm._make_request(a2, params)
    sched.add(req)
    sched.step()
    assert req not in sched.queues.waiting and kv.tier.hits == hits + 1, "not admitted in the step of its load"
    assert req.cache_hit_tokens >= len(a), "the loaded prefix was not used"
    twin = llm._make_request(twin_prompt, params)
    sched.add(twin)
    while sched.has_work:
        sched.step()
        sched.check_integrity()
    assert req.output == want and twin.output == want_twin
    assert twin.cache_hit_tokens >= len(a) and kv.tier.hits == hits + 1, "the twin loaded the same pages again"

    # Aborted right after the step that loaded it: the loaded pages stay cached, nothing leaks.
    a3 = a2 + want + prompt(5)
    llm.generate([prompt(40) for _ in range(4)], params, use_tqdm=False)
    req3 = llm._make_request(a3, params)
    sched.add(req3)
    sched.step()
    assert kv.tier.hits == hits + 2 and req3 not in sched.queues.waiting
    sched.finish(req3, "abort")
    sched.check_integrity()
    while sched.has_work:
        sched.step()
    assert sched.cache.match_prefix(a3[:-1], whole=True).matched_tokens >= len(a2) - 1
    sched.check_integrity()
    assert kv.flush_cache([]) is None and kv.allocator.free_pages == kv.allocator.total_pages


def test_copy_slots_by_chunks_of_layers() -> None:
    """A load's path: the layers chunk by chunk, `after_chunk(i)` once each chunk is enqueued;
    every layer copied exactly once; ranges outside the layers refused."""
    src_k, src_v = torch.randn(5, 9, 2, 3), torch.randn(5, 9, 2, 3)
    dst_k, dst_v = torch.full((5, 7, 2, 3), float("nan")), torch.full((5, 7, 2, 3), float("nan"))
    seen: list[int] = []
    copy_slots(src_k, src_v, [8, 1, 4], dst_k, dst_v, [0, 6, 3], [(0, 2), (2, 3), (3, 5)], seen.append)
    assert seen == [0, 1, 2]
    assert torch.equal(dst_k[:, [0, 6, 3]], src_k[:, [8, 1, 4]])
    assert torch.equal(dst_v[:, [0, 6, 3]], src_v[:, [8, 1, 4]])
    assert bool(dst_k[:, [1, 2, 4, 5]].isnan().all())
    with pytest.raises(ValueError, match="layer chunks"):
        copy_slots(src_k, src_v, [1], dst_k, dst_v, [1], [(0, 6)])


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copy_slots_matches_indexing(device, dtype) -> None:
    """Both directions (device -> host, host -> device) against plain torch indexing, on fresh
    random data with scattered, unsorted slots; untouched destination slots stay NaN."""

    g = torch.Generator().manual_seed(0)
    shape = (3, 64, 2, 8)
    dev_k, dev_v = (torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2))
    host_k, host_v = (torch.full(shape, float("nan")).to(dtype) for _ in range(2))
    src = torch.randperm(64, generator=g)[:20].tolist()
    dst = torch.randperm(64, generator=g)[:20].tolist()
    copy_slots(dev_k, dev_v, src, host_k, host_v, dst)
    assert torch.equal(host_k[:, dst], dev_k[:, src].cpu()) and torch.equal(host_v[:, dst], dev_v[:, src].cpu())
    rest = sorted(set(range(64)) - set(dst))
    assert host_k[:, rest].isnan().all()
    back_k, back_v = (torch.full(shape, float("nan")).to(dtype).to(device) for _ in range(2))
    copy_slots(host_k, host_v, dst, back_k, back_v, src)
    assert torch.equal(back_k[:, src], dev_k[:, src]) and torch.equal(back_v[:, src], dev_v[:, src])
    with pytest.raises(ValueError, match="source slots"):
        copy_slots(dev_k, dev_v, src, host_k, host_v, dst[:-1])


def test_metrics_export_host_tier_over_replicas() -> None:
    from minisgl.message import StatsMsg, decode, encode
    from minisgl.server.metrics import Metrics

    m = Metrics()
    for rank in (0, 1):
        msg = StatsMsg(1, 0, 10, 100, 50, 20, dp_rank=rank, host_kv_bytes=1000 + rank, host_kv_hits=3,
                       host_kv_tokens_loaded=70, host_kv_load_s=0.25)
        m.on_stats(decode(encode(msg)))  # the fields survive the wire
    text = m.render().decode()
    for line in ("minisgl_host_kv_bytes_used 2001.0", "minisgl_host_kv_hits 6.0",
                 "minisgl_host_kv_tokens_loaded 140.0", "minisgl_host_kv_load_seconds 0.5"):
        assert line in text, line


def test_pinned_empty_registers_exactly_and_unregisters_after_the_last_view(monkeypatch) -> None:
    """The tier's host pool: exactly its bytes page-locked (no power-of-two block), 64-byte
    aligned, and unregistered only once no view of it is left (a GPU kernel may still use one)."""
    import gc

    from minisgl.ops import kv_copy

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - cudart's name
            calls.append(("register", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):  # noqa: N802
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    t = kv_copy.pinned_empty((2, 3, 5, 2, 8), torch.bfloat16)
    assert t.shape == (2, 3, 5, 2, 8) and t.dtype == torch.bfloat16 and t.data_ptr() % 64 == 0
    (kind, ptr, size, flags), = calls
    assert kind == "register" and flags == 3 and 2 * t.numel() <= size <= 2 * t.numel() + 64
    assert ptr <= t.data_ptr() < ptr + 64
    half = t[1]
    del t
    gc.collect()
    assert len(calls) == 1, "unregistered while a view is alive"
    half.fill_(1.0)
    del half
    gc.collect()
    assert calls[-1] == ("unregister", ptr)
