"""Last stage of a request: replies become OpenAI's (or SGLang's) JSON. This module holds the
per-choice accumulation and every logprob shape; stream.py sends the same shapes as SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from minisgl.message import PromptEcho, UserReply
from minisgl.server.build import Job
from minisgl.server.chat_output import ChatOutput


class ChoiceTracker:
    """Accumulates each choice's text, tokens, logprobs and usage across replies. Choice i is
    prompt i // n, sample i % n (OpenAI's index order)."""

    def __init__(self, uids: list[int], n: int) -> None:
        k = len(uids)
        self.index = {u: i for i, u in enumerate(uids)}
        self.n = n
        self.text = [""] * k
        self.token_ids: list[list[int]] = [[] for _ in range(k)]
        self.logprobs: list[list[float]] = [[] for _ in range(k)]
        self.token_texts: list[list[str]] = [[] for _ in range(k)]
        self.token_bytes: list[list[bytes]] = [[] for _ in range(k)]
        self.top: list[list[list]] = [[] for _ in range(k)]
        self.finish: list[str | None] = [None] * k
        self.prompt_tokens = [0] * k
        self.cached_tokens = [0] * k
        self.completion_tokens = [0] * k
        self.prompt: list[PromptEcho | None] = [None] * k
        self.reasoning_open = [False] * k  # the prompt opened a reasoning block (first reply says)

    def add(self, r: UserReply) -> int:
        i = self.index[r.uid]
        self.text[i] += r.text
        self.token_ids[i] += r.token_ids
        self.logprobs[i] += r.logprobs or []
        self.token_texts[i] += r.token_texts or []
        self.token_bytes[i] += r.token_bytes or []
        self.top[i] += r.top_logprobs or []
        self.prompt_tokens[i] = r.prompt_tokens
        self.cached_tokens[i] = r.cached_tokens
        self.completion_tokens[i] = r.completion_tokens
        if r.prompt is not None:
            self.prompt[i] = r.prompt
        self.reasoning_open[i] |= r.reasoning_open
        if r.finish_reason is not None:
            self.finish[i] = r.finish_reason
        return i

    def usage(self) -> dict[str, Any]:
        # A prompt counts once however many choices (n) it has, as OpenAI counts it; its cached
        # tokens are its first choice's (the others may find what that one's prefill cached).
        firsts = range(0, len(self.text), self.n)
        prompt = sum(self.prompt_tokens[i] for i in firsts)
        completion = sum(self.completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens[i] for i in firsts)}}


def chat_logprobs(texts: list[str], lps: list[float], raw: list[bytes], top: list[list], k: int) -> dict[str, Any]:
    """OpenAI chat: `logprobs.content[i] = {token, logprob, bytes, top_logprobs}`."""

    def entry(text: str, lp: float, b: bytes) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(b)}

    alts = top or [[] for _ in texts]
    return {
        "content": [
            {**entry(t, lp, b), "top_logprobs": [entry(a[1], a[2], a[3]) for a in alt[:k]]}
            for t, lp, b, alt in zip(texts, lps, raw, alts)
        ]
    }


def completion_logprobs(
    texts: list[str], lps: list[float | None], top: list[list | None], k: int, offset: int
) -> dict[str, Any]:
    """OpenAI completions: `{tokens, token_logprobs, top_logprobs: [{text: lp}], text_offset}`;
    each top_logprobs entry holds the k alternatives and the chosen token (None where the
    token has no logprob: the first prompt token under echo)."""
    offsets, tops = [], []
    for text, lp, alts in zip(texts, lps, top):
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            tops.append(None)
            continue
        d = {a[1]: a[2] for a in (alts or [])[:k]}
        d.setdefault(text, lp)
        tops.append(d)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(p: PromptEcho) -> tuple[list[float | None], list[list | None]]:
    """The prompt tokens' (logprob, alternatives) columns, None at position 0."""
    entries = p.logprobs or [None] * len(p.token_ids)
    return [e and e[0] for e in entries], [e and e[1] for e in entries]


def vllm_prompt_logprobs(p: PromptEcho | None, k: int) -> list | None:
    """vLLM's `prompt_logprobs`: per position None or {id: {logprob, rank, decoded_token}},
    the prompt token plus k alternatives; rank is null where it is not among them."""
    if p is None or p.logprobs is None:
        return None
    out: list = []
    for tid, text, e in zip(p.token_ids, p.token_texts, p.logprobs):
        if e is None:
            out.append(None)
            continue
        lp, alts = e
        d = {str(a[0]): {"logprob": a[2], "rank": r + 1, "decoded_token": a[1]} for r, a in enumerate(alts[:k])}
        rank = next((r + 1 for r, a in enumerate(alts) if a[0] == tid), None)
        d.setdefault(str(tid), {"logprob": lp, "rank": rank, "decoded_token": text})
        out.append(d)
    return out


def head(job: Job, model: str) -> dict[str, Any]:
    chat = job.kind == "chat"
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }


def echo_text(job: Job, t: ChoiceTracker, i: int) -> str:
    given = job.echo_texts[i // job.n] if job.echo_texts else None
    p = t.prompt[i]
    return given if given is not None else (p.text if p is not None else "")


def completion_choice_logprobs(job: Job, t: ChoiceTracker, i: int) -> dict[str, Any] | None:
    if job.logprobs is None:
        return None
    k, p = job.logprobs, t.prompt[i]
    texts, lps, top, offset = t.token_texts[i], list(t.logprobs[i]), list(t.top[i] or [None] * len(t.logprobs[i])), 0
    if job.echo_texts is not None and p is not None:
        plps, ptop = echo_logprobs(p)
        texts, lps, top = p.token_texts + texts, plps + lps, ptop + top
    elif job.echo_texts is not None:
        offset = len(echo_text(job, t, i))
    return completion_logprobs(texts, lps, top, k, offset)


def chat_output(job: Job, reasoning_open: bool) -> ChatOutput | None:
    """A choice's output parser, when the request's output is parsed (tools, reasoning)."""
    if job.kind != "chat" or not (job.tool_format or job.reasoning):
        return None
    return ChatOutput(job.reasoning, reasoning_open, job.tool_format, job.max_calls)


async def respond(job: Job, replies: AsyncIterator[UserReply], t: ChoiceTracker, model: str) -> JSONResponse:
    """The whole answer of a non-streamed chat or completions request."""
    async for r in replies:
        t.add(r)
    choices = []
    for i, text in enumerate(t.text):
        c: dict[str, Any] = {"index": i, "finish_reason": t.finish[i]}
        out = chat_output(job, t.reasoning_open[i])
        if out is not None:
            out.feed(text)
            _, c["finish_reason"] = out.finish(t.finish[i])
            c["message"] = out.message()
        elif job.kind == "chat":
            c["message"] = {"role": "assistant", "content": text}
        if job.kind == "chat":
            c["logprobs"] = (
                None
                if job.logprobs is None
                else chat_logprobs(t.token_texts[i], t.logprobs[i], t.token_bytes[i], t.top[i], job.logprobs)
            )
        else:
            c["text"] = (echo_text(job, t, i) if job.echo_texts is not None else "") + text
            c["logprobs"] = completion_choice_logprobs(job, t, i)
            if job.prompt_logprobs is not None:
                c["prompt_logprobs"] = vllm_prompt_logprobs(t.prompt[i], job.prompt_logprobs)
        choices.append(c)
    body = {**head(job, model), "choices": choices, "usage": t.usage()}
    if job.kind == "chat" and job.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(t.prompt[0], job.prompt_logprobs)
    return JSONResponse(body)


def generate_result(job: Job, t: ChoiceTracker, rid: str) -> dict[str, Any]:
    """SGLang's /generate body (streams send it whole each time, text cumulative)."""
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": t.prompt_tokens[0],
        "cached_tokens": t.cached_tokens[0],
        "completion_tokens": t.completion_tokens[0],
        "finish_reason": t.finish[0] and {"type": t.finish[0]},
    }
    if job.logprobs is not None:
        meta["output_token_logprobs"] = [[lp, tok] for lp, tok in zip(t.logprobs[0], t.token_ids[0])]
        if job.logprobs:
            meta["output_top_logprobs"] = [[[a[2], a[0]] for a in alts] for alts in t.top[0]]
    return {"text": t.text[0], "output_ids": t.token_ids[0], "meta_info": meta}
