"""Request bodies of OpenAI's Responses API (POST /v1/responses), as strict pydantic models: the
first stage of the route and its part of /openapi.json.

Stateless: the server keeps no responses, so `store: true` and `previous_response_id` are refused
by name (capabilities.STATELESS); a conversation goes whole in `input`, the earlier output items
included (message, function_call and reasoning items are taken back as they were sent, their ids
and statuses too). What runs is the chat request it translates to (responses_build.py). Per
server (`ResponsesProtocol`): the max_output_tokens bound, and tools / reasoning only where a
tool-call / reasoning parser can return them.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Discriminator, Field, Tag, create_model

from minisgl.server.capabilities import NO_REASONING_PARSER, NO_TOOL_PARSER, STATELESS, refused
from minisgl.server.protocol_structured import NEEDS_COMPILE, ToolName
from minisgl.server.protocol_types import NO_EFFECT, Limits, Strict, int_in

Status = Literal["in_progress", "completed", "incomplete"] | None


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    """An earlier answer's text, passed back (its annotations and logprobs are not read)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"] = Field(description="developer is sent as system")
    content: str | list[ContentPart] = Field(description="text, or text parts (joined)")
    id: str | None = None
    status: Status = None


class FunctionCallItem(Strict):
    """An earlier answer's tool call (a function_call output item, passed back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="JSON text (rendered as an object), or any text (rendered as it is)")
    id: str | None = None
    status: Status = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText] = Field(description="the tool's result: text, or text parts (joined)")
    id: str | None = None
    status: Status = None


class SummaryText(Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
    """An earlier answer's reasoning, passed back: dropped (chat templates drop past reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Status = None


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


def _not_only_reasoning(items: list[Any]) -> list[Any]:
    if all(_item_type(i) == "reasoning" for i in items):
        raise ValueError("needs a message, function_call or function_call_output item (reasoning items are dropped)")
    return items


Items = Annotated[
    list[InputItem],
    Field(
        min_length=1,
        json_schema_extra={"contains": {"not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}},
    ),
    AfterValidator(_not_only_reasoning),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None,
        description='a JSON schema of the arguments; with tool_choice "required" or named: ' + NEEDS_COMPILE,
    )
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: ToolName = Field(description="one of tools (not expressible in the schema)")


class FormatText(Strict):
    type: Literal["text"]


class FormatJsonObject(Strict):
    type: Literal["json_object"]


class FormatJsonSchema(Strict):
    type: Literal["json_schema"]
    name: str = Field(description="a label")
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema of the output; " + NEEDS_COMPILE)
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")] | None = None


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        default=None, description='"none": the template\'s thinking off (enable_thinking false); else on'
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None, description="accepted; the reasoning comes whole, as a reasoning item's reasoning_text"
    )


class ResponsesRequest(Strict):
    model: str | None = Field(default=None, description="must be the served model's name (else 404)")
    input: Annotated[str, Field(min_length=1)] | Items = Field(
        description="a user message's text, or the conversation's items (not reasoning items alone)"
    )
    instructions: str | None = Field(default=None, description="a system message before the input")
    tools: list[FunctionTool] | None = Field(
        default=None, description="function tools (names unique: not expressible in the schema)"
    )
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one tool call")
    text: TextConfig | None = Field(
        default=None,
        description="format: the output's format (json_schema: must "
        "compile with xgrammar, not expressible in the schema)",
    )
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int_in(1, None) | None = Field(
        default=None,
        description="default: the rest of the context; the prompt's tokens plus it must fit the "
        "context (not expressible in the schema: else 400)",
    )
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(default=None, description="0: greedy")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    store: refused(STATELESS, False) = None  # type: ignore[valid-type]
    previous_response_id: refused(STATELESS) = None  # type: ignore[valid-type]
    truncation: Literal["disabled"] | None = Field(
        default=None, description='"disabled" only: a prompt past the context is a 400'
    )
    metadata: dict[str, str] | None = Field(default=None, description=NO_EFFECT)
    user: str | None = Field(default=None, description=NO_EFFECT)
    service_tier: str | None = Field(default=None, description=NO_EFFECT)
    prompt_cache_key: str | None = Field(default=None, description=NO_EFFECT)
    safety_identifier: str | None = Field(default=None, description=NO_EFFECT)


class ResponsesProtocol:
    """The Responses request model of one server: max_output_tokens bounded by its context, and
    tools / reasoning only where a tool-call / reasoning parser can return them."""

    def __init__(self, limits: Limits, tools: bool, reasoning: bool) -> None:
        fields: dict[str, Any] = {
            "max_output_tokens": (
                int_in(1, limits.max_new_tokens) | None,
                ResponsesRequest.model_fields["max_output_tokens"],
            ),
        }
        if not tools:
            fields["tools"] = (refused(NO_TOOL_PARSER), None)
            fields["tool_choice"] = (refused(NO_TOOL_PARSER, "none"), None)
        if not reasoning:
            fields["reasoning"] = (refused(NO_REASONING_PARSER), None)
        self.responses: type[BaseModel] = create_model("ResponsesRequest", __base__=ResponsesRequest, **fields)
