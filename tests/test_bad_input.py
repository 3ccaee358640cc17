"""Bad models, options, prompts and sampling parameters give a ValueError naming the culprit."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl import LLM, SamplingParams

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"
UP_PROJ = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture
def model_copy(tiny_model_path: Callable[[str], Path], tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path("llama3"), folder)
    return folder


def edit_config(folder: Path, **changes: Any) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def load(folder: Path, **options: Any) -> LLM:
    return LLM(str(folder), device="cpu", dtype="float32", **options)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"])
def test_missing_config_field(model_copy: Path, field: str) -> None:
    edit_config(model_copy, **{field: None})
    with pytest.raises(ValueError, match=field):
        load(model_copy)


def test_unknown_architecture(model_copy: Path) -> None:
    edit_config(model_copy, architectures=["FancyNetForCausalLM"])
    with pytest.raises(ValueError, match="FancyNetForCausalLM"):
        load(model_copy)


def test_missing_config_file(model_copy: Path) -> None:
    (model_copy / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        load(model_copy)


def test_unknown_dtype(tiny_model_path: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="float7"):
        LLM(str(tiny_model_path("llama3")), device="cpu", dtype="float7")


def test_missing_tensor(model_copy: Path) -> None:
    edit_weights(model_copy, lambda t: t.pop(UP_PROJ))
    with pytest.raises(ValueError, match=re.escape(UP_PROJ)):
        load(model_copy)


def test_missing_qkv_part(model_copy: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    edit_weights(model_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=re.escape(name)):
        load(model_copy)


def test_unexpected_tensor(model_copy: Path) -> None:
    name = "model.layers.0.mlp.extra_proj.weight"
    edit_weights(model_copy, lambda t: t.__setitem__(name, torch.zeros(4, 4)))
    with pytest.raises(ValueError, match=re.escape(name)):
        load(model_copy)


@pytest.mark.parametrize("name", [Q_PROJ, UP_PROJ, "model.norm.weight", "lm_head.weight"])
def test_wrong_shape(model_copy: Path, name: str) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1].clone()

    edit_weights(model_copy, shrink)
    with pytest.raises(ValueError, match=re.escape(name)):
        load(model_copy)


def test_prompt_longer_than_context(tiny_model_path: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model_path("llama3")), device="cpu", dtype="float32", max_model_len=32)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    assert len(llm.generate([[5] * 20], params)[0]["token_ids"]) == 1
    with pytest.raises(ValueError, match=r"(?i)prompt|context|max_model_len"):
        llm.generate([[5] * 40], params)
    with pytest.raises(ValueError, match=r"(?i)prompt|context|max_model_len"):
        llm.generate([[5] * 32], params)  # no room left to generate
    with pytest.raises(ValueError, match=r"(?i)prompt|context|max_model_len"):
        llm.generate([[5] * 20, [5] * 40], params)  # one bad prompt rejects the call
    # The engine is still usable after the rejected requests, and never runs past the context.
    out = llm.generate([[5] * 20, [5] * 31], SamplingParams(max_tokens=50, temperature=0.0))
    assert 1 <= len(out[0]["token_ids"]) <= 12
    assert len(out[1]["token_ids"]) == 1
    # max_tokens None: the rest of the context, per prompt (one params object for both).
    rest = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    out = llm.generate([[5] * 20, [5] * 29], rest)
    assert [len(o["token_ids"]) for o in out] == [12, 3] and rest.max_tokens is None
    with pytest.raises(ValueError, match="^min_tokens: 5 asked for but the prompt leaves room for 3 tokens"):
        llm.generate([[5] * 29], SamplingParams(max_tokens=None, min_tokens=5))


def test_bad_prompts(tiny_model_path: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model_path("llama3")), device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], params)
    with pytest.raises(ValueError, match="999999"):
        llm.generate([[5, 999999]], params)
    with pytest.raises(ValueError, match="(?i)prompt"):
        llm.generate([3.5], params)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5], [6]], [params])


def test_unknown_option(tiny_model_path: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="max_model_length"):
        LLM(str(tiny_model_path("llama3")), device="cpu", max_model_length=64)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_model_path("llama3")), device="cpu", max_model_len=100_000)


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"), device="cpu")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
    ],
)
def test_bad_sampling_params(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_good_sampling_params_edges() -> None:
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0)
    SamplingParams(top_k=1, top_p=0.01, min_p=1.0)
