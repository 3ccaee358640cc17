"""EAGLE-3: the checkpoint config and tensor layout, and the drafter's chain against a plain
torch statement of the head (fc over the target's three residual streams, the midlayer over
cat(norm(embed(next token)), norm(hidden)), the final norm, the draft LM head and d2t)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import spec_models
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from minisgl import LLM, SamplingParams
from minisgl.models.eagle3 import Eagle3Config
from minisgl.speculative.drafter import DraftRequest

BASE = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 1000,
        "max_position_embeddings": 512}


def test_config_layer_ids_and_defaults() -> None:
    assert Eagle3Config.from_dict(BASE).aux_layers(32) == (2, 16, 29)  # 2, L / 2, L - 3
    nested = Eagle3Config.from_dict({**BASE, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}})
    assert nested.aux_layers(32) == (2, 16, 29)  # SGLang/SpecForge: outputs of those layers
    top = Eagle3Config.from_dict({**BASE, "eagle_aux_hidden_state_layer_ids": [2, 16, 29]})
    assert top.aux_layers(32) == (2, 16, 29)  # vLLM: inputs of those layers
    cfg = Eagle3Config.from_dict({**BASE, "draft_vocab_size": 100, "target_hidden_size": 96})
    assert (cfg.draft_vocab_size, cfg.target_hidden_size) == (100, 96)
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        Eagle3Config.from_dict({**BASE, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="layers"):
        Eagle3Config.from_dict({**BASE, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="do not fit"):
        Eagle3Config.from_dict(BASE).aux_layers(2)


@pytest.fixture(scope="module")
def target(tiny_model_path) -> Path:
    return tiny_model_path("llama3")


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory) -> Path:
    return spec_models.build_eagle3_head(target, tmp_path_factory.mktemp("eagle3") / "head", draft_vocab=512)


def test_checkpoint_errors_name_the_tensor(target, head_dir, tmp_path) -> None:
    tensors = load_file(str(head_dir / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((head_dir / "config.json").read_text())
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="midlayer.hidden_norm.weight"):
        LLM(str(target), device="cpu", speculative_algorithm="eagle3", speculative_draft_model=str(bad))
    cfg = json.loads((head_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(ValueError, match="hidden states of size"):
        LLM(str(target), device="cpu", speculative_algorithm="eagle3", speculative_draft_model=str(bad))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotation of x [n, heads, d] at positions pos [n]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_head(w: dict, embed: torch.Tensor, cfg: dict, ids: list[int], hidden: list[torch.Tensor]):
    """The head over positions 0..n-1 (input i: token ids[i], hidden[i]: 3H or H wide),
    causal, from scratch. -> (normed [n, H], pre-norm [n, H])."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    x_h = torch.stack([t if t.shape[-1] == h else t @ w["fc.weight"].T for t in hidden])
    e = rms(embed[torch.tensor(ids)], w["midlayer.input_layernorm.weight"])
    x = torch.cat([e, rms(x_h, w["midlayer.hidden_norm.weight"])], dim=-1)
    n = len(ids)
    pos = torch.arange(n)
    q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), pos, cfg["rope_theta"])
    k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d), pos, cfg["rope_theta"])
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    s = torch.einsum("nhd,mhd->hnm", q, k) * d**-0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hnm,mhd->nhd", s.softmax(-1), v).reshape(n, h) @ w["midlayer.self_attn.o_proj.weight"].T
    r = o + x_h
    m = rms(r, w["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T))
    r = mlp @ w["midlayer.mlp.down_proj.weight"].T + r
    return rms(r, w["norm.weight"]), r


def test_drafts_equal_a_plain_torch_head(target, head_dir) -> None:
    llm = LLM(str(target), device="cpu", dtype="float32", speculative_algorithm="eagle3",
              speculative_draft_model=str(head_dir), disable_overlap=True)
    sched, eng = llm.scheduler, llm.engine
    prompt = [310, 311, 312, 400, 2000, 45, 46, 47, 900, 12]
    req = llm._make_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    sched.add(req)
    sched.step()  # the prefill: the head's KV covers the prompt, its first draft is waiting
    assert len(req.output) == 1
    k = 4
    assert sched.kv.grow(req, req.seq_len + k)
    sched.kv.flush()
    w = load_file(str(head_dir / "model.safetensors"))
    cfg = json.loads((head_dir / "config.json").read_text())
    embed = eng.model.model.embed_tokens.weight.detach()  # no own embedding: the target's

    def reference_chain(tokens: list[int]) -> list[int]:
        eng.score([tokens[:-1]])  # the target's residual streams at the three layers
        ids, hidden = tokens[1:], list(eng.model.model.aux_hidden)  # position t reads token t + 1
        want = []
        for _ in range(k):
            normed, pre = reference_head(w, embed, cfg, ids, hidden)
            best = int((normed[-1] @ w["lm_head.weight"].T).argmax())
            want.append(best + int(w["d2t"][best]))
            ids, hidden = ids + [want[-1]], hidden + [pre[-1]]
        return want

    got = eng.drafter.propose([DraftRequest(req.uid, req.row, req.prompt, req.output, k)])[0]
    assert got == reference_chain(req.tokens())  # after the prefill's mirror
    for _ in range(3):
        sched.step()  # verify steps: the head's KV follows the target's accepted tokens
    assert len(req.output) >= 4 and not req.finished
    assert sched.kv.grow(req, req.seq_len + k)
    sched.kv.flush()
    got = eng.drafter.propose([DraftRequest(req.uid, req.row, req.prompt, req.output, k)])[0]
    assert got == reference_chain(req.tokens())  # after verify steps' mirrors
