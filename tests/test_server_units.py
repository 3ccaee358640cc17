"""Server pieces without processes: the detokenizer, flags, scheduler options, sampling."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from minisgl.launch.cli import build_parser, parse_args
from minisgl.message import DetokenizeMsg, DetokInit, TokenOut, decode, encode
from minisgl.scheduler.process import scheduler_builder
from minisgl.server.build import Builder
from minisgl.server.errors import ApiError
from minisgl.server.protocol import Protocol
from minisgl.server.protocol_types import Limits
from minisgl.tokenizer.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_path: Callable[[str], Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path("llama3")))


def run(
    tok: Any, ids: list[int], stop: list[str] | None = None, finish: str = "length", per_step: int = 1,
    init: DetokInit | None = None,
) -> tuple[list[str], list[str | None], list[tuple[int, int]]]:
    """Feeds `ids` `per_step` at a time; returns the text deltas, finish reasons, and the
    (uid, output tokens to keep) pairs told to the scheduler."""
    detok = Detokenizer(tok)
    deltas, reasons, stopped = [], [], []
    for i in range(0, len(ids), per_step):
        last = i + per_step >= len(ids)
        first = init or DetokInit(3, stop)
        item = TokenOut(7, ids[i : i + per_step], None, finish if last else None, first if i == 0 else None)
        replies, s = detok.process(DetokenizeMsg([item]))
        stopped += s
        for r in replies:
            deltas.append(r.text)
            reasons.append(r.finish_reason)
    return deltas, reasons, stopped


@pytest.mark.parametrize("text", ["你好，世界！", "emoji 😀🎉 mix", "naïve café — 漢字 🙂"])
def test_split_characters_never_emit_replacement(tok: Any, text: str) -> None:
    ids = tok(text).input_ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some character is split over tokens
    deltas, reasons, _ = run(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


def test_partial_character_at_finish_is_sent(tok: Any) -> None:
    ids = tok("a😀").input_ids
    cut = ids[:-1]  # the emoji's last byte never comes
    deltas, _, _ = run(tok, cut)
    assert "".join(deltas) == tok.decode(cut)  # what a full decode gives, nothing held back


def test_stop_string_across_tokens_is_trimmed(tok: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok(text).input_ids
    deltas, reasons, stopped = run(tok, ids, stop=["own fo"])
    assert "".join(deltas) == "The quick br"
    assert reasons[-1] == "stop" and reasons.count("stop") == 1
    assert [uid for uid, _ in stopped] == [7]  # the scheduler is told once; later tokens are dropped
    assert all("o" not in d for d in deltas[2:])  # no part of the stop string went out


def test_stop_inside_a_multi_token_step(tok: Any) -> None:
    """A speculative step brings several tokens: those after the stop string's last are not
    output, not counted, and the scheduler is told how many to keep."""
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok(text).input_ids
    one = tok("The quick brown fox").input_ids
    assert ids[: len(one)] == one
    detok = Detokenizer(tok)
    item = TokenOut(7, ids, [0.5] * len(ids), None, DetokInit(3, ["own fo"], logprobs=True))
    replies, stopped = detok.process(DetokenizeMsg([item]))
    (r,) = replies
    assert r.text == "The quick br" and r.finish_reason == "stop" and r.matched_stop == "own fo"
    assert r.token_ids == one and r.completion_tokens == len(one) and len(r.logprobs) == len(one)
    assert stopped == [(7, len(one))]


def test_earliest_stop_string_wins(tok: Any) -> None:
    ids = tok("one two three four").input_ids
    deltas, _, _ = run(tok, ids, stop=["four", "two"], per_step=len(ids))
    assert "".join(deltas) == "one "


def test_held_back_text_is_flushed_at_finish(tok: Any) -> None:
    text = "over the lazy dog"
    ids = tok(text).input_ids
    deltas, reasons, stopped = run(tok, ids, stop=["dog!"])
    assert not deltas[-2].endswith("dog")  # " dog" might begin "dog!": held back...
    assert "".join(deltas) == text and reasons[-1] == "length"  # ...and sent at the end
    assert stopped == []


def test_stop_found_on_the_finishing_step(tok: Any) -> None:
    ids = tok("hello world").input_ids + [tok.eos_token_id]  # the scheduler's "stop": an EOS token
    deltas, reasons, stopped = run(tok, ids, stop=["world"], finish="stop", per_step=len(ids))
    assert "".join(deltas) == "hello " and reasons[-1] == "stop"
    assert stopped == []  # the scheduler already finished it


def test_stop_token_text_and_include_stop_str(tok: Any) -> None:
    text = "one two. three"
    ids = tok(text).input_ids
    dot = ids[[tok.decode(ids[: i + 1]) for i in range(len(ids))].index("one two.")]  # " two." or "."
    cut = ids[: ids.index(dot) + 1]  # what the scheduler sends when `dot` is a stop_token_id
    want = tok.decode(cut[:-1])
    assert "".join(run(tok, cut, finish="stop")[0]) == want  # the stop token's text is not output...
    keep = DetokInit(3, None, include_stop_str=True)
    assert "".join(run(tok, cut, finish="stop", init=keep)[0]) == tok.decode(cut)  # ...unless asked
    assert "".join(run(tok, cut, finish="length")[0]) == tok.decode(cut)  # a length finish keeps it
    # Stop strings: cut before the string, or after it with include_stop_str.
    assert "".join(run(tok, ids, stop=["two"])[0]) == "one "
    keep = DetokInit(3, ["two"], include_stop_str=True)
    deltas, reasons, stopped = run(tok, ids, init=keep)
    assert "".join(deltas) == "one two" and reasons[-1] == "stop" and [uid for uid, _ in stopped] == [7]


def test_every_flag_has_help() -> None:
    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 24
    for a in flags:
        assert a.help and len(a.help) > 10, a.option_strings
    out = subprocess.run(
        [sys.executable, "-m", "minisgl.serve", "--help"], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert out.returncode == 0
    for needed in (
        "--model",
        "--host",
        "--port",
        "--device",
        "--dtype",
        "--served-model-name",
        "--max-model-len",
        "--api-key",
        "--num-tokenizers",
        "--chat-template",
        "--shell",
        "--page-size",
        "--num-pages",
        "--max-running-requests",
        "--attention-backend",
        "--max-prefill-tokens",
        "--seed",
        "--cache",
        "--disable-overlap",
        "--disable-cuda-graph",
        "--cuda-graph-max-bs",
    ):
        assert needed in out.stdout


def test_args_map_onto_configs(tiny_model_path: Callable[[str], Path]) -> None:
    model = str(tiny_model_path("llama3"))
    args = parse_args(
        [
            "--model",
            model,
            "--device",
            "cpu",
            "--page-size",
            "4",
            "--num-pages",
            "64",
            "--max-running-requests",
            "8",
            "--seed",
            "3",
            "--max-model-len",
            "256",
            "--cache",
            "naive",
            "--disable-overlap",
            "--disable-cuda-graph",
            "--cuda-graph-max-bs",
            "16",
            "--max-prefill-tokens",
            "512",
        ]
    )
    assert args.served_model_name == "llama3" and args.port == 8000 and args.host == "127.0.0.1"
    cfg = args.engine_config()
    assert (cfg.page_size, cfg.num_pages, cfg.max_running_requests, cfg.seed, cfg.max_model_len, cfg.device) == (
        4,
        64,
        8,
        3,
        256,
        "cpu",
    )
    assert args.scheduler_options() == {
        "cache": "naive",
        "overlap": False,
        "cuda_graph": False,
        "cuda_graph_max_bs": 16,
        "max_prefill_tokens": 512,
    }
    assert parse_args(["--model", model, "--device", "cpu"]).scheduler_options() == {}
    with pytest.raises(ValueError, match="num_tokenizers"):
        parse_args(["--model", model, "--device", "cpu", "--num-tokenizers", "-1"])


def test_speculative_flags_without_the_algorithm_are_refused_naming_it(tmp_path: Path) -> None:
    """A speculative flag on a server without speculation would do nothing: refused in the style of
    every missing capability (the flag, the one that turns it on and its values); with the
    algorithm, the flag takes effect, and left out, its default does."""
    base = ["--model", str(tmp_path), "--device", "cpu", "--served-model-name", "m", "--num-tokenizers", "1"]
    for flag, value in (("--speculative-num-draft-tokens", "4"), ("--speculative-ngram-max", "3")):
        with pytest.raises(ValueError) as e:
            parse_args([*base, flag, value])
        assert str(e.value).startswith(f"{flag}: speculative decoding is off"), e.value
        assert "--speculative-algorithm ngram, draft, eagle3 or mtp" in str(e.value)
    args = parse_args([*base, "--speculative-algorithm", "ngram", "--speculative-ngram-max", "3"])
    assert (args.speculative_ngram_max, args.speculative_num_draft_tokens) == (3, 4)
    assert parse_args(base).speculative_ngram_max == 4


def test_scheduler_options_checked_before_the_model_loads() -> None:
    scheduler_builder({"cache": "naive", "overlap": False, "cuda_graph": False, "max_prefill_tokens": 64})
    for bad, name in (
        ({"cache": "lru"}, "cache"),
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs"),
        ({"max_prefill_tokens": 0}, "max_prefill_tokens"),
        ({"new_token_ratio": 0.5}, "new_token_ratio"),
    ):
        with pytest.raises(ValueError, match=name):
            scheduler_builder(bad)


def test_build_sampling() -> None:
    limits = Limits(vocab_size=1000, max_model_len=64)
    proto, builder = Protocol(limits), Builder("m", limits, {"temperature": 0.2, "top_k": 20})
    job = builder.completion(proto.completion(prompt="x", top_k=0, stop="x", temperature=0))
    d = job.msgs[0].sampling
    assert d.top_k == -1 and d.stop == ["x"] and d.max_tokens == 16  # OpenAI's completions default
    assert d.temperature == 0 and d.top_p == 1.0  # the request wins; then the model; then OpenAI
    d = builder.completion(proto.completion(prompt="x")).msgs[0].sampling
    assert (d.temperature, d.top_k) == (0.2, 20)
    assert (d.presence_penalty, d.repetition_penalty, d.logit_bias, d.min_tokens) == (0.0, 1.0, None, 0)
    # What the schema cannot state is checked here: min_tokens <= max_tokens, logprobs needed by
    # top_logprobs, the model.
    with pytest.raises(ApiError) as e:
        builder.completion(proto.completion(prompt="x", min_tokens=20, max_tokens=5))
    assert e.value.param == "min_tokens" and e.value.status == 400
    with pytest.raises(ApiError) as e:
        builder.chat(proto.chat(messages=[{"role": "user", "content": "x"}], top_logprobs=0, logprobs=False,
                               stream_options={"include_usage": True}))
    assert e.value.param == "stream_options"
    with pytest.raises(ApiError) as e:
        builder.chat(proto.chat(messages=[{"role": "user", "content": "x"}], model="other"))
    assert e.value.status == 404 and e.value.code == "model_not_found"


def test_tokenizer_worker_checks_and_templates(
    tiny_model_path: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minisgl.core.sampling_params import RequestError, SamplingParams
    from minisgl.message import StartMsg, TokenizeMsg
    from minisgl.models.source import resolve_model
    from minisgl.tokenizer.load import load_tokenizer
    from minisgl.tokenizer.worker import TokenizeHandler

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m.role }}:{{ m.content }}>>{% endfor %}")
    tok = load_tokenizer(resolve_model(tiny_model_path("llama3")), template)
    h = TokenizeHandler(tok, None, None, seed=0)  # type: ignore[arg-type]
    h.start(StartMsg(max_model_len=64, vocab_size=len(tok), extra_eos_ids=[]))
    chat = TokenizeMsg([1, 2], messages=[{"role": "user", "content": "hi"}],
                       sampling=SamplingParams(seed=5, max_tokens=None))
    refused = [
        (TokenizeMsg([1], text="word " * 80), "prompt"),
        (TokenizeMsg([1], text=""), "prompt"),
        (TokenizeMsg([1], input_ids=[len(tok) + 5]), "prompt"),
        (TokenizeMsg([1], text="hi", sampling=SamplingParams(max_tokens=100)), "max_tokens"),
        # More than the 64-token context leaves after the prompt: known only once tokenized.
        (TokenizeMsg([1], text="hi", sampling=SamplingParams(max_tokens=None, min_tokens=70)), "min_tokens"),
    ]
    # The API process validated the sampling fields; the worker gets them through the codec and
    # checks only what needs the prompt, never validating them again.
    validated = []
    monkeypatch.setattr(SamplingParams, "validate", lambda self: validated.append(self))
    msgs = h.prepare(decode(encode(chat)))
    assert tok.decode(msgs[0].input_ids) == "<<user:hi>>"
    assert [m.uid for m in msgs] == [1, 2] and [m.seed for m in msgs] == [5, 6]
    assert msgs[0].sampling.max_tokens == 64 - len(msgs[0].input_ids)  # the rest of the context
    assert msgs[0].detok.prompt_tokens == len(msgs[0].input_ids)
    for msg, param in refused:
        with pytest.raises(RequestError) as e:
            h.prepare(decode(encode(msg)))
        assert e.value.param == param and param in str(e.value)
    assert validated == []


def test_scheduler_process_add_checks_only_kv_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scheduler rank 0 takes the tokenizer's UserMsg as it decodes (no revalidation) and
    refuses only a request the KV pool could never hold, blaming max_tokens."""
    from types import SimpleNamespace

    import zmq

    from minisgl.core.sampling_params import SamplingParams
    from minisgl.message import StartMsg, UserMsg
    from minisgl.message.addresses import Addresses
    from minisgl.scheduler.process import SchedulerProcess

    def add_check(req: Any) -> None:
        if req.max_total_len > 40:
            raise ValueError(f"request needs up to {req.max_total_len} tokens of KV cache but the pool holds 40")

    engine = SimpleNamespace(model_config=SimpleNamespace(eos_token_ids=[2]), tp=SimpleNamespace(rank=0, size=1),
                             cpu_group=None, max_model_len=64)
    sched = SimpleNamespace(add_check=add_check, grammar=SimpleNamespace(compiler=None), waiting=[])
    addrs = Addresses.ipc(tmp_path, 1)
    ctx = zmq.Context()
    api = ctx.socket(zmq.PULL)
    api.bind(addrs.api)
    proc = SchedulerProcess(engine, sched, addrs, StartMsg(64, 100, []))  # type: ignore[arg-type]
    init = DetokInit(3)
    fits, too_long = (encode(UserMsg(u, [5, 6, 7], SamplingParams(max_tokens=n), 0, init))
                      for u, n in ((1, 8), (2, 50)))
    validated = []
    monkeypatch.setattr(SamplingParams, "validate", lambda self: validated.append(self))
    proc.apply(decode(fits))
    proc.apply(decode(too_long))
    assert [i[0] for i in proc.inputs] == ["add"] and proc.inputs[0][1].max_total_len == 11
    (reply,) = decode(api.recv()).replies
    assert (reply.uid, reply.error_param) == (2, "max_tokens") and "KV cache" in reply.error
    assert validated == []
    api.close(0)
    ctx.term()


def test_detokenizer_drops_state_of_aborted_request(tok: Any) -> None:
    detok = Detokenizer(tok)
    ids = tok("Hello there, how are you").input_ids
    detok.process(DetokenizeMsg([TokenOut(7, ids[:3], None, None, DetokInit(3, None))]))
    assert 7 in detok.states
    replies, _ = detok.process(DetokenizeMsg([TokenOut(7, [], None, "abort")]))
    assert replies == [] and 7 not in detok.states


def test_server_engine_defaults_match_engine_config() -> None:
    import dataclasses

    from minisgl.engine.config import EngineConfig
    from minisgl.launch.args import ServerArgs

    server, engine = ServerArgs(), EngineConfig()
    shared = [f.name for f in dataclasses.fields(EngineConfig) if hasattr(server, f.name)]
    assert len(shared) >= 12
    for name in shared:
        if name not in ("model", "device"):  # the server resolves these itself
            assert getattr(server, name) == getattr(engine, name), name
    cfg = ServerArgs(tp=2, dist_init_addr="127.0.0.1:1", page_size=4).engine_config(tp_rank=1)
    assert (cfg.tp_rank, cfg.tp_size, cfg.page_size, cfg.custom_nccl) == (1, 2, 4, True)
