"""Request bodies of every route, as pydantic models: the first stage of a request (parse and
validate), and the source of /openapi.json.

Models are strict (a JSON `true` is no integer, `"0.5"` no number) and closed: an unknown
field is refused by name (400), never ignored, since it might change the output. Fields
that cannot change the output (`user`, `metadata`, ...) are declared and accepted. The bounds
that depend on the served model (token ids, max_tokens) are set per server by
`build_protocol`, so the published schema states them as numbers.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from minisgl.core.sampling_params import PRIORITY_MAX
from minisgl.server.capabilities import NO_TOOL_PARSER, refused
from minisgl.server.protocol_structured import (
    CONSTRAINING,
    NEEDS_COMPILE,
    TOOL_CHOICE_CONSTRAINING,
    NamedToolChoice,
    OutputConstraints,
    TemplateKwargs,
    Tool,
    ToolCall,
    one_constraint_rule,
)
from minisgl.server.protocol_types import (
    MAX_LOGPROBS,
    MAX_N,
    NO_EFFECT,
    SEED_MAX,
    SEED_MIN,
    Int,
    Limits,
    Strict,
    completion_prompt,
    int_in,
    logit_bias,
    token_ids,
)

Penalty = Annotated[float, Field(ge=-2, le=2)]
Logprobs = int_in(0, MAX_LOGPROBS)
PRIORITY = (
    "vLLM's: the request's place in the queue under --scheduling-policy priority, smaller first (ties keep "
    "arrival order); a server scheduling fcfs refuses any value but 0"
)
SPACES = (
    "with skip_special_tokens false: true puts a space between special tokens and the text around them, "
    "false does not; unset: the tokenizer's own decoding (fast tokenizers: no spaces)"
)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="developer is sent as system")
    content: str | list[TextPart] | None = Field(default=None, description="text, or text parts (joined)")
    tool_calls: list[ToolCall] | None = Field(default=None, description="an assistant's calls, for the template")
    tool_call_id: str | None = Field(default=None, description="a tool result's call")
    name: str | None = None


class SamplingFields(Strict):
    """What chat and completions share: OpenAI's fields, then vLLM/SGLang extensions."""

    model: str | None = Field(default=None, description="must be the served model's name (else 404)")
    max_tokens: Int | None = None
    temperature: Annotated[float, Field(ge=0)] | None = Field(default=None, description="0: greedy")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: int_in(1, MAX_N) = 1
    seed: int_in(SEED_MIN, SEED_MAX) | None = Field(
        default=None, description="with n > 1, choice i uses seed + i"
    )
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="only with stream: true")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[int, float] | None = None
    user: str | None = Field(default=None, description=NO_EFFECT)
    metadata: dict[str, str] | None = Field(default=None, description=NO_EFFECT)
    store: bool | None = Field(default=None, description=NO_EFFECT)
    service_tier: str | None = Field(default=None, description=NO_EFFECT)
    # vLLM / SGLang extensions
    top_k: Int | None = Field(default=None, description="0 or -1: off")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Int = Field(
        default=0, description="EOS and stop_token_ids are masked until this many tokens (<= max_tokens; not "
        "expressible in the schema)"
    )
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = Field(default=None, description=SPACES)
    include_stop_str_in_output: bool = Field(
        default=False, description="keep the stop string, or the text of the EOS / stop_token_ids token, in the output"
    )
    prompt_logprobs: Logprobs | None = Field(
        default=None, description="vLLM: the logprob of every prompt token plus this many alternatives"
    )
    add_special_tokens: bool | None = Field(
        default=None, description="add the tokenizer's special tokens (BOS) to the prompt; default: true for "
        "completions, false for chat (the template holds them)"
    )
    priority: int_in(-PRIORITY_MAX, PRIORITY_MAX) = Field(default=0, description=PRIORITY)


class ChatCompletionRequest(SamplingFields, OutputConstraints):
    model_config = ConfigDict(json_schema_extra=one_constraint_rule({**CONSTRAINING,
                                                                     "tool_choice": TOOL_CHOICE_CONSTRAINING}))
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, description="max_tokens, by its newer name")
    logprobs: bool = False
    top_logprobs: Logprobs | None = Field(default=None, description="> 0 needs logprobs: true (not expressible)")
    tools: list[Tool] | None = Field(
        default=None, min_length=1, description="function tools (names unique: not expressible in the schema)"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description='default "auto" with tools; needs tools unless "none", and a named function must '
        "be one of them (not expressible in the schema)"
    )
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one tool call (default true)")
    chat_template_kwargs: TemplateKwargs | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        default=None, description="passed to the chat template as reasoning_effort (GPT-OSS's template reads it); "
        "chat_template_kwargs.reasoning_effort wins when both are set")


class CompletionRequest(SamplingFields, OutputConstraints):
    model_config = ConfigDict(json_schema_extra=one_constraint_rule(CONSTRAINING))
    prompt: Any
    logprobs: Logprobs | None = Field(default=None, description="the chosen token's logprob plus this many "
                                      "alternatives per token")
    echo: bool = Field(default=False, description="return the prompt before the completion (and, with "
                       "logprobs, the prompt tokens' logprobs)")
    best_of: int_in(1, 1) | None = Field(default=None, description="only 1 is supported")


class GenerateSampling(Strict):
    """SGLang's sampling_params of /generate."""

    max_new_tokens: Int | None = None
    min_new_tokens: Int = 0
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Int | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int_in(SEED_MIN, SEED_MAX) | None = None
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = Field(default=None, description=SPACES)
    no_stop_trim: bool = Field(default=False, description="keep the stop string in the output")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    logit_bias: dict[int, float] | None = None
    # SGLang's output constraints (at most one; the schema says so too)
    json_schema: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="the output is JSON following this schema (its JSON text); " + NEEDS_COMPILE
    )
    regex: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="the output matches this regex; " + NEEDS_COMPILE
    )
    ebnf: Annotated[str, Field(min_length=1)] | None = Field(
        default=None, description="the output follows this EBNF grammar (root rule `root`); " + NEEDS_COMPILE
    )

    model_config = ConfigDict(json_schema_extra=one_constraint_rule(
        {"json_schema": {"type": "string"}, "regex": {"type": "string"}, "ebnf": {"type": "string"}}
    ))


_ONE_OF_TEXT_IDS = {"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]}
_ONE_OF_PROMPT_MESSAGES = {"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}


def _exactly_one(obj: Any, a: str, b: str) -> Any:
    if (getattr(obj, a) is None) == (getattr(obj, b) is None):
        raise ValueError(f"give exactly one of {a} and {b}")
    return obj


class GenerateRequest(Strict):
    """SGLang-style native request: exactly one of `text` and `input_ids`."""

    model_config = ConfigDict(json_schema_extra=_ONE_OF_TEXT_IDS)
    # Absent, not null, when unused: the schema's oneOf counts present keys.
    text: str = Field(default=None, min_length=1)  # type: ignore[assignment]
    input_ids: list[Int] = Field(default=None)  # type: ignore[assignment]
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: Logprobs = 0
    priority: int_in(-PRIORITY_MAX, PRIORITY_MAX) = Field(default=0, description=PRIORITY)

    @model_validator(mode="after")
    def check_one_of(self) -> Any:
        return _exactly_one(self, "text", "input_ids")


class TokenizeRequest(Strict):
    """vLLM's /tokenize: exactly one of `prompt` (text) and `messages` (chat, templated)."""

    model_config = ConfigDict(json_schema_extra=_ONE_OF_PROMPT_MESSAGES)
    model: str | None = None
    prompt: str = Field(default=None)  # type: ignore[assignment]
    messages: list[ChatMessage] = Field(default=None, min_length=1)  # type: ignore[assignment]
    add_special_tokens: bool | None = Field(default=None, description="default: true for prompt, false for messages")
    add_generation_prompt: bool = Field(default=True, description="with messages: end with the assistant's turn")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def check_one_of(self) -> Any:
        return _exactly_one(self, "prompt", "messages")


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Int]


class ErrorBody(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, server_error, "
                      "internal_error")
    param: str | None = Field(description="the request field to blame, e.g. messages[0].role")
    code: str | int | None


class ErrorResponse(BaseModel):
    """The OpenAI error object: every 4xx and 5xx of this server."""

    error: ErrorBody


class Protocol:
    """The request models of one server, bounded by its model's vocabulary and context, and
    by whether it parses tool calls (`tools`)."""

    def __init__(self, limits: Limits, tools: bool = True) -> None:
        self.limits = limits
        ids_field = Annotated[token_ids(limits), Field()] | None
        new_tokens = int_in(1, limits.max_new_tokens) | None
        min_new = int_in(0, limits.max_new_tokens)
        top_k = int_in(-1, limits.vocab_size) | None
        bias = logit_bias(limits) | None

        def model(name: str, base: type[BaseModel], **fields: Any) -> Any:
            return create_model(name, __base__=base, **fields)

        shared: dict[str, Any] = {
            "max_tokens": (new_tokens, None),
            "min_tokens": (min_new, 0),
            "top_k": (top_k, None),
            "stop_token_ids": (ids_field, None),
            "logit_bias": (bias, None),
        }
        chat_fields: dict[str, Any] = {"max_completion_tokens": (new_tokens, None)}
        if not tools:  # no tool-call parser for the served model's output
            chat_fields["tools"] = (refused(NO_TOOL_PARSER), None)
            chat_fields["tool_choice"] = (refused(NO_TOOL_PARSER, "none"), None)
        self.chat = model("ChatCompletionRequest", ChatCompletionRequest, **chat_fields, **shared)
        self.completion = model("CompletionRequest", CompletionRequest, prompt=(completion_prompt(limits), ...),
                                **shared)
        sampling = model(
            "GenerateSampling",
            GenerateSampling,
            max_new_tokens=(new_tokens, None),
            min_new_tokens=(min_new, 0),
            top_k=(top_k, None),
            stop_token_ids=(ids_field, None),
            logit_bias=(bias, None),
        )
        self.generate = model(
            "GenerateRequest",
            GenerateRequest,
            input_ids=(token_ids(limits, min_items=1, max_items=limits.max_new_tokens), None),
            sampling_params=(sampling, Field(default_factory=sampling)),
        )
        self.tokenize = TokenizeRequest
        self.detokenize = create_model("DetokenizeRequest", __base__=DetokenizeRequest, tokens=(token_ids(limits), ...))
