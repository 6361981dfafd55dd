"""`specheads bench`: figure arithmetic on hand-made runs, prompt loading, outputs (JSON schema, Markdown, PNG),
an end-to-end run on the tiny target, and (slow) a real SmolLM2 run through the CLI."""
from __future__ import annotations

import dataclasses
import json

import pytest

from specheads.infer.bench import (BenchSettings, HFGenerate, MethodOptions, RunRecord, accept_histogram, build_methods,
                                   build_results, compare, forward_token_counts, head_entries, markdown_table,
                                   record_from_generation, run_bench, step_breakdown, summarize, write_outputs)
from specheads.prompts import BenchPrompt, encode_turn, load_jsonl_prompts, load_prompts
from specheads.utils import SpecheadsError


def rec(method, pid, tokens, time_s, steps=None, out=None, cat="writing", turn=0, phases=None):
    return RunRecord(method=method, prompt_id=pid, category=cat, turn=turn, prompt_tokens=10, new_tokens=tokens,
                     time_s=time_s, target_forwards=None if steps is None else len(steps), step_tokens=steps,
                     output_ids=out if out is not None else list(range(tokens)), phase_times=phases)


# ------------------------------------------------------------------------------------------------ arithmetic
def test_tau_speedup_histogram_on_hand_made_runs():
    van = [rec("vanilla", "a", 10, 2.0, [1] * 10), rec("vanilla", "b", 30, 4.0, [1] * 30)]
    # head: a in 4 forwards (3+3+2+2), b in 12 forwards; 2x less time in total
    head = [rec("head", "a", 10, 1.0, [3, 3, 2, 2]), rec("head", "b", 30, 2.0, [3] * 8 + [1, 1, 2, 2])]
    s = compare(head, van, greedy=True)
    assert s["new_tokens"] == 40 and s["target_forwards"] == 16
    assert s["tau"] == pytest.approx(40 / 16)
    assert s["tokens_per_s"] == pytest.approx(40 / 3.0)
    # ratio of totals (40/3) / (40/6) = 2, not the mean of per-prompt ratios (2 and 2 here, see next test)
    assert s["speedup"] == pytest.approx(2.0)
    assert s["accept_hist"] == {"1": 2, "2": 4, "3": 10}
    assert sum(int(k) * v for k, v in s["accept_hist"].items()) == 40  # the histogram's mean is τ
    assert s["identical"] == 1.0
    v = compare(van, van, greedy=True)
    assert v["tau"] == 1.0 and v["speedup"] == 1.0


def test_speedup_is_ratio_of_totals_not_mean_of_ratios():
    van = [rec("vanilla", "a", 100, 10.0, [1] * 100), rec("vanilla", "b", 10, 1.0, [1] * 10)]
    m = [rec("m", "a", 100, 5.0, None), rec("m", "b", 10, 2.0, None)]  # 2x on the long one, 0.5x on the short
    s = compare(m, van, greedy=False)
    assert s["speedup"] == pytest.approx((110 / 7.0) / (110 / 11.0))
    assert s["tau"] is None and s["accept_hist"] is None and s["target_forwards"] is None  # n/a, never guessed
    assert s["identical"] is None  # sampling: no identical check


def test_identical_share_matches_prompt_and_turn():
    van = [rec("vanilla", "a", 3, 1, [1, 1, 1], out=[1, 2, 3]), rec("vanilla", "b", 2, 1, [1, 1], out=[4, 5])]
    m = [rec("m", "a", 3, 1, [3], out=[1, 2, 3]), rec("m", "b", 2, 1, [2], out=[4, 6])]
    assert compare(m, van, greedy=True)["identical"] == 0.5


def test_accept_histogram_unknown_when_any_record_lacks_counts():
    assert accept_histogram([rec("m", "a", 2, 1, [2]), rec("m", "b", 1, 1, None)]) is None
    assert summarize([])["tokens_per_s"] is None


def test_forward_token_counts_from_call_positions():
    # vanilla: prefill at 0 over a 5-token prompt, then one call per token at positions 5, 6, 7
    assert forward_token_counts([0, 5, 6, 7], prompt_len=5, new_tokens=4) == [1, 1, 1, 1]
    # HF prompt lookup: the first call verifies candidates together with the prompt and keeps 3 tokens,
    # then a call at 7 keeps 1, then a call at 8 keeps 4 (capped by the end)
    assert forward_token_counts([0, 7, 8], prompt_len=5, new_tokens=8) == [3, 1, 4]
    assert forward_token_counts([], 5, 3) is None
    assert forward_token_counts([0, 9], 5, 3) is None  # inconsistent: never guessed


def test_step_breakdown_non_model_share():
    phases = {"draft": 1.0, "tree": 0.1, "target": 3.0, "verify": 0.2, "cache": 0.1, "other": 0.1, "prefill": 5.0}
    b = step_breakdown([rec("head", "a", 10, 10, [2] * 5, phases=phases)])
    assert b["non_model_share"] == pytest.approx(0.5 / 4.5)  # prefill is not a step phase
    assert b["step_share"]["target"] == pytest.approx(3.0 / 4.5)
    assert b["ms_per_step"] == pytest.approx(1000 * 4.5 / 5)


def test_record_from_generation_adapts_our_stats():
    from specheads.infer.engine.generate import GenerationResult, GenerationStats, ScheduleStats

    stats = GenerationStats(new_tokens=5, target_forwards=3, accept_hist=[0, 1, 2, 0], prefill_s=0.5,
                            timings={"draft": 0.1, "target": 0.3})
    res = GenerationResult(ids=[7, 8, 9, 10, 11], text="x", stats=stats)
    r = record_from_generation("head", res, prompt_len=4, dt=1.0, tokenizer=None)
    assert r.new_tokens == 5 and r.target_forwards == 3 and r.output_ids == [7, 8, 9, 10, 11]
    assert sorted(r.step_tokens) == [1, 2, 2] and r.schedule is None
    assert r.phase_times == {"draft": 0.1, "target": 0.3, "prefill": 0.5}
    stats.schedule = ScheduleStats(scheduled_steps=3, expected_tau_sum=5.0, source_tokens={"lookup": 4})
    r = record_from_generation("head", res, prompt_len=4, dt=1.0, tokenizer=None)
    assert r.schedule["scheduled_steps"] == 3 and r.schedule["source_tokens"] == {"lookup": 4}  # results.json keys


# ------------------------------------------------------------------------------------------------ prompts
def test_mt_bench_prompts_interleave_categories():
    ps = load_prompts("mt-bench", limit=8)
    assert len({p.category for p in ps}) == 8 and all(p.chat and len(p.turns) == 1 for p in ps)
    assert len(load_prompts("mt-bench")) == 80
    assert all(len(p.turns) == 2 for p in load_prompts("mt-bench", limit=3, both_turns=True))


def test_sharegpt_prompts_from_an_index_on():
    ps = load_prompts("sharegpt:2000", limit=3)
    assert len(ps) == 3 and all(p.chat and p.category == "sharegpt" and int(p.id) >= 2000 for p in ps)
    with pytest.raises(SpecheadsError, match="sharegpt:START"):
        load_prompts("sharegpt:first")


def test_humaneval_prompts_are_plain_completions():
    ps = load_prompts("humaneval")
    assert len(ps) == 164 and not ps[0].chat and ps[0].turns[0].startswith("from typing import List")


def test_jsonl_prompts_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def f():", "category": "code"}\n\n{"turns": ["hi", "more"], "id": "x"}\n')
    ps = load_jsonl_prompts(f)
    assert [p.chat for p in ps] == [False, True] and ps[1].id == "x" and ps[1].turns == ["hi"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(SpecheadsError, match="bad.jsonl:1"):
        load_jsonl_prompts(bad)
    with pytest.raises(SpecheadsError, match="not found"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_second_turn_carries_the_methods_own_answer(smol_tokenizer):
    p = BenchPrompt(id="1", category="writing", turns=["Say hi.", "Say it again."], chat=True)
    ids = encode_turn(smol_tokenizer, p, 1, ["Hi there!"])
    text = smol_tokenizer.decode(ids)
    assert text.index("Say hi.") < text.index("Hi there!") < text.index("Say it again.")
    assert text.rstrip().endswith("assistant")


# ------------------------------------------------------------------------------------------------ end to end (tiny)
class ByteTok:
    """A stand-in tokenizer for the tiny target: one id per byte (mod 256), no chat template."""
    pad_token_id = 0
    eos_token_id = 2
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] + [3 + b % 250 for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_run_bench_tiny_end_to_end(tiny, tmp_path):
    tiny.tokenizer = ByteTok()
    prompts = [BenchPrompt(id=str(i), category=c, turns=[t], chat=False)
               for i, (c, t) in enumerate([("a", "abc abc abc abc"), ("b", "hello hello hello")])]
    options = MethodOptions(draft_model="truncated:2", draft_tokens=3)
    methods, extra = build_methods(["prompt-lookup", "draft-model", "plain", "prompt-lookup-ours"], tiny, options)
    assert [m.name for m in methods] == ["vanilla", "prompt-lookup", "draft-model", "plain", "prompt-lookup-ours"]
    settings = BenchSettings(target="tiny", dataset="inline", dtype="float32", max_new_tokens=8, warmup_tokens=2)
    res = run_bench(prompts, methods, settings, tiny.tokenizer, out_dir=tmp_path, extra=extra, progress=False)
    assert res["complete"] and res["num_prompts"] == 2 and res["categories"] == ["a", "b"]
    for name in ("vanilla", "prompt-lookup", "draft-model", "plain", "prompt-lookup-ours"):
        o = res["methods"][name]["overall"]
        assert o["identical"] == 1.0, name  # greedy fp32: lossless
        assert o["target_forwards"] <= o["new_tokens"] and o["tau"] >= 1.0
        assert sum(int(k) * v for k, v in o["accept_hist"].items()) >= o["new_tokens"]
    assert res["methods"]["vanilla"]["overall"]["tau"] == 1.0
    assert res["methods"]["draft-model"]["step_breakdown"]["non_model_share"] is not None
    on_disk = json.loads((tmp_path / "results.json").read_text())
    check_schema(on_disk)
    assert sum(line.startswith("| vanilla |") for line in (tmp_path / "results.md").read_text().splitlines()) == 1
    assert (tmp_path / "speedup_tau.png").stat().st_size > 1000
    assert res["methods"]["plain"]["overall"]["tau"] == 1.0
    assert len((tmp_path / "outputs.jsonl").read_text().splitlines()) == 10


def test_interrupt_keeps_finished_prompts(tiny, tmp_path):
    tiny.tokenizer = ByteTok()

    class Boom(HFGenerate):
        calls = 0

        def generate(self, ids, n):
            Boom.calls += 1
            if Boom.calls == 3:  # warm-up, prompt 0, then prompt 1 (this method runs first there) is interrupted
                raise KeyboardInterrupt
            return super().generate(ids, n)

    prompts = [BenchPrompt(id=str(i), category="c", turns=["abcabc"], chat=False) for i in range(3)]
    methods = [HFGenerate("vanilla", tiny, 0.0), Boom("prompt-lookup", tiny, 0.0, prompt_lookup_num_tokens=3)]
    res = run_bench(prompts, methods, BenchSettings("tiny", "inline", "float32", max_new_tokens=4, warmup_tokens=1),
                    tiny.tokenizer, out_dir=tmp_path, progress=False)
    assert res["interrupted"] and not res["complete"] and res["num_prompts"] == 1
    assert res["interrupted_by"] == "SIGINT"  # a plain KeyboardInterrupt: Ctrl-C
    assert json.loads((tmp_path / "results.json").read_text())["num_prompts"] == 1


def check_schema(r):
    for k in ("schema", "command", "date", "environment", "settings", "complete", "definitions", "num_prompts",
              "categories", "methods"):
        assert k in r, k
    assert r["schema"] == "specheads.bench/1"
    for k in ("torch", "transformers", "specheads", "cpu"):
        assert k in r["environment"], k
    assert r["settings"]["dtype"] in ("float32", "bfloat16")
    for name, m in r["methods"].items():
        assert set(m) >= {"overall", "categories", "step_breakdown"}
        for f in [m["overall"], *m["categories"].values()]:
            assert set(f) >= {"turns", "new_tokens", "time_s", "tokens_per_s", "target_forwards", "tau", "speedup",
                              "accept_hist", "identical"}
        assert set(m["categories"]) == set(r["categories"])


def test_markdown_and_plots_from_hand_made_results(tmp_path):
    van = [rec("vanilla", "a", 10, 2.0, [1] * 10), rec("vanilla", "b", 10, 2.0, [1] * 10, cat="math")]
    head = [rec("head", "a", 10, 1.0, [3, 3, 4]), rec("head", "b", 10, 1.5, [2] * 5, cat="math")]
    pl = [rec("prompt-lookup", "a", 10, 1.5, None), rec("prompt-lookup", "b", 10, 2.5, None, cat="math")]
    meta = {"command": "x", "date": "d", "environment": {"cpu": "cpu", "torch_threads": 2},
            "tree": {"summary": "3 nodes", "reason": "because"}}
    res = build_results(van + head + pl, ["vanilla", "head", "prompt-lookup"],
                        BenchSettings("t", "mt-bench", "float32"), meta, True)
    md = markdown_table(res)
    assert "| head | 8.0 | 2.50 | 1.60x | n/a | 100% |" in md  # 20 tokens / 2.5 s; 20 / 8 forwards; 8.0 / 5.0
    assert "| prompt-lookup |" in md and "n/a" in md and "Why: because" in md
    write_outputs(res, van + head + pl, tmp_path)
    assert (tmp_path / "accept_hist.png").exists() and (tmp_path / "speedup_tau.png").exists()


def test_llamacpp_plain_is_the_second_reference():
    """With `llama.cpp` in the run every other method gets figures against it: head 20 tokens in 2.5 s against
    llama.cpp's 20 in 1.0 s = 0.40x, vanilla 4.0 s = 0.25x; llama.cpp itself gets none."""
    van = [rec("vanilla", "a", 10, 2.0, [1] * 10), rec("vanilla", "b", 10, 2.0, [1] * 10)]
    lc = [rec("llama.cpp", "a", 10, 0.5, [1] * 10), rec("llama.cpp", "b", 10, 0.5, [1] * 10)]
    head = [rec("head", "a", 10, 1.0, [3, 3, 4]), rec("head", "b", 10, 1.5, [2] * 5)]
    meta = {"command": "x", "date": "d", "environment": {"cpu": "cpu", "torch_threads": 2}}
    res = build_results(van + lc + head, ["vanilla", "llama.cpp", "head"], BenchSettings("t", "mt-bench", "float32"),
                        meta, True)
    assert "vs_llama.cpp" not in res["methods"]["llama.cpp"]
    assert res["methods"]["head"]["vs_llama.cpp"]["speedup"] == pytest.approx(0.4)
    md = markdown_table(res)
    assert "## Against llama.cpp plain decoding" in md
    assert "| head | 8.0 | 0.40x | 100% |" in md and "| vanilla | 5.0 | 0.25x | 100% |" in md


# ------------------------------------------------------------------------------------------------ CLI (real)
@pytest.mark.slow
def test_cli_smollm2_vanilla_and_prompt_lookup(smollm2, tmp_path):
    from specheads.cli import main

    out = tmp_path / "b"
    rc = main(["bench", "--target", "smollm2-135m", "--dtype", "fp32", "--dataset", "mt-bench", "--limit", "2",
               "--max-new-tokens", "8", "--warmup-tokens", "2", "--methods", "vanilla,prompt-lookup", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "results.json").read_text())
    check_schema(r)
    assert r["num_prompts"] == 2 and len(r["categories"]) == 2
    assert r["methods"]["prompt-lookup"]["overall"]["identical"] == 1.0
    assert r["methods"]["vanilla"]["overall"]["tau"] == 1.0


def test_cli_rejects_unknown_method(tmp_path, capsys):
    from specheads.cli import main
    from specheads.infer.bench import build_methods

    with pytest.raises(SpecheadsError, match="--methods"):
        build_methods(["medusa-magic"], None, MethodOptions())
    # The CLI checks names before the target loads: +lookup head methods pass it (and then need --head)
    base = ["bench", "--target", "no-such-target", "--out", str(tmp_path / "b"), "--methods"]
    assert main(base + ["vanilla,head+magic"]) != 0
    assert "unknown method(s) ['head+magic']" in capsys.readouterr().err
    assert main(base + ["vanilla,head+lookup"]) != 0
    assert "needs --head DIR" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_head_method_tree_auto_on_tiny(tiny, tmp_path, monkeypatch, kind):
    import specheads.infer.autotree as autotree
    import specheads.infer.scheduling.profile as prof_mod
    from specheads.heads.base import HeadSpec, build_head
    from specheads.infer.scheduling.costs import t1_seconds

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prof_mod, "PROFILE_CONTEXT", 32)
    monkeypatch.setattr(prof_mod, "PROFILE_REPEATS", 1)
    monkeypatch.setattr(autotree, "CALIBRATION_TOKENS", 8)
    tiny.tokenizer = ByteTok()
    build_head(HeadSpec(kind=kind), tiny).save_pretrained(tmp_path / "head")
    args = MethodOptions(heads=head_entries(str(tmp_path / "head")))
    methods, extra = build_methods(["head"], tiny, args, calib_ids=[[1, 5, 6, 7, 5, 6, 7, 5, 6]])
    tree = extra["tree"]
    assert tree["mode"] == "auto" and tree["total_tokens"] >= 1 and tree["reason"]
    assert set(tree["profile"]["verify_relative"]) == {"1", "2", "4", "8", "16", "32"}
    assert len(tree["acceptance"]["acc"]) == tree["acceptance"]["probe"]["depth"]
    assert tree["acceptance"]["probe_steps"] > 0 and tree["draft_cost"]["seconds_per_step"] > 0
    assert tree["draft_cost"]["depth1_seconds_per_step"] > 0 and tree["draft_cost"]["t1_s"] > 0
    # a cached profile whose one-token forward is far from the probe's (taken while the machine was busy) is
    # measured again before it prices anything
    from specheads.utils import atomic_write_json, read_json

    path = tree["profile"]["path"]
    stale = read_json(path)
    stale["noisy"] = False
    stale["verify"]["seconds"]["1"] = 1000 * tree["draft_cost"]["t1_s"]
    atomic_write_json(path, stale)
    _, extra2 = build_methods(["head"], tiny, args, calib_ids=[[1, 5, 6, 7, 5, 6, 7, 5, 6]])
    assert extra2["tree"]["profile"]["remeasured"] is True
    assert read_json(path)["verify"]["seconds"]["1"] < stale["verify"]["seconds"]["1"] / 10
    # a clean profile measured just now that still disagrees with the probe prices the draft (the probe's own
    # forwards were slowed): faked as a fresh profile whose one-token forward is 1000x the probe's
    t1_probe = extra2["tree"]["draft_cost"]["t1_s"]
    fresh = {**read_json(path), "cached": False, "path": path, "noisy": False}
    fresh["verify"] = {**fresh["verify"], "seconds": {**fresh["verify"]["seconds"], "1": 1000 * t1_probe}}
    real_load = autotree.load_or_profile
    monkeypatch.setattr(autotree, "load_or_profile", lambda target, refresh=False: fresh)
    _, extra3 = build_methods(["head"], tiny, args, calib_ids=[[1, 5, 6, 7, 5, 6, 7, 5, 6]])
    cost = extra3["tree"]["draft_cost"]
    assert cost["t1_s"] == t1_seconds(fresh) and cost["t1_from"].startswith("the profile")
    assert extra3["tree"]["profile"]["remeasured"] is False
    monkeypatch.setattr(autotree, "load_or_profile", real_load)
    prompts = [BenchPrompt(id="0", category="a", turns=["abcabcabc"], chat=False)]
    res = run_bench(prompts, methods, BenchSettings("tiny", "x", "float32", max_new_tokens=10, warmup_tokens=2),
                    tiny.tokenizer, out_dir=tmp_path / "out", extra=extra, progress=False)
    head = res["methods"]["head"]
    assert head["overall"]["identical"] == 1.0 and head["overall"]["tau"] >= 1.0
    assert 0 <= head["step_breakdown"]["non_model_share"] < 1
    assert res["tree"]["summary"] and "## Tree" in (tmp_path / "out" / "results.md").read_text()
    # A head's plain and +lookup methods share one load and one acceptance probe, so they get the same tree
    calls = []
    real = autotree.choose_tree_for_head
    monkeypatch.setattr(autotree, "choose_tree_for_head", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, extra = build_methods(["head", "head+lookup"], tiny, args, calib_ids=[[1, 5, 6, 7, 5, 6, 7, 5, 6]])
    assert len(calls) == 1
    assert extra["trees"]["head"]["total_tokens"] == extra["trees"]["head+lookup"]["total_tokens"]


def test_several_heads_in_one_run(tiny, tmp_path, monkeypatch):
    """Two --head values become methods head:eagle and head:medusa (labels from the folders' kinds), each with its
    own tree, both checked against vanilla in the same run."""
    import specheads.infer.autotree as autotree
    import specheads.infer.scheduling.profile as prof_mod
    from specheads.heads.base import HeadSpec, build_head

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prof_mod, "PROFILE_CONTEXT", 32)
    monkeypatch.setattr(prof_mod, "PROFILE_REPEATS", 1)
    monkeypatch.setattr(autotree, "CALIBRATION_TOKENS", 8)
    tiny.tokenizer = ByteTok()
    for kind in ("eagle", "medusa"):
        build_head(HeadSpec(kind=kind), tiny).save_pretrained(tmp_path / kind)
    assert head_entries(str(tmp_path / "eagle")) == {"head": str(tmp_path / "eagle")}
    assert head_entries([f"fast={tmp_path / 'eagle'}"]) == {"head:fast": str(tmp_path / "eagle")}
    with pytest.raises(SpecheadsError, match="used twice"):
        head_entries([str(tmp_path / "eagle"), str(tmp_path / "eagle")])
    with pytest.raises(SpecheadsError, match="no readable head config"):
        head_entries([str(tmp_path / "eagle"), str(tmp_path / "nothing")])
    args = MethodOptions(heads=head_entries([str(tmp_path / "eagle"), str(tmp_path / "medusa")]))
    with pytest.raises(SpecheadsError, match="head:nope"):
        build_methods(["head:nope"], tiny, args)
    methods, extra = build_methods(["head"], tiny, args, calib_ids=[[1, 5, 6, 7, 5, 6, 7, 5, 6]])
    assert [m.name for m in methods] == ["vanilla", "head:eagle", "head:medusa"]
    assert set(extra["trees"]) == {"head:eagle", "head:medusa"}
    prompts = [BenchPrompt(id="0", category="a", turns=["abcabcabc"], chat=False)]
    res = run_bench(prompts, methods, BenchSettings("tiny", "x", "float32", max_new_tokens=8, warmup_tokens=2),
                    tiny.tokenizer, out_dir=tmp_path / "out", extra=extra, progress=False)
    for n in ("head:eagle", "head:medusa"):
        assert res["methods"][n]["overall"]["identical"] == 1.0
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Tree: head:eagle" in md and "## Tree: head:medusa" in md


def test_per_head_trees_serve_each_head_its_own_tree(tiny, tmp_path):
    """--tree LABEL=SPEC: one run serves an EAGLE head a fixed tree and a DSpark head its whole block; the unlabelled
    value is every other head's; unknown labels and a second unlabelled tree are one line each."""
    from specheads.heads.base import HeadSpec, build_head
    from specheads.infer.bench.names import head_trees

    tiny.tokenizer = ByteTok()
    build_head(HeadSpec(kind="dspark", feature_layers=[1, 2, 3], block_size=4, markov_rank=16), tiny
               ).save_pretrained(tmp_path / "dspark")
    build_head(HeadSpec(kind="eagle"), tiny).save_pretrained(tmp_path / "eagle")
    heads = head_entries([str(tmp_path / "dspark"), str(tmp_path / "eagle")])
    trees = head_trees(["eagle=2,2,6", "dspark=3"], heads)
    assert trees == {str(tmp_path / "eagle"): "2,2,6", str(tmp_path / "dspark"): "3"}
    assert head_trees(["chain:2", "dspark=3"], heads)[str(tmp_path / "eagle")] == "chain:2"
    assert head_trees(None, heads) == {str(tmp_path / "eagle"): "auto", str(tmp_path / "dspark"): "auto"}
    with pytest.raises(SpecheadsError, match="'medusa' is not a --head label"):
        head_trees(["medusa=2"], heads)
    with pytest.raises(SpecheadsError, match="a second tree for every head"):
        head_trees(["2,2,6", "3"], heads)
    with pytest.raises(SpecheadsError, match="has a tree already"):
        head_trees(["dspark=3", "dspark=4"], heads)
    methods, extra = build_methods(["head:eagle", "head:dspark"], tiny, MethodOptions(heads=heads, tree=trees))
    assert extra["trees"]["head:eagle"]["mode"] == "2,2,6" and extra["trees"]["head:eagle"]["total_tokens"] == 6
    assert extra["trees"]["head:dspark"]["mode"] == "3" and extra["trees"]["head:dspark"]["family"] == "block"
    prompts = [BenchPrompt(id="0", category="a", turns=["abcabcabc"], chat=False)]
    res = run_bench(prompts, methods, BenchSettings("tiny", "x", "float32", max_new_tokens=8, warmup_tokens=2),
                    tiny.tokenizer, out_dir=tmp_path / "out", extra=extra, progress=False)
    for n in ("head:eagle", "head:dspark"):
        assert res["methods"][n]["overall"]["identical"] == 1.0


def test_head_lookup_merges_prompt_lookup_and_names_the_method(tiny, tmp_path):
    from specheads.heads.base import HeadSpec, build_head

    tiny.tokenizer = ByteTok()
    build_head(HeadSpec(kind="eagle"), tiny).save_pretrained(tmp_path / "head")
    args = MethodOptions(heads=head_entries(str(tmp_path / "head")), tree="2,2,4", lookup=3)
    methods, extra = build_methods(["head", "head+lookup"], tiny, args)
    assert [m.name for m in methods] == ["vanilla", "head", "head+lookup"]  # plain and merged side by side
    t = extra["tree"]
    assert (t["depth"], t["top_k"], t["total_tokens"]) == (2, 2, 4)  # DEPTH,TOP_K,TOTAL as in specheads generate
    assert extra["methods_info"]["head+lookup"]["lookup_tokens"] == 3
    assert "prompt-lookup" in extra["trees"]["head+lookup"]["summary"] and "lookup" not in extra["trees"]["head"]["summary"]
    prompts = [BenchPrompt(id="0", category="a", turns=["abcabcabcabc"], chat=False)]
    res = run_bench(prompts, methods, BenchSettings("tiny", "x", "float32", max_new_tokens=12, warmup_tokens=2),
                    tiny.tokenizer, out_dir=tmp_path / "out", extra=extra, progress=False)
    assert res["methods"]["head+lookup"]["overall"]["identical"] == 1.0
    assert res["methods"]["head"]["overall"]["identical"] == 1.0
    assert "lookup_tokens" not in extra["methods_info"]["head"]
    assert extra["trees"]["head+lookup"]["scheduler"]["pricing"] == "measured"  # the default: the run's seconds
    _, fixed = build_methods(["head+lookup"], tiny, dataclasses.replace(args, pricing="profile"))
    assert fixed["trees"]["head+lookup"]["scheduler"]["pricing"] == "profile"  # --pricing reaches the scheduler
    with pytest.raises(SpecheadsError, match="--methods head:nope\\+lookup: no such head"):
        build_methods(["head:nope+lookup"], tiny, args)
    with pytest.raises(SpecheadsError, match="greedy only"):
        build_methods(["head+lookup"], tiny, dataclasses.replace(args, temperature=0.7))
    with pytest.raises(SpecheadsError, match="--lookup 0"):
        dataclasses.replace(args, lookup=0)


def test_calibration_prompts_spread_over_the_set():
    from specheads.prompts import calibration_prompts

    assert calibration_prompts(list(range(80))) == [0, 20, 40, 60]  # one per two MT-bench categories
    assert calibration_prompts([7, 8]) == [7, 8]  # fewer prompts than asked: all of them
    assert calibration_prompts([]) == []


def test_schedule_summary_expected_and_oracle_on_hand_made_records():
    van = [rec("vanilla", "a", 10, 2.0, [1] * 10), rec("vanilla", "b", 10, 2.0, [1] * 10)]
    a, b = rec("m", "a", 10, 1.0, [2] * 5), rec("m", "b", 10, 1.0, [2] * 5)
    a.schedule = {"scheduled_steps": 5, "expected_tau_sum": 11.0, "expected_cost_sum": 5.0,
                  "source_tokens": {"head": 8, "lookup": 7}, "oracle_tokens": 10, "oracle_cost_sum": 6.0,
                  "oracle_censored": 1}
    b.schedule = {"scheduled_steps": 5, "expected_tau_sum": 9.0, "expected_cost_sum": 5.0,
                  "source_tokens": {"head": 6, "lookup": 9}, "oracle_tokens": 10, "oracle_cost_sum": 4.0,
                  "oracle_censored": 0}
    s = compare([a, b], van, greedy=True)
    assert s["expected_tau"] == pytest.approx(2.0) and s["expected_speedup"] == pytest.approx(2.0)
    assert s["sources_tau"] == pytest.approx({"head": 1.4, "lookup": 1.6})
    assert s["oracle_tau"] == pytest.approx(2.0) and s["oracle_speedup"] == pytest.approx(2.0)
    assert s["oracle_censored"] == 1
    assert s["speedup"] == pytest.approx(2.0)
    assert s["expected_vs_measured"] is None and s["speedup_vs_plain"] is None  # no plain: no like-with-like ratio
    plain = compare(van, van, greedy=True)
    assert plain["expected_tau"] is None and plain["oracle_tau"] is None and plain["expected_vs_measured"] is None
    res = build_results(van + [a, b], ["vanilla", "m"], BenchSettings("t", "x", "float32"),
                        {"command": "x", "date": "d", "environment": {"cpu": "cpu", "torch_threads": 2}}, True)
    md = markdown_table(res)
    assert "| m | 10.0 | 2.00 | 2.00x | 2.00x | 100% |" in md
    assert "| m | 2.00 | 2.00 | n/a | 2.00x | n/a | head 1.40, lookup 1.60 | 2.00 | 2.00x | 1 |" in md


def test_dspark_lookup_and_combo_methods_on_tiny(tiny, tmp_path, monkeypatch):
    """head:dspark (its --tree auto is the per-step scheduler), dspark+lookup and eagle+lookup (one scheduler over
    the head and the lookup chain), combo (both heads and lookup): all identical to vanilla, with the scheduler's
    expected figures and the oracle in results.json and results.md."""
    import specheads.infer.autotree as autotree
    import specheads.infer.scheduling.profile as prof_mod
    from specheads.heads.base import HeadSpec, build_head

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prof_mod, "PROFILE_CONTEXT", 32)
    monkeypatch.setattr(prof_mod, "PROFILE_REPEATS", 1)
    monkeypatch.setattr(autotree, "CALIBRATION_TOKENS", 8)
    tiny.tokenizer = ByteTok()
    build_head(HeadSpec(kind="dspark", feature_layers=[1, 2, 3], block_size=4, markov_rank=16), tiny
               ).save_pretrained(tmp_path / "dspark")
    build_head(HeadSpec(kind="eagle"), tiny).save_pretrained(tmp_path / "eagle")
    options = MethodOptions(heads=head_entries([str(tmp_path / "dspark"), str(tmp_path / "eagle")]), lookup=4)
    names = ["head:dspark", "head:dspark+lookup", "head:eagle+lookup", "combo", "lookup+recycling", "combo+recycling"]
    methods, extra = build_methods(names + ["recycling"], tiny, options, calib_ids=[[1, 5, 6, 7, 5, 6, 7, 5, 6]])
    assert [m.name for m in methods] == ["vanilla"] + names + ["recycling"]
    trees = extra["trees"]
    assert trees["head:dspark"]["family"] == "block" and "per step" in trees["head:dspark"]["reason"]
    assert set(trees["head:dspark"]["scheduler"]["verify_relative"]) == {"1", "2", "4", "8", "16", "32"}
    assert trees["combo"]["sources"] == ["dspark", "eagle", "lookup"] and "one verify budget" in trees["combo"]["summary"]
    assert trees["combo+recycling"]["sources"] == ["dspark", "eagle", "recycling", "lookup"]
    assert trees["lookup+recycling"]["sources"] == ["recycling", "lookup"]
    assert "scheduler" in trees["head:eagle+lookup"] and trees["head:eagle+lookup"]["mode"] == "auto"  # probed
    prompts = [BenchPrompt(id=str(i), category="a", turns=[t], chat=False)
               for i, t in enumerate(["abcabcabcabc", "hello hello hello"])]
    res = run_bench(prompts, methods, BenchSettings("tiny", "x", "float32", max_new_tokens=12, warmup_tokens=2),
                    tiny.tokenizer, out_dir=tmp_path / "out", extra=extra, progress=False)
    assert res["methods"]["recycling"]["overall"]["identical"] == 1.0
    for n in names:
        o = res["methods"][n]["overall"]
        assert o["identical"] == 1.0, n
        assert o["expected_tau"] >= 1.0 and o["expected_speedup"] > 0, n
    for n in names[1:]:
        o = res["methods"][n]["overall"]
        assert o["oracle_tau"] >= 1.0 and o["oracle_speedup"] > 0 and o["oracle_censored"] >= 0, n
    assert set(res["methods"]["combo"]["overall"]["sources_tau"]) == {"dspark", "eagle", "lookup"}
    assert res["methods"]["head:dspark"]["overall"]["oracle_tau"] is None  # one source: no oracle
    check_schema(json.loads((tmp_path / "out" / "results.json").read_text()))
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Scheduler: expected against measured" in md and "| combo |" in md
    with pytest.raises(SpecheadsError, match="greedy only"):
        build_methods(["combo"], tiny, dataclasses.replace(options, temperature=0.7))
    with pytest.raises(SpecheadsError, match="combo: needs --head"):
        build_methods(["combo"], tiny, MethodOptions())


def test_an_interrupted_bench_ends_as_every_command_does(tmp_path):
    """issue 49: bench kept the finished prompts on SIGTERM but exited 130 (SIGINT's code) with no line saying so;
    now it ends with Interrupted of the signal that stopped it (the CLI: one line, exit 128 + signal)."""
    import signal

    from specheads.infer.bench.runner import interrupted_exit
    from specheads.utils import Interrupted

    assert interrupted_exit({"interrupted": False}, tmp_path, "prompts") == 0
    with pytest.raises(Interrupted) as e:
        interrupted_exit({"interrupted": True, "interrupted_by": "SIGTERM"}, tmp_path, "prompts")
    assert e.value.signum == signal.SIGTERM
    assert e.value.detail == f"the finished prompts are kept in {tmp_path / 'results.json'} (complete: false)"
