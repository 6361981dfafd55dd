"""The evaluation that predicts serving: the serving walk (train/walk.py), the samples' standard error, every
held-out sample scored (not the shortest first N), and the dev set's walk τ equal to the τ our generation loop
serves on the same answers."""
import math

import pytest
import torch

from specheads.heads.base import HeadSpec, build_head
from specheads.train.walk import ratio_and_se, ratio_sums, walk_sample

pytestmark = pytest.mark.usefixtures("one_thread")


def test_walk_by_hand():
    # one answer of 6 tokens: start rows 1..6 (row t drafts token t+2; a(t) <= 7 - t). Cycles start at row 1
    # (a = 2), 3 (a = 3) and 6 (a = 1): 6 tokens in 3 target forwards
    accepted = [9, 2, 4, 3, 2, 2, 1, 9]
    start = [False, True, True, True, True, True, True, False]
    assert walk_sample(accepted, start) == (6, 3)
    # the per-position mean over the same rows counts rows serving never starts from: 14 / 6, not 2
    assert sum(accepted[1:7]) / 6 == pytest.approx(14 / 6)
    # the last cycle's bonus past the answer is never generated: 3 tokens, not 4
    assert walk_sample([1, 1, 2], [True, True, True]) == (3, 3)
    # two answers (two spans), every draft rejected: τ 1, as plain decoding
    assert walk_sample([1, 1, 1, 1, 1, 1], [True, True, False, True, True, True]) == (5, 5)
    assert walk_sample([2, 2], [False, False]) == (0, 0)


def test_ratio_standard_error_by_hand():
    # samples (tokens, rows): (2, 1), (6, 2): R = 8 / 3; residuals 2 - 8/3 = -2/3, 6 - 16/3 = 2/3
    s = ratio_sums(torch.tensor([2.0, 6.0, 5.0]), torch.tensor([1.0, 2.0, 0.0]))  # a sample without rows is left out
    r, se = ratio_and_se(s, 2)
    assert r == pytest.approx(8 / 3)
    assert se == pytest.approx(math.sqrt(2 * (4 / 9 + 4 / 9)) / 3)
    assert math.isnan(ratio_and_se(s, 1)[1])


def test_eval_indices_are_every_sample_or_a_seeded_draw():
    from specheads.train.dataset import eval_indices

    assert eval_indices(10, None, 0) == list(range(10)) and eval_indices(10, 50, 0) == list(range(10))
    a, b = eval_indices(200, 16, 0), eval_indices(200, 16, 0)
    assert a == b and len(set(a)) == 16 and a != list(range(16)) and a == sorted(a)
    assert eval_indices(200, 16, 1) != a


def _trained_eagle3(tiny, batches, layers, steps=40):
    """An EAGLE-3 head fitted for a few steps on the target's own greedy answers, so that drafts get accepted."""
    from specheads.train.steps import LossSettings, train_loss

    torch.manual_seed(0)
    head = build_head(HeadSpec(kind="eagle3", ttt_steps=3), tiny)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    settings = LossSettings(noise=0.0)
    head.train()
    for _ in range(steps):
        for b in batches:
            opt.zero_grad()
            train_loss("eagle3", head, b, tiny, layers, list(head.config.feature_layers), settings).loss.backward()
            opt.step()
    return head.eval()


def test_dev_walk_tau_equals_served_chain_tau(tiny):
    """Greedy fp32: on the target's own greedy answer, a chain drafter's served τ (our generation loop, tokens per
    target forward, prefill included) is the teacher-forced walk τ over that answer, answer by answer."""
    from specheads.infer.drafters import build_drafter
    from specheads.infer.generate import generate
    from specheads.train.head_eval import answer_batch
    from specheads.train.evaluate import EvalConfig, evaluate
    from specheads.train.layout import resolve_layers

    tiny.model.generation_config.eos_token_id = None  # answers of exactly max_new_tokens tokens
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (6,), generator=g).tolist() for _ in range(3)]
    answers = [tiny.model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    head0 = build_head(HeadSpec(kind="eagle3", ttt_steps=3), tiny)
    layers = sorted(set(resolve_layers(tiny.num_layers, head0.config.feature_layers, "eagle3")) | {tiny.num_layers})
    batches = [answer_batch(tiny, p, a, layers) for p, a in zip(prompts, answers)]
    head = _trained_eagle3(tiny, batches, layers)
    served_tokens = served_forwards = 0
    for p, a in zip(prompts, answers):
        res = generate(tiny, build_drafter(tiny, head, "chain:3"), input_ids=torch.tensor([p]),
                       max_new_tokens=24, eos_token_ids=[])
        assert res.ids == a  # exact: greedy speculative output is the target's greedy answer
        served_tokens += len(res.ids)
        served_forwards += res.stats.target_forwards
    m = evaluate("eagle3", head, batches, tiny, layers, list(head.config.feature_layers), EvalConfig())
    served = served_tokens / served_forwards
    assert served > 1.2  # the head drafts something worth checking
    assert m["tau_chain_walk"] == pytest.approx(served, rel=1e-9)
    assert m["eval_samples"] == 3 and m["tau_chain_walk_se"] > 0


def test_trainer_scores_every_held_out_sample_and_the_dev_set(tiny, tmp_path, monkeypatch):
    import json

    import specheads.train.head_eval as head_eval
    from test_eval import ByteTok
    from test_train import make_recipe, token_samples

    tiny.tokenizer = ByteTok()
    tiny.model.generation_config.eos_token_id = None
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["abc abc", "hello", "1 2 3"]))
    over = ["head.kind=eagle3", "head.ttt_steps=2", "train.max_steps=2", "eval.every_steps=0", "eval.at_start=false",
            "eval.dev_prompts=2", f"eval.dev_dataset={dev}", "eval.dev_max_new_tokens=8",
            "eval.select=dev_tau_chain_walk"]
    recipe = make_recipe(tmp_path / "run", *over)
    recipe.eval.max_samples = None  # every held-out sample (the default)
    res = Trainer_run(recipe, tiny, token_samples(8), token_samples(5, seed=1))
    last = res.history[-1]
    assert last["eval_samples"] == 5  # every held-out sample, not eval.max_samples of them
    assert last["dev_eval_samples"] == 2 and last["dev_eval_rows"] == 16  # 2 answers of 8 tokens
    assert {"tau_chain_walk", "tau_tree_walk", "tau_chain_se", "dev_tau_chain_walk"} <= set(last)
    assert res.best_metric == last["dev_tau_chain_walk"]
    cached = json.loads((tmp_path / "run" / "dev" / "answers.json").read_text())
    assert [len(r["answer_ids"]) for r in cached["rows"]] == [8, 8] and cached["settings"]["max_new_tokens"] == 8
    # a second run with the same settings reuses the answers (no generation)
    monkeypatch.setattr(head_eval, "target_answers", lambda *a, **k: pytest.fail("answers generated again"))
    res2 = Trainer_run(make_recipe(tmp_path / "run2", *over), tiny, token_samples(8), token_samples(5, seed=1),
                       answers_from=tmp_path / "run")
    assert res2.history[-1]["dev_tau_chain_walk"] == pytest.approx(last["dev_tau_chain_walk"], rel=1e-6)


def Trainer_run(recipe, tiny, train, val, answers_from=None):
    """Train `recipe` on the tiny target; answers_from: a run folder whose dev answers are copied in first."""
    import shutil
    from pathlib import Path

    from specheads.train.trainer import Trainer
    from test_train import make_head

    if answers_from is not None:
        shutil.copytree(answers_from / "dev", Path(recipe.output_dir) / "dev")
    return Trainer(recipe, tiny, make_head(recipe, tiny), train, val).train()


def test_dev_set_refuses_a_benchmark_and_select_needs_it(tmp_path):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe
    from specheads.train.devset import load_dev_prompts
    from specheads.utils import SpecheadsError

    with pytest.raises(SpecheadsError, match="eval.select: dev_tau_chain_walk needs the dev set"):
        load_config(Recipe, None, [f"output_dir={tmp_path}", "eval.select=dev_tau_chain_walk"])
    with pytest.raises(SpecheadsError, match="eval.select: 'tau_walk' is not one of"):
        load_config(Recipe, None, [f"output_dir={tmp_path}", "eval.select=tau_walk"])
    r = load_config(Recipe, None, [f"output_dir={tmp_path}", "eval.dev_prompts=8", "eval.dev_dataset=mt-bench"])
    with pytest.raises(SpecheadsError, match="eval.dev_dataset: 'mt-bench' is a benchmark"):
        load_dev_prompts(r)


def test_sharegpt_dev_is_balanced_and_excludes_training_ids():
    from specheads.prompts import MT_BENCH_CATEGORIES, load_sharegpt_dev, request_kind

    assert request_kind("Write a poem about the sea") == "writing"
    assert request_kind("Fix this python function") == "coding"
    assert request_kind("Act as a travel guide in Rome") == "roleplay"
    ps = load_sharegpt_dev(16)
    assert [p.category for p in ps[:8]] == MT_BENCH_CATEGORIES and len(ps) == 16
    again = load_sharegpt_dev(16, exclude={ps[0].id})
    assert ps[0].id not in {p.id for p in again} and len(again) == 16


@pytest.mark.slow
def test_eval_on_a_runs_held_out_split_reproduces_its_training_figures(smol_tokenizer, tmp_path, monkeypatch,
                                                                         capsys):
    """`specheads eval --dataset heldout:RUN` on the run's final head gives the figures the run's last (final-step)
    evaluation logged, within 3% (the same rows and settings: equal up to float summation order)."""
    import json

    import specheads.target
    from specheads.cli import main
    from specheads.target import tiny_target
    from specheads.train.prepare import prepare
    from specheads.train.trainer import run_training
    from test_prepare import _recipe, _sharegpt_file

    tiny_chat = tiny_target(vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer)
    over = ["train.max_steps=6", "train.batch_size=2", "train.lr=3e-3", "train.tracker=none", "eval.every_steps=0",
            "head.ttt_steps=2", "eval.tree_depth=2", "eval.batch_size=2"]
    recipe = _recipe(tmp_path, _sharegpt_file(tmp_path, n=30), *over)
    prepare(recipe, target=tiny_chat, progress=False)
    res = run_training(recipe, target=tiny_chat)
    last = res.history[-1]
    assert last["step"] == 6 and last["eval_samples"] >= 3
    monkeypatch.setattr(specheads.target, "load_target", lambda *a, **k: tiny_chat)
    assert main(["eval", "--head", str(tmp_path / "run" / "final"), "--dataset", f"heldout:{tmp_path / 'run'}",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["prompts"] == last["eval_samples"] and out["eval_rows"] == last["eval_rows"]
    for m in ("tau_chain", "tau_tree", "tau_chain_walk", "tau_tree_walk", "top1_0"):
        assert out[m] == pytest.approx(last[m], rel=0.03, abs=1e-3), m
    assert main(["eval", "--head", str(tmp_path), "--dataset", f"heldout:{tmp_path / 'nothing'}"]) == 2
    assert "train_config.yaml not found" in capsys.readouterr().err
