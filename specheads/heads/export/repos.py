"""Checkpoints of the original research repos, imported as native heads. Loaders matched: FasterDecoding/Medusa's
medusa/model/medusa_model.py and medusa_model_legacy.py (what medusa/train/train_legacy.py trains and saves);
the EAGLE repos' folders (SafeAILab/EAGLE eagle/model/cnets1.py, cnets.py) have the `eagle` / `eagle3` layouts
and are read by export/eagle.py and export/eagle3.py (their Format.repo_rope), their RoPE base by `import_rope` here: the repo builds its
rotary embedding at `config.rope_theta` when the config has it, else at 10,000 (LlamaRotaryEmbedding's default;
its own LLaMA-2 / Vicuna training configs omit the key), so a head imported at another base computes something
else; a base that differs from the target's is refused unless `--rope-theta` says which to run.

FasterDecoding checkpoints: `{h}.{l}.linear.*` [+ `{h}.{n}.weight`; without it, the legacy heads, the target's
lm_head], optionally under `medusa_head.`; config medusa_num_heads / medusa_num_layers.
"""
from __future__ import annotations

import copy
import dataclasses
import re

from specheads.heads.base import HeadConfig, HeadSpec
from specheads.heads.export.common import check_dims, need
from specheads.heads.export.formats import Format, register_format
from specheads.heads.medusa import MedusaHead
from specheads.utils import SpecheadsError

REPO_ROPE_DEFAULT = 10000.0  # the EAGLE repo's base when its config has no rope_theta (cnets.py, cnets1.py)
ROPE_CHOICES = ("checkpoint", "target")  # --rope-theta's words; a number is a base of its own

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
    spec = HeadSpec(kind=MedusaHead.kind, num_heads=K, num_layers=n, medusa_lm_head="per_head" if own else "shared",
                    bias=any(k.endswith("linear.bias") for k in sd))
    return spec, tensors


MEDUSA_REPO = register_format(Format(
    "medusa-repo", rank=70, reader=read_medusa_repo, written=False,
    detect=lambda config: "medusa_num_heads" in config, detect_rank=40))


def checkpoint_rope_theta(config: dict) -> tuple[float, str]:
    """(the RoPE base the EAGLE repo runs a checkpoint at, where it was read): `rope_theta`, else transformers 5's
    `rope_parameters.rope_theta` (exports of newer tools), else the repo's default 10,000."""
    if config.get("rope_theta") is not None:
        return float(config["rope_theta"]), "rope_theta"
    rope = config.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("rope_theta") is not None:
        return float(rope["rope_theta"]), "rope_parameters.rope_theta"
    return REPO_ROPE_DEFAULT, "no rope_theta: the EAGLE repo's default"


def target_rope_theta(target_config: dict) -> float:
    """The base the head's layers get from the target's config (the full-attention layers' where it has several)."""
    from specheads.target import full_attention_rope

    rope = full_attention_rope(target_config.get("rope_parameters")) or {}
    return float(rope.get("rope_theta", target_config.get("rope_theta", REPO_ROPE_DEFAULT)))


def parse_rope_choice(value: str | None) -> str | float | None:
    """--rope-theta: checkpoint | target | a positive number; one line naming the flag otherwise."""
    if value is None or value in ROPE_CHOICES:
        return value
    try:
        base = float(value)
    except ValueError:
        base = -1.0
    if not base > 0:
        raise SpecheadsError(f"--rope-theta {value!r}: one of {list(ROPE_CHOICES)} or a positive RoPE base")
    return base


def import_rope(cfg: HeadConfig, config: dict, choice, where: str) -> HeadConfig:
    """The head config an EAGLE repo checkpoint imports with. Its base equal to the target's: unchanged. Otherwise
    `choice` decides: "checkpoint" (or its number) runs the head at the checkpoint's base, as the repo does (the
    head's own rotary embedding, recorded in the native folder and in every later export), "target" rebuilds it at
    the target's, a number at that base; None refuses in one line naming both bases and the flag."""
    theirs, source = checkpoint_rope_theta(config)
    mine = target_rope_theta(cfg.target_config)
    if choice is None and theirs == mine:
        return cfg
    if choice is None:
        raise SpecheadsError(
            f"{where}: RoPE base {theirs:g} ({source}) but target {cfg.target_name!r} runs RoPE at {mine:g}; the "
            f"EAGLE repo runs this head at {theirs:g}: pass --rope-theta checkpoint to import it at that base (what "
            "it was trained with), --rope-theta target to rebuild it at the target's, or --rope-theta N")
    base = theirs if choice == "checkpoint" else mine if choice == "target" else float(choice)
    if base == mine:
        return cfg
    return dataclasses.replace(cfg, target_config=with_rope_theta(cfg.target_config, base))


def with_rope_theta(target_config: dict, base: float) -> dict:
    """A copy of a text config whose RoPE base is `base` in every spelling it has (rope_parameters, per layer type
    too, and rope_theta)."""
    d = copy.deepcopy(dict(target_config))
    rope = d.get("rope_parameters")
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        for v in rope.values():
            v["rope_theta"] = base
    else:
        d["rope_parameters"] = {**(rope or {"rope_type": "default"}), "rope_theta": base}
    if "rope_theta" in d:
        d["rope_theta"] = base
    return d
