"""Bad inputs through the real CLI, and the message each gets: writes docs/reliability.md and docs/reliability.json.

    python scripts/reliability_sweep.py                 # every case (minutes on 2 cores; the kill cases most)
    python scripts/reliability_sweep.py --only export   # cases whose area or name contains "export"
    python scripts/reliability_sweep.py --only kill --update   # those, merged into the recorded pages

Each case runs `specheads.cli.main(argv)` in a fresh folder on a tiny random Llama saved as a Hugging Face folder with
SmolLM2's tokenizer and chat template (the bundled target's, so prepare and generate run for real in seconds; its
lm_head scores only the answers' tokens, so that the fixture's EAGLE-3 run trains: `_speaks_the_answers`). A
case is a dict in CASES: `area`, `name` (the bad input), `argv` (placeholders {tmp} {run} {head} {target} {recipe}
{convs}), optional `setup(ctx)` that builds what the case needs, `rc` (expected exit code), `expect` (a fragment the
message must hold), optional `check(ctx)` (further facts: nothing deleted, nothing executed; returns a note),
`risk` (the class of failure it guards against: RISKS) and, from scripts/reliability_cases.py (the second table:
locks, damaged checkpoints, the OS refusing writes, targets, kills, ...) and scripts/reliability_table3.py (the
third: folders another process holds, checkpoint formats, eval against bench, symlinked outputs, GGUF files, endless
inputs, advice after a full disk), `during(ctx)`, `run(ctx, argv)` (a case that runs the CLI itself: (exit code,
stdout, stderr)) and `open`.
Add a row to cover a new bad input, then rerun the script: tests/test_reliability_sweep.py fails while the page and
the cases disagree.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "scripts"):  # this checkout's specheads, and reliability_cases beside this script
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import reliability_cases  # noqa: E402
import reliability_table3  # noqa: E402
from reliability_cli import run_in_process  # noqa: E402
from reliability_doc import RISKS, merge_rows, render_markdown  # noqa: E402

RECIPE = """command: specheads prepare --config {recipe}   # then: specheads train --config {recipe}
output_dir: {base}/prepared
target: {{name: {target}, dtype: float32}}
data: {{source: {convs}, max_length: 48, val_fraction: 0.25}}
features: {{shard_tokens: 200, batch_tokens: 128}}
head: {{kind: eagle3, draft_vocab_size: 64, eagle3: {{ttt_steps: 2}}}}
train: {{max_steps: 2, batch_size: 2, save_every: 1, warmup_steps: 0, tracker: none}}
eval: {{max_samples: 2, batch_size: 2, every_steps: 0}}
"""


class Ctx:
    """One case's folder ({tmp}) plus the shared fixtures (built once per sweep under `base`)."""

    def __init__(self, base: Path, tmp: Path):
        self.base, self.tmp = base, tmp
        self.vars = {"tmp": str(tmp), "run": str(tmp / "run"), "head": str(tmp / "head"),
                     "target": str(base / "target"), "recipe": str(base / "recipe.yaml"),
                     "convs": str(base / "convs.json"), "base": str(base)}

    def path(self, key: str) -> Path:
        return Path(self.vars[key])

    def copy(self, fixture: str, to: str = "run") -> Path:
        shutil.copytree(self.base / fixture, self.path(to))
        return self.path(to)


# ------------------------------------------------------------------------------------------------ fixtures

def _conversations(n: int, seed: str = "c") -> list[dict]:
    return [{"id": f"{seed}{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: " + "why? " * (i % 4)},
        {"from": "gpt", "value": f"Answer {i}. " + "Because. " * (i % 5 + 1)}]} for i in range(n)]


def _speaks_the_answers(model, tok, convs: list[dict]) -> None:
    """Zero the lm_head rows of every token the answers do not use. A random 49,152-token target's greedy token lies
    in the recipe's 64-token draft vocabulary (the answers' most frequent tokens) on ~0.1% of rows, and EAGLE-3's
    loss counts only rows whose target token the draft vocabulary holds: none did, so the loss was 0.0000 and the
    weights never moved. Now the other logits are 0 and the greedy token is one of the answers' (some of them
    score above 0 on every row), as a target trained on such data would choose."""
    import torch

    keep = sorted({i for c in convs for turn in c["conversations"] if turn["from"] == "gpt"
                   for i in tok(turn["value"], add_special_tokens=False)["input_ids"]})
    rows = torch.ones(model.lm_head.weight.shape[0], dtype=torch.bool)
    rows[keep] = False
    with torch.no_grad():
        model.lm_head.weight[rows] = 0.0


def _check_training_moved(trained: Path) -> None:
    """The fixture run must train: a nonzero loss and every weight of the head changing between its two
    checkpoints (the resume and checkpoint cases run on these weights; unchanging ones would prove nothing)."""
    import torch
    from safetensors.torch import load_file

    loss = json.loads((trained / "train_summary.json").read_text())["last_loss"]
    first, last = (load_file(str(p / "model.safetensors")) for p in sorted((trained / "checkpoints").glob("step-*")))
    still = [k for k in first if first[k].is_floating_point() and torch.equal(first[k], last[k])]
    if not loss or still:
        raise SystemExit(f"fixture train did not train: last loss {loss}, unchanged between its checkpoints: "
                         f"{still} (every row outside the draft vocabulary?)")


def build_fixtures(base: Path) -> None:
    """target/ (tiny Llama + SmolLM2 tokenizer, its lm_head restricted to the answers' tokens), convs.json,
    recipe.yaml, prepared/ (prepare), trained/ (train, checked to change the head's weights)."""
    from transformers import AutoTokenizer

    from specheads.target import resolve_target_path, tiny_target

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))
    convs = _conversations(12)
    t = tiny_target(vocab_size=len(tok), tokenizer=tok)
    t.model.config.eos_token_id = tok.eos_token_id
    _speaks_the_answers(t.model, tok, convs)
    t.model.save_pretrained(base / "target")
    tok.save_pretrained(base / "target")
    (base / "convs.json").write_text(json.dumps(convs))
    ctx = Ctx(base, base)
    (base / "recipe.yaml").write_text(RECIPE.format(**ctx.vars))
    for argv in (["prepare", "--config", ctx.vars["recipe"], "--no-progress"],
                 ["train", "--config", ctx.vars["recipe"]]):
        rc, out, err = run_in_process(argv)
        if rc != 0:
            raise SystemExit(f"fixture {' '.join(argv)} failed ({rc}):\n{err[-3000:]}")
    _check_training_moved(base / "prepared")
    shutil.copytree(base / "prepared", base / "trained")
    shutil.rmtree(base / "prepared" / "checkpoints")
    for name in ("best", "final"):
        shutil.rmtree(base / "prepared" / name)
    for name in ("train_summary.json", "train_config.yaml"):
        (base / "prepared" / name).unlink()


def _cli_process(argv: list[str]) -> tuple[int, str, str]:
    """The CLI in a fresh Python (for cases whose outcome depends on process-wide state that earlier in-process
    cases leave behind, such as torch.distributed's default group); a Python traceback is recorded as one."""
    import subprocess

    p = subprocess.run([sys.executable, "-m", "specheads", *argv], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    err = p.stderr
    if "Traceback (most recent call last)" in err:
        err = "TRACEBACK " + err
    return (-1 if err.startswith("TRACEBACK") else p.returncode), p.stdout, err


# -------------------------------------------------------------------------------------------- setup helpers

def _prepared(ctx: Ctx) -> None:
    ctx.copy("prepared")


def _trained(ctx: Ctx) -> Path:
    return ctx.copy("trained")


def _head(ctx: Ctx) -> Path:
    shutil.copytree(ctx.base / "trained" / "final", ctx.path("head"))
    return ctx.path("head")


def _edit_head_config(**changes) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        h = _head(ctx)
        cfg = json.loads((h / "config.json").read_text())
        for k, v in changes.items():
            if k.startswith("spec."):
                cfg["spec"][k[5:]] = v
            else:
                cfg[k] = v
        (h / "config.json").write_text(json.dumps(cfg))
    return setup


def _edit_head_weights(fn: Callable[[dict], None], keep_checksum: bool = False) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        from safetensors.torch import load_file, save_file

        h = _head(ctx)
        w = load_file(str(h / "model.safetensors"))
        fn(w)
        save_file(w, str(h / "model.safetensors"), metadata={"format": "pt", "kind": "eagle3"})
        if not keep_checksum:
            (h / "model.safetensors.sha256").unlink()
    return setup


def _bump_weight(w: dict) -> None:
    w["fc.weight"] = w["fc.weight"].clone()
    w["fc.weight"][0, 0] += 1.0


class _Payload:
    """Unpickling it would create the file `marker` (what a malicious checkpoint does)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _pickle_into(folder: Path, names: list[str], marker: Path) -> None:
    import torch

    for n in names:
        torch.save({"state": _Payload(str(marker))}, folder / n)


def _crafted_checkpoint(ctx: Ctx) -> None:
    run = ctx.copy("trained")
    ck = sorted((run / "checkpoints").glob("step-*"))[-1]
    _pickle_into(ck, ["custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "scheduler.bin"],
                 ctx.tmp / "pwned")


def _old_checkpoint(ctx: Ctx) -> None:
    run = ctx.copy("trained")
    ck = sorted((run / "checkpoints").glob("step-*"))[-1]
    for p in ck.iterdir():
        p.unlink()
    _pickle_into(ck, ["custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin"], ctx.tmp / "pwned")
    (ck / "trainer_state.json").write_text(json.dumps({"step": 2, "best_metric": None, "best_step": None,
                                                       "history": [], "num_processes": 1}))


def _pickled_weights(ctx: Ctx) -> None:
    h = _head(ctx)
    (h / "model.safetensors").unlink()
    _pickle_into(h, ["model.safetensors"], ctx.tmp / "pwned")


def _damaged_shard(ctx: Ctx) -> None:
    run = ctx.copy("prepared")
    shard = sorted((run / "features").glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))


def _other_data(ctx: Ctx) -> None:
    ctx.copy("prepared")
    (ctx.tmp / "other.json").write_text(json.dumps(_conversations(7, "o")))
    ctx.vars["state"] = json.dumps(_tree(ctx.path("run")))


def _empty_answers(ctx: Ctx) -> None:
    rows = _conversations(6)
    rows[1]["conversations"][1]["value"] = "  \n"
    rows[2]["conversations"][1]["value"] = ""
    (ctx.tmp / "convs.json").write_text(json.dumps(rows))


def _non_empty_out(ctx: Ctx) -> None:
    _head(ctx)
    (ctx.tmp / "out").mkdir()
    (ctx.tmp / "out" / "notes.txt").write_text("mine")


def _run_with_head(ctx: Ctx) -> None:
    ctx.copy("trained")
    ctx.vars["state"] = json.dumps(_tree(ctx.path("run")))


def _tree(folder: Path) -> dict:
    from specheads.utils import sha256_file

    return {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _unchanged(key: str = "run") -> Callable[[Ctx], str]:
    def check(ctx: Ctx) -> str:
        assert _tree(ctx.path(key)) == json.loads(ctx.vars["state"]), f"{key} folder changed"
        return "run folder unchanged"
    return check


def _not_executed(ctx: Ctx) -> str:
    assert not (ctx.tmp / "pwned").exists(), "the pickle ran"
    return "no code ran"


def _kept(rel: str) -> Callable[[Ctx], str]:
    def check(ctx: Ctx) -> str:
        assert (ctx.tmp / rel).exists(), f"{rel} was deleted"
        return f"{rel} kept"
    return check


def _nothing_written(ctx: Ctx) -> str:
    assert not ctx.path("run").exists(), "prepare wrote into the run folder before refusing"
    return "nothing written"


def _head_and_other_target(ctx: Ctx) -> None:
    """The head, and a second tiny target of the same shapes but other weights."""
    from specheads.target import tiny_target

    _head(ctx)
    shutil.copytree(ctx.base / "target", ctx.tmp / "other-target", ignore=shutil.ignore_patterns("*.safetensors"))
    tiny_target(vocab_size=49152, seed=1).model.save_pretrained(ctx.tmp / "other-target")


# ------------------------------------------------------------------------------------------------- the cases

TRAIN = ["train", "--config", "{recipe}", "output_dir={run}"]
PREPARE = ["prepare", "--no-progress", "--config", "{recipe}", "output_dir={run}"]
GENERATE = ["generate", "--target", "{target}", "--head", "{head}", "--prompt", "hi", "--max-new-tokens", "2",
            "--tree", "2,2,4"]
EXPORT = ["export", "--head", "{head}", "--format", "eagle3"]

CASES: list[dict[str, Any]] = [
    # recipes and overrides
    {"area": "config", "name": "override with a bad number", "argv": TRAIN + ["train.lr=abc"], "rc": 2,
     "expect": "override 'train.lr=abc': expected a number"},
    {"area": "config", "name": "override of an unknown key", "argv": TRAIN + ["train.learning_rate=1"], "rc": 2,
     "expect": "unknown key 'train.learning_rate'"},
    {"area": "config", "name": "eval.batch_size=0", "argv": TRAIN + ["eval.batch_size=0"], "rc": 2,
     "expect": "eval.batch_size: must be >= 1"},
    {"area": "config", "name": "train.lr=nan", "argv": TRAIN + ["train.lr=nan"], "rc": 2,
     "expect": "train.lr: must be > 0, got nan"},
    {"area": "config", "name": "data.val_fraction=1.5", "argv": PREPARE + ["data.val_fraction=1.5"], "rc": 2,
     "expect": "data.val_fraction: must be in [0,1)"},
    {"area": "config", "name": "unknown key in the recipe file",
     "setup": lambda c: (c.tmp / "r.yaml").write_text("trian:\n  lr: 1\n"),
     "argv": ["train", "--config", "{tmp}/r.yaml"], "rc": 2, "expect": "r.yaml: unknown key(s) ['trian']"},
    {"area": "config", "name": "recipe file is not YAML",
     "setup": lambda c: (c.tmp / "r.yaml").write_text("train: [1, 2\n"),
     "argv": ["train", "--config", "{tmp}/r.yaml"], "rc": 2, "expect": "not valid YAML"},
    {"area": "config", "name": "recipe file missing", "argv": ["train", "--config", "{tmp}/none.yaml"], "rc": 2,
     "expect": "config file not found"},
    # prepare
    {"area": "prepare", "name": "data.source missing", "argv": PREPARE + ["data.source={tmp}/none.json"], "rc": 2,
     "expect": "file not found", "check": _nothing_written},
    {"area": "prepare", "name": "data.source is not JSON",
     "setup": lambda c: (c.tmp / "x.json").write_text("hello"), "argv": PREPARE + ["data.source={tmp}/x.json"],
     "rc": 2, "expect": "not valid JSON at line 1"},
    {"area": "prepare", "name": "every row malformed",
     "setup": lambda c: (c.tmp / "x.jsonl").write_text('{"messages": []}\n{"messages": [{"role": "user"}]}\n'),
     "argv": PREPARE + ["data.source={tmp}/x.jsonl"], "rc": 2, "expect": "no usable conversation"},
    {"area": "prepare", "name": "empty and whitespace assistant turns", "setup": _empty_answers,
     "argv": PREPARE + ["data.source={tmp}/convs.json"], "rc": 0, "expect": "empty answers skipped"},
    {"area": "prepare", "name": "other data into a prepared run", "setup": _other_data,
     "argv": PREPARE + ["data.source={tmp}/other.json"], "rc": 2, "expect": "holds features of other data",
     "check": _unchanged()},
    {"area": "prepare", "name": "features.dir without a manifest", "argv": PREPARE + ["features.dir={tmp}/nothing"],
     "rc": 2, "expect": "no manifest.json"},
    # train
    {"area": "train", "name": "train before prepare", "argv": TRAIN, "rc": 2, "expect": "run `specheads prepare"},
    {"area": "train", "name": "checkpoints there, no --resume", "setup": _run_with_head, "argv": TRAIN, "rc": 2,
     "expect": "pass --resume", "check": _unchanged()},
    {"area": "train", "name": "--resume without a checkpoint", "setup": _prepared, "argv": TRAIN + ["--resume"],
     "rc": 2, "expect": "--resume: no checkpoint"},
    {"area": "train", "name": "crafted pickles in the newest checkpoint", "setup": _crafted_checkpoint,
     "argv": TRAIN + ["train.max_steps=3", "--resume"], "rc": 0, "expect": "trained 3 steps",
     "check": _not_executed},
    {"area": "train", "name": "checkpoint of accelerate's pickles only", "setup": _old_checkpoint,
     "argv": TRAIN + ["train.max_steps=3", "--resume"], "rc": 2, "expect": "written by an older specheads",
     "check": _not_executed},
    {"area": "train", "name": "feature shard with a flipped byte", "setup": _damaged_shard, "argv": TRAIN, "rc": 2,
     "expect": "sha256 differs from the manifest's"},
    {"area": "train", "name": "train.deepspeed file missing", "setup": _prepared,
     "argv": TRAIN + ["train.deepspeed={tmp}/ds.json"], "rc": 2, "expect": "train.deepspeed"},
    {"area": "train", "name": "Medusa-2 LoRA on an EAGLE-3 head", "setup": _prepared,
     "argv": TRAIN + ["train.lora.enabled=true", "features.mode=online"], "rc": 2, "expect": "need head.kind medusa"},
    {"area": "train", "name": "data.val_fraction=0 (no held-out split)", "setup": _prepared,
     "argv": TRAIN + ["data.val_fraction=0", "features.mode=online"], "rc": 0,
     "expect": "no held-out split: best/ not written"},
    # export
    {"area": "export", "name": "--out holds other files", "setup": _non_empty_out, "argv": EXPORT + ["--out", "{tmp}/out"],
     "rc": 2, "expect": "not empty and not an earlier eagle3 export", "check": _kept("out/notes.txt")},
    {"area": "export", "name": "--out is the run folder holding the head", "setup": _run_with_head,
     "argv": ["export", "--head", "{run}/final", "--format", "eagle3", "--out", "{run}", "--force"], "rc": 2,
     "expect": "contains the source folder", "check": _unchanged()},
    {"area": "export", "name": "--out is the head folder", "setup": _head, "argv": EXPORT + ["--out", "{head}"],
     "rc": 2, "expect": "is the source folder"},
    {"area": "export", "name": "--out inside the head folder", "setup": _head,
     "argv": EXPORT + ["--out", "{head}/sglang"], "rc": 2, "expect": "is inside the source folder"},
    {"area": "export", "name": "format for another head kind", "setup": _head,
     "argv": ["export", "--head", "{head}", "--format", "medusa-vllm", "--out", "{tmp}/o"], "rc": 2,
     "expect": "needs a medusa head"},
    {"area": "export", "name": "--head folder missing", "argv": EXPORT + ["--out", "{tmp}/o"], "rc": 2,
     "expect": "head folder not found"},
    {"area": "export", "name": "--head without --format", "setup": _head,
     "argv": ["export", "--head", "{head}", "--out", "{tmp}/o"], "rc": 2, "expect": "--format: required"},
    {"area": "export", "name": "--import without --target", "setup": _head,
     "argv": ["export", "--import", "{head}", "--out", "{tmp}/o"], "rc": 2, "expect": "needs --target"},
    {"area": "export", "name": "--speculative-tokens 0", "setup": _head,
     "argv": ["export", "--head", "{head}", "--format", "speculators", "--out", "{tmp}/o", "--speculative-tokens",
              "0"], "rc": 2, "expect": "must be >= 1"},
    # head folders, read by generate
    {"area": "head", "name": "hidden_size as a string", "setup": _edit_head_config(hidden_size="64"),
     "argv": GENERATE, "rc": 2, "expect": "key 'hidden_size': expected a positive integer, got '64'"},
    {"area": "head", "name": "feature_layers beyond the target's layers",
     "setup": _edit_head_config(feature_layers=[2, 9, 40], **{"spec.feature_layers": [2, 9, 40]}),
     "argv": GENERATE, "rc": 2, "expect": "key 'feature_layers': [9, 40] outside 0..4"},
    {"area": "head", "name": "draft_vocab_size above the vocab", "setup": _edit_head_config(draft_vocab_size=10 ** 6),
     "argv": GENERATE, "rc": 2, "expect": "key 'draft_vocab_size'"},
    {"area": "head", "name": "d2t ids beyond the vocab",
     "setup": _edit_head_weights(lambda w: w.update(d2t=w["d2t"] + 10 ** 6)), "argv": GENERATE, "rc": 2,
     "expect": "key 'd2t': expected strictly increasing target ids"},
    {"area": "head", "name": "weights changed after saving", "setup": _edit_head_weights(_bump_weight, True),
     "argv": GENERATE, "rc": 2, "expect": "recorded in model.safetensors.sha256"},
    {"area": "head", "name": "model.safetensors is a pickle", "setup": _pickled_weights, "argv": GENERATE, "rc": 2,
     "expect": "not a readable safetensors file", "check": _not_executed},
    {"area": "head", "name": "head trained for another target", "setup": _head_and_other_target,
     "argv": GENERATE[:2] + ["{tmp}/other-target"] + GENERATE[3:], "rc": 2, "expect": "head was trained for target"},
    # draft tree specs and sampling parameters (infer/treespec.py, infer/verify.SamplingParams)
    *[{"area": "tree", "name": f"EAGLE --tree {spec}", "setup": _head, "argv": GENERATE[:-2] + [f"--tree={spec}"], "rc": 2,
       "expect": expect} for spec, expect in (("3,100000,10", "TOP_K 100000 is above the head's draft vocabulary of 64"), ("0,0,0", "DEPTH 0 is outside 1..64"), ("-1,8,48", "DEPTH -1 is outside 1..64"),
                                              ("3,0,10", "TOP_K 0 must be at least 1"), ("chain:0", "the chain length K 0 is outside 1..64"), ("chain:x", "expected chain:K with K a whole number"),
                                              ("[[100000]]", "rank 100000 is beyond the head's draft vocabulary of 64"))],
    *[{"area": "tree", "name": name, "argv": ["generate", "--target", "{target}", "--prompt", "hi",
                                              "--max-new-tokens", "2", *extra], "rc": 2, "expect": expect}
      for name, extra, expect in (
          ("prompt lookup --tree 0", ["--drafter", "prompt-lookup", "--tree", "0"], "the number of draft tokens 0 is outside 1..64"),
          ("prompt lookup --tree -3", ["--drafter", "prompt-lookup", "--tree=-3"], "the number of draft tokens -3 is outside 1..64"),
          ("draft model --draft-layers 0", ["--drafter", "draft-model", "--draft-layers", "0"], "--draft-layers 0: must be at least 1"),
          ("--temperature nan", ["--temperature", "nan"], "--temperature nan: must be a finite number"),
          ("--temperature inf", ["--temperature", "inf"], "--temperature inf: must be a finite number"),
          ("--top-p 0", ["--temperature", "1", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"))],
    {"area": "tree", "name": "--lookup -4 with a head", "setup": _head, "argv": GENERATE + ["--lookup", "-4"], "rc": 2,
     "expect": "--lookup -4: must be 0 (off) .. 64"},
]

# The class of failure each case of the table above guards against (RISKS; the second table's cases say it
# themselves): what would happen had the check not been there.
_RISK_BY_AREA = {"config": "unclear", "prepare": "traceback", "train": "traceback", "export": "traceback",
                 "head": "silent wrong result", "tree": "traceback"}
_RISK_CASES = {
    "data loss": ["other data into a prepared run", "checkpoints there, no --resume", "--out holds other files",
                  "--out is the run folder holding the head", "--out is the head folder",
                  "--out inside the head folder"],
    "silent wrong result": ["override of an unknown key", "train.lr=nan", "data.val_fraction=1.5",
                            "empty and whitespace assistant turns", "crafted pickles in the newest checkpoint",
                            "checkpoint of accelerate's pickles only", "feature shard with a flipped byte",
                            "Medusa-2 LoRA on an EAGLE-3 head", "--speculative-tokens 0", "--temperature nan",
                            "--temperature inf"],
    "traceback": ["eval.batch_size=0", "recipe file missing", "hidden_size as a string"],
    "unclear": ["train before prepare", "every row malformed", "data.val_fraction=0 (no held-out split)",
                "--head without --format"],
}
RISK = {c["name"]: _RISK_BY_AREA[c["area"]] for c in CASES}
RISK.update({name: risk for risk, names in _RISK_CASES.items() for name in names})
assert set(RISK) == {c["name"] for c in CASES} and set(RISK.values()) <= set(RISKS)

# The helpers the second table's cases use (reliability_cases.cases(h): it imports nothing of this module).
HELPERS = SimpleNamespace(TRAIN=TRAIN, PREPARE=PREPARE, GENERATE=GENERATE, EXPORT=EXPORT, head=_head,
                          trained=_trained, prepared=_prepared, kept=_kept, tree=_tree, not_executed=_not_executed,
                          nothing_written=_nothing_written, conversations=_conversations)
CASES += reliability_cases.cases(HELPERS)
CASES += reliability_table3.cases(HELPERS)  # issue 38's classes (a third table, the same helpers)
# issue 49's classes (round four), one module per class, each `cases(h)` over the same helpers, all recorded in
# docs/reliability.json (a module written but not yet recorded stays out of ROUND4_RECORDED until its
# `--only AREA --update` run; `--round4` runs every module whatever this says).
ROUND4 = ("kernels", "profiles", "limits", "fingerprint", "signals", "kinds", "hub", "data", "dist", "parts",
          "endpoint", "vllm", "launch")
ROUND4_RECORDED: tuple[str, ...] = ROUND4  # every module recorded (--only AREA --update for each)
ROUND4_CASES = {_name: importlib.import_module(f"reliability_r4_{_name}").cases(HELPERS) for _name in ROUND4}
for _name in ROUND4_RECORDED:
    CASES += ROUND4_CASES[_name]


# ------------------------------------------------------------------------------------------------- running

def _normalise(text: str, ctx: Ctx) -> str:
    for key in ("tmp", "base"):
        text = text.replace(str(Path(ctx.vars[key]).resolve()), f"<{key}>").replace(ctx.vars[key], f"<{key}>")
    text = re.sub(r"\bpid \d+", "pid <pid>", text)
    text = re.sub(r"\d+\.\d+ tok/s", "<n> tok/s", text)
    text = re.sub(r"(\.tmp-)[A-Za-z0-9_]+", r"\1<x>", text)  # a temporary file's random name
    return re.sub(r"\b[0-9a-f]{12,}\b", "<hex>", text)


def run_case(case: dict, base: Path) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="case-", dir=base))
    ctx = Ctx(base, tmp)
    t = time.perf_counter()
    if case.get("setup"):
        case["setup"](ctx)
    argv = [a.format(**ctx.vars) for a in case["argv"]]
    if case.get("run"):  # a case that runs the CLI itself (the kill cases: processes killed and rerun)
        rc, out, err = case["run"](ctx, argv)
    else:
        with case["during"](ctx) if case.get("during") else contextlib.nullcontext():
            rc, out, err = _cli_process(argv) if case.get("fresh_process") else run_in_process(argv)
    lines = (out + err).splitlines()
    if rc != 0:
        msg = next((ln for ln in reversed(lines) if ": error: " in ln), None)
        if "TRACEBACK" in err:
            msg = "TRACEBACK " + err.strip().splitlines()[-1]
        msg = msg or (lines[-1] if lines else "")
    else:
        msg = next((ln for ln in lines if case["expect"] in ln), lines[-1] if lines else "")
    msg = re.sub(r"^.*?(?=specheads \w+: error: )", "", msg)  # a progress bar's \r line before it
    last = err.strip().splitlines()[-1] if err.strip() else ""
    one_line = rc == 0 or (bool(last) and last.endswith(msg))  # the error is the last line
    ok, note = rc == case["rc"] and case["expect"] in msg and "Traceback" not in err and one_line, ""
    if ok and case.get("check"):
        try:
            note = case["check"](ctx) or ""
        except AssertionError as e:
            ok, note = False, f"FAILED: {e}"
    row = {"area": case["area"], "name": case["name"], "risk": case.get("risk") or RISK[case["name"]],
           "command": case.get("command") or "specheads " + " ".join(case["argv"]), "rc": rc, "expected_rc": case["rc"],
           "expected": case["expect"], "message": _normalise(msg.strip(), ctx), "also": _normalise(note, ctx), "ok": ok,
           "open": case.get("open", ""), "seconds": round(time.perf_counter() - t, 1)}
    shutil.rmtree(tmp, ignore_errors=True)
    return row


def sweep(only: str | None = None, base: Path | None = None, names: list[str] | None = None) -> list[dict]:
    """Run the selected cases (all by default) and return their rows."""
    logging.getLogger().addHandler(logging.NullHandler())  # the CLI's logging stays out of the captured streams
    own = base is None
    base = Path(tempfile.mkdtemp(prefix="specheads-sweep-")) if own else base
    try:
        if not (base / "trained").exists():
            build_fixtures(base)
        terms = only.split(",") if only else []  # --only a,b: the cases of either
        cases = [c for c in CASES if (not terms or any(t in c["area"] or t in c["name"] for t in terms))
                 and (names is None or c["name"] in names)]
        return [run_case(c, base) for c in cases]
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="run the cases whose area or name contains this (several: comma-separated)")
    ap.add_argument("--update", action="store_true",
                    help="with --only: merge the rows run into the recorded reliability.json (the other cases keep "
                         "their recorded rows) and rewrite both pages")
    ap.add_argument("--out", default=str(ROOT / "docs"), help="folder for reliability.md and reliability.json")
    ap.add_argument("--round4", action="store_true", help="every round-four module's cases too (ROUND4)")
    a = ap.parse_args(argv)
    if a.round4:
        CASES.extend(c for m in ROUND4 if m not in ROUND4_RECORDED for c in ROUND4_CASES[m])
    t = time.perf_counter()
    rows = sweep(a.only)
    out = Path(a.out)
    if a.only is None or a.update:
        recorded = rows if a.only is None else merge_rows(json.loads((out / "reliability.json").read_text()),
                                                          rows, CASES)
        out.mkdir(parents=True, exist_ok=True)
        (out / "reliability.json").write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "seconds"} for r in recorded], indent=2) + "\n")
        (out / "reliability.md").write_text(render_markdown(recorded))
    for r in rows:
        print(f"{'ok ' if r['ok'] else 'OPEN' if r['open'] else 'BAD'} {r['seconds']:5.1f}s  {r['area']:8s} {r['name']}: {r['message']}")
    wrote = f"; wrote {out}/reliability.md" if a.only is None or a.update else ""
    print(f"{len(rows)} cases in {time.perf_counter() - t:.0f} s{wrote}")
    return 0 if all(r["ok"] or r["open"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
