"""The `cuda` attention backend: greedy tokens equal the torch backend's on tiny models (GPU,
decode through CUDA graphs), the decode path against the torch backend on the CPU (CI), and
the startup checks."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from minisgl.attention.cuda_backend import CudaAttentionBackend
from minisgl.attention.torch_backend import TorchAttentionBackend
from minisgl.core.batch import ForwardBatch
from minisgl.kvcache.pool import KVPool

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu(fn):
    """Marks a test `gpu` (select with -m gpu) and skips it without CUDA (no conftest needed)."""
    return pytest.mark.gpu(_needs_cuda(fn))


@gpu
@pytest.mark.parametrize(("name", "page_size"), [("qwen2", 1), ("qwen3", 16)])
def test_engine_greedy_tokens_match_torch_backend(
    name: str, page_size: int, tiny_model_path: Callable[[str], Path]
) -> None:
    """head_dim 16 (qwen2) and 32 (qwen3); decode through CUDA graphs, prefill on the torch
    backend in both. fp16 rounding may flip a greedy choice only at a near-tie: a sequence
    may differ only from a step where the two tokens' logits are within 1% of each other."""
    from minisgl import LLM, SamplingParams

    path = str(tiny_model_path(name))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 40000, (n,), generator=gen).tolist() for n in (1, 7, 19, 40, 111)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llms = {
        backend: LLM(
            path, device="cuda", dtype="float16", attention_backend=backend, page_size=page_size,
            num_pages=4096 // page_size, max_running_requests=8,
        )
        for backend in ("torch", "cuda")
    }  # fmt: skip
    tokens = {b: [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
              for b, llm in llms.items()}  # fmt: skip
    flips = 0
    for prompt, ref, ours in zip(prompts, tokens["torch"], tokens["cuda"], strict=True):
        if ours == ref:
            continue
        i = next(k for k, (a, b) in enumerate(zip(ref, ours, strict=True)) if a != b)
        logits = llms["torch"].engine.score([prompt + ref[:i]])[0][-1]
        gap = (logits[ref[i]] - logits[ours[i]]).abs().item()
        scale = logits.abs().max().item()
        assert gap <= 0.01 * scale, f"step {i}: tokens differ with a logit gap {gap:.3g} of {scale:.3g}"
        flips += 1
    assert flips <= 1, f"{flips} of {len(prompts)} sequences differ"
    del llms
    gc.collect()
    torch.cuda.empty_cache()


def decode_batch(pool: KVPool, lens: list[int], gen: torch.Generator) -> ForwardBatch:
    """A decode step for len(lens) requests whose first len-1 tokens are already cached."""
    batch = len(lens)
    table = torch.zeros(batch + 1, 64, dtype=torch.int32)
    perm = torch.randperm(pool.num_slots - pool.page_size, generator=gen) + pool.page_size
    at = 0
    for i, n in enumerate(lens):
        table[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    k, v = pool.k_cache(0), pool.v_cache(0)
    k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
    v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
    rows = torch.arange(batch, dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    return ForwardBatch(
        mode="decode", input_ids=torch.zeros(batch, dtype=torch.int64),
        positions=(seq - 1).long(), out_slots=table[rows.long(), (seq - 1).long()],
        req_rows=rows, seq_lens=seq, prefix_lens=seq - 1,
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
        sample_rows=torch.arange(batch), req_to_slot=table, seq_lens_cpu=lens,
        prefix_lens_cpu=[n - 1 for n in lens], max_seq_len=max(lens), max_extend_len=1,
    )  # fmt: skip


def test_decode_matches_torch_backend_on_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, 64, 4, 2, 64, torch.bfloat16, torch.device("cpu"))
    batch = decode_batch(pool, [1, 9, 33], gen)
    q = torch.randn(3, 8, 64, generator=gen).to(torch.bfloat16)
    kv = torch.randn(3, 4, 64, generator=gen).to(torch.bfloat16)
    k, v = kv[:, :2], kv[:, 2:]
    ours = CudaAttentionBackend(pool, 8, 0.125)
    ours.prepare(batch)
    out = ours.forward(q, k, v, 0, batch)
    ref = TorchAttentionBackend(pool, 8, 0.125).forward(q, k, v, 0, batch)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=2e-2)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


@pytest.mark.parametrize(
    ("dtype", "dim", "q_heads", "match"),
    [
        (torch.float32, 64, 4, "float16, bfloat16 or fp8_e4m3"),
        (torch.bfloat16, 96, 4, "head_dim"),
        (torch.bfloat16, 64, 18, "query heads per KV head"),
        (torch.bfloat16, 64, 3, "query heads per KV head"),
    ],
)
def test_startup_checks(dtype: torch.dtype, dim: int, q_heads: int, match: str) -> None:
    pool = KVPool(1, 2, 1, 2, dim, dtype, torch.device("cpu"))
    with pytest.raises(ValueError, match=match):
        CudaAttentionBackend(pool, q_heads, 0.1)
