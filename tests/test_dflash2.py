"""DFlash2 heads (heads/dflash2.py) on the tiny target: the local convolution and the candidate selector by hand on
tiny tensors, the identity start (a fresh DFlash2 backbone is DFlash's), the training forward equal to the served
block, the selector loss by hand and one step of the kind's loss, lossless sampling end to end, the refusals, and the
real `speculators` package loading and running our export."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specheads.heads import HeadSpec, build_head
from specheads.heads.dflash2 import (CandidateSelector, DFlash2Head, LocalConv, block_conv, training_candidates)
from specheads.heads.export import export_head, import_head
from specheads.utils import SpecheadsError
from helpers import (greedy_chain, perturb, run_fixture, sampled_pairs, speculators_export, two_token_probs,
                     verifier_states)

ROOT = Path(__file__).resolve().parents[1]
SPEC_PY = ROOT / ".venv-speculators" / "bin" / "python"
V, D = 256, 64
BASE = dict(kind="dflash2", feature_layers=[1, 2, 3], block_size=4, markov_rank=0, confidence_head=False,
            sample_from_anchor=False, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
            num_layers=2)


def _head(tiny, seed=3, **kw):
    return perturb(build_head(HeadSpec(**{**BASE, **kw}), tiny), 0.1, seed)  # the convolutions not the identity


def _inputs(T=24, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, 3 * D, generator=g), torch.randint(0, V, (1, T), generator=g)


def test_block_conv_by_hand():
    """Conv(x; δ, b)_i = Σ_{t <= min(k-1, i)} x_{i-t} ⊙ (b_t + δ_{i,t}[c // S]) on K = 3 slots, D = 4, S = 2."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])  # [K=3, D=4]
    b = torch.tensor([[1.0, 0.5, 2.0, 1.0], [0.1, 0.2, 0.3, 0.4]])  # [k=2, D]
    delta = torch.tensor([[[0.0, 1.0], [2.0, 3.0]], [[1.0, 0.0], [0.5, -1.0]], [[0.0, 0.0], [1.0, 1.0]]])  # [K,k,G=2]
    want = torch.empty(3, 4)
    for i in range(3):
        for c in range(4):
            want[i, c] = sum(x[i - t, c] * (b[t, c] + delta[i, t, c // 2]) for t in range(min(2, i + 1)))
    assert torch.equal(block_conv(x, delta, b, 2), want)
    assert torch.equal(want[0], x[0] * (b[0] + torch.tensor([0.0, 0.0, 1.0, 1.0])))  # slot 0: no left tap
    blocks = torch.stack([x, x + 100.0])  # [A=2, K, D]: block 1 never reads block 0
    out = block_conv(blocks, torch.stack([delta, delta]), b, 2)
    assert torch.equal(out[0], want) and torch.equal(out[1], block_conv(x + 100.0, delta, b, 2))


def test_local_conv_uses_one_projection_per_side_and_starts_as_the_identity():
    conv = LocalConv(hidden=4, kernel_size=2, group_size=2)
    u = torch.randn(2, 3, 4)
    got, delta = conv.prepare(u)
    assert torch.equal(got, u) and torch.equal(conv.finish(u, delta), u)  # b_0 = 1, b_1 = 0, W_κ = 0
    with torch.no_grad():
        conv.kernel_projection.weight.normal_()
        conv.base_kernel.normal_()
    kappa = (u @ conv.kernel_projection.weight.T).view(2, 3, 2, 2, 2)  # [.., K, side, tap, G]
    got, delta = conv.prepare(u)
    torch.testing.assert_close(got, block_conv(u, kappa[..., 0, :, :], conv.base_kernel[0], 2))
    torch.testing.assert_close(delta, kappa[..., 1, :, :])
    y = torch.randn(2, 3, 4)
    torch.testing.assert_close(conv.finish(y, delta), block_conv(y, kappa[..., 1, :, :], conv.base_kernel[1], 2))


def test_selector_scores_and_logits_by_hand():
    """S(v) = U(v) + < P[x_prev] ⊙ W_h h , Q[v] > on the unary top-k; -inf elsewhere."""
    torch.manual_seed(0)
    sel = CandidateSelector(vocab_size=6, hidden=3, rank=2, top_k=3, std=1.0)
    unary = torch.tensor([0.5, 3.0, -1.0, 2.0, 2.5, 0.0])
    h, prev = torch.tensor([1.0, -2.0, 0.5]), torch.tensor(4)
    cand = torch.tensor([1, 4, 3])  # the unary top-3, in rank order
    P, Q, W = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    with torch.no_grad():
        want = torch.stack([unary[v] + sum(P[4, r] * (W[r] @ h) * Q[v, r] for r in range(2)) for v in cand])
        torch.testing.assert_close(sel.score(unary, h, prev, cand), want)
        lg = sel.logits(unary, h, prev)
    assert torch.isinf(lg[[0, 2, 5]]).all() and (lg[[0, 2, 5]] < 0).all()
    torch.testing.assert_close(lg[cand], want)
    assert int(lg.argmax()) == int(cand[want.argmax()])  # the walk's choice


def test_training_candidates_inject_a_missing_target_at_the_last_rank():
    unary = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0], [0.0, 5.0, 4.0, 3.0, 1.0]])
    cand, pos, hit = training_candidates(unary, torch.tensor([2, 0]), top_k=3)
    assert cand.tolist() == [[1, 2, 3], [1, 2, 0]] and pos.tolist() == [1, 2] and hit.tolist() == [True, False]


def test_fresh_backbone_is_dflash(tiny):
    """Identity convolutions at init: with the same backbone weights, a DFlash2 head's block states are a DFlash
    (dspark, no Markov / confidence head) head's, and its greedy draft is the unary argmax once the selector adds
    nothing."""
    torch.manual_seed(0)
    d2 = build_head(HeadSpec(**BASE), tiny)
    d1 = build_head(HeadSpec(kind="dspark", feature_layers=[1, 2, 3], block_size=4, markov_rank=0,
                             confidence_head=False, sample_from_anchor=False, num_layers=2), tiny)
    own = d1.state_dict()
    d1.load_state_dict({k: v for k, v in d2.state_dict().items() if k in own}, strict=True)
    f, ids = _inputs()
    a = torch.tensor([[3, 9]])
    torch.testing.assert_close(d2.block_states(f, ids, a)[0], d1.block_states(f, ids, a)[0], atol=0, rtol=0)
    with torch.no_grad():
        d2.candidate_selector.successor_codebook.zero_()
    lg, _ = d2.heads(*d2.block_states(f, ids, a))
    base, _ = d1(f, ids, a)
    assert torch.equal(lg.argmax(-1), base.argmax(-1))


@pytest.mark.parametrize("kw", [{}, dict(sample_from_anchor=True, conv_kernel_size=3)],
                         ids=["dflash-slots", "anchor-drafts-3-taps"])
def test_training_forward_equals_draft_block(tiny, kw):
    """The served block (cache fed in two pieces, the selector walked greedily) equals the teacher-forced selector
    logits of the same anchor once the data continues with the drafted tokens; batched blocks equal single ones."""
    head = _head(tiny, **kw)
    f, ids = _inputs()
    p = 9
    cache, logits, conf, forced = greedy_chain(head, f, ids, p, split=4)
    K = head.num_drafts
    assert logits.shape == (K, V) and conf is None and head.d2t is None  # forced holds the drafted ids themselves
    assert (torch.isfinite(logits).sum(-1) == 4).all()  # S on the top-4 candidates only
    tl, _ = head.heads(*head.block_states(f, forced, torch.tensor([[3, p]])))
    torch.testing.assert_close(tl[0, 1], logits, atol=1e-5, rtol=1e-5)
    short = head.new_cache()
    head.extend_context(short, f[0, :4])
    both, _ = head.draft_blocks([cache, short], [int(ids[0, p]), int(ids[0, 4])])
    torch.testing.assert_close(both[0], logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[1], head.draft_block(short, ids[0, 4])[0], atol=1e-5, rtol=1e-5)


def test_selector_loss_by_hand():
    from specheads.train.kinds.dflash2 import selector_loss

    scores = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]], [[1.0, 1.0, 1.0], [0.5, 0.0, -0.5]]])  # [N=2,K'=2,k=3]
    cand = torch.tensor([[[7, 3, 9], [1, 2, 5]], [[4, 6, 8], [2, 3, 1]]])
    want = torch.tensor([[3, 5], [8, 0]])  # ranks 1, 2, 2, and the last one invalid
    valid = torch.tensor([[True, True], [True, False]])
    loss, m = selector_loss(scores, cand, want, valid, gamma=4.0)
    ce = lambda s, i: -torch.log_softmax(s, -1)[i]  # noqa: E731
    w1 = math.exp(-1 / 4)
    want_loss = (ce(scores[0, 0], 1) + w1 * ce(scores[0, 1], 2) + ce(scores[1, 0], 2)) / (2 + w1)
    torch.testing.assert_close(loss, want_loss)
    assert m["sel_acc_0"] == 0.0 and m["sel_acc_1"] == 1.0  # rank 0 picked vs 1 and ties; rank 2 picked at j = 1
    dp, _ = selector_loss(scores, cand, want, valid, gamma=4.0, weighting="dpace", dpace_alpha=1.0)
    # α = 1: w_j = the counted drafts from j on (2, 1 in block 0; 1 in block 1), divided by the 3 counted drafts
    torch.testing.assert_close(dp, (2 * ce(scores[0, 0], 1) + ce(scores[0, 1], 2) + ce(scores[1, 0], 2)) / 3)


def test_the_kinds_loss_adds_the_selector_and_trains_every_part(tiny):
    """One loss step on the tiny target: L = L_block(U) + α_sel L_sel (α_sel 0 leaves exactly the unary term), and
    the gradient reaches the convolutions, the codebooks and the selector projection."""
    from specheads.train.kinds.dflash2 import loss
    from specheads.train.settings import BlockTrainConfig
    from specheads.train.steps import LossSettings

    head = _head(tiny)
    f, ids = _inputs(T=20)
    with torch.no_grad():
        out = tiny.model(ids, output_hidden_states=True)
    h_in = torch.cat([out.hidden_states[i] for i in (1, 2, 3)], -1)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}

    def run(alpha):
        s = LossSettings(block=BlockTrainConfig(max_anchors=4, selector_alpha=alpha),
                         generator=torch.Generator().manual_seed(0))
        return loss(head, batch, h_in, out.hidden_states[4], tiny, s)

    full, unary = run(1.0), run(0.0)
    torch.testing.assert_close(full.loss, unary.loss + torch.tensor(full.metrics["sel_ce"]), atol=1e-5, rtol=1e-5)
    assert 0.0 <= full.metrics["sel_recall"] <= 1.0 and "sel_acc_0" in full.metrics and "acc_0" in full.metrics
    head.zero_grad()
    full.loss.backward()
    for name in ("layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
                 "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight", "fc.weight"):
        g = dict(head.named_parameters())[name].grad
        assert g is not None and g.abs().sum() > 0, name


def test_sampling_is_lossless_end_to_end():
    """generate() sampling with a DFlash2 block drafter (each draft drawn from softmax(S) over its candidates, the
    next draft's predecessor the drawn token, q recorded) on an 8-token vocabulary: the first two new tokens vs the
    exact target distribution (tests/test_sampling_stats.py's check)."""
    from specheads.infer.drafters import DSparkDrafter
    from specheads.infer.scheduling.step import Scheduler
    from specheads.infer.verify import SamplingParams
    from specheads.target import tiny_target
    from tests.test_sampling_stats import assert_same

    Vs = 8
    target = tiny_target(vocab_size=Vs, hidden_size=32, num_layers=2, seed=0)
    torch.manual_seed(1)
    spec = HeadSpec(kind="dflash2", feature_layers=[1, 2], block_size=3, markov_rank=0, confidence_head=False,
                    num_layers=1, sample_from_anchor=True, conv_group_size=16, selector_rank=4, selector_top_k=3)
    head = perturb(build_head(spec, target).eval(), 0.5, seed=None)
    prompt, n = [1, 5, 3], 600
    expected = two_token_probs(target, prompt, SamplingParams(1.0, top_k=4))
    drafter = DSparkDrafter(head, scheduler=Scheduler({1: 1.0, 2: 1.01, 4: 1.02}, 1.0))
    counts, drafted = sampled_pairs(target, drafter, prompt, n, top_k=4)
    assert drafted > n
    assert_same(counts, expected * n)


def test_bad_specs_are_refused(tiny):
    with pytest.raises(SpecheadsError, match=r"head\.dflash2\.markov_rank / head\.dflash2\.confidence_head"):
        HeadSpec(kind="dflash2", block_size=4, markov_rank=16)  # DSpark's Markov head asked for
    with pytest.raises(SpecheadsError, match=r"head\.dflash2\.markov_rank / head\.dflash2\.confidence_head"):
        HeadSpec(kind="dflash2", block_size=4, confidence_head=True)  # and its confidence head
    assert HeadSpec(kind="dflash2", block_size=4).options.markov_rank == 0  # DFlash2's own defaults build
    with pytest.raises(SpecheadsError, match="head.draft_vocab_size: DFlash2 drafts over the full vocabulary"):
        HeadSpec(**{**BASE, "draft_vocab_size": 100})
    with pytest.raises(SpecheadsError, match="head.dflash2.conv_kernel_size: 5 taps exceed the block's 4 slots"):
        HeadSpec(**{**BASE, "conv_kernel_size": 5})
    with pytest.raises(SpecheadsError, match="head.dflash2.selector_top_k: must be >= 1"):
        HeadSpec(**{**BASE, "selector_top_k": 0})
    with pytest.raises(SpecheadsError, match="head.dflash2.conv_group_size: 24 does not divide the target's hidden size 64"):
        build_head(HeadSpec(**{**BASE, "conv_group_size": 24}), tiny)
    with pytest.raises(SpecheadsError, match="head.dflash2.selector_top_k: 300 exceeds the vocabulary 256"):
        build_head(HeadSpec(**{**BASE, "selector_top_k": 300}), tiny)
    with pytest.raises(SpecheadsError, match="head.dflash2.anchor_features"):
        HeadSpec(**{**BASE, "anchor_features": True})


def test_speculators_export_reads_back_and_other_formats_are_refused(tiny, tmp_path):
    head = _head(tiny)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "speculators", tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash2" and cfg["architectures"] == ["DFlash2DraftModel"]
    assert [cfg[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")] == [2, 16, 8, 4]
    assert cfg["draft_vocab_size"] == V and cfg["sample_from_anchor"] is False
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    back = import_head(tmp_path / "s", tiny)
    assert isinstance(back, DFlash2Head) and back.config.head_spec == head.config.head_spec
    want = head.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())
    with pytest.raises(SpecheadsError, match="--format specforge: SpecForge 0.2.0 has no DFlash2"):
        export_head(tmp_path / "h", "specforge", tmp_path / "sf")


@pytest.mark.skipif(not SPEC_PY.exists(), reason="no .venv-speculators (run scripts/setup_speculators_venv.sh)")
@pytest.mark.parametrize("kw", [{}, dict(sample_from_anchor=True, conv_kernel_size=3, selector_top_k=6)],
                         ids=["dflash-slots", "anchor-drafts"])
def test_speculators_package_loads_and_runs_our_export(tiny, tmp_path, kw):
    """The real consumer: speculators' DFlash2SpeculatorConfig / DFlash2DraftModel load the export (every weight
    equal, none of its parameters left unread), and its own training forward gives our unary logits and verifier
    targets per draft, and its own CandidateSelector.select on its hidden states and predecessors our candidates and
    scores (within 1e-4)."""
    head = _head(tiny, **kw)
    toks = speculators_export(tiny, head, tmp_path)
    T = toks.shape[1]
    out, pre = verifier_states(tiny, toks)
    with torch.no_grad():
        feats = torch.cat([out.hidden_states[i] for i in (1, 2, 3)], -1)
        anchors = torch.tensor([[2, 5, 6, 11]])  # A * K = 16 < T
        unary, cand, scores, _ = head(feats, toks, anchors)
    lm = torch.zeros(1, T)
    lm[0, anchors[0]] = 1
    rows = anchors[0][:, None] + torch.arange(head.num_drafts)  # draft j of the block at p: target row p + j
    ref = {"features": feats, "tokens": toks, "loss_mask": lm, "verifier_last": pre, "unary": unary[0],
           "cand": cand[0], "scores": scores[0], "targets": tiny.lm_head(out.hidden_states[4])[0, rows]}
    (tmp_path / "ref").mkdir()
    save_file({k: v.contiguous() for k, v in ref.items()}, str(tmp_path / "ref" / "inputs.safetensors"))
    got = run_fixture(SPEC_PY, "speculators_dflash2_load.py", tmp_path / "s", tmp_path / "ref", timeout=300)
    diffs = got.pop("max_abs_diff")
    s = head.spec
    assert got["class"] == "DFlash2DraftModel" and got["config"] == "DFlash2SpeculatorConfig"
    assert got["algorithm"] == "dflash2" and got["embed_is_verifier"] and got["loss_finite"]
    assert got["block_size"] == 4 and got["anchors"] == 4 and got["aux_ids"] == [1, 2, 3]
    assert got["sample_from_anchor"] == s.options.sample_from_anchor and got["top_k"] == s.options.selector_top_k
    assert got["conv"] == [s.options.conv_kernel_size, s.options.conv_group_size] and got["selector_rank"] == s.options.selector_rank
    assert got["same_candidates"] and got["verifier"] == str(tmp_path / "verifier")
    assert max(diffs.values()) < 1e-4, diffs
