"""Losses: alignment (step k at row t predicts token t+2+k), weighting, masking, and the simulated τ."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specheads.train.losses import (eagle3_loss, eagle_loss, medusa_loss, shift_rows, simulated_tau, soft_ce,
                                    step_correct, step_mask)

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


def test_step_correct_and_simulated_tau():
    # target greedy tokens; drafts right for steps 0,1 at row 0, wrong at step 2
    targ = torch.arange(T).unsqueeze(0) % V  # [1,T], row j's greedy token is j (any fixed sequence will do)
    lm = torch.ones(1, T, dtype=torch.long)
    steps = [onehot_logits(shift_rows(targ, 1 + k)[0]).unsqueeze(0) for k in range(3)]  # all correct
    steps[2][0, 0] = onehot_logits(torch.tensor(5))  # row 0 step 2 wrong (wants token 3)
    valid, top1, topk = step_correct(steps, targ, lm, topk=2)
    tau = simulated_tau(top1, valid[0])
    assert tau[0].item() == 3.0  # 1 + steps 0,1
    assert tau[1].item() == 4.0  # all three correct
    assert tau[-1].item() == 2.0  # last start row t = T-3: only step 0 (token T-1) lies inside the sequence
    assert simulated_tau(top1, valid[0], depth=1).max().item() == 2.0
    # top-2 contains the right token when the second-best logit is right
    steps[2][0, 0, 3] = 10.0
    _, top1b, topkb = step_correct(steps, targ, lm, topk=2)
    assert not top1b[2, 0, 0] and topkb[2, 0, 0]


def test_target_logits_on_masked_rows_only_give_the_same_losses(tiny):
    from specheads.train.steps import target_logits

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
    from specheads.train.steps import target_logits

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
