"""Request models of the structured fields: the output constraints every generate route takes
(`response_format`, the SGLang/vLLM `regex` and `ebnf`, vLLM's `structured_outputs`; /generate's
in its sampling_params), chat's `tools` / `tool_choice`, assistant `tool_calls` and `role: "tool"`
messages, and `chat_template_kwargs`. Shapes only; build.py (chat_request.py) turns them into the
grammar and template inputs, and names what the schema cannot state (a grammar xgrammar rejects,
a tool_choice naming no tool) in a 400. The schema states the one-constraint rule itself
(`one_constraint_rule`): a body with two constraints is invalid by the schema, as the server says.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema, model_validator

from minisgl.server.protocol_types import Strict

NEEDS_COMPILE = "must compile with xgrammar (not expressible in the schema: else 400 naming xgrammar's reason)"
ONE_CONSTRAINT = (
    "One output constraint at most: response_format other than text, regex, ebnf, structured_outputs, or (chat) "
    "tool_choice required / named (stated by the schema's allOf)"
)
# Arguments of apply_chat_template, and what it passes the template itself: not template variables.
RESERVED_TEMPLATE_KWARGS = (
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
    "strftime_now",
)


class JsonSchemaSpec(Strict):
    name: str | None = Field(default=None, description="OpenAI requires it; here it is only a label")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(
        default=None, alias="schema", description="the JSON schema of the output (none: any JSON object); "
        + NEEDS_COMPILE
    )
    strict: bool | None = Field(default=None, description="the output always follows the schema exactly")


class ResponseFormatText(Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(Strict):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StructuralTagItem(Strict):
    begin: str
    schema_: dict[str, Any] | bool = Field(alias="schema")
    end: str


class ResponseFormatStructuralTag(Strict):
    """xgrammar's structural tag: its `format`, or the older `structures` + `triggers` form
    that vLLM and SGLang take; exactly one of the two."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["format"], "not": {"anyOf": [{"required": ["structures"]}, {"required": ["triggers"]}]}},
        {"required": ["structures", "triggers"], "not": {"required": ["format"]}},
    ]})
    type: Literal["structural_tag"]
    # Absent, not null, when unused: the schema's oneOf counts present keys.
    format: dict[str, Any] = Field(default=None, description=NEEDS_COMPILE)  # type: ignore[assignment]
    structures: list[StructuralTagItem] = Field(default=None, description=NEEDS_COMPILE)  # type: ignore[assignment]
    triggers: list[str] = Field(default=None)  # type: ignore[assignment]

    @model_validator(mode="after")
    def check_one_of(self) -> Any:
        legacy = (self.structures is not None, self.triggers is not None)
        if legacy != (True, True) if self.format is None else legacy != (False, False):
            raise ValueError("give either format, or structures and triggers")
        return self


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema | ResponseFormatStructuralTag,
    Field(discriminator="type"),
]

STRUCTURED_OUTPUT_KEYS = ("json", "regex", "grammar", "choice")


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of json, regex, grammar, choice."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": [k]} for k in STRUCTURED_OUTPUT_KEYS]})
    # Absent, not null, when unused: the schema's oneOf counts present keys.
    json_: dict[str, Any] | str = Field(  # type: ignore[assignment]
        default=None, alias="json", description="a JSON schema (an object, or its JSON text); " + NEEDS_COMPILE
    )
    regex: Annotated[str, Field(min_length=1)] = Field(  # type: ignore[assignment]
        default=None, description="the output matches this regex; " + NEEDS_COMPILE
    )
    grammar: Annotated[str, Field(min_length=1)] = Field(  # type: ignore[assignment]
        default=None, description="an EBNF grammar (root rule `root`); " + NEEDS_COMPILE
    )
    choice: list[Annotated[str, Field(min_length=1)]] = Field(  # type: ignore[assignment]
        default=None, min_length=1, description="the output is exactly one of these strings"
    )

    @model_validator(mode="after")
    def check_one_of(self) -> Any:
        given = [k for k in STRUCTURED_OUTPUT_KEYS if getattr(self, "json_" if k == "json" else k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}")
        return self


class OutputConstraints(Strict):
    """The output constraints of chat and completions (at most one; `one_constraint_rule`)."""

    response_format: ResponseFormat | None = Field(default=None, description=ONE_CONSTRAINT)
    regex: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="SGLang/vLLM: the output matches this regex; " + NEEDS_COMPILE
    )
    ebnf: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description="SGLang/vLLM: the output follows this EBNF grammar (root rule `root`); " + NEEDS_COMPILE,
    )
    structured_outputs: StructuredOutputs | None = Field(default=None, description="vLLM's; " + ONE_CONSTRAINT)


# What makes each field a constraint (present, and a value that constrains), in JSON Schema.
CONSTRAINING: dict[str, dict[str, Any]] = {
    "response_format": {"type": "object", "required": ["type"], "properties": {"type": {"not": {"const": "text"}}}},
    "regex": {"type": "string"},
    "ebnf": {"type": "string"},
    "structured_outputs": {"type": "object"},
}
TOOL_CHOICE_CONSTRAINING = {"anyOf": [{"const": "required"}, {"type": "object"}]}


def one_constraint_rule(constraining: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A model's json_schema_extra stating "at most one of these constrains the output": no two
    of them present with a constraining value. The server refuses the same bodies (400 naming
    the second field), so a schema-valid body is never refused for it."""
    names = list(constraining)

    def present(name: str) -> dict[str, Any]:
        return {"required": [name], "properties": {name: constraining[name]}}

    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    return {"allOf": [{"not": {"allOf": [present(a), present(b)]}} for a, b in pairs]}


ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDef(Strict):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description='a JSON schema of the arguments; with tool_choice "required" or named: '
        + NEEDS_COMPILE
    )
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: ToolName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Strict):
    name: str
    arguments: str = Field(description="JSON text (rendered as an object), or any text (rendered as it is)")


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


def _no_reserved(value: dict[str, Any]) -> dict[str, Any]:
    bad = sorted(set(value) & set(RESERVED_TEMPLATE_KWARGS))
    if bad:
        raise ValueError(f"{bad[0]!r} is not a template variable of one's own (reserved by the chat template call)")
    return value


TemplateKwargs = Annotated[
    dict[str, Any],
    AfterValidator(_no_reserved),
    WithJsonSchema({
        "type": "object",
        "description": "extra variables for the chat template, e.g. {\"enable_thinking\": false} for Qwen3",
        "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}},
    }),
]
