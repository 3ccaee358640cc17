"""Loading the tokenizer and its chat template (an HF folder, or a GGUF's tokenizer converted
once into one: gguf_tokenizer.py)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from minisgl.models.source import ModelSource
from minisgl.tokenizer.gguf_tokenizer import gguf_tokenizer_folder


def load_tokenizer(source: ModelSource, chat_template: str | Path | None = None, tokenizer: str | Path | None = None):
    """The model's tokenizer, or the one in the folder `tokenizer` when given."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        folder = Path(tokenizer)
        if not folder.is_dir():
            raise ValueError(f"tokenizer folder {str(folder)!r} does not exist")
        source = ModelSource(folder, is_gguf=False)
    folder = gguf_tokenizer_folder(source.path) if source.is_gguf else source.path
    tok = AutoTokenizer.from_pretrained(str(folder))
    if not getattr(tok, "chat_template", None):
        # The template may live in chat_template.jinja (transformers 5) or in
        # tokenizer_config.json (older); read both forms.
        jinja = folder / "chat_template.jinja"
        cfg = folder / "tokenizer_config.json"
        if jinja.exists():
            tok.chat_template = jinja.read_text()
        elif cfg.exists():
            template = json.loads(cfg.read_text()).get("chat_template")
            if template:
                tok.chat_template = template
    if chat_template is not None:
        path = Path(chat_template)
        if not path.is_file():
            raise ValueError(f"chat template file {str(path)!r} does not exist")
        tok.chat_template = path.read_text()
    return tok


def hide_torch() -> None:
    """For processes that only tokenize (the tokenizer workers, the detokenizer): transformers
    imports torch whenever it is installed (~2 s and a few hundred MB per process) though a
    tokenizer never uses it. With sys.modules["torch"] None, importlib.util.find_spec("torch")
    is None, so transformers runs tokenizer-only (and an `import torch` fails at once). Call it
    first thing in such a process's entry function, never at a library module's import: the
    offline LLM and the scheduler load this module too, and they need torch."""
    if "torch" in sys.modules:
        return  # loaded already: nothing left to save
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers says so once, as advice; here it is the point.
    logging.getLogger("transformers").addFilter(lambda r: not r.getMessage().startswith("PyTorch was not found"))


def load_server_tokenizer(args: Any) -> Any:
    from minisgl.models.source import resolve_model

    # Set before the tokenizer runs: a forked child (large_inputs.py) must not inherit a
    # thread pool the Rust tokenizer started.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return load_tokenizer(resolve_model(args.model), args.chat_template, args.tokenizer)
