"""The drafter a SpecConfig names, built for one engine (its device, dtype and TP ranks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.spec.config import SpecConfig
from minisgl.spec.drafter import Drafter

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine


def build_drafter(engine: Engine, spec: SpecConfig) -> Drafter:
    if spec.algorithm == "ngram":
        from minisgl.spec.ngram import NgramDrafter

        return NgramDrafter(spec.ngram_min, spec.ngram_max)
    if spec.algorithm == "draft":
        from minisgl.spec.draft_model import DraftModelDrafter

        return DraftModelDrafter(engine, spec.draft_model)
    from minisgl.spec.eagle3 import Eagle3Drafter

    return Eagle3Drafter(engine, spec.draft_model)
