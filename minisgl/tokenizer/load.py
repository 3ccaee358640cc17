"""Loading the tokenizer and its chat template (HF folder or GGUF metadata)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from minisgl.models.source import ModelSource


def load_tokenizer(source: ModelSource, chat_template: str | Path | None = None, tokenizer: str | Path | None = None):
    """The model's tokenizer, or the one in the folder `tokenizer` when given."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        folder = Path(tokenizer)
        if not folder.is_dir():
            raise ValueError(f"tokenizer folder {str(folder)!r} does not exist")
        source = ModelSource(folder, is_gguf=False)
    if source.is_gguf:
        from minisgl.models.gguf_file import gguf_tokenizer

        tok = gguf_tokenizer(source.path)
    else:
        tok = AutoTokenizer.from_pretrained(str(source.path))
        if not getattr(tok, "chat_template", None):
            # The template may live in chat_template.jinja (transformers 5) or in
            # tokenizer_config.json (older); read both forms.
            jinja = source.path / "chat_template.jinja"
            cfg = source.path / "tokenizer_config.json"
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


def load_server_tokenizer(args: Any) -> Any:
    from minisgl.models.source import resolve_model

    # Set before the tokenizer runs: a forked child (large_inputs.py) must not inherit a
    # thread pool the Rust tokenizer started.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return load_tokenizer(resolve_model(args.model), args.chat_template, args.tokenizer)
