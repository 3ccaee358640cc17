"""Extending after a cached prefix (chunked prefill or a prefix-cache hit) gives the same
logits and greedy tokens as computing everything from scratch."""

from __future__ import annotations

import torch

from minisgl import LLM
from minisgl.sampling.sampler import SamplingTensors


def test_extend_after_cached_prefix_equals_scratch(tiny_model_path) -> None:
    llm = LLM(str(tiny_model_path("qwen3")), device="cpu", dtype="float32", page_size=4)
    eng = llm.engine
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 5000, (23,), generator=gen).tolist()
    full = eng.score([prompt])[0]

    row = eng.table.allocate_row()
    pages = eng.allocator.allocate(8)
    eng.write_slots([row] * 32, list(range(32)), eng.allocator.slot_ids(pages)[:32])
    try:
        # Three extends: 9 tokens, then 7 more on top of those, then the last 7; then decode.
        pieces = [(0, prompt[:9]), (9, prompt[9:16]), (16, prompt[16:])]
        rows_logits = []
        for prefix, toks in pieces:
            batch = eng.build_batch("extend", [row], [prefix], [toks])
            rows_logits.append(eng.forward(batch, all_positions=True))
        chunked = torch.cat(rows_logits)
        torch.testing.assert_close(chunked, full, rtol=1e-4, atol=1e-4)

        # Decode 5 greedy tokens after the cached prompt; compare with scoring from scratch.
        tokens = list(prompt)
        st = SamplingTensors.build([0.0], [-1], [1.0], [0.0], [0], [0], eng.device)
        for _ in range(5):
            tokens.append(int(eng.sample(eng.forward(
                eng.build_batch("extend" if len(tokens) == len(prompt) else "decode", [row],
                                [len(tokens) - 1], [[tokens[-1]]])), st)[0]))
        scratch = eng.score([tokens[:-1]])[0]
        assert scratch[len(prompt) - 1 :].argmax(-1).tolist() == tokens[len(prompt) :]
    finally:
        eng.allocator.free(pages)
        eng.table.free_row(row)
