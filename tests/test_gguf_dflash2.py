"""DFlash2 heads as llama.cpp drafts (heads/dflash2_gguf.py): the flat z-lab config the converter reads, the heads
llama.cpp cannot run refused, and with the built tools (`make llamacpp`) the converted draft read back tensor for
tensor and run by llama-server: greedy output equals plain, and every step's draft length (cut where the selector's
probability first falls below --spec-draft-p-min) and accepted count equal ours (test_llamacpp.py's target)."""
from __future__ import annotations

import re

import pytest
import torch

from specheads.heads import HeadSpec, build_head
from specheads.heads.base import read_head_config
from specheads.heads.dflash2_gguf import DFLASH2_DRAFT, converter_config
from specheads.utils import SpecheadsError
from test_llamacpp import _our_blocks as _llamacpp_blocks  # noqa: E402
from test_llamacpp import (FEATURES, REPEAT, _cut_threshold, _ggufs_and_plain_reply, _tie, _walk,  # noqa: F401
                           needs_tools, repeat_smol, smol_cache, tiny_smol)

K_BLOCK = 4
SPEC = dict(kind="dflash2", block_size=K_BLOCK, markov_rank=0, confidence_head=False, sample_from_anchor=False,
            conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)


def test_dflash2_converter_config_is_the_flat_zlab_layout(tiny):
    head = build_head(HeadSpec(feature_layers=[3, 1, 2], mask_token_id=5, num_layers=2, **SPEC), tiny)
    config = converter_config(head.config, {"speculators_model_type": "dflash2", "transformer_layer_config": {}})
    assert config["architectures"] == ["DFlash2DraftModel"]  # conversion/qwen.py:664
    assert "speculators_model_type" not in config and "transformer_layer_config" not in config
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64 and config["vocab_size"] == 256
    assert config["dflash_config"] == {"block_size": K_BLOCK, "mask_token_id": 5, "target_layer_ids": [2, 0, 1],
                                       "causal": False, "conv_kernel_size": 3, "conv_group_size": 16,
                                       "selector_rank": 8, "selector_top_k": 4}


@pytest.mark.parametrize("spec,msg", [
    ({"sample_from_anchor": True}, "bonus token"),
    ({"selector_top_k": 8}, "k\\(k\\+1\\)"),  # 8 * 9 = 72 scores do not fit a 64-wide row
    ({"feature_layers": [1, 2, 4]}, "pre-norm"),
])
def test_dflash2_heads_llamacpp_cannot_run_are_refused(tiny, tmp_path, spec, msg):
    build_head(HeadSpec(**{**SPEC, "feature_layers": [1, 2, 3], "mask_token_id": 5, **spec}), tiny).save_pretrained(
        tmp_path / "h")
    with pytest.raises(SpecheadsError, match=msg):
        DFLASH2_DRAFT.check_head(read_head_config(tmp_path / "h"), tmp_path / "h")


@pytest.fixture(scope="module")
def dflash2_head(tiny_smol):
    """A random DFlash2 head on the peaked target: convolutions and selector far from their identity / small init
    (the selector's transition term of the order of the unary gaps, so it reorders the candidates)."""
    folder, target, _ = tiny_smol
    torch.manual_seed(2)
    head = build_head(HeadSpec(feature_layers=FEATURES, **SPEC), target)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad:
                p.add_((0.5 if "candidate_selector" in name else 0.05) * torch.randn_like(p))
    head.save_pretrained(folder.parent / "dflash2")
    return head, folder.parent / "dflash2"


@needs_tools
def test_dflash2_export_gguf_reads_back_every_tensor(tiny_smol, dflash2_head, tmp_path):
    import json

    from specheads.cli import main
    from specheads.heads.gguf import gguf_metadata, spec_type_of

    head, head_dir = dflash2_head
    out = tmp_path / "gguf"
    assert main(["export", "--head", str(head_dir), "--format", "gguf", "--out", str(out), "--gguf-type", "f32"]) == 0
    meta, tensors = gguf_metadata(out / "draft.gguf")
    assert meta["dflash.selector_top_k"] == 4 and meta["dflash.conv_kernel_size"] == 3
    assert "dflash.sample_from_anchor" not in meta  # DFlashModel writes none: draft-dspark would read it as true
    sd = head.state_dict()

    def same(name, ours):
        assert torch.equal(torch.as_tensor(tensors[name].data.copy()).reshape(ours.shape), ours.float()), name

    same("selector_predecessor.weight", sd["candidate_selector.predecessor_codebook"])
    same("selector_successor.weight", sd["candidate_selector.successor_codebook"])
    same("selector_hidden.weight", sd["candidate_selector.hidden_projection.weight"])
    for i in range(head.spec.num_layers):
        for gg, ours in (("attn", "attention_conv"), ("ffn", "mlp_conv")):
            same(f"blk.{i}.{gg}_conv_base", sd[f"layers.{i}.{ours}.base_kernel"])  # [side, tap, D] both
            same(f"blk.{i}.{gg}_conv_proj.weight", sd[f"layers.{i}.{ours}.kernel_projection.weight"])
    manifest = json.loads((out / "gguf_export.json").read_text())
    assert manifest["llama_server"].endswith(f"--spec-type draft-dflash --spec-draft-n-max {K_BLOCK - 1}")
    assert spec_type_of(out / "draft.gguf") == "draft-dflash"  # not draft-dspark, the other dflash-arch kind


def _our_blocks(head, target, seq: list[int], start: int) -> dict:
    """test_llamacpp's, the last member the selector's probability of each chosen token."""
    return _llamacpp_blocks(head, target, seq, start, third=lambda logits, _: logits.softmax(-1).amax(-1).tolist())


def test_dflash2_llamacpp_drafts_are_our_drafts_and_greedy_equals_plain(tiny_smol, dflash2_head):
    """llama.cpp's draft-dflash with our converted DFlash2 head: greedy output equals llama.cpp plain; every step's
    draft length (the block cut at the first selector probability below a p-min chosen in a gap of ours) and
    accepted count (server log, -lv 5) equal our walk's, and so do the totals of its counters."""
    from specheads.infer.bench.llamacpp import LlamaServer

    folder, target, _ = tiny_smol
    head, head_dir = dflash2_head
    n_predict = 20
    model, draft, ids, want = _ggufs_and_plain_reply(folder, target, head_dir, n_predict)
    seq = ids + want
    ours = _our_blocks(head, target, seq, len(ids))
    p_min = _cut_threshold(ours, seq, len(ids), n_predict)
    steps = list(_walk(ours, seq, len(ids), n_predict, p_min))
    for a, cut, *_ in steps:  # no near tie before the cut: llama.cpp's fp32 choice is ours
        assert _tie(ours[a][1]) >= cut, (a, ours[a])
    log_file = folder.parent / "dflash2-server.log"
    args = ("--spec-type", "draft-dflash", "--spec-draft-n-max", str(head.num_drafts),
            "--spec-draft-p-min", f"{p_min:.6f}", "-lv", "5")
    with LlamaServer(model, draft, args, log_file=log_file) as spec:
        reply = spec.complete(ids, n_predict)
    assert reply["tokens"] == want  # lossless: greedy speculative = greedy plain
    logged = [(int(m[2]), int(m[1])) for m in re.finditer(r"accepted (\d+)/(\d+) draft tokens",
                                                          log_file.read_text(errors="replace"))]
    assert [(n, acc) for n, acc in logged if n] == [(n, acc) for *_, n, acc in steps if n]
    assert any(cut < head.num_drafts for _, cut, *_ in steps)  # the selector probability cut a block short
    assert (sum(n for *_, n, _ in steps), sum(acc for *_, acc in steps)) == (
        reply["timings"]["draft_n"], reply["timings"]["draft_n_accepted"])


def _selector_made_head(target, root):
    """A DFlash2 head on the repeat target whose every draft is REPEAT, chosen by the selector over a better unary
    candidate: attention and MLP outputs zero (each drafting slot's state is the mask embedding's, the same for all),
    the final norm's dimension-0 weight set so that the target's lm_head ranks REPEAT third, and the codebooks give
    the pair (REPEAT, REPEAT) a bonus of 50 through W_h h (W_h reads dimension 0 only, h_0 > 0)."""
    torch.manual_seed(3)
    head = build_head(HeadSpec(feature_layers=FEATURES, **SPEC), target)
    seen = []
    hook = head.norm.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    with torch.no_grad():
        for layer in head.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        cache = head.new_cache()
        head.extend_context(cache, torch.zeros(2, len(FEATURES) * target.hidden_size))
        head.draft_block(cache, REPEAT)
        hook.remove()
        z = seen[0].reshape(-1, seen[0].shape[-1])[-1]  # a drafting slot's pre-norm state (all equal)
        lm = target.lm_head.weight
        head.norm.weight[0] = 0.0
        others = lm @ head.norm(z)
        top = others.topk(3).values
        per_unit = lm[REPEAT, 0] * z[0] / z.pow(2).mean().add(target.config.rms_norm_eps).sqrt()
        head.norm.weight[0] = float((top[1] + top[2]) / 2 / per_unit)  # U(REPEAT) between the 2nd and 3rd
        h = head.norm(z)
        unary, sel = lm @ h, head.candidate_selector
        assert unary.argmax() != REPEAT and REPEAT in unary.topk(4).indices and h[0] > 0
        sel.hidden_projection.weight.zero_()
        sel.hidden_projection.weight[:, 0] = 1.0
        sel.predecessor_codebook[REPEAT] = 1.0
        sel.successor_codebook[REPEAT] = 50.0 / (head.spec.options.selector_rank * float(h[0]))
        logits, _ = head.draft_block(cache, REPEAT)
        assert logits.argmax(-1).tolist() == [REPEAT] * head.num_drafts
    head.save_pretrained(root / "repeat-dflash2")
    return head, root / "repeat-dflash2"


@needs_tools
def test_dflash2_selector_choice_is_llamacpps_and_every_draft_is_accepted(repeat_smol):
    """The repeat target and a head whose drafts are REPEAT only through its selector (the unary top-1 is another
    token): llama.cpp drafts REPEAT too, so every draft is accepted: 25 tokens = the prefill's 1 + 6 steps of 3
    accepted drafts + 1, 18 of 18 drafts accepted, as our walk says."""
    from specheads.heads.gguf import draft_gguf, target_gguf
    from specheads.infer.bench.llamacpp import LlamaServer

    folder, target, _ = repeat_smol
    head, head_dir = _selector_made_head(target, folder.parent)
    model = target_gguf(str(folder), "f32")
    draft = draft_gguf(head_dir, target=str(folder), outtype="f32")
    ids, n_predict = target.tokenizer("Hello there, how are you?")["input_ids"], 25
    steps = list(_walk(_our_blocks(head, target, ids + [REPEAT] * n_predict, len(ids)), ids + [REPEAT] * n_predict,
                       len(ids), n_predict, 0.0))
    assert [(n, acc) for *_, n, acc in steps] == [(3, 3)] * 6
    args = ("--spec-type", "draft-dflash", "--spec-draft-n-max", str(head.num_drafts))
    with LlamaServer(model, draft, args) as spec:
        reply = spec.complete(ids, n_predict)
    assert reply["tokens"] == [REPEAT] * n_predict
    assert (reply["timings"]["draft_n"], reply["timings"]["draft_n_accepted"]) == (18, 18)
