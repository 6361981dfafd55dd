"""How much the held-out sample selection moves a run's training-time figures: the head scored on the first N
held-out samples (what `eval.max_samples: N` scored before it drew at random: shards are length-sorted, so the
shortest), on every sample, and on random draws of N, as JSON.

    python scripts/heldout_selection.py --run runs/demo --head runs/demo/best --first 8 --draws 5 --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    from specheads.heads.base import load_head
    from specheads.train.heldout import heldout_recipe
    from specheads.target import load_target
    from specheads.train.evaluate import evaluate
    from specheads.train.dataset import eval_indices
    from specheads.train.trainer import load_training_data
    from specheads.utils import atomic_write_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a `specheads train` run folder (its train_config.yaml)")
    p.add_argument("--head", required=True, help="head folder to score (e.g. RUN/best)")
    p.add_argument("--first", type=int, default=16, help="N: the old selection's sample count (default 16)")
    p.add_argument("--draws", type=int, default=5, help="random draws of N samples (seeds 0..draws-1)")
    p.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    a = p.parse_args(argv)
    recipe = heldout_recipe(a.run)
    target = load_target(recipe.target.name, dtype=recipe.target.dtype)
    head = load_head(a.head, target).eval()
    _, val_ds, collate_fn, layers, _ = load_training_data(recipe, target)
    keys = ("top1_0", "tau_chain", "tau_chain_se", "tau_tree", "tau_chain_walk", "tau_tree_walk", "eval_samples",
            "eval_rows")

    def score(idx):
        dl = torch.utils.data.DataLoader(torch.utils.data.Subset(val_ds, idx), batch_size=recipe.eval.batch_size,
                                         collate_fn=collate_fn)
        m = evaluate(head.config.kind, head, dl, target, layers, list(head.config.feature_layers), recipe.eval)
        return {k: round(m[k], 4) for k in keys if k in m}

    n = len(val_ds)
    out = {"run": a.run, "head": a.head, "held_out_samples": n, "first": score(list(range(min(a.first, n)))),
           "all": score(list(range(n))), "random": [score(eval_indices(n, a.first, s)) for s in range(a.draws)]}
    print(json.dumps(out, indent=1))
    if a.out:
        atomic_write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
