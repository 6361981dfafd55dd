"""DSpine heads (heads/dspine.py) on the tiny target: the adjacent causal injection by hand on tiny tensors (slot k
reads slot k-1's predicted feature and nothing after it; the anchor slot is never written; zero writes are the
identity), the causal block attention, the token codes, the greedy block pass equal to the teacher-forced forward,
the refinement reading the previous token only, the loss terms and schedule by hand, a train step with the
scheduled replacement, greedy exactness and lossless sampling end to end, the export refusals."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specheads.heads import HeadSpec, build_head
from specheads.heads.dspine import AdjacentInjection
from specheads.train.kinds.dspine import align_loss, refine_loss, schedule
from specheads.train.settings import BlockTrainConfig
from specheads.utils import SpecheadsError
from helpers import greedy_chain, perturb, sampled_pairs, two_token_probs
from tests.test_dspark import _inputs  # the same random features and tokens as the DSpark tests

V, D = 256, 64
BASE = {"kind": "dspine", "feature_layers": [1, 2, 3], "block_size": 5, "markov_rank": 0, "confidence_head": False,
        "sample_from_anchor": False, "num_layers": 2, "dspine_transfer_rank": 16, "dspine_message_size": 8,
        "dspine_top_k": 6, "mask_token_id": 5}


def _head(tiny, seed=3, **kw):
    spec = HeadSpec(**{**BASE, **kw})
    head = build_head(spec, tiny, token_counts=torch.arange(V) if spec.draft_vocab_size else None)
    return perturb(head, 0.1, seed, trainable_only=True)  # far from init (the writes too): every injection matters


def _injection(rank=6, message=4, hidden=8, layers=2, seed=0):
    torch.manual_seed(seed)
    inj = AdjacentInjection(hidden, layers, rank, message, write_std=0.3)
    with torch.no_grad():
        inj.predecessor_gate.weight.normal_(std=0.3)
        inj.bias.normal_()
    return inj


def test_injection_equations_by_hand():
    """z_k = u_k + rms(u_k) W_i(σ(G_r f_k + G_p π_k + b) ⊙ M π_k), π_1 = the anchor's code, π_k = f_{k-1}."""
    inj = _injection()
    u, anchor = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 6)
    z = inj(u, 1, anchor)
    R, W, M = inj.readouts[1].weight, inj.writes[1].weight, inj.message.weight
    Gr, Gp, b = inj.receiver_gate.weight, inj.predecessor_gate.weight, inj.bias
    f = [math.sqrt(6) * R @ u[0, 0, k] / (R @ u[0, 0, k]).norm() for k in range(4)]
    assert torch.equal(z[0, 0, 0], u[0, 0, 0])  # the anchor slot is never written
    for k in range(1, 4):
        pi = anchor[0, 0] if k == 1 else f[k - 1]
        gate = torch.sigmoid(Gr @ f[k] + Gp @ pi + b)
        want = u[0, 0, k] + u[0, 0, k].norm() / math.sqrt(8) * (W @ (gate * (M @ pi)))
        torch.testing.assert_close(z[0, 0, k], want, atol=1e-5, rtol=1e-5)


def test_injection_is_adjacent_and_causal():
    """Slot k's output changes with slot k-1's state (its predicted feature) and never with a later slot's; the
    anchor code reaches slot 1 only."""
    inj = _injection()
    u, anchor = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6)
    z = inj(u, 0, anchor)
    for k in range(1, 4):
        v = u.clone()
        v[:, :, k] += torch.randn_like(v[:, :, k])
        zv = inj(v, 0, anchor)
        assert torch.equal(zv[:, :, :k], z[:, :, :k])  # earlier slots: untouched
        assert (zv[:, :, k + 1] - z[:, :, k + 1]).abs().amax() > 1e-4  # the next slot reads it
        assert torch.equal(zv[:, :, k + 2:], z[:, :, k + 2:])  # one slot per layer, no further
    za = inj(u, 0, anchor + 1.0)
    assert torch.equal(za[:, :, 0], z[:, :, 0]) and torch.equal(za[:, :, 2:], z[:, :, 2:])
    assert (za[:, :, 1] - z[:, :, 1]).abs().amax() > 1e-4


def test_zero_writes_are_the_identity_and_forced_predecessors_apply_below_the_layer_count():
    inj = AdjacentInjection(8, 3, 6, 4, write_std=0.0)
    u, anchor = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 6)
    assert torch.equal(inj(u, 2, anchor), u)
    inj = _injection(layers=3)
    codes, mask = torch.randn(2, 2, 3, 6), torch.tensor([[True, False], [False, True]])
    for layer in range(3):
        plain, forced = inj(u, layer, anchor), inj(u, layer, anchor, (codes, mask, 1))
        assert torch.equal(forced[~mask], plain[~mask])
        assert torch.equal(forced[..., 0, :], plain[..., 0, :])
        if layer < 1:
            assert (forced[mask] - plain[mask]).abs().amax() > 1e-4
        else:
            assert torch.equal(forced, plain)


def test_block_attention_is_causal_inside_the_block(tiny):
    head = _head(tiny)
    attn, layer = head.layers[0].self_attn, head.layers[0]
    x = torch.randn(1, 2, 5, D)
    pos = torch.arange(5).view(1, 1, 5).expand(1, 2, 5) + 7
    cos, sin = head._rope(x, pos.flatten(1))
    cos, sin = (t.view(1, 2, 5, -1) for t in (cos, sin))
    ck, cv = (torch.randn(1, attn.Hkv, 7, attn.hd) for _ in range(2))
    allowed = torch.ones(1, 2, 7, dtype=torch.bool)
    out = layer(x, cos, sin, ck, cv, allowed)
    y = x.clone()
    y[:, :, 2] += 1.0
    out2 = layer(y, cos, sin, ck, cv, allowed)
    torch.testing.assert_close(out2[:, :, :2], out[:, :, :2], atol=1e-6, rtol=1e-6)  # slots 0, 1 see no slot 2
    assert (out2[:, :, 3:] - out[:, :, 3:]).abs().amax() > 1e-4  # slots after it do


def test_token_codes_and_readouts_from_the_target_lm_head(tiny):
    head = build_head(HeadSpec(**BASE), tiny)
    codes = head.transfer_codes
    torch.testing.assert_close(codes.norm(dim=-1), torch.ones(V), atol=1e-5, rtol=1e-5)
    R = head.injection.readouts[0].weight  # P^T: orthonormal principal directions of the normalised rows
    torch.testing.assert_close(R @ R.T, torch.eye(16), atol=1e-4, rtol=1e-4)
    assert torch.equal(R, head.injection.readouts[1].weight)
    n = F.normalize(tiny.lm_head.weight.float(), dim=-1)
    proj = (n - n.mean(0)) @ R.T  # the codes are these projections whitened per direction, then normalised
    scale = proj.std(0, unbiased=False)
    torch.testing.assert_close(codes, F.normalize(proj / scale, dim=-1), atol=1e-4, rtol=1e-4)
    with pytest.raises(SpecheadsError, match=r"head\.dspine\.transfer_rank: 65 must be within 1..64"):
        build_head(HeadSpec(**{**BASE, "dspine_transfer_rank": 65}), tiny)


@pytest.mark.parametrize("kw", [{}, {"draft_vocab_size": 100}], ids=["full-vocab", "draft-vocab"])
def test_greedy_block_equals_teacher_forced_forward(tiny, kw):
    head = _head(tiny, **kw)
    f, ids = _inputs()
    p = 9
    _, logits, conf, forced = greedy_chain(head, f, ids, p)  # forced: the data continues with the greedy drafts
    assert conf is None and logits.shape == (4, head.config.out_vocab)
    assert (torch.isfinite(logits).sum(-1) == 6).all()  # the top-6 candidates of each draft carry its q
    out = head(f, forced, torch.tensor([[3, p]]))
    tf = torch.full_like(out.base, float("-inf")).scatter(-1, out.candidates, out.scores)[0, 1]
    assert torch.equal(torch.isfinite(tf), torch.isfinite(logits))
    torch.testing.assert_close(tf[torch.isfinite(tf)], logits[torch.isfinite(logits)], atol=1e-5, rtol=1e-5)
    # the first draft's predecessor is the anchor, which the forward injection already read: scores = base logits
    torch.testing.assert_close(out.scores[0, 1, 0], out.base[0, 1, 0].gather(-1, out.candidates[0, 1, 0]),
                               atol=1e-5, rtol=1e-5)


def test_refinement_reads_the_previous_token_only(tiny):
    """Changing the data's x_{p+j} changes draft j's refined scores only: the block itself reads only the anchor."""
    head = _head(tiny)
    f, ids = _inputs()
    p, j = 9, 2
    other = ids.clone()
    other[0, p + j] = (ids[0, p + j] + 1) % V
    a, b = head(f, ids, torch.tensor([[p]])), head(f, other, torch.tensor([[p]]))
    assert torch.equal(a.base, b.base) and torch.equal(a.features, b.features)
    keep = [i for i in range(4) if i != j]
    assert torch.equal(a.scores[0, 0, keep], b.scores[0, 0, keep])
    assert (a.scores[0, 0, j] - b.scores[0, 0, j]).abs().max() > 1e-5


def test_sampled_drafts_read_the_drawn_predecessor(tiny):
    """With pick, draft j+1's q is the one re-scored on the token drawn for draft j (not on its argmax)."""
    head = _head(tiny)
    f, ids = _inputs()
    cache = head.new_cache()
    head.extend_context(cache, f[0, :9])
    drawn = []

    def pick(j, lg):  # the candidate ranked second, a token the greedy chain would not take
        tok = lg.topk(2, dim=-1).indices[..., 1]
        drawn.append(int(tok))
        return tok

    logits, _ = head.draft_block(cache, ids[0, 9], pick=pick)
    forced = ids.clone()
    forced[0, 10:14] = head.to_target_ids(torch.tensor(drawn))
    out = head(f, forced, torch.tensor([[9]]))
    tf = torch.full_like(out.base, float("-inf")).scatter(-1, out.candidates, out.scores)[0, 0]
    torch.testing.assert_close(tf[torch.isfinite(tf)], logits[torch.isfinite(logits)], atol=1e-5, rtol=1e-5)


def test_refine_and_align_losses_by_hand():
    class Identity:  # no draft vocab: draft ids are target ids
        @staticmethod
        def to_target_ids(x):
            return x

    scores = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])  # [N=1,K'=2,k=3]
    cand = torch.tensor([[[4, 1, 7], [3, 2, 0]]])
    labels = torch.tensor([[1, 9]])  # draft 0's label is its 2nd candidate; draft 1's is not a candidate
    tgt = torch.full((1, 2, 10), -30.0)
    tgt[0, 0, [4, 1, 7]] = torch.tensor([1.0, 2.0, 0.0])
    tgt[0, 1, 9] = 5.0  # draft 1: the target's mass is off the candidates (below the threshold)
    lse = tgt.logsumexp(-1)
    w = torch.tensor([[1.0, 0.5]])
    got, cover = refine_loss(Identity, scores, cand, labels, tgt, lse, w, 0.1, 0.9, 1e-4)
    q0 = scores[0, 0].softmax(-1)
    p0 = torch.tensor([1.0, 2.0, 0.0]).softmax(-1)
    ce0, l10 = -q0[1].log(), (q0 - p0).abs().sum()
    want = (1.0 * (0.1 * ce0 + 0.9 * l10) + 0.5 * 0.0) / 1.5  # draft 1: no covered label, no L1 (mass ~ 0)
    torch.testing.assert_close(got, want)
    assert cover == pytest.approx(0.5)
    feats = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]], [[[1.0, 1.0], [0.0, -1.0]]]])  # [n=2,N=1,K'=2,r=2]
    codes = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    a = align_loss(feats, codes, w)  # layer 0: 0, 0; layer 1: 1 - 1/√2, 2
    assert float(a) == pytest.approx(((1 - 2 ** -0.5) * 1.0 + 2.0 * 0.5) / 1.5, rel=1e-6)


def test_schedule_reaches_specforge_endpoints():
    cfg = BlockTrainConfig()
    assert schedule(0, 600, cfg) == (0.0, 0.5)
    assert schedule(100, 600, cfg)[1] == pytest.approx(0.5)
    assert schedule(150, 600, cfg)[1] == pytest.approx(0.25)
    assert schedule(200, 600, cfg)[1] == 0.0 and schedule(146, 600, cfg)[0] == 0.5
    assert schedule(73, 600, cfg)[0] == pytest.approx(0.25)
    with pytest.raises(SpecheadsError, match="dspine_replace_hold"):
        BlockTrainConfig(dspine_replace_hold=0.5, dspine_replace_end=0.4)


def test_train_step_replaces_and_moves_every_part(tiny):
    """The loss on sampled blocks at step 0 (every block's shallow layer replaced with probability 0.5); its
    gradient reaches every trainable tensor and not the codes; replaced blocks differ in the features only there."""
    from specheads.train.kinds.dspine import loss
    from specheads.train.steps import LossSettings

    head = _head(tiny)
    f, ids = _inputs(T=24)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    h_last = torch.randn(1, 24, D)
    settings = LossSettings(block=BlockTrainConfig(max_anchors=6, dspine_alignment_warmup=0),
                            generator=torch.Generator().manual_seed(0), step=0, total_steps=10)
    out = loss(head, batch, f, h_last, tiny, settings)
    assert out.metrics["replace_prob"] == 0.5 and out.metrics["align_beta"] == 0.5
    assert torch.isfinite(out.loss) and {"refine_loss", "align_loss", "candidate_coverage"} <= set(out.metrics)
    out.loss.backward()
    for n, p in head.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
    anchors, rep = torch.tensor([[4, 9]]), torch.tensor([[True, False]])
    plain, forced = head(f, ids, anchors), head(f, ids, anchors, replace=(rep, 1))
    assert torch.equal(forced.features[:, 0, 1], plain.features[:, 0, 1])
    assert (forced.features[:, 0, 0] - plain.features[:, 0, 0]).abs().max() > 1e-5


def test_spec_checks():
    for kw, msg in [({"sample_from_anchor": True}, "sample_from_anchor"), ({"markov_rank": 4}, "markov_rank"),
                    ({"confidence_head": True, "confidence_with_markov": False}, "confidence_head"),
                    ({"dspine_top_k": 0}, "top_k"), ({"dspine_write_std": -1.0}, "write_std")]:
        with pytest.raises(SpecheadsError, match=rf"head\.dspine\.{msg}"):
            HeadSpec(**{**BASE, **kw})


def test_greedy_decoding_is_exact(tiny):
    from tests.test_kind_contract import check_greedy_exact

    check_greedy_exact(tiny, _head(tiny), "tree:6")  # the best-first block tree (the contract serves "3")


def test_end_to_end_sampling_is_lossless():
    """generate() with the DSpark drafter over a DSpine head on an 8-token vocabulary (each draft drawn from its
    re-scored top-3 candidates, the next draft refined on the drawn token): the first two new tokens follow the
    target's exact distribution."""
    from specheads.infer.drafters import DSparkDrafter
    from specheads.infer.scheduling.step import Scheduler
    from specheads.infer.verify import SamplingParams
    from specheads.target import tiny_target
    from tests.test_sampling_stats import V as SV, assert_same

    target = tiny_target(vocab_size=SV, hidden_size=32, num_layers=2, seed=0)
    torch.manual_seed(1)
    spec = HeadSpec(kind="dspine", feature_layers=[1, 2], block_size=3, markov_rank=0, num_layers=2,
                    confidence_head=False, sample_from_anchor=False, dspine_transfer_rank=4,
                    dspine_message_size=4, dspine_top_k=3, dspine_write_std=0.3)
    head = perturb(build_head(spec, target).eval(), 0.5, seed=None, trainable_only=True)
    prompt, n = [1, 5, 3], 600
    expected = two_token_probs(target, prompt, SamplingParams(temperature=1.0, top_k=4))
    drafter = DSparkDrafter(head, scheduler=Scheduler({1: 1.0, 2: 1.01, 4: 1.02}, 1.0))
    counts, drafted = sampled_pairs(target, drafter, prompt, n, top_k=4)
    assert drafted > n
    assert_same(counts, expected * n)


def test_exports_are_refused_with_their_reasons(tiny, tmp_path):
    from specheads.heads.export import export_head

    _head(tiny).save_pretrained(tmp_path / "h")
    with pytest.raises(SpecheadsError, match="--format specforge: SpecForge's DSpineDraftModel .* not in specforge "
                                             "0.2.0"):
        export_head(tmp_path / "h", "specforge", tmp_path / "sf", target=tiny)
    with pytest.raises(SpecheadsError, match="--format speculators: speculators 0.9.0 has no DSpine model"):
        export_head(tmp_path / "h", "speculators", tmp_path / "sp", target=tiny)
    assert not (tmp_path / "sf").exists() and not (tmp_path / "sp").exists()
