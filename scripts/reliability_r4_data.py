"""Reliability sweep, round four (issue 52 point 4): agentic data and several sources: a malformed tool call,
data.source beside data.sources, template variables that are not a mapping, a weighted mix of two files.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.
"""
from __future__ import annotations

import json
from typing import Callable

BAD_CALL = {"id": "bad", "messages": [{"role": "user", "content": "Weather?"},
                                      {"role": "assistant", "content": None,
                                       "tool_calls": [{"type": "function", "function": {"arguments": "{oops"}}]}]}


def _openai_rows(h, n: int) -> list[dict]:
    """The fixture's conversations as OpenAI messages rows (what a tool-call file holds)."""
    role = {"human": "user", "gpt": "assistant"}
    return [{"id": c["id"], "messages": [{"role": role[t["from"]], "content": t["value"]} for t in c["conversations"]]}
            for c in h.conversations(n, seed="t")]


def _tool_file(h) -> Callable:
    def setup(ctx) -> None:
        rows = _openai_rows(h, 8) + [BAD_CALL]
        (ctx.tmp / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return setup


def _skipped_and_counted(ctx) -> str:
    s = json.loads((ctx.tmp / "run" / "prepare_summary.json").read_text())
    assert s["skip_reasons"] == {"bad tool_calls": 1}, s["skip_reasons"]
    assert s["conversations_kept"] == 8, s["conversations_kept"]
    return "the 8 good rows prepared; the bad one counted under skip_reasons"


def _two_files(h) -> Callable:
    def setup(ctx) -> None:
        for name, seed in (("a", "a"), ("b", "b")):
            rows = [dict(c, id=f"{seed}{i}") for i, c in enumerate(h.conversations(8, seed=seed))]
            (ctx.tmp / f"{name}.json").write_text(json.dumps(rows))
    return setup


def _mix_recorded(ctx) -> str:
    s = json.loads((ctx.tmp / "run" / "prepare_summary.json").read_text())
    mix = {r["name"]: r["in_mix"] for r in s["sources"]}
    assert mix == {"a": 8, "b": 4}, mix
    assert s["conversations_kept"] == 12, s["conversations_kept"]
    return "prepare_summary.json sources: a 8, b 4 (weight 0.5)"


def cases(h) -> list[dict]:
    data = h.PREPARE
    return [
        {"area": "data", "risk": "silent wrong result", "name": "a malformed tool_calls row in data.source",
         "setup": _tool_file(h), "argv": data + ["data.source={tmp}/tools.jsonl"], "rc": 0,
         "expect": "{'bad tool_calls': 1}", "check": _skipped_and_counted},
        {"area": "data", "risk": "silent wrong result", "name": "data.source and data.sources both given",
         "setup": _two_files(h), "argv": data + ["data.sources=[{{source: {tmp}/a.json}}]"], "rc": 2,
         "expect": "data.source and data.sources: both given", "check": h.nothing_written},
        {"area": "data", "risk": "unclear", "name": "data.chat_template_kwargs not a mapping",
         "argv": data + ["data.chat_template_kwargs=enable_thinking"], "rc": 2,
         "expect": "data.chat_template_kwargs=enable_thinking': expected a mapping"},
        {"area": "data", "risk": "unclear", "name": "data.chat_template_kwargs names apply_chat_template's own tools",
         "argv": data + ["data.chat_template_kwargs={{tools: []}}"], "rc": 2,
         "expect": "data.chat_template_kwargs: 'tools' is not a template variable"},
        {"area": "data", "risk": "silent wrong result", "name": "data.sources: two files, one at weight 0.5",
         "setup": _two_files(h), "argv": data + ["data.source=null", "data.sources=[{{source: {tmp}/a.json}}, "
                                                  "{{source: {tmp}/b.json, weight: 0.5}}]"], "rc": 0,
         "expect": "conversations read", "check": _mix_recorded},
    ]
