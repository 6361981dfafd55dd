"""Output guards (issue 28): `specheads export` never replaces another head's folder or a folder it reads, never
copies a damaged head, and says when --import binds a head to another target; `bench --batch-sizes` never labels a
row with a batch size it did not run."""
from __future__ import annotations

import json

import pytest


# ------------------------------------------------------------------------------------------- bench --batch-sizes
def test_batch_sizes_above_the_prompt_count_are_refused_before_the_target_loads(tmp_path, monkeypatch, capsys):
    """2 prompts and --batch-sizes 1,1000000: the 1000000 row would run as B = 2 under the label B = 1000000."""
    import specheads.target
    from specheads.cli import main

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(specheads.target, "load_target", no_load)
    ds = tmp_path / "p.jsonl"
    ds.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(2)))
    out = tmp_path / "out"
    assert main(["bench", "--batch-sizes", "1,1000000", "--dataset", str(ds), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--batch-sizes 1,1000000: 1000000 above the 2 prompts" in err
    assert not out.exists()
    assert main(["bench", "--batch-sizes", "2,4", "--dataset", str(ds), "--limit", "1", "--out", str(out)]) == 2
    assert "2,4 above the 1 prompts" in capsys.readouterr().err
