"""Second stage of a request: a validated body (protocol.py) becomes the engine's request,
TokenizeMsg(s) with their sampling fields, plus what rendering the answer needs (a Job).

Sampling fields the request leaves out take the model's recommended values (generation
config, see models/sampling_defaults.py), then OpenAI's. Errors name the request's own
fields; the worker and scheduler name engine fields, which `Job.names` maps back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.core.sampling_params import RequestError, SamplingParams, checked_sampling
from minisgl.message import TokenizeMsg
from minisgl.models.sampling_defaults import OPENAI_DEFAULTS
from minisgl.parsers.tool_formats import ToolFormat
from minisgl.server.chat_request import ChatFeatures, ChatPlan, one_constraint, plan_chat, template_messages
from minisgl.server.errors import ApiError
from minisgl.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    SamplingFields,
    TokenizeRequest,
)
from minisgl.server.protocol_types import Limits, as_json_data

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Job:
    """One API call: what to submit, and how to render what comes back."""

    kind: str  # "chat" | "completion" | "generate"
    msgs: list[TokenizeMsg]  # uids are placeholders (len = n); the frontend numbers them
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's plus k alternatives
    echo_texts: list[str | None] | None = None  # echo: per prompt, its text (None: decode its ids)
    prompt_logprobs: int | None = None  # vLLM's extension field, when the request set it
    names: dict[str, str] = field(default_factory=dict)  # engine field -> request field
    # Chat output parsing (render.py's ChatOutput): tool calls in this format, reasoning blocks.
    tool_format: ToolFormat | None = None
    max_calls: int | None = None  # 1 with parallel_tool_calls false
    reasoning: str | None = None


class Builder:
    def __init__(
        self, model_name: str, limits: Limits, defaults: dict[str, Any], features: ChatFeatures | None = None
    ) -> None:
        self.model_name = model_name
        self.limits = limits
        self.defaults = defaults
        self.features = features or ChatFeatures()

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise ApiError(
                f"The model `{requested}` does not exist; this server serves `{self.model_name}`.",
                "model",
                404,
                "model_not_found",
            )

    def sampling(self, req: Any, max_tokens: int | None, names: dict[str, str], **extra: Any) -> SamplingParams:
        """The request's SamplingParams (max_tokens None: the rest of the context), validated
        here, in the API process, once: a bad value never reaches a queue, and the processes
        after this one receive it typed and check only what they own (prompt length, KV fit)."""

        def pick(name: str) -> Any:
            value = getattr(req, name)
            return value if value is not None else self.defaults.get(name, OPENAI_DEFAULTS[name])

        d: dict[str, Any] = {name: pick(name) for name in ("temperature", "top_p", "top_k", "min_p")}
        d.update(max_tokens=max_tokens, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids)
        d.update(ignore_eos=req.ignore_eos, top_k=-1 if d["top_k"] in (0, -1) else d["top_k"])
        optional = {
            "presence_penalty": req.presence_penalty or 0.0,
            "frequency_penalty": req.frequency_penalty or 0.0,
            "repetition_penalty": pick("repetition_penalty"),
            "logit_bias": req.logit_bias or None,
            **extra,
        }
        d.update(optional)
        try:
            return checked_sampling(d)
        except RequestError as e:
            name = names.get(e.param or "", e.param)
            raise ApiError(f"{name}{str(e)[len(e.param or ''):]}" if e.param else str(e), name) from e

    def _common(self, req: SamplingFields) -> None:
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise ApiError("stream_options is only allowed when stream is true", "stream_options")

    def chat(self, req: ChatCompletionRequest) -> Job:
        self._common(req)
        if req.top_logprobs and not req.logprobs:
            raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
        names = {"prompt": "messages", "max_tokens": "max_tokens"}
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens, names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
        top = (req.top_logprobs or 0) if req.logprobs else 0
        plan = self.plan(req)
        sampling = self.sampling(
            req, max_tokens, names, min_tokens=req.min_tokens, top_logprobs=top, prompt_logprobs=req.prompt_logprobs,
            priority=req.priority, **self.grammar_names(plan, names),
        )
        msg = TokenizeMsg(
            [0] * req.n,
            messages=chat_messages(req.messages),
            sampling=sampling,
            add_special_tokens=req.add_special_tokens,
            return_prompt=req.prompt_logprobs is not None,
            tools=plan.template_tools,
            chat_template_kwargs=_template_kwargs(req),
            reasoning=self.features.reasoning,
            **{**self._output_options(req, req.logprobs), **self._harmony_options(plan)},
        )
        return Job("chat", [msg], req.n, req.stream, _usage(req), top if req.logprobs else None, None,
                   req.prompt_logprobs, names, plan.tool_format, plan.max_calls, self.features.reasoning)

    def plan(self, req: ChatCompletionRequest | CompletionRequest) -> ChatPlan:
        """The output constraint and tool handling of a chat or completions request (400 naming
        the field)."""
        tools = as_json_data(getattr(req, "tools", None))
        parallel = getattr(req, "parallel_tool_calls", None) is not False
        choice = as_json_data(getattr(req, "tool_choice", None))
        try:
            return plan_chat(as_json_data(req.response_format), req.regex, req.ebnf, tools, choice, parallel,
                             self.features.tool_format, as_json_data(req.structured_outputs))
        except ValueError as e:
            raise ApiError(str(e), str(e).split(":", 1)[0]) from e

    @staticmethod
    def grammar_names(plan: ChatPlan, names: dict[str, str]) -> dict[str, str]:
        """The plan's grammar field; its engine name mapped to the request's in `names`: xgrammar
        parses the grammar in the scheduler's compiler (the API process stays torch-free:
        xgrammar imports torch), whose error names the engine field."""
        if plan.grammar_field is not None:
            (kind,) = plan.grammar
            names[kind] = plan.grammar_field
        return plan.grammar

    def completion(self, req: CompletionRequest) -> Job:
        self._common(req)
        names = {"prompt": "prompt", "max_tokens": "max_tokens", "top_logprobs": "logprobs"}
        k = req.logprobs
        # echo with logprobs reports the prompt tokens' logprobs with k alternatives each.
        wanted = [p for p in (k if req.echo else None, req.prompt_logprobs) if p is not None]
        prompt_lp = max(wanted) if wanted else None
        max_tokens = COMPLETIONS_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        grammar = self.grammar_names(self.plan(req), names)
        sampling = self.sampling(
            req, max_tokens, names, min_tokens=req.min_tokens, top_logprobs=k or 0, prompt_logprobs=prompt_lp,
            priority=req.priority, **grammar
        )
        msgs = [
            TokenizeMsg(
                [0] * req.n,
                sampling=sampling,
                add_special_tokens=req.add_special_tokens,
                return_prompt=req.echo or prompt_lp is not None,
                **({"text": p} if isinstance(p, str) else {"input_ids": p}),
                **self._output_options(req, k is not None),
            )
            for p in req.prompt
        ]
        echo = [p if isinstance(p, str) else None for p in req.prompt] if req.echo else None
        return Job("completion", msgs, req.n, req.stream, _usage(req), k, echo, req.prompt_logprobs, names)

    def generate(self, req: GenerateRequest) -> Job:
        sp = req.sampling_params
        names = {f: f"sampling_params.{f}" for f in ("temperature", "top_p", "top_k", "min_p", "seed", "stop")}
        names.update(max_tokens="sampling_params.max_new_tokens", min_tokens="sampling_params.min_new_tokens")
        names["prompt"] = "text" if req.text is not None else "input_ids"
        top = req.top_logprobs_num if req.return_logprob else 0
        grammar = {f: getattr(sp, f) for f in ("json_schema", "regex", "ebnf") if getattr(sp, f) is not None}
        names.update({f: f"sampling_params.{f}" for f in grammar})  # one at most: the schema says so
        try:
            one_constraint([names[f] for f in grammar])
        except ValueError as e:
            raise ApiError(str(e), str(e).split(":", 1)[0]) from e
        sampling = self.sampling(sp, sp.max_new_tokens, names, min_tokens=sp.min_new_tokens, top_logprobs=top,
                                 priority=req.priority, **grammar)
        prompt = {"text": req.text} if req.text is not None else {"input_ids": req.input_ids}
        msg = TokenizeMsg(
            [0],
            sampling=sampling,
            logprobs=req.return_logprob,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            include_stop_str=sp.no_stop_trim,
            **prompt,
        )
        return Job("generate", [msg], stream=req.stream, logprobs=top if req.return_logprob else None, names=names)

    def tokenize(self, req: TokenizeRequest) -> tuple[TokenizeMsg, dict[str, str]]:
        """POST /tokenize: the message, and the field a prompt error names."""
        self.check_model(req.model)
        msg = TokenizeMsg(
            [0],
            text=req.prompt,
            messages=None if req.messages is None else chat_messages(req.messages),
            add_special_tokens=req.add_special_tokens,
            add_generation_prompt=req.add_generation_prompt,
            return_prompt=req.return_token_strs,
            mode="tokenize",
        )
        return msg, {"prompt": "prompt" if req.messages is None else "messages"}

    def _harmony_options(self, plan: ChatPlan) -> dict[str, Any]:
        """Harmony's channel markers are special tokens: its parser must see them."""
        fmt = plan.tool_format or self.features.tool_format
        if self.features.reasoning == "gpt-oss" or (fmt is not None and fmt.name == "gpt-oss"):
            return {"skip_special_tokens": False}
        return {}

    @staticmethod
    def _output_options(req: SamplingFields, logprobs: bool) -> dict[str, Any]:
        return {
            "logprobs": logprobs,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens,
            "include_stop_str": req.include_stop_str_in_output,
        }


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """OpenAI's reasoning_effort reaches the template under its own name (GPT-OSS's template
    writes it into the system message; templates that ignore it are unaffected)."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": req.reasoning_effort, **(req.chat_template_kwargs or {})}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """What the chat template sees: text content (parts joined); developer is system; an
    assistant's tool calls (arguments as objects) and a tool result's call id and name."""
    out = []
    for m in messages:
        d: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or []),
        }
        if m.tool_calls is not None:
            d["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        d.update({k: getattr(m, k) for k in ("tool_call_id", "name") if getattr(m, k) is not None})
        out.append(d)
    return template_messages(out)


def _usage(req: SamplingFields) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)
