"""Refusals of what this server was started without, all in one style: the 400 names the request's
field, the server flag that turns the capability on and that flag's values. The field's schema
(per server, see protocol.py) admits only its neutral values, so a schema-valid body is never
refused for it, and a client reading /openapi.json learns the same from the field's description.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema

from minisgl.parsers.reasoning import REASONING_PARSERS
from minisgl.parsers.tool_formats import ALIASES, TOOL_FORMATS


def _choices(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


NO_TOOL_PARSER = (
    "this server has no tool-call parser for its model's output, so it cannot return tool calls: start it with "
    f"--tool-call-parser {_choices(sorted(TOOL_FORMATS))} (aliases: {', '.join(sorted(ALIASES))}), or serve a "
    "model whose chat template shows its tool-call format"
)
NO_REASONING_PARSER = (
    "this server has no reasoning parser, so it cannot return the model's reasoning apart from its answer: "
    f"start it with --reasoning-parser {_choices(sorted(REASONING_PARSERS))}"
)
EMBED_ONLY = (
    "this server serves an embedding model (--task embed): it answers POST /v1/embeddings only; start one "
    "with --task generate to generate text"
)
STATELESS = (
    "this server keeps no responses (stateless): send the whole conversation as input, with store false or absent "
    "and no previous_response_id"
)
GENERATE_ONLY = (
    "this server generates text (--task generate): POST /v1/embeddings needs an embedding model; start a "
    "server with --task embed (or on a sentence-transformers / Qwen3-Embedding folder, detected by --task auto)"
)


def refused(why: str, *neutral: Any) -> Any:
    """A field type that takes only `neutral` values (null, and e.g. "none"); any other value is
    a 400 saying `why`. Use with a default of None."""
    allowed = (None, *neutral)

    def check(value: Any) -> Any:
        if not any(type(value) is type(v) and value == v for v in allowed):  # 0 is no False
            raise ValueError(why)
        return value

    schema: dict[str, Any] = (
        {"type": "null"} if not neutral else {"anyOf": [{"type": "null"}, *({"const": v} for v in neutral)]}
    )
    return Annotated[Any, BeforeValidator(check), WithJsonSchema({**schema, "description": why}), Field()]
