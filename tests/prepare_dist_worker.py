"""Worker for tests/test_prepare_dist.py, run under torchrun: `specheads prepare` of a recipe, and with
--kill-rank R --kill-after N rank R kills itself (SIGKILL, no cleanup) right after committing its N-th feature
shard, as a node lost mid-prepare would; torchrun then stops the other ranks."""
from __future__ import annotations

import argparse
import os
import signal
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--kill-rank", type=int, default=None)
    ap.add_argument("--kill-after", type=int, default=1)
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(here))  # this checkout's specheads
    import torch

    from specheads.config import load_config
    from specheads.train.recipe import Recipe
    from specheads.runlock import run_lock
    from specheads.train.prepare import prepare

    torch.set_num_threads(1)
    recipe = load_config(Recipe, a.config, [])
    rank = int(os.environ.get("RANK", "0"))
    written = []

    def after_shard(k: int) -> None:
        written.append(k)
        if rank == a.kill_rank and len(written) >= a.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    with run_lock(recipe.output_dir, "prepare"):
        prepare(recipe, progress=False, after_shard=after_shard)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as commands/prepare.py: no gloo teardown


if __name__ == "__main__":
    raise SystemExit(main())
