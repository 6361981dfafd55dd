"""The serving-true dev set of `specheads train`: prompts answered by the target exactly as `specheads bench`
answers them, scored teacher-forced with the held-out split's evaluation (train/evaluate.py) and its serving walk
(train/walk.py).

The held-out split is the training data's own distribution (its answers written as `prepare` wrote them, several
turns a sample, cut at data.max_length); serving answers one user turn with the target's greedy tokens up to
`--max-new-tokens`. The dev set removes those differences: first user turns (`eval.dev_dataset`, by default
`sharegpt-dev`, ShareGPT first turns balanced over MT-bench's eight kinds, none of the run's training
conversations), encoded as bench encodes them (prompts.encode_turn), answered greedily by HF `generate` (bench's
`vanilla`) for `eval.dev_max_new_tokens` tokens in the recipe's target dtype. The answers are token ids, written
once to <output_dir>/dev/answers.json (atomically; reused while the target, dtype and settings match) and their
features computed once per training process.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from specheads.prompts import load_prompts, load_sharegpt_dev
from specheads.train.layout import features_dir
from specheads.utils import SpecheadsError, atomic_write_json

log = logging.getLogger(__name__)

BENCHMARKS = ("mt-bench", "mt_bench", "mtbench", "humaneval", "human-eval")  # what the dev set must never be


def dev_settings(recipe, target) -> dict:
    """What the cached answers depend on (a mismatch regenerates them)."""
    ecfg = recipe.eval
    return {"dataset": ecfg.dev_dataset, "prompts": ecfg.dev_prompts, "max_new_tokens": ecfg.dev_max_new_tokens,
            "target": target.fingerprint(), "dtype": str(next(target.model.parameters()).dtype),
            "answered_by": "plain decoding loop"}  # was HF generate: bf16 answers may differ in the last tokens


def training_conversation_ids(recipe) -> set[str]:
    """Conversation ids of the run's prepared data (data/tokens of the run, and of the features folder's run)."""
    import datasets

    ids: set[str] = set()
    for root in {Path(recipe.output_dir), features_dir(recipe).parent}:
        tok = root / "data" / "tokens"
        if (tok / "dataset_info.json").exists():
            ids.update(datasets.load_from_disk(str(tok))["conversation_id"])
    return ids


def load_dev_prompts(recipe) -> list:
    ecfg = recipe.eval
    if ecfg.dev_dataset in BENCHMARKS:
        raise SpecheadsError(f"eval.dev_dataset: {ecfg.dev_dataset!r} is a benchmark we report; the dev set must be "
                             f"disjoint from it (sharegpt-dev, sharegpt:START or a JSONL file)")
    if ecfg.dev_dataset == "sharegpt-dev":
        return load_sharegpt_dev(ecfg.dev_prompts, exclude=training_conversation_ids(recipe))
    return load_prompts(ecfg.dev_dataset, ecfg.dev_prompts)


def dev_answers(recipe, target, progress: bool = True) -> list[dict]:
    """[{id, category, prompt_ids, answer_ids}] from <output_dir>/dev/answers.json, or generated and written there."""
    from specheads.train.head_eval import target_answers

    path = Path(recipe.output_dir) / "dev" / "answers.json"
    want = dev_settings(recipe, target)
    if path.exists():
        try:
            cached = json.loads(path.read_text())
            if cached.get("settings") == want:
                return cached["rows"]
            log.info("dev set: %s was made with other settings; answering again", path)
        except (json.JSONDecodeError, KeyError, TypeError):
            log.warning("dev set: %s is damaged; answering again", path)
    prompts = load_dev_prompts(recipe)
    pairs = target_answers(target, prompts, recipe.eval.dev_max_new_tokens, progress=progress,
                           dataset=f"eval.dev_dataset {recipe.eval.dev_dataset}")
    rows = [{"id": p.id, "category": p.category, "prompt_ids": pi, "answer_ids": ai}
            for p, (pi, ai) in zip(prompts, pairs)]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"settings": want, "rows": rows})
    log.info("dev set: %d prompts answered (%d tokens) -> %s", len(rows), sum(len(r["answer_ids"]) for r in rows),
             path)
    return rows


def dev_batches(rows: list[dict], target, layers: list[int], rank: int = 0, world: int = 1) -> list[dict]:
    """This process's share of the dev rows as one-sample batches with features; every process gets the same
    number of batches (a padding batch scores nothing), so a sharded head's collectives stay in step."""
    from specheads.train.head_eval import answer_batch

    per = -(-len(rows) // world)
    out = [answer_batch(target, r["prompt_ids"], r["answer_ids"], layers) for r in rows[rank::world]]
    pad = out[0] if out else answer_batch(target, rows[0]["prompt_ids"], rows[0]["answer_ids"], layers)
    while len(out) < per:
        out.append({**pad, "loss_mask": torch.zeros_like(pad["loss_mask"])})  # scores nothing, no second forward
    return out
