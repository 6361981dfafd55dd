"""Checkpoints of the original research repos, imported as native heads. Loaders matched: FasterDecoding/Medusa's
medusa/model/medusa_model.py and medusa_model_legacy.py (what medusa/train/train_legacy.py trains and saves);
the EAGLE repos' folders (SafeAILab/EAGLE eagle/model/cnets1.py, cnets.py) have the `eagle` / `eagle3` layouts
and are read by export/eagle.py and export/eagle3.py.

FasterDecoding checkpoints: `{h}.{l}.linear.*` [+ `{h}.{n}.weight`; without it, the legacy heads, the target's
lm_head], optionally under `medusa_head.`; config medusa_num_heads / medusa_num_layers.
"""
from __future__ import annotations

import re

from specheads.heads.base import HeadSpec
from specheads.heads.export.common import check_dims, need
from specheads.utils import SpecheadsError

# FasterDecoding/Medusa checkpoints: the state dict of the heads' ModuleList, `{h}.{l}.linear.weight|bias` for the
# ResBlocks and, in medusa_model.py's heads only, `{h}.{n}.weight` for the head's own vocab projection
# (medusa_model_legacy.py's heads, the ones train_legacy.py trains and saves, are ResBlocks read through the base
# model's lm_head); saved and loaded without a prefix (medusa_head.state_dict / load_state_dict), older exports
# carry `medusa_head.` in front. All are read.
_MEDUSA_REPO_KEY = re.compile(r"(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.)?(weight|bias)")


def read_medusa_repo(config: dict, sd: dict, target, where: str, w: str) -> tuple[HeadSpec, dict]:
    """medusa_model.py heads end in their own vocab projection `{h}.{n}.weight`; medusa_model_legacy.py heads (what
    train_legacy.py trains and saves) are ResBlocks only and project through the base model's lm_head: imported as
    a head sharing the target's lm_head (the same function). A mix of both is refused."""
    if "hidden_size" in config:
        check_dims(config, target, where)
    K, n = int(need(config, "medusa_num_heads", where)), int(need(config, "medusa_num_layers", where))
    tensors = {}
    for k, v in sd.items():
        m = _MEDUSA_REPO_KEY.fullmatch(k)
        if m is None:
            raise SpecheadsError(f"{w}: unexpected key {k!r}")
        h, l, lin, p = int(m[1]), int(m[2]), m[3], m[4]
        if lin:  # each tied repeat becomes its own tensor here: our blocks are distinct
            tensors[f"blocks.{h}.layers.{l}.{p}"] = v.clone()
        elif l == n and p == "weight":
            tensors[f"lm_heads.{h}.weight"] = v
        else:
            raise SpecheadsError(f"{w}: unexpected key {k!r}")
    own = sorted(h for h in range(K) if f"lm_heads.{h}.weight" in tensors)
    if own and len(own) < K:
        raise SpecheadsError(f"{w}: heads {own} have a vocab projection ('{{h}}.{n}.weight') and the others not; a "
                             "checkpoint has it on every head (medusa_model.py) or on none (medusa_model_legacy.py)")
    spec = HeadSpec(kind="medusa", num_heads=K, num_layers=n, medusa_lm_head="per_head" if own else "shared",
                    bias=any(k.endswith("linear.bias") for k in sd))
    return spec, tensors
