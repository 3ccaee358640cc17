"""A GGUF file's weights as torch tensors, dequantized, under their Hugging Face names.

llama.cpp's converter permutes the rows of Llama's q/k projections (for its interleaved rope
layout); we undo that permutation so the weights match the Hugging Face (neox) layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minisgl.models.gguf_meta import gguf_file

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
    """(HF name, fp32 tensor) pairs, dequantized one at a time (`cfg`: gguf_meta.gguf_config)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    permute = cfg["_gguf_arch"] == "llama"
    for t in gguf_file(path).tensors:
        name = _hf_name(t.name)
        array = dequantize(t.data, GGMLQuantizationType(t.qtype))  # row-major [out, in] already
        w = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(t.shape)  # writable copy
        if permute and name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif permute and name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        yield name, w
