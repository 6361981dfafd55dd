"""DSpark / DFlash block heads on the tiny target: training forward == inference forward, the loss and calibration
math on hand-made inputs, a training run whose simulated τ rises (frozen target bit-identical), save/load and
export/import round trips, the real `speculators` package running our export, bad input."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.heads import HeadSpec, build_head, load_head
from specheads.heads.export import export_head, import_head
from specheads.train.calibrate import fit_platt, fit_sequential_temperatures, null_ece
from specheads.train.confidence import BlockEvalAccumulator, ece
from specheads.train.losses import acceptance_rate, block_position_weights, dspark_loss
from specheads.train.kinds.block import block_targets, block_valid, sample_anchors
from specheads.utils import SpecheadsError
from helpers import (assert_resume_is_exact, greedy_chain, perturb, run_fixture, save_token_rows, speculators_export,
                     verifier_states)

ROOT = Path(__file__).resolve().parents[1]
SPEC_PY = ROOT / ".venv-speculators" / "bin" / "python"
SF_PY = ROOT / ".venv-specforge" / "bin" / "python"  # scripts/setup_specforge_venv.sh
V, D = 256, 64


def _head(tiny, seed=3, **kw):
    spec = HeadSpec(**{"kind": "dspark", "feature_layers": [1, 2, 3], "block_size": 4, "markov_rank": 16,
                       "num_layers": 2, **kw})
    head = build_head(spec, tiny, token_counts=torch.arange(V) if spec.draft_vocab_size else None)
    # far from init, so that every part matters (the frozen lm_head rows stay the target's)
    return perturb(head, 0.1, seed, trainable_only=True)


def _inputs(T=24, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, 3 * D, generator=g), torch.randint(0, V, (1, T), generator=g)


VARIANTS = [dict(markov_head_type="vanilla", draft_vocab_size=100), dict(markov_head_type="gated"),
            dict(markov_head_type="rnn", sample_from_anchor=False), dict(markov_rank=0, confidence_head=False),
            dict(markov_head_type="rnn", draft_vocab_size=100, confidence_with_markov=False),
            dict(anchor_features=True, draft_vocab_size=100),
            dict(anchor_features=True, markov_head_type="rnn", sample_from_anchor=False)]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_training_forward_equals_draft_block(tiny, kw):
    """The context fed in two pieces to the cache, then draft_block's greedy chain, equals the teacher-forced
    training forward of the same anchor once the data's next tokens are the drafted ones."""
    head = _head(tiny, **kw)
    f, ids = _inputs()
    p = 9
    cache, logits, conf, forced = greedy_chain(head, f, ids, p, split=4)
    assert cache.length == p
    K = head.num_drafts
    assert logits.shape == (K, head.config.out_vocab) and (conf is None) == (not head.spec.options.confidence_head)
    tl, tc = head(f, forced, torch.tensor([[3, p]]))
    torch.testing.assert_close(tl[0, 1], logits, atol=1e-5, rtol=1e-5)
    if conf is not None:
        torch.testing.assert_close(torch.sigmoid(tc[0, 1]), conf, atol=1e-6, rtol=1e-5)
    short = head.new_cache()  # a context of the first 4 rows reproduces the block drafted there
    head.extend_context(short, f[0, :4])
    l4, _ = head.draft_block(short, ids[0, 4])
    torch.testing.assert_close(head(f, ids, torch.tensor([[4]]))[0][0, 0, 0], l4[0], atol=1e-5, rtol=1e-5)


def test_anchor_features_variant_starts_as_the_reference_and_reads_row_p_minus_1(tiny):
    """W_a = 0 at init and every other weight drawn as the reference's: the same function. Once W_a moves, the
    anchor slot's extra input is W_a c_{p-1} (the fused row before the anchor), and with no context at all
    draft_block equals the training forward at p = 0 (c_{-1} = 0)."""
    spec = dict(kind="dspark", feature_layers=[1, 2, 3], block_size=4, markov_rank=16, draft_vocab_size=100)
    torch.manual_seed(0)
    ref = build_head(HeadSpec(**spec), tiny, token_counts=torch.arange(V))
    torch.manual_seed(0)
    var = build_head(HeadSpec(**spec, anchor_features=True), tiny, token_counts=torch.arange(V))
    sr, sv = ref.state_dict(), var.state_dict()
    assert set(sv) - set(sr) == {"anchor_proj.weight"} and all(torch.equal(sr[k], sv[k]) for k in sr)
    assert not var.anchor_proj.weight.any() and var.anchor_proj.weight.requires_grad
    f, ids = _inputs()
    a = torch.tensor([[3, 9]])
    torch.testing.assert_close(var(f, ids, a)[0], ref(f, ids, a)[0], atol=0, rtol=0)
    with torch.no_grad():
        var.anchor_proj.weight.normal_(std=0.1)
    assert not torch.allclose(var(f, ids, a)[0], ref(f, ids, a)[0])
    c = var.project_features(f)  # [1,T,D]
    got = var._anchor_input(var.context_kv(f), a)
    torch.testing.assert_close(got, var.anchor_proj(c[:, [2, 8]]), atol=0, rtol=0)  # rows p-1 = 2, 8
    logits, _ = var.draft_block(var.new_cache(), ids[0, 0])  # empty context: anchor at position 0
    forced = ids.clone()
    forced[0, 1:1 + var.num_drafts] = var.to_target_ids(logits.argmax(-1))
    torch.testing.assert_close(var(f, forced, torch.tensor([[0]]))[0][0, 0], logits, atol=1e-5, rtol=1e-5)


def test_block_reads_only_the_context_before_its_anchor(tiny):
    head = _head(tiny)
    f, ids = _inputs()
    a = torch.tensor([[7]])
    ref, _ = head(f, ids, a)
    f2, ids2 = f.clone(), ids.clone()
    f2[:, 7:] += 1.0  # the anchor's own row and later rows: not read (the anchor's feature does not exist yet)
    ids2[0, 12:] = (ids2[0, 12:] + 1) % V  # tokens past the block's Markov inputs
    out, _ = head(f2, ids2, a)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    f2[:, 6] += 1.0  # the last context row is read
    assert not torch.allclose(head(f2, ids2, a)[0], ref)


def test_acceptance_rate_and_confidence_bce_by_hand():
    big = 30.0
    same = torch.tensor([[big, 0.0, 0.0, 0.0]])
    other = torch.tensor([[0.0, big, 0.0, 0.0]])
    half = torch.tensor([[big, big, 0.0, 0.0]])  # q = (1/2, 1/2, 0, 0)
    lse = lambda t: t.logsumexp(-1)  # noqa: E731  (no draft vocab: the columns are the whole vocab)
    assert acceptance_rate(same, same, lse(same)).item() == pytest.approx(1.0)
    assert acceptance_rate(other, same, lse(same)).item() == pytest.approx(0.0, abs=1e-6)
    assert acceptance_rate(half, same, lse(same)).item() == pytest.approx(0.5)
    # a draft vocab of the first two ids; the target puts half its mass on id 3, outside it: at most 1/2 accepted
    full = torch.tensor([[big, -big, -big, big]])
    assert acceptance_rate(same[:, :2], full[:, :2], lse(full)).item() == pytest.approx(0.5)

    # the BCE target is detached: the confidence loss alone sends no gradient into the logits
    logits = torch.randn(3, 2, 4, requires_grad=True)
    conf = torch.zeros(3, 2, requires_grad=True)  # c = 0.5
    tgt = logits.detach().clone()  # the draft equals the target: acceptance 1 everywhere
    ones = torch.ones(3, 2, dtype=torch.bool)
    out = dspark_loss(logits, conf, tgt, tgt.logsumexp(-1), ones, ones, w_ce=0.0, w_l1=0.0, alpha=1.0)
    assert out.loss.item() == pytest.approx(math.log(2.0), rel=1e-5)  # BCE(0.5, 1) = log 2
    out.loss.backward()
    assert logits.grad is None or not logits.grad.any()  # CE and L1 weigh 0 here: any gradient would be the BCE's
    assert conf.grad is not None and bool((conf.grad < 0).all())


def test_loss_weights_and_masks():
    w = block_position_weights(3, 4.0)
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))
    logits = torch.zeros(1, 3, 4)
    tgt = torch.tensor([[[5.0, 0, 0, 0]] * 3])
    ones = torch.ones(1, 3, dtype=torch.bool)
    ce_all = dspark_loss(logits, None, tgt, tgt.logsumexp(-1), ones, ones, w_ce=1.0, w_l1=0.0).loss
    assert ce_all.item() == pytest.approx(math.log(4.0), rel=1e-5)  # uniform draft: CE = log 4 at every draft
    logits = torch.tensor([[[9.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 9.0]]])
    ce = -(torch.softmax(tgt, -1) * torch.log_softmax(logits, -1)).sum(-1)[0]  # per draft, by hand
    first = dspark_loss(logits, None, tgt, tgt.logsumexp(-1), ones, torch.tensor([[True, False, False]]),
                        w_ce=1.0, w_l1=0.0).loss
    assert first.item() == pytest.approx(ce[0].item(), rel=1e-5)  # invalid drafts leave the loss
    mean = dspark_loss(logits, None, tgt, tgt.logsumexp(-1), ones, ones, w_ce=1.0, w_l1=0.0).loss
    assert mean.item() == pytest.approx(float((ce * w).sum() / w.sum()), rel=1e-5)  # exp(-j / 4)-weighted mean
    out_of_vocab = dspark_loss(logits, None, tgt, tgt.logsumexp(-1), torch.tensor([[True, True, False]]), ones,
                               w_ce=1.0, w_l1=0.0).loss  # draft 2's target token lies outside the draft vocab
    assert out_of_vocab.item() == pytest.approx(float((ce[:2] * w[:2]).sum() / w[:2].sum()), rel=1e-5)


def test_sample_anchors_reproducible_and_on_assistant_rows():
    lm = torch.zeros(3, 20, dtype=torch.long)
    lm[0, 5:] = 1
    lm[1, 10:14] = 1
    lm[2, 18:] = 1
    a1, v1 = sample_anchors(lm, 6, torch.Generator().manual_seed(0))
    a2, v2 = sample_anchors(lm, 6, torch.Generator().manual_seed(0))  # the trainer passes LossSettings.generator
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    assert v1.sum(1).tolist() == [6, 4, 2]  # row 1 has 4 candidates (p = 9..12), row 2 two (p = 17, 18)
    for b in range(3):
        chosen = a1[b][v1[b]]
        assert bool((lm[b, chosen + 1] == 1).all()) and len(set(chosen.tolist())) == len(chosen)  # x_{p+1} answers
        assert chosen.tolist() == sorted(chosen.tolist())
    assert not torch.equal(a1, sample_anchors(lm, 6, torch.Generator().manual_seed(1))[0])
    ok = block_valid(lm, torch.tensor([[17], [11], [17]]), 4)  # contiguous prefixes inside the sequence
    assert ok.tolist() == [[[True, True, False, False]], [[True, True, False, False]], [[True, True, False, False]]]


def test_block_targets_read_row_p_plus_j(tiny):
    head = _head(tiny, draft_vocab_size=100)
    h = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[2, 7], [4, 0]])
    valid = torch.ones(2, 2, 4, dtype=torch.bool)
    valid[1, 1] = False  # a padding block
    full = tiny.lm_head(h)  # [2,12,V]
    tgt, lse, ok = block_targets(head, tiny, h, anchors, valid)  # the draft vocab's columns, renormalised
    torch.testing.assert_close(tgt[0, 1, 2], full[0, 9, head.d2t])  # draft 2 of the block at 7: row 9
    torch.testing.assert_close(lse[0, 1, 2], full[0, 9, head.d2t].logsumexp(-1))
    assert bool(ok.all())
    tgt, lse, ok = block_targets(head, tiny, h, anchors, valid, full_vocab=True)
    torch.testing.assert_close(tgt[1, 0, 3], full[1, 7, head.d2t])
    torch.testing.assert_close(lse[1, 0, 3], full[1, 7].logsumexp(-1))  # the full vocabulary's
    want = torch.isin(full[0, 2:6].argmax(-1), head.d2t)
    assert torch.equal(ok[0, 0], want)


def test_fit_sequential_temperatures_recovers_obvious_answers():
    z = torch.linspace(-4, 4, 41).repeat_interleave(200)  # 8,200 rows
    g = torch.Generator().manual_seed(0)
    y1 = torch.rand(z.shape, generator=g) < torch.sigmoid(z / 2.0)  # truly σ(z / 2): temperature 2
    t = fit_sequential_temperatures(z[None], y1[None], torch.ones(1, z.numel(), dtype=torch.bool))
    assert t.item() == pytest.approx(2.0, rel=0.08)
    # position 0 always accepted (confident and right), position 1 truly σ(z / 0.5) given it: T_1 = 0.5
    logits = torch.stack([torch.full_like(z, 30.0), z])
    y = torch.stack([torch.ones_like(y1), torch.rand(z.shape, generator=g) < torch.sigmoid(z / 0.5)])
    t = fit_sequential_temperatures(logits, y, torch.ones(2, z.numel(), dtype=torch.bool))
    assert t[1].item() == pytest.approx(0.5, rel=0.08)
    # a position without rows keeps T = 1
    v = torch.ones(2, z.numel(), dtype=torch.bool)
    v[1] = False
    assert fit_sequential_temperatures(logits, y, v)[1].item() == 1.0


def test_fit_platt_recovers_obvious_answers():
    """Truly σ(z / 2 + 1) at draft 0: T 2, β 1 (a temperature alone cannot give the +1). Draft 1 is fitted only on
    the rows where draft 0 was accepted (the event its confidence predicts): there truly σ(z / 0.5 - 0.5), while
    every row where draft 0 failed has draft 1 wrong too (it would drag β down if counted)."""
    g = torch.Generator().manual_seed(0)
    z = torch.linspace(-4, 4, 41).repeat_interleave(200)  # 8,200 rows
    y0 = torch.rand(z.shape, generator=g) < torch.sigmoid(z / 2.0 + 1.0)
    y1 = (torch.rand(z.shape, generator=g) < torch.sigmoid(z / 0.5 - 0.5)) & y0
    temps, bias = fit_platt(torch.stack([z, z]), torch.stack([y0, y1]), torch.ones(2, z.numel(), dtype=torch.bool))
    assert temps[0].item() == pytest.approx(2.0, rel=0.1) and bias[0].item() == pytest.approx(1.0, abs=0.1)
    assert temps[1].item() == pytest.approx(0.5, rel=0.1) and bias[1].item() == pytest.approx(-0.5, abs=0.15)
    # a position with too few rows (here: none) keeps T = 1, β = 0
    v = torch.ones(2, z.numel(), dtype=torch.bool)
    v[1] = False
    temps, bias = fit_platt(torch.stack([z, z]), torch.stack([y0, y1]), v)
    assert (temps[1].item(), bias[1].item()) == (1.0, 0.0)


def test_ece_and_its_noise_floor():
    """ece: 0.9 on always-right rows is 0.1 off; half right at 0.5 is 0. It bins as the accumulator does. The null
    ECE of a calibrated 0.5 on M rows is E|mean(y) - 0.5| = sqrt(2 / π) * 0.5 / sqrt(M) (0.0399 at M = 100); draft
    1 counts only the rows where draft 0 was accepted."""
    assert ece(torch.full((10,), 0.9), torch.ones(10)) == pytest.approx(0.1)
    assert ece(torch.full((10,), 0.5), torch.arange(10) % 2) == 0.0
    g = torch.Generator().manual_seed(1)
    p, y = torch.rand(500, generator=g), torch.rand(500, generator=g) < 0.4
    acc = BlockEvalAccumulator(1, [0.5])
    acc.add(y[None, None], torch.ones(1, 1, 500, dtype=torch.bool), torch.ones(1, 500, dtype=torch.bool), p[None, None])
    assert ece(p, y) == pytest.approx(acc.metrics()["ece_0"])
    conf = torch.full((2, 100), 0.5)
    correct = torch.stack([torch.arange(100) < 40, torch.ones(100, dtype=torch.bool)])
    out = null_ece(conf, correct, torch.ones(2, 100, dtype=torch.bool), sims=2000)
    assert out["rows_0"] == 100 and out["rows_1"] == 40
    assert out["ece_null_0"] == pytest.approx(math.sqrt(2 / math.pi) * 0.5 / 10, rel=0.1)
    assert out["ece_null95_0"] > out["ece_null_0"] and out["ece_null_1"] > out["ece_null_0"]  # fewer rows: wider


def test_block_metrics_by_hand():
    # 4 blocks of 2 drafts; draft 0 right in blocks 0, 1; draft 1 right in block 0 only; confidences by hand
    top1 = torch.tensor([[True, True, False, False], [True, False, False, False]])[:, None]
    valid = torch.ones(2, 1, 4, dtype=torch.bool)
    conf = torch.tensor([[0.95, 0.95, 0.05, 0.05], [0.95, 0.05, 0.5, 0.5]])[:, None]
    acc = BlockEvalAccumulator(2, [0.5])
    acc.add(top1, valid, torch.ones(1, 4, dtype=torch.bool), conf)
    m = acc.metrics()
    assert m["accept_0"] == 0.5 and m["accept_1"] == 0.5  # draft 1 counted only where draft 0 was accepted
    assert m["auroc_0"] == 1.0 and m["auroc_1"] == 1.0  # perfectly ranked
    assert m["brier_0"] == pytest.approx(0.05 ** 2) and m["ece_0"] == pytest.approx(0.05)
    assert m["conf_1"] == pytest.approx(0.5)  # over blocks 0, 1 only
    # survival: block 0 0.9025 (accepted 2), block 1 0.0475 (accepted 1 of 2: label 0 at j = 1)
    assert m["surv_ece_1"] == pytest.approx((abs(0.9025 - 1) + 0.0475 + 0.025 + 0.025) / 4)
    # cut at survival 0.5: blocks verify 2, 1, 0, 0 drafts; accepted 2, 1, 0, 0 -> τ = (3 + 2 + 1 + 1) / 4
    assert m["tau_cut0.5"] == pytest.approx(7 / 4) and m["len_cut0.5"] == pytest.approx(3 / 4)


def _sharp_target():
    """The tiny target with a sharpened output (final norm x 20; argmax unchanged): a random tiny Llama's
    next-token distributions are nearly flat, which gives soft-target losses little to learn from."""
    from specheads.target import tiny_target

    t = tiny_target()
    with torch.no_grad():
        t.final_norm.weight.mul_(20)
    return t


def _greedy_samples(target, n, T=40, prompt=6, seed=0):
    """Sequences the target wrote itself (greedy), the answer part loss-masked: the target agrees with every answer
    token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.vocab_size, (n, prompt), generator=g)
    with torch.no_grad():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=T - prompt,
                                    min_new_tokens=T - prompt, do_sample=False)
    lm = torch.zeros(T, dtype=torch.long)
    lm[prompt:] = 1
    return [{"input_ids": row[:T], "loss_mask": lm.clone()} for row in out]


@pytest.mark.parametrize("anchor_features", [False, True], ids=["reference", "anchor_features"])
def test_training_run_tau_rises_and_target_stays_frozen(tmp_path, anchor_features):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe
    from tests.trained import train_checked

    target = _sharp_target()
    data, val = _greedy_samples(target, 24), _greedy_samples(target, 6, seed=1)
    counts = sum(torch.bincount(d["input_ids"][d["loss_mask"].bool()], minlength=V) for d in data)
    recipe = load_config(Recipe, None, [
        f"output_dir={tmp_path}", "seed=0", "head.kind=dspark", "head.feature_layers=[1,2,3]", "head.block_size=4",
        "head.markov_rank=16", "head.draft_vocab_size=64", "train.tracker=none", "train.batch_size=2",
        "train.lr=1e-2", "train.block.w_ce=1.0", "train.warmup_steps=1", "train.max_steps=40",
        "train.block.max_anchors=16", "eval.every_steps=0", "eval.max_samples=6", "eval.batch_size=2",
        f"head.anchor_features={str(anchor_features).lower()}"])
    torch.manual_seed(0)
    head = build_head(recipe.head, target, token_counts=counts)
    assert (head.anchor_proj is not None) == anchor_features
    res, changed = train_checked(recipe, target, head, data, val)  # the frozen lm_head rows and buffers stay
    first, last = res.history[0], res.history[-1]
    assert last["tau_chain"] > first["tau_chain"] + 0.2, (first["tau_chain"], last["tau_chain"])
    assert {"accept_0", "ece_0", "conf_0", "tau_cut0.5", "len_cut0.5"} <= set(last)
    assert "lm_head.weight" not in changed and not torch.equal(head.lm_head.weight, torch.zeros(1))
    assert ("anchor_proj.weight" in changed) == anchor_features  # W_a left zero
    assert load_head(tmp_path / "best", target).kind == "dspark"


def test_resume_gives_same_weights(tiny, tmp_path):
    """A run stopped after a checkpoint and resumed ends with the same weights as an uninterrupted one (the
    anchors come from the trainer's generator, saved in its checkpoints)."""
    from specheads.config import load_config
    from specheads.train.recipe import Recipe

    data, val = _greedy_samples(tiny, 10, T=24), _greedy_samples(tiny, 2, T=24, seed=1)
    assert_resume_is_exact(tiny, lambda out: load_config(Recipe, None, [
        f"output_dir={out}", "seed=0", "head.kind=dspark", "head.feature_layers=[1,2,3]", "head.block_size=3",
        "head.markov_rank=8", "train.tracker=none", "train.batch_size=2", "train.lr=1e-2", "train.max_steps=6",
        "train.save_every=2", "train.block.max_anchors=4", "eval.every_steps=0", "eval.at_start=false",
        "eval.max_samples=2"]), data, val, tmp_path)


def test_run_training_calibrates_the_head_folders(tmp_path):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe
    from specheads.train.trainer import run_training

    target = _sharp_target()
    save_token_rows(_greedy_samples(target, 14, T=24), tmp_path / "data" / "tokens")
    recipe = load_config(Recipe, None, [
        f"output_dir={tmp_path}", "seed=0", "features.mode=online", "data.val_fraction=0.4", "head.kind=dspark",
        "head.feature_layers=[1,2,3]", "head.block_size=3", "head.markov_rank=8", "train.tracker=none",
        "train.batch_size=2", "train.lr=1e-2", "train.max_steps=4", "train.block.max_anchors=8", "eval.every_steps=0",
        "eval.at_start=false", "eval.batch_size=2"])
    run_training(recipe, target=target)
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert set(report) == {"best", "final"} and report["final"]["rows"] > 0
    temps, biases = report["final"]["temperatures"], report["final"]["biases"]
    head = load_head(tmp_path / "final", target)
    assert head.conf_temperature.tolist() == pytest.approx(temps) and temps != [1.0, 1.0, 1.0]
    assert head.conf_bias.tolist() == pytest.approx(biases) and biases != [0.0, 0.0, 0.0]
    assert {"ece_0", "accept_0"} <= set(report["final"]["odd_after"])
    assert {"ece_0", "accept_0"} <= set(report["final"]["odd_after_temperature"])
    from specheads.train.trainer import recalibrate_run  # `specheads train --calibrate-only`: no training

    summary = (tmp_path / "train_summary.json").read_bytes()
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    (tmp_path / "calibration.json").unlink()
    again = recalibrate_run(recipe, target=target)
    assert again["final"]["biases"] == pytest.approx(biases, abs=1e-6)  # the same rows: the same fit
    assert (tmp_path / "calibration.json").exists() and (tmp_path / "train_summary.json").read_bytes() == summary
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ckpts


def test_save_load_bit_exact_and_frozen_parts(tiny, tmp_path):
    head = _head(tiny, draft_vocab_size=100)
    head.conf_temperature.copy_(torch.tensor([0.5, 1.5, 2.0, 3.0]))
    head.conf_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.4]))
    head.save_pretrained(tmp_path / "h")
    back = load_head(tmp_path / "h", tiny)
    sd, sd2 = head.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    z = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    assert torch.allclose(back.calibrated(z), torch.sigmoid(z / sd["conf_temperature"] + sd["conf_bias"]))
    assert "embed_tokens.weight" not in sd and back.embed_tokens is tiny.embed_tokens
    assert not back.lm_head.weight.requires_grad  # the target's rows of d2t, frozen (as speculators / DeepSpec)
    torch.testing.assert_close(back.lm_head.weight, tiny.lm_head.weight[back.d2t])
    full = _head(tiny)  # no draft vocab: the target's lm_head by reference, not saved
    assert "lm_head.weight" not in full.state_dict() and full.lm_head is tiny.lm_head


def test_folder_saved_before_the_bias_loads_uncalibrated_bias(tiny, tmp_path):
    """A head folder written before `conf_bias` existed (no such key, no checksum sidecar) loads with β = 0;
    any other missing key is still one error naming it."""
    from safetensors.torch import load_file, save_file

    head = _head(tiny)
    head.save_pretrained(tmp_path / "h")
    w = tmp_path / "h" / "model.safetensors"
    sd = load_file(str(w))
    (tmp_path / "h" / "model.safetensors.sha256").unlink()
    save_file({k: v for k, v in sd.items() if k != "conf_bias"}, str(w))
    assert bool((load_head(tmp_path / "h", tiny).conf_bias == 0).all())
    save_file({k: v for k, v in sd.items() if k != "conf_temperature"}, str(w))
    with pytest.raises(SpecheadsError, match="missing key 'conf_temperature'"):
        load_head(tmp_path / "h", tiny)


def _same_state(a, b, skip=()):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if k not in skip:
            assert torch.equal(sa[k], sb[k]), k


CASES = [("speculators", dict(draft_vocab_size=100)), ("speculators", dict(markov_rank=0, confidence_head=False,
         sample_from_anchor=False)), ("speculators", dict(markov_head_type="rnn")),
         ("specforge", dict(markov_head_type="gated")), ("specforge", dict(markov_rank=0, confidence_head=False,
                                                                            sample_from_anchor=False))]


@pytest.mark.parametrize("fmt,kw", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_export_import_round_trip_bit_exact(tiny, tmp_path, fmt, kw):
    head = _head(tiny, **kw)
    head.conf_temperature.fill_(2.0)  # neither format carries the calibration: back as T = 1, β = 0
    head.conf_bias.fill_(0.5)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", fmt, tmp_path / "out")
    back = import_head(tmp_path / "out", tiny)
    assert back.kind == "dspark" and back.spec.options.block_size == 4 and back.config.feature_layers == [1, 2, 3]
    for k in ("markov_rank", "markov_head_type", "confidence_head", "sample_from_anchor"):
        assert getattr(back.spec.options, k) == getattr(head.spec.options, k), k
    for k in ("mask_token_id", "num_layers", "draft_vocab_size"):
        assert getattr(back.spec, k) == getattr(head.spec, k), k
    _same_state(head, back, skip=("conf_temperature", "conf_bias"))
    assert bool((back.conf_temperature == 1).all()) and bool((back.conf_bias == 0).all())


def test_anchor_features_head_stays_native_and_its_exports_are_refused(tiny, tmp_path):
    head = _head(tiny, anchor_features=True, draft_vocab_size=100)
    head.save_pretrained(tmp_path / "h")
    back = load_head(tmp_path / "h", tiny)
    _same_state(head, back)
    f, ids = _inputs()
    a = torch.tensor([[5]])
    torch.testing.assert_close(back(f, ids, a)[0], head(f, ids, a)[0], atol=0, rtol=0)
    for fmt, loader in [("speculators", "speculators. DSparkDraftModel"),
                        ("specforge", "SpecForge.s DSparkDraftModel")]:
        with pytest.raises(SpecheadsError, match=rf"--format {fmt}: .*{loader}.* cannot run this head: .*"
                                                 "head.dspark.anchor_features"):
            export_head(tmp_path / "h", fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()
    with pytest.raises(SpecheadsError, match="head.anchor_features: a setting of .*dspark.* heads, not of an EAGLE-3"):
        HeadSpec(kind="eagle3", anchor_features=True)


def test_export_layouts_match_the_consumers_contracts(tiny, tmp_path):
    head = _head(tiny, draft_vocab_size=100)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "speculators", tmp_path / "s", verifier_name_or_path="org/verifier")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["DSparkSpeculator"]
    assert cfg["aux_hidden_state_layer_ids"] == [1, 2, 3]  # speculators uses hidden_states ids, as we do
    assert cfg["block_size"] == 4 and cfg["sample_from_anchor"] is True and cfg["mask_token_id"] == 0
    assert cfg["markov_rank"] == 16 and cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3" and cfg["draft_vocab_size"] == 100
    sd = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert torch.equal(sd["d2t"] + torch.arange(100), head.d2t) and "conf_temperature" not in sd  # offsets
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "t2d", "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias",
            "layers.1.self_attn.k_norm.weight"} <= set(sd)
    assert sd["markov_head.markov_w1.weight"].shape == (V, 16) and sd["markov_head.markov_w2.weight"].shape == (100, 16)

    with pytest.raises(SpecheadsError, match="full vocabulary"):
        export_head(tmp_path / "h", "specforge", tmp_path / "x")
    full = _head(tiny, markov_head_type="gated")
    full.save_pretrained(tmp_path / "f")
    export_head(tmp_path / "f", "specforge", tmp_path / "sf")
    cfg = json.loads((tmp_path / "sf" / "config.json").read_text())
    # SpecForge's DSparkDraftModel (configs/qwen3-8b-dspark.json): a Qwen3 config (model_type qwen3, which
    # AutoConfig and SGLang's start-up load), block_size, num_target_layers, dflash_config (z-lab ids = ours - 1,
    # projector_type dspark and the DSpark fields); the fields again at the top level for SGLang 0.5.23
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_target_layers"] == 4 and "dspark_config" not in cfg
    assert cfg["num_hidden_layers"] == 2 and cfg["layer_types"] == ["full_attention"] * 2
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 1, 2], "mask_token_id": 0, "projector_type": "dspark",
                                    "attention_mode": "gqa", "markov_rank": 16, "markov_head_type": "gated",
                                    "enable_confidence_head": True, "confidence_head_with_markov": True}
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["sample_from_anchor"]) == (16, "gated", True)
    keys = set(load_file(str(tmp_path / "sf" / "model.safetensors")))
    assert "markov_head.gate_proj.weight" in keys and not {"lm_head.weight", "d2t", "t2d"} & keys
    for kw, name in ((dict(sample_from_anchor=False), "DSparkDraftModel"),
                     (dict(markov_rank=0, confidence_head=False), "DFlashDraftModel")):  # SpecForge's alignments
        _head(tiny, **kw).save_pretrained(tmp_path / "a")
        with pytest.raises(SpecheadsError, match=rf"--format specforge: .* head\.dspark\.sample_from_anchor .*{name} reads "
                                                 "slot k as the draft of"):
            export_head(tmp_path / "a", "specforge", tmp_path / "x")


def test_bad_inputs_give_one_clear_error(tiny, tmp_path):
    from specheads.target import tiny_target

    with pytest.raises(SpecheadsError, match="head.dspark.block_size: 1 drafts nothing"):
        HeadSpec(kind="dspark", block_size=1, sample_from_anchor=False)
    with pytest.raises(SpecheadsError, match="head.dspark.block_size: must be >= 1"):
        HeadSpec(kind="dspark", block_size=0)
    positions = tiny.max_positions
    with pytest.raises(SpecheadsError, match=f"head.dspark.block_size: .* does not fit the {positions} positions"):
        build_head(HeadSpec(kind="dspark", block_size=positions, feature_layers=[1, 2, 3]), tiny)
    with pytest.raises(SpecheadsError, match=r"head.feature_layers: 9 is outside 0..4"):
        build_head(HeadSpec(kind="dspark", feature_layers=[1, 9]), tiny)
    with pytest.raises(SpecheadsError, match="head.dspark.confidence_with_markov: needs head.dspark.markov_rank > 0"):
        HeadSpec(kind="dspark", markov_rank=0)
    with pytest.raises(SpecheadsError, match="head.mask_token_id: 999 is outside the target vocab"):
        build_head(HeadSpec(kind="dspark", mask_token_id=999, feature_layers=[1, 2, 3]), tiny)
    with pytest.raises(SpecheadsError, match="head.markov_head_type"):
        from specheads.config import load_config
        from specheads.train.recipe import Recipe

        load_config(Recipe, None, ["head.kind=dspark", "head.markov_head_type=lstm"])
    from specheads.heads.dspark import DSparkHead

    build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), tiny).save_pretrained(tmp_path / "e3")
    with pytest.raises(SpecheadsError, match=r"key 'kind' is 'eagle3', expected 'dspark'"):
        DSparkHead.from_pretrained(tmp_path / "e3", tiny)
    with pytest.raises(SpecheadsError, match="hidden size 64 vs 32"):
        _head(tiny).save_pretrained(tmp_path / "d")
        load_head(tmp_path / "d", tiny_target(hidden_size=32))


@pytest.mark.skipif(not SPEC_PY.exists(), reason="no .venv-speculators (run scripts/setup_speculators_venv.sh)")
@pytest.mark.parametrize("kw", [dict(draft_vocab_size=100), dict(markov_head_type="rnn", sample_from_anchor=False),
                                dict(markov_rank=0, confidence_head=False, sample_from_anchor=False)],
                         ids=["dspark-vanilla-V'", "dspark-rnn-dflash-slots", "dflash"])
def test_speculators_package_loads_and_runs_our_export(tiny, tmp_path, kw):
    """The real consumer: speculators' own config and model classes load the export (every weight equal), and its
    own training forward gives our Markov-corrected block logits and confidence logits (within 1e-4) and the same
    verifier targets per draft (the slot <-> token alignment)."""
    head = _head(tiny, **kw)
    toks = speculators_export(tiny, head, tmp_path)
    T = toks.shape[1]
    out, pre = verifier_states(tiny, toks)
    with torch.no_grad():
        torch.testing.assert_close(tiny.final_norm(pre), out.hidden_states[4])
    feats = torch.cat([out.hidden_states[i] for i in (1, 2, 3)], -1)
    anchors = torch.tensor([[2, 5, 6, 11]])  # A * K = 16 < T
    lm = torch.zeros(1, T)
    lm[0, anchors[0]] = 1  # speculators samples its anchors among loss-mask positions: exactly these four
    with torch.no_grad():
        logits, conf = head(feats, toks, anchors)
    rows = anchors[0][:, None] + torch.arange(head.num_drafts)  # draft j of the block at p: target row p + j
    targets = tiny.lm_head(out.hidden_states[4])[0, rows]
    if head.d2t is not None:
        targets = targets[..., head.d2t]
    ref = {"features": feats, "tokens": toks, "loss_mask": lm, "verifier_last": pre, "logits": logits[0],
           "targets": targets}
    if conf is not None:
        ref["conf"] = conf[0]
    (tmp_path / "ref").mkdir()
    save_file({k: v.contiguous() for k, v in ref.items()}, str(tmp_path / "ref" / "inputs.safetensors"))
    got = run_fixture(SPEC_PY, "speculators_dspark_load.py", tmp_path / "s", tmp_path / "ref")
    diffs = got.pop("max_abs_diff")
    kind = "dflash" if not head.spec.options.confidence_head and head.spec.options.markov_rank == 0 else "dspark"
    assert got["class"] == {"dspark": "DSparkDraftModel", "dflash": "DFlashDraftModel"}[kind]
    assert got["embed_is_verifier"]  # its load_verifier_weights overwrites the embedding (dflash/core.py)
    assert got["block_size"] == 4 and got["anchors"] == 4 and got["aux_ids"] == [1, 2, 3]
    assert got["sample_from_anchor"] == head.spec.options.sample_from_anchor and got["verifier"] == str(tmp_path / "verifier")
    assert set(diffs) == ({"logits", "targets", "conf"} if conf is not None else {"logits", "targets"})
    assert max(diffs.values()) < 1e-4, diffs


def run_specforge_load(export_dir: Path, target, feats, toks, anchors: list[int], tmp_path: Path
                       ) -> tuple[dict, dict]:
    """Run tests/fixtures/specforge_load.py in .venv-specforge on an export: SpecForge builds its draft model from
    the folder and runs its own training forward over exactly `anchors` (the loss mask marks each anchor and the
    token after it, nothing else twice in a row, so its sampler takes them all). -> (its JSON report, its logits /
    confidence logits per block and slot)."""
    ref = tmp_path / "sfref"
    ref.mkdir()
    target.model.save_pretrained(ref / "verifier")  # what SpecForge's TargetEmbeddingsAndHead reads
    T = toks.shape[1]
    lm = torch.zeros(1, T)
    for a in anchors:
        lm[0, a] = lm[0, a + 1] = 1
    with torch.no_grad():
        last = target.model(toks, output_hidden_states=True).hidden_states[-1]  # the final post-norm state
    save_file({"features": feats.contiguous(), "tokens": toks, "loss_mask": lm, "last": last.contiguous()},
              str(ref / "inputs.safetensors"))
    return run_fixture(SF_PY, "specforge_load.py", export_dir, ref), load_file(str(ref / "out.safetensors"))


SPECFORGE_CASES = [dict(markov_head_type="vanilla"), dict(markov_head_type="gated", confidence_with_markov=False),
                   dict(markov_head_type="rnn"), dict(markov_rank=0, confidence_head=False, sample_from_anchor=False)]


@pytest.mark.skipif(not SF_PY.exists(), reason="no .venv-specforge (run scripts/setup_specforge_venv.sh)")
@pytest.mark.parametrize("kw", SPECFORGE_CASES, ids=["dspark-vanilla", "dspark-gated-conf-alone", "dspark-rnn",
                                                     "dflash"])
def test_specforge_builds_and_runs_our_export(tiny, tmp_path, kw):
    """The real consumer (issue 38): SpecForge 0.2.0's own classes build the draft from our folder (AutoConfig:
    model_type qwen3; AutoDraftModel -> DSparkDraftModel / DFlashDraftModel; the Markov and confidence heads from
    dflash_config, every weight equal, none of its parameters left unread) and its own training forward gives, per
    block and slot, our Markov-corrected logits and confidence logits (DSpark: slot k drafts x_(p+k+1); DFlash:
    slot k >= 1 drafts x_(p+k))."""
    head = _head(tiny, **kw)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "specforge", tmp_path / "sf")
    f, toks = _inputs()
    anchors = [2, 6, 11, 15]  # A * K = 16 < T; anchors three apart at least
    with torch.no_grad():
        logits, conf = head(f, toks, torch.tensor([anchors]))
    got, out = run_specforge_load(tmp_path / "sf", tiny, f, toks, anchors, tmp_path)
    dspark = head.spec.options.markov_rank > 0 or head.spec.options.confidence_head
    assert got == {"ok": True, "class": "DSparkDraftModel" if dspark else "DFlashDraftModel", "config": "Qwen3Config",
                   "model_type": "qwen3", "checked": len(load_file(str(tmp_path / "sf" / "model.safetensors"))),
                   "block_size": 4, "anchors": 4, "target_layer_ids": [0, 1, 2], "mask_token_id": 0,
                   "markov_head": {"vanilla": "VanillaMarkovHead", "gated": "GatedMarkovHead", "rnn": "RNNMarkovHead",
                                   None: "NoneType"}[head.spec.options.markov_head_type if head.spec.options.markov_rank else None],
                   "confidence_head": head.spec.options.confidence_head,
                   "confidence_head_with_markov": head.spec.options.confidence_head and head.spec.options.confidence_with_markov}
    theirs = out["logits"][:, 0 if head.spec.options.sample_from_anchor else 1:]
    assert theirs.shape == logits[0].shape
    torch.testing.assert_close(theirs, logits[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(theirs.argmax(-1), logits[0].argmax(-1))
    if conf is not None:
        torch.testing.assert_close(out["conf"], conf[0], atol=1e-4, rtol=1e-4)


def test_specforge_folders_of_our_earlier_layout_still_import(tiny, tmp_path):
    """Before issue 38 the specforge export wrote model_type dspark and the DSpark fields at the top level and in
    dspark_config (SpecForge read neither); such folders import as the same head, and so do SpecForge's own DSpark
    configs (fields in dflash_config only, its defaults where absent)."""
    head = _head(tiny, markov_head_type="rnn", confidence_with_markov=False)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "specforge", tmp_path / "sf")
    cfg = json.loads((tmp_path / "sf" / "config.json").read_text())
    fields = {k: cfg["dflash_config"].pop(k) for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                                      "confidence_head_with_markov")}
    del cfg["dflash_config"]["projector_type"], cfg["dflash_config"]["attention_mode"]
    old = dict(cfg, model_type="dspark", dspark_config=fields, **fields)
    (tmp_path / "sf" / "config.json").write_text(json.dumps(old))
    back = import_head(tmp_path / "sf", tiny)
    _same_state(head, back, skip=("conf_temperature", "conf_bias"))
    assert (back.spec.options.markov_head_type, back.spec.options.confidence_with_markov, back.spec.options.sample_from_anchor) == \
        ("rnn", False, True)
    for k in fields:  # SpecForge's own layout: the fields in dflash_config alone
        del cfg[k]
    cfg["dflash_config"].update(projector_type="dspark", markov_rank=16, markov_head_type="rnn",
                                enable_confidence_head=True)  # confidence_head_with_markov: its default false
    del cfg["sample_from_anchor"]  # SpecForge's DSpark alignment
    (tmp_path / "sf" / "config.json").write_text(json.dumps(cfg))
    back = import_head(tmp_path / "sf", tiny)
    _same_state(head, back, skip=("conf_temperature", "conf_bias"))


def _sglang_dspark_reading(cfg: dict) -> dict:
    """What SGLang 0.5.23 (its release wheel) takes from a DSpark / DFlash draft folder's config.json, re-stated:
    the class from architectures[0] (models/dspark.py EntryClass: DSparkDraftModel, Qwen3DSparkModel,
    LingDSparkModel; models/dflash.py: DFlashDraftModel); speculative/dflash_utils.py parse_dflash_draft_config:
    block_size and target_layer_ids from dflash_config, else the top level; dspark_components/dspark_config.py
    parse_dspark_draft_config: markov_rank, markov_head_type, mask_token_id from {**dflash_config,
    **dspark_config}, else the top level (markov_rank > 0 required, the head type one of vanilla / gated / rnn);
    get_dspark_sample_from_anchor: top level, default true; and the model's own heads (models/dspark.py
    build_markov_head, build_confidence_head): getattr(config, "markov_rank" / "markov_head_type" /
    "confidence_head_with_markov") at the top level."""
    dfc = cfg.get("dflash_config") or {}
    merged = {**dfc, **(cfg.get("dspark_config") or {})}
    out = {"class": cfg["architectures"][0], "block_size": dfc.get("block_size", cfg.get("block_size")),
           "target_layer_ids": dfc.get("target_layer_ids", cfg.get("target_layer_ids")),
           "mask_token_id": merged.get("mask_token_id", cfg.get("mask_token_id"))}
    if out["class"] == "DSparkDraftModel":
        rank = int(merged.get("markov_rank", cfg.get("markov_rank", 0)))
        assert rank > 0, "DSpark requires markov_rank > 0"
        kind = str(merged.get("markov_head_type", cfg.get("markov_head_type"))).lower()
        assert kind in ("vanilla", "gated", "rnn")
        out.update(markov_rank=rank, markov_head_type=kind, sample_from_anchor=bool(cfg.get("sample_from_anchor", True)),
                   model_markov=(int(cfg.get("markov_rank", 0)), str(cfg.get("markov_head_type", "vanilla"))),
                   confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", rank > 0)))
    return out


@pytest.mark.parametrize("kw", SPECFORGE_CASES, ids=["dspark-vanilla", "dspark-gated-conf-alone", "dspark-rnn",
                                                     "dflash"])
def test_specforge_export_as_sglang_reads_it(tiny, tmp_path, kw):
    """SGLang 0.5.23's DSpark / DFlash loaders on our specforge export (_sglang_dspark_reading; read, SGLang does
    not run on a CPU here): AutoConfig loads the folder (model_type qwen3), and SGLang finds the head's block size,
    layers (ours - 1), mask token, Markov rank and type (in its config parser and its model alike), alignment and
    confidence input; the Markov / confidence tensors are named as its modules' parameters."""
    from transformers import AutoConfig

    head = _head(tiny, **kw)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "specforge", tmp_path / "sf")
    assert AutoConfig.from_pretrained(tmp_path / "sf").model_type == "qwen3"  # SGLang's start-up: AutoConfig
    cfg = json.loads((tmp_path / "sf" / "config.json").read_text())
    got, spec = _sglang_dspark_reading(cfg), head.spec
    want = {"block_size": 4, "target_layer_ids": [0, 1, 2], "mask_token_id": 0}
    if spec.options.markov_rank:
        want.update({"class": "DSparkDraftModel", "markov_rank": 16, "markov_head_type": spec.options.markov_head_type,
                     "sample_from_anchor": True, "model_markov": (16, spec.options.markov_head_type),
                     "confidence_head_with_markov": spec.options.confidence_with_markov})
    else:
        want["class"] = "DFlashDraftModel"
    assert got == want
    keys = set(load_file(str(tmp_path / "sf" / "model.safetensors")))
    extra = {"vanilla": set(), "gated": {"gate_proj.weight", "gate_proj.bias"},
             "rnn": {"joint_proj.weight", "joint_proj.bias"}}  # dspark.py VanillaMarkov / GatedMarkovHead / RNNHead
    markov = {k[len("markov_head."):] for k in keys if k.startswith("markov_head.")}
    assert markov == ({"markov_w1.weight", "markov_w2.weight"} | extra[spec.options.markov_head_type] if spec.options.markov_rank
                      else set())
    conf = {k for k in keys if k.startswith("confidence_head.")}
    assert conf == ({"confidence_head.proj.weight", "confidence_head.proj.bias"} if spec.options.confidence_head else set())
