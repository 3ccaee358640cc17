"""Tiny random-weight models of every supported family vs Hugging Face transformers (CPU).

Greedy tokens must match transformers' `generate` token for token in float32, and prefill
logits within 1e-4 relative; bfloat16 must run and mostly agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bf16_tie
import pytest
import tiny_models
import torch

from minisgl import LLM, SamplingParams

MODELS = list(tiny_models.SPECS)

TEXT_PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a small dragon who loved to read",
    "1, 2, 3, 5, 8, 13,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]
ID_PROMPT_LENS = [1, 7, 19, 40, 3]
MAX_NEW = 12


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def hf_greedy(model: Any, prompt_ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy generate for one prompt (no batching, so no padding effects)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return out[0, len(prompt_ids) :].tolist()


class Pair:
    """A tiny model loaded both in minisgl (fp32, CPU) and in transformers (fp32)."""

    def __init__(self, name: str, path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name = name
        self.path = path
        self.llm = LLM(str(path), device="cpu", dtype="float32")
        self.hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
        self._ref: dict[tuple[int, ...], list[int]] = {}

    def ref(self, prompt_ids: list[int], max_new: int = MAX_NEW) -> list[int]:
        key = tuple(prompt_ids)
        if key not in self._ref or len(self._ref[key]) < max_new:
            self._ref[key] = hf_greedy(self.hf, prompt_ids, max(max_new, MAX_NEW))
        return self._ref[key][:max_new]

    def id_prompts(self) -> list[list[int]]:
        gen = torch.Generator().manual_seed(1234)
        vocab = len(self.hf_tokenizer)
        return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in ID_PROMPT_LENS]


@pytest.fixture(scope="module", params=MODELS)
def pair(request: pytest.FixtureRequest, tiny_model_path: Callable[[str], Path]) -> Iterator[Pair]:
    yield Pair(request.param, tiny_model_path(request.param))


def test_greedy_token_ids_match_hf(pair: Pair) -> None:
    prompts = pair.id_prompts()
    outs = pair.llm.generate(prompts, greedy())
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["token_ids"] == pair.ref(prompt), f"{pair.name}: prompt of {len(prompt)} ids"


def test_greedy_text_prompts_match_hf(pair: Pair) -> None:
    outs = pair.llm.generate(TEXT_PROMPTS, greedy())
    for prompt, out in zip(TEXT_PROMPTS, outs, strict=True):
        prompt_ids = pair.hf_tokenizer(prompt).input_ids
        assert out["token_ids"] == pair.ref(prompt_ids), f"{pair.name}: {prompt!r}"
        assert isinstance(out["text"], str)
        assert out["text"] == pair.hf_tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_prefill_logits_match_hf(pair: Pair) -> None:
    prompts = pair.id_prompts()
    scores = pair.llm.engine.score(prompts)
    assert len(scores) == len(prompts)
    for prompt, ours in zip(prompts, scores, strict=True):
        with torch.no_grad():
            ref = pair.hf(torch.tensor([prompt])).logits[0].float()
        assert ours.shape == ref.shape == (len(prompt), pair.hf.config.vocab_size)
        assert ours.dtype == torch.float32
        rel = (ours.cpu() - ref).abs().max() / ref.abs().max()
        assert rel <= 1e-4, f"{pair.name}: prompt of {len(prompt)} ids, rel err {rel:.2e}"


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_bfloat16_runs_and_mostly_agrees(name: str, tiny_model_path: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_path(name)
    llm = LLM(str(path), device="cpu", dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(99)
    prompts = [torch.randint(0, 40000, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]
    outs = llm.generate(prompts, greedy(4))
    assert all(len(o["token_ids"]) == 4 for o in outs)
    for p, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        # bf16 may only flip a near-tie of the fp32 reference.
        bf16_tie.assert_near_tie(ref, int(ref.argmax()), o["token_ids"][0], 0)
    rel = [(s.float() - hf(torch.tensor([p])).logits[0].detach()).norm() / s.norm() for s, p in
           zip(llm.engine.score(prompts), prompts)]
    assert max(rel) < 2e-2, f"bf16 logits differ by {max(rel):.3g} (relative) from fp32 transformers"


# --- stopping, ordering and the result format (one model is enough) ---------------------


@pytest.fixture(scope="module")
def llama(tiny_model_path: Callable[[str], Path]) -> Pair:
    return Pair("llama3", tiny_model_path("llama3"))


def first_new_token(ref: list[int], start: int) -> tuple[int, int]:
    """(index, token) of the first token at or after `start` not seen earlier in `ref`."""
    for i in range(start, len(ref)):
        if ref[i] not in ref[:i]:
            return i, ref[i]
    raise AssertionError(f"no fresh token after {start} in {ref}")


def test_results_are_dicts_in_input_order(llama: Pair) -> None:
    prompts = llama.id_prompts()
    params = [greedy(n) for n in (5, 1, 9, 3, 7)]
    outs = llama.llm.generate(prompts, params)
    assert [set(o) >= {"text", "token_ids"} for o in outs] == [True] * len(prompts)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert len(out["token_ids"]) == p.max_tokens  # generated part only, no prompt
        assert out["token_ids"] == llama.ref(prompt, p.max_tokens)
        assert all(isinstance(t, int) for t in out["token_ids"])
    # Alone, each prompt gives the same tokens as inside the batch.
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert llama.llm.generate([prompt], p)[0]["token_ids"] == out["token_ids"]


def test_default_sampling_params(llama: Pair) -> None:
    outs = llama.llm.generate(["Hello there", [5, 6, 7]])
    assert len(outs) == 2
    for out in outs:
        assert 1 <= len(out["token_ids"]) <= SamplingParams().max_tokens


def test_stop_token_ids(llama: Pair) -> None:
    prompt = llama.id_prompts()[2]
    ref = llama.ref(prompt)
    k, tok = first_new_token(ref, 4)
    out = llama.llm.generate(
        [prompt],
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[tok], ignore_eos=True),
    )[0]
    assert out["token_ids"] == ref[: k + 1]


def test_stop_string_is_not_returned(llama: Pair) -> None:
    prompt = llama.id_prompts()[3]
    ref_ids = llama.ref(prompt)
    ref_text = llama.hf_tokenizer.decode(ref_ids, skip_special_tokens=True)
    # A 3-character stop string from the middle of the text, at its first occurrence.
    start = len(ref_text) // 2
    while not (s := ref_text[start : start + 3]).strip() or ref_text.find(s) < start:
        start += 1
    stop = ref_text[start : start + 3]
    out = llama.llm.generate(
        [prompt],
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop=[stop, "never@@"], ignore_eos=True),
    )[0]
    assert out["text"] == ref_text[:start]
    assert stop not in out["text"]
    assert out["token_ids"] == ref_ids[: len(out["token_ids"])]
    assert len(out["token_ids"]) < len(ref_ids)


def test_stop_string_completed_by_the_last_token(llama: Pair) -> None:
    """The token that completes a stop string is also the max_tokens-th: still a stop."""
    prompt = llama.id_prompts()[3]
    ref_ids = llama.ref(prompt)
    decode = lambda ids: llama.hf_tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    # The first n whose text grows by a fresh, non-blank piece at token n; the stop string is
    # that piece's last 2 characters (or fewer), so it completes exactly at token n.
    for n in range(2, len(ref_ids) + 1):
        before, text = decode(ref_ids[: n - 1]), decode(ref_ids[:n])
        stop = text[len(before) :][-2:]
        if text.startswith(before) and stop.strip() and text.find(stop) == len(text) - len(stop):
            break
    else:
        pytest.skip("no token with a fresh suffix")
    out = llama.llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, stop=[stop], ignore_eos=True))[0]
    assert out["token_ids"] == ref_ids[:n]
    assert out["text"] == text[: len(text) - len(stop)]
    assert out["finish_reason"] == "stop"


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_eos_stops_generation(llama: Pair, where: str, tmp_path: Path) -> None:
    import json
    import shutil

    prompt = llama.id_prompts()[1]
    ref = llama.ref(prompt)
    k, tok = first_new_token(ref, 3)
    folder = tmp_path / "model"
    shutil.copytree(llama.path, folder)
    cfg = json.loads((folder / where).read_text())
    eos = cfg["eos_token_id"]
    cfg["eos_token_id"] = [*(eos if isinstance(eos, list) else [eos]), tok]
    (folder / where).write_text(json.dumps(cfg))

    llm = LLM(str(folder), device="cpu", dtype="float32")
    assert tok in llm.model_config.eos_token_ids
    for eos_id in llama.llm.model_config.eos_token_ids:  # the original ids are kept
        assert eos_id in llm.model_config.eos_token_ids
    stopped = llm.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0.0))[0]
    eos_set = set(llm.model_config.eos_token_ids)
    first_eos = next(i for i, t in enumerate(ref) if t in eos_set)  # <= k
    assert stopped["token_ids"] == ref[: first_eos + 1]
    ignored = llm.generate([prompt], greedy())[0]
    assert ignored["token_ids"] == ref


def test_all_eos_ids_are_read(llama: Pair) -> None:
    # config.json says 2 (<|im_end|>); generation_config.json adds 0 (<|endoftext|>).
    assert set(llama.llm.model_config.eos_token_ids) == {2, 0}


def test_max_tokens_one(llama: Pair) -> None:
    prompts = llama.id_prompts()
    outs = llama.llm.generate(prompts, greedy(1))
    assert [o["token_ids"] for o in outs] == [llama.ref(p, 1) for p in prompts]


def test_chat_template_is_read(pair: Pair) -> None:
    # Llama-style folders carry chat_template.jinja (transformers 5), Qwen folders keep it
    # inside tokenizer_config.json: both must be found.
    has_jinja = (pair.path / "chat_template.jinja").exists()
    assert has_jinja == (tiny_models.SPECS[pair.name].tokenizer == "smollm2")
    messages = [{"role": "user", "content": "Hi there!"}]
    kw = {"add_generation_prompt": True, "tokenize": False}
    ours = pair.llm.tokenizer.apply_chat_template(messages, **kw)
    assert ours == pair.hf_tokenizer.apply_chat_template(messages, **kw)
    assert "Hi there!" in ours and ("<|im_start|>assistant" in ours)


def test_config_forms_are_both_exercised() -> None:
    legacy = {n for n, s in tiny_models.SPECS.items() if s.legacy_rope}
    assert legacy and legacy != set(tiny_models.SPECS)
