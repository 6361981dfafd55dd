"""LiLiCorr heads (heads/lilicorr.py) on the tiny target: the draft logits are the lattice walk's scores on the
backbone's top-k and -inf elsewhere (argmax = the walk), the served block equals the training forward walked
greedily, a sampled walk follows the drawn tokens, the lattice loss by hand, the refusals, and the `modelopt` export
as vLLM / SGLang / TensorRT-LLM read it (tests/fixtures/lilicorr_engine_read.py)."""
from __future__ import annotations

import pytest
import torch

from specheads.heads import HeadSpec, build_head
from specheads.train.kinds.lilicorr import chain_scores, lattice_loss
from specheads.train.settings import BlockTrainConfig
from specheads.utils import SpecheadsError

D = 64
BASE = dict(kind="lilicorr", feature_layers=[1, 2, 3], block_size=4, markov_rank=0, confidence_head=False,
            sample_from_anchor=False, lilicorr_candidate_topk=4, lilicorr_hidden_size=32, lilicorr_num_layers=2,
            lilicorr_num_heads=2, lilicorr_factor_dim=8, num_layers=1)


def _head(tiny, seed=3, **kw):
    head = build_head(HeadSpec(**{**BASE, **kw}), tiny)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return head


def _inputs(T=20, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, 3 * D, generator=g), torch.randint(0, 256, (1, T), generator=g)


def test_draft_logits_are_the_walk_on_the_candidates(tiny):
    head = _head(tiny)
    feats, ids = _inputs()
    h, _ = head.block_states(feats, ids, torch.tensor([[7]]))
    unary, cand, start, pair = head.lattice(h)
    lg, conf = head.heads(h, ids[:, 7:8], greedy=True)
    assert conf is None and lg.shape == (1, 1, 3, 256)
    finite = torch.isfinite(lg[0, 0])
    for j in range(3):  # S_j on C_j (the unary top-k), -inf elsewhere
        assert set(finite[j].nonzero().flatten().tolist()) == set(cand[0, 0, j].tolist())
    row = start[0, 0]
    for j in range(3):  # the greedy walk by hand: S_{j+1} = pair_j(argmax S_j, ·)
        assert torch.allclose(lg[0, 0, j, cand[0, 0, j]], row)
        if j < 2:
            row = pair[0, 0, j, int(row.argmax())]
    cache = head.new_cache()
    head.extend_context(cache, feats[0, :7])
    served, _ = head.draft_block(cache, int(ids[0, 7]))
    assert torch.allclose(served, lg[0, 0], atol=1e-5)
    assert torch.equal(served.argmax(-1), lg[0, 0].argmax(-1))


def test_a_sampled_walk_reads_the_drawn_tokens(tiny):
    """pick(j, logits_j) -> the drawn token: draft j+1's row is the pair score leaving it, not the argmax."""
    head = _head(tiny)
    feats, ids = _inputs()
    h, _ = head.block_states(feats, ids, torch.tensor([[9]]))
    _, cand, start, pair = head.lattice(h)
    lowest = lambda j, lj: lj.masked_fill(~torch.isfinite(lj), float("inf")).argmin(-1)  # the least likely candidate
    lg, _ = head.heads(h, ids[:, 9:10], greedy=True, pick=lowest)
    r0 = int(start[0, 0].argmin())
    assert torch.allclose(lg[0, 0, 1, cand[0, 0, 1]], pair[0, 0, 0, r0])


def test_anchor_row_matters_and_is_zero_before_any_context(tiny):
    head = _head(tiny)
    feats, ids = _inputs()
    h = head.block_states(feats, ids, torch.tensor([[5]]))[0]
    assert h.shape[2] == 5  # K = 4 slots + c_{p-1}
    c = head.project_features(feats)
    assert torch.allclose(h[0, 0, 4], c[0, 4])
    empty = head.new_cache()
    lg, _ = head.draft_block(empty, 3)  # p = 0: no context row, a = 0
    assert torch.isfinite(lg).sum(-1).tolist() == [4, 4, 4]


def test_lattice_loss_by_hand():
    start = torch.tensor([[1.0, 2.0, 0.0]])  # N = 1, k = 3, K' = 2
    pair = torch.tensor([[[[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]]]])
    cand = torch.tensor([[[10, 11, 12], [20, 21, 22]]])
    y = torch.tensor([[11, 20]])  # ranks 1 then 0
    valid = torch.ones(1, 2, dtype=torch.bool)
    tgt = torch.zeros(1, 2, 30)
    tgt[0, 0, 11], tgt[0, 0, 10], tgt[0, 1, 20], tgt[0, 1, 22] = 2.0, 1.0, 1.0, 4.0
    cfg = BlockTrainConfig(lilicorr_w_ce=1.0, lilicorr_w_margin=1.0, lilicorr_w_pen=1.0, lilicorr_margin=2.0)
    z = chain_scores(start, pair, torch.tensor([[1, 0]]))
    assert torch.equal(z[0, 1], pair[0, 0, 1])  # the row leaving y_0's rank
    ce = -(torch.log_softmax(start[0], -1)[1] + torch.log_softmax(pair[0, 0, 1], -1)[0])
    hinge = max(0.0, 2.0 - (2.0 - 1.0)) + max(0.0, 2.0 - (3.0 - 0.0))  # margin 2 minus (y's score - best other)
    p0, p1 = torch.softmax(start[0], -1), torch.softmax(pair[0, 0, 1], -1)
    pen = p0[0] * 1.0 + p0[2] * 2.0 + p1[1] * 1.0 + p1[2] * 0.0  # relu(T(y) - T(c)), 0 at y and above it
    total, m = lattice_loss(start, pair, cand, y, valid, tgt, cfg)
    assert torch.allclose(total, (ce + hinge + pen) / 2)
    y_miss = torch.tensor([[13, 20]])  # y_0 not a candidate: the chain stops, nothing supervised
    total, m = lattice_loss(start, pair, cand, y_miss, valid, tgt, cfg)
    assert float(total) == 0.0 and m["lat_supervised"] == 0.0
    total, m = lattice_loss(start, pair, cand, y, torch.tensor([[True, False]]), tgt, cfg)
    assert m["lat_supervised"] == 0.0  # a block trains only when all its drafts are valid (ModelOpt)


@pytest.mark.parametrize("bad, msg", [
    (dict(sample_from_anchor=True), "sample_from_anchor"), (dict(markov_rank=8), "markov_rank"),
    (dict(draft_vocab_size=64), "draft_vocab_size"), (dict(lilicorr_vector_eps=0.7), "vector_eps"),
    (dict(lilicorr_candidate_topk=0), "candidate_topk")])
def test_refusals(bad, msg):
    with pytest.raises(SpecheadsError, match=msg):
        HeadSpec(**{**BASE, **bad})


def test_heads_must_divide_the_width(tiny):
    with pytest.raises(SpecheadsError, match=r"head\.lilicorr\.num_heads"):
        build_head(HeadSpec(**{**BASE, "lilicorr_num_heads": 3}), tiny)


def _export(tiny, tmp_path, consumers=None, **kw):
    from specheads.heads.export import export_head

    head = _head(tiny, mask_token_id=5, **kw)
    head.save_pretrained(tmp_path / "h")
    return head, export_head(tmp_path / "h", "modelopt", tmp_path / "m", consumers=consumers)


@pytest.mark.parametrize("kw", [{}, {"lilicorr_hidden_size": 0, "lilicorr_candidate_topk": 8}],
                         ids=["projected-width", "target-width"])
def test_modelopt_export_read_by_vllm_sglang_trtllm(tiny, tmp_path, kw):
    """The engines' LiLiCorr loaders (tests/fixtures/lilicorr_engine_read.py, read) on our modelopt export: every
    config key they read, every lilicorr.* tensor under their names with our values, and their head's scores on a
    block of ours equal our lattice's start and pair scores."""
    from safetensors.torch import load_file

    from specheads.heads.export.lilicorr import native_name
    from tests.fixtures import lilicorr_engine_read as engine

    head, out = _export(tiny, tmp_path, **kw)
    c, w, backbone = engine.load(out)
    o = head.spec.options
    assert {k: c[k] for k in ("model_type", "block_size", "conv", "has_own_lm_head", "target_layer_ids",
                              "mask_token_id", "num_hidden_layers", "rms_norm_eps")} == {
        "model_type": "qwen3", "block_size": 4, "conv": (0, 0), "has_own_lm_head": False,
        "target_layer_ids": [0, 1, 2], "mask_token_id": 5, "num_hidden_layers": 1,
        "rms_norm_eps": head.layer_config.rms_norm_eps}
    assert {k: c[k] for k in engine.FIELDS} == {**{k: getattr(o, k) for k in engine.FIELDS},
                                                "hidden_size": o.hidden_size or D}
    ours = head.state_dict()
    written = load_file(str(out / "model.safetensors"))
    assert {native_name(k) for k in written} == set(ours) - {"conf_temperature", "conf_bias"}
    for k, v in {**{f"lilicorr.{n}": t for n, t in w.items()}, **backbone}.items():
        assert torch.equal(v, ours[native_name(k)]), k
    feats, ids = _inputs()
    h, _ = head.block_states(feats, ids, torch.tensor([[0, 7, 12]]))  # p = 0: no anchor row (valid false)
    unary, cand, start, pair = head.lattice(h)
    k = o.candidate_topk
    logp = torch.log_softmax(unary, -1).topk(k, -1).values  # the engines' candidate features (rank order)
    valid = (h[0, :, 4].abs().sum(-1) > 0)
    got = engine.score(c, w, head.embed(cand[0]), logp[0], h[0, :, 1:4], h[0, :, 4], valid)
    assert valid.tolist() == [False, True, True]
    assert torch.allclose(got[:, 0, 0], start[0], atol=1e-5) and torch.allclose(got[:, 1:], pair[0], atol=1e-5)


def test_modelopt_round_trip_and_sequential_spelling(tiny, tmp_path):
    """Our modelopt export reads back bit-exact; a folder in ModelOpt's own nn.Sequential spelling reads too, and
    the engines' strictest reader (vLLM's) refuses that spelling (so the names written matter)."""
    from safetensors.torch import load_file, save_file

    from specheads.heads.export import import_head
    from tests.fixtures import lilicorr_engine_read as engine

    head, out = _export(tiny, tmp_path)
    back = import_head(out, tiny)
    assert back.kind == "lilicorr" and back.spec.options == head.spec.options
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in head.state_dict().items())
    sd = load_file(str(out / "model.safetensors"))
    seq = {k.replace("feature_norm.", "feature_mlp.0.").replace("up_proj.", "1." if "feature" in k else "0.")
           .replace("down_proj.", "3." if "feature" in k else "2.") if k.startswith("lilicorr.") else k: v
           for k, v in sd.items()}
    save_file(seq, str(out / "model.safetensors"))
    assert all(torch.equal(v, import_head(out, tiny).state_dict()[k]) for k, v in head.state_dict().items())
    with pytest.raises(ValueError, match="coverage"):
        engine.load(out)


def test_modelopt_refusals_name_the_consumer(tiny, tmp_path):
    """candidate_topk 12: vLLM and SGLang take powers of two up to 16 (one line naming both); TensorRT-LLM alone
    exports; speculators / specforge name modelopt; another kind cannot be written as modelopt."""
    from specheads.heads.export import export_head

    with pytest.raises(SpecheadsError, match=r"--format modelopt: .*vLLM's LiLiCorrForCausalLM \(vllm\).*"
                                             r"SGLang's LiLiCorrDraftModel \(sglang\).*tensorrt-llm") as e:
        _export(tiny, tmp_path, lilicorr_candidate_topk=12)
    assert "\n" not in str(e.value) and not (tmp_path / "m").exists()
    _, out = _export(tiny, tmp_path / "t", consumers=["tensorrt-llm"], lilicorr_candidate_topk=12)
    assert (out / "model.safetensors").exists()
    for fmt in ("speculators", "specforge"):
        with pytest.raises(SpecheadsError, match=f"--format {fmt}: .*export modelopt"):
            export_head(tmp_path / "h", fmt, tmp_path / fmt)
    dflash = build_head(HeadSpec(kind="dspark", feature_layers=[1, 2, 3], block_size=4, markov_rank=0,
                                 confidence_head=False, sample_from_anchor=False, num_layers=1), tiny)
    dflash.save_pretrained(tmp_path / "d")
    with pytest.raises(SpecheadsError, match="--format modelopt: needs a lilicorr head"):
        export_head(tmp_path / "d", "modelopt", tmp_path / "dm")


def test_end_to_end_sampling_is_lossless():
    """generate() with a LiLiCorr head on an 8-token vocabulary, served as the best-first tree of 6 nodes over its
    block of 2 drafts (the chain is the tree's first path): each draft is drawn from the lattice's scores on its top-4 candidates (q is 0 off them), the next
    draft's row leaves the drawn token; the first two new tokens follow the target's exact distribution."""
    from specheads.infer.drafters import build_drafter
    from specheads.infer.verify import SamplingParams
    from specheads.target import tiny_target
    from helpers import perturb, sampled_pairs, two_token_probs
    from tests.test_sampling_stats import V as SV, assert_same

    target = tiny_target(vocab_size=SV, hidden_size=32, num_layers=2, seed=0)
    torch.manual_seed(1)
    spec = HeadSpec(**{**BASE, "feature_layers": [1, 2], "block_size": 3})
    head = perturb(build_head(spec, target).eval(), 0.5, seed=None, trainable_only=True)
    prompt, n = [1, 5, 3], 600
    expected = two_token_probs(target, prompt, SamplingParams(temperature=1.0, top_k=4))
    counts, drafted = sampled_pairs(target, build_drafter(target, head, "tree:6"), prompt, n,
                                     top_k=4)
    assert drafted > n  # drafts were verified, not only roots
    assert_same(counts, expected * n)
