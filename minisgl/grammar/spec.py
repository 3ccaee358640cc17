"""A request's grammar (minisgl.core.grammar_fields.GrammarSpec) as xgrammar builds it.

`check_grammar` parses the spec with xgrammar without a tokenizer (well under a millisecond
for typical schemas), so the offline LLM refuses a schema, regex or grammar that xgrammar
rejects, with xgrammar's reason, before anything is queued. The server parses grammars only in
the scheduler's compiler (compiler.py): xgrammar imports torch, which the API process never
loads (DESIGN.md §2).
"""

from __future__ import annotations

import json
import re
from typing import Any

from minisgl.core.grammar_fields import GrammarSpec

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " (a C++ log prefix).
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


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
