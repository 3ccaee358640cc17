"""Every message type survives encode -> decode unchanged (one msgpack path for all)."""

from __future__ import annotations

import dataclasses

import pytest

from minisgl.core.sampling_params import SamplingParams
from minisgl.message import (
    AbortMsg,
    DecodeMsg,
    DetokenizeMsg,
    DetokInit,
    FlushCacheMsg,
    FlushCacheReply,
    PromptEcho,
    ReadyMsg,
    ReplyBatch,
    StartMsg,
    StatsMsg,
    TokenizeMsg,
    TokenOut,
    UserMsg,
    UserReply,
    decode,
    encode,
    message,
)

INIT = DetokInit(prompt_tokens=7, stop=["</s>", "\n\n"], skip_special_tokens=False, logprobs=True)
INIT_ECHO = DetokInit(3, None, True, True, True, True, 5, [1, 2, 3], True)
ECHO = PromptEcho(
    "a😀",
    [1, 2, 3],
    ["a", "\ufffd", "\ufffd"],
    [b"a", b"\xf0\x9f", b"\x98\x80"],
    [None, [-0.5, [[7, "x", -0.1, b"x"]]], [-2.0, []]],
)
SAMPLES = [
    TokenizeMsg(
        [1, 2, 3],
        text="héllo 你好 😀",
        sampling=SamplingParams(max_tokens=None, temperature=0.7, stop=["x"], seed=2**63 - 1),
    ),
    TokenizeMsg([5], text="{", sampling=SamplingParams(json_schema={"type": "object"}, logit_bias={3: -1.5})),
    TokenizeMsg([9], input_ids=[1, 2, 3], logprobs=True, include_stop_str=True, return_prompt=True),
    TokenizeMsg([4], messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False, mode="tokenize"),
    DecodeMsg(4, [1, 2, 2**31]),
    AbortMsg(5, "stop"),
    AbortMsg(8, "stop", 17),
    AbortMsg(6),
    INIT,
    UserMsg(3, [1, 2, 3], SamplingParams(max_tokens=4, top_k=-1, min_p=0.0), seed=2**63 - 1, detok=INIT),
    UserMsg(3, [1, 2, 3], SamplingParams(max_tokens=4, logit_bias={5: -100.0, 2**20: 1.5}), seed=0, detok=INIT_ECHO),
    UserMsg(7, [1], SamplingParams(max_tokens=1), seed=1, detok=INIT, admit_by=12345.678),
    TokenizeMsg([10], text="hi", admit_by=99.5),
    INIT_ECHO,
    ECHO,
    TokenOut(3, [10, 11], [-0.5, -1.25], "length", INIT),
    TokenOut(3, [], None, None, None),
    TokenOut(
        4,
        [10, 11],
        [-0.5, -1.25],
        None,
        INIT,
        top_logprobs=[[[10, -0.5], [7, -1.0]], [[11, -1.25], [3, -2.0]]],
        prompt_logprobs=[None, [-3.5, [[4, -0.125], [9, -2.5]]], [-0.25, []]],
    ),
    DetokenizeMsg([TokenOut(1, [5], None), TokenOut(2, [6], [-3.0], "stop")]),
    DetokenizeMsg([]),
    UserReply(1, "text ✓", [1, 2], [-0.1, -0.2], ["te", "xt ✓"], "stop", 3, 2, None, None),
    UserReply(2, error="prompt: too long", error_param="prompt"),
    UserReply(4, error="the queue is full", error_code="queue_tokens"),
    UserReply(
        3,
        "\ufffd",
        [9],
        [-0.3],
        ["\ufffd"],
        None,
        3,
        1,
        None,
        None,
        [b"\xf0"],
        [[[9, "\ufffd", -0.3, b"\xf0"], [4, "b", -1.5, b"b"]]],
        ECHO,
    ),
    ReplyBatch([UserReply(1, "a"), UserReply(2, "b", finish_reason="length", cached_tokens=16)]),
    FlushCacheMsg(7),
    FlushCacheReply(7, 1),
    FlushCacheReply(8, 0, "3 cached pages are in use"),
    StatsMsg(1, 2, 300, 4096, 1000, 250),
    StatsMsg(1, 2, 300, 4096, 1000, 250, dp_rank=3, load_tokens=1300, received=17),
    StatsMsg(1, 0, 30, 4096, 100, 0, spec_proposed=40, spec_accepted=31, spec_verified=10),
    ReadyMsg("scheduler", None, {"max_model_len": 512, "eos_token_ids": [2, 3]}),
    ReadyMsg("tokenizer0", "ValueError: no such model"),
    StartMsg(512, 49152, [2]),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg


def test_every_message_type_is_covered() -> None:
    from minisgl.message import codec

    covered = {type(m).__name__ for m in SAMPLES} | {"SamplingParams", "_Point", "_Tup"}
    assert set(codec._BY_TAG) <= covered


def test_decoding_does_not_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's SamplingParams is validated once, where it is made (the API process):
    decoding restores the fields without running __init__ / __post_init__ again."""
    params = SamplingParams(max_tokens=None, stop="x", json_schema={"type": "object"}, logit_bias={7: 2.0})
    data = encode(UserMsg(1, [1, 2], params, 0, INIT))
    calls = []
    monkeypatch.setattr(SamplingParams, "validate", lambda self: calls.append(self))
    back = decode(data)
    assert calls == [] and back.sampling == params and back.sampling.stop == ["x"]


def test_floats_keep_full_precision() -> None:
    lp = [-1e-12, -0.1 + 1e-17, -123.456789012345]
    assert decode(encode(TokenOut(1, [1, 2, 3], lp))).logprobs == lp


def test_plain_values_and_nesting_in_containers() -> None:
    value = {"a": [AbortMsg(1), {"b": StatsMsg(0, 0, 0, 1, 0, 0)}], "c": None}
    assert decode(encode(value)) == value


def test_tuples_come_back_as_lists() -> None:
    @message
    @dataclasses.dataclass
    class _Tup:
        xs: list[int]

    assert decode(encode(_Tup((1, 2)))) == _Tup([1, 2])  # type: ignore[arg-type]


def test_unregistered_types_are_refused() -> None:
    @dataclasses.dataclass
    class _Point:
        x: int

    with pytest.raises(TypeError, match="_Point"):
        encode(_Point(1))
    with pytest.raises(TypeError):
        encode({1, 2})
