"""Reliability sweep, round four (issue 49): SIGTERM / SIGINT in prepare, train, export, eval, bench; batched regeneration killed and resumed.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.
"""
from __future__ import annotations


def cases(h) -> list[dict]:
    return []
