"""A hybrid checkpoint with an MTP head, for the MTP tests: a tiny qwen3_next / qwen3_5 folder
copied with `mtp.*` tensors added (transformers writes none), random but in the layout the
published checkpoints use (fc over [embedding | hidden], zero-centred norms, one decoder layer
with full attention). `MtpReference` computes the head's greedy draft chain with transformers'
own decoder layer and norms (an implementation independent of minisgl's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


def _hf_classes(model_type: str):  # noqa: ANN202 - transformers classes
    if model_type == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        return m.Qwen3NextDecoderLayer, m.Qwen3NextRMSNorm
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return m.Qwen3_5DecoderLayer, m.Qwen3_5RMSNorm


def _sparse(config, i: int) -> bool:  # noqa: ANN001
    """transformers' rule for an MoE MLP at layer i (Qwen3NextDecoderLayer)."""
    return (getattr(config, "num_experts", 0) > 0 and i not in getattr(config, "mlp_only_layers", [])
            and (i + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def _full_layer_index(config) -> int:  # noqa: ANN001
    """A full-attention layer of the target whose MLP kind is the MTP layer's (layer 0's rule)."""
    for i, kind in enumerate(config.layer_types):
        if kind == "full_attention" and _sparse(config, i) == _sparse(config, 0):
            return i
    raise AssertionError("no full-attention layer with the MTP layer's MLP")


def mtp_modules(model_dir: Path, seed: int):  # noqa: ANN201 - (config, layer idx, modules)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    config = getattr(config, "text_config", None) or config
    config._attn_implementation = "sdpa"
    layer_cls, norm_cls = _hf_classes(config.model_type.removesuffix("_text"))
    idx = _full_layer_index(config)
    torch.manual_seed(seed)
    h, eps = config.hidden_size, config.rms_norm_eps
    mods = torch.nn.ModuleDict({
        "layer": layer_cls(config, idx), "fc": torch.nn.Linear(2 * h, h, bias=False),
        "pre_fc_norm_embedding": norm_cls(h, eps=eps), "pre_fc_norm_hidden": norm_cls(h, eps=eps),
        "norm": norm_cls(h, eps=eps),
    }).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mods.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return config, idx, mods


def add_mtp_head(model_dir: Path, out: Path, seed: int = 21) -> Path:
    """`model_dir` copied to `out` with an MTP head (a second safetensors file, in the index when
    the folder has one)."""
    shutil.copytree(model_dir, out)
    _, _, mods = mtp_modules(model_dir, seed)
    tensors = {f"mtp.layers.0.{k}": v for k, v in mods["layer"].state_dict().items()}
    for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = mods[name].weight.detach()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "mtp.safetensors"))
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "mtp.safetensors" for k in tensors})
        index.write_text(json.dumps(data))
    return out


class MtpReference:
    """The head's greedy drafts after a context, from transformers: the target's final normed
    hidden states, then the MTP layer over positions 0..n-2 (token t + 1, hidden t) and k - 1
    chain steps on its own outputs, causal attention over all of them (recomputed each step)."""

    def __init__(self, model_dir: Path, hf_model, seed: int = 21) -> None:  # noqa: ANN001
        self.hf = hf_model
        self.config, _, self.mods = mtp_modules(model_dir, seed)

    @torch.no_grad()
    def drafts(self, context: list[int], k: int) -> list[int]:
        hf, m = self.hf, self.mods
        ids = torch.tensor([context])
        hidden = hf.model(ids).last_hidden_state[0]  # [n, H], after the final norm
        embed = hf.get_input_embeddings()
        tokens, hs = list(context[1:]), [hidden[t] for t in range(len(context) - 1)]
        out = []
        for _ in range(k):
            x = m["fc"](torch.cat([m["pre_fc_norm_embedding"](embed(torch.tensor(tokens))),
                                   m["pre_fc_norm_hidden"](torch.stack(hs))], dim=-1))[None]
            pos = torch.arange(len(tokens))[None]
            # Qwen3.5's rotary embedding is multimodal: text positions in its 3 sections alike.
            rope_pos = pos[None].expand(3, 1, -1) if self.config.model_type.startswith("qwen3_5") else pos
            y = m["layer"](x, position_embeddings=hf.model.rotary_emb(x, rope_pos), attention_mask=None,
                           position_ids=pos)
            y = m["norm"](y[0] if isinstance(y, tuple) else y)[0]
            d = int(hf.lm_head(y[-1]).argmax())
            out.append(d)
            tokens.append(d)
            hs.append(y[-1])
        return out
