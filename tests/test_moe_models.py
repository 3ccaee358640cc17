"""Qwen3-MoE, Qwen2-MoE and Mixtral beyond tests/test_models_hf.py (which holds their greedy
tokens and prefill logits to transformers'): what the config says about each layer, both on-disk
forms of the experts, checkpoint errors, dummy weights, TP = 2 over gloo, the server, and the
Triton kernels (interpreted) inside the model."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import tiny_models
import torch

from minisgl import LLM, SamplingParams, env
from minisgl.core.model_config import ModelConfig

MOE_MODELS = ["qwen3_moe", "qwen2_moe", "mixtral"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 5, list(range(300, 317)), [42]]


def hf_model(path: Path):  # noqa: ANN201 - a transformers model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)[0, len(prompt) :].tolist()


# ---- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,sparse,top_k,renormalize,shared",
    [("qwen3_moe", (True, False, True), 2, True, 0),  # mlp_only_layers [1]
     ("qwen2_moe", (False, True, False, True), 4, False, 96),  # decoder_sparse_step 2
     ("mixtral", (True, True), 2, True, 0)],
)
def test_config_reads_each_layers_block(tiny_model_path: Callable[[str], Path], name: str, sparse: tuple,
                                        top_k: int, renormalize: bool, shared: int) -> None:
    cfg = ModelConfig.from_folder(tiny_model_path(name))
    assert cfg.moe is not None and cfg.moe.sparse_layers == sparse
    assert (cfg.moe.top_k, cfg.moe.renormalize, cfg.moe.shared_expert_intermediate_size) == (top_k, renormalize, shared)
    llm = LLM(str(tiny_model_path(name)), device="cpu", dtype="float32")
    kinds = [type(layer.mlp).__name__ for layer in llm.engine.model.model.layers]
    assert kinds == ["SparseMoeBlock" if s else "LlamaMLP" for s in sparse]


def qwen3_moe_config(**changes: object) -> dict:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64, "num_experts": 6,
           "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


def test_config_errors_name_the_field() -> None:
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
    assert ModelConfig.from_dict(qwen3_moe_config(num_experts=None, num_local_experts=5)).moe.num_experts == 5
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_dict(qwen3_moe_config(num_experts=None))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict(qwen3_moe_config(num_experts_per_tok=7))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig.from_dict(qwen3_moe_config(moe_intermediate_size=None))
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        ModelConfig.from_dict(qwen3_moe_config(decoder_sparse_step=0))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelConfig.from_dict(qwen3_moe_config(architectures=["Qwen2MoeForCausalLM"]))
    with pytest.raises(ValueError, match="moe_intermediate_size \\(30\\) is not divisible"):
        ModelConfig.from_dict(qwen3_moe_config(moe_intermediate_size=30)).check_tp(4)
    # Every layer sparse: the unused dense intermediate_size does not constrain TP.
    ModelConfig.from_dict(qwen3_moe_config(intermediate_size=97)).check_tp(2)


# ---- checkpoints -----------------------------------------------------------------------------


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def params(llm: LLM) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in llm.engine.model.state_dict().items()}


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_stacked_experts_load_like_per_expert_tensors(tiny_model_path, tmp_path: Path, name: str) -> None:
    """transformers 5's stacked form (mlp.experts.gate_up_proj / down_proj) gives the same weights."""
    src = tiny_model_path(name)
    stacked = copy_model(src, tmp_path / "stacked")
    tiny_models.stack_experts(stacked / "model.safetensors")
    want, got = params(LLM(str(src), device="cpu", dtype="float32")), params(LLM(str(stacked), device="cpu"))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def rewrite_checkpoint(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    from safetensors.torch import load_file, save_file

    copy_model(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_checkpoint_errors_name_the_tensor(tiny_model_path, tmp_path: Path) -> None:
    src = tiny_model_path("qwen2_moe")  # per-expert tensors; layers 1 and 3 sparse, 6 experts
    e3 = "model.layers.1.mlp.experts.3.up_proj.weight"
    cases = {
        "missing": (lambda t: t.pop(e3), f"tensor {e3} is missing"),
        "twice": (lambda t: t.update({"model.layers.1.mlp.experts.down_proj": torch.zeros(6, 64, 32)}),
                  "appears twice"),
        "shape": (lambda t: t.update({e3: torch.zeros(31, 64)}), "has shape \\(31, 64\\), expected \\(32, 64\\)"),
        "no such expert": (lambda t: t.update({"model.layers.1.mlp.experts.6.up_proj.weight": t[e3].clone()}),
                           "unexpected tensor model.layers.1.mlp.experts.6.up_proj.weight"),
        "dense layer": (lambda t: t.update({"model.layers.0.mlp.experts.0.up_proj.weight": t[e3].clone()}),
                        "unexpected tensor model.layers.0.mlp.experts.0.up_proj.weight"),
    }
    for what, (edit, message) in cases.items():
        folder = rewrite_checkpoint(src, tmp_path / what.replace(" ", "_"), edit)
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), device="cpu", dtype="float32")


@pytest.mark.parametrize("name", MOE_MODELS)
def test_dummy_weights(tiny_model_path, name: str) -> None:
    llm = LLM(str(tiny_model_path(name)), device="cpu", dtype="float32", load_format="dummy")
    experts = [m for n, m in llm.engine.model.named_modules() if n.endswith(".experts")]
    assert experts and all(bool((m.w13 != 0).all() and (m.w2 != 0).all()) for m in experts)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [GREEDY.max_tokens] * len(PROMPTS)


# ---- TP = 2 (gloo), the server ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_tp2_equals_tp1(tiny_model_path, name: str) -> None:
    """Every expert's intermediate dim sharded over two ranks, one all-reduce per block (the
    routed and Qwen2-MoE's shared expert together): exactly TP = 1's tokens in fp32."""
    path = str(tiny_model_path(name))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [o["token_ids"] for o in LLM(path, device="cpu", dtype="float32").generate(PROMPTS, params, use_tqdm=False)]
    two = LLM(path, device="cpu", dtype="float32", tp_size=2)
    try:
        got = [o["token_ids"] for o in two.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        two.shutdown()
    assert got == want


def test_server_answers_like_transformers(tiny_model_path, tmp_path: Path) -> None:
    import httpx
    import openai
    from server_harness import Server

    path = tiny_model_path("qwen3_moe")
    hf = hf_model(path)
    server = Server("--model", str(path), "--dtype", "float32", cwd=tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for prompt in PROMPTS[:2]:
                r = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
                    "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
                assert r.status_code == 200, r.text
                assert r.json()["output_ids"] == hf_greedy(hf, prompt, 8)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="Hello there", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        want = tok.decode(hf_greedy(hf, tok("Hello there").input_ids, 8), skip_special_tokens=True)
        assert out.choices[0].text == want
    finally:
        assert server.stop() == 0


# ---- the Triton kernels inside the model (interpreted on the CPU) ----------------------------


@pytest.mark.triton
@pytest.mark.skipif(not env.TRITON_INTERPRET, reason="the CPU runs Triton kernels only under TRITON_INTERPRET=1")
def test_triton_path_matches_transformers(tiny_model_path) -> None:
    """The kernel path of the MoE blocks (here routing + alignment in one program, the fused
    GEMMs, the shared expert summed in) gives transformers' logits and tokens."""
    path = tiny_model_path("qwen2_moe")
    hf = hf_model(path)
    llm = LLM(str(path), device="cpu", dtype="float32")
    prompt = list(range(1000, 1020))
    ours = llm.engine.score([prompt])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max() / ref.abs().max() <= 1e-4
    assert llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0]["token_ids"] == hf_greedy(hf, prompt, 3)



# ---- tile configs ----------------------------------------------------------------------------


def test_a_padded_graph_batch_takes_the_same_tiles(tmp_path: Path) -> None:
    """Decode batches run eagerly at their size and in CUDA graphs padded to the ladder size: the
    tile config (and so every bit of the result) must be the same for both."""
    import bisect

    from minisgl.kernels import fused_moe_config as C
    from minisgl.step.cuda_graph import batch_size_ladder

    tiles = [C.MoeTileConfig(bm, C.GemmTile(n, 64), C.GemmTile(64, 128)) for bm in (16, 32, 64) for n in (32, 64)]
    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512]
    table = {"GPU X": {C.shape_key(128, 8, 768, 2048, torch.bfloat16): {
        str(m): tiles[i % len(tiles)].to_dict() for i, m in enumerate(sizes)}}}
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(table))
    C.use_config_file(path)
    try:
        for max_bs in (8, 160, 256):
            ladder = batch_size_ladder(max_bs)
            for bs in range(1, max_bs + 1):
                padded = ladder[bisect.bisect_left(ladder, bs)]
                for device in ("GPU X", None):  # tuned, and the default
                    got = [C.get_config(128, 8, 768, 2048, t, torch.bfloat16, device) for t in (bs, padded)]
                    assert got[0] == got[1], (max_bs, bs, padded, device)
        assert C.get_config(128, 8, 768, 2048, 3, torch.bfloat16, "GPU X") == tiles[2]  # M=4's entry
        assert C.get_config(128, 8, 768, 2048, 9000, torch.bfloat16, "GPU X") == tiles[10 % len(tiles)]
    finally:
        C.use_config_file(C.CONFIG_FILE)


def test_four_bit_experts_have_their_own_tiles(tmp_path: Path) -> None:
    """4-bit experts look up their format's entries (shape_key's w=, INT4 with its group), never the
    16-bit experts' (whose deepest pipelines overflow shared memory with the dequantisation), and
    the reverse; untuned (another format or group), the default tiles."""
    from minisgl.kernels import fused_moe_config as C

    t16 = C.MoeTileConfig(128, C.GemmTile(128, 64, 8, 8, 4), C.GemmTile(256, 64, 8, 8, 4))
    t4 = C.MoeTileConfig(64, C.GemmTile(64, 128, 8, 4, 3), C.GemmTile(128, 128, 8, 8, 3))
    key = (128, 8, 768, 2048, torch.bfloat16)
    g128, g32 = C.weights_key("int4", 128), C.weights_key("int4", 32)
    assert (g128, g32, C.weights_key("mxfp4", 32), C.weights_key(None, 128)) == ("int4g128", "int4g32", "mxfp4", None)
    table = {"GPU X": {C.shape_key(*key): {"4096": t16.to_dict()},
                       C.shape_key(*key, weights=g128): {"4096": t4.to_dict()}}}
    assert C.shape_key(*key, weights=g128) == C.shape_key(*key) + ",w=int4g128"
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(table))
    C.use_config_file(path)
    try:
        assert C.get_config(*key[:4], 4096, key[4], "GPU X") == t16
        assert C.get_config(*key[:4], 4096, key[4], "GPU X", weights=g128) == t4
        assert C.is_tuned(*key, "GPU X", weights=g128) and not C.is_tuned(*key, "GPU X", weights="mxfp4")
        default = C.default_config(128, 8, 4096, key[4])
        for other in ("mxfp4", g32):  # another format, or INT4 at another group: untuned
            assert C.get_config(*key[:4], 4096, key[4], "GPU X", weights=other) == default
    finally:
        C.use_config_file(C.CONFIG_FILE)
