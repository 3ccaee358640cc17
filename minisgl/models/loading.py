"""Loading a model: its config, and the model with its weights on a device, in a dtype, for one
TP rank (the target's, or a draft model's for speculative decoding)."""

from __future__ import annotations

import torch

from minisgl.core.model_config import ModelConfig
from minisgl.distributed.info import Communicator, TPInfo
from minisgl.models.gemma3 import Gemma3ForCausalLM
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.qwen3_next import Qwen3NextForCausalLM
from minisgl.models.source import ModelSource
from minisgl.models.weights import fill_dummy, iter_safetensors


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.is_gguf:
        from minisgl.models.gguf_meta import gguf_config

        return ModelConfig.from_dict(gguf_config(source.path))
    return ModelConfig.from_folder(source.path)


def load_model(
    source: ModelSource, model_cfg: ModelConfig, seed: int, *, dtype: torch.dtype, device: torch.device, tp: TPInfo,
    comm: Communicator, max_model_len: int, dummy: bool, lm_head: bool = True,
) -> LlamaForCausalLM:
    """A Llama-family model on `device` in `dtype`, sharded for TP rank `tp`, with its weights
    (random ones of the real shapes when `dummy`): the target, or a draft model. `lm_head`
    False: an embedding model's, whose LM head is never used (nor loaded)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            cls = Gemma3ForCausalLM if model_cfg.is_gemma3 else LlamaForCausalLM
            if model_cfg.linear_attn is not None:  # Qwen3-Next, Qwen3.5: the hybrid block
                cls = Qwen3NextForCausalLM
            model = cls(model_cfg, tp, comm, max_model_len, device)
    finally:
        torch.set_default_dtype(default_dtype)
    model.needs_lm_head = lm_head
    if dummy:
        fill_dummy(model, seed)
    elif source.is_gguf:
        from minisgl.models.gguf_meta import gguf_config
        from minisgl.models.gguf_weights import iter_gguf

        model.load_weights(iter_gguf(source.path, gguf_config(source.path)))
    else:
        model.load_weights(iter_safetensors(source.path))
    return model.eval()
