"""The report scripts that write the README's result blocks."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path: Path, name: str, samples: int, tau: float) -> Path:
    run = tmp_path / name
    run.mkdir(exist_ok=True)
    (run / "prepare_summary.json").write_text(json.dumps(
        {"conversations_kept": 10, "samples": samples, "tokens": 100 * samples, "masked_tokens": 60 * samples,
         "timings": {"regenerate_s": 60.0, "features_s": 30.0, "total_s": 95.0}}))
    (run / "train_summary.json").write_text(json.dumps(
        {"kind": "eagle3", "steps": 5, "train_seconds": 120.0, "tokens_per_s": 500.0,
         "history": [{"tau_tree": 1.0, "tau_chain": 1.0, "top1_0": 0.0}, {"tau_tree": tau, "tau_chain": 1.5,
                                                                          "top1_0": 0.4}]}))
    return run


def test_recipe_report_keep_replaces_named_rows_and_keeps_the_rest(tmp_path):
    report = _script("recipe_report")
    out = tmp_path / "out"
    a, b = _run(tmp_path, "a", 7, 2.0), _run(tmp_path, "b", 9, 2.5)
    assert report.main([str(a), "--out", str(out)]) == 0
    assert report.main([str(b), "--out", str(out), "--keep"]) == 0  # a's folder is not named: its row stays
    rows = json.loads((out / "recipes.json").read_text())
    assert [r["run"] for r in rows] == [str(a), str(b)] and rows[1]["samples"] == 9
    _run(tmp_path, "a", 11, 3.0)  # a measured again: replaces its row in place
    assert report.main([str(a), "--out", str(out), "--keep"]) == 0
    rows = json.loads((out / "recipes.json").read_text())
    assert [(r["run"], r["samples"], r["tau_tree_end"]) for r in rows] == [(str(a), 11, 3.0), (str(b), 9, 2.5)]
    assert report.main([str(b), "--out", str(out)]) == 0  # without --keep the file holds the named runs only
    assert [r["run"] for r in json.loads((out / "recipes.json").read_text())] == [str(b)]


def test_update_readme_results_copies_a_run_into_the_page_and_the_headline(tmp_path, monkeypatch):
    upd = _script("update_readme_results")
    run = tmp_path / "runs" / "bench"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"command": "specheads bench --out runs/bench", "date": "2030-01-02T03:04",
                                                  "environment": {"cpu": "Some CPU", "torch": "9", "transformers": "8"},
                                                  "plots": ["speedup_tau.png"]}))
    (run / "results.md").write_text("# specheads bench: t on d\n\n3 prompts, dtype float32, now.\n\n"
                                    "| method | tokens/s | τ |\n|---|---:|---:|\n| vanilla | 9.5 | 1.00 |\n| head | 14.2 | 1.61 |\n\n"
                                    "## Per category (speedup / τ)\n\n| category | vanilla |\n\nDefinitions: **tau** = x.\n")
    (run / "speedup_tau.png").write_bytes(b"png")
    page, readme = tmp_path / "docs" / "results" / "README.md", tmp_path / "README.md"
    page.parent.mkdir(parents=True)
    page.write_text("# Results\n")
    readme.write_text("# x\n<!-- results:headline:start -->\nold\n<!-- results:headline:end -->\ntail\n")
    monkeypatch.setattr(upd, "RESULTS_PAGE", page)
    monkeypatch.setattr(upd, "README", readme)
    docs = page.parent / "my-run"
    assert upd.main([str(run), str(docs), "--headline"]) == 0
    assert (docs / "results.json").exists() and (docs / "speedup_tau.png").read_bytes() == b"png"
    text = page.read_text()
    assert "## my-run" in text and "### Per category" in text and "| head | 14.2 | 1.61 |" in text
    assert "Definitions:" not in text and "![speedup_tau](my-run/speedup_tau.png)" in text
    assert "on 2030-01-02 (Some CPU, torch 9, transformers 8)" in text
    head = readme.read_text()
    assert "| head | 14.2 | 1.61 |" in head and "| category |" not in head and head.endswith("tail\n")
    assert "3 prompts, dtype float32, now." in head and "(docs/results/README.md#my-run)" in head
    assert upd.main([str(docs), str(docs)]) == 0  # re-rendered from the docs folder itself: the same block
    assert page.read_text() == text


def test_head_compare_reads_the_best_step_and_the_calibration(tmp_path):
    compare = _script("head_compare")
    run = tmp_path / "dspark"
    (run / "best").mkdir(parents=True)
    (run / "best" / "config.json").write_text(json.dumps({"kind": "dspark", "spec": {
        "kind": "dspark", "markov_rank": 0, "confidence_head": False, "anchor_features": False}}))
    (run / "train_summary.json").write_text(json.dumps(
        {"kind": "dspark", "steps": 8, "train_seconds": 30.0, "best_step": 4,
         "history": [{"step": 4, "tau_chain": 1.3, "tau_tree": 1.4, "top1_0": 0.3},
                     {"step": 8, "tau_chain": 1.2, "tau_tree": 1.25, "top1_0": 0.2}]}))
    eagle = _run(tmp_path, "eagle", 7, 2.0)
    assert compare.main([str(eagle), str(run), "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "heads.json").read_text())["rows"]
    assert rows[1]["tau_chain"] == 1.3 and rows[1]["top1"][0] == 0.3  # the best step's figures, not the last
    assert rows[0]["tau_tree"] == 2.0  # no best_step: the last evaluation
    md = (tmp_path / "out" / "heads.md").read_text()
    assert "dspark = DFlash" in md and md.startswith("Produced by `python scripts/head_compare.py")


def test_prediction_table_reads_the_best_step_and_the_served_tau(tmp_path):
    table = _script("prediction_table")
    run = tmp_path / "run"
    run.mkdir()
    hist = [{"step": 0, "tau_chain_walk": 1.0, "dev_tau_chain_walk": 1.0},
            {"step": 10, "tau_chain": 1.6, "tau_chain_walk": 1.5, "tau_chain_walk_se": 0.02, "dev_tau_chain_walk": 1.4},
            {"step": 20, "tau_chain_walk": 1.55, "dev_tau_chain_walk": 1.3}]
    (run / "train_summary.json").write_text(json.dumps({"best_step": 10, "history": hist}))
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"command": "specheads bench ...", "methods": {"head:eagle3": {
        "overall": {"tau": 1.35, "turns": 80}}}}))
    out = tmp_path / "pred"
    assert table.main(["--row", "h", str(run), str(bench), "head:eagle3", "tau_chain_walk", "--out", str(out)]) == 0
    r = json.loads((out.parent / "pred.json").read_text())["rows"][0]
    assert (r["held_out"], r["dev"], r["served_tau"], r["held_out_per_position"]) == (1.5, 1.4, 1.35, 1.6)
    assert r["dev_error"] == pytest.approx(1.4 / 1.35 - 1) and r["holds"]  # +3.7%: within 5%
    assert "| h | 10 | 1.600 | 1.500 ± 0.020 | 1.400 | 1.350 (80 turns) | +3.7% | yes |" in (out.parent / "pred.md").read_text()


def test_tuning_table_reads_the_best_step_and_the_data(tmp_path):
    """scripts/tuning_table.py: the best step's held-out and dev figures, the data of the features' own run."""
    table = _script("tuning_table")
    feats_run, run = tmp_path / "a", tmp_path / "b"
    feats_run.mkdir()
    run.mkdir()
    (feats_run / "prepare_summary.json").write_text(json.dumps({"samples": 871}))
    (run / "train_config.yaml").write_text(f"data:\n  regen_temperature: 0.7\nfeatures:\n  dir: {feats_run}/features\n")
    hist = [{"step": 5, "dev_tau_tree_walk": 1.2},
            {"step": 9, "top1_0": 0.3, "tau_chain_walk": 1.4, "tau_tree_walk": 1.6, "dev_top1_0": 0.25,
             "dev_tau_chain_walk": 1.3, "dev_tau_chain_walk_se": 0.03, "dev_tau_tree_walk": 1.5,
             "dev_tau_tree_walk_se": 0.04}]
    (run / "train_summary.json").write_text(json.dumps({"kind": "eagle3", "steps": 10, "epochs": 2, "best_step": 9,
                                                        "train_seconds": 12.5, "history": hist}))
    assert table.main(["--row", "sampled", str(run), "--out", str(tmp_path / "t")]) == 0
    r = json.loads((tmp_path / "t.json").read_text())["rows"][0]
    assert (r["samples"], r["regen_temperature"], r["best_step"], r["dev_tau_tree_walk"]) == (871, 0.7, 9, 1.5)
    assert ("| sampled | eagle3 | 871 | sampled T=0.7 | 9 of 10 (2) | 12.5 | 0.300 | 1.400 / 1.600 | 0.250 | "
            "1.300 ± 0.030 | 1.500 ± 0.040 |") in (tmp_path / "t.md").read_text()


def test_compare_bench_runs_finds_a_changed_output(tmp_path):
    """scripts/compare_bench_runs.py: identical runs compare identical; one changed text and one changed τ are named."""
    def write(d, text, tau):
        (d / "single").mkdir(parents=True)
        (d / "batch").mkdir()
        rows = [{"method": m, "prompt_id": "1", "turn": 0, "text": t, "target_forwards": 3, "new_tokens": 4}
                for m, t in (("vanilla", "a b"), ("head", text))]
        (d / "single" / "outputs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "single" / "results.json").write_text(json.dumps(
            {"methods": {"vanilla": {"overall": {"tau": 1.0}}, "head": {"overall": {"tau": tau}}}}))
        row = {"tau": tau, "target_forwards": 3, "row_forwards": 6, "new_tokens": 8, "identical": 1.0}
        (d / "batch" / "results.json").write_text(json.dumps({"batch_sizes": {"4": {"head": row}}}))

    write(tmp_path / "a", "a b", 1.5)
    write(tmp_path / "b", "a b", 1.5)
    write(tmp_path / "c", "a c", 1.25)
    script = Path(__file__).resolve().parents[1] / "scripts" / "compare_bench_runs.py"
    for other, same in (("b", True), ("c", False)):
        out = tmp_path / f"{other}.json"
        subprocess.run([sys.executable, str(script), str(tmp_path / "a"), str(tmp_path / other), str(out)], check=True,
                       capture_output=True)
        res = json.loads(out.read_text())
        assert (res["single"]["identical_rows"] == 2) is same and (res["batch"]["identical"] == 1) is same
        assert res["single"]["tau_differs"] == ({} if same else {"head": [1.5, 1.25]})
        assert res["single"]["rows_differing"] == ([] if same else [["head", "1", 0]])


def test_kinds_matched_prices_draft_cost_in_vanilla_forwards(tmp_path):
    """scripts/kinds_matched.py: with every stage's output present nothing runs; the table joins each kind's training
    summary with the one bench run, draft cost = draft seconds per step / vanilla seconds per token."""
    km = _script("kinds_matched")
    runs = tmp_path / "runs"
    hist = [{"step": 40, "top1_0": 0.3, "tau_chain_walk": 1.4, "tau_tree_walk": 1.6, "dev_tau_tree_walk": 1.5,
             "dev_tau_tree_walk_se": 0.04}]
    for d, steps, secs in ((runs / "_timing" / "eagle3", 12, 6.0), (runs / "eagle3", 40, 20.0)):
        d.mkdir(parents=True)
        (d / "train_summary.json").write_text(json.dumps({"kind": "eagle3", "steps": steps, "epochs": 1000,
                                                          "best_step": 40, "train_seconds": secs, "history": hist}))
    (runs / "bench").mkdir()
    over = lambda tau, sp, t, n, f: {"tau": tau, "speedup": sp, "identical": 1.0, "time_s": t,  # noqa: E731
                                     "new_tokens": n, "target_forwards": f}
    (runs / "bench" / "results.json").write_text(json.dumps({"num_prompts": 2, "settings": {"max_new_tokens": 8},
        "methods": {"vanilla": {"overall": over(1.0, 1.0, 4.0, 100, 100)},
                    "head:eagle3": {"overall": over(1.6, 1.2, 3.3, 100, 50),
                                    "step_breakdown": {"seconds": {"draft": 0.5}}}}}))
    out = tmp_path / "out"
    assert km.main(["--runs", str(runs), "--kinds", "eagle3", "--out", str(out), "--budget-s", "20"]) == 0
    r = json.loads((out / "kinds.json").read_text())["rows"][0]
    assert r["seconds_per_step"] == 0.5 and r["steps"] == 40
    assert r["draft_cost_forwards"] == pytest.approx((0.5 / 50) / (4.0 / 100))  # 0.25 of a vanilla token
    assert "| eagle3 | 2,2,6 | 40 | 20.0 | 0.300 | 1.400 / 1.600 | 1.500 ± 0.040 | 0.25 | 1.600 | 1.20x | - |" in \
        (out / "kinds.md").read_text()  # an EAGLE tree: no fixed walk predicts it
    assert r["predicted_tau"] is None and r["timing"] == "measured"
    assert json.loads((out / "bench.json").read_text())["num_prompts"] == 2


def test_kinds_matched_serves_each_block_kind_as_chain_and_tree():
    """issue 41's table: with --block-trees every block kind (a block size for --tree) is served twice from the
    same trained run, as its chain and as the scheduled tree over its block; tree kinds once."""
    km = _script("kinds_matched")
    kinds = [("eagle3", "r", [], "2,2,6"), ("dspark", "r", [], "7"), ("dflash2", "r", [], "7")]
    assert km.served(kinds, False) == [("eagle3", "eagle3", "2,2,6"), ("dspark", "dspark", "7"),
                                       ("dflash2", "dflash2", "7")]
    assert km.served(kinds, True)[3:] == [("dspark-tree", "dspark", "tree:auto"),
                                          ("dflash2-tree", "dflash2", "tree:auto")]
    assert km.served(kinds, True, 16)[5:] == [("dspark-tree16", "dspark", "tree:16"),
                                              ("dflash2-tree16", "dflash2", "tree:16")]


def test_kinds_matched_prediction_rows(tmp_path):
    """--fixed-tree: a fixed block is predicted by the dev chain walk, tree:N by the dev block-tree walk of N nodes
    (another node budget, or a scheduled tree, is not predicted); the error is dev / served - 1, within 5% holds;
    --seconds-per-step skips the timing run and marks the row's timing given."""
    km = _script("kinds_matched")
    runs = tmp_path / "runs"
    hist = [{"step": 9, "top1_0": 0.2, "tau_chain_walk": 1.1, "tau_tree_walk": 1.2, "dev_tau_tree_walk": 1.2,
             "dev_tau_chain_walk": 1.10, "dev_tau_blocktree_walk": 1.30, "dev_blocktree_nodes": 16}]
    (runs / "dspark").mkdir(parents=True)
    (runs / "dspark" / "train_summary.json").write_text(json.dumps(
        {"kind": "dspark", "steps": 9, "epochs": 1, "best_step": 9, "train_seconds": 9.0, "history": hist}))
    assert km.predicted(runs / "dspark", "7") == ("dev_tau_chain_walk", 1.10)
    assert km.predicted(runs / "dspark", "tree:16") == ("dev_tau_blocktree_walk", 1.30)
    assert km.predicted(runs / "dspark", "tree:32") == (None, None)
    assert km.predicted(runs / "dspark", "tree:auto") == (None, None)
    (runs / "bench").mkdir()
    over = lambda tau: {"tau": tau, "speedup": 1.0, "identical": 1.0, "time_s": 1.0,  # noqa: E731
                        "new_tokens": 10, "target_forwards": 8}
    (runs / "bench" / "results.json").write_text(json.dumps({"num_prompts": 1, "settings": {}, "methods": {
        "vanilla": {"overall": over(1.0)}, "head:dspark": {"overall": over(1.0)},
        "head:dspark-tree": {"overall": over(1.4)}, "head:dspark-tree16": {"overall": over(1.25)}}}))
    out = tmp_path / "out"
    assert km.main(["--runs", str(runs), "--kinds", "dspark", "--out", str(out), "--block-trees",
                    "--fixed-tree", "16", "--seconds-per-step", "dspark=1.5"]) == 0
    rows = {r["label"]: r for r in json.loads((out / "kinds.json").read_text())["rows"]}
    assert rows["dspark"]["prediction_error"] == pytest.approx(0.10) and rows["dspark"]["prediction_holds"] is False
    assert rows["dspark-tree16"]["prediction_error"] == pytest.approx(0.04) and rows["dspark-tree16"]["prediction_holds"]
    assert rows["dspark-tree"]["predicted_tau"] is None
    assert rows["dspark"]["timing"] == "given" and rows["dspark"]["seconds_per_step"] == 1.5
    assert not (runs / "_timing").exists()
    md = (out / "kinds.md").read_text()
    assert "1.100 (+10.0%, over 5%)" in md and "1.300 (+4.0%)" in md
