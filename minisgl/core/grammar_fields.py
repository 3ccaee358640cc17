"""The grammar fields of a request (SamplingParams' structured-output fields) as the request
vocabulary: their names, their normal form, and the hashable spec (kind, text) that keys the
grammar compiler's cache. Parsing a grammar needs xgrammar: that lives in minisgl/grammar/."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# SamplingParams fields that hold a grammar; at most one may be set.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_FIELDS
    text: str  # the JSON schema / regex / EBNF / structural tag (JSON text)


def normalize_grammar_field(name: str, value: Any) -> str | None:
    """A grammar field as text (dicts become JSON), or None when unset; ValueError names the field."""
    if value is None:
        return None
    if isinstance(value, dict) and name in ("json_schema", "structural_tag"):
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        dict_ok = name in ("json_schema", "structural_tag")
        kinds = "a JSON object or a non-empty string" if dict_ok else "a non-empty string"
        raise ValueError(f"{name} must be {kinds}, got {value!r}")
    return value


def grammar_spec(params: Any) -> GrammarSpec | None:
    """The spec of a SamplingParams (its grammar fields already normalized by validate())."""
    for name in GRAMMAR_FIELDS:
        value = getattr(params, name, None)
        if value is not None:
            return GrammarSpec(name, value)
    return None
