"""Constrained decoding with xgrammar: grammar specs from request fields (spec.py), compiled
off the scheduler's critical path and cached by key (compiler.py), one matcher per request row
(matcher.py), and the per-step token masks applied to the logits on the device (masks.py)."""

