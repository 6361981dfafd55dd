"""Where a run's prepared data lies and which feature layers it stores: the rules `prepare` writes by and
`train` reads by.

Feature layer ids index HF's `output_hidden_states` tuple (0 = embeddings, i = output of decoder layer i-1,
L = num_layers = the final post-norm state, the lm_head input). Defaults: Medusa / EAGLE-1/2 `[L]`; EAGLE-3
`[2, L//2, L-3]`. Every folder stores layer L too: the target's next-token distribution is recomputed from it.

    <output_dir>/data/tokens   the tokenised Dataset (online features read it)
    <output_dir>/features      the offline features (features.dir names another recipe's folder instead)
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from specheads.heads.base import default_feature_layers
from specheads.train.shards import check_features_folder
from specheads.utils import SpecheadsError

OVERWRITE_HINT = "rerun with `specheads prepare --overwrite` to replace this run's prepared data, or choose another " \
                 "output_dir"


def resolve_layers(num_layers: int, layers: Sequence[int] | None = None, kind: str | None = None) -> list[int]:
    """Layers to store: explicit `layers` or the kind's default, plus L (always stored), sorted, unique."""
    L = num_layers
    wanted = list(layers) if layers is not None else default_feature_layers(kind, L) if kind else [L]
    for i in wanted:
        if not isinstance(i, int) or not 0 <= i <= L:
            raise SpecheadsError(f"features.layers: {i!r} is out of range 0..{L} (0 = embeddings, {L} = final "
                                 f"post-norm state)")
    return sorted(set(wanted) | {L})


def feature_layers_for(recipe, num_layers: int) -> list[int]:
    """features.layers if set, else head.feature_layers, else the head kind's default; layer L always added."""
    layers = recipe.features.layers if recipe.features.layers is not None else recipe.head.feature_layers
    return resolve_layers(num_layers, layers, recipe.head.kind)


def features_dir(recipe) -> Path:
    """Where the offline features are: features.dir, or <output_dir>/features."""
    return Path(recipe.features.dir) if recipe.features.dir else Path(recipe.output_dir) / "features"


def tokens_dir(recipe) -> Path:
    """Where the tokenised data is: <output_dir>/data/tokens."""
    return Path(recipe.output_dir) / "data" / "tokens"


def check_split(feat_dir: Path, val_fraction: float) -> None:
    """The features' held-out split (the manifest's val_fraction) is the recipe's: training splits offline features
    by the manifest, so another data.val_fraction would leave the features on the old split."""
    m = check_features_folder(feat_dir)
    if m is not None and float(m.get("val_fraction", 0.0)) != float(val_fraction):
        raise SpecheadsError(f"{feat_dir}: its features were split with data.val_fraction {m.get('val_fraction', 0.0)}"
                             f" (manifest.json), not {val_fraction}; {OVERWRITE_HINT}")
