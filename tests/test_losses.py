"""Losses: alignment (step k at row t predicts token t+2+k), weighting, masking, the simulated τ, and the
distillation family (train.loss) on hand-made distributions whose answers are obvious."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specheads.train.losses import (LK_EPS, LOSS_TERMS, DistillLoss, accepted_lengths, distill_loss, eagle3_loss,
                                    eagle_loss, medusa_loss, parse_loss, resolve_loss, shift_rows, soft_ce,
                                    step_correct, step_mask)
from specheads.train.teacher import TargetRows
from test_dspark import _greedy_samples

B, T, V, K, D = 2, 10, 17, 3, 8


def onehot_logits(ids: torch.Tensor, v: int = V, scale: float = 50.0) -> torch.Tensor:
    return F.one_hot(ids, v).float() * scale


def test_step_mask_alignment():
    lm = torch.zeros(B, T, dtype=torch.long)
    lm[:, 5:] = 1
    m0 = step_mask(lm, 0)
    assert m0[0].tolist() == [False] * 3 + [True] * 5 + [False] * 2  # row t counts iff token t+2 is assistant
    m2 = step_mask(lm, 2)
    assert m2[0].nonzero().flatten().tolist() == [1, 2, 3, 4, 5]


def test_medusa_hard_labels_perfect_and_weighting():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (B, T))
    lm = torch.ones(B, T, dtype=torch.long)
    perfect = torch.stack([onehot_logits(shift_rows(ids, 2 + k)) for k in range(K)])  # [K,B,T,V]
    out = medusa_loss(perfect, ids, lm)
    assert out.loss.item() < 1e-6 and all(out.metrics[f"acc_{k}"] == 1.0 for k in range(K))
    rnd = torch.randn(K, B, T, V)
    out = medusa_loss(rnd, ids, lm)
    manual = sum(0.8 ** k * F.cross_entropy(rnd[k, :, : T - 2 - k].reshape(-1, V), ids[:, 2 + k:].reshape(-1))
                 for k in range(K))
    assert torch.allclose(out.loss, manual, atol=1e-5)


def test_medusa_soft_labels_minimised_by_target_distribution():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (B, T))
    lm = torch.ones(B, T, dtype=torch.long)
    tl = torch.randn(B, T, V)
    matched = torch.stack([shift_rows(tl, 1 + k) for k in range(K)])
    base = medusa_loss(matched, ids, lm, target_logits=tl).loss
    worse = medusa_loss(matched + 0.5 * torch.randn_like(matched), ids, lm, target_logits=tl).loss
    assert worse > base


def test_loss_mask_excludes_rows():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (B, T))
    lm = torch.zeros(B, T, dtype=torch.long)
    lm[:, 6:] = 1
    lg = torch.randn(K, B, T, V)
    a = medusa_loss(lg, ids, lm).loss
    lg2 = lg.clone()
    lg2[0, :, :4] += 100 * torch.randn(B, 4, V)  # head 0 rows 0..3 predict tokens 2..5: masked
    assert torch.equal(a, medusa_loss(lg2, ids, lm).loss)
    lg2[0, :, 4] += 100 * torch.randn(B, V)  # row 4 predicts token 6: counted
    assert not torch.equal(a, medusa_loss(lg2, ids, lm).loss)


def test_eagle_loss_zero_regression_when_exact_and_grad_flows():
    torch.manual_seed(0)
    h = torch.randn(B, T, D)
    W = torch.randn(V, D)
    tl = h @ W.T
    lm = torch.ones(B, T, dtype=torch.long)
    pred = shift_rows(h, 1).clone().requires_grad_(True)
    out = eagle_loss(pred, pred @ W.T, h, tl, lm)
    assert out.metrics["reg"] < 1e-9 and out.metrics["acc_0"] == 1.0
    noisy = (pred.detach() + 0.3 * torch.randn_like(pred)).requires_grad_(True)
    out2 = eagle_loss(noisy, noisy @ W.T, h, tl, lm)
    assert out2.metrics["reg"] > 0.01
    out2.loss.backward()
    assert noisy.grad.abs().sum() > 0


def test_eagle3_masks_targets_outside_draft_vocab_and_weights_steps():
    torch.manual_seed(0)
    d2t = torch.tensor([0, 2, 4, 6, 8, 10])  # draft vocab: even ids below 12
    tl = torch.randn(B, T, V)
    lm = torch.ones(B, T, dtype=torch.long)
    steps = [torch.randn(B, T, len(d2t), requires_grad=True) for _ in range(3)]
    out = eagle3_loss(steps, tl, lm, d2t)
    # rows whose target argmax is outside the draft vocab do not matter
    targ = shift_rows(tl, 1).argmax(-1)
    outside = ~torch.isin(targ, d2t)
    assert outside.any()
    s0 = steps[0].detach().clone()
    s0[outside] += 100 * torch.randn_like(s0[outside])
    out2 = eagle3_loss([s0] + [s.detach() for s in steps[1:]], tl, lm, d2t)
    assert torch.allclose(out.loss, out2.loss)
    # weighting 0.8^i of the renormalised soft CE
    manual = 0.0
    for i, s in enumerate(steps):
        t_i = shift_rows(tl, 1 + i)
        m = step_mask(lm, i) & torch.isin(t_i.argmax(-1), d2t)
        manual = manual + 0.8 ** i * soft_ce(s[m], t_i[..., d2t][m]).mean()
    assert torch.allclose(out.loss, manual, atol=1e-5)
    out.loss.backward()
    assert all(s.grad is not None and s.grad.abs().sum() > 0 for s in steps)


def test_step_correct_and_accepted_lengths():
    # target greedy tokens; drafts right for steps 0,1 at row 0, wrong at step 2
    targ = torch.arange(T).unsqueeze(0) % V  # [1,T], row j's greedy token is j (any fixed sequence will do)
    lm = torch.ones(1, T, dtype=torch.long)
    steps = [onehot_logits(shift_rows(targ, 1 + k)[0]).unsqueeze(0) for k in range(3)]  # all correct
    steps[2][0, 0] = onehot_logits(torch.tensor(5))  # row 0 step 2 wrong (wants token 3)
    valid, top1, topk = step_correct(steps, targ, lm, topk=2)
    tau = accepted_lengths(top1)[valid[0]].float()  # the accepted length per start row
    assert tau[0].item() == 3.0  # 1 + steps 0,1
    assert tau[1].item() == 4.0  # all three correct
    assert tau[-1].item() == 2.0  # last start row t = T-3: only step 0 (token T-1) lies inside the sequence
    assert accepted_lengths(top1, depth=1)[valid[0]].max().item() == 2
    # top-2 contains the right token when the second-best logit is right
    steps[2][0, 0, 3] = 10.0
    _, top1b, topkb = step_correct(steps, targ, lm, topk=2)
    assert not top1b[2, 0, 0] and topkb[2, 0, 0]


def test_target_logits_on_masked_rows_only_give_the_same_losses(tiny):
    from specheads.train.teacher import target_logits

    torch.manual_seed(0)
    h = torch.randn(2, 12, 64)
    lm = (torch.rand(2, 12) > 0.4).long()
    full, part = target_logits(tiny, h), target_logits(tiny, h, lm)
    assert torch.count_nonzero(part) < full.numel()  # rows were skipped
    Vt = full.shape[-1]
    d2t = torch.arange(0, Vt, 2)
    steps = [torch.randn(2, 12, len(d2t)) for _ in range(3)]
    assert torch.equal(eagle3_loss(steps, full, lm, d2t).loss, eagle3_loss(steps, part, lm, d2t).loss)
    med = torch.randn(3, 2, 12, Vt)
    ids = torch.randint(0, Vt, (2, 12))
    assert torch.equal(medusa_loss(med, ids, lm, full).loss, medusa_loss(med, ids, lm, part).loss)
    pred = torch.randn(2, 12, 64)
    assert torch.equal(eagle_loss(pred, pred @ tiny.lm_head.weight.T, h, full, lm).loss,
                       eagle_loss(pred, pred @ tiny.lm_head.weight.T, h, part, lm).loss)


def test_medusa_soft_labels_from_draft_vocab_columns_equal_the_sliced_full_logits(tiny):
    # steps.train_loss computes only the draft vocab's lm_head rows for Medusa's soft labels
    from specheads.train.teacher import target_logits

    torch.manual_seed(1)
    h = torch.randn(2, 12, 64)
    lm = (torch.rand(2, 12) > 0.3).long()
    full = target_logits(tiny, h, lm)  # [B,T,V]
    d2t = torch.tensor([7, 3, 11, 0, 20, 5])
    cols = target_logits(tiny, h, lm, vocab=d2t)  # [B,T,V']
    assert cols.shape == (2, 12, 6)
    assert torch.allclose(cols, full[..., d2t], atol=1e-5)
    med = torch.randn(3, 2, 12, len(d2t))
    ids = torch.randint(0, full.shape[-1], (2, 12))
    a = medusa_loss(med, ids, lm, full, d2t=d2t)
    b = medusa_loss(med, ids, lm, cols, d2t=d2t, target_in_draft_vocab=True)
    assert torch.allclose(a.loss, b.loss, atol=1e-5)
    assert {k: float(v) for k, v in a.metrics.items()} == pytest.approx({k: float(v) for k, v in b.metrics.items()},
                                                                         abs=1e-5)
    # accuracy is measured against the target's choice within the draft vocab
    tk = shift_rows(cols, 1)[step_mask(lm, 0)]
    want = float((med[0][step_mask(lm, 0)].argmax(-1) == tk.argmax(-1)).float().mean())
    assert float(b.metrics["acc_0"]) == pytest.approx(want)


def test_medusa_hard_labels_with_draft_vocab_map_and_mask():
    ids = torch.tensor([[5, 6, 2, 4, 9, 3, 1, 8]])
    d2t = torch.tensor([2, 4, 6, 8])  # draft vocab: even ids; draft id = index
    lm = torch.ones_like(ids)
    draft_labels = torch.tensor([-1, 1, 0, 1, -1, -1, -1, 3])  # ids mapped, -1 outside
    perfect = onehot_logits(shift_rows(draft_labels.clamp(min=0).unsqueeze(0), 2), v=4).unsqueeze(0)  # [1,1,T,4]
    out = medusa_loss(perfect, ids, lm, d2t=d2t)
    assert out.loss.item() < 1e-6 and out.metrics["acc_0"] == 1.0  # rows whose label is odd (outside) are masked
    wrong = perfect.clone()
    wrong[0, 0, 0] = onehot_logits(torch.tensor(3), v=4)  # row 0 predicts token 2 (draft id 0): now wrong
    assert medusa_loss(wrong, ids, lm, d2t=d2t).loss.item() > 1.0


# ------------------------------------------------------------------------------ the loss family (train.loss)


def _probs_logits(p) -> torch.Tensor:
    """Logits whose softmax is p exactly where p > 0 (zeros become -1e4: exp underflows to exactly 0 in fp32)."""
    p = torch.as_tensor(p, dtype=torch.float64)
    return torch.where(p > 0, p.clamp_min(1e-300).log(), torch.full_like(p, -1e4)).float()


def _term(name, q, p, lse=None, eta=3.0):
    """One term at one row: q, p probabilities over V' (p over V' only; lse = log of the target's full-vocab
    normaliser relative to these logits: 0 when p holds all the mass)."""
    z, t = _probs_logits(q)[None], _probs_logits(p)[None]
    lse = torch.zeros(1) if lse is None else torch.tensor([lse])
    total, metrics = distill_loss(z, t, DistillLoss(((name, 1.0),), eta), lse)
    return float(total), metrics


@pytest.mark.parametrize("name", LOSS_TERMS)
def test_identical_distributions_cost_nothing_but_the_entropy(name):
    p = [0.5, 0.3, 0.2]
    val, m = _term(name, p, p)
    H = -sum(x * math.log(x) for x in p)
    assert val == pytest.approx(H if name == "soft_ce" else 0.0, abs=1e-6)  # soft CE = KL + H(p)
    if name.startswith("lk_"):
        assert float(m["accept"]) == pytest.approx(1.0, abs=1e-6)


def test_disjoint_distributions_tv_one_acceptance_zero():
    q, p = [0.0, 1.0], [1.0, 0.0]
    assert _term("tv", q, p)[0] == pytest.approx(1.0)
    assert _term("l1", q, p)[0] == pytest.approx(2.0)
    val, m = _term("lk_alpha", q, p)
    assert float(m["accept"]) == 0.0 and val == pytest.approx(-math.log(LK_EPS))  # finite at zero overlap
    val, m = _term("lk_lambda", q, p)  # ᾱ = 0: λ = 1, all KL (huge, finite)
    assert float(m["accept"]) == 0.0 and math.isfinite(val) and val > 100


def test_two_tokens_by_hand():
    # p = (3/4, 1/4), q = (1/2, 1/2): overlap min = 1/2 + 1/4 = 3/4, TV = 1/4
    q, p = [0.5, 0.5], [0.75, 0.25]
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert _term("soft_ce", q, p)[0] == pytest.approx(math.log(2), rel=1e-6)
    assert _term("kl", q, p)[0] == pytest.approx(kl, rel=1e-5)
    assert _term("tv", q, p)[0] == pytest.approx(0.25, rel=1e-6)
    assert _term("l1", q, p)[0] == pytest.approx(0.5, rel=1e-6)
    assert _term("lk_alpha", q, p)[0] == pytest.approx(-math.log(0.75), rel=1e-6)
    lam = math.exp(-3.0 * 0.75)
    assert _term("lk_lambda", q, p)[0] == pytest.approx(lam * kl + (1 - lam) * 0.25, rel=1e-5)
    lam1 = math.exp(-1.0 * 0.75)
    assert _term("lk_lambda", q, p, eta=1.0)[0] == pytest.approx(lam1 * kl + (1 - lam1) * 0.25, rel=1e-5)


def test_mass_outside_the_draft_vocab():
    # full vocab (0.5, 0.25, 0.25), draft vocab = the first two: p' = (2/3, 1/3), mass inside m = 3/4
    p_full = torch.tensor([0.5, 0.25, 0.25])
    t_full = p_full.log()
    lse = float(t_full.logsumexp(0))  # = 0
    q = [2 / 3, 1 / 3]  # the best a draft-vocab draft can do
    for name in ("soft_ce", "kl", "tv", "l1"):  # divergences to p', the target given the token lies in V'
        z, t = _probs_logits(q)[None], t_full[:2][None]
        val = float(distill_loss(z, t, DistillLoss(((name, 1.0),)))[0])
        assert val == pytest.approx(-(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)) if name == "soft_ce"
                                    else 0.0, abs=1e-6)
    z, t = _probs_logits(q)[None], t_full[:2][None]
    val, m = distill_loss(z, t, DistillLoss((("lk_alpha", 1.0),)), torch.tensor([lse]))
    assert float(m["accept"]) == pytest.approx(0.75, abs=1e-6)  # α = min(2/3, 1/2) + min(1/3, 1/4) = m
    assert float(val) == pytest.approx(-math.log(0.75), abs=1e-6)


@pytest.mark.parametrize("name", LOSS_TERMS)
def test_gradients_finite_and_pointing_at_the_target(name):
    q, p = [0.5, 0.5], [0.75, 0.25]
    z = _probs_logits(q)[None].requires_grad_(True)
    total, _ = distill_loss(z, _probs_logits(p)[None], DistillLoss(((name, 1.0),)), torch.zeros(1))
    total.backward()
    g = z.grad[0]
    assert torch.isfinite(g).all() and g[0] < 0 < g[1]  # descent raises q_0 towards 3/4
    for q, p in (([0.0, 1.0], [1.0, 0.0]), ([0.3, 0.7], [0.3, 0.7])):  # disjoint, identical: finite
        z = _probs_logits(q)[None].requires_grad_(True)
        distill_loss(z, _probs_logits(p)[None], DistillLoss(((name, 1.0),)), torch.zeros(1))[0].backward()
        assert torch.isfinite(z.grad).all()


@pytest.mark.parametrize("name", LOSS_TERMS)
def test_descent_raises_the_exact_acceptance(name):
    torch.manual_seed(0)
    full = 2.0 * torch.randn(16, 12)  # 16 rows, V = 12; the draft vocab is the first 8 columns
    lse, t = full.logsumexp(-1), full[:, :8]
    z = torch.zeros(16, 8, requires_grad=True)
    opt = torch.optim.Adam([z], lr=0.1)
    loss = DistillLoss(((name, 1.0),))

    def accept():
        return float(torch.minimum(torch.softmax(z.detach(), -1), torch.exp(t - lse[:, None])).sum(-1).mean())

    before = accept()
    for _ in range(150):
        opt.zero_grad()
        distill_loss(z, t, loss, lse)[0].backward()
        opt.step()
    mass = float(torch.exp(t - lse[:, None]).sum(-1).mean())
    assert before < accept() <= mass + 1e-6 and accept() > before + 0.5 * (mass - before)


def test_mixture_is_the_weighted_sum_and_metrics_name_the_terms():
    torch.manual_seed(0)
    d2t = torch.tensor([0, 2, 4, 6, 8, 10])
    tl = torch.randn(B, T, V)
    lm = torch.ones(B, T, dtype=torch.long)
    steps = [torch.randn(B, T, len(d2t)) for _ in range(2)]
    mix = eagle3_loss(steps, tl, lm, d2t, loss=resolve_loss("eagle3", "soft_ce:0.1,tv:0.9"))
    ce = eagle3_loss(steps, tl, lm, d2t, loss=resolve_loss("eagle3", "soft_ce")).loss
    tv = eagle3_loss(steps, tl, lm, d2t, loss=resolve_loss("eagle3", "tv")).loss
    assert torch.allclose(mix.loss, 0.1 * ce + 0.9 * tv, atol=1e-6)
    assert {"ce_0", "tv_0", "ce_1", "tv_1", "acc_0"} <= set(mix.metrics)
    assert torch.equal(ce, eagle3_loss(steps, tl, lm, d2t).loss)  # soft_ce is the default
    lk = eagle3_loss(steps, tl, lm, d2t, loss=resolve_loss("eagle3", "lk_alpha"))
    assert 0 < float(lk.metrics["accept_0"]) < 1


def test_parse_loss_and_the_per_kind_table():
    assert parse_loss("tv") == (("tv", 1.0),)
    assert parse_loss(" soft_ce:0.1 , tv:0.9") == (("soft_ce", 0.1), ("tv", 0.9))
    for bad, why in (("xent", "not one of"), ("tv:abc", "not a number"), ("tv:-1", ">= 0"), ("tv,tv:2", "twice"),
                     ("tv:0", "every weight is 0"), ("", "not one of")):
        with pytest.raises(ValueError, match=why):
            parse_loss(bad)
    assert str(resolve_loss("dspark")) == "soft_ce:0.1,l1:0.9"  # DeepSpec's composite when train.loss is unset
    assert str(resolve_loss("dspark", w_ce=1.0, w_l1=0.0)) == "soft_ce:1,l1:0"  # DFlash recipe
    assert str(resolve_loss("eagle3")) == str(resolve_loss("medusa")) == str(resolve_loss("eagle")) == "soft_ce:1"
    assert resolve_loss("eagle3", "lk_lambda", eta=2.0).eta == 2.0 and resolve_loss("eagle3", "lk_lambda").needs_lse


def test_train_config_validates_the_loss(tmp_path):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe
    from specheads.train.settings import BlockTrainConfig, LoraTrainConfig, MedusaTrainConfig, TrainConfig
    from specheads.train.kinds import head_kind
    from specheads.utils import SpecheadsError

    assert TrainConfig(loss="soft_ce:0.1,tv:0.9").loss == "soft_ce:0.1,tv:0.9"
    with pytest.raises(SpecheadsError, match=r"train.loss: 'tvd'.*not one of.*NAME:WEIGHT"):
        load_config(Recipe, None, ["train.loss=tvd"])
    with pytest.raises(SpecheadsError, match=r"train\.block\.w_ce / train\.block\.w_l1"):  # DFlash's beside train.loss
        TrainConfig(loss="tv", block=BlockTrainConfig(w_ce=1.0, w_l1=0.0))
    with pytest.raises(SpecheadsError, match=r"override 'train\.loss=tv'.*train\.block\.w_ce"):  # from flags too
        load_config(Recipe, None, ["train.loss=tv", "train.block.w_ce=1.0", "train.block.w_l1=0"])
    with pytest.raises(SpecheadsError, match=r"train\.medusa\.soft_labels"):
        head_kind("medusa").check(TrainConfig(loss="tv"))  # the kind's own check of train: (train/kinds/medusa.py)
    head_kind("medusa").check(TrainConfig(loss="tv", medusa=MedusaTrainConfig(soft_labels=True)))
    with pytest.raises(SpecheadsError, match=r"train\.lora\.enabled"):
        head_kind("medusa").check(TrainConfig(loss="tv", medusa=MedusaTrainConfig(soft_labels=True),
                                              lora=LoraTrainConfig(enabled=True)))
    with pytest.raises(SpecheadsError, match="lk_eta"):
        TrainConfig(lk_eta=-1.0)


def test_dspark_default_is_deepspec_composite():
    from specheads.train.losses import dspark_loss

    torch.manual_seed(0)
    logits, tgt = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    ones = torch.ones(5, 3, dtype=torch.bool)
    old = dspark_loss(logits, None, tgt, tgt.logsumexp(-1), ones, ones, w_ce=0.1, w_l1=0.9)
    new = dspark_loss(logits, None, tgt, tgt.logsumexp(-1), ones, ones, loss=resolve_loss("dspark"))
    assert torch.equal(old.loss, new.loss) and old.metrics == new.metrics
    w = torch.exp(-torch.arange(3.0) / 4.0).expand(5, 3)
    lq, p = torch.log_softmax(logits, -1), torch.softmax(tgt, -1)
    by_hand = 0.1 * ((-(p * lq).sum(-1)) * w).sum() / w.sum() + 0.9 * ((lq.exp() - p).abs().sum(-1) * w).sum() / w.sum()
    assert torch.allclose(old.loss, by_hand, atol=1e-6)
    tv = dspark_loss(logits, None, tgt, tgt.logsumexp(-1), ones, ones, loss=resolve_loss("dspark", "tv"))
    assert torch.allclose(tv.loss, 0.5 * ((lq.exp() - p).abs().sum(-1) * w).sum() / w.sum(), atol=1e-6)


def test_target_rows_from_full_logits():
    full = torch.tensor([[[0.0, 3.0, 1.0, 2.0]]])  # one row, V = 4; argmax 1
    rows = TargetRows.from_full(full, torch.tensor([0, 3]))
    assert rows.logits.tolist() == [[[0.0, 2.0]]] and rows.greedy.item() == 1 and not rows.in_vocab.item()
    assert rows.lse.item() == pytest.approx(float(full.logsumexp(-1)))
    with pytest.raises(ValueError, match="logsumexp"):
        distill_loss(torch.zeros(1, 2), torch.zeros(1, 2), DistillLoss((("lk_alpha", 1.0),)))


@pytest.mark.parametrize("name", LOSS_TERMS)
def test_training_with_each_loss_raises_the_held_out_tau(tmp_path, name):
    from specheads.config import load_config
    from specheads.heads.base import build_head
    from specheads.train.recipe import Recipe
    from specheads.target import tiny_target
    from specheads.train.trainer import Trainer

    target = tiny_target()
    with torch.no_grad():
        target.final_norm.weight.mul_(20)  # sharp next-token distributions (a random tiny Llama's are flat)
    data, val = _greedy_samples(target, 16, T=32), _greedy_samples(target, 4, T=32, seed=1)
    recipe = load_config(Recipe, None, [
        f"output_dir={tmp_path}", "seed=0", "head.kind=eagle3", "head.ttt_steps=2", "head.draft_vocab_size=96",
        "train.tracker=none", "train.batch_size=4", "train.lr=1e-2", "train.warmup_steps=1", "train.max_steps=24",
        f"train.loss={name}", "eval.every_steps=0", "eval.max_samples=4", "eval.batch_size=4", "eval.tree_depth=2"])
    counts = sum(torch.bincount(d["input_ids"][d["loss_mask"].bool()], minlength=target.vocab_size) for d in data)
    torch.manual_seed(0)
    head = build_head(recipe.head, target, token_counts=counts)
    res = Trainer(recipe, target, head, data, val).train()
    first, last = res.history[0], res.history[-1]
    assert last["tau_chain"] > first["tau_chain"] + 0.25, (name, first["tau_chain"], last["tau_chain"])  # ~1.04 -> 1.5
