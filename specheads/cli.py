"""`specheads <command>`: a thin dispatcher. Each command lives in `specheads/commands/<name>.py` and defines
`add_arguments(parser)` and `run(args) -> int`; library code below it logs and never parses argv."""
from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading
from pathlib import Path

from specheads import __version__
from specheads.utils import Interrupted, SpecheadsError, errno_text, os_error_of, setup_logging

COMMANDS = {
    "prepare": "conversations -> chat-templated tokens + assistant masks -> target features (offline shards)",
    "train": "fit draft heads on a frozen target (accelerate / DDP / DeepSpeed)",
    "export": "write a head folder in another layout (eagle, eagle3, speculators, medusa-vllm) or import one",
    "generate": "speculative generation with a head (or a training-free drafter), streamed",
    "bench": "tokens/s, accepted length and speedup against plain decoding and peers, in one run",
    "launch": "run train (or prepare) on this node of the recipe's launch: topology, through accelerate launch",
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


def _terminated(signum, frame):
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    # SIGTERM unwinds as Ctrl-C does (locks released, temporaries removed, one line) instead of ending the process
    # where it stands; training turns both into a checkpoint first (train/stopping.py)
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _run(args)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args._run(args) or 0)
    except SpecheadsError as e:
        print(f"specheads {args.command}: error: {e}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:  # a file we read as text is not UTF-8 (a dataset, a prompt file, ...)
        print(f"specheads {args.command}: error: {_not_utf8(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the OS refusing a write (full disk, read-only, ...) is one line too
        oe = os_error_of(e)
        if oe is None:
            raise
        safetensors = not isinstance(e, OSError)
        where = str(oe.filename or ("a safetensors file (its writer did not say which)" if safetensors else
                                    "a file whose name the failing write did not give"))
        if ".tmp-" in Path(where).name:  # a temporary name (mkstemp's): the folder it was being written in
            where = f"{Path(where).parent} (a temporary file there)"
        print(f"specheads {args.command}: error: {where}: cannot write: {errno_text(oe)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Interrupted); what was kept is in its detail
        signum = getattr(e, "signum", signal.SIGINT)
        detail = getattr(e, "detail", "")
        print(f"specheads {args.command}: interrupted ({signal.Signals(signum).name})" + (f": {detail}" if detail
              else ""), file=sys.stderr)
        return 128 + signum


def _not_utf8(e: UnicodeDecodeError) -> str:
    """'<file>: not UTF-8 text: line N has byte 0xff (invalid start byte)': the file is the one the failing read
    was reading (the open text file in the innermost frame that holds one), the line found by decoding it again."""
    import io

    tb, name = e.__traceback__, None
    while tb is not None:
        for v in tb.tb_frame.f_locals.values():
            if isinstance(v, io.TextIOWrapper) and isinstance(getattr(v, "name", None), str):
                name = v.name
            elif isinstance(v, io.TextIOWrapper) and isinstance(getattr(v.buffer, "name", None), str):
                name = v.buffer.name  # gzip.open(path) under a TextIOWrapper
        tb = tb.tb_next
    bad = e.object[e.start:e.start + 1].hex() if isinstance(e.object, bytes) else "?"
    what = f"byte 0x{bad} ({e.reason})"
    if name is None:
        return f"a file read as text is not UTF-8: {what}"
    try:
        import gzip

        data = (gzip.open if name.endswith(".gz") else open)(name, "rb").read()
        data.decode("utf-8")
    except UnicodeDecodeError as again:
        line = data.count(b"\n", 0, again.start) + 1
        row = f" (row {line - 1})" if name.endswith((".jsonl", ".jsonl.gz")) else ""
        return f"{name}: not UTF-8 text: line {line}{row} has {what}"
    except OSError:
        pass
    return f"{name}: not UTF-8 text: {what}"


if __name__ == "__main__":
    raise SystemExit(main())
