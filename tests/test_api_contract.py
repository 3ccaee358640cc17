"""The HTTP contract, in-process (tests/api_fake.py): every error an OpenAI error object,
/openapi.json telling the truth, values range-checked before they are queued, and the exact
OpenAI shapes of logprobs, echo and prompt logprobs (streamed and not)."""

from __future__ import annotations

import json
import logging

import pytest
from api_fake import CONTEXT, VOCAB, make_client
from server_harness import sse_events

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def app():  # noqa: ANN201
    return make_client(defaults={"temperature": 0.2, "top_p": 0.9})


@pytest.fixture(scope="module")
def client(app):  # noqa: ANN001, ANN201
    return app[0]


@pytest.fixture(autouse=True)
def any_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The contract does not depend on the engine build: the fake server takes issue 14's
    sampling fields even where this build's SamplingParams lacks them (the device side)."""
    from minisgl.core.sampling_params import SamplingParams
    from minisgl.server import build

    known = set(SamplingParams.__dataclass_fields__)
    monkeypatch.setattr(
        build, "checked_sampling", lambda f: SamplingParams(**{k: v for k, v in f.items() if k in known})
    )


def error_of(r, status: int) -> dict:  # noqa: ANN001
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_errors_are_openai_objects(client) -> None:  # noqa: ANN001
    assert error_of(client.get("/v1/nope"), 404)["code"] == "not_found"
    r = client.delete(CMPL)
    assert error_of(r, 405)["code"] == "method_not_allowed" and "POST" in r.headers["allow"]
    json_type = {"content-type": "application/json"}
    assert "not valid JSON" in error_of(client.post(CMPL, content=b'{"prompt": ', headers=json_type), 400)["message"]
    assert "UTF-8" in error_of(client.post(CMPL, content=b'{"prompt": "\xff\xfe"}', headers=json_type), 400)["message"]
    assert "JSON object" in error_of(client.post(CMPL, content=b"[1, 2]", headers=json_type), 400)["message"]
    assert "missing" in error_of(client.post(CMPL), 400)["message"]
    assert "Content-Type" in error_of(client.post(CMPL, content=b'{"prompt": "x"}'), 400)["message"]
    err = error_of(client.post(CMPL, json={"prompt": "x", "suffix": "y"}), 400)
    assert err["param"] == "suffix" and "unknown field" in err["message"]
    assert error_of(client.post(CHAT, json={"messages": HI, "model": "gpt-9"}), 404)["code"] == "model_not_found"
    err = error_of(client.post(CHAT, json={"messages": [{"role": "user", "content": "refuse"}]}), 400)
    assert err["param"] == "messages" and err["message"].startswith("messages:")  # the worker's "prompt", renamed


def test_body_limit_413(client) -> None:  # noqa: ANN001
    big = json.dumps({"prompt": "x" * 5000}).encode()  # the fake server takes 4096 bytes
    err = error_of(client.post(CMPL, content=big, headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]

    def chunks():  # noqa: ANN202 - no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 1000

    assert error_of(client.post(CMPL, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert client.post(CMPL, json={"prompt": "x", "max_tokens": 3}).status_code == 200


def test_internal_error_is_one_logged_500_and_serving_goes_on(client, caplog) -> None:  # noqa: ANN001
    logger = logging.getLogger("minisgl")  # it does not propagate to the root, where caplog listens
    logger.addHandler(caplog.handler)
    try:
        r = client.post(CMPL, json={"prompt": "boom"})
    finally:
        logger.removeHandler(caplog.handler)
    err = error_of(r, 500)
    rid = r.headers["x-request-id"]
    assert err["type"] == "internal_error" and rid in err["message"]
    records = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None  # the traceback, once
    assert client.post(CMPL, json={"prompt": "x"}).status_code == 200


BIG = 2**64  # msgpack cannot encode it: it must be refused before anything is queued
REPROS = [
    (CMPL, {"prompt": [5, 99999999999999999999999]}, "prompt"),
    (CMPL, {"prompt": [[5, BIG]]}, "prompt"),
    (CMPL, {"prompt": [5, VOCAB]}, "prompt"),
    (CMPL, {"prompt": "x", "stop_token_ids": [BIG]}, "stop_token_ids"),
    (CMPL, {"prompt": "x", "logit_bias": {str(BIG): 1}}, "logit_bias"),
    (CMPL, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5"),
    (CMPL, {"prompt": "x", "n": BIG}, "n"),
    (CMPL, {"prompt": "x", "seed": BIG}, "seed"),
    (CMPL, {"prompt": "x", "max_tokens": BIG}, "max_tokens"),
    (CMPL, {"prompt": "x", "max_tokens": CONTEXT}, "max_tokens"),
    (CMPL, {"prompt": "x", "top_k": BIG}, "top_k"),
    (CMPL, {"prompt": "x", "logprobs": BIG}, "logprobs"),
    (CMPL, {"prompt": ""}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": HI, "top_logprobs": BIG}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": BIG}]}]}, "messages[0].content[0].text"),
    ("/generate", {"input_ids": [5, BIG]}, "input_ids"),
    ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": [BIG]}}, "sampling_params.stop_token_ids"),
    ("/generate", {}, None),
    ("/generate", {"text": "x", "input_ids": [1]}, None),
    ("/detokenize", {"tokens": [BIG]}, "tokens"),
    ("/tokenize", {"prompt": "x", "messages": HI}, None),
]


@pytest.mark.parametrize(("path", "body", "param"), REPROS, ids=[f"{p}:{b}"[:60] for p, b, _ in REPROS])
def test_values_range_checked_before_queueing(app, path: str, body: dict, param: str | None) -> None:  # noqa: ANN001
    client, backend = app
    before = len(backend.seen)
    err = error_of(client.post(path, json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert len(backend.seen) == before  # nothing reached the queue


def test_openapi_states_the_contract(client) -> None:  # noqa: ANN001
    schema = client.get("/openapi.json").json()
    assert "422" not in json.dumps(schema["paths"]) and "HTTPValidationError" not in json.dumps(schema)
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            if path != "/health":
                for code in ("413", "500"):
                    ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                    shape = "/AnthropicErrorResponse" if path.startswith("/v1/messages") else "/ErrorResponse"
                    assert ref.endswith(shape), (path, method)
            if method == "post":
                assert {"400", "404", "413"} <= set(op["responses"]), path
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    for path in (CHAT, "/v1/completions", "/generate", "/v1/messages", "/v1/responses"):  # every generate route
        assert {"application/json", "text/event-stream"} <= set(schema["paths"][path]["post"]["responses"]["200"][
            "content"]), path
    assert "/v1/messages/count_tokens" in schema["paths"]
    defs = schema["components"]["schemas"]
    chat = defs["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and chat["properties"]["messages"]["minItems"] == 1
    assert defs["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant", "tool"]
    assert chat["properties"]["max_tokens"]["anyOf"][0]["maximum"] == CONTEXT - 1
    assert "oneOf" in defs["GenerateRequest"] and "oneOf" in defs["TokenizeRequest"]
    ids = defs["GenerateRequest"]["properties"]["input_ids"]
    assert ids["items"]["maximum"] == VOCAB - 1 and ids["minItems"] == 1
    assert "fit the context" in defs["CompletionRequest"]["properties"]["prompt"]["description"]
    assert "text/html" in client.get("/docs").headers["content-type"]


def test_openapi_with_api_key_documents_bearer_and_401() -> None:
    client, _ = make_client(api_key="k")
    schema = client.get("/openapi.json").json()  # the contract itself needs no key
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    op = schema["paths"][CHAT]["post"]
    assert op["security"] == [{"bearer": []}, {"apiKey": []}] and "401" in op["responses"]
    assert schema["components"]["securitySchemes"]["apiKey"] == {"type": "apiKey", "in": "header", "name": "x-api-key"}
    assert "security" not in schema["paths"]["/health"]["get"]
    err = error_of(client.post(CHAT, json={"messages": HI}), 401)
    assert err["code"] == "invalid_api_key"
    assert client.post(CHAT, json={"messages": HI}, headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.post(CHAT, json={"messages": HI}, headers={"x-api-key": "k"}).status_code == 200  # Anthropic's way
    assert client.post(CHAT, json={"messages": HI}, headers={"x-api-key": "nope"}).status_code == 401


def test_accepted_fields_and_defaults(app) -> None:  # noqa: ANN001
    client, backend = app
    body = {"messages": HI, "user": "u1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
            "parallel_tool_calls": True, "response_format": {"type": "text"}, "min_p": 0.1, "top_k": 5,
            "stop_token_ids": [3], "ignore_eos": True, "skip_special_tokens": False,
            "spaces_between_special_tokens": True, "include_stop_str_in_output": True}
    assert client.post(CHAT, json=body).status_code == 200
    msg = backend.seen[-1]
    assert msg.sampling.temperature == 0.2 and msg.sampling.top_p == 0.9  # the model's defaults
    assert (msg.sampling.min_p, msg.sampling.top_k, msg.sampling.stop_token_ids) == (0.1, 5, [3])
    assert msg.include_stop_str and msg.spaces_between_special_tokens and not msg.skip_special_tokens
    client.post(CHAT, json={"messages": HI, "temperature": 0, "top_p": 1})
    assert (backend.seen[-1].sampling.temperature, backend.seen[-1].sampling.top_p) == (0, 1)
    card = client.get("/v1/models/tiny").json()
    assert card["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9, "top_k": -1, "min_p": 0.0,
                                         "repetition_penalty": 1.0}
    assert card["max_model_len"] == CONTEXT and client.get("/v1/models").json()["data"] == [card]
    assert error_of(client.get("/v1/models/other"), 404)["code"] == "model_not_found"
    assert client.get("/version").json()["version"]


def test_tokenize_and_detokenize_routes(app) -> None:  # noqa: ANN001
    client, backend = app
    r = client.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False, "return_token_strs": True})
    assert r.json() == {"count": 2, "max_model_len": CONTEXT, "tokens": [7, 8], "token_strs": ["p", "p"]}
    msg = backend.seen[-1]
    assert (msg.mode, msg.text, msg.add_special_tokens) == ("tokenize", "hello", False)
    client.post("/tokenize", json={"messages": HI, "add_generation_prompt": False})
    assert backend.seen[-1].messages == HI and backend.seen[-1].add_generation_prompt is False
    assert client.post("/detokenize", json={"tokens": [10, 12]}).json() == {"prompt": "abc"}


def test_chat_logprob_shapes(client) -> None:  # noqa: ANN001
    body = {"messages": HI, "logprobs": True, "top_logprobs": 2}
    content = client.post(CHAT, json=body).json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["ab", "\ufffd", "c"]
    assert content[1]["bytes"] == [0xE2, 0x82]  # the token's real bytes, not U+FFFD's
    assert content[0]["top_logprobs"] == [{"token": "t100", "logprob": -1.0, "bytes": list(b"t100")},
                                          {"token": "t101", "logprob": -2.0, "bytes": list(b"t101")}]
    with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        events = sse_events(list(r.iter_lines()))
    streamed = [c for e in events for c in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert streamed == content
    off = client.post(CHAT, json={"messages": HI, "logprobs": True}).json()["choices"][0]["logprobs"]["content"]
    assert all(c["top_logprobs"] == [] for c in off)
    assert client.post(CHAT, json={"messages": HI}).json()["choices"][0]["logprobs"] is None


def test_completion_logprobs_echo_and_prompt_logprobs(client) -> None:  # noqa: ANN001
    body = {"prompt": [7, 8], "logprobs": 1, "echo": True, "max_tokens": 3}
    choice = client.post(CMPL, json=body).json()["choices"][0]
    assert choice["text"] == "PROMPTab\ufffdc"  # a token-id prompt echoes as its decoded text
    lp = choice["logprobs"]
    assert lp["tokens"] == ["P", "P", "ab", "\ufffd", "c"]
    assert lp["token_logprobs"] == [None, -2.0, -0.5, -1.0, -1.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"t200": -1.0, "P": -2.0}
    assert lp["top_logprobs"][2] == {"t100": -1.0, "ab": -0.5}  # k alternatives plus the chosen token
    assert lp["text_offset"] == [0, 1, 2, 4, 5]
    with client.stream("POST", CMPL, json={**body, "stream": True}) as r:
        events = sse_events(list(r.iter_lines()))
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    merged = {k: [x for e in events if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"][k]]
              for k in lp}
    assert merged == lp
    text = client.post(CMPL, json={"prompt": "hello", "echo": True}).json()["choices"][0]
    assert text["text"] == "helloab\ufffdc" and text["logprobs"] is None  # a text prompt echoes as given
    vllm = client.post(CMPL, json={"prompt": "x", "prompt_logprobs": 1}).json()["choices"][0]["prompt_logprobs"]
    assert vllm == [None, {"200": {"logprob": -1.0, "rank": 1, "decoded_token": "t200"},
                           "8": {"logprob": -2.0, "rank": None, "decoded_token": "P"}}]
    chat = client.post(CHAT, json={"messages": HI, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][1] == {"8": {"logprob": -2.0, "rank": None, "decoded_token": "P"}}
