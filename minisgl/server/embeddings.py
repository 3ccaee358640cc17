"""POST /v1/embeddings, OpenAI's embeddings API, on a server of an embedding model (--task embed,
or a sentence-transformers / Qwen3-Embedding folder that --task auto detects).

Each input is one request through the usual hops (tokenizer worker, scheduler: batched by the
prefill admission, run as the engine's pool step, its KV freed after; engine/pooling.py), whose one
reply carries the pooled final hidden state (fp32). Here, in the API process, it is truncated to
`dimensions` (Matryoshka), L2-normalised (unless `normalize: false`) and encoded (`float`, or
`base64`: the float32 little-endian bytes). A server that generates answers this route with a 400
naming --task, and leaves it out of /openapi.json (and an embedding server its generate routes).

No `from __future__ import annotations`: FastAPI reads the route annotations as objects.
"""

import base64
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, create_model

from minisgl.core.sampling_params import SamplingParams
from minisgl.message import TokenizeMsg
from minisgl.models.embedding_config import EmbeddingConfig
from minisgl.server import openapi_doc
from minisgl.server.build import Job
from minisgl.server.capabilities import EMBED_ONLY, GENERATE_ONLY
from minisgl.server.errors import ApiError
from minisgl.server.protocol_types import NO_EFFECT, Limits, Strict, int_in, text_or_ids
from minisgl.server.stages import Stages

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request
# Routes of generation: on an embedding server they answer a 400 naming --task (and the schema
# leaves them out).
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/messages", "/v1/responses")


def embedding_input(limits: Limits) -> Any:
    """`input`: a string, a list of strings, a list of token ids or a list of such lists;
    normalised to a list of inputs (str or list[int]), each at most the context long."""
    return text_or_ids(
        limits, MAX_INPUTS, limits.max_model_len, "inputs",
        "the input(s) to embed: text or token ids, one or a list; each at most the context long in tokens "
        "(text: not expressible in the schema, else 400)",
    )


class EmbeddingRequest(Strict):
    model: str | None = Field(default=None, description="must be the served model's name (else 404)")
    input: Any
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="base64: the float32 little-endian bytes of each embedding"
    )
    dimensions: int_in(1, None) | None = Field(
        default=None, description="keep the first this many dimensions (Matryoshka), then normalise"
    )
    normalize: bool = Field(default=True, description="L2-normalise each embedding (after truncating)")
    add_special_tokens: bool = Field(default=True, description="add the tokenizer's special tokens to text inputs")
    user: str | None = Field(default=None, description=NO_EFFECT)


def finish_vector(raw: bytes, dimensions: int | None, normalize: bool, encoding: str) -> Any:
    """The pooled hidden state (float32 bytes) as the client asked for it."""
    v = np.frombuffer(raw, dtype="<f4")[:dimensions].astype(np.float64)
    if normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    v32 = v.astype("<f4")
    return base64.b64encode(v32.tobytes()).decode() if encoding == "base64" else v32.tolist()


def add_embedding_routes(app: FastAPI, stages: Stages, limits: Limits, embedding: EmbeddingConfig | None) -> None:
    """/v1/embeddings (`embedding`: the served model's, or None on a generating server), and on
    an embedding server the refusal of the generate routes (registered first, so they match)."""
    dims = embedding.dimensions if embedding is not None else 1
    model = create_model(
        "EmbeddingRequest",
        __base__=EmbeddingRequest,
        input=(embedding_input(limits), ...),
        dimensions=(int_in(1, dims) | None, EmbeddingRequest.model_fields["dimensions"]),
    )
    if embedding is not None:
        for path in GENERATION_PATHS:
            app.add_api_route(path, _refusal(EMBED_ONLY), methods=["POST"], include_in_schema=False)

    @app.post("/v1/embeddings", responses=openapi_doc.errors(400, 404, 503), include_in_schema=embedding is not None)
    async def embeddings(req: model, request: Request) -> JSONResponse:  # type: ignore[valid-type]
        """OpenAI's embeddings: one pooled, normalised vector per input."""
        if embedding is None:
            raise ApiError(GENERATE_ONLY)
        stages.builder.check_model(req.model)
        sampling = SamplingParams(max_tokens=1, temperature=0.0)  # an embedding samples nothing
        msgs = [
            TokenizeMsg(
                [0],
                **({"text": x} if isinstance(x, str) else {"input_ids": x}),
                sampling=sampling,
                add_special_tokens=req.add_special_tokens,
                pooling=embedding.pooling,
            )
            for x in req.input
        ]
        replies, tracker, _ = await stages.start(Job("embed", msgs, names={"prompt": "input"}), request)
        vectors: list[Any] = [None] * len(msgs)
        async for r in replies:
            i = tracker.add(r)
            if r.embedding is not None:
                vectors[i] = finish_vector(r.embedding, req.dimensions, req.normalize, req.encoding_format)
        tokens = sum(tracker.prompt_tokens)
        return JSONResponse(
            {
                "object": "list",
                "model": stages.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            }
        )


def _refusal(why: str) -> Any:
    async def refuse() -> None:
        raise ApiError(why)

    return refuse
