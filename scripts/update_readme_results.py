#!/usr/bin/env python3
"""Copy a `specheads bench` run into the docs and its figures into the results pages, never typed by hand.

    python scripts/update_readme_results.py RUN_DIR [DOCS_DIR] [--headline]

- copies RUN_DIR's results.json, results.md and PNG plots into DOCS_DIR (default docs/results/demo);
- writes the run's block (its command, machine, date and every table of its results.md) into docs/results/README.md
  between `<!-- results:NAME:start -->` and `<!-- results:NAME:end -->`, NAME = DOCS_DIR's folder name (a section
  is appended when the page has none yet);
- with --headline, also writes its main table into README.md's `<!-- results:headline:... -->` block.
Both blocks are rendered from DOCS_DIR alone (`render_block`, `render_headline`), so a test can check that the
README and the results page hold exactly what the results files say. RUN_DIR may be DOCS_DIR itself (re-render).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS_PAGE = ROOT / "docs" / "results" / "README.md"
HEADLINE = "headline"


def _results(docs: Path) -> tuple[dict, list[str]]:
    return json.loads((docs / "results.json").read_text()), (docs / "results.md").read_text().strip().splitlines()


def _provenance(res: dict, docs: Path) -> str:
    env = res.get("environment", {})
    return (f"Produced by `{res['command']}` on {res['date'][:10]} ({env.get('cpu') or 'unknown CPU'}, "
            f"torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}); figures from "
            f"`{_rel(docs / 'results.md', ROOT)}`, copied by `scripts/update_readme_results.py`.")


def _rel(path: Path, start: Path) -> str:
    return os.path.relpath(Path(path).resolve(), Path(start).resolve())


def render_block(docs: Path, page: Path = RESULTS_PAGE) -> str:
    """The results page's block for one run: provenance, then results.md without its title and definitions
    (the page states them once), sections nested under the page's own, and the plots."""
    res, lines = _results(docs)
    body = ["#" + line if line.startswith("## ") else line for line in lines
            if not line.startswith("# ") and not line.startswith("Definitions: ")]
    while body and not body[0].strip():
        body.pop(0)
    while body and not body[-1].strip():
        body.pop()
    plots = [f"![{Path(p).stem}]({_rel(docs / Path(p).name, page.parent)})" for p in res.get("plots", [])]
    return "\n".join(["", _provenance(res, docs), ""] + body + [""] + plots)


def render_headline(docs: Path, readme: Path = README, page: Path = RESULTS_PAGE) -> str:
    """README's headline: the settings line and the main table of results.md, with provenance and a link to the
    run's full block."""
    res, lines = _results(docs)
    start = next(i for i, line in enumerate(lines) if line.startswith("| method |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    settings = next(line for line in lines if line and not line.startswith(("#", "|")))
    link = f"{_rel(page, readme.parent)}#{docs.name}"
    return "\n".join(["", _provenance(res, docs), "", settings, ""] + lines[start:end] +
                     ["", f"Per category, per phase, the tree chosen and why: [{docs.name}]({link})."])


def replace_block(name: str, body: str, path: Path = RESULTS_PAGE, append_title: str | None = None) -> bool:
    """Put `body` between `<!-- results:NAME:start -->` and `<!-- results:NAME:end -->` in `path`; without the
    markers, append a section titled `append_title` holding them (None: report and fail)."""
    start, end = f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->"
    text = path.read_text()
    if start not in text or end not in text:
        if append_title is None:
            print(f"{path} has no {start} / {end} markers", file=sys.stderr)
            return False
        text = f"{text.rstrip()}\n\n## {append_title}\n\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{body}\n{end}{tail}")
    return True


def copy_run(out: Path, docs: Path) -> None:
    res = json.loads((out / "results.json").read_text())
    docs.mkdir(parents=True, exist_ok=True)
    for name in ["results.json", "results.md"] + [Path(p).name for p in res.get("plots", [])]:
        if (out / name).resolve() != (docs / name).resolve():
            shutil.copy(out / name, docs / name)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a `specheads bench --out` folder")
    ap.add_argument("docs", type=Path, nargs="?", default=Path("docs/results/demo"))
    ap.add_argument("--headline", action="store_true", help="also make it README.md's headline table")
    a = ap.parse_args(argv)
    copy_run(a.run, a.docs)
    if not replace_block(a.docs.name, render_block(a.docs, RESULTS_PAGE), RESULTS_PAGE, append_title=a.docs.name):
        return 2
    print(f"{RESULTS_PAGE}: block {a.docs.name} written from {a.docs}")
    if a.headline:
        if not replace_block(HEADLINE, render_headline(a.docs, README, RESULTS_PAGE), README):
            return 2
        print(f"{README}: headline written from {a.docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
