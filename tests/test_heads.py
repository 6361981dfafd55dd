"""Draft heads on the tiny target: shapes, parameter counts, frozen parts, save/load, cache equivalence, bad input."""
from __future__ import annotations

import json

import pytest
import torch

from specheads.heads import HeadSpec, build_draft_vocab, build_head, default_feature_layers, load_head
from specheads.heads.base import DraftHead
from specheads.heads.kinds import kind_names, kind_spec
from specheads.utils import SpecheadsError
from helpers import make_head

B, T, D, V = 2, 9, 64, 256


def _inputs(F=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, F * D, generator=g), torch.randint(0, V, (B, T), generator=g)


def _chain_mask(cache_len: int, n: int) -> torch.Tensor:
    """[1,1,n,cache_len+n] float: a chain (each new row sees all cached columns and the new rows up to itself)."""
    m = torch.zeros(1, 1, n, cache_len + n)
    m[..., cache_len:] = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return m


def test_default_feature_layers():
    assert default_feature_layers("medusa", 30) == [30]
    assert default_feature_layers("eagle", 30) == [30]
    assert default_feature_layers("eagle3", 30) == [2, 15, 27]
    with pytest.raises(SpecheadsError, match="head.kind"):
        default_feature_layers("hydra", 30)


def test_spec_validation():
    with pytest.raises(SpecheadsError, match="head.kind"):
        HeadSpec(kind="hydra")
    with pytest.raises(SpecheadsError, match="num_heads"):
        HeadSpec(kind="medusa", num_heads=0)


@pytest.mark.parametrize("mode", ["shared", "per_head"])
def test_medusa_shapes_counts_identity_at_init(tiny, mode):
    spec = HeadSpec(kind="medusa", num_heads=3, num_layers=2, medusa_lm_head=mode)
    head = build_head(spec, tiny)
    blocks = 3 * 2 * (D * D + D)
    assert sum(p.numel() for p in head.parameters()) == blocks + (3 * V * D if mode == "per_head" else 0)
    # distinct (untied) blocks: each layer its own tensor
    ptrs = {blk.layers[i].weight.data_ptr() for blk in head.blocks for i in range(2)}
    assert len(ptrs) == 6
    h, _ = _inputs()
    logits = head(h)
    assert logits.shape == (3, B, T, V)
    # W = 0 at init: every head returns the target lm_head logits of the same state
    ref = tiny.lm_head(h)
    for k in range(3):
        torch.testing.assert_close(logits[k], ref)


def test_medusa_draft_vocab(tiny):
    counts = torch.zeros(V)
    counts[torch.arange(0, V, 4)] = torch.arange(64, dtype=torch.float) + 1  # ids 0,4,8,... only
    head = build_head(HeadSpec(kind="medusa", num_heads=2, draft_vocab_size=32, medusa_lm_head="per_head"), tiny,
                      token_counts=counts)
    assert head.d2t.shape == (32,) and bool((head.d2t % 4 == 0).all())  # the most frequent ids were chosen
    h, _ = _inputs()
    logits = head(h)
    assert logits.shape == (2, B, T, 32)
    full = tiny.lm_head(h)
    torch.testing.assert_close(logits[0], full[..., head.d2t])  # per-head lm_head initialised from target rows
    top = logits[0].argmax(-1)
    assert torch.equal(head.to_target_ids(top), head.d2t[top])


def test_build_draft_vocab():
    counts = torch.tensor([5, 0, 9, 1, 7, 0, 3, 0])
    d2t, t2d, cov = build_draft_vocab(counts, 3)
    assert d2t.tolist() == [0, 2, 4]  # top-3 by count, sorted by id
    assert t2d.tolist() == [True, False, True, False, True, False, False, False]
    assert cov == pytest.approx(21 / 25)
    with pytest.raises(SpecheadsError, match="draft_vocab_size"):
        build_draft_vocab(counts, 9)


def _takes_draft_vocab(kind: str) -> bool:
    """The kind's example head takes a draft vocabulary of 64 ids (some kinds draft over the full vocabulary only)."""
    try:
        HeadSpec(kind=kind, **{**kind_spec(kind).example, "draft_vocab_size": 64})
    except SpecheadsError:
        return False
    return True


# every registered kind (its example head) and, where it takes one, with a draft vocabulary of 64 ids
KIND_VOCABS = [(k, None) for k in kind_names()] + [(k, 64) for k in kind_names() if _takes_draft_vocab(k)]
KIND_VOCAB_IDS = [f"{k}-V'{dv}" if dv else k for k, dv in KIND_VOCABS]


def _kind_head(tiny, kind, dv, scale=0.1):
    return make_head(tiny, kind, scale=scale, **({"draft_vocab_size": dv} if dv else {}))


@pytest.mark.parametrize("kind,dv", KIND_VOCABS, ids=KIND_VOCAB_IDS)
def test_frozen_parts_not_in_state_or_parameters(tiny, kind, dv):
    head = _kind_head(tiny, kind, dv, scale=0.0)  # as built
    frozen = {tiny.embed_tokens.weight.data_ptr(), tiny.lm_head.weight.data_ptr(),
              tiny.final_norm.weight.data_ptr()}
    assert not frozen & {p.data_ptr() for p in head.parameters()}
    assert not frozen & {t.data_ptr() for t in head.state_dict().values()}
    untrained = [n for n, p in head.named_parameters() if not p.requires_grad]
    if dv is None:
        assert untrained == []
    else:  # a block backbone's draft-vocab lm_head is the target's d2t rows, copied and frozen (heads/dspark.py)
        assert untrained in ([], ["lm_head.weight"])
        if untrained:
            torch.testing.assert_close(head.lm_head.weight, tiny.lm_head.weight[head.d2t], atol=0, rtol=0)
    assert head.embed_tokens is tiny.embed_tokens  # shared by reference


def test_eagle_shapes_counts(tiny):
    head = build_head(HeadSpec(kind="eagle"), tiny)
    attn = D * D * 2 + 2 * D * 32  # q,o: D x D; k,v: D x (2 kv heads x 16)
    mlp = 3 * D * 128
    assert sum(p.numel() for p in head.parameters()) == (2 * D * D + D) + attn + mlp + D  # fc(+bias) + layer
    assert "layers.0.input_layernorm.weight" not in head.state_dict()  # EAGLE drops the first input norm
    f, x = _inputs()
    ph, logits = head(f, x)
    assert ph.shape == (B, T, D) and logits.shape == (B, T, V)
    nobias = build_head(HeadSpec(kind="eagle", bias=False), tiny)
    assert nobias.fc.bias is None


def test_eagle_incremental_cache_equals_training_forward(tiny):
    """Strong check of cache, mask and positions: prefill 4 rows, then 2 rows at a time, then 1 by 1."""
    head = build_head(HeadSpec(kind="eagle"), tiny)
    torch.manual_seed(0)
    with torch.no_grad():  # perturb so the layer is far from its init
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    f, x = _inputs()
    _, ref = head(f, x)
    cache = head.new_cache()
    outs, start = [], 0
    for n in (4, 2, 1, 1, 1):
        pos = torch.arange(start, start + n).expand(B, n)
        _, lg = head.draft_forward(f[:, start:start + n], x[:, start:start + n], pos, _chain_mask(start, n), cache)
        outs.append(lg)
        start += n
        assert cache.get_seq_length() == start
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-5, rtol=1e-5)


def test_eagle_tree_branches_do_not_see_each_other(tiny):
    """Two sibling nodes after a 5-row prefix: each equals the chain computation of its own path."""
    head = build_head(HeadSpec(kind="eagle"), tiny)
    f, x = _inputs()
    cache = head.new_cache()
    head.draft_forward(f[:, :5], x[:, :5], torch.arange(5).expand(B, 5), _chain_mask(0, 5), cache)
    sib_tok = torch.stack([x[:, 5], (x[:, 5] + 1) % V], 1)  # [B,2]
    mask = torch.zeros(1, 1, 2, 7)
    mask[..., 0, 6] = float("-inf")
    mask[..., 1, 5] = float("-inf")
    _, lg = head.draft_forward(f[:, 5:6].expand(B, 2, D), sib_tok, torch.full((B, 2), 5), mask, cache)
    _, ref = head(f[:, :6], x[:, :6])
    torch.testing.assert_close(lg[:, 0], ref[:, 5], atol=1e-5, rtol=1e-5)
    x2 = x[:, :6].clone()
    x2[:, 5] = (x2[:, 5] + 1) % V
    _, ref2 = head(f[:, :6], x2)
    torch.testing.assert_close(lg[:, 1], ref2[:, 5], atol=1e-5, rtol=1e-5)


def test_select_columns_keeps_the_accepted_branch(tiny):
    """After two siblings, keep prefix + the second sibling: the next row equals the chain through that sibling."""
    from specheads.kvcache import select_columns

    head = build_head(HeadSpec(kind="eagle"), tiny)
    f, x = _inputs()
    cache = head.new_cache()
    head.draft_forward(f[:, :5], x[:, :5], torch.arange(5).expand(B, 5), _chain_mask(0, 5), cache)
    sib = torch.stack([(x[:, 5] + 1) % V, x[:, 5]], 1)  # the true token is the SECOND sibling
    mask = torch.zeros(1, 1, 2, 7)
    mask[..., 0, 6] = float("-inf")
    mask[..., 1, 5] = float("-inf")
    head.draft_forward(f[:, 5:6].expand(B, 2, D), sib, torch.full((B, 2), 5), mask, cache)
    select_columns(cache, torch.tensor([0, 1, 2, 3, 4, 6]))
    assert cache.get_seq_length() == 6
    _, lg = head.draft_forward(f[:, 6:7], x[:, 6:7], torch.full((B, 1), 6), _chain_mask(6, 1), cache)
    _, ref = head(f[:, :7], x[:, :7])
    torch.testing.assert_close(lg[:, 0], ref[:, 6], atol=1e-5, rtol=1e-5)


def test_eagle_padding_rows_no_nan(tiny):
    head = build_head(HeadSpec(kind="eagle"), tiny)
    f, x = _inputs()
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 5:] = 0
    ph, lg = head(f, x, am)
    assert torch.isfinite(lg).all()
    _, ref = head(f[1:, :5], x[1:, :5])  # padding does not change the valid rows
    torch.testing.assert_close(lg[1:, :5], ref, atol=1e-5, rtol=1e-5)


def test_eagle3_shapes_and_ttt_equals_draft_forward(tiny):
    head = build_head(HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3]), tiny)
    attn = 2 * D * D * 2 + 2 * (2 * D) * 32 - D * D  # q: 2D->D, k,v: 2D->32, o: D->D
    expect = 3 * D * D + attn + 3 * D * 128 + 3 * D + D + 100 * D  # fc, attn, mlp, 3 norms, final norm, lm_head
    assert sum(p.numel() for p in head.parameters()) == expect
    f, x = _inputs(F=3)
    steps = head(f, x, steps=3)
    assert len(steps) == 3 and all(s.shape == (B, T, 100) for s in steps)
    assert len(head(f, x)) == 7  # default TTT length
    # step 0 == draft_forward over the whole prefix (causal)
    cache = head.new_cache()
    h0, l0 = head.draft_forward(head.project_features(f), x, torch.arange(T).expand(B, T), _chain_mask(0, T), cache)
    torch.testing.assert_close(l0, steps[0], atol=1e-5, rtol=1e-5)
    # steps 1 and 2 at row t == a chain of drafts below prefix row t
    t = 4
    cache.crop(-(T - t - 1))
    h1, l1 = head.draft_forward(h0[:, t:t + 1], x[:, t + 1:t + 2], torch.full((B, 1), t + 1), _chain_mask(t + 1, 1),
                                cache)
    torch.testing.assert_close(l1[:, 0], steps[1][:, t], atol=1e-5, rtol=1e-5)
    _, l2 = head.draft_forward(h1, x[:, t + 2:t + 3], torch.full((B, 1), t + 2), _chain_mask(t + 2, 1), cache)
    torch.testing.assert_close(l2[:, 0], steps[2][:, t], atol=1e-5, rtol=1e-5)


def test_eagle3_lm_head_init_and_to_target_ids(tiny):
    counts = torch.arange(V, dtype=torch.float)  # the highest ids are the most frequent
    head = build_head(HeadSpec(kind="eagle3", draft_vocab_size=16), tiny, token_counts=counts)
    assert head.d2t.tolist() == list(range(V - 16, V))
    torch.testing.assert_close(head.lm_head.weight, tiny.lm_head.weight[V - 16:])
    assert head.to_target_ids(torch.tensor([0, 15])).tolist() == [V - 16, V - 1]
    assert head.t2d.sum() == 16 and bool(head.t2d[V - 1]) and not bool(head.t2d[0])


@pytest.mark.parametrize("kind,dv", KIND_VOCABS, ids=KIND_VOCAB_IDS)
def test_save_load_bit_exact(tiny, tmp_path, kind, dv):
    head = _kind_head(tiny, kind, dv)  # moved from its initialisation
    head.save_pretrained(tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["config.json", "model.safetensors",
                                                                  "model.safetensors.sha256"]
    back = load_head(tmp_path / "h", tiny)
    assert type(back) is type(head)
    sd, sd2 = head.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert back.embed_tokens is tiny.embed_tokens


def test_load_mismatched_target(tiny, tmp_path):
    from specheads.target import tiny_target

    build_head(HeadSpec(kind="eagle"), tiny).save_pretrained(tmp_path / "h")
    other = tiny_target(seed=1)
    with pytest.raises(SpecheadsError, match=r"tiny-llama-0.*tiny-llama-1.*weights differ in 30 of 39 tensors"):
        load_head(tmp_path / "h", other)
    wider = tiny_target(hidden_size=32)
    with pytest.raises(SpecheadsError, match=r"hidden size 64 vs 32"):
        load_head(tmp_path / "h", wider)
    with pytest.raises(SpecheadsError, match=r"vocab 256 vs 128"):
        load_head(tmp_path / "h", tiny_target(vocab_size=128))


def test_bad_folders(tiny, tmp_path):
    d = tmp_path / "h"
    build_head(HeadSpec(kind="medusa", num_heads=2), tiny).save_pretrained(d)
    cfg_path = d / "config.json"
    good = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**good, "colour": "blue"}))
    with pytest.raises(SpecheadsError, match=r"config.json: unknown key 'colour'"):
        load_head(d, tiny)
    cfg_path.write_text(json.dumps({k: v for k, v in good.items() if k != "fingerprint"}))
    with pytest.raises(SpecheadsError, match=r"config.json: missing key 'fingerprint'"):
        load_head(d, tiny)
    cfg_path.write_text("{not json")
    with pytest.raises(SpecheadsError, match=r"config.json: not valid JSON"):
        load_head(d, tiny)
    cfg_path.write_text(json.dumps(good))
    w = d / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(SpecheadsError, match=r"model.safetensors: not a readable safetensors"):
        load_head(d, tiny)
    w.write_bytes(b"\x00" * 16)
    with pytest.raises(SpecheadsError, match=r"model.safetensors"):
        load_head(d, tiny)
    from safetensors.torch import load_file, save_file

    w.write_bytes(data)
    sd = load_file(str(w))
    sd.pop("blocks.1.layers.0.bias")
    save_file(sd, str(w))
    with pytest.raises(SpecheadsError, match=r"model.safetensors: missing key 'blocks.1.layers.0.bias'"):
        load_head(d, tiny)
    sd["extra"] = torch.zeros(1)
    sd["blocks.1.layers.0.bias"] = torch.zeros(D)
    save_file(sd, str(w))
    with pytest.raises(SpecheadsError, match=r"unexpected key 'extra'"):
        load_head(d, tiny)
    with pytest.raises(SpecheadsError, match="head folder not found"):
        load_head(tmp_path / "nope", tiny)


def test_bf16_head_and_target(tmp_path):
    from specheads.target import tiny_target

    t16 = tiny_target(dtype=torch.bfloat16)
    head = build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), t16, dtype=torch.bfloat16)
    f, x = _inputs(F=3)
    out = head(f.bfloat16(), x, steps=2)
    assert out[0].dtype == torch.bfloat16 and torch.isfinite(out[1].float()).all()
    assert head._rope.rotary.inv_freq.dtype == torch.float32  # rotary stays fp32
    head.save_pretrained(tmp_path / "h")
    assert isinstance(DraftHead.from_pretrained(tmp_path / "h", t16), DraftHead)


# these kinds' own forwards, branch by branch; every kind's one Trainer step moving every trainable parameter is
# test_kind_contract.py's test_one_step_moves_the_head_and_not_the_target
@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "peagle"])
def test_gradients_reach_every_head_parameter_and_no_target_weight(tiny, kind):
    fused = kind in ("eagle3", "peagle")
    head = build_head(HeadSpec(kind=kind, feature_layers=[1, 2, 3] if fused else None, num_layers=2 if
                               kind == "peagle" else 1), tiny)
    F = 3 if fused else 1
    f, x = _inputs(F=F)
    if kind == "medusa":
        loss = head(f).logsumexp(-1).sum()
    elif kind == "eagle":
        ph, lg = head(f, x)
        loss = lg.logsumexp(-1).sum() + ph.square().sum()
    else:  # EAGLE-3's TTT steps; P-EAGLE's depths (mask_hidden reached through depths >= 1)
        loss = sum(s.logsumexp(-1).sum() for s in (head(f, x) if kind == "peagle" else head(f, x, steps=2)))
    loss.backward()
    missing = [n for n, p in head.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # Medusa blocks start at W = 0, b = 0: SiLU'(0) = 0.5, so their grads are non-zero too
    assert missing == []
    assert all(p.grad is None for p in tiny.model.parameters())


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_draft_forward_last_only_equals_last_row(tiny, kind):
    F = 1 if kind == "eagle" else 3
    head = build_head(HeadSpec(kind=kind, draft_vocab_size=100, feature_layers=None if F == 1 else [1, 2, 3]), tiny)
    f, x = _inputs(F=F)
    args = (head.project_features(f), x, torch.arange(T).expand(B, T), _chain_mask(0, T))
    h_all, l_all = head.draft_forward(*args, head.new_cache())
    h_last, l_last = head.draft_forward(*args, head.new_cache(), last_only=True)
    assert l_last.shape == (B, 1, 100) and h_last.shape == (B, T, D)
    torch.testing.assert_close(h_last, h_all, atol=0, rtol=0)
    torch.testing.assert_close(l_last[:, 0], l_all[:, -1], atol=1e-6, rtol=1e-6)


def test_last_row_is_a_dense_copy():
    from specheads.heads.base import last_row

    h = torch.randn(2, 5, 8)
    r = last_row(h)
    assert r.shape == (2, 1, 8) and r.stride() == (8, 8, 1)  # not h's batch stride 40 (slow bf16 linear on CPU)
    assert torch.equal(r[:, 0], h[:, -1])
