"""EAGLE-3.1 (issue 30): EAGLE-3 with `fc_norm` (one RMSNorm per captured target state before fc) and `norm_output`
(the head's post-norm state fed to its next step), as speculators' Eagle3SpeculatorConfig / Eagle3DraftModel
(.venv-speculators, speculators/models/eagle3/config.py and core.py) define them. Off: EAGLE-3's equations, keys and
export files; on: the equations, training, greedy generation through our loop, native save / load, the speculators
export run by the real package, and one clear refusal from the eagle3 and gguf formats."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specheads.config import load_config
from specheads.heads import HeadSpec, build_head, load_head
from specheads.heads.base import read_head_config
from specheads.heads.export import export_head, import_head
from specheads.heads.export.eagle3 import eagle31_problems
from specheads.heads.gguf import DRAFT_KINDS
from specheads.heads.kinds import kind_names, kind_spec
from specheads.infer.drafters import EagleDrafter
from specheads.infer.engine.generate import generate
from specheads.target import tiny_target
from specheads.train.recipe import Recipe
from specheads.utils import SpecheadsError
from tests.trained import train_checked
from test_export import run_speculators_load
from test_heads import _chain_mask

ROOT = Path(__file__).resolve().parents[1]
SPEC_PY = ROOT / ".venv-speculators" / "bin" / "python"
B, T, D, V = 2, 9, 64, 256
ON = dict(fc_norm=True, norm_output=True)


def _head(target, seed=3, **kw):
    """An EAGLE-3 head over layers [3, 1, 2] (unsorted: exports reorder) with every weight moved off its init."""
    spec = HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=kw.pop("feature_layers", [3, 1, 2]), **kw)
    head = build_head(spec, target, token_counts=torch.arange(V))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return head


def _inputs(seed=1, F=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, F * D, generator=g), torch.randint(0, V, (B, T), generator=g)


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _eagle3_reference(head, f, x):
    """EAGLE-3's step 0 written out from the head's modules (heads/eagle3.py docstring): (o [B,T,D], logits)."""
    mid, eps = head.midlayer, head.layer_config.rms_norm_eps
    g = f @ head.fc.weight.T
    pos = torch.arange(T).expand(B, T)
    a, _ = mid.self_attn(hidden_states=torch.cat([mid.input_layernorm(head.embed(x)), mid.hidden_norm(g)], -1),
                         attention_mask=_chain_mask(0, T), position_embeddings=head._rope(g, pos))
    o = g + a
    o = o + mid.mlp(_rms(o, mid.post_attention_layernorm.weight, eps))
    return o, head.lm_head(_rms(o, head.norm.weight, eps))


def test_switches_off_are_eagle3(tiny):
    """Default and explicit false: the same keys (no fc_norm), the same init from the same seed, and EAGLE-3's
    equations; the switches are refused on other kinds."""
    torch.manual_seed(0)
    a = build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), tiny)
    torch.manual_seed(0)
    b = build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3], fc_norm=False, norm_output=False), tiny)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any(k.startswith("fc_norm") for k in sa) and a.fc_norm is None
    on = build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3], **ON), tiny)
    assert sorted(on.state_dict()) == sorted(list(sa) + [f"fc_norm.{i}.weight" for i in range(3)])
    head = _head(tiny)
    f, x = _inputs()
    with torch.no_grad():
        o, logits = _eagle3_reference(head, f, x)
        h, lg = head.draft_forward(head.project_features(f), x, torch.arange(T).expand(B, T), _chain_mask(0, T),
                                   head.new_cache())
        torch.testing.assert_close(h, o, atol=1e-5, rtol=1e-5)  # the pre-norm state goes on
        torch.testing.assert_close(lg, logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(head(f, x, steps=1)[0], logits, atol=1e-5, rtol=1e-5)
    for kind in (k for k in kind_names() if k != "eagle3"):  # every other kind: not one of its settings
        for name in ON:
            with pytest.raises(SpecheadsError, match=f"head.{name}: a setting of eagle3 heads, not of "):
                HeadSpec(kind=kind, **{**kind_spec(kind).example, name: True})  # a valid head of that kind


def test_switches_on_follow_speculators_equations(tiny):
    """fc_norm: RMSNorm_i (weight fc_norm.{i}, the target's eps) on block i of the features, in config order, then
    fc; norm_output: the state handed on is RMSNorm_final(o), the logits unchanged. TTT step i == a chain of
    draft_forward calls fed the returned states (training reads what inference feeds)."""
    head = _head(tiny, **ON)
    assert len(head.fc_norm) == 3 and all(n.variance_epsilon == tiny.model.config.rms_norm_eps for n in head.fc_norm)
    assert all(not torch.equal(n.weight, torch.ones(D)) for n in head.fc_norm)
    plain = _head(tiny)
    with torch.no_grad():
        plain.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("fc_norm")})
    f, x = _inputs()
    eps = head.layer_config.rms_norm_eps
    with torch.no_grad():
        normed = torch.cat([_rms(c, n.weight, eps) for n, c in zip(head.fc_norm, f.chunk(3, -1))], -1)
        torch.testing.assert_close(head.project_features(f), plain.project_features(normed), atol=1e-6, rtol=1e-6)
        args = (head.project_features(f), x, torch.arange(T).expand(B, T), _chain_mask(0, T))
        h_on, l_on = head.draft_forward(*args, head.new_cache())
        h_off, l_off = plain.draft_forward(*args, plain.new_cache())
        torch.testing.assert_close(h_on, _rms(h_off, head.norm.weight, eps), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l_on, l_off, atol=1e-5, rtol=1e-5)
        steps = head(f, x, steps=3)
        cache = head.new_cache()
        h0, l0 = head.draft_forward(*args, cache)
        torch.testing.assert_close(l0, steps[0], atol=1e-5, rtol=1e-5)
        t = 4
        cache.crop(-(T - t - 1))
        h1, l1 = head.draft_forward(h0[:, t:t + 1], x[:, t + 1:t + 2], torch.full((B, 1), t + 1),
                                    _chain_mask(t + 1, 1), cache)
        torch.testing.assert_close(l1[:, 0], steps[1][:, t], atol=1e-5, rtol=1e-5)
        _, l2 = head.draft_forward(h1, x[:, t + 2:t + 3], torch.full((B, 1), t + 2), _chain_mask(t + 2, 1), cache)
        torch.testing.assert_close(l2[:, 0], steps[2][:, t], atol=1e-5, rtol=1e-5)
        _, last = head.draft_forward(*args, head.new_cache(), last_only=True)
        torch.testing.assert_close(last[:, 0], l_on[:, -1], atol=1e-6, rtol=1e-6)


def _samples(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 24 - (i % 3) * 4
        lm = torch.zeros(t, dtype=torch.long)
        lm[t // 3:] = 1
        out.append({"input_ids": torch.randint(3, V, (t,), generator=g), "loss_mask": lm})
    return out


def test_training_moves_every_head_weight_and_not_the_target(tiny, tmp_path):
    recipe = load_config(Recipe, None, [
        f"output_dir={tmp_path}", "seed=0", "head.kind=eagle3", "head.fc_norm=true", "head.norm_output=true",
        "head.draft_vocab_size=64", "head.ttt_steps=2", "train.tracker=none", "train.batch_size=2", "train.lr=1e-2",
        "train.warmup_steps=1", "train.log_every=1", "train.max_steps=2", "eval.at_start=false",
        "eval.every_steps=2", "eval.max_samples=4", "eval.batch_size=2"])
    torch.manual_seed(0)
    head = build_head(recipe.head, tiny)
    res, changed = train_checked(recipe, tiny, head, _samples(8), _samples(4, seed=1),
                                 expect_changed=set(head.state_dict()) - {"d2t", "t2d"})
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= changed
    assert res.steps == 2 and 1.0 <= res.history[-1]["tau_chain"]
    final = load_head(tmp_path / "final", tiny)
    assert final.spec.options.fc_norm and final.spec.options.norm_output


@pytest.mark.usefixtures("one_thread")
def test_greedy_generation_equals_plain_greedy(tiny):
    head = _head(tiny, feature_layers=[1, 2, 3], **ON)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        base = torch.randint(3, V, (6,), generator=g).tolist()
        prompt = base * 3 if i % 2 else base + torch.randint(3, V, (5,), generator=g).tolist()
        ref = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        r = generate(tiny, EagleDrafter(head, depth=3, top_k=3, total_tokens=8), prompt, max_new_tokens=24)
        assert r.ids == ref[0, len(prompt):].tolist()
        assert sum(n * c for n, c in enumerate(r.stats.accept_hist)) == len(r.ids)


def test_native_save_load_round_trip(tiny, tmp_path):
    head = _head(tiny, **ON)
    head.save_pretrained(tmp_path / "h")
    spec = json.loads((tmp_path / "h" / "config.json").read_text())["spec"]
    assert spec["eagle3"]["fc_norm"] is True and spec["eagle3"]["norm_output"] is True
    back = load_head(tmp_path / "h", tiny)
    sd, sd2 = head.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    f, x = _inputs()
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(head(f, x, steps=2), back(f, x, steps=2)))
    # a folder written before the switches existed (no such spec keys) loads as EAGLE-3
    _head(tiny).save_pretrained(tmp_path / "old")
    cfg = json.loads((tmp_path / "old" / "config.json").read_text())
    for name in ON:
        del cfg["spec"]["eagle3"][name]
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg))
    old = load_head(tmp_path / "old", tiny)
    assert old.fc_norm is None and not old.norm_output


def test_speculators_export_carries_both_and_imports_back(tiny, tmp_path):
    """Config keys as speculators names them (true, top level; absent when off, so a plain EAGLE-3 export is as
    before); fc_norm.{i} renumbered in ascending layer order with fc's blocks; the import is the same head."""
    head = _head(tiny, **ON)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "speculators", tmp_path / "s", consumers=["speculators"], target=tiny)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    sd = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    for i, j in enumerate([1, 2, 0]):  # layers [3, 1, 2]: ascending 1, 2, 3 are config positions 1, 2, 0
        assert torch.equal(sd[f"fc_norm.{i}.weight"], head.state_dict()[f"fc_norm.{j}.weight"])
    back = import_head(tmp_path / "s", tiny)
    assert back.spec.options.fc_norm and back.spec.options.norm_output and back.config.feature_layers == [1, 2, 3]
    f, x = _inputs()
    theirs = torch.cat([f.chunk(3, -1)[j] for j in (1, 2, 0)], -1)
    with torch.no_grad():
        for a, b in zip(head(f, x, steps=2), back(theirs, x, steps=2)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    _head(tiny).save_pretrained(tmp_path / "plain")
    export_head(tmp_path / "plain", "speculators", tmp_path / "sp", target=tiny)
    plain = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert "fc_norm" not in plain and "norm_output" not in plain
    assert not any(k.startswith("fc_norm") for k in load_file(str(tmp_path / "sp" / "model.safetensors")))


@pytest.mark.parametrize("switches", [ON, dict(fc_norm=True), dict(norm_output=True)],
                         ids=["both", "fc_norm", "norm_output"])
def test_consumers_that_cannot_carry_it_refuse_in_one_line(tiny, tmp_path, switches):
    """SGLang >= 0.5.23 and vLLM >= 0.34 build both switches (eagle3 and, for vLLM, speculators); llama.cpp's
    converter (0c1e570), the EAGLE-3 repo and gguf build neither: the eagle3 export for its default consumers names
    llama.cpp alone and the consumers that read it; for those it is written (the keys at the top level, fc_norm.{i}
    ascending) and read back as the same head."""
    head = _head(tiny, feature_layers=[3, 1, 2], **switches)
    head.save_pretrained(tmp_path / "h")
    names = ", ".join(f"head.{n}" for n in switches)
    with pytest.raises(SpecheadsError, match=rf"--format eagle3: .*llama.cpp's EAGLE-3 converter \(llama.cpp\): this "
                                             rf"head is EAGLE-3.1 \({names}\): llama.cpp's converter .*; export for "
                                             r"\['sglang', 'vllm'\] only with --consumer") as e:
        export_head(tmp_path / "h", "eagle3", tmp_path / "e")
    assert "\n" not in str(e.value) and "(sglang)" not in str(e.value) and not (tmp_path / "e").exists()
    with pytest.raises(SpecheadsError, match=r"--format gguf: .* is an EAGLE-3.1 head .*pre-norm state"):
        DRAFT_KINDS["eagle3"].check_head(read_head_config(tmp_path / "h"), tmp_path / "h")
    cfg = head.config
    for fmt, consumer in [("speculators", "speculators"), ("speculators", "vllm"), ("eagle3", "vllm"),
                          ("eagle3", "sglang")]:
        assert eagle31_problems(fmt, consumer, cfg) == [], (fmt, consumer)
    for consumer in ("llama.cpp", "eagle-repo"):
        assert eagle31_problems("eagle3", consumer, cfg), consumer
    assert eagle31_problems("eagle3", "llama.cpp", _head(tiny, feature_layers=[1, 2, 3]).config) == []
    export_head(tmp_path / "h", "eagle3", tmp_path / "e", consumers=["sglang", "vllm"])
    out = json.loads((tmp_path / "e" / "config.json").read_text())
    assert {n: out.get(n) for n in ON} == {n: switches.get(n) for n in ON}
    back = import_head(tmp_path / "e", tiny)
    assert (back.spec.options.fc_norm, back.spec.options.norm_output) == (bool(switches.get("fc_norm")),
                                                          bool(switches.get("norm_output")))
    export_head(tmp_path / "h", "speculators", tmp_path / "s", target=tiny)  # speculators and vLLM >= 0.34
    assert json.loads((tmp_path / "s" / "config.json").read_text())["specheads"]["consumers"] == ["speculators",
                                                                                                   "vllm"]


def _engine_eagle31_chain(cfg: dict, sd: dict, theirs_f, x, t: int, tiny):
    """An engine's EAGLE-3.1 draft chain at row t, re-stated from SGLang 0.5.23's llama_eagle3.py (the release
    wheel: LlamaModel reads getattr(config, "fc_norm") and "norm_output", num_aux from eagle_config's ids, splits the
    captured states [B,T,F*D] (ascending layers) into F chunks and applies fc_norm[i] (weights fc_norm.{i}.weight,
    eps rms_norm_eps) to chunk i before fc; norm(h, residual) gives the logits' state and the pre-norm state, and
    with norm_output the post-norm one is handed to the next step) and vLLM 0.34.0's (llama_eagle3.py:
    combine_hidden_states chunks into fc_norm the same way, forward returns post-norm aux_output with norm_output;
    speculators/algos.py update_eagle3 copies fc_norm / norm_output from a speculators config). The decoder layer
    is plain EAGLE-3's (a plain head loaded with the file's tensors: the other export tests check that layer).
    -> the logits of steps 0, 1, 2 at row t."""
    F = len((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    eps = cfg["rms_norm_eps"]
    plain = _head(tiny, feature_layers=[1, 2, 3])
    plain.load_state_dict({**plain.state_dict(), **{k.replace("layers.0.", "midlayer."): v for k, v in sd.items()
                                                    if not k.startswith(("fc_norm.", "embed_tokens"))}})
    chunks = theirs_f.chunk(F, -1)
    if cfg.get("fc_norm", False):
        chunks = [_rms(c, sd[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(chunks)]
    g = torch.cat(chunks, -1) @ sd["fc.weight"].T
    hand_on = (lambda h: _rms(h, sd["norm.weight"], eps)) if cfg.get("norm_output", False) else (lambda h: h)
    cache = plain.new_cache()
    h, lg = plain.draft_forward(g, x, torch.arange(T).expand(B, T), _chain_mask(0, T), cache)
    out = [lg[:, t]]
    cache.crop(-(T - t - 1))
    h = hand_on(h)[:, t:t + 1]
    for k in (1, 2):
        h, lg = plain.draft_forward(h, x[:, t + k:t + k + 1], torch.full((B, 1), t + k), _chain_mask(t + k, 1), cache)
        out.append(lg[:, 0])
        h = hand_on(h)
    return out


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("switches", [ON, dict(fc_norm=True), dict(norm_output=True)],
                         ids=["both", "fc_norm", "norm_output"])
def test_sglang_and_vllm_read_the_eagle31_export(tiny, tmp_path, switches, fmt):
    """The keys and tensors SGLang >= 0.5.23 (eagle3) and vLLM >= 0.34 (eagle3, and speculators through
    update_eagle3) read, applied to our export of an unsorted-layer EAGLE-3.1 head: three steps of the engine's
    chain give our per-step logits."""
    head = _head(tiny, feature_layers=[3, 1, 2], **switches)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", fmt, tmp_path / "e", target=tiny, consumers=["vllm"])
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    sd = load_file(str(tmp_path / "e" / "model.safetensors"))
    if fmt == "speculators":  # update_eagle3: the layer config plus the keys it passes on
        cfg = {**cfg["transformer_layer_config"], **{k: cfg.get(k, False) for k in ("fc_norm", "norm_output")},
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"]}}
    f, x = _inputs()
    theirs = torch.cat([f.chunk(3, -1)[j] for j in (1, 2, 0)], -1)  # captured ascending: layers 1, 2, 3
    t = 4
    with torch.no_grad():
        ours = [lg[:, t] for lg in head(f, x, steps=3)]
        for k, (a, b) in enumerate(zip(ours, _engine_eagle31_chain(cfg, sd, theirs, x, t, tiny))):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=f"step {k}")


def test_recipe_turns_both_on():
    recipe = load_config(Recipe, ROOT / "configs" / "eagle31-smollm2.yaml")
    assert recipe.head.kind == "eagle3" and recipe.head.options.fc_norm and recipe.head.options.norm_output
    assert recipe.features.dir == "runs/eagle3-smollm2/features"


@pytest.mark.skipif(not SPEC_PY.exists(), reason="no .venv-speculators (run scripts/setup_speculators_venv.sh)")
def test_speculators_package_loads_and_runs_the_eagle31_export(tmp_path):
    """The real consumer: speculators' classes load the export with fc_norm / norm_output on (its config says so,
    every weight equal, fc_norm.* included), and its own TTT forward (per-layer fc norms, post-norm state fed on)
    gives our per-step logits."""
    target = tiny_target(num_layers=8, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    target.model.save_pretrained(tmp_path / "verifier")
    layers = [6, 1, 3]
    head = _head(target, feature_layers=layers, **ON)
    head.save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", "speculators", tmp_path / "s", verifier_name_or_path=str(tmp_path / "verifier"),
                consumers=["speculators"], target=target)
    g = torch.Generator().manual_seed(5)
    blocks = {i: torch.randn(1, 12, D, generator=g) for i in layers}
    toks = torch.randint(0, V, (1, 12), generator=g)
    with torch.no_grad():
        logits = head(torch.cat([blocks[i] for i in layers], -1), toks, steps=3)
    out = run_speculators_load(tmp_path / "s", torch.cat([blocks[i] for i in sorted(layers)], -1), toks, logits,
                               tmp_path)
    assert out["ok"] and out["embed_is_verifier"] and out["aux_ids"] == sorted(layers) and out["steps"] == 3
    assert out["checked"] == len(load_file(str(tmp_path / "s" / "model.safetensors")))
    assert max(out["max_abs_diff"]) < 1e-4, out["max_abs_diff"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}
    probe = ("import json, sys; from speculators import SpeculatorModelConfig as C; c = C.from_pretrained(sys.argv[1]);"
             " print(json.dumps({'fc_norm': c.fc_norm, 'norm_output': c.norm_output,"
             " 'norm_before_fc': c.norm_before_fc}))")
    r = subprocess.run([str(SPEC_PY), "-c", probe, str(tmp_path / "s")], capture_output=True, text=True, env=env,
                       timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"fc_norm": True, "norm_output": True,
                                                            "norm_before_fc": False}
