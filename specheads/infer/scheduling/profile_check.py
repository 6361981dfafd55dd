"""Whether a cached cost profile (profile.py) may be read: every field its readers use (costs.relative_costs,
t1_seconds, interp_cost, batch_cost_fn; step.py, autotree.py, resolve.py, skipsearch.py, bench/batch.py) is there,
of the right type, finite, positive, within plausible bounds and non-decreasing where the readers assume it. A
profile edited by hand or damaged on disk is named in one line and measured again; one measured for other settings
(another version, other sizes, another context, a busy machine) is measured again quietly. Pure checks on the
parsed JSON: no model, no timing.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

from specheads.utils import SpecheadsError, errno_text, read_text_bounded

MAX_SECONDS = 600.0  # one forward slower than this is no measurement (a large target on CPU: seconds)
MAX_COST_PER_TOKEN = 64.0  # relative t(n)/t(1) above 64 n (a batch cell below 1/64) is no forward's cost: a
# forward of n tokens does at most n tokens' work plus the one-token forward's fixed part, and even a forward slowed
# by other work rarely takes 10x (relative_raw, read by nobody, need only be finite and > 0)
ROUNDING = 1e-6  # relative[1] == 1 and non-decreasing, within the rounding of a float written as JSON

OK, STALE, DAMAGED = "", "stale", "damaged"  # the verdicts: usable; measured for other settings; not readable


def read_profile(path: str | os.PathLike) -> tuple[Any, str]:
    """(the parsed JSON, "") or (None, what is wrong): a file that cannot be read or is not JSON."""
    try:
        text = read_text_bounded(path)
    except SpecheadsError as e:  # not UTF-8, or endless
        return None, str(e).removeprefix(f"{path}: ")
    except OSError as e:
        return None, f"cannot be read ({errno_text(e)})"
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as e:
        return None, f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
    except RecursionError:
        return None, "nested too deeply to be a profile"


def _show(x: Any) -> str:
    text = json.dumps(x) if not isinstance(x, float) or math.isfinite(x) else str(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int_keys(field: str, d: Any) -> tuple[list[int] | None, str]:
    """The sorted sizes of an object keyed by sizes ("1", "2", ...), or what is wrong with it."""
    if not isinstance(d, dict) or not d:
        return None, f"{field} is {_show(d)} (expected an object of sizes)"
    bad = [k for k in d if not (k.isdigit() and k == str(int(k)) and int(k) >= 1)]  # "01" is no key a reader finds
    if bad:
        return None, f"{field} has the key {_show(bad[0])} (expected sizes 1, 2, ...)"
    return sorted(int(k) for k in d), ""


def _value(field: str, v: Any, low: float, high: float) -> str:
    """"" when v is a finite number in [low, high] (low 0: > 0), else what is wrong."""
    if not _is_number(v) or not low <= v <= high or v <= 0:
        span = f"from {round(low, 4):g} to {high:g}" if low >= 1e-3 else "> 0" if high == math.inf else \
            f"> 0 and at most {high:g}"
        return f"{field} is {_show(v)} (expected a finite number {span})"
    return ""


def _head(prof: Any, version: int, part: str) -> tuple[str, str]:
    """The checks both profiles share: an object, its version, its `part` an object, its context, its noise flag."""
    if not isinstance(prof, dict):
        return DAMAGED, f"is a JSON {type(prof).__name__ if prof is not None else 'null'}, not an object"
    if "version" not in prof:
        return DAMAGED, "has no 'version'"
    if not _is_int(prof["version"]):
        return DAMAGED, f"version is {_show(prof['version'])} (expected a whole number)"
    if prof["version"] != version:
        return STALE, f"version {prof['version']} (this specheads measures version {version})"
    if part not in prof:
        return DAMAGED, f"has no '{part}'"
    if not isinstance(prof[part], dict):
        return DAMAGED, f"{part} is {_show(prof[part])} (expected an object)"
    if not _is_int(prof[part].get("context")) or prof[part]["context"] < 0:
        return DAMAGED, f"{part}.context is {_show(prof[part].get('context'))} (expected a whole number of tokens)"
    if not isinstance(prof.get("noisy", False), bool):
        return DAMAGED, f"noisy is {_show(prof['noisy'])} (expected true or false)"
    return OK, ""


def check_verify_profile(prof: Any, sizes: Sequence[int], context: int, version: int) -> tuple[str, str]:
    """(verdict, why) of a cached verification profile for `sizes` (tree nodes) over `context` cached tokens:
    OK (""), STALE (measured for other settings) or DAMAGED (a field its readers use is missing or wrong)."""
    verdict, why = _head(prof, version, "verify")
    if verdict:
        return verdict, why
    v = prof["verify"]
    keys = {}
    for name in ("relative", "seconds", "relative_raw"):
        keys[name], why = _int_keys(f"verify.{name}", v.get(name))
        if why:
            return DAMAGED, why
    if not keys["relative"] == keys["seconds"] == keys["relative_raw"]:
        return DAMAGED, (f"verify.relative has sizes {keys['relative']}, verify.seconds {keys['seconds']}, "
                         f"verify.relative_raw {keys['relative_raw']} (expected the same)")
    if keys["relative"] != sorted(sizes) or v["context"] != context:
        return STALE, f"measured for sizes {keys['relative']} over {v['context']} tokens"
    if prof.get("noisy"):
        return STALE, "measured while other work shared the machine"
    return _verify_values(v, sorted(sizes))


def _verify_values(v: dict, sizes: list[int]) -> tuple[str, str]:
    rel, prev = v["relative"], None
    for n in sizes:
        why = (_value(f"verify.relative['{n}']", rel[str(n)], 1 - ROUNDING, MAX_COST_PER_TOKEN * n)
               or _value(f"verify.relative_raw['{n}']", v["relative_raw"][str(n)], 0.0, math.inf)
               or _value(f"verify.seconds['{n}']", v["seconds"][str(n)], 0.0, MAX_SECONDS))
        if why:
            return DAMAGED, why
        if prev is not None and rel[str(n)] < rel[str(prev)] - ROUNDING:
            return DAMAGED, (f"verify.relative['{n}'] = {rel[str(n)]:g} is below verify.relative['{prev}'] = "
                             f"{rel[str(prev)]:g} (a forward of more nodes never costs less)")
        prev = n
    if abs(rel[str(sizes[0])] - 1) > ROUNDING:
        return DAMAGED, f"verify.relative['{sizes[0]}'] is {_show(rel[str(sizes[0])])} (expected 1: t(1)/t(1))"
    return OK, ""


def check_batch_profile(prof: Any, rows: Sequence[int], tokens: Sequence[int], context: int,
                        version: int) -> tuple[str, str]:
    """(verdict, why) of a cached batch profile for `rows` x `tokens` over `context` cached tokens a row, as
    check_verify_profile."""
    verdict, why = _head(prof, version, "batch")
    if verdict:
        return verdict, why
    b = prof["batch"]
    for name in ("rows", "tokens"):
        if not isinstance(b.get(name), list) or not b[name] or not all(_is_int(x) and x >= 1 for x in b[name]):
            return DAMAGED, f"batch.{name} is {_show(b.get(name))} (expected a list of whole numbers >= 1)"
    if b["rows"] != sorted(set(b["rows"])) or b["tokens"] != sorted(set(b["tokens"])):
        return DAMAGED, f"batch.rows {b['rows']} / batch.tokens {b['tokens']} (expected ascending, each once)"
    for name in ("relative", "seconds", "relative_raw"):
        why = _grid_keys(f"batch.{name}", b.get(name), b["rows"], b["tokens"])
        if why:
            return DAMAGED, why
    if b["rows"] != list(rows) or b["tokens"] != list(tokens) or b["context"] != context:
        return STALE, f"measured for rows {b['rows']} x tokens {b['tokens']} over {b['context']} tokens"
    if prof.get("noisy"):
        return STALE, "measured while other work shared the machine"
    return _batch_values(b)


def _grid_keys(field: str, d: Any, rows: list[int], tokens: list[int]) -> str:
    want = {str(B) for B in rows}
    if not isinstance(d, dict) or set(d) != want:
        return f"{field} is {_show(d)} (expected an object of the rows {rows})"
    for B in rows:
        if not isinstance(d[str(B)], dict) or set(d[str(B)]) != {str(n) for n in tokens}:
            return f"{field}['{B}'] is {_show(d[str(B)])} (expected an object of the tokens {tokens})"
    return ""


def _batch_values(b: dict) -> tuple[str, str]:
    rows, tokens, rel = b["rows"], b["tokens"], b["relative"]
    for B in rows:
        for n in tokens:
            at = f"['{B}']['{n}']"
            high = MAX_COST_PER_TOKEN * B * n
            why = (_value(f"batch.relative{at}", rel[str(B)][str(n)], 1 / MAX_COST_PER_TOKEN, high)
                   or _value(f"batch.relative_raw{at}", b["relative_raw"][str(B)][str(n)], 0.0, math.inf)
                   or _value(f"batch.seconds{at}", b["seconds"][str(B)][str(n)], 0.0, MAX_SECONDS))
            if why:
                return DAMAGED, why
    for B, B2 in zip(rows, rows[1:]):
        for n in tokens:
            if rel[str(B2)][str(n)] < rel[str(B)][str(n)] - ROUNDING:
                return DAMAGED, (f"batch.relative['{B2}']['{n}'] is below batch.relative['{B}']['{n}'] (more rows "
                                 "never cost less)")
    for B in rows:
        for n, n2 in zip(tokens, tokens[1:]):
            if rel[str(B)][str(n2)] < rel[str(B)][str(n)] - ROUNDING:
                return DAMAGED, (f"batch.relative['{B}']['{n2}'] is below batch.relative['{B}']['{n}'] (more "
                                 "tokens never cost less)")
    if 1 in rows and 1 in tokens and abs(rel["1"]["1"] - 1) > ROUNDING:
        return DAMAGED, f"batch.relative['1']['1'] is {_show(rel['1']['1'])} (expected 1: t(1, 1)/t(1, 1))"
    return OK, ""
