#!/usr/bin/env python3
"""Moved: `specheads eval --head DIR [--dataset mt-bench|sharegpt:START|FILE.jsonl] [--limit N] ...`."""
import sys

from specheads.cli import main

raise SystemExit(main(["eval", *sys.argv[1:]]))
