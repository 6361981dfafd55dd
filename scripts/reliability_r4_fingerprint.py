"""Reliability sweep, round four (issue 49): a head on a target it was not trained for (other weights, other quantization).

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.

The fixture head records its target (specheads/target_record.py); the cases give generate, bench, eval and export a
copy of that target with one decoder tensor changed ("the same shapes, other weights", a fine-tune with frozen
embeddings, which the embedding / lm_head fingerprint alone never saw): refused in one line naming the head folder
and what differs, and with --allow-other-target run to the end under one warning (those rows run in a fresh
process, where the warning reaches stderr as a user sees it). A head folder written before the record loads with
the old check; another family is refused with the flag too.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

CHANGED = "model.layers.1.mlp.down_proj.weight"  # the decoder tensor the changed copy alters
REFUSED = "decoder weights differ in 1 of"
WARNED = "proceeding (--allow-other-target)"
FLAG = "--allow-other-target"


def _target_with(ctx, edit: Callable[[dict], None], name: str = "changed") -> Path:
    """{tmp}/<name>: the fixture target with `edit` applied to its tensors."""
    from safetensors.torch import load_file, save_file

    out = ctx.tmp / name
    shutil.copytree(ctx.base / "target", out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _scale(key: str) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        tensors[key] = tensors[key] * 1.05
    return edit


def _changed(h) -> Callable:
    def setup(ctx) -> None:
        h.head(ctx)
        _target_with(ctx, _scale(CHANGED))
    return setup


def _old_head(h, edit: Callable[[dict], None] | None = None) -> Callable:
    """The head as a folder written before the target record (config.json without `target_record`), and the
    target changed by `edit` when given."""
    def setup(ctx) -> None:
        head = h.head(ctx)
        config = json.loads((head / "config.json").read_text())
        del config["target_record"]
        (head / "config.json").write_text(json.dumps(config))
        if edit is not None:
            _target_with(ctx, edit)
    return setup


def _other_family(h) -> Callable:
    """The head and a target of another hidden size (the fixture's tokenizer and vocabulary)."""
    def setup(ctx) -> None:
        from specheads.target import tiny_target

        h.head(ctx)
        shutil.copytree(ctx.base / "target", ctx.tmp / "changed", ignore=shutil.ignore_patterns("*.safetensors"))
        tiny_target(vocab_size=49152, hidden_size=32, seed=1).model.save_pretrained(ctx.tmp / "changed")
    return setup


def _damaged_record(h) -> Callable:
    def setup(ctx) -> None:
        head = h.head(ctx)
        config = json.loads((head / "config.json").read_text())
        config["target_record"] = "abc"
        (head / "config.json").write_text(json.dumps(config))
    return setup


def _nothing_at(rel: str) -> Callable:
    def check(ctx) -> str:
        assert not (ctx.tmp / rel).exists(), f"{rel} was written"
        return f"nothing written at {rel}"
    return check


def _sidecar_holds_the_record(ctx) -> str:
    side = json.loads((ctx.tmp / "e3" / "specheads_target.json").read_text())
    head = json.loads((ctx.path("head") / "config.json").read_text())
    assert side["target_record"] == head["target_record"], "the export's record is not the head's"
    return "specheads_target.json holds the head's target record"


def cases(h) -> list[dict]:
    on = ["--target", "{tmp}/changed", "--head", "{head}"]
    generate = ["generate", *on, "--prompt", "hi", "--max-new-tokens", "2", "--tree", "2,2,4"]
    bench = ["bench", *on, "--methods", "head", "--limit", "1", "--max-new-tokens", "2", "--warmup-tokens", "0",
             "--tree", "2,2,4", "--out", "{tmp}/bench"]
    evaluate = ["eval", *on, "--limit", "1", "--max-new-tokens", "4", "--dtype", "fp32"]
    export = [*h.EXPORT, "--target", "{tmp}/changed", "--out", "{tmp}/e3"]
    commands = {"generate": (generate, "bench"), "bench": (bench, "bench"), "eval": (evaluate, "bench"),
                "export": (export, "e3")}
    rows = []
    for name, (argv, out) in commands.items():
        rows.append({"area": "fingerprint", "risk": "silent wrong result", "setup": _changed(h),
                     "name": f"{name} with a target whose decoder weights changed", "argv": argv, "rc": 2,
                     "expect": REFUSED, "check": _nothing_at(out)})
        rows.append({"area": "fingerprint", "risk": "unclear", "setup": _changed(h),
                     "name": f"{name} with a changed target and {FLAG}", "argv": argv + [FLAG], "rc": 0,
                     "expect": WARNED, "fresh_process": True})
    gen_same = generate[:2] + ["{target}"] + generate[3:]
    rows += [
        {"area": "fingerprint", "risk": "unclear", "name": "export of a head carries its target record",
         "setup": lambda c: h.head(c), "argv": [*h.EXPORT, "--out", "{tmp}/e3"], "rc": 0, "expect": "exported",
         "check": _sidecar_holds_the_record},
        {"area": "fingerprint", "risk": "traceback", "name": "old head without a target record loads",
         "setup": _old_head(h), "argv": gen_same, "rc": 0, "expect": "--- 2 tokens"},
        {"area": "fingerprint", "risk": "silent wrong result",
         "name": "old head without a target record, target embedding changed",
         "setup": _old_head(h, _scale("model.embed_tokens.weight")), "argv": generate, "rc": 2,
         "expect": "embedding / lm_head fingerprint differs"},
        {"area": "fingerprint", "risk": "silent wrong result", "name": f"another family with {FLAG}",
         "setup": _other_family(h), "argv": generate + [FLAG], "rc": 2, "expect": "hidden size 64 vs 32"},
        {"area": "fingerprint", "risk": "traceback", "name": "head config with a damaged target record",
         "setup": _damaged_record(h), "argv": gen_same, "rc": 2, "expect": "key 'target_record': expected null"},
    ]
    return rows
