"""A new drafter kind from one new file: `--plugin FILE.py` registers it and `specheads bench --methods
drafter:NAME` (and `specheads generate --drafter NAME`) run it through the same loop and verification as every other
drafter. The toy drafter drafts the target's own greedy continuation (an oracle), so its answer is obvious: every
draft is accepted (τ = K + 1 per step, but for the answer's end) and the output equals plain decoding."""
import json
import sys

import pytest

TOY = '''
"""Toy oracle drafter: the target's own greedy continuation, K tokens as a chain."""
import torch

from specheads.infer.drafters import DrafterKind, register_drafter
from specheads.infer.engine.protocol import Drafter
from specheads.infer.tree import chain_tree


class ToyOracle(Drafter):
    name = "toy"

    def __init__(self, target, k):
        self.target, self.k = target, k

    @torch.no_grad()
    def propose(self, ctx):
        ids, out = list(ctx.ids), []
        for _ in range(min(self.k, ctx.max_depth)):
            logits = self.target.model(torch.tensor([ids])).logits[0, -1]
            out.append(int(logits.argmax()))
            ids.append(out[-1])
        return chain_tree(ctx.ids[-1], out)


register_drafter(DrafterKind("toy", "tokens", "toy oracle", lambda target, head, spec: ToyOracle(target, spec.num_tokens),
                             default_tree="3"))
'''


class ByteTok:
    pad_token_id = 0
    eos_token_id = None
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] + [3 + b % 250 for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture
def toy_env(tiny, tmp_path, monkeypatch):
    import specheads.target
    from specheads.infer.drafters import DRAFTERS

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    tiny.tokenizer = ByteTok()
    monkeypatch.setattr(specheads.target, "load_target", lambda *a, **k: tiny)
    monkeypatch.delitem(DRAFTERS, "toy", raising=False)
    monkeypatch.delitem(sys.modules, "specheads_plugin_toy_drafter", raising=False)  # imported once per process
    (tmp_path / "toy_drafter.py").write_text(TOY)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                    for p in ["abc abc abc", "hello there", "one two three"]))
    yield tmp_path
    DRAFTERS.pop("toy", None)
    sys.modules.pop("specheads_plugin_toy_drafter", None)


def test_bench_runs_a_plugin_drafter_kind(toy_env, capsys):
    from specheads.cli import main

    out = toy_env / "bench"
    rc = main(["bench", "--target", "tiny", "--dataset", str(toy_env / "prompts.jsonl"), "--plugin",
               str(toy_env / "toy_drafter.py"), "--methods", "vanilla,plain,drafter:toy", "--max-new-tokens", "12",
               "--warmup-tokens", "0", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    toy, plain = res["methods"]["drafter:toy"]["overall"], res["methods"]["plain"]["overall"]
    assert toy["identical"] == 1.0 and plain["identical"] == 1.0  # the same tokens as vanilla (fp32 greedy)
    assert plain["tau"] == 1.0
    # every draft accepted: 12 tokens in ceil(12 / 4) = 3 forwards per prompt (3 drafts + the bonus each)
    assert toy["new_tokens"] == 36 and toy["target_forwards"] == 9 and toy["tau"] == 4.0
    assert res["methods_info"]["drafter:toy"]["drafter"] == "toy"


def test_generate_takes_a_plugin_drafter(toy_env, capsys):
    from specheads.cli import main

    rc = main(["generate", "--plugin", str(toy_env / "toy_drafter.py"), "--drafter", "toy", "--tree", "2",
               "--prompt", "abc abc", "--raw", "--json", "--max-new-tokens", "9"])
    assert rc == 0, capsys.readouterr().err
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["new_tokens"] == 9 and stats["target_forwards"] == 3  # 2 drafts + the bonus per forward


def test_unknown_drafter_method_and_plugin_are_one_line(toy_env, capsys):
    from specheads.cli import main

    assert main(["bench", "--dataset", str(toy_env / "prompts.jsonl"), "--methods", "drafter:toy", "--out",
                 str(toy_env / "b")]) == 2
    err = capsys.readouterr().err
    assert "drafter:NAME for a registered drafter" in err and "Traceback" not in err
    assert main(["bench", "--plugin", str(toy_env / "nope.py"), "--out", str(toy_env / "b")]) == 2
    err = capsys.readouterr().err
    assert f"--plugin {toy_env / 'nope.py'}: no such file" in err and "Traceback" not in err
