"""Request bodies of the OpenAI-compatible API and the native /generate, as pydantic models.

Unknown fields are accepted (clients send extras such as `user`); fields that would change
the output and are not implemented are refused by the serving code, never ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    regex: str | None = None  # SGLang-style extensions: the output matches this regex
    ebnf: str | None = None  # ... or this EBNF grammar


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class GenerateRequest(BaseModel):
    """SGLang-style native request: `text` or `input_ids`, plus `sampling_params`."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
