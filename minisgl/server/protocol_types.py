"""Field types of the request models whose bounds come from the served model (vocabulary size,
context length), each with the JSON schema that states exactly what its validator accepts:
/openapi.json must admit every request the server takes and no other."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

MAX_LOGPROBS = 20  # alternatives per position, as OpenAI allows for top_logprobs
MAX_N = 128  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
# Seeds: JSON's interoperable integers (RFC 8259 section 6: exact in a double), which every
# client and schema validator compares exactly; int64 bounds would not be (2^63 - 1 rounds).
SEED_MIN, SEED_MAX = -(2**53 - 1), 2**53 - 1
_CANONICAL_INT = re.compile(r"0|[1-9][0-9]*")


# The description of a field taken only so that clients written for other servers work.
NO_EFFECT = "accepted for compatibility; does not change the output"


def _integral(value: Any) -> Any:
    # JSON Schema counts 1.0 as an integer; Python's json reads it as a float.
    return int(value) if type(value) is float and value.is_integer() else value


def int_in(ge: int | None = None, le: int | None = None) -> Any:
    """An integer in [ge, le] (or a float with no fraction). The bounds sit inside, on the int:
    outside the BeforeValidator pydantic could not state them in the JSON schema."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


Int = int_in()


class Strict(BaseModel):
    """Request models: a JSON `true` is no integer, `"0.5"` no number, an unknown field a 400."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


@dataclass(frozen=True)
class Limits:
    """What the request models need to know about the served model."""

    vocab_size: int
    max_model_len: int

    @property
    def max_token_id(self) -> int:
        return self.vocab_size - 1

    @property
    def max_new_tokens(self) -> int:
        return self.max_model_len - 1  # a prompt has at least one token


def int_range_pattern(hi: int) -> str:
    """A regex (JSON-schema dialect) matching exactly the canonical decimals 0..hi: used to
    state the token-id keys of logit_bias, which JSON can only carry as strings."""
    s, alts = str(hi), ["0"]
    alts += ["[1-9]" + (f"[0-9]{{{k}}}" if k else "") for k in range(len(s) - 1)]  # shorter numbers
    for i, ch in enumerate(s):  # same length: equal to hi up to i, then a smaller digit
        lo, rest = (1 if i == 0 else 0), len(s) - i - 1
        if int(ch) > lo:
            digit = str(lo) if int(ch) - 1 == lo else f"[{lo}-{int(ch) - 1}]"
            alts.append(s[:i] + digit + (f"[0-9]{{{rest}}}" if rest else ""))
    alts.append(s)
    return "^(" + "|".join(dict.fromkeys(alts)) + ")$"


def _token_id_checker(limits: Limits) -> Any:
    def check(ids: list[int]) -> list[int]:
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise ValueError(f"[{bad}]: token id {ids[bad]} is outside the vocabulary [0, {limits.vocab_size})")
        return ids

    return check


def token_ids(limits: Limits, *, min_items: int = 0, max_items: int | None = None) -> Any:
    """A list of token ids, each in [0, vocab_size); `[i]: token id X is outside ...` when not.
    Checked by hand rather than per item by pydantic, so that one id past 2^64 gives one
    readable error (and never reaches msgpack)."""
    schema: dict[str, Any] = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": limits.max_token_id},
        "minItems": min_items,
    }
    if max_items is not None:
        schema["maxItems"] = max_items
    return Annotated[
        list[Int],
        Field(min_length=min_items, max_length=max_items),
        AfterValidator(_token_id_checker(limits)),
        WithJsonSchema(schema),
    ]


def logit_bias(limits: Limits) -> Any:
    """OpenAI's logit_bias: token id (as a decimal string, JSON keys being strings) -> bias in
    [-100, 100]. Parsed to {int: float}."""

    def parse(value: dict[str, float]) -> dict[int, float]:
        out: dict[int, float] = {}
        for key, bias in value.items():
            if not _CANONICAL_INT.fullmatch(key):
                raise ValueError(f"key {key!r} is not a token id (a decimal integer, as a string)")
            if int(key) >= limits.vocab_size:
                raise ValueError(f"key {key}: token id is outside the vocabulary [0, {limits.vocab_size})")
            out[int(key)] = bias
        return out

    schema = {
        "type": "object",
        "description": f"token id (decimal string, 0..{limits.max_token_id}) -> bias added to its logit",
        "patternProperties": {
            int_range_pattern(limits.max_token_id): {"type": "number", "minimum": -100, "maximum": 100}
        },
        "additionalProperties": False,
    }
    return Annotated[
        dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]],
        AfterValidator(parse),
        WithJsonSchema(schema),
    ]


def text_or_ids(limits: Limits, max_items: int, max_ids: int, noun: str, description: str) -> Any:
    """A string, a list of strings, a list of token ids or a list of such lists (each at most
    `max_ids` tokens, at most `max_items` of them); normalised to a list of str or list[int].
    Hand-parsed: a pydantic union would report one error per branch for a single bad id."""
    check_ids = _token_id_checker(limits)

    def one(p: Any, where: str) -> str | list[int]:
        if isinstance(p, str):
            if not p:
                raise ValueError(f"{where}must not be empty")
            return p
        if isinstance(p, list) and p and all(type(_integral(t)) is int for t in p):
            p = [_integral(t) for t in p]
            if len(p) > max_ids:
                raise ValueError(f"{where}has {len(p)} tokens; the context is {limits.max_model_len}")
            try:
                return check_ids(p)
            except ValueError as e:
                raise ValueError(f"{where.rstrip(': ')}{e}") from None
        raise ValueError(f"{where}must be a non-empty string or a non-empty list of token ids")

    def parse(value: Any) -> list[str | list[int]]:
        if isinstance(value, str) or (isinstance(value, list) and value and type(_integral(value[0])) is int):
            return [one(value, "")]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a non-empty string, list of strings, list of token ids, or list of those lists")
        if len(value) > max_items:
            raise ValueError(f"at most {max_items} {noun} per request, got {len(value)}")
        return [one(p, f"[{i}]: ") for i, p in enumerate(value)]

    ids = {
        "type": "array",
        "minItems": 1,
        "maxItems": max_ids,
        "items": {"type": "integer", "minimum": 0, "maximum": limits.max_token_id},
    }
    text = {"type": "string", "minLength": 1}
    schema = {
        "description": description,
        "anyOf": [
            text,
            ids,
            {"type": "array", "minItems": 1, "maxItems": max_items, "items": text},
            {"type": "array", "minItems": 1, "maxItems": max_items, "items": ids},
        ],
    }
    return Annotated[Any, BeforeValidator(parse), WithJsonSchema(schema)]


def completion_prompt(limits: Limits) -> Any:
    """/v1/completions `prompt`, normalised to a list of prompts (str or list[int])."""
    return text_or_ids(
        limits, MAX_PROMPTS, limits.max_new_tokens, "prompts",
        "the prompt(s); with a list, each prompt is generated n times. Not stated by the schema: the prompt's "
        "tokens plus max_tokens must fit the context (else 400)",
    )


def as_json_data(obj: Any) -> Any:
    """A validated model (or a list of them, or a neutral value a capability refusal let through)
    as plain JSON data, the way a translated request carries it to the chat stages."""
    if isinstance(obj, list):
        return [as_json_data(o) for o in obj]
    return obj.model_dump(by_alias=True, exclude_none=True) if hasattr(obj, "model_dump") else obj
