"""Request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as
strict pydantic models: the first stage of those routes and their part of /openapi.json.

What the server runs is the chat request they translate to (anthropic_build.py): the same
template, grammar and output parsers as /v1/chat/completions. Fields that cannot change the
output (`metadata`, `cache_control`, `service_tier`) are declared and accepted; anything else
unknown is refused by name. Per server (`AnthropicProtocol`): max_tokens and top_k bounds, and
tools / thinking only where a tool-call / reasoning parser can return them (capabilities.py).
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, create_model

from minisgl.server.capabilities import NO_REASONING_PARSER, NO_TOOL_PARSER, refused
from minisgl.server.protocol_structured import NEEDS_COMPILE, ToolName
from minisgl.server.protocol_types import NO_EFFECT, Limits, Strict, int_in


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


Cache = Field(default=None, description=NO_EFFECT)


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = Cache


class ToolUseBlock(Strict):
    """An assistant's earlier tool call (the `tool_use` block of a response, passed back)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = Cache


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = Field(default=None, description="text, or text blocks (joined)")
    is_error: bool | None = Field(default=None, description="the result goes to the template as it is")
    cache_control: CacheControl | None = Cache


class ThinkingBlock(Strict):
    """An earlier answer's thinking, passed back: dropped (chat templates drop past reasoning)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


UserBlock = Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[
    TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class UserMessage(Strict):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


Message = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class AnthropicTool(Strict):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any] = Field(
        description='a JSON schema of the input; with tool_choice "any" or "tool": ' + NEEDS_COMPILE
    )
    type: Literal["custom"] | None = Field(default=None, description="client tools only (no server tools)")
    cache_control: CacheControl | None = Cache


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = Field(default=None, description="true: at most one tool call")


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: ToolName = Field(description="one of tools (not expressible in the schema)")
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]
TOOL_CHOICE_NONE = {"type": "none"}


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: int_in(1024, None) = Field(
        description="accepted; the thinking is not cut at this budget (max_tokens bounds the whole answer)"
    )


class ThinkingAdaptive(Strict):
    type: Literal["adaptive"]


class ThinkingDisabled(Strict):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]
THINKING_OFF = {"type": "disabled"}
THINKING = (
    "enabled / adaptive: the template's thinking on (enable_thinking), and the reasoning returned as thinking "
    "blocks; disabled: off; absent: the template's default (its reasoning, if any, is returned)"
)


class Metadata(Strict):
    user_id: str | None = None


class CountTokensRequest(Strict):
    """POST /v1/messages/count_tokens: the prompt tokens a Messages request with these fields takes."""

    model: str = Field(description="must be the served model's name (else 404)")
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = Field(default=None, description=THINKING)


class MessagesRequest(CountTokensRequest):
    max_tokens: int_in(1, None) = Field(
        description="the prompt's tokens plus max_tokens must fit the context (not expressible in the schema: else 400)"
    )
    temperature: Annotated[float, Field(ge=0, le=1)] | None = Field(default=None, description="0: greedy")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: int_in(1, None) | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    metadata: Metadata | None = Field(default=None, description=NO_EFFECT)
    service_tier: Literal["auto", "standard_only"] | None = Field(default=None, description=NO_EFFECT)


class AnthropicErrorObject(BaseModel):
    type: str = Field(
        description="invalid_request_error, authentication_error, not_found_error, request_too_large, "
        "api_error, overloaded_error"
    )
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error object: every 4xx and 5xx under /v1/messages."""

    type: Literal["error"]
    error: AnthropicErrorObject


class AnthropicProtocol:
    """The Messages request models of one server: bounded by its model's context and vocabulary,
    and by whether it parses tool calls and reasoning."""

    def __init__(self, limits: Limits, tools: bool, reasoning: bool) -> None:
        fields: dict[str, Any] = {}
        if not tools:
            fields["tools"] = (refused(NO_TOOL_PARSER), None)
            fields["tool_choice"] = (refused(NO_TOOL_PARSER, TOOL_CHOICE_NONE), None)
        if not reasoning:
            fields["thinking"] = (refused(NO_REASONING_PARSER, THINKING_OFF), None)

        def model(name: str, base: type[BaseModel], **more: Any) -> Any:
            return create_model(name, __base__=base, **fields, **more)

        self.count_tokens = model("CountTokensRequest", CountTokensRequest)
        self.messages = model(
            "MessagesRequest",
            MessagesRequest,
            max_tokens=(
                int_in(1, limits.max_new_tokens),
                Field(description=MessagesRequest.model_fields["max_tokens"].description),
            ),
            top_k=(int_in(1, limits.vocab_size) | None, None),
        )
