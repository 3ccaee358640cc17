"""Request models of chat's structured fields: `response_format`, the SGLang/vLLM `regex` and
`ebnf`, `tools` / `tool_choice`, assistant `tool_calls` and `role: "tool"` messages, and
`chat_template_kwargs`. Shapes only; build.py (chat_request.py) turns them into the grammar and
template inputs, and names what the schema cannot state (a grammar xgrammar rejects, a
tool_choice naming no tool) in a 400.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema, model_validator

from minisgl.server.protocol_types import Strict

NEEDS_COMPILE = "must compile with xgrammar (not expressible in the schema: else 400 naming xgrammar's reason)"
ONE_CONSTRAINT = (
    "One output constraint at most: response_format other than text, regex, ebnf, or tool_choice required / "
    "named (not expressible in the schema)"
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
