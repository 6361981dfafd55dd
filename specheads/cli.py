"""`specheads <command>`: a thin dispatcher. Each command lives in `specheads/commands/<name>.py` and defines
`add_arguments(parser)` and `run(args) -> int`; library code below it logs and never parses argv."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from specheads import __version__
from specheads.utils import SpecheadsError, setup_logging

COMMANDS = {
    "prepare": "conversations -> chat-templated tokens + assistant masks -> target features (offline shards)",
    "train": "fit draft heads on a frozen target (accelerate / DDP / DeepSpeed)",
    "export": "write a head folder in another layout (eagle, eagle3, speculators, medusa-vllm) or import one",
    "generate": "speculative generation with a head (or a training-free drafter), streamed",
    "bench": "tokens/s, accepted length and speedup against plain decoding and peers, in one run",
    "eval": "teacher-forced top-k and simulated accepted length of a head on the target's answers to a dataset",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specheads", description="Train, export and run speculative draft heads.")
    parser.add_argument("--version", action="version", version=f"specheads {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(f"specheads.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"specheads.commands.{name}":
                raise
            p.set_defaults(_run=lambda a, n=name: _not_built(n))
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _not_built(name: str) -> int:
    print(f"specheads {name}: not available in this build", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return int(args._run(args) or 0)
    except SpecheadsError as e:
        print(f"specheads {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specheads {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
