"""The host KV tier on a GPU: the gather/scatter copy kernel (csrc/kv_copy.cu) against torch
indexing, the side-stream ordering of stores and loads, and greedy tokens with the tier on/off."""

from __future__ import annotations

import os
import random
import sys
import time

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.kvcache.host_tier import HostKVTier
from minisgl.kvcache.pool import KVPool
from minisgl.ops import kv_copy
from minisgl.ops.kv_copy import copy_slots, pinned_empty

pytestmark = pytest.mark.gpu

POISON = 0xFF  # every byte: NaN in bf16 (0xFFFF) and in e4m3fn (0xFF)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, where: str) -> torch.Tensor:
    # A view into the middle of a larger pinned allocation, like the tier's K and V halves.
    t = pinned_empty((2, *shape), dtype)[1] if where == "pinned" else torch.empty(shape, dtype=dtype, device="cuda")
    _bytes(t).fill_(POISON)
    return t


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device="cuda") * 4).to(dtype)


def _check(dst: torch.Tensor, dst_slots: list[int], src: torch.Tensor, src_slots: list[int]) -> None:
    got, want = _bytes(dst).cpu(), _bytes(src).cpu()
    assert torch.equal(got[:, dst_slots], want[:, src_slots]), "copied rows differ from torch indexing"
    rest = sorted(set(range(dst.shape[1])) - set(dst_slots))
    assert bool((got[:, rest] == POISON).all()), "a slot outside the list was written"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(4, 3000, 8, 128), (2, 100, 2, 6), (3, 257, 3, 5)],
                         ids=["qwen3-rows", "4-byte-rows", "odd-rows"])
def test_copy_kernel_matches_torch_indexing(dtype, shape) -> None:
    """Both directions through pinned host memory, and GPU to GPU, on fresh random data with
    scattered, unsorted slots; each vector width of the kernel (16, 4 and 1 bytes)."""
    layers, slots, heads, dim = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    gpu_k, gpu_v = _random(shape, dtype, gen), _random(shape, dtype, gen)
    host_shape = (layers, slots + 123, heads, dim)
    host_k, host_v = _poisoned(host_shape, dtype, "pinned"), _poisoned(host_shape, dtype, "pinned")
    assert kv_copy._pick(gpu_k, gpu_v, host_k, host_v)[0] == "kernel"
    rng = random.Random(1)
    n = slots // 3
    src = rng.sample(range(slots), n)
    dst = rng.sample(range(host_shape[1]), n)
    copy_slots(gpu_k, gpu_v, src, host_k, host_v, dst)  # GPU -> host
    torch.cuda.synchronize()
    _check(host_k, dst, gpu_k, src)
    _check(host_v, dst, gpu_v, src)
    back_k, back_v = _poisoned(shape, dtype, "cuda"), _poisoned(shape, dtype, "cuda")
    again = rng.sample(range(slots), n)
    copy_slots(host_k, host_v, dst, back_k, back_v, again)  # host -> GPU
    torch.cuda.synchronize()
    _check(back_k, again, host_k, dst)
    _check(back_v, again, host_v, dst)
    gg_k, gg_v = _poisoned(shape, dtype, "cuda"), _poisoned(shape, dtype, "cuda")
    copy_slots(back_k, back_v, again, gg_k, gg_v, src)  # GPU -> GPU
    torch.cuda.synchronize()
    _check(gg_k, src, gpu_k, src)
    _check(gg_v, src, gpu_v, src)


def test_pageable_host_pool_takes_the_torch_path() -> None:
    gpu = torch.randn(2, 64, 2, 8, device="cuda", dtype=torch.bfloat16)
    host = torch.full((2, 64, 2, 8), float("nan"), dtype=torch.bfloat16)
    path, why = kv_copy._pick(gpu, gpu, host, host)
    assert path == "torch" and "pageable" in why
    copy_slots(gpu, gpu, [3, 1], host, host, [5, 9])
    assert torch.equal(host[:, [5, 9]], gpu[:, [3, 1]].cpu())
    with pytest.raises(ValueError, match="destination slots span"):
        copy_slots(gpu, gpu, [3], host, host, [64])


def test_side_stream_copies_are_ordered_against_the_compute_stream() -> None:
    """A write-back reads KV that compute-stream work enqueued before it writes (an in-flight
    step), the freed pages' reuse waits for it, a load lands before the next reader; and the
    host never waits (the compute stream is still busy when the calls return)."""
    layers, heads, dim, n = 4, 8, 128, 2048
    pool = KVPool(layers, 2 * n + 1, 1, heads, dim, torch.bfloat16, torch.device("cuda"))
    _bytes(pool._k).fill_(POISON)
    _bytes(pool._v).fill_(POISON)
    tier = HostKVTier(pool, 2 * n * pool.bytes_per_token / 2**30)
    assert kv_copy._pick(pool._k, pool._v, tier._k, tier._v)[0] == "kernel"
    pages, tokens = list(range(1, n + 1)), tuple(range(n))
    fresh = list(range(n + 1, 2 * n + 1))
    # Device index tensors made first: indexing with a host list would synchronise the host.
    idx, fresh_idx = torch.tensor(pages, device="cuda"), torch.tensor(fresh, device="cuda")
    copy_slots(pool._k, pool._v, pages, pool._k, pool._v, pages)  # the copy path's first-call work
    # Every tensor the test itself needs is allocated before the GPU is kept busy: a first
    # allocation of a size may cudaMalloc, which waits for the device (measured on an H100: the
    # index_select after the load drained the stream the first time and not the second, while
    # the tier's own calls returned with it busy both times).
    truth = torch.randn(layers, n, heads, dim, device="cuda").to(torch.bfloat16)
    neg = -truth
    got_k, got_v = torch.empty_like(truth), torch.empty_like(truth)
    # And every torch op it runs below runs once first: a kernel's first launch may load its
    # module (CUDA lazy loading), which waits for the device (H100, 2026-11-27: with the
    # allocations made first, the first index_select after the load still drained it).
    pool._k.index_copy_(1, idx, truth)
    _bytes(pool._k).index_fill_(1, idx, POISON)
    torch.index_select(pool._k[0], 0, fresh_idx, out=got_k[0])
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of compute-stream work ahead of everything below
    pool._k.index_copy_(1, idx, truth)  # "the in-flight step writes the prefix's KV"
    pool._v.index_copy_(1, idx, neg)
    tier.on_evict(tokens, pages)  # write-back on the copy stream
    assert not torch.cuda.current_stream().query(), "the host waited for the GPU"
    _bytes(pool._k).index_fill_(1, idx, POISON)  # "a later step reuses the freed pages"
    _bytes(pool._v).index_fill_(1, idx, POISON)
    nodes = tier.lookup(tokens, 0)
    assert len(nodes) == n
    with torch.cuda.stream(tier._copier.stream):
        torch.cuda._sleep(500_000_000)  # the load lands well after the compute stream's sleep ends
    tier.load(nodes, fresh)
    assert not torch.cuda.current_stream().query(), "the host waited for the GPU"
    for layer in range(layers):  # "the next step": its attention waits per chunk of layers
        pool.wait_loaded(layer)
        torch.index_select(pool._k[layer], 0, fresh_idx, out=got_k[layer])
        torch.index_select(pool._v[layer], 0, fresh_idx, out=got_v[layer])
    assert not torch.cuda.current_stream().query(), "the host waited for the GPU"
    torch.cuda.synchronize()
    assert torch.equal(got_k, truth) and torch.equal(got_v, neg)
    assert tier.load_seconds > 0 and tier.tokens_loaded == n


def test_a_captured_step_waits_for_a_load_issued_after_capture() -> None:
    """The pool's per-chunk load events are external: a CUDA graph captured before any load (as
    the engine's are) holds event-wait nodes that wait, at replay, for a load issued later. The
    copy stream is held back here (~0.5 s of sleep on it), so a reader that did not wait would
    read the poisoned pages. The first chunk's layers are read before the last chunk's copy
    lands (the overlap), and the host never waits."""
    layers, heads, dim, n = 8, 8, 128, 1024
    pool = KVPool(layers, 2 * n + 1, 1, heads, dim, torch.bfloat16, torch.device("cuda"))
    tier = HostKVTier(pool, 2 * n * pool.bytes_per_token / 2**30)
    chunks = pool.load_chunks
    assert len(chunks) > 1 and chunks[0][0] == 0 and chunks[-1][1] == layers
    pages, tokens = list(range(1, n + 1)), tuple(range(n))
    fresh_idx = torch.tensor(range(n + 1, 2 * n + 1), device="cuda")
    truth = torch.randn(layers, n, heads, dim, device="cuda").to(torch.bfloat16)
    got = torch.empty_like(truth)
    # External: recorded by the graph's replay (a plain event's record inside a capture is not).
    first_read = torch.cuda.Event(enable_timing=True, external=True)
    last_copy = torch.cuda.Event(enable_timing=True)
    copy_slots(pool._k, pool._v, pages, pool._k, pool._v, pages)  # the copy path's first-call work

    def step() -> None:  # "an extend step": per layer, the wait, then a read of the loaded slots
        for layer in range(layers):
            pool.wait_loaded(layer)
            torch.index_select(pool._k[layer], 0, fresh_idx, out=got[layer])
            if layer == chunks[0][1] - 1:
                first_read.record()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    pool._k[:, 1 : n + 1] = truth
    tier.on_evict(tokens, pages)  # to the host
    torch.cuda.synchronize()
    _bytes(pool._k).fill_(POISON)
    nodes = tier.lookup(tokens, 0)
    torch.cuda.synchronize()
    with torch.cuda.stream(tier._copier.stream):
        torch.cuda._sleep(1_000_000_000)  # the copies below start ~0.5 s late
    tier.load(nodes, list(range(n + 1, 2 * n + 1)))
    with torch.cuda.stream(tier._copier.stream):
        last_copy.record()
    graph.replay()
    assert not torch.cuda.current_stream().query(), "the host waited for the GPU"
    torch.cuda.synchronize()
    assert torch.equal(got, truth), "the graph read pages before their load landed"
    # The first chunk's reads ran before the last chunk's copy finished: layers overlap the load.
    assert first_read.elapsed_time(last_copy) > 0


def _finishes(seconds: float) -> bool:
    """Whether the current stream drains within `seconds` (a deadlock would never)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if torch.cuda.current_stream().query():
            return True
        time.sleep(0.01)
    return False


def test_a_load_issued_while_a_waiting_replay_is_queued_does_not_deadlock() -> None:
    """The overlap scheduler issues step N+1's load while step N's graph (whose waits may not
    have run yet) is queued: the load's copy waits for step N, so step N must not wait for the
    load's fresh records. An event-wait node waits for the record before its graph's launch."""
    layers, heads, dim, n = 4, 8, 128, 256
    pool = KVPool(layers, 2 * n + 1, 1, heads, dim, torch.bfloat16, torch.device("cuda"))
    tier = HostKVTier(pool, 2 * n * pool.bytes_per_token / 2**30)
    pages, tokens = list(range(1, n + 1)), tuple(range(n))
    got = torch.empty(n, heads, dim, device="cuda", dtype=torch.bfloat16)
    idx = torch.tensor(range(n + 1, 2 * n + 1), device="cuda")
    copy_slots(pool._k, pool._v, pages, pool._k, pool._v, pages)

    def step() -> None:
        for layer in range(layers):
            pool.wait_loaded(layer)
        torch.index_select(pool._k[layers - 1], 0, idx, out=got)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    tier.on_evict(tokens, pages)
    nodes = tier.lookup(tokens, 0)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # "step N-1" still running: the replay below is queued
    graph.replay()  # "step N"
    tier.load(nodes, list(range(n + 1, 2 * n + 1)))  # "step N+1's admission": its copy waits for step N
    graph.replay()  # "step N+1"
    if not _finishes(30.0):
        # The GPU is stuck: nothing after this in the process could run. Say why, then stop.
        print("DEADLOCK: a replay waited for a load enqueued after its launch", file=sys.stderr, flush=True)
        os._exit(3)
    torch.cuda.synchronize()


def test_fence_keeps_a_late_load_from_overwriting_reused_pages() -> None:
    """Pages a load is still writing, freed (an admission undone, then evicted) and reused by a
    step that does not wait for loads (a decode): `on_evict` fences them, so the reuse's writes
    come after the late copy and survive it."""
    layers, heads, dim, n = 4, 8, 128, 512
    pool = KVPool(layers, 2 * n + 1, 1, heads, dim, torch.bfloat16, torch.device("cuda"))
    tier = HostKVTier(pool, 2 * n * pool.bytes_per_token / 2**30)
    pages, tokens = list(range(1, n + 1)), tuple(range(n))
    fresh = list(range(n + 1, 2 * n + 1))
    idx = torch.tensor(fresh, device="cuda")
    ones = torch.ones(layers, n, heads, dim, device="cuda", dtype=torch.bfloat16)
    copy_slots(pool._k, pool._v, pages, pool._k, pool._v, pages)
    pool._k.index_copy_(1, idx, ones)  # first launches made before the GPU is kept busy
    pool._k[:, 1 : n + 1] = -ones
    tier.on_evict(tokens, pages)
    nodes = tier.lookup(tokens, 0)
    torch.cuda.synchronize()
    with torch.cuda.stream(tier._copier.stream):
        torch.cuda._sleep(500_000_000)
    tier.load(nodes, fresh)  # lands late, writing -1
    # The loaded prefix leaves the cache again: its host copy exists, so no write-back (which
    # would order the compute stream by itself); only the fence orders the reuse below.
    tier.on_evict(tokens, fresh)
    assert tier.pages_stored == n
    pool._k.index_copy_(1, idx, ones)  # a decode reuses the pages at once, writing 1
    torch.cuda.synchronize()
    assert bool((pool._k[:, fresh] == 1).all()), "the late load overwrote the reused pages"


def test_multi_turn_greedy_tokens_with_tier_bf16(tiny_model_path) -> None:
    """The CPU identity test on the GPU (bf16, CUDA graphs, overlap): the same request sequence
    with the tier off and on; each reply the same up to a bf16 near-tie of the reference."""
    import bf16_tie

    path = str(tiny_model_path("qwen3"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    rng = random.Random(3)
    system = [rng.randrange(100, 4000) for _ in range(10)]
    off = LLM(path, device="cuda", dtype="bfloat16", num_pages=90, page_size=1)
    prompts, want = [], []
    convs = [list(system) for _ in range(4)]
    for _turn in range(3):
        for c in convs:  # one conversation at a time: each turn's prefix was evicted meanwhile
            c.extend(rng.randrange(100, 4000) for _ in range(12))
            prompts.append(list(c))
            want.append(off.generate([c], params, use_tqdm=False)[0]["token_ids"])
            c.extend(want[-1])
    on = LLM(path, device="cuda", dtype="bfloat16", num_pages=90, page_size=1, host_kv_cache_gb=0.01)
    got = [on.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts]
    tier = on.scheduler.kv.tier
    assert tier.hits > 0 and tier.tokens_loaded > 0, "the tier should have served later turns"
    assert kv_copy._pick(tier._k, tier._v, tier.pool._k, tier.pool._v)[0] == "kernel"
    on.scheduler.check_integrity()
    # The scorer gets a pool that never fills (off's 90 pages hold its radix cache's prefixes).
    scorer = LLM(path, device="cuda", dtype="bfloat16", num_pages=1024, page_size=1)
    bf16_tie.assert_same_or_bf16_tie(bf16_tie.engine_scorer(scorer), want, got, prompts)
