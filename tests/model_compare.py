"""Helpers of the tests that compare a model family against transformers on the CPU: greedy
sampling params, seeded random prompts, and transformers' fp32 model of a folder (cached in
the dict the test module's `hf_models` fixture holds)."""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl import SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def random_prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 2000, (n,), generator=gen).tolist() for n in lens]


def hf_model(path: Path, cache: dict[str, object]) -> object:
    from transformers import AutoModelForCausalLM

    if str(path) not in cache:
        cache[str(path)] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return cache[str(path)]


def record_prefix_hits(llm: object) -> list[int]:
    """The matched tokens of every request `llm` admits from now on (wraps its scheduler's
    RequestKV.attach); the list fills as requests are admitted."""
    hits: list[int] = []
    kv = llm.scheduler.kv
    attach = kv.attach

    def counting_attach(req, match):  # noqa: ANN001, ANN202
        hits.append(match.matched_tokens)
        return attach(req, match)

    kv.attach = counting_attach
    return hits
