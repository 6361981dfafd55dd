"""Worker for the distributed training tests (run under `accelerate launch` or plainly): a tiny Llama target, a
2-head Medusa head, random token samples; trains with the given settings and writes <out>/final."""
from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--deepspeed", default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-after", type=int, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(here), here]  # this checkout's specheads (not an installed one) and test_train
    from test_train import make_head, make_recipe, token_samples

    from specheads.target import tiny_target
    from specheads.train.trainer import Trainer

    over = [f"train.grad_accum={a.grad_accum}", f"train.batch_size={a.batch_size}", f"train.max_steps={a.max_steps}",
            f"train.save_every={a.save_every}", "eval.every_steps=0", "eval.at_start=false"]
    if a.deepspeed:
        over.append(f"train.deepspeed={a.deepspeed}")
    recipe = make_recipe(a.out, *over)
    target = tiny_target()
    head = make_head(recipe, target)
    Trainer(recipe, target, head, token_samples(16), token_samples(4, seed=1)).train(resume=a.resume,
                                                                                    stop_after=a.stop_after)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # see specheads/commands/train.py: gloo teardown sometimes aborts after a finished run
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
