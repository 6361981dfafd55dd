#!/usr/bin/env python3
"""Copy a `specheads bench` results.md (and its command line) into README.md between named results markers.

    python scripts/update_readme_results.py runs/demo/bench [docs/results/demo]

It also copies results.json, results.md and the PNG plots into the docs folder (second argument) so that the
README's plots render and the figures it shows stay next to the file they came from.

The README's numbers are never typed by hand: they come from the results.json/results.md this reads.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path



def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__)
        return 2
    out = Path(argv[0])
    docs = Path(argv[1] if len(argv) == 2 else "docs/results/demo")
    docs.mkdir(parents=True, exist_ok=True)
    # README markers are named after the docs folder: <!-- results:demo:start --> ... <!-- results:demo:end -->
    START, END = f"<!-- results:{docs.name}:start -->", f"<!-- results:{docs.name}:end -->"
    res = json.loads((out / "results.json").read_text())
    table = (out / "results.md").read_text().strip()
    # Drop the H1 and demote the H2s so that the block nests under the README's own section.
    table = "\n".join("###" + line[1:] if line.startswith("## ") else line
                      for line in table.splitlines() if not line.startswith("# "))
    env = res.get("environment", {})
    block = [START, "", f"Produced by `{res['command']}` on {res['date'][:10]} "
             f"({env.get('cpu', 'this CPU')}, torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')});",
             f"copied from `{out}/results.md` into `{docs}/` by `python scripts/update_readme_results.py {out} {docs}`.",
             "", table, ""]
    for name in ["results.json", "results.md"] + list(res.get("plots", [])):
        shutil.copy(out / Path(name).name, docs / Path(name).name)
    for png in res.get("plots", []):
        block.append(f"![{Path(png).stem}]({docs / Path(png).name})")
    block.append(END)
    if not replace_block(docs.name, "\n".join(block[1:-1])):
        return 2
    print(f"README.md: results section replaced from {out}")
    return 0


def replace_block(name: str, body: str, readme: Path = Path("README.md")) -> bool:
    """Put `body` between README's `<!-- results:NAME:start -->` and `<!-- results:NAME:end -->` markers."""
    start, end = f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->"
    text = readme.read_text()
    if start not in text or end not in text:
        print(f"{readme} has no {start} / {end} markers", file=sys.stderr)
        return False
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{body}\n{end}{tail}")
    return True


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
