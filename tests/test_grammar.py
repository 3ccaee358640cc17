"""Structured output offline (minisgl.LLM, tiny random-weight model, CPU): every output under a
JSON schema validates with jsonschema (10 seeds here, 200 in test_grammar_gpu.py), regex and
EBNF likewise; constrained rows leave the unconstrained rows of their batch untouched; overlap
equals no overlap; chunked prefill and prefix-cache hits; bad grammars are refused naming the
field; the reasoning gate."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.core.grammar_fields import GrammarSpec
from minisgl.grammar.compiler import GrammarCompiler
from minisgl.grammar.masks import GrammarMasks
from minisgl.grammar.spec import check_grammar
from minisgl.kernels.token_bitmask import unpack_bitmask_reference

# Nested objects, an array, enums, required fields, bounded numbers; strings by pattern: xgrammar
# 0.2.8 lets a string with maxLength hold raw control characters (strict JSON parsers refuse them).
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "emu"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z]{1,2}$"},
                "age": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["age"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["id", "kind", "owner", "tags"],
}
REGEX = r"(yes|no), [a-z]{1,6}@[a-z]{2,5}\.(com|org)"
EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num op expr\nnum ::= [1-9] [0-9]?\nop ::= " + " | " * "'
PROMPTS = ["Describe a pet as JSON:", "Hello", "The answer is", "Give me data"]


@pytest.fixture(scope="module")
def llm(tiny_model_path: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model_path("llama3")), device="cpu", max_model_len=256, num_pages=4096)


def sampled(n: int, cap: int = 120, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=cap, temperature=1.0, seed=s, **kw) for s in range(n)]


def check_mixed_batch(llm: LLM, n_json: int, n_other: int, check_plain: bool = True) -> None:
    """n_json seeds under the JSON schema, n_other under the regex and under the EBNF grammar,
    and 3 unconstrained rows, all in one batch: every constrained output stops by itself and
    validates. A seeded row's draw depends only on its logits and (seed, step): the
    unconstrained rows must equal a batch without the constrained ones (where the numerics do
    not depend on the batch size: the CPU)."""
    plain = [SamplingParams(max_tokens=12, seed=100 + i) for i in range(3)]
    params = [*sampled(n_json, json_schema=SCHEMA), *sampled(n_other, regex=REGEX), *sampled(n_other, ebnf=EBNF),
              *plain]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params, use_tqdm=False)
    for out in outs[:n_json]:
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert len({o["text"] for o in outs[:n_json]}) > 0.8 * n_json  # really sampled, not one forced string
    for out in outs[n_json : n_json + n_other]:
        assert out["finish_reason"] == "stop" and re.fullmatch(REGEX, out["text"]), out
    for out in outs[n_json + n_other : -3]:
        text = out["text"]
        assert out["finish_reason"] == "stop" and re.fullmatch(r"\((\d+( [+*] \d+)*)\)", text), out
    if check_plain:
        assert_same(outs[-3:], llm.generate([PROMPTS[(len(params) - 3 + i) % 4] for i in range(3)], plain,
                                            use_tqdm=False))


def assert_same(got: list[dict], want: list[dict]) -> None:
    """Equal results: tokens and text exactly, the fp32 logprobs within rounding (the batches
    differ, and with them the reduction order)."""
    assert [{k: v for k, v in o.items() if k != "logprobs"} for o in got] == [
        {k: v for k, v in o.items() if k != "logprobs"} for o in want
    ]
    for g, w in zip(got, want):
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)


def test_grammars_in_one_mixed_batch(llm: LLM) -> None:
    """A CI-sized sample; tests/test_grammar_gpu.py runs 200 seeds of the same on the GPU."""
    check_mixed_batch(llm, n_json=10, n_other=3)


def test_overlap_equals_no_overlap(llm: LLM, tiny_model_path: Callable[[str], Path]) -> None:
    """With overlap a constrained row waits for its in-flight token before its mask: the tokens
    must equal the non-overlap scheduler's."""
    mixed = [SamplingParams(max_tokens=12, seed=7), *sampled(2, json_schema=SCHEMA, cap=16), *sampled(1, regex=REGEX)]
    prompts = [PROMPTS[i % 4] for i in range(len(mixed))]
    no_overlap = LLM(str(tiny_model_path("llama3")), device="cpu", max_model_len=256, num_pages=1024,
                     disable_overlap=True)
    assert_same(no_overlap.generate(prompts, mixed, use_tqdm=False), llm.generate(prompts, mixed, use_tqdm=False))


def test_chunked_prefill_and_prefix_hits(tiny_model_path: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model_path("llama3")), device="cpu", max_model_len=256, num_pages=1024, max_prefill_tokens=7)
    prompt = "A long shared prefix that spans several prefill chunks, then: "
    first = llm.generate([prompt], sampled(1, regex=REGEX), use_tqdm=False)
    again = llm.generate([prompt] * 2, sampled(2, regex=REGEX), use_tqdm=False)  # radix hits
    assert_same(again[:1], first)
    for out in again:
        assert out["finish_reason"] == "stop" and re.fullmatch(REGEX, out["text"]), out
    assert llm.scheduler.cache.cached_pages > 0


def test_stop_conditions_end_constrained_rows(llm: LLM) -> None:
    out = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=3, seed=1, json_schema=SCHEMA),
                                     SamplingParams(max_tokens=40, seed=2, regex=REGEX, stop=["@"])], use_tqdm=False)
    assert out[0]["finish_reason"] == "length" and len(out[0]["token_ids"]) == 3
    assert out[1]["finish_reason"] == "stop" and "@" not in out[1]["text"]


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, r"^json_schema: invalid \("),
        ({"regex": "a(b"}, r"^regex: invalid \(Regex parsing error"),
        ({"ebnf": "root ::= foo"}, r"^ebnf: invalid \(.*Rule \"foo\" is not defined"),
        ({"structural_tag": '{"type": "structural_tag", "format": {"type": "nope"}}'}, r"^structural_tag: invalid"),
        ({"json_schema": "{not json"}, r"^json_schema: invalid"),
    ],
)
def test_bad_grammar_is_a_value_error_naming_the_field(llm: LLM, kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        llm.generate("hi", SamplingParams(max_tokens=4, **kw), use_tqdm=False)
    assert not llm.scheduler.has_work
    assert llm.generate("hi", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]["token_ids"]


def test_sampling_params_grammar_fields() -> None:
    with pytest.raises(ValueError, match="^json_schema: only one of"):
        SamplingParams(json_schema={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="^regex must be"):
        SamplingParams(regex="")
    with pytest.raises(ValueError, match="^grammar_after_token"):
        SamplingParams(regex="a", grammar_after_token=-1)
    p = SamplingParams(json_schema={"type": "object"})
    assert p.json_schema == '{"type": "object"}'  # dicts travel as JSON text (msgpack, cache key)
    check_grammar(GrammarSpec("structural_tag", json.dumps(
        {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]})))


def test_compiler_caches_and_gate_opens_after_token(llm: LLM) -> None:
    comp = GrammarCompiler(lambda: llm.tokenizer, llm.engine.model_config.vocab_size)
    spec = GrammarSpec("regex", "ab")
    assert comp.prefetch(spec) is comp.prefetch(spec)  # one compile per spec
    tok = llm.tokenizer
    after = tok.convert_tokens_to_ids("<|im_end|>")
    g = comp.matcher(spec, [tok.eos_token_id], after)
    masks = GrammarMasks(comp.vocab_size, 4, torch.device("cpu"))
    assert not g.needs_mask and g.accept(5) and not g.needs_mask  # free until the gate token
    assert g.accept(after) and g.needs_mask
    allowed = unpack_bitmask_reference(masks.fill([g])[0], comp.vocab_size)[0]
    ids = allowed.nonzero().flatten().tolist()
    assert ids and all(tok.decode([i]) in ("a", "ab") for i in ids)
    assert not g.accept(tok.convert_tokens_to_ids("b")) and g.rejected


def test_grammar_starts_after_the_gate_token(llm: LLM) -> None:
    """With grammar_after_token, tokens up to that token are free, then the grammar holds: the
    greedy first token is used as the gate, so the output is that token, then the regex."""
    first = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    gate = first["token_ids"][0]
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0.0, regex=REGEX,
                                                   grammar_after_token=gate), use_tqdm=False)[0]
    assert out["token_ids"][0] == gate and out["finish_reason"] == "stop"
    assert re.fullmatch(REGEX, llm.tokenizer.decode(out["token_ids"][1:], skip_special_tokens=True))
