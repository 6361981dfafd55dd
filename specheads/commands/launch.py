"""`specheads launch --config RECIPE [--node-rank N] [--main-ip IP] [--dry-run] [-- COMMAND ...]`: run a specheads
command (default `train`) on this node of the recipe's `launch:` topology, through accelerate's own launcher.

Run the same line on every node, each with its own --node-rank (0 on the node at launch.main_process_ip):
    specheads launch --config configs/eagle3-llama3-8b.yaml --node-rank $NODE_RANK -- train
`--config RECIPE` is added to COMMAND when it names none, so every node reads the same recipe (docs/training.md).
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex

from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="recipe YAML; its launch: section is the topology")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's rank, 0..launch.num_machines-1 (0: the main node); needed with several nodes")
    p.add_argument("--main-ip", default=None, help="node 0's address (overrides launch.main_process_ip)")
    p.add_argument("--dry-run", action="store_true", help="print the accelerate launch line and exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the specheads command each process runs, after `--` (default: train)")


def run(args: argparse.Namespace) -> int:
    from specheads.config import load_config
    from specheads.train.recipe import Recipe
    from specheads.train.launch import accelerate_argv, check_port_free, wait_for_main

    recipe = load_config(Recipe, args.config)
    cfg = recipe.launch
    command = list(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd) or ["train"]
    if command[0] not in ("train", "prepare"):
        raise SpecheadsError(f"-- COMMAND: {command[0]!r} is not train or prepare (write e.g. `-- train "
                             f"train.max_steps=100`; the launch: settings come from the recipe)")
    if "--config" not in command and not any(c.startswith("--config=") for c in command):
        command[1:1] = ["--config", args.config]
    if args.node_rank is None and cfg.num_machines > 1:
        raise SpecheadsError(f"--node-rank: needed, launch.num_machines is {cfg.num_machines} (0 on the main node)")
    rank = args.node_rank or 0
    argv, env = accelerate_argv(cfg, rank, args.main_ip, recipe.train.mixed_precision, command)
    shown = " ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + shlex.join(argv)
    if args.dry_run:
        print(shown, flush=True)
        return 0
    ip = args.main_ip or cfg.main_process_ip
    if cfg.num_machines > 1 and rank == 0:
        check_port_free(cfg.main_process_port)
    elif cfg.num_machines > 1:
        waited = wait_for_main(ip, cfg.main_process_port, cfg.timeout_s)
        log.info("node %d: the main node answers at %s:%d (after %.0f s)", rank, ip, cfg.main_process_port, waited)
    log.info("node %d of %d: %s", rank, cfg.num_machines, shown)
    os.environ.update(env)
    os.execv(argv[0], argv)  # accelerate's launcher replaces this process (its exit status is the node's)
    return 0  # not reached
