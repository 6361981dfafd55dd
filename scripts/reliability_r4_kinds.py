"""Reliability sweep, round four (issue 49): the newer kinds' settings out of range and the exports that cannot carry them.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.

The kinds here: DFlash2, DSpine, LiLiCorr, Domino, P-EAGLE, EAGLE-3.1 (heads/<kind>.py; their ranges are their
options' LIMITS and checks, tests/test_kind_limits.py tries every one). A case's head of a kind is the kind's
KindSpec.example built on the sweep's target; its recipe is the sweep's with the head: section of that example.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import yaml


def example(kind: str, **changes) -> dict:
    """The kind's example head: section (KindSpec.example) with `changes` to its own settings."""
    from specheads.heads.kinds import kind_spec

    ex = json.loads(json.dumps(kind_spec(kind).example))
    if kind_spec(kind).options is not None:
        ex[kind] = {**ex.get(kind, {}), **changes}
    return {"kind": kind, **ex}


def kind_recipe(kind: str) -> Callable:
    """{tmp}/r.yaml: the sweep's recipe with a head: section of `kind` (its example)."""
    def setup(ctx) -> None:
        recipe = yaml.safe_load(Path(ctx.vars["recipe"]).read_text())
        recipe["head"] = example(kind)
        (ctx.tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    return setup


def kind_head(kind: str, edit: dict[str, Any] | None = None, **changes) -> Callable:
    """{head}: a head of `kind` (its example with `changes`) on the sweep's target; `edit` then sets keys of its
    own settings in config.json's spec (what a hand edit of the folder does)."""
    def setup(ctx) -> None:
        from specheads import load_target
        from specheads.heads import HeadSpec, build_head

        t = load_target(ctx.vars["target"], dtype="float32")
        build_head(HeadSpec(**example(kind, **changes)), t).save_pretrained(ctx.path("head"))
        if edit:
            path = ctx.path("head") / "config.json"
            cfg = json.loads(path.read_text())
            cfg["spec"][kind].update(edit)
            path.write_text(json.dumps(cfg))
    return setup


def nothing_at(rel: str) -> Callable:
    def check(ctx) -> str:
        assert not (ctx.tmp / rel).exists(), f"{rel} was written"
        return f"nothing written at {rel}"
    return check


def cases(h) -> list[dict]:
    TRAIN = ["train", "--config", "{tmp}/r.yaml", "output_dir={run}"]

    def setting(kind: str, override: str, expect: str, risk: str = "silent wrong result") -> dict:
        return {"area": "kinds", "risk": risk, "name": f"{kind} recipe with {override}", "setup": kind_recipe(kind),
                "argv": TRAIN + [override], "rc": 2, "expect": f"override '{override}': {expect}",
                "check": h.nothing_written}

    def export(kind: str, fmt: str, expect: str, risk: str = "traceback", name: str = "", **changes) -> dict:
        """`expect`: the refusal's reason (after "--format FMT: ", which the generic refusals follow with the
        head folder)."""
        return {"area": "kinds", "risk": risk, "name": f"export --format {fmt} of {name or 'a ' + kind} head",
                "setup": kind_head(kind, **changes),
                "argv": ["export", "--head", "{head}", "--format", fmt, "--out", "{tmp}/o"], "rc": 2,
                "expect": expect, "check": nothing_at("o")}

    return [
        # the kinds' own settings out of range, by dotted override (each names the field and its range)
        setting("dflash2", "head.dflash2.block_size=0", "head.dflash2.block_size: must be >= 1, got 0"),
        setting("dflash2", "head.dflash2.conv_kernel_size=9",
                "head.dflash2.conv_kernel_size: 9 taps exceed the block's 4 slots"),
        setting("dspine", "head.dspine.write_std=inf", "head.dspine.write_std: expected a finite number, got inf"),
        setting("lilicorr", "head.lilicorr.vector_eps=0.5", "head.lilicorr.vector_eps: must be in (0,0.5), got 0.5"),
        setting("domino", "head.domino.prefix_len=9", "head.domino.prefix_len: must be in 0..4 (the drafts), got 9"),
        setting("peagle", "head.peagle.num_depths=0", "head.peagle.num_depths: must be >= 1, got 0"),
        setting("eagle3", "head.eagle3.fc_norm=3", "expected true/false, got 3", "unclear"),
        setting("dspine", "train.block.dspine_replace_prob=1.5",
                "train.block.dspine_replace_prob: must be in [0,1], got 1.5"),
        # a head folder whose config.json holds a value out of range: the file and the key named
        {"area": "kinds", "risk": "silent wrong result", "name": "dflash2 head folder with selector_top_k 0",
         "setup": kind_head("dflash2", edit={"selector_top_k": 0}),
         "argv": ["export", "--head", "{head}", "--format", "speculators", "--out", "{tmp}/o"], "rc": 2,
         "expect": "config.json: key 'spec': head.dflash2.selector_top_k: must be >= 1, got 0",
         "check": nothing_at("o")},
        # formats that cannot carry the kind: refused with the reason, nothing written
        export("dflash2", "specforge", "SpecForge 0.2.0 has no DFlash2 draft model"),
        export("dspine", "speculators", "speculators 0.9.0 has no DSpine model"),
        export("peagle", "eagle3", "holds a peagle head (exported as native, speculators)"),
        export("domino", "speculators", "speculators 0.9.0 has no Domino model"),
        export("lilicorr", "modelopt", "cannot be exported for vLLM's LiLiCorrForCausalLM (vllm): head.lilicorr.candidate_topk 6",
               risk="silent wrong result", name="a lilicorr (6 candidates)",
               candidate_topk=6),
        export("lilicorr", "gguf", "holds a lilicorr head; llama.cpp drafts with ['dflash2', 'dspark', 'eagle3'] "
               "heads (the pinned llama.cpp has no LiLiCorr reader"),
        export("domino", "gguf", "holds a domino head; llama.cpp drafts with ['dflash2', 'dspark', 'eagle3'] "
               "heads (the pinned llama.cpp (0c1e570) has no Domino reader"),
        export("eagle3", "gguf", "is an EAGLE-3.1 head (head.fc_norm)", risk="silent wrong result", name="an EAGLE-3.1",
               fc_norm=True),
    ]
