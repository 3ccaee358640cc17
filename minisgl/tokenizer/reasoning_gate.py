"""Where a reasoning model's grammar starts: after its reasoning block, not at the first token."""

from __future__ import annotations

from typing import Any

from minisgl.core.grammar_fields import grammar_spec
from minisgl.core.sampling_params import SamplingParams
from minisgl.parsers.reasoning import REASONING_PARSERS, prompt_closes_reasoning, prompt_opens_reasoning


def reasoning_gate(tok: Any, parser: str, prompt: str, params: SamplingParams) -> bool:
    """Sets params.grammar_after_token to the block's closing token when the request has a
    grammar and its prompt leaves room for a reasoning block (Qwen3 with enable_thinking=False
    renders an empty, closed block: then the grammar starts at once). Returns whether the prompt
    itself opened the block (the output starts inside it). `prompt` may be the prompt's end only."""
    if parser == "gpt-oss":
        # Harmony: the grammar (tool_choice's calls, a response_format) constrains the output
        # from its first token; the analysis channel is then skipped (README: Tool calling).
        return False
    if grammar_spec(params) is not None and not prompt_closes_reasoning(prompt, parser):
        close = REASONING_PARSERS[parser][1]
        ids = tok(close, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise ValueError(f"--reasoning-parser {parser}: {close!r} is not one token for this tokenizer")
        params.grammar_after_token = ids[0]
    return prompt_opens_reasoning(prompt, parser)
