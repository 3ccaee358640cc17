"""What a request constrains its output to: one of the SamplingParams grammar fields, as a
hashable spec (kind, text) that keys the compile cache.

`check_grammar` parses the spec with xgrammar without a tokenizer (well under a millisecond
for typical schemas), so a schema, regex or grammar that xgrammar rejects is refused where the
request is validated, with xgrammar's reason, before anything is queued.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# SamplingParams fields that hold a grammar; at most one may be set.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " (a C++ log prefix).
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


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


def xgrammar_message(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return _CPP_PREFIX.sub("", lines[0] if lines else type(e).__name__)


def structural_tag_json(text: str) -> str:
    """xgrammar's structural tag JSON. Also accepts the older form vLLM and SGLang take in
    `response_format` ({"structures": [{"begin", "schema", "end"}], "triggers": [...]})."""
    from xgrammar.structural_tag import StructuralTag, StructuralTagItem

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"structural_tag is not valid JSON: {e}") from e
    if isinstance(obj, dict) and "structures" in obj:
        items = [StructuralTagItem(**s) for s in obj["structures"]]
        return StructuralTag.from_legacy_structural_tag(items, list(obj.get("triggers", []))).model_dump_json()
    return text


def build_grammar(spec: GrammarSpec) -> Any:
    """The xgrammar Grammar of `spec` (no tokenizer needed). JSON is generated compactly with
    the usual separators (", " and ": ") rather than with free whitespace: a weak or random model
    could otherwise spend its whole budget on whitespace."""
    import xgrammar as xgr

    if spec.kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=True)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind == "ebnf":
        return xgr.Grammar.from_ebnf(spec.text)
    if spec.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(structural_tag_json(spec.text))
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


def check_grammar(spec: GrammarSpec) -> None:
    """ValueError naming the field and xgrammar's reason when `spec` does not parse."""
    try:
        build_grammar(spec)
    except ValueError as e:
        if str(e).startswith(spec.kind):
            raise
        raise ValueError(f"{spec.kind}: invalid ({xgrammar_message(e)})") from e
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and pydantic errors
        raise ValueError(f"{spec.kind}: invalid ({xgrammar_message(e)})") from e
