"""The sampling settings a model recommends, for requests that leave them out (as vLLM does):
the model folder's generation_config.json, or, for the built-in GGUF model (which carries
none), its model card's recommendation. Fields a request sets always win; fields neither
the request nor the model sets take OpenAI's defaults (temperature 1, top_p 1, ...)."""

from __future__ import annotations

import json
from typing import Any

from minisgl.models.source import DEFAULT_GGUF, ModelSource

# generation_config.json key -> SamplingParams field (the same names).
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
OPENAI_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
# Models that ship without a generation config, by file name: their model cards' settings.
BUILT_IN: dict[str, dict[str, Any]] = {
    DEFAULT_GGUF: {"temperature": 0.2, "top_p": 0.9},  # SmolLM2-135M-Instruct's model card
}


def _valid(name: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if name == "top_k":
        return isinstance(value, int) and (value >= 1 or value in (0, -1))
    if name == "repetition_penalty":
        return value > 0
    if name == "top_p":
        return 0 < value <= 1
    if name == "min_p":
        return 0 <= value <= 1
    return value >= 0  # temperature


def model_sampling_defaults(source: ModelSource) -> dict[str, Any]:
    """The fields the model sets (a subset of FIELDS); values that would be refused in a
    request are left out, so a bad config cannot break every request."""
    if source.is_gguf:
        return dict(BUILT_IN.get(source.path.name, {}))
    path = source.path / "generation_config.json"
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    out = {k: cfg[k] for k in FIELDS if k in cfg and _valid(k, cfg[k])}
    if out.get("top_k") == 0:
        out["top_k"] = -1  # transformers' 0 means off, as does our -1
    return out


def describe(defaults: dict[str, Any]) -> str:
    """One line for logs and the shell: every field, the model's values marked."""
    return ", ".join(
        f"{k}={defaults.get(k, v)}" + (" (model)" if k in defaults else "") for k, v in OPENAI_DEFAULTS.items()
    )
