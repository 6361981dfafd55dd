"""`specheads eval`: a head's teacher-forced accuracy on the target's own answers, on the tiny target."""
import json

import pytest

from specheads.cli import main
from specheads.heads.base import HeadSpec, build_head

pytestmark = pytest.mark.usefixtures("one_thread")


class ByteTok:
    """One id per byte (3..252), no chat template: JSONL "prompt" rows are plain completions."""
    pad_token_id = 0
    eos_token_id = 2
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] + [3 + b % 250 for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_eval_command_on_tiny(tiny, tmp_path, monkeypatch, capsys, kind):
    import specheads.target

    tiny.tokenizer = ByteTok()
    monkeypatch.setattr(specheads.target, "load_target", lambda *a, **k: tiny)
    build_head(HeadSpec(kind=kind, **({"num_heads": 3} if kind == "medusa" else {})), tiny).save_pretrained(tmp_path / "head")
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["abc abc abc", "hello there", "1 2 3 4"]))
    assert main(["eval", "--head", str(tmp_path / "head"), "--dataset", str(data), "--limit", "2",
                 "--max-new-tokens", "6", "--dtype", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["kind"] == kind and out["prompts"] == 2 and 0 < out["answer_tokens"] <= 12
    assert 0 <= out["top1_0"] <= 1 and 1 <= out["tau_chain"] <= out["tau_tree"] + 1e-9
    assert main(["eval", "--head", str(tmp_path / "head"), "--dataset", str(data), "--limit", "1",
                 "--max-new-tokens", "4"]) == 0
    assert "| top1_0 |" in capsys.readouterr().out


def test_eval_bad_dataset_is_one_line(tmp_path, capsys):
    assert main(["eval", "--head", str(tmp_path), "--dataset", "sharegpt:x"]) == 2
    err = capsys.readouterr().err
    assert "--dataset sharegpt:x: expected sharegpt:START" in err and "Traceback" not in err
    assert main(["eval", "--head", str(tmp_path), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens 0: must be at least 1" in capsys.readouterr().err


def test_eval_refuses_a_prompt_longer_than_the_context_window_as_bench_does(tiny, tmp_path, monkeypatch, capsys):
    """issue 38: eval scored prompts longer than the target's context window as if they fitted, where generate
    and bench refuse them. Both now refuse the same prompt, naming it, before anything runs."""
    import specheads.target

    tiny.tokenizer = ByteTok()
    monkeypatch.setattr(specheads.target, "load_target", lambda *a, **k: tiny)
    build_head(HeadSpec(kind="eagle3"), tiny).save_pretrained(tmp_path / "head")
    data = tmp_path / "p.jsonl"
    window = tiny.max_positions
    data.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"id": "long", "prompt": "x" * window}) + "\n")
    want = (f"--dataset {data}: prompt long: {window + 1} tokens do not fit the context window of {window} of "
            f"target {tiny.name} (no room for a new token); shorten it or leave it out")
    assert main(["eval", "--head", str(tmp_path / "head"), "--dataset", str(data), "--dtype", "fp32"]) == 2
    assert capsys.readouterr().err.strip() == f"specheads eval: error: {want}"
    assert main(["bench", "--dataset", str(data), "--methods", "vanilla", "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"specheads bench: error: {want}"
    assert not (tmp_path / "b").exists()


def test_eval_answers_stop_at_the_context_window(tiny):
    """A prompt that fits is answered up to the window's end at most (bench's answers stop there too)."""
    from specheads.prompts import BenchPrompt
    from specheads.train.head_eval import target_answers

    tiny.tokenizer = ByteTok()
    window = tiny.max_positions
    prompt = BenchPrompt(id="p", category="all", turns=["y" * (window - 4)], chat=False)
    ((ids, answer),) = target_answers(tiny, [prompt], max_new_tokens=64, progress=False)
    assert len(ids) == window - 3 and len(ids) + len(answer) <= window


def test_eval_on_a_run_without_a_held_out_split_says_why(tmp_path, capsys):
    """issue 38: `eval --dataset heldout:RUN` on a run trained with data.val_fraction 0 printed an empty table; now
    one line saying the run has no held-out split, before any model loads."""
    from specheads.config import load_config, save_config
    from specheads.train.recipe import Recipe

    run = tmp_path / "run"
    save_config(load_config(Recipe, None, [f"output_dir={run}", "data.val_fraction=0"]), run / "train_config.yaml")
    assert main(["eval", "--head", str(run / "final"), "--dataset", f"heldout:{run}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"specheads eval: error: --dataset heldout:{run}: the run has no held-out split (data.val_fraction 0 in "
        f"{run / 'train_config.yaml'}), so there is nothing to score; give another --dataset (mt-bench, "
        f"sharegpt:START, a JSONL file)")


def test_dev_answers_equal_hf_generate_greedy(tiny):
    """The dev set's answers come from our plain decoding loop: in fp32 token for token HF generate's."""
    import torch

    from specheads.prompts import BenchPrompt
    from specheads.train.head_eval import target_answers

    tiny.tokenizer = ByteTok()
    prompts = [BenchPrompt(id=f"p{i}", category="all", turns=[t], chat=False) for i, t in enumerate(("ab" * 5, "xyz"))]
    for ids, answer in target_answers(tiny, prompts, max_new_tokens=24, progress=False):
        ref = tiny.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert answer == ref and len(answer) > 0
