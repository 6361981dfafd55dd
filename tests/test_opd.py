"""Draft-OPD (train/opd.py, train/rollout.py): the loss by hand, what a rollout records, the replay being the served
draft, a stage run for EAGLE-3 and DSpark (head changes, target does not), resume, the recipe path end to end, and
the refusals. Tiny random targets and heads only."""
from __future__ import annotations

import math

import pytest
import torch

from test_resume import target_state
from test_train import make_recipe, state, token_samples

from specheads.heads import HeadSpec, build_head, load_head
from specheads.train.checkpoint import list_checkpoints
from specheads.train.kinds import head_kind
from specheads.train.opd import OpdTrainer, opd_loss, prompt_of, run_opd
from specheads.train.rollout import rollout, rollout_batch
from specheads.utils import SpecheadsError

V = 256
SPECS = {"eagle3": {"kind": "eagle3", "ttt_steps": 2},
         "dspark": {"kind": "dspark", "feature_layers": [1, 2, 3], "block_size": 4, "markov_rank": 16,
                    "num_layers": 1}}


def _head(tiny, kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_head(HeadSpec(**SPECS[kind]), tiny)


def _prompt(seed: int = 0, n: int = 10) -> list[int]:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------------------------------- the loss

def test_loss_by_hand_forward_kl_where_accepted_reverse_kl_where_rejected():
    p = [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]]  # the target's distributions at two states
    q = [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]  # the draft's
    tl, dl = torch.tensor(p).log() + 3.0, torch.tensor(q).log() - 1.0  # logits: any shift per row
    dl.requires_grad_(True)
    fkl = sum(a * math.log(a / b) for a, b in zip(p[0], q[0]))  # KL(p || q) at the accepted state
    rkl = sum(b * math.log(b / a) for a, b in zip(p[1], q[1]))  # KL(q || p) at the rejected one
    out = opd_loss(dl, tl, torch.tensor([True, False]))
    assert out.loss.item() == pytest.approx((fkl + rkl) / 2, rel=1e-5)
    assert out.metrics["fkl"].item() == pytest.approx(fkl, rel=1e-5)
    assert out.metrics["rkl"].item() == pytest.approx(rkl, rel=1e-5)
    weighted = opd_loss(dl, tl, torch.tensor([True, False]), accepted_weight=2.0, rejected_weight=0.5)
    assert weighted.loss.item() == pytest.approx((2 * fkl + 0.5 * rkl) / 2, rel=1e-5)
    # swapping the labels swaps the directions: the two KLs differ, so a wrong direction would show
    swapped = opd_loss(dl, tl, torch.tensor([False, True])).loss.item()
    rkl0 = sum(b * math.log(b / a) for a, b in zip(p[0], q[0]))
    fkl1 = sum(a * math.log(a / b) for a, b in zip(p[1], q[1]))
    assert swapped == pytest.approx((rkl0 + fkl1) / 2, rel=1e-5) and abs(swapped - out.loss.item()) > 1e-3
    out.loss.backward()
    assert dl.grad is not None and dl.grad.abs().sum() > 0


def test_prompt_is_the_tokens_before_the_first_assistant_token():
    ids, lm = torch.arange(10, 20), torch.tensor([0] * 6 + [1] * 4)
    assert prompt_of(ids, lm, 100).tolist() == list(range(10, 16))
    assert prompt_of(ids, lm, 4).tolist() == [12, 13, 14, 15]  # the last tokens kept
    assert prompt_of(ids, torch.tensor([1] * 10), 100).tolist() == [10, 11]  # at least a root and a context row


# ------------------------------------------------------------------------------------------------ rollouts

@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_greedy_rollout_collects_the_induced_states(tiny, kind):
    """The rollout is the target's greedy answer; each state's recorded target logits are the target's at the
    state's position (their argmax is the sequence's next token); accepted states are exactly those whose draft
    was that token; the features are the target's at the head's layers; the replayed logits' argmax is the draft
    the drafter made at every state (the replay is the served drafter)."""
    from specheads.infer.generate import generate
    from specheads.train.features import extract_features

    head = _head(tiny, kind)
    prompt = _prompt()
    r = rollout(tiny, head, prompt, "chain:3", 24)
    plain = generate(tiny, None, input_ids=prompt, max_new_tokens=24)
    assert r.ids == prompt + plain.ids and r.prompt_len == len(prompt)
    assert len(r.root) > 0 and r.forwards > 0
    T = len(r.ids)
    pos = r.root + r.depth  # the state's position: its drafts predict token pos + 1
    assert bool(((r.root >= len(prompt) - 1) & (pos + 1 < T)).all())
    nxt = torch.tensor(r.ids)[pos + 1]
    assert torch.equal(r.target_logits.argmax(-1), nxt)
    assert torch.equal(r.accepted, r.proposal == nxt)
    full = tiny.model(torch.tensor([r.ids])).logits[0].float()
    assert torch.allclose(r.target_logits, full[pos], atol=1e-4)
    layers = list(head.config.feature_layers)
    ref = extract_features(tiny, torch.tensor([r.ids]), torch.ones(1, T, dtype=torch.long), layers)[0]  # [T,F,D]
    assert torch.allclose(r.features[:T - 1], ref.flatten(1)[:T - 1].to(r.features.dtype), atol=1e-4)
    seqs, h_in, st, acc, tl = rollout_batch([r], "cpu")
    replay = head_kind(kind).states(head, seqs, h_in, st)
    assert torch.equal(head.to_target_ids(replay.argmax(-1)) if head.d2t is not None else replay.argmax(-1),
                       r.proposal)


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_replay_is_the_served_draft_at_every_depth(tiny, kind, monkeypatch):
    """A verifier that accepts every first child (so random heads reach deep states): at every visited state, down
    to depth 3 (past EAGLE-3's 2 TTT steps), the replay's argmax is the draft the drafter served there."""
    import specheads.infer.engine.generate as engine
    from specheads.infer.verify import Accepted

    def accept_all(sampling, generator):
        def verify(tree, logits):
            nodes, parents = [0], tree.parents.tolist()
            while (kids := [i for i in range(len(parents)) if parents[i] == nodes[-1]]):
                nodes.append(kids[0])
            return Accepted(nodes, int(logits[nodes[-1]].argmax()))
        return verify

    monkeypatch.setattr(engine, "verifier", lambda verification, sampling, generator: accept_all(sampling, generator))
    head = _head(tiny, kind)
    r = rollout(tiny, head, _prompt(1), "chain:4", 20)
    assert int(r.depth.max()) == 3 and bool(r.accepted[r.depth < 3].all())
    seqs, h_in, st, _, _ = rollout_batch([r], "cpu")
    assert torch.equal(head_kind(kind).states(head, seqs, h_in, st).argmax(-1), r.proposal)


def test_sampled_rollout_replays_the_distribution_each_draft_was_drawn_from(tiny):
    """A DSpark head sampling its drafts at temperature 1 (no warping): the replayed distribution at every visited
    state, deeper ones included, is the one the drafter drew that state's drafts from. (EAGLE heads draft their
    tree deterministically also when sampling: the tests above cover them.)"""
    head = _head(tiny, "dspark")
    seen_deep = False
    for seed in range(3):
        r = rollout(tiny, head, _prompt(seed), "chain:3", 24, temperature=1.0, seed=seed, keep_q=True)
        assert r.q is not None and r.q.shape[0] == len(r.root) > 0
        seqs, h_in, st, _, _ = rollout_batch([r], "cpu")
        replay = torch.softmax(head_kind("dspark").states(head, seqs, h_in, st).float(), -1)
        assert torch.allclose(replay, r.q, atol=1e-4)
        seen_deep |= bool((r.depth > 0).any())
    assert seen_deep, "no state below a root was visited: the test would not check deeper drafts"


def test_rollout_batch_pads_and_indexes_states_by_row(tiny):
    head = _head(tiny, "eagle3")
    a, b = (rollout(tiny, head, _prompt(s, n), "chain:2", n2) for s, n, n2 in ((0, 8, 12), (1, 12, 6)))
    seqs, h_in, st, acc, tl = rollout_batch([a, b], "cpu")
    assert seqs["input_ids"].shape == (2, max(len(a.ids), len(b.ids)))
    assert seqs["attention_mask"].sum().item() == len(a.ids) + len(b.ids)
    assert st.b.tolist() == [0] * len(a.root) + [1] * len(b.root)
    assert torch.equal(tl, torch.cat([a.target_logits, b.target_logits]))
    assert torch.equal(h_in[1, :len(b.ids)], b.features)


# ------------------------------------------------------------------------------------------------- the stage

def _opd_recipe(path, kind: str, *over: str):
    spec = [f"head.{k}={v}" for k, v in SPECS[kind].items() if k != "feature_layers"]
    if "feature_layers" in SPECS[kind]:
        spec.append("head.feature_layers=[1,2,3]")
    return make_recipe(path, *spec, "train.stage=opd", "train.opd.max_new_tokens=12", "train.opd.tree=chain:3",
                       "train.lr=3e-3", "train.max_steps=4", "train.save_every=2", "eval.every_steps=0",
                       "eval.at_start=false", *over)


def _assert_moved(before: dict, head, frozen: dict, target, skip: str = "") -> None:
    """Every trainable parameter of the head (but `skip`'s, which OPD does not train) changed; the target's none."""
    after = state(head)
    names = [n for n, p in head.named_parameters() if p.requires_grad and not (skip and n.startswith(skip))]
    still = [n for n in names if torch.equal(before[n], after[n])]
    assert names and not still, f"OPD left {still} unchanged"
    assert all(torch.equal(v, target.model.state_dict()[k]) for k, v in frozen.items()), "target changed"


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_stage_trains_the_head_and_never_the_target(tiny, tmp_path, kind):
    r = _opd_recipe(tmp_path / "run", kind)
    head, frozen = _head(tiny, kind), target_state(tiny)
    before = state(head)
    res = OpdTrainer(r, tiny, head, token_samples(8), None).train()
    assert res.steps == 4 and res.last_loss is not None and math.isfinite(res.last_loss)
    _assert_moved(before, head, frozen, tiny, skip="confidence_head")  # the draft's weights, not its confidence
    if kind == "dspark":  # the confidence head serves calibrated scores; OPD leaves it to --calibrate-only
        conf = [n for n in before if n.startswith("confidence_head")]
        assert conf and all(torch.equal(before[n], state(head)[n]) for n in conf)
    final = load_head(tmp_path / "run" / "final", tiny)
    assert all(torch.equal(final.state_dict()[k], v) for k, v in state(head).items())


def test_stage_resumes_to_the_same_weights(tiny, tmp_path):
    """Sampled rollouts (their seeds from the saved generator): stopped after step 2, resumed with a fresh
    process's head and RNG, the weights end equal to an uninterrupted run's."""
    over = ["train.opd.temperature=1.0"]
    data = token_samples(8)
    a = _opd_recipe(tmp_path / "a", "eagle3", *over)
    head_a = _head(tiny, "eagle3")
    OpdTrainer(a, tiny, head_a, data, None).train()
    b = _opd_recipe(tmp_path / "b", "eagle3", *over)
    assert OpdTrainer(b, tiny, _head(tiny, "eagle3"), data, None).train(stop_after=2).steps == 2
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["step-000002"]
    torch.rand(5)  # another process: the global RNG moved on
    resumed = _head(tiny, "eagle3", seed=9)  # other initial weights: the checkpoint's replace them
    assert OpdTrainer(b, tiny, resumed, data, None).train(resume=True).steps == 4
    sa, sb = state(head_a), state(resumed)
    assert all(torch.equal(sa[k], sb[k]) for k in sa), "resumed OPD run differs from the uninterrupted one"


def test_run_opd_from_a_head_folder_saves_a_head_that_serves(tiny, tmp_path):
    """The recipe path: prepared tokens, train.init_head a saved EAGLE-3 head, a held-out split evaluated; final/
    loads and serves exactly (greedy output = plain greedy)."""
    import datasets

    from specheads.infer.generate import generate
    from specheads.infer.drafters.build import build_drafter

    rows = token_samples(10)
    datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                                "loss_mask": [r["loss_mask"].tolist() for r in rows],
                                "conversation_id": [f"c{i}" for i in range(10)]}).save_to_disk(
        str(tmp_path / "run" / "data" / "tokens"))
    init = _head(tiny, "eagle3")
    init.save_pretrained(tmp_path / "init")
    r = _opd_recipe(tmp_path / "run", "eagle3", "features.mode=online", "data.val_fraction=0.3",
                    f"train.init_head={tmp_path / 'init'}", "train.max_steps=2", "eval.max_samples=2")
    frozen = target_state(tiny)
    res = run_opd(r, target=tiny)
    assert res.steps == 2 and res.history  # evaluated at the end on the held-out split
    head = load_head(tmp_path / "run" / "final", tiny)
    assert any(not torch.equal(head.state_dict()[k], v) for k, v in init.state_dict().items())
    assert all(torch.equal(v, tiny.model.state_dict()[k]) for k, v in frozen.items())
    prompt = _prompt(3)
    spec = generate(tiny, build_drafter(tiny, head, "chain:3"), input_ids=prompt, max_new_tokens=16)
    assert spec.ids == generate(tiny, None, input_ids=prompt, max_new_tokens=16).ids


def test_refusals(tiny, tmp_path):
    eagle1 = make_recipe(tmp_path / "e", "head.kind=eagle", "train.stage=opd")
    with pytest.raises(SpecheadsError, match=r"cannot be trained on-policy; kinds that can: .*eagle3"):
        OpdTrainer(eagle1, tiny, build_head(eagle1.head, tiny), token_samples(4), None).train()
    no_init = _opd_recipe(tmp_path / "n", "eagle3")
    with pytest.raises(SpecheadsError, match="train.init_head"):
        run_opd(no_init, target=tiny)
    with pytest.raises(SpecheadsError, match="train.stage"):
        make_recipe(tmp_path / "s", "train.stage=rl")
    with pytest.raises(SpecheadsError, match="scheduled tree"):
        rollout(tiny, _head(tiny, "eagle3"), _prompt(), "auto", 4)
    from specheads.train.trainer import run_training

    with pytest.raises(SpecheadsError, match="run_training"):
        run_training(no_init, target=tiny)
