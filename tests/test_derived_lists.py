"""Every list of head kinds a user reads either comes from the registry (heads/kinds.py) or is checked against it
here: the package description, `generate --head`'s help, heads/__init__.py's docstring, and the docs' tables of
kinds (docs/training.md's losses, docs/architecture.md's module table). A kind added without them fails here, naming
the list and the kind."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import specheads.heads
from specheads.heads.kinds import kind_names, kind_title, kinds

ROOT = Path(__file__).resolve().parents[1]
ALIASES = {"DFlash": "dspark"}  # names prose uses for a variant of a registered kind (a dspark head without its
# Markov and confidence heads)


def package_kinds() -> list[str]:
    """The kinds this package registers (a test's or a plugin's own kinds left out)."""
    return [n for n, k in kinds().items() if k.head.__module__.startswith("specheads.")]


def named(text: str, word: str) -> bool:
    """Whether `word` stands in `text` as a whole name (EAGLE is not found inside EAGLE-3 or P-EAGLE)."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def test_kind_title_strips_the_article_and_head():
    assert kind_title("eagle3") == "EAGLE-3" and kind_title("eagle") == "EAGLE" and kind_title("dspark") == "DSpark"
    assert {kind_title(n) for n in package_kinds()} >= {"Medusa", "P-EAGLE", "Domino", "DSpine", "LiLiCorr"}


def test_named_is_whole_names_only():
    assert named("Medusa, EAGLE-3, P-EAGLE", "EAGLE-3") and not named("Medusa, EAGLE-3, P-EAGLE", "EAGLE")
    assert named("(EAGLE, EAGLE-3)", "EAGLE") and not named("DFlash2", "DFlash")


def test_package_description_lists_exactly_the_registered_kinds():
    desc = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    listed = re.match(r"Train draft heads \(([^)]*)\)", desc)
    assert listed, f"pyproject.toml description no longer starts 'Train draft heads (...)': {desc[:80]}"
    names = [n.strip() for part in listed.group(1).split(",") for n in part.split(" / ")]
    titles = {kind_title(n): n for n in package_kinds()}
    missing = [t for t in titles if t not in names]
    assert not missing, f"pyproject.toml description lacks registered kinds {missing}"
    unknown = [n for n in names if n not in titles and n not in ALIASES]
    assert not unknown, f"pyproject.toml description names {unknown}, no registered kind (or alias)"


def test_generate_head_help_lists_every_registered_kind():
    from specheads.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    action = next(a for a in sub.choices["generate"]._actions if "--head" in a.option_strings)
    missing = [n for n in kind_names() if not named(action.help, n)]
    assert not missing, f"generate --head help lacks {missing}: {action.help}"


def test_heads_package_docstring_lists_every_registered_kind():
    doc = specheads.heads.__doc__ or ""
    listed = re.search(r"every registered kind \(([^:;)]*)", doc)
    assert listed, "heads/__init__.py's docstring no longer lists the kinds as 'every registered kind (a, b, ...'"
    names = [n.strip() for n in listed.group(1).split(",")]
    assert sorted(names) == sorted(package_kinds()), f"heads/__init__.py docstring lists {names}"


def _table_rows(text: str, header: str) -> list[str]:
    """The first cells of the markdown table whose header row is `header`."""
    lines = text.splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    return rows


def test_training_losses_table_has_a_row_per_kind():
    rows = _table_rows((ROOT / "docs" / "training.md").read_text(), "| kind | loss |")
    kinds_in = [r.split()[0] for r in rows]
    missing = [n for n in package_kinds() if n not in kinds_in]
    assert not missing, f"docs/training.md losses table has no row for {missing}"
    assert not [k for k in kinds_in if k not in package_kinds()], f"unknown kinds in the table: {kinds_in}"


def test_architecture_module_table_names_every_kind():
    rows = [line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines() if line.startswith("|")]
    text = "\n".join(rows)
    # a kind's module or folder in backticks: `eagle3.py`, `kinds/eagle3/`, `eagle3/`
    missing = [n for n in package_kinds() if not re.search(rf"`(?:[\w/]*/)?{re.escape(n)}(?:\.py|/)`", text)]
    assert not missing, f"docs/architecture.md's module tables name no module or folder of {missing}"


@pytest.mark.parametrize("flag", ["--head"])
def test_help_text_is_built_when_asked(flag, capsys):
    """`specheads generate --help` prints the derived list (argparse formats it without error)."""
    from specheads.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert flag in out and all(named(out, n) for n in kind_names())
