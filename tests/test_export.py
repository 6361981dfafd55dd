"""Export -> import round trips per format, the key/config layout each consumer reads, foreign checkpoints, errors,
and (when .venv-speculators exists) the real `speculators` package loading our export."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.heads import HeadSpec, build_head, load_head
from specheads.heads.export import export_head, import_head
from specheads.utils import SpecheadsError

ROOT = Path(__file__).resolve().parents[1]
SPEC_PY = ROOT / ".venv-speculators" / "bin" / "python"
V, D = 256, 64
COUNTS = torch.arange(V)  # the highest ids are "most frequent"


def _trained(spec, tiny, tmp_path, name="h"):
    head = build_head(spec, tiny, token_counts=COUNTS if spec.draft_vocab_size else None)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    head.save_pretrained(tmp_path / name)
    return head


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


CASES = [
    ("native", HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3])),
    ("eagle", HeadSpec(kind="eagle")),
    ("eagle", HeadSpec(kind="eagle", bias=False)),
    ("eagle3", HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3])),
    ("eagle3", HeadSpec(kind="eagle3")),
    ("speculators", HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3])),
    ("speculators", HeadSpec(kind="eagle3", feature_layers=[1, 2, 4])),
    ("medusa-vllm", HeadSpec(kind="medusa", num_heads=3, num_layers=2, medusa_lm_head="per_head")),
    ("medusa-vllm", HeadSpec(kind="medusa", num_heads=2, medusa_lm_head="per_head", draft_vocab_size=50)),
]


@pytest.mark.parametrize("fmt,spec", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_round_trip_bit_exact(tiny, tmp_path, fmt, spec):
    head = _trained(spec, tiny, tmp_path)
    export_head(tmp_path / "h", fmt, tmp_path / "out")
    back = import_head(tmp_path / "out", tiny)
    assert type(back) is type(head) and back.config.feature_layers == head.config.feature_layers
    _same_state(head, back)


def test_medusa_shared_exports_target_rows(tiny, tmp_path):
    head = _trained(HeadSpec(kind="medusa", num_heads=2, draft_vocab_size=40), tiny, tmp_path)
    with pytest.raises(SpecheadsError, match="--target"):
        export_head(tmp_path / "h", "medusa-vllm", tmp_path / "out")
    export_head(tmp_path / "h", "medusa-vllm", tmp_path / "out", target=tiny)
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(sd["lm_heads.1.weight"], tiny.lm_head.weight[head.d2t])
    assert torch.equal(sd["token_map"], head.d2t)  # vLLM's token_map holds absolute target ids
    back = import_head(tmp_path / "out", tiny)
    assert back.spec.medusa_lm_head == "per_head"
    h = torch.randn(1, 5, D)
    torch.testing.assert_close(back(h), head(h))


def test_eagle3_layout_matches_sglang(tiny, tmp_path):
    head = _trained(HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3]), tiny, tmp_path)
    export_head(tmp_path / "h", "eagle3", tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == V and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang ids = ours - 1
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    mid = {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"} | {f"midlayer.mlp.{p}_proj.weight" for p in
                                                                      ("gate", "up", "down")}
    mid |= {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight"}
    assert set(sd) == mid | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (D, 2 * D)  # attention reads [embed ; hidden]
    assert sd["fc.weight"].shape == (D, 3 * D) and sd["lm_head.weight"].shape == (100, D)
    # SGLang: hot_token_id = d2t + arange (offsets); t2d is a [V] bool mask
    assert torch.equal(sd["d2t"] + torch.arange(100), head.d2t)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].sum() == 100


def test_speculators_and_medusa_config_fields(tiny, tmp_path):
    _trained(HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3]), tiny, tmp_path)
    export_head(tmp_path / "h", "speculators", tmp_path / "s", verifier_name_or_path="org/verifier",
                speculative_tokens=5)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5}]
    assert sc["verifier"]["name_or_path"] == "org/verifier" and sc["verifier"]["architectures"]
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    keys = set(load_file(str(tmp_path / "s" / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.hidden_norm.weight"} <= keys
    assert not any(k.startswith("midlayer.") for k in keys)

    _trained(HeadSpec(kind="medusa", num_heads=2, num_layers=2, medusa_lm_head="per_head"), tiny, tmp_path, "m")
    export_head(tmp_path / "m", "medusa-vllm", tmp_path / "mv")
    cfg = json.loads((tmp_path / "mv" / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 2 and cfg["num_hidden_layers"] == 2
    assert cfg["truncated_vocab_size"] == V and cfg["medusa_fc_bias"] is True
    keys = set(load_file(str(tmp_path / "mv" / "model.safetensors")))
    assert keys == {f"blocks.{h}.layers.{l}.{p}" for h in range(2) for l in range(2) for p in ("weight", "bias")} | \
        {"lm_heads.0.weight", "lm_heads.1.weight"}


@pytest.mark.parametrize("prefix", ["", "medusa_head."])
def test_import_fasterdecoding_medusa(tiny, tmp_path, prefix):
    """FasterDecoding/Medusa @ e2a5d20c048a9b0a4092e6933c34313687422518: medusa/train/train_legacy.py saves
    `medusa_head.state_dict()` (the ModuleList of `nn.Sequential(*[ResBlock] * n, nn.Linear(D, V, bias=False))`) as
    medusa_lm_head.safetensors, keys `{h}.{l}.linear.weight|bias` and `{h}.{n}.weight`, no prefix, and
    medusa/model/medusa_model.py loads it back with `medusa_head.load_state_dict`; older exports put `medusa_head.`
    in front. The repo ties the n ResBlocks of a head (the same module n times): we untie."""
    src = tmp_path / "repo"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2,
                                                 "base_model_name_or_path": "x"}))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for h in range(2):
        w, b = torch.randn(D, D, generator=g) * 0.01, torch.randn(D, generator=g) * 0.01
        for l in range(2):  # the same values under both names, as the tied repo writes them
            sd[f"{prefix}{h}.{l}.linear.weight"], sd[f"{prefix}{h}.{l}.linear.bias"] = w.clone(), b.clone()
        sd[f"{prefix}{h}.2.weight"] = torch.randn(V, D, generator=g)
    save_file(sd, str(src / "medusa_lm_head.safetensors"))
    head = import_head(src, tiny)
    assert head.spec.num_heads == 2 and head.spec.num_layers == 2 and head.spec.resolved_bias()
    assert head.blocks[0].layers[0].weight.data_ptr() != head.blocks[0].layers[1].weight.data_ptr()
    x = torch.randn(1, 3, D)
    blk = sd[f"{prefix}0.0.linear.weight"], sd[f"{prefix}0.0.linear.bias"]
    y = x
    for _ in range(2):
        y = y + torch.nn.functional.silu(y @ blk[0].T + blk[1])
    torch.testing.assert_close(head(x)[0], y @ sd[f"{prefix}0.2.weight"].T)
    sd[f"{prefix}0.0.extra.weight"] = torch.zeros(1)
    save_file(sd, str(src / "medusa_lm_head.safetensors"))
    with pytest.raises(SpecheadsError, match="unexpected key '(medusa_head.)?0.0.extra.weight'"):
        import_head(src, tiny)


def test_import_eagle1_repo_folder(tiny, tmp_path):
    _trained(HeadSpec(kind="eagle"), tiny, tmp_path)
    export_head(tmp_path / "h", "eagle", tmp_path / "e")
    sd = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert "lm_head.weight" not in sd and "fc.bias" in sd
    assert json.loads((tmp_path / "e" / "config.json").read_text())["num_hidden_layers"] == 1
    sd["embed_tokens.weight"] = tiny.embed_tokens.weight.clone()  # EAGLE-1 repo checkpoints carry the embedding
    save_file(sd, str(tmp_path / "e" / "model.safetensors"))
    assert import_head(tmp_path / "e", tiny).kind == "eagle"
    os.replace(tmp_path / "e" / "model.safetensors", tmp_path / "e" / "pytorch_model.bin")
    with pytest.raises(SpecheadsError, match="pickles are never loaded"):
        import_head(tmp_path / "e", tiny)


def test_export_import_errors(tiny, tmp_path):
    from specheads.target import tiny_target

    _trained(HeadSpec(kind="eagle"), tiny, tmp_path)
    with pytest.raises(SpecheadsError, match="needs a eagle3 head"):
        export_head(tmp_path / "h", "eagle3", tmp_path / "x")
    with pytest.raises(SpecheadsError, match="--format"):
        export_head(tmp_path / "h", "onnx", tmp_path / "x")
    w = tmp_path / "h" / "model.safetensors"
    sd = load_file(str(w))
    sd.pop("layers.0.mlp.up_proj.weight")
    save_file(sd, str(w))
    with pytest.raises(SpecheadsError, match=r"model.safetensors: missing key 'layers.0.mlp.up_proj.weight'"):
        export_head(tmp_path / "h", "eagle", tmp_path / "x")
    assert not (tmp_path / "x").exists()

    _trained(HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3]), tiny, tmp_path, "e3")
    export_head(tmp_path / "e3", "eagle3", tmp_path / "sg")
    with pytest.raises(SpecheadsError, match=r"hidden_size 64 but target 'tiny-llama-0' has hidden size 32"):
        import_head(tmp_path / "sg", tiny_target(hidden_size=32))
    sw = tmp_path / "sg" / "model.safetensors"
    sd = load_file(str(sw))
    sd["d2t"] = sd["d2t"] + torch.arange(100)  # absolute ids written where offsets belong
    save_file(sd, str(sw))
    with pytest.raises(SpecheadsError, match="'d2t' and 't2d' disagree"):
        import_head(tmp_path / "sg", tiny)
    sd.pop("lm_head.weight")
    save_file(sd, str(sw))
    with pytest.raises(SpecheadsError, match="missing key 'lm_head.weight'"):
        import_head(tmp_path / "sg", tiny)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{}")
    with pytest.raises(SpecheadsError, match="cannot tell the checkpoint format"):
        import_head(tmp_path / "junk", tiny)


def test_cli_export_and_import(tiny, tmp_path, capsys, monkeypatch):
    from specheads import cli

    _trained(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), tiny, tmp_path)
    assert cli.main(["export", "--head", str(tmp_path / "h"), "--format", "eagle3", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "model.safetensors").exists()
    assert cli.main(["export", "--head", str(tmp_path / "h"), "--format", "medusa-vllm", "--out",
                     str(tmp_path / "z")]) == 2
    assert "needs a medusa head" in capsys.readouterr().err
    monkeypatch.setattr("specheads.target.load_target", lambda name, dtype="float32", **kw: tiny)
    assert cli.main(["export", "--import", str(tmp_path / "o"), "--target", "tiny", "--out", str(tmp_path / "n")]) == 0
    _same_state(load_head(tmp_path / "h", tiny), load_head(tmp_path / "n", tiny))
    assert cli.main(["export", "--import", str(tmp_path / "o"), "--out", str(tmp_path / "n2")]) == 2


@pytest.mark.skipif(not SPEC_PY.exists(), reason="no .venv-speculators (run scripts/setup_speculators_venv.sh)")
def test_speculators_package_loads_and_runs_our_export(tiny, tmp_path):
    """The real consumer: speculators' own config and model classes load the export (every weight equal), and its own
    EAGLE-3 TTT forward gives our per-step logits (same layer semantics, mask, positions up to a RoPE-invariant
    shift, and d2t/t2d buffers)."""
    tiny.model.save_pretrained(tmp_path / "verifier")  # speculators reads the verifier config and its embedding
    head = _trained(HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3]), tiny, tmp_path)
    export_head(tmp_path / "h", "speculators", tmp_path / "s", verifier_name_or_path=str(tmp_path / "verifier"))
    g = torch.Generator().manual_seed(5)
    feats, toks = torch.randn(1, 12, 3 * D, generator=g), torch.randint(0, V, (1, 12), generator=g)
    with torch.no_grad():
        logits = head(feats, toks, steps=3)
    (tmp_path / "ref").mkdir()
    save_file({"features": feats, "tokens": toks, **{f"logits_{i}": l for i, l in enumerate(logits)}},
              str(tmp_path / "ref" / "inputs.safetensors"))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HOME": os.environ.get("HOME", str(tmp_path))}
    r = subprocess.run([str(SPEC_PY), str(ROOT / "tests" / "fixtures" / "speculators_load.py"), str(tmp_path / "s"),
                        str(tmp_path / "ref")], capture_output=True, text=True, env=env, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    diffs = out.pop("max_abs_diff")
    assert out == {"ok": True, "checked": 15, "draft_vocab_size": 100, "aux_ids": [1, 2, 3],
                   "class": "Eagle3DraftModel", "verifier": str(tmp_path / "verifier"), "steps": 3}
    assert max(diffs) < 1e-4, diffs
