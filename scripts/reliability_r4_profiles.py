"""Reliability sweep, round four (issue 49): cached cost profiles damaged or edited by hand.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.

Each case writes a clean profile of the sweep's tiny target (made from scripted timings: nothing is timed to make
it) into a cache of its own ({tmp}/cache, SPECHEADS_CACHE) at the path the CLI reads (profile.profile_path of the
target as generate and bench load it), damages it, and runs the real CLI in this process with the specheads logger
captured (the sweep's own handler discards logging): the damage is named in exactly one line, the profile measured
again and written in place, and the command ends 0.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

GEN = ["generate", "--target", "{target}", "--head", "{head}", "--prompt", "hi", "--max-new-tokens", "2"]
LOOKUP = GEN + ["--tree", "2,2,4", "--lookup", "2"]  # the per-step scheduler: Scheduler.for_target
AUTO = GEN + ["--tree", "auto"]  # --tree auto: autotree.choose_tree_for_head
BATCH = ["bench", "--target", "{target}", "--head", "{head}", "--dataset", "mt-bench", "--limit", "2",
         "--max-new-tokens", "4", "--warmup-tokens", "0", "--batch-sizes", "2", "--methods", "head+sched",
         "--tree", "2,2,4", "--out", "{tmp}/bench"]  # +sched's batch budget: costs.batch_cost_fn
BATCH_GRID = ((1, 2), (1, 2, 4))  # the batch profile's rows x tokens in these cases (the default 5 x 5 grid at 384
# cached tokens measures for minutes on a shared 2-core machine; the reading path is the same)

_NAMES: dict[str, tuple[str, int]] = {}  # fixture base -> (the verify profile's file name, its clipped context)


def _profile_name(ctx) -> tuple[str, int]:
    """The file name of the sweep target's verify profile (machine key included) and its profiling context, as the
    CLI's load_target gives them (computed once per sweep)."""
    if str(ctx.base) not in _NAMES:
        from specheads.infer.scheduling import profile
        from specheads.target import load_target

        t = load_target(ctx.vars["target"], dtype="float32")
        _NAMES[str(ctx.base)] = (Path(profile.profile_path(t, t.dtype)).name,
                                 profile._clip_context(t, profile.PROFILE_CONTEXT, profile.PROFILE_SIZES))
    return _NAMES[str(ctx.base)]


def _clean(kind: str, context: int) -> dict[str, Any]:
    """A clean profile of `kind` (verify or batch) from scripted timings (1 ms plus 0.1 ms a token)."""
    from specheads.infer.scheduling import profile

    def time_cell(cell) -> float:
        b, n = cell if isinstance(cell, tuple) else (1, cell)
        return 1e-3 * (1 + 0.1 * b * n)

    if kind == "verify":
        part = profile.verify_from_timings(profile.PROFILE_SIZES, profile.PROFILE_REPEATS, context, time_cell)
        return {"version": profile.PROFILE_VERSION, "verify": part, "noisy": False, "noise": ""}
    part = profile.batch_from_timings(*BATCH_GRID, profile.PROFILE_REPEATS, context, time_cell)
    return {"version": profile.BATCH_PROFILE_VERSION, "kind": "batch", "batch": part, "noisy": False, "noise": ""}


def damaged(h, kind: str, edit: Callable[[dict], Any] | bytes) -> Callable:
    """setup: the head (h.head), and a clean `kind` profile at the CLI's path in {tmp}/cache, damaged by `edit` (a
    change to the parsed profile, or the bytes the file becomes)."""
    def setup(ctx) -> None:
        h.head(ctx)
        name, context = _profile_name(ctx)
        if kind == "batch":
            name = name.removesuffix(".json") + "-batch.json"
        path = ctx.tmp / "cache" / "profiles" / name
        path.parent.mkdir(parents=True)
        if isinstance(edit, bytes):
            path.write_bytes(edit)
        else:
            prof = _clean(kind, context)
            edit(prof)
            path.write_text(json.dumps(prof))
        ctx.vars["profile"], ctx.vars["kind"], ctx.vars["context"] = str(path), kind, str(context)
        ctx.vars["damaged"] = path.read_text(errors="replace")
    return setup


@contextlib.contextmanager
def _own_cache(ctx):
    """SPECHEADS_CACHE = {tmp}/cache, the batch grid of BATCH_GRID, and one profile warning per fault (the
    process-wide memory of named faults starts empty: earlier cases named files of their own)."""
    from specheads.infer.scheduling import profile

    old = os.environ.get("SPECHEADS_CACHE"), profile.BATCH_ROWS, profile.BATCH_TOKENS
    os.environ["SPECHEADS_CACHE"] = str(ctx.tmp / "cache")
    profile.BATCH_ROWS, profile.BATCH_TOKENS = BATCH_GRID
    profile._WARNED.clear()
    try:
        yield
    finally:
        profile.BATCH_ROWS, profile.BATCH_TOKENS = old[1], old[2]
        if old[0] is None:
            os.environ.pop("SPECHEADS_CACHE", None)
        else:
            os.environ["SPECHEADS_CACHE"] = old[0]


def run_logged(ctx, argv: list[str]) -> tuple[int, str, str]:
    """specheads.cli.main(argv) in this process, in the case's own cache, its warnings captured (ctx.log) and put
    after stderr: (exit code, stdout, stderr), the profile's file name written <profile>.json."""
    from reliability_cli import run_in_process  # scripts/ is on sys.path (the sweep puts it there)

    log = io.StringIO()
    handler = logging.StreamHandler(log)
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("specheads")
    logger.addHandler(handler)
    try:
        with _own_cache(ctx):
            rc, out, err = run_in_process(argv)
    finally:
        logger.removeHandler(handler)
    ctx.log = log.getvalue()
    # the file's name holds the sweep's random folder (the target's name is its path): one stable name recorded
    name = Path(ctx.vars["profile"]).name
    return rc, out, (err + ctx.log).replace(name, "<profile>.json")


def named_once_and_measured_again(ctx) -> str:
    """The damaged file named in exactly one line; the file measured again and written in place, readable."""
    from specheads.infer.scheduling import profile
    from specheads.infer.scheduling.profile_check import (DAMAGED, check_batch_profile, check_verify_profile,
                                                          read_profile)

    path = ctx.vars["profile"]
    lines = [ln for ln in ctx.log.splitlines() if f"cost profile {path}:" in ln]
    assert len(lines) == 1, f"{len(lines)} lines name the profile: {lines}"
    text = Path(path).read_text(errors="replace")
    assert text != ctx.vars["damaged"], "the damaged profile was not written again"
    prof, why = read_profile(path)
    assert not why, why
    context = int(ctx.vars["context"])
    if ctx.vars["kind"] == "verify":
        verdict = check_verify_profile(prof, profile.PROFILE_SIZES, context, profile.PROFILE_VERSION)
    else:
        verdict = check_batch_profile(prof, *BATCH_GRID, context, profile.BATCH_PROFILE_VERSION)
    assert verdict[0] != DAMAGED, verdict  # clean, or noisy (never trusted) where the machine was busy
    return "named in one line; measured again and written in place"


def _set(*path) -> Callable[[dict], None]:
    """An edit setting prof[path[0]][path[1]]... to path[-1]."""
    *keys, value = path

    def edit(prof: dict) -> None:
        d = prof
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return edit


def _both(*edits: Callable[[dict], None]) -> Callable[[dict], None]:
    def edit(prof: dict) -> None:
        for e in edits:
            e(prof)
    return edit


def _drop_size(prof: dict) -> None:
    del prof["verify"]["relative"]["8"]


def cases(h) -> list[dict]:
    rows = [
        ("one-token forward of 0 s in the cost profile (the scheduler)", "verify", _set("verify", "seconds", "1", 0),
         LOOKUP, "verify.seconds['1'] is 0", "traceback"),
        ("negative and NaN costs in the cost profile (the scheduler)", "verify",
         _both(_set("verify", "relative", "4", -1.0), _set("verify", "relative", "8", float("nan"))), LOOKUP,
         "verify.relative['4'] is -1.0", "silent wrong result"),
        ("costs written as strings in the cost profile (the scheduler)", "verify",
         _set("verify", "relative", "2", "1.1"), LOOKUP, "verify.relative['2'] is \"1.1\"", "traceback"),
        ("cost profile that is a JSON list (the scheduler)", "verify", b"[1.0, 1.1, 1.2]", LOOKUP,
         "is a JSON list, not an object", "traceback"),
        ("cost profile that is not JSON (--tree auto)", "verify", b'{"version": 5, "verify": {"relative": ', AUTO,
         "not valid JSON", "unclear"),
        ("cost profile without its verify part (--tree auto)", "verify", lambda p: p.pop("verify"), AUTO,
         "has no 'verify'", "traceback"),
        ("cost profile with a size missing from its costs (--tree auto)", "verify", _drop_size, AUTO,
         "(expected the same)", "unclear"),
        ("batch cost profile with a zero and a null cell (bench --batch-sizes +sched)", "batch",
         _both(_set("batch", "relative", "2", "2", 0), _set("batch", "seconds", "1", "4", None)), BATCH,
         "batch.seconds['1']['4'] is null", "silent wrong result"),
    ]
    return [{"area": "profiles", "name": name, "risk": risk, "setup": damaged(h, kind, edit), "argv": argv, "rc": 0,
             "expect": expect, "run": run_logged, "check": named_once_and_measured_again}
            for name, kind, edit, argv, expect, risk in rows]
