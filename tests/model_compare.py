"""Helpers of the tests that compare a model family against transformers on the CPU: greedy
sampling params, seeded random prompts, and transformers' fp32 model of a folder (cached in
the dict the test module's `hf_models` fixture holds), a multimodal folder around a text model."""

from __future__ import annotations

import json
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


def multimodal_folder(src: Path, dst: Path, architecture: str, model_type: str, lift: dict[str, object]
                      ) -> dict[str, torch.Tensor]:
    """A ...ForConditionalGeneration folder at `dst` from the text-model folder `src`: its files
    but config.json and the weights, a config with src's under text_config, a tiny vision_config,
    and the top-level keys `lift` (their value taken from src's config, default the dict's).
    Returns src's tensors, for the caller to rename, extend and save."""
    from safetensors.torch import load_file

    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            (dst / f.name).write_bytes(f.read_bytes())
    text_cfg = json.loads((src / "config.json").read_text())
    cfg = {"architectures": [architecture], "model_type": model_type,
           "text_config": {k: v for k, v in text_cfg.items() if k != "architectures"},
           "vision_config": {"hidden_size": 8}, **{k: text_cfg.get(k, d) for k, d in lift.items()}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return load_file(str(src / "model.safetensors"))
