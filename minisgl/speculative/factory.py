"""The drafter a SpecConfig names, built for one target (its device, dtype and TP ranks)."""

from __future__ import annotations

from minisgl.speculative.config import SpecConfig
from minisgl.speculative.drafter import Drafter, DraftTarget


def build_drafter(target: DraftTarget, spec: SpecConfig) -> Drafter:
    if spec.algorithm == "ngram":
        from minisgl.speculative.ngram import NgramDrafter

        return NgramDrafter(spec.ngram_min, spec.ngram_max)
    if spec.algorithm == "draft":
        from minisgl.speculative.draft_model import DraftModelDrafter

        return DraftModelDrafter(target, spec.draft_model)
    if spec.algorithm == "mtp":
        from minisgl.speculative.mtp import MtpDrafter

        return MtpDrafter(target)
    from minisgl.speculative.eagle3 import Eagle3Drafter

    return Eagle3Drafter(target, spec.draft_model)
