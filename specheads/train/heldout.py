"""A run's own held-out split scored again after training (`specheads eval --dataset heldout:RUN`): the samples and
settings its training-time evaluation scored (train_config.yaml, eval_indices), so the figures reproduce it."""
from __future__ import annotations

from typing import Any

import torch


def heldout_recipe(run_dir: str):
    """The recipe a run trained with (<run_dir>/train_config.yaml), for `--dataset heldout:RUN`."""
    from pathlib import Path

    from specheads.config import load_config
    from specheads.recipe import Recipe
    from specheads.utils import SpecheadsError

    path = Path(run_dir) / "train_config.yaml"
    if not path.exists():
        raise SpecheadsError(f"--dataset heldout:{run_dir}: {path} not found (a folder `specheads train` wrote)")
    return load_config(Recipe, path, [f"output_dir={run_dir}"])


def evaluate_head_on_heldout(target, head, recipe) -> dict[str, Any]:
    """Metrics of `head` on the held-out split of the run `recipe` trained (its stored tokens and features, the
    samples and settings its training-time evaluation scored): they reproduce that evaluation's figures."""
    from specheads.train.evaluate import evaluate
    from specheads.train.trainer import eval_indices, load_training_data

    _, val_ds, collate_fn, layers, extract_fn = load_training_data(recipe, target)
    picked = eval_indices(len(val_ds), recipe.eval.max_samples, recipe.seed)
    dl = torch.utils.data.DataLoader(torch.utils.data.Subset(val_ds, picked), batch_size=recipe.eval.batch_size,
                                     collate_fn=collate_fn)

    def with_hidden(b):
        b = {k: (t.to(target.device) if isinstance(t, torch.Tensor) else t) for k, t in b.items()}
        if "hidden" not in b and extract_fn is not None:
            b["hidden"] = extract_fn(target, b["input_ids"], b["attention_mask"], layers)
        return b

    kind = head.config.kind
    metrics = evaluate(kind, head, dl, target, layers, list(head.config.feature_layers), recipe.eval,
                       get_hidden=with_hidden)
    return {"prompts": len(picked), "answer_tokens": int(metrics.get("eval_rows", 0)),
            **{k: round(v, 4) for k, v in metrics.items()}}
