"""Loading a model for an engine: its config, dtype and weights (the target's, or a draft
model's for speculative decoding)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisgl.engine.config import DTYPES
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.source import ModelSource
from minisgl.models.weights import fill_dummy, iter_safetensors

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in fp16 are slow or missing; fp32 is the exact path
    declared = DTYPES.get(str(model_cfg.torch_dtype or "").removeprefix("torch."))
    return declared if declared in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.is_gguf:
        from minisgl.models.gguf_file import gguf_config

        return ModelConfig.from_dict(gguf_config(source.path))
    return ModelConfig.from_folder(source.path)


def load_model(engine: Engine, source: ModelSource, model_cfg: ModelConfig, seed: int) -> LlamaForCausalLM:
    """A Llama-family model on the engine's device, dtype and TP ranks, with its weights (the
    target, or a draft model for speculative decoding)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(engine.dtype)
    try:
        with torch.device(engine.device):
            model = LlamaForCausalLM(model_cfg, engine.tp, engine.comm, engine.max_model_len, engine.device)
    finally:
        torch.set_default_dtype(default_dtype)
    if engine.cfg.load_format == "dummy":
        fill_dummy(model, seed)
    elif source.is_gguf:
        from minisgl.models.gguf_file import gguf_config, iter_gguf

        model.load_weights(iter_gguf(source.path, gguf_config(source.path)))
    else:
        model.load_weights(iter_safetensors(source.path))
    return model.eval()
