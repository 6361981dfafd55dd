"""The README and the results page hold exactly what the results files say, and the README's Python example runs."""
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def blocks(text: str) -> dict[str, str]:
    """{NAME: body} of every `<!-- results:NAME:start -->` ... `<!-- results:NAME:end -->` block."""
    return dict(re.findall(r"<!-- results:([\w.-]+):start -->\n(.*?)\n<!-- results:\1:end -->", text, re.S))


def test_readme_headline_is_copied_from_its_results_file():
    upd = _script("update_readme_results")
    readme = blocks((ROOT / "README.md").read_text())
    assert list(readme) == ["headline"]  # one table in the README; the rest lives on the results page
    docs = re.search(r"figures from `(docs/results/[\w.-]+)/results\.md`", readme["headline"]).group(1)
    assert readme["headline"] == upd.render_headline(ROOT / docs, ROOT / "README.md", ROOT / "docs/results/README.md")
    main_table = [line for line in (ROOT / docs / "results.md").read_text().splitlines() if line.startswith("| ")]
    assert main_table[2] in readme["headline"]  # a figure row, verbatim


def test_results_page_blocks_are_copied_from_their_results_files():
    upd, report = _script("update_readme_results"), _script("recipe_report")
    page = ROOT / "docs" / "results" / "README.md"
    found = blocks(page.read_text())
    runs = [d.name for d in (ROOT / "docs" / "results").iterdir() if (d / "results.json").exists()]
    assert set(runs) | {"recipes"} == set(found)  # every run folder has its block, and nothing else is there
    for name in runs:
        assert found[name] == upd.render_block(ROOT / "docs" / "results" / name, page), name
    rows = json.loads((ROOT / "docs" / "results" / "recipes" / "recipes.json").read_text())
    assert report.markdown(rows) in found["recipes"]
    assert "Definitions: " not in page.read_text()  # the definitions are written once, as a list
    for img in re.findall(r"!\[[^]]*\]\(([^)]+)\)", page.read_text()):
        assert (page.parent / img).exists(), img


@pytest.mark.slow
def test_readme_python_example_runs(smollm2, tmp_path, monkeypatch, capsys):
    """The README's code block, on an untrained EAGLE-3 head; greedy output equals HF generate's."""
    import torch

    import specheads
    from specheads.heads.base import HeadSpec, build_head

    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert "runs/demo/best" in code
    build_head(HeadSpec(kind="eagle3", draft_vocab_size=2048), smollm2).save_pretrained(tmp_path / "head")
    monkeypatch.setattr(specheads, "load_target", lambda *a, **k: smollm2)  # the session's target, loaded once
    scope: dict = {}
    exec(code.replace("runs/demo/best", str(tmp_path / "head")), scope)
    res = scope["res"]
    ids = res.prompt_ids
    ref = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    assert res.ids == ref and res.stats.target_forwards >= 1
    assert "τ" in capsys.readouterr().out
