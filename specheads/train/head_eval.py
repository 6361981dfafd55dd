"""Teacher-forced accuracy of a trained head on the target's own answers to benchmark prompts (`specheads eval`).

The target answers each prompt greedily (our decoding loop with the plain drafter: the owned forward and its
compiled kernels where the target runs them, as `specheads bench`'s `plain` answers); the head is then scored on those answers exactly as
`specheads train` scores it on its held-out split (train/evaluate.py: per-step top-1 / top-k, simulated τ of a
chain and of a tree, against the target's greedy token). Comparing the two separates a data shift (held-out
training data vs the benchmark's prompts) from an inference problem (teacher-forced accuracy far above the
acceptance `specheads bench` measures).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from specheads.prompts import BenchPrompt, first_turn_ids
from specheads.train.layout import resolve_layers

log = logging.getLogger(__name__)


@torch.no_grad()
def target_answers(target, prompts: list[BenchPrompt], max_new_tokens: int, progress: bool = True,
                   dataset: str = "") -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) per prompt: the prompt encoded as `specheads bench` encodes it, answered by
    our decoding loop with the plain drafter (bench's `plain`: the same tokens as HF generate in fp32, and the
    answers serving decodes in bf16, ~4.6x HF generate's speed on a bf16 CPU target) for at most max_new_tokens
    tokens, stopping at the target's end-of-sequence tokens. A prompt that does not fit the target's context window
    is refused before anything runs, as bench refuses it (specheads/prompts.first_turn_ids), and an answer stops
    where the window ends, as bench's do."""
    from tqdm.auto import tqdm

    from specheads.infer.drafters import build_drafter
    from specheads.infer.engine.generate import generate

    encoded = first_turn_ids(target, prompts, dataset or "(prompts)")
    window = target.max_positions or (1 << 62)
    out = []
    for ids in tqdm(encoded, desc="target answers", unit="prompt", disable=not progress):
        cap = min(max_new_tokens, window - len(ids))
        gen = generate(target, build_drafter(target, "plain"), ids, max_new_tokens=cap) if cap > 0 else None
        out.append((ids, gen.ids if gen is not None else []))
    return out


@torch.no_grad()
def answer_batch(target, prompt_ids: list[int], answer_ids: list[int], layers: list[int]) -> dict:
    """One collated sample: prompt + answer, the loss mask on the answer's tokens (as the assistant mask in
    training), and the target's features at `layers`."""
    from specheads.train.features import extract_features

    ids = torch.tensor([list(prompt_ids) + list(answer_ids)], device=target.device)
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, len(prompt_ids):] = 1
    b = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(ids)}
    b["hidden"] = extract_features(target, b["input_ids"], b["attention_mask"], layers)
    return b


def answer_batches(target, prompts: list[BenchPrompt], layers: list[int], max_new_tokens: int,
                   dataset: str = "") -> list[dict]:
    """One collated batch per prompt: the prompt plus the target's greedy answer, with features."""
    return [answer_batch(target, p, a, layers) for p, a in target_answers(target, prompts, max_new_tokens,
                                                                          dataset=dataset)]


def evaluate_head_on_prompts(target, head, prompts: list[BenchPrompt], max_new_tokens: int = 64,
                             tree_width: int = 2, tree_depth: int = 4, dataset: str = "",
                             block_tree_nodes: int = 16) -> dict[str, Any]:
    """Metrics of `head` on the target's answers to `prompts` (train/evaluate.py's, rounded to 4 places), with
    the rows counted. `dataset` names the prompts in errors (--dataset). block_tree_nodes: a block head's
    best-first tree scored beside its chain (`--tree tree:N`; 0 = off)."""
    from specheads.train.evaluate import EvalConfig, evaluate

    kind = head.config.kind
    layers = resolve_layers(target.num_layers, head.config.feature_layers, kind)
    batches = answer_batches(target, prompts, layers, max_new_tokens, dataset)
    cfg = EvalConfig(tree_width=tree_width, tree_depth=tree_depth, block_tree_nodes=block_tree_nodes)
    metrics = evaluate(kind, head, batches, target, layers, list(head.config.feature_layers), cfg)
    answer_tokens = int(sum(int(b["loss_mask"].sum()) for b in batches))
    return {"prompts": len(batches), "answer_tokens": answer_tokens, **{k: round(v, 4) for k, v in metrics.items()}}

