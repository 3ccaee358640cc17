"""The one check of a prompt's token ids (the offline LLM, the engine and the server's
tokenizer workers all call it; the server prefixes the request field's name)."""

from __future__ import annotations

from collections.abc import Sequence


def check_prompt(ids: Sequence[int], max_model_len: int, vocab_size: int, generates: bool = True) -> None:
    """generates: the request generates tokens, so the prompt must leave room for one (an
    embedding request's prompt may fill the context)."""
    if len(ids) == 0:
        raise ValueError("prompt is empty")
    if len(ids) > max_model_len - generates:
        raise ValueError(
            f"prompt has {len(ids)} tokens but the context is {max_model_len} tokens"
            + (" (at least one must be left to generate)" if generates else "")
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
