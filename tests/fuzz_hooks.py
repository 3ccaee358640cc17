"""Schemathesis hooks of the API fuzzing runs (tests/test_server_fuzz.py, tests/fuzz_api.py).

The schema states every constraint the server enforces except the few JSON Schema cannot
express, which its descriptions name; a schema-valid request that breaks one of those gets a
400 by design, so such requests are dropped here from the positive cases (the server's 400
for each is a regression test of its own):
- the prompt's tokens plus max_tokens must fit the context (exact, with the model's tokenizer);
- min_tokens <= max_tokens; chat's top_logprobs > 0 needs logprobs: true; stream_options
  needs stream: true;
- on an engine build without prompt logprobs, completions' echo with logprobs;
- an output constraint must compile with xgrammar (checked here with the server's own planning
  code and the grammar parse of the scheduler's compiler): chat's and completions' (response_format,
  regex, ebnf, structured_outputs, tool_choice), /generate's sampling_params, the Responses
  text.format (one constraint at most is stated by the schema itself);
- the Anthropic and Responses routes run as the chat request they translate to (the server's own
  translation, anthropic_build.py / responses_build.py): the same context rule;
- an embedding input's text must fit the context (its token ids are bounded by the schema).
Requests whose generation work (prompts x n x max_tokens) exceeds FUZZ_MAX_WORK tokens are
dropped too, positive or negative: they are valid, only slow on a CPU.

Configured by environment: FUZZ_MODEL_DIR (the served model), FUZZ_CONTEXT (its context).
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis
from transformers import AutoTokenizer

from minisgl.core.grammar_fields import GrammarSpec
from minisgl.core.sampling_params import SamplingParams
from minisgl.grammar.spec import check_grammar
from minisgl.server import anthropic_build, responses_build
from minisgl.server.anthropic_protocol import MessagesRequest
from minisgl.server.build import chat_messages
from minisgl.server.chat_request import plan_chat
from minisgl.server.protocol import ChatMessage
from minisgl.server.responses_protocol import ResponsesRequest

GENERATING = {"/v1/chat/completions", "/v1/completions", "/generate", "/v1/messages", "/v1/responses",
              "/v1/embeddings"}
# Loaded now, at import: schemathesis runs hooks on several threads, and a first import of
# transformers (numpy) on one of them races hypothesis on another.
_TOKENIZER = AutoTokenizer.from_pretrained(os.environ["FUZZ_MODEL_DIR"])
_NO_PROMPT_LOGPROBS = "prompt_logprobs" not in SamplingParams.__dataclass_fields__


def _tokenizer() -> Any:
    return _TOKENIZER


def as_chat(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The chat body an Anthropic or Responses body runs as (the server's own translation)."""
    if path == "/v1/messages":
        return anthropic_build.chat_body(MessagesRequest.model_validate(body))
    return responses_build.chat_body(ResponsesRequest.model_validate(body))


def _prompt_lengths(path: str, body: dict[str, Any]) -> list[int]:
    tok = _tokenizer()
    if path in ("/v1/messages", "/v1/responses"):
        path, body = "/v1/chat/completions", as_chat(path, body)
    if path == "/v1/embeddings":
        given = body["input"]
        # Token ids may be written 7.0 (a JSON Schema integer too); bools are not ids.
        one = isinstance(given, str) or (given and type(given[0]) in (int, float))
        inputs = [given] if one else given
        add = body.get("add_special_tokens") is not False
        return [len(x) if isinstance(x, list) else len(tok(x, add_special_tokens=add).input_ids) for x in inputs]
    if path == "/v1/chat/completions":
        # The server's own conversion (tool calls, tool results) and template variables.
        messages = chat_messages([ChatMessage.model_validate(m) for m in body["messages"]])
        kwargs = body.get("chat_template_kwargs") or {}
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return [len(tok(text, add_special_tokens=bool(body.get("add_special_tokens"))).input_ids)]
    if path == "/generate":
        if "input_ids" in body:
            return [len(body["input_ids"])]
        return [len(tok(body["text"]).input_ids)]
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], (str, list))) else prompt
    add = body.get("add_special_tokens")
    return [len(p) if isinstance(p, list) else len(tok(p, add_special_tokens=add is not False).input_ids)
            for p in prompts]


def _max_tokens(path: str, body: dict[str, Any]) -> tuple[int | None, int]:
    if path in ("/v1/messages", "/v1/embeddings"):
        return body.get("max_tokens", 0), 0  # an embedding generates nothing: its input may fill the context
    if path == "/v1/responses":
        return body.get("max_output_tokens"), 0
    if path == "/generate":
        sp = body.get("sampling_params") or {}
        return sp.get("max_new_tokens"), sp.get("min_new_tokens") or 0
    mt = body.get("max_completion_tokens") if body.get("max_completion_tokens") is not None else body.get("max_tokens")
    if mt is None and path == "/v1/completions":
        mt = 16  # OpenAI's default there
    return mt, body.get("min_tokens") or 0


def acceptable(path: str, body: dict[str, Any]) -> bool:
    """False where a schema-valid body breaks a constraint the schema cannot state."""
    context = int(os.environ["FUZZ_CONTEXT"])
    lengths = _prompt_lengths(path, body)
    max_tokens, min_tokens = _max_tokens(path, body)
    for n in lengths:
        room = context - n + (path == "/v1/embeddings")
        if room < 1 or (max_tokens is not None and max_tokens > room) or min_tokens > (max_tokens or room):
            return False
    if path != "/generate" and body.get("stream_options") is not None and not body.get("stream"):
        return False
    if path == "/v1/chat/completions" and (body.get("top_logprobs") or 0) > 0 and not body.get("logprobs"):
        return False
    if path in ("/v1/messages", "/v1/responses"):
        path, body = "/v1/chat/completions", as_chat(path, body)
    if path in ("/v1/chat/completions", "/v1/completions", "/generate") and not _constraint_ok(body):
        return False
    return not (_NO_PROMPT_LOGPROBS and body.get("echo") and body.get("logprobs") is not None)


def _constraint_ok(body: dict[str, Any]) -> bool:
    try:  # the fuzzed server has no tool-call parser: its schema admits no tools
        sp = body.get("sampling_params")
        if isinstance(sp, dict):  # /generate's
            grammar = {k: sp[k] for k in ("json_schema", "regex", "ebnf") if sp.get(k) is not None}
        else:
            grammar = plan_chat(body.get("response_format"), body.get("regex"), body.get("ebnf"), body.get("tools"),
                                body.get("tool_choice"), body.get("parallel_tool_calls") is not False, None,
                                body.get("structured_outputs")).grammar
        for kind, text in grammar.items():  # the scheduler's compiler parses it the same way
            check_grammar(GrammarSpec(kind, text))
    except ValueError:
        return False
    return True


def work(path: str, body: dict[str, Any]) -> int:
    try:
        lengths = _prompt_lengths(path, body)
        max_tokens, _ = _max_tokens(path, body)
    except Exception:  # noqa: BLE001 - a malformed (negative) body: the server refuses it cheaply
        return 0
    if path == "/v1/embeddings":
        return sum(lengths)
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    context = int(os.environ["FUZZ_CONTEXT"])
    each = max_tokens if isinstance(max_tokens, int) else context
    return len(lengths) * max(1, n) * max(1, each)


@schemathesis.hook
def filter_case(ctx: Any, case: Any) -> bool:
    path, body = case.operation.path, case.body
    if path not in GENERATING or not isinstance(body, dict):
        return True
    if work(path, body) > int(os.environ.get("FUZZ_MAX_WORK", "4096")):
        return False
    if not case.meta or not case.meta.generation.mode.is_positive:
        return True
    try:
        return acceptable(path, body)
    except (KeyError, TypeError, IndexError, AttributeError):
        return True  # not the shape the schema promises: let the server judge it


@schemathesis.hook
def map_case(ctx: Any, case: Any) -> Any:
    """The Anthropic routes require `model`, and a random name is a 404 before the body is looked
    at: positive cases name the served model there, so that the fuzzer reaches the route's logic
    (the 404 itself is chat's and completions' too, where `model` is optional)."""
    path, body = case.operation.path, case.body
    positive = case.meta and case.meta.generation.mode.is_positive
    if path.startswith("/v1/messages") and positive and isinstance(body, dict) and isinstance(body.get("model"), str):
        body["model"] = os.environ.get("FUZZ_SERVED_NAME", "tiny")
    return case
