"""`specheads train --config RECIPE.yaml [key=value ...] [--init-head DIR] [--resume | --calibrate-only]`: fit a draft
head on a frozen target; with train.stage=opd, distil a trained head on-policy (train/opd.py).

One process:            specheads train --config configs/eagle3-smollm2.yaml
Several (DDP/DeepSpeed): accelerate launch --config_file configs/accelerate/<...>.yaml -m specheads train --config ...
Needs `specheads prepare --config RECIPE.yaml` first (tokenised data; offline features unless features.mode=online).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="recipe YAML (sections target, data, features, head, train, eval)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. train.lr=1e-4 train.max_steps=200 output_dir=runs/x")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint under <output_dir>/checkpoints (model, optimizer, "
                        "scheduler, RNG, data position)")
    p.add_argument("--init-head", metavar="DIR", default=None,
                   help="start from this trained head folder or hub id org/name[@revision] (train.init_head); the "
                        "opd stage (train.stage=opd) needs one")
    p.add_argument("--calibrate-only", action="store_true",
                   help="a DSpark run already trained: fit its confidence calibration again on the held-out split "
                        "(best/ and final/, calibration.json); no training, the checkpoints and summary untouched")


def run(args: argparse.Namespace) -> int:
    from specheads.config import load_config
    from specheads.train.recipe import Recipe
    from specheads.runlock import run_lock

    overrides = list(args.overrides) + ([f"train.init_head={args.init_head}"] if args.init_head else [])
    recipe = load_config(Recipe, args.config, overrides)
    if args.calibrate_only and args.resume:
        raise SpecheadsError("--calibrate-only and --resume: choose one")
    with run_lock(recipe.output_dir, "train"):  # one writer per run folder (rank 0 holds it for all ranks)
        _run(args, recipe)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not args.calibrate_only:
        # Training is over and the process group is destroyed (Trainer.train ends with end_training). About one
        # 2-process gloo run in four still aborts in interpreter teardown (SIGABRT in the gloo/c10d destructors), so
        # leave without it: flush and exit now (the run lock is released above).
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    return 0


def _run(args: argparse.Namespace, recipe) -> None:
    from specheads.train.opd import run_opd
    from specheads.train.trainer import recalibrate_run, run_training

    if args.calibrate_only:
        out = recalibrate_run(recipe)
        for name, r in out.items():
            print(f"calibrated {recipe.output_dir}/{name}: held-out conditional ECE max "
                  f"{r['odd_before'].get('ece_max', float('nan')):.3f} -> {r['odd_after'].get('ece_max', float('nan')):.3f}"
                  f"; {recipe.output_dir}/calibration.json", flush=True)
        return
    run = run_opd if recipe.train.stage == "opd" else run_training
    res = run(recipe, resume=args.resume)
    if int(os.environ.get("RANK", "0")) == 0:
        final = res.output_dir / "final"
        if res.best_dir is None and res.best_step is not None:  # the summary names only folders that exist
            print(f"trained {res.steps} steps; best {recipe.eval.select} {res.best_metric:.3f} at step "
                  f"{res.best_step}, but {res.output_dir / 'best'} is gone (removed since; its weights are not "
                  f"kept); head: {final}", flush=True)
        elif res.best_dir is None:
            print(f"trained {res.steps} steps; no held-out split: best/ not written; head: {final}", flush=True)
        else:
            print(f"trained {res.steps} steps; best {recipe.eval.select} {res.best_metric:.3f} at step "
                  f"{res.best_step}; head: {res.best_dir} (final: {final})", flush=True)
