"""Whether a model folder is an embedding model, and how its embeddings are pooled: torch-free
(the launcher reads it for the API; the engine for loading).

`--task auto` serves embeddings for a sentence-transformers folder (modules.json with a Pooling
module, or 1_Pooling/config.json: Qwen3-Embedding ships one) and for a checkpoint of a base model
without an LM head (config.json architectures "Qwen3Model", "LlamaModel", ...); anything else
generates. Pooling comes from the sentence-transformers Pooling config: last token (Qwen3-
Embedding), mean, or the first token (cls); a decoder without one pools its last token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.core.model_config import BASE_MODELS
from minisgl.models.source import ModelSource

TASKS = ("auto", "generate", "embed")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class EmbeddingConfig:
    pooling: str  # "last" | "mean" | "cls": which positions' final hidden states make the embedding
    dimensions: int  # the embedding's length (the hidden size); requests may truncate it (Matryoshka)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _pooling_folder(folder: Path) -> Path | None:
    """The sentence-transformers Pooling module's folder, if the model has one."""
    modules = _read(folder / "modules.json")
    if isinstance(modules, list):
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("models.Pooling"):
                return folder / str(m.get("path", ""))
    return folder / "1_Pooling" if (folder / "1_Pooling" / "config.json").is_file() else None


def _is_base_model(folder: Path) -> bool:
    archs = (_read(folder / "config.json") or {}).get("architectures") or []
    return bool(archs) and archs[0] in BASE_MODELS


def resolve_task(source: ModelSource, task: str) -> str:
    """ "generate" or "embed" for `--task` (auto: what the folder is)."""
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if task != "auto":
        return task
    if source.is_gguf:
        return "generate"
    return "embed" if _pooling_folder(source.path) is not None or _is_base_model(source.path) else "generate"


def embedding_config(source: ModelSource) -> EmbeddingConfig:
    """The pooling and dimensions of an embedding model (ValueError for a pooling not served)."""
    pooling = "last"
    dims = None
    folder = None if source.is_gguf else _pooling_folder(source.path)
    if folder is not None:
        st = _read(folder / "config.json") or {}
        unsupported = [k for k in _ST_UNSUPPORTED if st.get(k)]
        modes = [mode for key, mode in _ST_MODES.items() if st.get(key)]
        if unsupported or len(modes) > 1:
            raise ValueError(
                f"{folder / 'config.json'}: pooling {', '.join(unsupported + modes)} is not served; "
                f"minisgl pools one of: last token, mean, cls"
            )
        pooling = modes[0] if modes else pooling
        dims = st.get("word_embedding_dimension")
    if dims is None:
        if source.is_gguf:
            from minisgl.models.gguf_meta import gguf_config

            dims = gguf_config(source.path)["hidden_size"]
        else:
            dims = (_read(source.path / "config.json") or {}).get("hidden_size")
    if not isinstance(dims, int) or dims < 1:
        raise ValueError(f"cannot tell the embedding size of {source.path}: no hidden_size")
    return EmbeddingConfig(pooling, dims)
