"""A run's own held-out split scored again after training (`specheads eval --dataset heldout:RUN`): the samples and
settings its training-time evaluation scored (train_config.yaml, eval_indices), so the figures reproduce it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from specheads.config import load_config
from specheads.train.dataset import eval_indices, split_batches
from specheads.train.evaluate import evaluate
from specheads.train.recipe import Recipe
from specheads.train.trainer import load_training_data
from specheads.utils import SpecheadsError


def heldout_recipe(run_dir: str):
    """The recipe a run trained with (<run_dir>/train_config.yaml), for `--dataset heldout:RUN`."""
    path = Path(run_dir) / "train_config.yaml"
    if not path.exists():
        raise SpecheadsError(f"--dataset heldout:{run_dir}: {path} not found (a folder `specheads train` wrote)")
    recipe = load_config(Recipe, path, [f"output_dir={run_dir}"])
    if not recipe.data.val_fraction:
        raise SpecheadsError(f"--dataset heldout:{run_dir}: the run has no held-out split (data.val_fraction 0 in "
                             f"{path}), so there is nothing to score; give another --dataset (mt-bench, "
                             f"sharegpt:START, a JSONL file)")
    return recipe


def evaluate_head_on_heldout(target, head, recipe) -> dict[str, Any]:
    """Metrics of `head` on the held-out split of the run `recipe` trained (its stored tokens and features, the
    samples and settings its training-time evaluation scored): they reproduce that evaluation's figures."""
    _, val_ds, collate_fn, layers, extract_fn = load_training_data(recipe, target)
    if len(val_ds) == 0:  # a split asked for, but no conversation hashed into it (a small data set)
        raise SpecheadsError(f"--dataset heldout:{recipe.output_dir}: the run's held-out split is empty (no "
                             f"conversation fell in data.val_fraction {recipe.data.val_fraction}), so there is "
                             f"nothing to score; give another --dataset (mt-bench, sharegpt:START, a JSONL file)")
    picked = eval_indices(len(val_ds), recipe.eval.max_samples, recipe.seed)
    batches = split_batches(val_ds, recipe.eval.batch_size, collate_fn, target, layers, extract_fn, picked)
    metrics = evaluate(head.config.kind, head, batches, target, layers, list(head.config.feature_layers),
                       recipe.eval)
    return {"prompts": len(picked), "answer_tokens": int(metrics.get("eval_rows", 0)),
            **{k: round(v, 4) for k, v in metrics.items()}}
