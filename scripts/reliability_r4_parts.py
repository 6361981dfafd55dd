"""Reliability sweep, round four (issue 50.3): a target folder without its decoder layers (what offline training
reads of a target: specheads/target_parts.py) given to the commands that need the whole target.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.
"""
from __future__ import annotations

from reliability_cases import target_copy

MISSING = "has no tensors of decoder layers"


def stripped_target(ctx) -> None:
    """{tmp}/t: the sweep's target folder with every `model.layers.*` tensor removed from its safetensors."""
    from safetensors.torch import load_file, save_file

    t = target_copy(ctx)
    for f in t.glob("*.safetensors"):
        kept = {k: v for k, v in load_file(str(f)).items() if ".layers." not in k}
        save_file(kept, str(f), metadata={"format": "pt"})


def cases(h) -> list[dict]:
    gen = ["generate", "--target", "{tmp}/t", "--prompt", "hi", "--max-new-tokens", "2"]
    return [
        # without the check transformers fills the missing layers with random weights and answers nonsense
        {"area": "parts", "risk": "silent wrong result", "name": "generate with a target folder missing its decoder layers",
         "setup": stripped_target, "argv": gen, "rc": 2, "expect": MISSING},
        {"area": "parts", "risk": "silent wrong result",
         "name": "prepare (online features) with a target folder missing its decoder layers",
         "setup": lambda c: (h.prepared(c), stripped_target(c)),
         "argv": h.PREPARE + ["target.name={tmp}/t", "features.mode=online"], "rc": 2, "expect": MISSING},
    ]
