"""`specheads prepare --config RECIPE.yaml [key=value ...]`: data -> (regenerate) -> tokens -> features."""
from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="recipe YAML (sections target, data, features, head, ...)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. data.max_conversations=200 output_dir=runs/x")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs only)")
    p.add_argument("--verify", action="store_true",
                   help="re-hash every listed feature shard against its sha256 in the manifest; damaged shards are "
                        "rewritten (training checks each shard once on first read unless features.verify=false)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier prepare of other data, split, target or layers in output_dir: removes its "
                        "features/, data/ (tokens, regenerated answers), prepare_config.yaml and prepare_summary.json "
                        "first (refused when output_dir holds a trained run)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specheads.config import format_changes, load_config
    from specheads.train.recipe import Recipe
    from specheads.runlock import run_lock
    from specheads.train.prepare import format_summary, prepare

    recipe = load_config(Recipe, args.config, args.overrides)
    print(f"# specheads prepare --config {args.config} {' '.join(args.overrides)}".rstrip())
    print(format_changes(recipe, Path(recipe.output_dir) / "prepare_config.yaml"), flush=True)
    with run_lock(recipe.output_dir, "prepare"):  # one writer per run folder (rank 0 holds it for all ranks)
        summary = prepare(recipe, progress=not args.no_progress, verify=args.verify, overwrite=args.overwrite)
    if summary:  # rank 0 (or the one process); the other ranks of a torchrun / accelerate launch return {}
        print(format_summary(summary))
        print(f"summary written to {recipe.output_dir}/prepare_summary.json")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # as commands/train.py: gloo's teardown can abort; leave now
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    return 0
