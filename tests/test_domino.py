"""Domino heads (heads/domino.py) on the tiny target: the greedy block pass equals the teacher-forced forward,
the correction leaves the first P drafts and a zero W_2 alone, the λ schedule by hand, train steps (TRL style) with
exp and D-PACE weights, exact resume, greedy decoding identical to plain decoding, the export refusals."""
from __future__ import annotations

import pytest
import torch

from specheads.heads import HeadSpec, build_head
from specheads.train.kinds.domino import base_weight
from specheads.utils import SpecheadsError
from helpers import assert_resume_is_exact, greedy_chain, perturb, save_token_rows
from tests.test_dspark import _inputs  # the same random features and tokens as the DSpark tests

V, D = 256, 64
BASE = {"kind": "domino", "feature_layers": [1, 2, 3], "block_size": 4, "markov_rank": 0, "confidence_head": False,
        "num_layers": 2, "domino_gru_hidden": 24, "domino_emb_dim": 16, "mask_token_id": 5}


def _head(tiny, seed=3, **kw):
    spec = HeadSpec(**{**BASE, **kw})
    head = build_head(spec, tiny, token_counts=torch.arange(V) if spec.draft_vocab_size else None)
    return perturb(head, 0.1, seed, trainable_only=True)  # far from init, so that the correction matters


@pytest.mark.parametrize("kw", [{}, {"draft_vocab_size": 100, "domino_prefix_len": 0},
                                {"confidence_head": True, "confidence_with_markov": False, "domino_prefix_len": 2}],
                         ids=["plain", "draft-vocab-P0", "confidence-P2"])
def test_greedy_block_equals_teacher_forced_forward(tiny, kw):
    head = _head(tiny, **kw)
    f, ids = _inputs()
    p = 9
    _, logits, conf, forced = greedy_chain(head, f, ids, p)  # forced: the data continues with the greedy drafts
    assert logits.shape == (head.num_drafts, head.config.out_vocab)
    base, final, tc = head(f, forced, torch.tensor([[3, p]]))
    torch.testing.assert_close(final[0, 1], logits, atol=1e-5, rtol=1e-5)
    P = head.prefix_len
    assert torch.equal(final[..., :P, :], base[..., :P, :])  # the first P drafts: base logits only
    assert (final[..., P:, :] - base[..., P:, :]).abs().max() > 1e-3  # the correction moves the others
    if conf is not None:
        torch.testing.assert_close(torch.sigmoid(tc[0, 1]), conf, atol=1e-6, rtol=1e-5)


def test_gru_reads_the_previous_tokens_causally(tiny):
    """Changing the data's token x_{p+j} changes the corrected logits of drafts >= j only (and never the base)."""
    head = _head(tiny, domino_prefix_len=0)
    f, ids = _inputs()
    p, j = 9, 2
    other = ids.clone()
    other[0, p + j] = (ids[0, p + j] + 1) % V
    b1, f1, _ = head(f, ids, torch.tensor([[p]]))
    b2, f2, _ = head(f, other, torch.tensor([[p]]))
    assert torch.equal(b1, b2)  # the block reads only rows < p and the anchor
    assert torch.equal(f1[0, 0, :j], f2[0, 0, :j])
    assert (f1[0, 0, j:] - f2[0, 0, j:]).abs().amax(-1).min() > 0


def test_zero_correction_is_dflash(tiny):
    head = _head(tiny, domino_prefix_len=0)
    with torch.no_grad():
        head.embed_proj[2].weight.zero_()
    f, ids = _inputs()
    base, final, _ = head(f, ids, torch.tensor([[6, 9]]))
    assert torch.equal(base, final)


def test_base_weight_schedule_by_hand():
    assert base_weight(0, 100, 1.0, 0.5) == 1.0
    assert base_weight(25, 100, 1.0, 0.5) == pytest.approx(0.5)
    assert base_weight(50, 100, 1.0, 0.5) == 0.0 and base_weight(99, 100, 1.0, 0.5) == 0.0
    assert base_weight(10, 100, 0.4, 1.0) == pytest.approx(0.36)
    assert base_weight(0, 1, 1.0, 0.5) == 1.0 and base_weight(1, 1, 1.0, 0.5) == 0.0  # decay over >= 1 step


@pytest.mark.parametrize("bad,match", [({"markov_rank": 8}, "markov_rank"),
                                       ({"sample_from_anchor": False}, "sample_from_anchor"),
                                       ({"domino_prefix_len": 9}, "prefix_len"),
                                       ({"domino_gru_hidden": 0}, "gru_hidden"),
                                       ({"anchor_features": True}, "anchor_features")])
def test_bad_specs_give_one_clear_error(bad, match):
    with pytest.raises(SpecheadsError, match=rf"head\.domino\.{match}"):
        HeadSpec(**{**BASE, **bad})


def _recipe(out, steps=4, extra=()):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe

    return load_config(Recipe, None, [
        f"output_dir={out}", "seed=0", "head.kind=domino", "head.feature_layers=[1,2,3]", "head.block_size=3",
        "head.markov_rank=0", "head.confidence_head=false", "head.mask_token_id=5", "head.domino_gru_hidden=16",
        "head.domino_emb_dim=8", "head.domino_prefix_len=0", "train.tracker=none", "train.batch_size=2",
        "train.lr=1e-2", f"train.max_steps={steps}", "train.block.max_anchors=4", "eval.every_steps=0",
        "eval.at_start=false", "eval.max_samples=2", *extra])


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_train_steps_move_every_trainable_parameter_and_not_the_target(tiny, tmp_path, weighting):
    from specheads.heads import load_head
    from tests.test_dspark import _greedy_samples
    from tests.trained import train_checked

    data, val = _greedy_samples(tiny, 6, T=24), _greedy_samples(tiny, 2, T=24, seed=1)
    recipe = _recipe(tmp_path, extra=[f"train.block.weighting={weighting}"])
    torch.manual_seed(0)
    head = build_head(recipe.head, tiny)
    _, changed = train_checked(recipe, tiny, head, data, val)
    assert {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.2.weight"} <= changed
    assert load_head(tmp_path / "final", tiny).kind == "domino"


def test_resume_gives_same_weights(tiny, tmp_path):
    from tests.test_dspark import _greedy_samples

    data, val = _greedy_samples(tiny, 10, T=24), _greedy_samples(tiny, 2, T=24, seed=1)
    assert_resume_is_exact(tiny, lambda out: _recipe(out, steps=6, extra=["train.save_every=2"]), data, val, tmp_path)


@pytest.mark.parametrize("fmt,kw,match", [("speculators", {}, "speculators 0.9.0 has no Domino"),
                                          ("eagle3", {}, "domino"),
                                          ("specforge", {"draft_vocab_size": 100}, "full vocabulary"),
                                          ("specforge", {"confidence_head": True, "confidence_with_markov": False},
                                           "DominoDraftModel has none")])
def test_exports_are_refused_with_one_line(tiny, tmp_path, fmt, kw, match):
    from specheads.heads.export import export_head

    head = _head(tiny, **kw)
    head.save_pretrained(tmp_path / "h")
    with pytest.raises(SpecheadsError, match=match):
        export_head(tmp_path / "h", fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gguf_export_is_refused(tiny, tmp_path):
    from specheads.heads.base import read_head_config
    from specheads.heads.gguf import DRAFT_KINDS, _draft_kind

    head = _head(tiny)
    head.save_pretrained(tmp_path / "h")
    assert "domino" not in DRAFT_KINDS
    with pytest.raises(SpecheadsError, match="domino"):
        _draft_kind(read_head_config(tmp_path / "h"), tmp_path / "h")


def test_run_training_online_with_a_confidence_head_calibrates_it(tmp_path):
    """`run_training` on online features (the target run per batch) with a confidence head: best/ and final/ are
    Domino folders and their confidences are calibrated as DSpark's are."""
    import json

    from specheads.config import load_config
    from specheads.heads import load_head
    from specheads.train.recipe import Recipe
    from specheads.train.trainer import run_training
    from tests.test_dspark import _greedy_samples, _sharp_target

    target = _sharp_target()
    save_token_rows(_greedy_samples(target, 14, T=24), tmp_path / "data" / "tokens")
    recipe = load_config(Recipe, None, [
        f"output_dir={tmp_path}", "seed=0", "features.mode=online", "data.val_fraction=0.4", "head.kind=domino",
        "head.feature_layers=[1,2,3]", "head.block_size=3", "head.markov_rank=0", "head.confidence_head=true",
        "head.confidence_with_markov=false", "head.domino_gru_hidden=16", "head.domino_emb_dim=8",
        "train.tracker=none", "train.batch_size=2", "train.lr=1e-2", "train.max_steps=4",
        "train.block.max_anchors=8", "eval.every_steps=0", "eval.at_start=false", "eval.batch_size=2"])
    run_training(recipe, target=target)
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert set(report) == {"best", "final"} and report["final"]["rows"] > 0
    head = load_head(tmp_path / "final", target)
    assert head.kind == "domino" and head.conf_temperature.tolist() == pytest.approx(report["final"]["temperatures"])


def test_cli_generate_and_bench_run_a_domino_head(tiny, tmp_path, capsys, monkeypatch):
    """`specheads generate --head DIR` and bench's `head:domino` (from `--head domino=DIR`) run the head; bench's
    greedy output is identical to plain decoding."""
    import json

    import specheads.infer.drafters.build as drafters_mod
    import specheads.target
    from specheads.cli import main
    from specheads.infer.bench import BenchSettings, MethodOptions, build_methods, run_bench
    from specheads.infer.bench.names import head_entries
    from specheads.prompts import BenchPrompt
    from specheads.infer.scheduling.step import Scheduler
    from tests.test_bench import ByteTok

    head = _head(tiny)
    head.save_pretrained(tmp_path / "dm")
    tiny.tokenizer = ByteTok()
    monkeypatch.setattr(specheads.target, "load_target", lambda *a, **k: tiny)
    made = []  # the schedulers' pricing (--pricing reaches the one generate builds)
    monkeypatch.setattr(drafters_mod.Scheduler, "for_target",
                        classmethod(lambda cls, target, refresh=False, pricing="measured":
                                    made.append(pricing) or Scheduler({1: 1.0, 8: 1.1}, 1e-3, pricing=pricing)))
    assert main(["generate", "--head", str(tmp_path / "dm"), "--prompt", "hi", "--raw", "--json",
                 "--max-new-tokens", "8", "--pricing", "profile"]) == 0
    assert made == ["profile"]
    out = json.loads(capsys.readouterr().out)
    assert len(out["ids"]) == 8 and out["stats"]["scheduled_steps"] == out["stats"]["target_forwards"]
    args = MethodOptions(heads=head_entries([f"domino={tmp_path / 'dm'}"]), tree="chain:3")
    methods, extra = build_methods(["head:domino"], tiny, args)
    assert [m.name for m in methods] == ["vanilla", "head:domino"]
    prompts = [BenchPrompt(id="0", category="a", turns=["abcabcabc"], chat=False)]
    res = run_bench(prompts, methods, BenchSettings("tiny", "x", "float32", max_new_tokens=8, warmup_tokens=2),
                    tiny.tokenizer, out_dir=tmp_path / "out", extra=extra, progress=False)
    assert res["methods"]["head:domino"]["overall"]["identical"] == 1.0


def test_save_load_bit_exact_and_frozen_parts(tiny, tmp_path):
    from specheads.heads import load_head

    head = _head(tiny, draft_vocab_size=100)
    head.save_pretrained(tmp_path / "h")
    back = load_head(tmp_path / "h", tiny)
    sd, sd2 = head.state_dict(), back.state_dict()
    assert type(back).__name__ == "DominoHead" and sd.keys() == sd2.keys()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"} <= set(sd)
    assert back.embed_proj[2].weight.shape[0] == 100  # W_2 spans the draft vocabulary
    assert "embed_tokens.weight" not in sd and not back.lm_head.weight.requires_grad
    f, ids = _inputs()
    a = torch.tensor([[4, 9]])
    assert all(torch.equal(x, y) for x, y in zip(head(f, ids, a)[:2], back(f, ids, a)[:2]))


def test_specforge_export_is_its_domino_layout_and_reads_back_bit_exact(tiny, tmp_path):
    """The keys SpecForge's DominoDraftModel reads (configs/qwen3-8b-domino.json, _init_draft_head), its tensor
    names and sizes, and the import back into the same head."""
    import json

    from safetensors.torch import load_file

    from specheads.heads.export import export_head, import_head

    head = _head(tiny, domino_prefix_len=2)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "specforge", tmp_path / "sf")
    cfg = json.loads((tmp_path / "sf" / "config.json").read_text())
    assert cfg["architectures"] == ["DominoDraftModel"] and cfg["block_size"] == 4 and cfg["emb_dim"] == 16
    dfc = cfg["dflash_config"]
    assert dfc["projector_type"] == "domino" and dfc["shift_label"] is True
    assert (dfc["gru_hidden_dim"], dfc["emb_dim"], dfc["pure_draft_prefix_len"]) == (24, 16, 2)
    assert dfc["target_layer_ids"] == [0, 1, 2] and dfc["mask_token_id"] == 5
    sd = load_file(str(tmp_path / "sf" / "model.safetensors"))
    assert sd["prefix_gru.weight_ih_l0"].shape == (3 * 24, D) and sd["prefix_gru.weight_hh_l0"].shape == (3 * 24, 24)
    assert sd["embed_proj.0.weight"].shape == (16, D + 24) and sd["embed_proj.2.weight"].shape == (V, 16)
    again = import_head(tmp_path / "sf", tiny)
    assert again.kind == "domino" and again.prefix_len == 2
    a, b = head.state_dict(), again.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if k not in ("conf_temperature", "conf_bias"))
    bad = dict(cfg, dflash_config=dict(dfc, shift_label=False))
    (tmp_path / "sf" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(SpecheadsError, match="shift_label false"):
        import_head(tmp_path / "sf", tiny)


@pytest.mark.parametrize("prefix", [0, 2], ids=["P0", "P2"])
def test_specforge_builds_and_runs_our_domino_export(tiny, tmp_path, prefix):
    """The real consumer: SpecForge 0.2.0's DominoDraftModel built from our folder (AutoConfig, AutoDraftModel,
    prefix_gru / embed_proj, every weight equal) and its own OnlineDominoModel forward (shift_label true: slot k
    drafts x_(p+k+1), the GRU over x_p..x_(p+k), the first pure_draft_prefix_len slots uncorrected) give our
    corrected logits."""
    from safetensors.torch import load_file

    from specheads.heads.export import export_head
    from tests.test_dspark import SF_PY, run_specforge_load

    if not SF_PY.exists():
        pytest.skip("no .venv-specforge (run scripts/setup_specforge_venv.sh)")
    head = _head(tiny, domino_prefix_len=prefix)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "specforge", tmp_path / "sf")
    f, toks = _inputs()
    anchors = [2, 6, 11, 15]
    with torch.no_grad():
        _, final, _ = head(f, toks, torch.tensor([anchors]))
    got, out = run_specforge_load(tmp_path / "sf", tiny, f, toks, anchors, tmp_path)
    assert (got["class"], got["model_type"], got["anchors"], got["target_layer_ids"], got["mask_token_id"]) == \
        ("DominoDraftModel", "qwen3", 4, [0, 1, 2], 5)
    assert got["checked"] == len(load_file(str(tmp_path / "sf" / "model.safetensors")))
    torch.testing.assert_close(out["logits"], final[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(out["logits"].argmax(-1), final[0].argmax(-1))
