"""Reliability sweep, round four (issue 52 point 1): regeneration from a serving engine (data.regen_endpoint): an
endpoint that is not a URL, nothing listening, a server that returns text only, a server that dies mid-run and the
rerun that resumes.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace. The servers are
tests/fake_openai.py's (an OpenAI-compatible server in a thread on 127.0.0.1: nothing timed, nothing downloaded).
"""
from __future__ import annotations

import contextlib
import json
import socket
from typing import Callable

from reliability_cli import run_in_process  # scripts/ is on sys.path (the sweep puts it there)
from tests.fake_openai import FakeOpenAI  # ROOT is on sys.path

REGEN = ["data.regenerate=true", "data.regen_max_new_tokens=4", "data.regen_retries=0"]


def _tokenizer(ctx):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ctx.vars["target"])


def _server(**kw) -> Callable:
    """setup: a fake server bound (its URL in {endpoint}); `_serving` runs it while the CLI runs."""
    def setup(ctx) -> None:
        ctx.server = FakeOpenAI(_tokenizer(ctx), **kw)
        ctx.vars["endpoint"] = ctx.server.url
    return setup


@contextlib.contextmanager
def _serving(ctx):
    with ctx.server:
        yield


def _closed_port(ctx) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ctx.vars["endpoint"] = f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def _rows(ctx) -> list[dict]:
    path = ctx.tmp / "run" / "data" / "regenerated.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _no_rows(ctx) -> str:
    assert not _rows(ctx), "rows written although no server answered"
    return "no regenerated row written; the source is untouched"


def _retokenized(ctx) -> str:
    rows = _rows(ctx)
    assert rows and all(r["regenerated_by"]["token_ids"] == "retokenized" for r in rows), rows[:1]
    s = json.loads((ctx.tmp / "run" / "prepare_summary.json").read_text())
    assert s["regenerate_endpoint"]["url"] == ctx.vars["endpoint"], s.get("regenerate_endpoint")
    return f"{len(rows)} rows say regenerated_by.token_ids: retokenized; prepare_summary.json names the endpoint"


def _dies_then_resumes(ctx, argv: list[str]) -> tuple[int, str, str]:
    """The server fails after 3 answers (prepare stops with its error), then serves again: the rerun finishes
    from the rows kept. Returns the first run's outcome; the check compares the rerun with one uninterrupted."""
    with ctx.server:
        rc, out, err = run_in_process(argv)
        ctx.kept = len(_rows(ctx))
        ctx.server.fail_after = None
        ctx.rerun = run_in_process(argv)[0]
        ctx.resumed = (ctx.tmp / "run" / "data" / "regenerated.jsonl").read_bytes()
        ctx.whole = run_in_process([a.replace(ctx.vars["run"], ctx.vars["run"] + "-whole") for a in argv])[0]
    return rc, out, err


def _resumed_equals_whole(ctx) -> str:
    whole = (ctx.tmp / "run-whole" / "data" / "regenerated.jsonl").read_bytes()
    assert ctx.rerun == 0 and ctx.whole == 0, (ctx.rerun, ctx.whole)
    assert 0 < ctx.kept and ctx.resumed == whole, "the resumed file differs from an uninterrupted run's"
    return f"{ctx.kept} rows kept by the failed run; the rerun's file equals an uninterrupted run's, byte for byte"


def cases(h) -> list[dict]:
    prep = h.PREPARE
    return [
        {"area": "endpoint", "risk": "unclear", "name": "data.regen_endpoint is not an http URL",
         "argv": prep + REGEN + ["data.regen_endpoint=localhost:8080"], "rc": 2,
         "expect": "data.regen_endpoint: expected an http(s) URL", "check": h.nothing_written},
        {"area": "endpoint", "risk": "traceback", "name": "data.regen_endpoint: nothing listening there",
         "setup": _closed_port, "argv": prep + REGEN + ["data.regen_endpoint={endpoint}", "data.regen_retries=1"],
         "rc": 2, "expect": "no answer after 2 tries", "check": _no_rows},
        {"area": "endpoint", "risk": "silent wrong result", "name": "data.regen_endpoint: a server that returns text only",
         "setup": _server(ids="text"), "during": _serving, "argv": prep + REGEN + ["data.regen_endpoint={endpoint}"],
         "rc": 0, "expect": "conversations read", "check": _retokenized},
        {"area": "endpoint", "risk": "data loss", "name": "data.regen_endpoint: the server fails mid-run, then the rerun",
         "setup": _server(fail_after=3), "run": _dies_then_resumes,
         "argv": prep + REGEN + ["data.regen_endpoint={endpoint}", "data.regen_batch_size=1"], "rc": 2,
         "expect": "no answer after 1 try", "check": _resumed_equals_whole},
    ]
