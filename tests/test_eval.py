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
    build_head(HeadSpec(kind=kind, num_heads=3), tiny).save_pretrained(tmp_path / "head")
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
