"""TRL's check after training, shared by the head-kind tests: train a head with the real Trainer, then every
trainable parameter (or the names a test expects) has moved and the frozen target has not."""
from __future__ import annotations

import torch


def train_checked(recipe, target, head, data, val, expect_changed: set[str] | None = None):
    """Trainer(recipe, target, head, data, val).train() -> (result, changed names); asserts changed ==
    expect_changed (default: the head's trainable parameters) and the target's state bit-identical."""
    from specheads.train.trainer import Trainer

    before = {k: v.clone() for k, v in head.state_dict().items()}
    target_before = {k: v.clone() for k, v in target.model.state_dict().items()}
    res = Trainer(recipe, target, head, data, val).train()
    after = head.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    want = expect_changed if expect_changed is not None else {
        n for n, p in head.named_parameters() if p.requires_grad}
    assert changed == want, ("moved but frozen", changed - want, "trainable but unmoved", want - changed)
    now = target.model.state_dict()
    assert all(torch.equal(v, now[k]) for k, v in target_before.items()), "the frozen target changed"
    return res, changed
