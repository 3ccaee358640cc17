"""Models given as a GGUF file: config, weights (dequantized) and tokenizer from its metadata.

Only the Llama-family GGUF layout ("llama" and "qwen2"/"qwen3" architectures) is mapped.
llama.cpp's converter permutes the rows of Llama's q/k projections (for its interleaved rope
layout); we undo that permutation so the weights match the Hugging Face (neox) layout.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def find_gguf(path: Path) -> Path | None:
    """The .gguf file `path` names, or the single one in the folder `path`, else None."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"{path} holds several .gguf files; name one: {[f.name for f in found]}")
        return found[0] if found else None
    return None


@functools.lru_cache(maxsize=2)
def _reader(path: Path):
    # Parsing the header (the whole vocabulary) takes seconds; config, weights and tokenizer
    # all read the same file, so parse it once. The reader memory-maps the tensor data.
    import gguf

    return gguf.GGUFReader(str(path))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(path: Path) -> dict[str, Any]:
    """An HF-style config dict from the GGUF metadata."""
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch not in _ARCH:
        raise ValueError(f"unknown GGUF architecture {arch!r} in {path.name}; supported: {', '.join(_ARCH)}")
    names = {t.name for t in r.tensors}
    heads = int(_field(r, f"{arch}.attention.head_count"))
    hidden = int(_field(r, f"{arch}.embedding_length"))
    vocab = _field(r, f"{arch}.vocab_size") or len(_field(r, "tokenizer.ggml.tokens", []))
    head_dim = _field(r, f"{arch}.attention.key_length") or hidden // heads
    return {
        "architectures": [_ARCH[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(r, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(r, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(r, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(r, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "_gguf_arch": arch,
    }


def _hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {gguf_name}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    if base not in _TOP_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name}")
    return f"{_TOP_NAMES[base]}.{kind}"


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    # Inverse of llama.cpp's permute: rows were (head, dim/2, 2) -> (head, 2, dim/2).
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(path: Path, cfg: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) pairs, dequantized one at a time."""
    from gguf.quants import dequantize

    r = _reader(path)
    permute = cfg["_gguf_arch"] == "llama"
    for t in r.tensors:
        name = _hf_name(t.name)
        array = dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; the dequantized array is already row-major [out, in].
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(shape)  # writable copy
        if permute and name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif permute and name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        yield name, w


def gguf_tokenizer(path: Path):
    """The tokenizer (with its chat template) rebuilt from the GGUF metadata by transformers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not getattr(tok, "chat_template", None):
        template = _field(_reader(path), "tokenizer.chat_template")
        if template:
            tok.chat_template = template
    return tok
