"""P-EAGLE heads on the tiny target: COD keep counts by hand, the mask vector read at depths >= 1 only, one head
pass drafting all K tokens (equal to the teacher-forced forward), a training step that moves the head and not the
target, fp32 greedy output equal to plain decoding (single and batched), the speculators export loaded and run by
the real package, exports refused with one line, bad settings; D-PACE over the chains (weights by hand, the
reduction, a training step)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.heads import HeadSpec, build_head, load_head
from specheads.heads.export import export_head, import_head
from specheads.infer.drafters import PEagleDrafter
from specheads.train.kinds.peagle import chain_dpace_weights, cod_chains, cod_keep, peagle_loss
from specheads.utils import SpecheadsError
from helpers import perturb, run_fixture

ROOT = Path(__file__).resolve().parents[1]
SPEC_PY = ROOT / ".venv-speculators" / "bin" / "python"
V, D = 256, 64


def _head(target, seed=3, **kw):
    spec = HeadSpec(**{"kind": "peagle", "feature_layers": [1, 2, 3], "num_layers": 2, "num_depths": 4,
                       "mask_token_id": 5, **kw})
    head = build_head(spec, target, token_counts=torch.arange(V) if spec.draft_vocab_size else None)
    return perturb(head, 0.1, seed)  # far from init, so that every part matters


def _inputs(T=14, seed=5, F=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, F * D, generator=g), torch.randint(0, V, (1, T), generator=g)


def test_cod_keeps_every_chain_at_ratio_one():
    """r = 1: depth d keeps n - d chains; all 12 tokens count, so rows 0..9 are valid (x_{t+2} exists): anchors
    0 .. 9-d at depth d (an anchor row >= 0, its position a+d a valid row)."""
    chains = cod_chains(torch.ones(1, 12, dtype=torch.long), 4, 1.0, 1.0)
    assert len(chains) == 3
    for d, (anchors, valid) in enumerate(chains, start=1):
        assert anchors.tolist() == [list(range(10 - d))] and bool(valid.all())


def test_cod_keep_counts_by_depth_and_nested_chains():
    """r = 0.7, floor 0.2 (speculators' defaults), 40 prompt tokens then 160 answer tokens: n = 160 valid rows
    (rows 38..197). keep_d = floor((n - d) max(0.7^d, 0.2)): 111, 77, 53, 37, 31, 30, 30 (0.7^5 = 0.168 < 0.2: the
    floor). Each depth keeps min(keep_d, its pool); every chain (a, d) predicts an answer token and has (a, d-1)."""
    assert [cod_keep(160, d, 0.7, 0.2) for d in range(1, 8)] == [111, 77, 53, 37, 31, 30, 30]
    lm = torch.zeros(2, 200, dtype=torch.long)
    lm[0, 40:] = 1
    lm[1, 40:120] = 1  # a shorter answer: n = 80
    chains = cod_chains(lm, 8, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert len(chains) == 7
    for b, n in ((0, 160), (1, 80)):
        prev = set(range(200))  # depth 0: every row
        valid0 = {t for t in range(198) if lm[b, t + 2]}
        for d, (anchors, valid) in enumerate(chains, start=1):
            kept = anchors[b][valid[b]].tolist()
            assert kept == sorted(set(kept))
            pool = {a for a in range(200) if a + d in valid0 and (a in prev if d > 1 else a >= 0)}
            assert len(kept) == min(cod_keep(n, d, 0.7, 0.2), len(pool)), (b, d)
            assert set(kept) <= pool
            prev = set(kept)
    assert int(chains[0][1][0].sum()) == 111 and int(chains[0][1][1].sum()) == cod_keep(80, 1, 0.7, 0.2) == 55


def test_mask_vector_read_at_depths_ge_1_only_and_chains_see_no_future(tiny):
    """mask_hidden moves every depth >= 1 and leaves depth 0 as it was; a chain anchored at row a reads nothing of
    rows after a (their features and tokens are unknown when it drafts)."""
    head = _head(tiny)
    f, x = _inputs()
    with torch.no_grad():
        base = head(f, x)
        head.mask_hidden.add_(1.0)
        moved = head(f, x)
        head.mask_hidden.sub_(1.0)
        a = 6
        f2, x2 = f.clone(), x.clone()
        f2[:, a + 1:] += 3.0
        x2[:, a + 1:] = (x2[:, a + 1:] + 1) % V
        future = head(f2, x2)
    assert torch.equal(base[0], moved[0])
    assert all((base[d] - moved[d]).abs().amax(-1).min() > 1e-4 for d in range(1, 4))  # every row moves
    for d in range(4):
        assert torch.allclose(base[d][0, :a + 1], future[d][0, :a + 1], atol=1e-5)
        assert not torch.allclose(base[d][0, a + 1:], future[d][0, a + 1:], atol=1e-3)


@pytest.mark.parametrize("kw", [{}, {"draft_vocab_size": 100, "num_layers": 1, "num_depths": 3}])
def test_one_pass_drafts_k_tokens_equal_to_the_teacher_forced_forward(tiny, kw):
    """The context fed in two pieces, then ONE head pass (one lm_head call) gives the K drafts after the root,
    equal to the training forward's K depths at that anchor; the next step (two more rows) again."""
    head = _head(tiny, **kw)
    f, x = _inputs()
    K = head.num_drafts
    with torch.no_grad():
        ref = head(f, x)
    calls = []
    head.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    cache = head.new_cache()
    c = 8  # true rows 0..7; row 7 pairs f_7 with the root x_8
    head.extend_context(cache, f[0, :3])
    head.extend_context(cache, f[0, 3:c])
    cache.ids = [0] + x[0, :c].tolist()  # ids[t+1] = x_{t+1}, the root last
    logits, conf = head.draft_block(cache, cache.ids[-1])
    assert conf is None and logits.shape == (K, head.config.out_vocab) and len(calls) == 1
    assert calls[0][1] == c + K - 1  # the true rows and K-1 mask rows in one pass
    assert torch.allclose(logits, torch.stack([ref[d][0, c - 1] for d in range(K)]), atol=1e-5)
    assert cache.kv.get_seq_length() == c  # mask rows dropped
    head.extend_context(cache, f[0, c:c + 2])
    cache.ids = [0] + x[0, :c + 2].tolist()
    logits, _ = head.draft_block(cache, cache.ids[-1])
    assert torch.allclose(logits, torch.stack([ref[d][0, c + 1] for d in range(K)]), atol=1e-5)


def test_pooled_loss_by_hand(tiny):
    """One sequence, depth 0 on the counted rows, one chain per depth: the loss is the mean KL over exactly those
    rows, each against the target's row a+1+d."""
    from specheads.train.losses import resolve_loss
    from specheads.train.teacher import TargetRows

    g = torch.Generator().manual_seed(0)
    T = 8
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])  # rows 1..5 count at depth 0
    logits = [torch.randn(1, T, V, generator=g), torch.randn(1, 2, V, generator=g)]
    chains = [(torch.tensor([[1, 3]]), torch.tensor([[True, False]]))]  # chain (1, 1): predicts x_4, target row 3
    tgt = torch.randn(1, T, V, generator=g)
    out = peagle_loss(logits, chains, TargetRows.from_full(tgt, None), lm, None, resolve_loss("peagle"))

    def kl(q, p):
        return float((p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum())

    rows = [kl(logits[0][0, t], tgt[0, t + 1]) for t in range(1, 6)] + [kl(logits[1][0, 0], tgt[0, 3])]
    assert out.loss.item() == pytest.approx(sum(rows) / 6, rel=1e-5)
    assert set(out.metrics) >= {"acc_0", "acc_1"}


def test_chain_dpace_weights_by_hand():
    """Anchor 0 drafts depths 0, 1, 2 with q = 0.5, 0.5, 1; anchor 1 only depth 0 (COD dropped its chain). α = 0.5:
    s = 0.75, 0.75, 1 -> P = 0.75, 0.5625, 0.5625 -> w = Σ_{i>=j} P_i = 1.875, 1.125, 0.5625; anchor 1 alone: 1."""
    q = [torch.tensor([0.5, 1.0]), torch.tensor([0.5]), torch.tensor([1.0])]
    where = [(torch.tensor([0, 0]), torch.tensor([0, 1])), (torch.tensor([0]), torch.tensor([0])),
             (torch.tensor([0]), torch.tensor([0]))]
    w = chain_dpace_weights(q, where, (1, 4), alpha=0.5)
    assert torch.allclose(w[0], torch.tensor([1.875, 1.0])) and torch.allclose(w[1], torch.tensor([1.125]))
    assert torch.allclose(w[2], torch.tensor([0.5625]))


def test_pooled_loss_dpace_reduction_by_hand():
    """weighting=dpace: Σ_rows w ℓ / the number of rows, w from each anchor's chain of confidences (anchor 1 has
    depths 0 and 1, the other rows depth 0 alone), q the draft's probability of the target's argmax."""
    from specheads.train.losses import dpace_position_weights, resolve_loss
    from specheads.train.teacher import TargetRows

    g = torch.Generator().manual_seed(1)
    T, a = 8, 0.5
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])  # rows 1..5 count at depth 0
    logits = [torch.randn(1, T, V, generator=g), torch.randn(1, 1, V, generator=g)]
    chains = [(torch.tensor([[1]]), torch.tensor([[True]]))]  # chain (1, 1): target row 3
    tgt = torch.randn(1, T, V, generator=g)
    out = peagle_loss(logits, chains, TargetRows.from_full(tgt, None), lm, None, resolve_loss("peagle"),
                      weighting="dpace", dpace_alpha=a)

    def kl(q, p):
        return float((p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum())

    def conf(q, p):
        return float(q.softmax(-1)[p.argmax()])

    terms = []
    for t in range(1, 6):
        qs = [conf(logits[0][0, t], tgt[0, t + 1])] + ([conf(logits[1][0, 0], tgt[0, 3])] if t == 1 else [])
        w = dpace_position_weights(torch.tensor([qs]), torch.ones(1, len(qs), dtype=torch.bool), a)[0]
        terms.append(float(w[0]) * kl(logits[0][0, t], tgt[0, t + 1]))
        if t == 1:
            terms.append(float(w[1]) * kl(logits[1][0, 0], tgt[0, 3]))
    assert out.loss.item() == pytest.approx(sum(terms) / 6, rel=1e-5)
    with pytest.raises(ValueError, match="block weighting"):
        peagle_loss(logits, chains, TargetRows.from_full(tgt, None), lm, None, resolve_loss("peagle"), weighting="x")


def _recipe(out, steps=3, extra=()):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe

    return load_config(Recipe, None, [
        f"output_dir={out}", "seed=0", "head.kind=peagle", "head.feature_layers=[1,2,3]", "head.num_layers=2",
        "head.num_depths=3", "head.mask_token_id=5", "train.tracker=none", "train.batch_size=2", "train.lr=1e-2",
        f"train.max_steps={steps}", "train.peagle.cod_ratio=0.7", "train.peagle.cod_ratio_min=0.2",
        "eval.every_steps=0", "eval.at_start=false", "eval.max_samples=2", *extra])


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_train_steps_move_every_trainable_parameter_and_not_the_target(tiny, tmp_path, weighting):
    from tests.test_dspark import _greedy_samples
    from tests.trained import train_checked

    data, val = _greedy_samples(tiny, 6, T=24), _greedy_samples(tiny, 2, T=24, seed=1)
    recipe = _recipe(tmp_path, extra=[f"train.block.weighting={weighting}"])
    assert recipe.train.block.weighting == weighting
    torch.manual_seed(0)
    head = build_head(recipe.head, tiny)
    _, changed = train_checked(recipe, tiny, head, data, val)
    assert {"mask_hidden", "layers.1.mlp.down_proj.weight", "midlayer.self_attn.q_proj.weight"} <= changed
    after = head.state_dict()
    loaded = load_head(tmp_path / "final", tiny)
    assert loaded.kind == "peagle" and all(torch.equal(v, after[k]) for k, v in loaded.state_dict().items())


def test_greedy_generation_equals_plain_decoding_single_and_batched(tiny):
    from specheads.infer.engine.batch import generate_batch
    from specheads.infer.engine.generate import generate
    from specheads.infer.scheduling.step import Scheduler
    from tests.test_batch import mixed_prompts
    from tests.test_generate import hf_greedy

    head = _head(tiny, draft_vocab_size=100)
    ps = mixed_prompts(tiny.vocab_size, 4)
    refs = [hf_greedy(tiny, p, 16) for p in ps]
    flat = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1}
    for make in (lambda: PEagleDrafter(head, num_tokens=4),
                 lambda: PEagleDrafter(head, scheduler=Scheduler(flat, 1e-3))):
        for p, ref in zip(ps, refs):
            r = generate(tiny, make(), p, max_new_tokens=16)
            assert r.ids == ref
            assert r.stats.tree_nodes > r.stats.target_forwards  # drafts were verified
    res = generate_batch(tiny, lambda: PEagleDrafter(head, num_tokens=3), ps, 16, batch_size=3)  # propose_many
    assert [row.ids for row in res.rows] == refs


@pytest.mark.parametrize("fmt,match", [("eagle3", "needs a eagle3 head"), ("specforge", "needs a domino or dspark head"),
                                       ("medusa-vllm", "needs a medusa head")])
def test_other_exports_are_refused_with_one_line(tiny, tmp_path, fmt, match):
    _head(tiny).save_pretrained(tmp_path / "h")
    with pytest.raises(SpecheadsError, match=match):
        export_head(tmp_path / "h", fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gguf_export_is_refused_with_the_reason(tiny, tmp_path):
    from specheads.heads.base import read_head_config
    from specheads.heads.gguf import DRAFT_KINDS, _draft_kind

    _head(tiny).save_pretrained(tmp_path / "h")
    assert "peagle" not in DRAFT_KINDS
    with pytest.raises(SpecheadsError, match="peagle head; llama.cpp drafts with .* maps no P-EAGLE model"):
        _draft_kind(read_head_config(tmp_path / "h"), tmp_path / "h")


def test_speculators_export_reads_back_bit_exact(tiny, tmp_path):
    """Unsorted feature layers and a draft vocabulary: the export's fc and mask_hidden blocks in ascending layer
    order, layers.0 = our midlayer; read back, the same tensors and the same function (features permuted so)."""
    head = _head(tiny, feature_layers=[3, 1, 2], draft_vocab_size=100)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "speculators", tmp_path / "s", target=tiny)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert (cfg["speculators_model_type"], cfg["mask_token_id"], cfg["transformer_layer_config"]["num_hidden_layers"],
            cfg["eagle_aux_hidden_state_layer_ids"]) == ("peagle", 5, 2, [1, 2, 3])
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["specheads"]["consumers"] == ["speculators"]  # vLLM 0.34 refuses P-EAGLE (issue 38)
    with pytest.raises(SpecheadsError, match=r"--format speculators: .*\(vllm\): vLLM 0.34 refuses P-EAGLE .*export "
                                             r"for \['speculators'\] only with --consumer"):
        export_head(tmp_path / "h", "speculators", tmp_path / "v", target=tiny, consumers=["vllm"])
    sd = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert "mask_hidden" in sd and "layers.0.hidden_norm.weight" in sd and "layers.1.mlp.up_proj.weight" in sd
    assert torch.equal(sd["mask_hidden"][..., :D], head.mask_hidden[..., D:2 * D].detach())  # layer 1 first
    back = import_head(tmp_path / "s", tiny)
    assert back.kind == "peagle" and back.config.feature_layers == [1, 2, 3] and back.spec.options.num_depths == 4
    ours, theirs = head.state_dict(), back.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours if k not in
                                            ("fc.weight", "mask_hidden"))
    f, x = _inputs()
    perm = torch.cat([f[..., 1 * D:2 * D], f[..., 2 * D:], f[..., :D]], -1)  # ours [3,1,2] -> ascending [1,2,3]
    with torch.no_grad():
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(head(f, x), back(perm, x)))  # fc sums reordered


@pytest.mark.skipif(not SPEC_PY.exists(), reason="no .venv-speculators (run scripts/setup_speculators_venv.sh)")
def test_speculators_package_loads_and_runs_our_export(tmp_path):
    """The real consumer: speculators' PEagleSpeculatorConfig / PEagleDraftModel load the export (every weight
    equal, the token embedding the verifier's as the package loads it: nothing filled in by hand), and its own training forward over our chains (its mask token, mask_hidden,
    fc, layers, P-EAGLE attention mask and positions) gives our logits at every row of every depth."""
    from specheads.target import tiny_target
    from tests.test_export import ROPE

    target = tiny_target(num_layers=4, rope_parameters=dict(ROPE))
    target.model.save_pretrained(tmp_path / "verifier")
    head = _head(target, feature_layers=[3, 1, 2], draft_vocab_size=100)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "speculators", tmp_path / "s", verifier_name_or_path=str(tmp_path / "verifier"),
                target=target)
    f, x = _inputs(T=12)
    chains = [(torch.tensor([[0, 2, 5, 7, 9]]), torch.ones(1, 5, dtype=torch.bool)),
              (torch.tensor([[2, 5, 7]]), torch.ones(1, 3, dtype=torch.bool)),
              (torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool))]
    with torch.no_grad():
        out = head(f, x, None, chains)
    anchor_pos = torch.cat([torch.arange(12)] + [a[0] for a, _ in chains])
    depth = torch.cat([torch.zeros(12, dtype=torch.long)] + [torch.full((a.shape[1],), d) for d, (a, _) in
                                                              enumerate(chains, start=1)])
    (tmp_path / "ref").mkdir()
    theirs = torch.cat([f[..., D:2 * D], f[..., 2 * D:], f[..., :D]], -1)  # ascending layer order
    save_file({"features": theirs, "tokens": x, "anchor_pos": anchor_pos, "depth": depth,
               "logits": torch.cat(out, dim=1).contiguous()}, str(tmp_path / "ref" / "inputs.safetensors"))
    got = run_fixture(SPEC_PY, "speculators_peagle_load.py", tmp_path / "s", tmp_path / "ref")
    diff = got.pop("max_abs_diff")
    assert got == {"ok": True, "embed_is_verifier": True, "checked": len(load_file(str(tmp_path / "s" / "model.safetensors"))),
                   "class": "PEagleDraftModel", "mask_token_id": 5, "num_layers": 2, "aux_ids": [1, 2, 3],
                   "draft_vocab_size": 100, "speculative_tokens": 4, "rows": 12 + 5 + 3 + 1}
    assert diff < 1e-4, diff


@pytest.mark.parametrize("bad,match", [(["train.peagle.cod_ratio=0"], r"train\.peagle\.cod_ratio"),
                                       (["train.peagle.cod_ratio=0.3", "train.peagle.cod_ratio_min=0.5"],
                                        "cod_ratio_min: 0.5 is above"),
                                       (["head.num_depths=0"], r"head\.peagle\.num_depths: must be >= 1"),
                                       (["head.fc_norm=true"], "head.fc_norm: a setting of eagle3 heads, not of a "
                                                               "P-EAGLE head"),
                                       (["head.peagle.fc_norm=true"], r"unknown key 'head\.peagle\.fc_norm'"),
                                       (["train.peagle.cod_rate=0.5"], "cod_rate")])
def test_bad_settings_give_one_clear_error(tmp_path, bad, match):
    with pytest.raises(SpecheadsError, match=match):
        _recipe(tmp_path, extra=bad)
