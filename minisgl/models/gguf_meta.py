"""Models given as a GGUF file: where the file is and its config, from the metadata alone.

Torch-free (the launcher resolves the model with it; DESIGN.md §2): the weights are read by
gguf_weights.py, the tokenizer is converted once by minisgl/tokenizer/gguf_tokenizer.py. Only
the Llama-family GGUF layout ("llama" and "qwen2"/"qwen3" architectures) is mapped.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


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
def gguf_reader(path: Path) -> Any:
    # Parsing the header (the whole vocabulary) takes seconds; config, weights and tokenizer
    # all read the same file, so parse it once. The reader memory-maps the tensor data.
    import gguf

    return gguf.GGUFReader(str(path))


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(path: Path) -> dict[str, Any]:
    """An HF-style config dict from the GGUF metadata."""
    r = gguf_reader(path)
    arch = gguf_field(r, "general.architecture")
    if arch not in _ARCH:
        raise ValueError(f"unknown GGUF architecture {arch!r} in {path.name}; supported: {', '.join(_ARCH)}")
    names = {t.name for t in r.tensors}
    heads = int(gguf_field(r, f"{arch}.attention.head_count"))
    hidden = int(gguf_field(r, f"{arch}.embedding_length"))
    vocab = gguf_field(r, f"{arch}.vocab_size") or len(gguf_field(r, "tokenizer.ggml.tokens", []))
    head_dim = gguf_field(r, f"{arch}.attention.key_length") or hidden // heads
    return {
        "architectures": [_ARCH[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(gguf_field(r, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(gguf_field(r, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf_field(r, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(gguf_field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(gguf_field(r, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(gguf_field(r, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": gguf_field(r, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": gguf_field(r, "tokenizer.ggml.bos_token_id"),
        "_gguf_arch": arch,
    }
