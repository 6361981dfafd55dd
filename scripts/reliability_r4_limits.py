"""Reliability sweep, round four (issue 49): limits met mid-run: context window, trees and batches over the engine's buckets, cache length.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.
"""
from __future__ import annotations


def cases(h) -> list[dict]:
    return []
