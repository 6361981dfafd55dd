"""D-PACE block position weights (speculators `dpace_loss_decay`) on hand-written logits whose weights are obvious,
its reduction inside dspark_loss, the train.block.weighting setting, and a train step on the tiny target with it."""
from __future__ import annotations

import math

import pytest
import torch

from specheads.train.losses import dpace_position_weights, dspark_loss

BIG = 30.0  # a logit this far above the others puts probability ~1 on its token


def _logits(rows: list[list[tuple[int, float]]], V: int = 4) -> torch.Tensor:
    """[N,K',V] logits: draft j puts logit `height` on `token` and 0 elsewhere."""
    out = torch.zeros(len(rows), len(rows[0]), V)
    for n, row in enumerate(rows):
        for j, (tok, height) in enumerate(row):
            out[n, j, tok] = height
    return out


def test_dpace_weights_by_hand():
    q = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])
    valid = torch.ones(3, 3, dtype=torch.bool)
    w = dpace_position_weights(q, valid, alpha=0.5)
    # a sure drafter: s = 1, P = 1, w_j = the counted drafts from j on
    assert torch.allclose(w[0], torch.tensor([3.0, 2.0, 1.0]))
    # a hopeless one: s = α = 0.5, P = 0.5, 0.25, 0.125
    assert torch.allclose(w[1], torch.tensor([0.875, 0.375, 0.125]))
    # wrong at draft 1: s = 1, 0.5, 1 -> P = 1, 0.5, 0.5
    assert torch.allclose(w[2], torch.tensor([2.0, 1.0, 0.5]))
    # α = 1 ignores the confidence
    assert torch.allclose(dpace_position_weights(q, valid, alpha=1.0), torch.tensor([[3.0, 2.0, 1.0]] * 3))


def test_dpace_weights_skip_drafts_that_do_not_count_and_have_no_gradient():
    q = torch.tensor([[0.0, 1.0, 1.0, 1.0]], requires_grad=True)
    valid = torch.tensor([[True, True, False, False]])
    w = dpace_position_weights(q, valid, alpha=0.5)
    assert torch.allclose(w, torch.tensor([[0.5 + 0.5, 0.5, 0.0, 0.0]]))
    assert not w.requires_grad


def test_dspark_loss_dpace_reduction_by_hand():
    """One block of 3 drafts: draft 0 sure and right, draft 1 sure and wrong, draft 2 uniform. With soft CE alone
    and a one-hot target, ℓ_j = -log q_j(target token): 0, BIG, log V. D-PACE: s = 1, α, (1-α)/V + α."""
    V, a = 4, 0.5
    target = _logits([[(1, BIG), (2, BIG), (3, BIG)]], V) * 10  # one-hot targets 1, 2, 3
    draft = _logits([[(1, BIG), (0, BIG), (0, 0.0)]], V)
    valid = torch.ones(1, 3, dtype=torch.bool)
    from specheads.train.losses import DistillLoss, parse_loss

    soft_ce = DistillLoss(parse_loss("soft_ce:1"))
    out = dspark_loss(draft, None, target, target.logsumexp(-1), valid.clone(), valid, loss=soft_ce,
                      weighting="dpace", dpace_alpha=a)
    s = [1.0, a, (1 - a) / V + a]
    P = [s[0], s[0] * s[1], s[0] * s[1] * s[2]]
    w = [P[0] + P[1] + P[2], P[1] + P[2], P[2]]
    ce = [0.0, BIG, math.log(V)]
    want = sum(wi * ci for wi, ci in zip(w, ce)) / 3  # divided by the counted drafts, not Σ w
    assert out.loss.item() == pytest.approx(want, rel=1e-4)
    exp = dspark_loss(draft, None, target, target.logsumexp(-1), valid.clone(), valid, loss=soft_ce, gamma=4.0)
    e = [math.exp(-j / 4.0) for j in range(3)]
    assert exp.loss.item() == pytest.approx(sum(ei * ci for ei, ci in zip(e, ce)) / sum(e), rel=1e-4)


def test_dspark_loss_dpace_gradient_flows_through_the_loss_not_the_weights():
    V = 4
    target = _logits([[(1, BIG), (2, BIG)]], V)
    draft = torch.zeros(1, 2, V, requires_grad=True)
    valid = torch.ones(1, 2, dtype=torch.bool)
    out = dspark_loss(draft, None, target, target.logsumexp(-1), valid.clone(), valid, weighting="dpace")
    out.loss.backward()
    assert draft.grad is not None and draft.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="weighting"):
        dspark_loss(draft, None, target, target.logsumexp(-1), valid.clone(), valid, weighting="linear")


def test_weighting_setting_is_validated():
    from specheads.train.settings import BlockTrainConfig
    from specheads.utils import SpecheadsError

    assert BlockTrainConfig().weighting == "exp"
    assert BlockTrainConfig(weighting="dpace", dpace_alpha=1.0).dpace_alpha == 1.0
    with pytest.raises(SpecheadsError, match="train.block.weighting"):
        BlockTrainConfig(weighting="linear")
    with pytest.raises(SpecheadsError, match="train.block.dpace_alpha"):
        BlockTrainConfig(weighting="dpace", dpace_alpha=0.0)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_train_steps_with_dpace_on_the_tiny_target(tiny, tmp_path, kind):
    """TRL style: after a few D-PACE steps every trainable parameter moved and the frozen target did not."""
    from specheads.config import load_config
    from specheads.heads import build_head
    from specheads.train.recipe import Recipe
    from tests.test_dspark import _greedy_samples
    from tests.trained import train_checked

    data, val = _greedy_samples(tiny, 6, T=24), _greedy_samples(tiny, 2, T=24, seed=1)
    extra = ["head.markov_rank=8"] if kind == "dspark" else ["head.markov_rank=0", "head.confidence_head=false",
                                                             "head.sample_from_anchor=false", "head.mask_token_id=5"]
    # (the tiny target embeds its pad token 0, the default mask token, as zeros: a DFlash block's queries would be
    # 0 and its q / k projections get no gradient)
    recipe = load_config(Recipe, None, [
        f"output_dir={tmp_path}", "seed=0", "head.kind=dspark", "head.feature_layers=[1,2,3]", "head.block_size=3",
        *extra, "train.tracker=none", "train.batch_size=2", "train.lr=1e-2", "train.max_steps=3",
        "train.block.max_anchors=4", "train.block.weighting=dpace", "train.block.dpace_alpha=0.5",
        "eval.every_steps=0", "eval.at_start=false", "eval.max_samples=2"])
    assert recipe.train.block.weighting == "dpace"
    torch.manual_seed(0)
    head = build_head(recipe.head, tiny)
    train_checked(recipe, tiny, head, data, val)


def test_dpace_a_draft_outside_the_draft_vocab_counts_as_rejected():
    """Draft 0's target token lies outside V' (in_vocab false): its own loss stays out, and the drafts after it
    see s_0 = α (never accepted), as if the drafter were wrong there."""
    V, a = 4, 0.5
    target = _logits([[(1, BIG), (2, BIG)]], V) * 10
    draft = _logits([[(1, BIG), (2, 0.0)]], V)  # sure and right on draft 0, uniform on draft 1
    valid = torch.ones(1, 2, dtype=torch.bool)
    in_vocab = torch.tensor([[False, True]])
    from specheads.train.losses import DistillLoss, parse_loss

    out = dspark_loss(draft + 0.0, None, target, target.logsumexp(-1), in_vocab, valid,
                      loss=DistillLoss(parse_loss("soft_ce:1")), weighting="dpace", dpace_alpha=a)
    # s_0 = α (q_0 = 0 outside V'), s_1 = (1-α)/V + α: P_1 = α s_1 = w_1; ℓ_1 = log V; one counted draft
    assert out.loss.item() == pytest.approx(a * ((1 - a) / V + a) * math.log(V), rel=1e-4)
    w = dpace_position_weights(torch.tensor([[0.0, 1.0]]), valid, a) * in_vocab.float()
    assert torch.allclose(w, torch.tensor([[0.0, a]]))  # a sure draft 1 after it: P_1 = α
