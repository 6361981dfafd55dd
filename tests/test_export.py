"""Export -> import round trips per format; each consumer's reading rules (the config keys and tensors its loader
reads, in its conventions) applied to our files, with the loader cited; refusals of what a consumer cannot read;
foreign checkpoints; errors; and (when .venv-speculators exists) the real `speculators` package running our export.

The consumer rules below are our own re-statement of what each loader does, read at these commits (full list with
what each was used for: docs/exports.md):
SGLang sgl-project/sglang@3b64d5dee0756de843b5f022966f69c995cd15ea python/sglang/srt/models/llama_eagle.py,
  @d737979cbd17c6162f39c1953cfa72d3d23cc0d0 .../llama_eagle3.py, @00239548f1cd1a06ca145a5447a86738090a48f1 .../llama.py;
vLLM vllm-project/vllm@e1c4a55214c63e19e83f82ad6c552d82148bae0b vllm/model_executor/models/llama_eagle.py,
  @583507d13075783a12ccbd774575974d10ca4959 .../llama_eagle3.py, @e06c9ba2a6ea923a84add30f5dafaea126429b81 .../llama.py,
  @0002bff0b6cb36a3c8a17364de3303664463c412 .../registry.py, @23c5aa92d517802488a0c77a5f58cd0a2019c5a3
  vllm/transformers_utils/configs/eagle.py, @4e1790651fc758c06c7a903dd4cd82364ac91b27
  vllm/v1/worker/gpu_model_runner.py, @09cddad8f0324594022359cd2b07e962a14b895f .../models/medusa.py,
  @4bb77b3239adff81001f12cd9c9a39b65800a373 vllm/transformers_utils/configs/medusa.py,
  @cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec .../configs/speculators/algos.py;
EAGLE SafeAILab/EAGLE@cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b eagle/model/{ea_model,cnets,cnets1,modeling_llama_kv}.py;
llama.cpp ggml-org/llama.cpp pull requests #18039 (EAGLE-3 support, merged), #25794 (aux ids from config, merged),
  #27040 (states that the converter reads the top-level ids);
FasterDecoding/Medusa@e2a5d20c048a9b0a4092e6933c34313687422518."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.heads import HeadSpec, build_head, default_feature_layers, load_head
from specheads.heads.base import causal_mask_4d
from specheads.heads.export import consumer_problems, consumers_of, export_head, import_head
from specheads.utils import SpecheadsError
from helpers import run_fixture

ROOT = Path(__file__).resolve().parents[1]
SPEC_PY = ROOT / ".venv-speculators" / "bin" / "python"
V, D = 256, 64
COUNTS = torch.arange(V)  # the highest ids are "most frequent"
ROPE = {"rope_type": "default", "rope_theta": 100000.0}  # SmolLM2's base: the readers' fallback is 10,000


@pytest.fixture
def tiny_rope():
    """The tiny target with a RoPE base of 100,000 in transformers 5's `rope_parameters` (as SmolLM2's config)."""
    from specheads.target import tiny_target

    return tiny_target(rope_parameters=dict(ROPE))


@pytest.fixture
def tiny8():
    """An 8-layer tiny target: room for non-default EAGLE-3 layers in 1..L-1 (default [2, 4, 5])."""
    from specheads.target import tiny_target

    return tiny_target(num_layers=8, rope_parameters=dict(ROPE))


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


def _exported(path):
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


CASES = [
    ("native", HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3])),
    ("eagle", HeadSpec(kind="eagle")),
    ("eagle", HeadSpec(kind="eagle", bias=False, num_layers=2)),
    ("eagle-vllm", HeadSpec(kind="eagle")),
    ("eagle-vllm", HeadSpec(kind="eagle", bias=False)),
    ("eagle3", HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3])),
    ("eagle3", HeadSpec(kind="eagle3")),
    ("speculators", HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3])),
    ("speculators", HeadSpec(kind="eagle3")),
    ("medusa-vllm", HeadSpec(kind="medusa", num_heads=3, num_layers=2, medusa_lm_head="per_head")),
    ("medusa-vllm", HeadSpec(kind="medusa", num_heads=2, draft_vocab_size=50)),
]


@pytest.mark.parametrize("fmt,spec", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_round_trip_bit_exact(tiny, tmp_path, fmt, spec):
    head = _trained(spec, tiny, tmp_path)
    export_head(tmp_path / "h", fmt, tmp_path / "out", target=tiny)
    back = import_head(tmp_path / "out", tiny)
    assert type(back) is type(head) and back.config.feature_layers == head.config.feature_layers
    assert back.spec.resolved_bias() == head.spec.resolved_bias()
    _same_state(head, back)


# ------------------------------------------------------------------------------------------------ EAGLE-1 readers
def _eagle1_reader(cfg: dict, fc_bias: bool, attention_bias: bool, rope_theta: float):
    """The EAGLE-1 draft a reader builds from an exported config: HF's own Llama layers (num_hidden_layers of them,
    layer 0 without its input norm, as all three readers do), fc 2D -> D, RoPE at `rope_theta`."""
    from transformers import LlamaConfig, LlamaModel

    lc = LlamaConfig(vocab_size=8, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                     num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                     head_dim=cfg.get("head_dim"), rms_norm_eps=cfg["rms_norm_eps"],
                     num_hidden_layers=cfg["num_hidden_layers"], max_position_embeddings=cfg["max_position_embeddings"],
                     attention_bias=attention_bias, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    lc._attn_implementation = "sdpa"
    model = LlamaModel(lc)
    model.layers[0].input_layernorm = torch.nn.Identity()
    reader = torch.nn.Module()
    reader.fc = torch.nn.Linear(2 * cfg["hidden_size"], cfg["hidden_size"], bias=fc_bias)
    reader.layers = model.layers
    return reader, model.rotary_emb


def _load_reader(reader, sd: dict, unexpected: str) -> None:
    """Load like the consumer: every parameter it built must come from the file (a missing one stays random in all
    three); file keys it has no parameter for are `unexpected` = "ignored" (load_state_dict(strict=False), SGLang's
    skip of unknown biases) or "error" (vLLM llama_eagle.py: params_dict[name], a KeyError)."""
    own = set(reader.state_dict())
    assert own <= set(sd), f"the reader would leave {sorted(own - set(sd))} uninitialised"
    if unexpected == "error":
        assert set(sd) <= own, f"the reader has no parameter for {sorted(set(sd) - own)} (KeyError)"
    reader.load_state_dict({k: v for k, v in sd.items() if k in own}, strict=True)


def _eagle1_logits(reader, rotary, target, feats, toks):
    """fc([E(x); f]) -> layers -> the target's lm_head: what all three readers compute (no final norm)."""
    T = toks.shape[1]
    pos = torch.arange(T)[None]
    mask = causal_mask_4d(torch.ones(1, T, dtype=torch.long), torch.float32)
    x = reader.fc(torch.cat([target.embed_tokens(toks), feats], -1))
    pe = rotary(x, pos)
    for layer in reader.layers:
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        x = x[0] if isinstance(x, tuple) else x
    return target.lm_head(x)


def _eagle1_case(target, spec, tmp_path, fmt):
    head = _trained(spec, target, tmp_path)
    export_head(tmp_path / "h", fmt, tmp_path / fmt)
    g = torch.Generator().manual_seed(7)
    feats, toks = torch.randn(1, 9, D, generator=g), torch.randint(0, V, (1, 9), generator=g)
    with torch.no_grad():
        ours = head(feats, toks)[1]
    return (*_exported(tmp_path / fmt), ours, feats, toks)


@pytest.mark.parametrize("bias", [True, False])
def test_eagle_read_by_the_eagle_repo(tiny_rope, tmp_path, bias):
    """EAGLE repo (SafeAILab/EAGLE@cb7e0841, eagle/model/ea_model.py + cnets1.py): `bias = con["bias"]` (default
    True) is the FC bias; attention biases only with `qkv_bias`; RoPE base `config.rope_theta` if present, else
    10,000; `ea_layer.load_state_dict(..., strict=False)` (extra keys ignored, missing ones stay random)."""
    cfg, sd, ours, feats, toks = _eagle1_case(tiny_rope, HeadSpec(kind="eagle", bias=bias), tmp_path, "eagle")
    assert cfg.get("rope_theta", 10000) == ROPE["rope_theta"]
    reader, rotary = _eagle1_reader(cfg, fc_bias=cfg.get("bias", True), attention_bias="qkv_bias" in cfg,
                                    rope_theta=cfg.get("rope_theta", 10000))
    _load_reader(reader, sd, unexpected="ignored")
    with torch.no_grad():
        torch.testing.assert_close(_eagle1_logits(reader, rotary, tiny_rope, feats, toks), ours)


@pytest.mark.parametrize("bias", [True, False])
def test_eagle_read_by_sglang(tiny_rope, tmp_path, bias):
    """SGLang LlamaForCausalLMEagle (sgl-project/sglang@3b64d5de, python/sglang/srt/models/llama_eagle.py): the class
    named in `architectures`; `fc = nn.Linear(2D, D)` with a bias always; its Llama layers (llama.py @00239548) take
    `attention_bias or bias` as the q/k/v/o bias and `getattr(config, "rope_theta", 10000)`; weights load by name
    (`model.` + name), biases it has no parameter for are skipped."""
    cfg, sd, ours, feats, toks = _eagle1_case(tiny_rope, HeadSpec(kind="eagle", bias=bias), tmp_path, "eagle")
    assert cfg["architectures"][0] == "LlamaForCausalLMEagle"
    reader, rotary = _eagle1_reader(cfg, fc_bias=True,
                                    attention_bias=bool(cfg.get("attention_bias") or cfg.get("bias")),
                                    rope_theta=cfg.get("rope_theta", 10000))
    _load_reader(reader, sd, unexpected="ignored")
    with torch.no_grad():
        torch.testing.assert_close(_eagle1_logits(reader, rotary, tiny_rope, feats, toks), ours)


@pytest.mark.parametrize("bias", [True, False])
def test_eagle_vllm_read_by_vllm(tiny_rope, tmp_path, bias):
    """vLLM EagleLlamaForCausalLM (vllm-project/vllm@e1c4a552, vllm/model_executor/models/llama_eagle.py): fc built
    with bias=False, weights by `params_dict[name]` (a key it lacks is a KeyError); the class comes from
    `architectures` mapped arch -> "Eagle" + arch unless it starts with "Eagle" (transformers_utils/configs/eagle.py
    @23c5aa92) and looked up in the registry (@0002bff0: EagleLlamaForCausalLM); its Llama layers (llama.py @e06c9ba2)
    take `attention_bias or bias` as q/k/v (unless `qkv_bias`) and o bias, RoPE from `rope_parameters` (older
    versions: `rope_theta`). A head trained with an fc bias reads exactly: the bias is folded into layer 0."""
    cfg, sd, ours, feats, toks = _eagle1_case(tiny_rope, HeadSpec(kind="eagle", bias=bias), tmp_path, "eagle-vllm")
    archs = [a if a.startswith("Eagle") else f"Eagle{a}" for a in cfg["architectures"]]
    assert "EagleLlamaForCausalLM" in archs and "fc.bias" not in sd and cfg["eagle_fc_bias"] is False
    assert cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"] == ROPE["rope_theta"]
    attention_bias = bool(cfg.get("attention_bias") or cfg.get("bias"))
    assert attention_bias == bias and "qkv_bias" not in cfg
    reader, rotary = _eagle1_reader(cfg, fc_bias=False, attention_bias=attention_bias, rope_theta=cfg["rope_theta"])
    _load_reader(reader, sd, unexpected="error")
    with torch.no_grad():
        torch.testing.assert_close(_eagle1_logits(reader, rotary, tiny_rope, feats, toks), ours, rtol=1e-4, atol=1e-5)


def _tied_target():
    """The tiny target with its lm_head tied to its embedding, as SmolLM2-135M's (`tie_word_embeddings: true`)."""
    from specheads.target import tiny_target

    t = tiny_target(rope_parameters=dict(ROPE))
    t.model.config.tie_word_embeddings = True
    t.model.lm_head.weight = t.model.model.embed_tokens.weight
    return t


@pytest.mark.parametrize("fmt,spec", [("eagle", HeadSpec(kind="eagle")), ("eagle-vllm", HeadSpec(kind="eagle")),
                                      ("eagle3", HeadSpec(kind="eagle3")), ("speculators", HeadSpec(kind="eagle3"))])
def test_tied_target_exports_untied_draft(tmp_path, fmt, spec):
    """SGLang's LlamaForCausalLMEagle (llama_eagle.py @3b64d5de) makes `lm_head = model.embed_tokens` when the
    draft config says `tie_word_embeddings`; its EAGLE worker then calls set_embed_and_head (llama.py), which
    deletes `model.embed_tokens.weight` and then `lm_head.weight`, the same module's, and fails before drafting.
    Every export says false, whatever the target's config (copied into the `eagle` layouts) says; the speculators
    export carries the target's embedding as its own tensor (speculators reads it from the checkpoint), the others
    none (the engine hands the draft the target's)."""
    target = _tied_target()
    assert target.text_config.to_dict()["tie_word_embeddings"] is True
    _trained(spec, target, tmp_path)
    assert json.loads((tmp_path / "h" / "config.json").read_text())["target_config"]["tie_word_embeddings"] is True
    export_head(tmp_path / "h", fmt, tmp_path / fmt, target=target)
    cfg, sd = _exported(tmp_path / fmt)
    layer = cfg.get("transformer_layer_config", cfg)
    assert cfg.get("tie_word_embeddings", False) is False and layer["tie_word_embeddings"] is False
    if fmt == "speculators":
        assert torch.equal(sd["embed_tokens.weight"], target.embed_tokens.weight)
    else:
        assert "embed_tokens.weight" not in sd


# ------------------------------------------------------------------------------------------------ EAGLE-3 readers
def _captured_layers(consumer: str, cfg: dict, L: int) -> list[int]:
    """The target layers a consumer feeds the draft, in its order (hidden-states index: input of layer i = ours i).
    SGLang (llama.py @00239548 set_eagle3_layers_to_capture): eagle_config ids + 1, default [2, L//2, L-3]; vLLM
    (gpu_model_runner.py @4e179065 _get_eagle3_aux_layers_from_config): top-level ids, else the model default
    (llama.py @e06c9ba2: (2, L//2, L-3)); llama.cpp (PR #25794; #27040 quotes eagle3_raw_config.get(
    "eagle_aux_hidden_state_layer_ids") then [2, n//2, n-3]): top level; the EAGLE-3 repo (modeling_llama_kv.py
    @cb7e0841): `idx == 2 or idx == L//2 or idx == L-3`, whatever the config says. Each engine appends the input of
    layer idx while looping over the layers, so states arrive ascending and once per layer."""
    default = [2, L // 2, L - 3]
    if consumer == "sglang":
        nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = [i + 1 for i in nested] if nested else default
    elif consumer in ("vllm", "llama.cpp", "speculators"):
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or default
    else:
        ids = default
    return sorted(set(ids))


def _eagle3_fc_reads_right(head, cfg, sd, target, consumer):
    """The consumer concatenates the captured states in layer order and applies the file's fc: the same g_t as our
    head gives from its features in config order."""
    hs = target.model(torch.randint(0, V, (1, 7)), output_hidden_states=True).hidden_states
    theirs = torch.cat([hs[i] for i in _captured_layers(consumer, cfg, target.num_layers)], -1)
    assert theirs.shape[-1] == sd["fc.weight"].shape[1] == 3 * D  # fc = Linear(3 * hidden, hidden) in each engine
    ours = head.project_features(torch.cat([hs[i] for i in head.config.feature_layers], -1))
    bias = sd.get("fc.bias") if consumer == "sglang" and cfg.get("bias") else None  # SGLang: bias=config.bias
    torch.testing.assert_close(torch.nn.functional.linear(theirs, sd["fc.weight"], bias), ours)


@pytest.mark.parametrize("layers", [None, [1, 3, 6], [6, 1, 3]], ids=["default", "non-default", "unsorted"])
def test_eagle3_read_by_sglang_vllm_llamacpp(tiny8, tmp_path, layers):
    """Each engine's aux-id convention on a non-default (and an unsorted) head: SGLang's nested ids are ours minus
    one, vLLM's and llama.cpp's top-level ids are ours, all capture ascending; d2t offsets (SGLang llama_eagle3.py
    @d737979c: hot_token_id = d2t + arange; vLLM llama_eagle3.py @583507d1: base + draft_id_to_target_id), t2d
    skipped; `draft_vocab_size` rows in lm_head; num_hidden_layers 1 (SGLang raises otherwise); the parameter names
    SGLang's LlamaForCausalLMEagle3 registers (fc, midlayer.{input_layernorm, hidden_norm, self_attn.*_proj,
    post_attention_layernorm, mlp.*}, norm, lm_head); RoPE base via rope_theta (getattr default 10,000)."""
    head = _trained(HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=layers), tiny8, tmp_path)
    export_head(tmp_path / "h", "eagle3", tmp_path / "e3")
    cfg, sd = _exported(tmp_path / "e3")
    want = sorted(head.config.feature_layers)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == want
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in want]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 100 == sd["lm_head.weight"].shape[0] and cfg["rope_theta"] == ROPE["rope_theta"]
    assert "target_hidden_size" not in cfg  # the EAGLE-3 repo loads the target's embedding only without it
    mid = {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"} | {f"midlayer.mlp.{p}_proj.weight" for p in
                                                                      ("gate", "up", "down")}
    mid |= {f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    assert set(sd) == mid | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert torch.equal(sd["d2t"] + torch.arange(100), head.d2t) and int(sd["t2d"].sum()) == 100
    with torch.no_grad():
        for consumer in ("sglang", "vllm", "llama.cpp"):
            assert _captured_layers(consumer, cfg, 8) == want, consumer
            _eagle3_fc_reads_right(head, cfg, sd, tiny8, consumer)


def test_eagle3_with_fc_bias_for_sglang_only(tiny8, tmp_path):
    """SGLang reads `bias` as the fc bias AND (LlamaDecoderLayer's `attention_bias or bias`, llama.py @00239548)
    the o_proj bias, qkv being rebuilt without one (llama_eagle3.py @d737979c): the export writes a zero o_proj bias.
    vLLM (llama_eagle3.py @583507d1: fc bias=False, params_dict KeyError) and llama.cpp (PR #18039's converter maps
    fc.weight only) cannot take the head: refused unless the export names SGLang alone."""
    head = _trained(HeadSpec(kind="eagle3", bias=True), tiny8, tmp_path)
    with pytest.raises(SpecheadsError, match=r"vLLM's Eagle3LlamaForCausalLM \(vllm\): its fc has no bias.*"
                                             r"llama.cpp.*export for \['sglang'\] only with --consumer"):
        export_head(tmp_path / "h", "eagle3", tmp_path / "x")
    export_head(tmp_path / "h", "eagle3", tmp_path / "e3", consumers=["sglang"])
    cfg, sd = _exported(tmp_path / "e3")
    assert cfg["bias"] is True and cfg["specheads"]["consumers"] == ["sglang"]
    assert torch.equal(sd["midlayer.self_attn.o_proj.bias"], torch.zeros(D)) and "fc.bias" in sd
    with torch.no_grad():
        _eagle3_fc_reads_right(head, cfg, sd, tiny8, "sglang")
    back = import_head(tmp_path / "e3", tiny8)
    _same_state(head, back)


@pytest.mark.parametrize("fmt,layers,consumer,reason", [
    ("eagle3", [1, 5], "vllm", "exactly 3 feature layers"),
    ("eagle3", [1, 3, 5, 7], "sglang", "exactly 3 feature layers"),
    ("eagle3", [2, 4, 8], "llama.cpp", "layer id 8 is our final post-norm state"),
    ("eagle3", [2, 2, 5], "sglang", "captures each target layer once"),
    ("eagle3", [0, 3, 5], "vllm", "layer id 0"),
    ("speculators", [2, 4, 8], "speculators", "pre-norm output"),
    ("speculators", [2, 2, 5], "speculators", "captures each target layer once"),
])
def test_feature_layers_no_consumer_can_feed_are_refused(tiny8, tmp_path, fmt, layers, consumer, reason):
    """Layers the engines cannot reproduce (see _captured_layers): they build fc for 3 states, capture inputs of
    layers 0..L-1 (never our post-norm L; speculators' last id is the pre-norm output), add the residual (none before
    layer 0: SGLang / vLLM), and capture a layer once. The export refuses, naming the consumer and the reason."""
    _trained(HeadSpec(kind="eagle3", feature_layers=layers), tiny8, tmp_path)
    with pytest.raises(SpecheadsError, match=rf"--format {fmt}: .*\({consumer}\): [^;]*{reason}"):
        export_head(tmp_path / "h", fmt, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_layer_zero_exports_for_llamacpp_alone(tiny8, tmp_path):
    _trained(HeadSpec(kind="eagle3", feature_layers=[0, 3, 5]), tiny8, tmp_path)
    with pytest.raises(SpecheadsError, match=r"export for \['llama.cpp'\] only with --consumer"):
        export_head(tmp_path / "h", "eagle3", tmp_path / "x")
    export_head(tmp_path / "h", "eagle3", tmp_path / "x", consumers=["llama.cpp"])
    with pytest.raises(SpecheadsError, match=r"--consumer 'tensorrt': --format eagle3 is read by"):
        export_head(tmp_path / "h", "eagle3", tmp_path / "x", consumers=["tensorrt"])


def test_eagle_repo_reads_only_its_hardcoded_layers(tiny8, tmp_path):
    """The EAGLE-3 repo captures layers 2, L//2, L-3 (modeling_llama_kv.py @cb7e0841) and ignores config ids, its fc
    has no bias and loads with strict=False (cnets.py, ea_model.py): opt-in consumer, checked when named."""
    assert "eagle-repo" in consumers_of("eagle3") and "eagle-repo" not in consumers_of("eagle3", default_only=True)
    _trained(HeadSpec(kind="eagle3", feature_layers=[1, 3, 6]), tiny8, tmp_path)
    export_head(tmp_path / "h", "eagle3", tmp_path / "x")  # the engines read it
    with pytest.raises(SpecheadsError, match=r"\(eagle-repo\): it captures the hardcoded layers 2, L // 2, L - 3 = "
                                             r"\[2, 4, 5\]"):
        export_head(tmp_path / "h", "eagle3", tmp_path / "x", consumers=["sglang", "eagle-repo"])
    _trained(HeadSpec(kind="eagle3"), tiny8, tmp_path, "d")
    export_head(tmp_path / "d", "eagle3", tmp_path / "y", consumers=["eagle-repo"])
    assert _captured_layers("eagle-repo", {}, 8) == json.loads((tmp_path / "y" / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"]


def test_training_defaults_export_everywhere():
    """heads/base.py default_feature_layers: three distinct ascending ids in 1..L-1 for every L >= 4, which every
    default consumer of eagle3 and speculators accepts; [2, L//2, L-3] (the EAGLE-3 repo's, SGLang's and vLLM's
    default) from L = 7 on, so SmolLM2 (L = 30) keeps [2, 15, 27] and its features on disk stay valid."""
    from specheads.heads.base import HeadConfig

    assert default_feature_layers("eagle3", 30) == [2, 15, 27]
    assert default_feature_layers("eagle3", 4) == [1, 2, 3]  # [2, L//2, L-3] would be [2, 2, 1]
    for L in range(4, 65):
        ids = default_feature_layers("eagle3", L)
        assert ids == sorted(set(ids)) and len(ids) == 3 and 1 <= ids[0] and ids[-1] <= L - 1, (L, ids)
        if L >= 7:
            assert ids == [2, L // 2, L - 3]
        cfg = HeadConfig(kind="eagle3", target_name="t", hidden_size=8, vocab_size=8, feature_layers=ids,
                         fingerprint={}, draft_vocab_size=None, spec={"kind": "eagle3", "feature_layers": ids},
                         target_config={"num_hidden_layers": L, "model_type": "llama"})
        for fmt in ("eagle3", "speculators"):
            for c in consumers_of(fmt, default_only=True) + (["eagle-repo"] if fmt == "eagle3" and L >= 7 else []):
                assert consumer_problems(fmt, c, cfg) == [], (L, fmt, c)
    with pytest.raises(SpecheadsError, match="head.feature_layers: EAGLE-3 fuses 3 distinct"):
        default_feature_layers("eagle3", 3)


def test_medusa_shared_exports_target_rows(tiny, tmp_path):
    """A head sharing the target's lm_head over a draft vocabulary: original_lm_head true, the target's full lm_head
    once as lm_heads.0 (vLLM slices it to token_map), token_map the absolute ids; read back as the same shared head."""
    head = _trained(HeadSpec(kind="medusa", num_heads=2, draft_vocab_size=40), tiny, tmp_path)
    with pytest.raises(SpecheadsError, match="--target"):
        export_head(tmp_path / "h", "medusa-vllm", tmp_path / "out")
    export_head(tmp_path / "h", "medusa-vllm", tmp_path / "out", target=tiny)
    cfg, sd = _exported(tmp_path / "out")
    assert cfg["original_lm_head"] is True and cfg["truncated_vocab_size"] == 40
    assert torch.equal(sd["lm_heads.0.weight"], tiny.lm_head.weight) and "lm_heads.1.weight" not in sd
    assert torch.equal(sd["token_map"], head.d2t)  # vLLM's token_map holds absolute target ids
    back = import_head(tmp_path / "out", tiny)
    assert back.spec.options.lm_head == "shared" and torch.equal(back.d2t, head.d2t)
    h = torch.randn(1, 5, D)
    torch.testing.assert_close(back(h), head(h))


def test_medusa_own_projections_over_a_draft_vocab_refused_for_vllm(tiny, tmp_path):
    """vLLM 0.12-0.32 build every lm_heads.{h} over the full vocabulary and read a draft vocabulary only through
    original_lm_head (one projection for all heads): per-head projections over V' fit no layout; 0.33 removed
    Medusa. One line, nothing written; the same head over the full vocabulary exports."""
    _trained(HeadSpec(kind="medusa", num_heads=2, medusa_lm_head="per_head", draft_vocab_size=50), tiny, tmp_path)
    with pytest.raises(SpecheadsError, match=r"--format medusa-vllm: .*vLLM's Medusa \(vllm\): vLLM 0.12-0.32 build "
                                             r".*head.medusa.lm_head per_head.*50-token draft vocabulary.*no "
                                             r"medusa-vllm consumer reads this head") as e:
        export_head(tmp_path / "h", "medusa-vllm", tmp_path / "x")
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()
    _trained(HeadSpec(kind="medusa", num_heads=2, medusa_lm_head="per_head"), tiny, tmp_path, "full")
    export_head(tmp_path / "full", "medusa-vllm", tmp_path / "y")


VLLM_MEDUSA = ("0.11", "0.32")  # vllm@09cddad8 (the last layout with V'-row heads) and the 0.32.0 wheel (the last)


def _vllm_medusa(cfg: dict, sd: dict, version: str):
    """vLLM's Medusa as it builds itself from our config and loads our file (vllm/model_executor/models/medusa.py,
    vllm@09cddad8 = 0.11 and the vllm 0.32.0 release wheel): ResidualBlock = num_hidden_layers x (x + SiLU(Linear(x,
    bias=medusa_fc_bias))); with original_lm_head ONE lm_head of truncated_vocab_size rows for every head, loaded from
    lm_heads.0.weight; else lm_heads.{h} of truncated_vocab_size rows (0.11) or vocab_size rows (0.32); token_map
    read only when truncated_vocab_size < vocab_size; an lm weight with more rows than token_map is sliced to its
    rows; ParallelLMHead's weight_loader asserts the rows; weights by name after stripping "medusa_heads."; the
    logits cut to truncated_vocab_size and scattered into token_map (-inf elsewhere). -> (heads, lms, token_map)."""
    K, n, Vfull, Vt = cfg["num_heads"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["truncated_vocab_size"]
    one = cfg.get("original_lm_head", False)
    rows = Vt if one or version == "0.11" else Vfull
    weights = {k.replace("medusa_heads.", ""): v for k, v in sd.items()}
    token_map = weights.pop("token_map") if Vt < Vfull else None
    assert Vt == Vfull or token_map is not None  # vLLM's own assert at the end of load_weights
    blocks = torch.nn.ModuleList(torch.nn.ModuleList(torch.nn.Linear(D, D, bias=cfg.get("medusa_fc_bias", False))
                                                     for _ in range(n)) for _ in range(K))
    for h in range(K):
        for l in range(n):
            for p in ("weight", "bias") if cfg.get("medusa_fc_bias", False) else ("weight",):
                getattr(blocks[h][l], p).data.copy_(weights[f"blocks.{h}.layers.{l}.{p}"])
    lms = []
    for h in range(1 if one else K):
        w = weights[f"lm_heads.{h}.weight"]
        if token_map is not None and w.shape[0] > token_map.shape[0]:
            w = w[token_map]
        assert w.shape[0] == rows, f"vLLM {version}: lm_heads.{h} has {w.shape[0]} rows, its lm_head {rows}"
        lms.append(w)
    return blocks, (lms * K if one else lms), token_map


@pytest.mark.parametrize("version", VLLM_MEDUSA)
@pytest.mark.parametrize("shared", [True, False], ids=["shared-draft-vocab", "per-head"])
def test_medusa_vllm_read_by_vllm(tiny, tmp_path, shared, version):
    """vLLM Medusa (above; MedusaConfig @4bb77b32 and in 0.32, vllm/transformers_utils/configs/medusa.py:
    from_pretrained renames every key holding "num" and "heads" to num_heads and "num" and "layers" to
    num_hidden_layers, so no other such key may appear) computes our logits from our files, a shared head over a
    draft vocabulary and per-head projections over the full one, in both layouts it had."""
    spec = (HeadSpec(kind="medusa", num_heads=2, draft_vocab_size=40) if shared else
            HeadSpec(kind="medusa", num_heads=3, num_layers=2, medusa_lm_head="per_head"))
    head = _trained(spec, tiny, tmp_path)
    export_head(tmp_path / "h", "medusa-vllm", tmp_path / "mv", target=tiny)
    cfg, sd = _exported(tmp_path / "mv")
    assert [k for k in cfg if "num" in k and ("heads" in k or "layers" in k)] == ["num_heads", "num_hidden_layers"]
    assert cfg["architectures"] == ["MedusaModel"] and cfg["model_type"] == "medusa"
    blocks, lms, token_map = _vllm_medusa(cfg, sd, version)
    h = torch.randn(1, 5, D)
    with torch.no_grad():
        ours = head(h)
        for k in range(cfg["num_heads"]):
            x = h
            for lin in blocks[k]:
                x = x + torch.nn.functional.silu(lin(x))
            theirs = (x @ lms[k].T)[..., :cfg["truncated_vocab_size"]]
            want = ours[k]
            if token_map is not None:
                full = torch.full((1, 5, V), float("-inf"))
                full[..., token_map] = theirs
                mine = torch.full((1, 5, V), float("-inf"))
                mine[..., head.d2t] = ours[k]
                theirs, want = full, mine
            torch.testing.assert_close(theirs, want)


def test_speculators_config_fields(tiny, tmp_path):
    """speculators' Eagle3SpeculatorConfig fields (.venv-speculators, speculators/models/eagle3/config.py) and what
    vLLM's speculators path takes from them (vllm@cfb173ab, vllm/transformers_utils/configs/speculators/algos.py
    update_eagle3: draft_vocab_size, target_hidden_size if not None, norm_before_residual with default TRUE, so ours
    is written false; eagle_aux_hidden_state_layer_ids as given, our convention). embed_tokens.weight is the
    target's, in the head's dtype: speculators' _load_verifier_weights (model.py) fills the draft's embedding from the
    verifier only where it is NaN, and after from_pretrained a tensor the file lacks is not; without --target the
    export is refused in one line."""
    from specheads.target import tiny_target

    _trained(HeadSpec(kind="eagle3", draft_vocab_size=100, feature_layers=[1, 2, 3]), tiny, tmp_path)
    with pytest.raises(SpecheadsError, match=r"--format speculators: .* needs --target .*embed_tokens.weight"):
        export_head(tmp_path / "h", "speculators", tmp_path / "s")
    with pytest.raises(SpecheadsError, match="head was trained for target 'tiny-llama-0' but the target given"):
        export_head(tmp_path / "h", "speculators", tmp_path / "s", target=tiny_target(seed=1))
    assert not (tmp_path / "s").exists()
    export_head(tmp_path / "h", "speculators", tmp_path / "s", verifier_name_or_path="org/verifier",
                speculative_tokens=5, target=tiny)
    cfg, sd = _exported(tmp_path / "s")
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["norm_before_residual"] is False and cfg["target_hidden_size"] is None and cfg["draft_vocab_size"] == 100
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5}]
    assert sc["verifier"]["name_or_path"] == "org/verifier" and sc["verifier"]["architectures"]
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.hidden_norm.weight"} <= set(sd)
    assert not any(k.startswith("midlayer.") for k in sd)
    assert torch.equal(sd["embed_tokens.weight"], tiny.embed_tokens.weight)


def test_verifier_is_named_in_every_export_and_the_bundled_target_said(tiny, tmp_path):
    """The verifier an export names: the head's target (our aliases as their hub id) or the one the user gives
    (--verifier, every format). A head trained on the bundled smollm2-135m, the Q4_1 GGUF dequantised, says so,
    unless --verifier is a local copy of that exact target (its embedding and lm_head give the head's fingerprint:
    the GGUF converted for the engine, as docs/exports.md advises)."""
    _trained(HeadSpec(kind="eagle3"), tiny, tmp_path)
    cpath = tmp_path / "h" / "config.json"
    export_head(tmp_path / "h", "eagle3", tmp_path / "own")
    own = _exported(tmp_path / "own")[0]["specheads"]
    assert own["verifier"] == "tiny-llama-0" and "verifier_note" not in own and own["format"] == "eagle3"
    c = json.loads(cpath.read_text())
    c["target_name"] = "smollm2-135m"
    cpath.write_text(json.dumps(c))
    tiny.model.save_pretrained(tmp_path / "exact")  # the head's very target, saved for an engine
    from specheads.target import tiny_target

    tiny_target(seed=1).model.save_pretrained(tmp_path / "other")  # a relative: same shapes, other weights
    for fmt in ("eagle3", "speculators"):
        export_head(tmp_path / "h", fmt, tmp_path / fmt, target=tiny)
        cfg = _exported(tmp_path / fmt)[0]
        assert cfg["specheads"]["verifier"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert "Q4_1 GGUF" in cfg["specheads"]["verifier_note"] and "dequantised" in cfg["specheads"]["verifier_note"]
        for verifier, noted in (("org/other-verifier", True), (tmp_path / "other", True), (tmp_path / "exact", False)):
            export_head(tmp_path / "h", fmt, tmp_path / f"{fmt}-x", verifier_name_or_path=str(verifier), target=tiny)
            cfg = _exported(tmp_path / f"{fmt}-x")[0]
            assert cfg["specheads"]["verifier"] == str(verifier)
            assert ("verifier_note" in cfg["specheads"]) is noted, (fmt, verifier)
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "exact")


class _RepoResBlock(torch.nn.Module):
    """FasterDecoding/Medusa's ResBlock (medusa_model.py and medusa_model_legacy.py): x + SiLU(Linear(x))."""

    def __init__(self, d):
        super().__init__()
        self.linear = torch.nn.Linear(d, d)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def _repo_medusa_heads(K: int, n: int, legacy: bool) -> torch.nn.ModuleList:
    """The repo's `medusa_head`, random weights: `nn.Sequential(*([ResBlock(D)] * n), nn.Linear(D, V, bias=False))`
    per head (medusa_model.py), or the ResBlocks alone (medusa_model_legacy.py, which projects every head through
    `base_model.lm_head`). `[ResBlock(D)] * n` is ONE block repeated n times (tied)."""
    torch.manual_seed(11)
    heads = torch.nn.ModuleList(torch.nn.Sequential(*([_RepoResBlock(D)] * n),
                                                    *([] if legacy else [torch.nn.Linear(D, V, bias=False)]))
                                for _ in range(K))
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.05 * torch.randn_like(p))
    return heads


@pytest.mark.parametrize("legacy", [True, False], ids=["train_legacy", "medusa_model"])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("prefix", ["", "medusa_head."])
def test_import_fasterdecoding_medusa(tiny, tmp_path, prefix, n, legacy):
    """FasterDecoding/Medusa @ e2a5d20c048a9b0a4092e6933c34313687422518: medusa/train/train_legacy.py builds
    medusa/model/medusa_model_legacy.py's MedusaModel (heads = ResBlocks only, logits = base_model.lm_head(head(h)))
    and saves `medusa_head.state_dict()` as medusa_lm_head.safetensors: keys `{h}.{l}.linear.weight|bias`, nothing
    else, no prefix. medusa_model.py's heads end in their own `nn.Linear(D, V, bias=False)`: keys `{h}.{n}.weight`
    too. Older exports put `medusa_head.` in front. The file below is the repo module's own state dict (the tied
    repeats cloned: safetensors refuses tensors sharing memory); the imported head must compute what the repo's
    module computes, and unties the repeats."""
    K = 2
    heads = _repo_medusa_heads(K, n, legacy)
    src = tmp_path / "repo"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"medusa_num_heads": K, "medusa_num_layers": n, "version": "2",
                                                 "base_model_name_or_path": "x"}))
    sd = {prefix + k: v.clone() for k, v in heads.state_dict().items()}
    assert any(k.endswith(f".{n}.weight") for k in sd) is not legacy
    save_file(sd, str(src / "medusa_lm_head.safetensors"))
    head = import_head(src, tiny)
    assert head.spec.options.num_heads == K and head.spec.num_layers == n and head.spec.resolved_bias()
    assert head.spec.options.lm_head == ("shared" if legacy else "per_head")
    if n > 1:
        assert head.blocks[0].layers[0].weight.data_ptr() != head.blocks[0].layers[1].weight.data_ptr()
    x = torch.randn(1, 3, D)
    with torch.no_grad():
        want = [tiny.lm_head(heads[k](x)) if legacy else heads[k](x) for k in range(K)]
        torch.testing.assert_close(head(x), torch.stack(want))
    if legacy:  # vLLM's layout wants a projection per head: the target's lm_head rows, given --target
        export_head(_saved(head, tmp_path / "native"), "medusa-vllm", tmp_path / "mv", target=tiny)
        assert torch.equal(load_file(str(tmp_path / "mv" / "model.safetensors"))["lm_heads.1.weight"],
                           tiny.lm_head.weight)
    sd[f"{prefix}0.0.extra.weight"] = torch.zeros(1)
    save_file(sd, str(src / "medusa_lm_head.safetensors"))
    with pytest.raises(SpecheadsError, match="unexpected key '(medusa_head.)?0.0.extra.weight'"):
        import_head(src, tiny)


def _saved(head, folder):
    head.save_pretrained(folder)
    return folder


def test_import_fasterdecoding_medusa_mixed_layouts_refused(tiny, tmp_path):
    """A vocab projection on some heads only is neither layout: one message, no guess."""
    heads = _repo_medusa_heads(2, 1, legacy=False)
    sd = {k: v.clone() for k, v in heads.state_dict().items() if k != "1.1.weight"}
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(SpecheadsError, match=r"heads \[0\] have a vocab projection \('\{h\}.1.weight'\)"):
        import_head(tmp_path, tiny)


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


@pytest.mark.parametrize("fmt", ["eagle", "eagle3"])
def test_import_of_an_eagle_repo_checkpoint_reads_its_rope_base(tiny_rope, tmp_path, fmt):
    """The EAGLE repo (SafeAILab/EAGLE cnets1.py / cnets.py _init_rope) builds its rotary embedding at
    config.rope_theta when present, else at 10,000 (its LLaMA-2 / Vicuna configs omit the key). Key = the target's
    base: imported as it is. Absent (10,000) or another value on a target at 100,000: refused in one line naming
    both and --rope-theta; `checkpoint` runs the head at its own base (the repo's logits), `target` rebuilds it at
    the target's (the old behaviour, now explicit), N at N; the base chosen is recorded and exported again."""
    spec = HeadSpec(kind="eagle") if fmt == "eagle" else HeadSpec(kind="eagle3", feature_layers=[1, 2, 3])
    head = _trained(spec, tiny_rope, tmp_path)
    export_head(tmp_path / "h", fmt, tmp_path / "repo")  # the repo's layout; rope_theta 100000 written
    _same_state(head, import_head(tmp_path / "repo", tiny_rope))
    cpath = tmp_path / "repo" / "config.json"
    cfg = json.loads(cpath.read_text())
    for k in ("rope_theta", "rope_parameters"):
        cfg.pop(k)
    cpath.write_text(json.dumps(cfg))
    with pytest.raises(SpecheadsError, match=r"config.json: RoPE base 10000 \(no rope_theta: the EAGLE repo's "
                                             r"default\) but target 'tiny-llama-0' runs RoPE at 100000; .*"
                                             r"--rope-theta checkpoint .*--rope-theta target") as e:
        import_head(tmp_path / "repo", tiny_rope)
    assert "\n" not in str(e.value)
    at_target = import_head(tmp_path / "repo", tiny_rope, rope_theta="target")
    _same_state(head, at_target)
    own = import_head(tmp_path / "repo", tiny_rope, rope_theta="checkpoint")
    _same_state(head, own)  # the same weights, run at another base
    assert own.layer_config.rope_parameters["rope_theta"] == 10000.0
    g = torch.Generator().manual_seed(7)
    F = len(head.config.feature_layers)
    feats, toks = torch.randn(1, 9, F * D, generator=g), torch.randint(0, V, (1, 9), generator=g)
    with torch.no_grad():
        mine, theirs = (head(feats, toks)[1], own(feats, toks)[1]) if fmt == "eagle" else \
            (head(feats, toks, steps=1)[0], own(feats, toks, steps=1)[0])
        assert (mine - theirs).abs().max() > 1e-3  # the base matters at these positions
        if fmt == "eagle":  # the repo's own reading of the folder at 10,000: our imported head's logits
            reader, rotary = _eagle1_reader(cfg, fc_bias=cfg.get("bias", True), attention_bias=False,
                                            rope_theta=cfg.get("rope_theta", 10000))
            _load_reader(reader, load_file(str(tmp_path / "repo" / "model.safetensors")), unexpected="ignored")
            torch.testing.assert_close(_eagle1_logits(reader, rotary, tiny_rope, feats, toks), theirs)
    own.save_pretrained(tmp_path / "own")  # recorded: loads and exports at 10,000
    assert load_head(tmp_path / "own", tiny_rope).layer_config.rope_parameters["rope_theta"] == 10000.0
    export_head(tmp_path / "own", fmt, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["rope_theta"] == 10000.0
    assert import_head(tmp_path / "repo", tiny_rope, rope_theta=5e5).layer_config.rope_parameters["rope_theta"] == 5e5
    cfg["rope_theta"] = 10000.0  # the key present with another base than the target's: refused too
    cpath.write_text(json.dumps(cfg))
    with pytest.raises(SpecheadsError, match=r"RoPE base 10000 \(rope_theta\) but target"):
        import_head(tmp_path / "repo", tiny_rope)


def test_cli_rope_theta_flag(tiny_rope, tmp_path, capsys, monkeypatch):
    from specheads import cli

    _trained(HeadSpec(kind="eagle"), tiny_rope, tmp_path)
    export_head(tmp_path / "h", "eagle", tmp_path / "repo")
    cfg = json.loads((tmp_path / "repo" / "config.json").read_text())
    del cfg["rope_theta"], cfg["rope_parameters"]
    (tmp_path / "repo" / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr("specheads.target.load_target", lambda name, dtype="float32", **kw: tiny_rope)
    imp = ["export", "--import", str(tmp_path / "repo"), "--target", "t", "--out"]
    assert cli.main([*imp, str(tmp_path / "a")]) == 2 and "--rope-theta checkpoint" in capsys.readouterr().err
    assert cli.main([*imp, str(tmp_path / "a"), "--rope-theta", "ten"]) == 2
    assert "--rope-theta 'ten': one of ['checkpoint', 'target'] or a positive RoPE base" in capsys.readouterr().err
    assert cli.main(["export", "--head", str(tmp_path / "h"), "--format", "eagle", "--out", str(tmp_path / "b"),
                     "--rope-theta", "target"]) == 2
    assert "--rope-theta: only with --import" in capsys.readouterr().err
    assert cli.main([*imp, str(tmp_path / "a"), "--rope-theta", "checkpoint"]) == 0
    assert load_head(tmp_path / "a", tiny_rope).layer_config.rope_parameters["rope_theta"] == 10000.0


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
    assert cli.main(["export", "--head", str(tmp_path / "h"), "--format", "eagle3", "--out", str(tmp_path / "o"),
                     "--verifier", "org/v"]) == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["specheads"]["verifier"] == "org/v"
    assert cli.main(["export", "--head", str(tmp_path / "h"), "--format", "medusa-vllm", "--out",
                     str(tmp_path / "z")]) == 2
    assert "needs a medusa head" in capsys.readouterr().err
    _trained(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3], bias=True), tiny, tmp_path, "b")
    assert cli.main(["export", "--head", str(tmp_path / "b"), "--format", "eagle3", "--out", str(tmp_path / "z")]) == 2
    assert "(vllm): its fc has no bias" in capsys.readouterr().err
    assert cli.main(["export", "--head", str(tmp_path / "b"), "--format", "eagle3", "--out", str(tmp_path / "z"),
                     "--consumer", "sglang"]) == 0
    loaded = []
    monkeypatch.setattr("specheads.target.load_target", lambda name, dtype="float32", **kw: loaded.append(name) or tiny)
    # speculators writes the target's embedding: without --target the head's recorded target is loaded
    assert cli.main(["export", "--head", str(tmp_path / "h"), "--format", "speculators", "--out",
                     str(tmp_path / "sp")]) == 0
    assert loaded == ["tiny-llama-0"] and "embed_tokens.weight" in _exported(tmp_path / "sp")[1]
    assert cli.main(["export", "--import", str(tmp_path / "o"), "--target", "tiny", "--out", str(tmp_path / "n")]) == 0
    _same_state(load_head(tmp_path / "h", tiny), load_head(tmp_path / "n", tiny))
    assert cli.main(["export", "--import", str(tmp_path / "o"), "--out", str(tmp_path / "n2")]) == 2


def _permuted_features(ids, g, T):
    """Random per-layer states; (ours in config order, theirs ascending as the engines concatenate them)."""
    blocks = {i: torch.randn(1, T, D, generator=g) for i in ids}
    return torch.cat([blocks[i] for i in ids], -1), torch.cat([blocks[i] for i in sorted(ids)], -1)


@pytest.mark.skipif(not SPEC_PY.exists(), reason="no .venv-speculators (run scripts/setup_speculators_venv.sh)")
@pytest.mark.parametrize("layers,L,draft_vocab,vocab", [([1, 2, 3], 4, 100, V), ([6, 1, 3], 8, None, 16384)],
                         ids=["default-layers", "non-default-unsorted"])
def test_speculators_package_loads_and_runs_our_export(tmp_path, layers, L, draft_vocab, vocab):
    """The real consumer: speculators' own config and model classes load the export as shipped (every weight equal,
    the token embedding the verifier's: nothing filled in by hand), and its own EAGLE-3 TTT forward, fed the aux states in ascending layer order as vLLM captures them, gives our per-step logits
    (same layer semantics, mask, positions up to a RoPE-invariant shift, d2t/t2d buffers, fc block order). The
    second case has a 16384-token vocabulary: an embedding that size which the file lacked would come out of
    from_pretrained as zeros (fresh pages), as issue 38 saw with SmolLM2, not as the NaN speculators fills."""
    from specheads.target import tiny_target

    target = tiny_target(num_layers=L, vocab_size=vocab, rope_parameters=dict(ROPE))
    target.model.save_pretrained(tmp_path / "verifier")  # speculators reads the verifier config and its embedding
    head = _trained(HeadSpec(kind="eagle3", draft_vocab_size=draft_vocab, feature_layers=layers), target, tmp_path)
    export_head(tmp_path / "h", "speculators", tmp_path / "s", verifier_name_or_path=str(tmp_path / "verifier"),
                target=target)
    g = torch.Generator().manual_seed(5)
    ours, theirs = _permuted_features(layers, g, 12)
    toks = torch.randint(0, V, (1, 12), generator=g)
    with torch.no_grad():
        logits = head(ours, toks, steps=3)
    out = run_speculators_load(tmp_path / "s", theirs, toks, logits, tmp_path)
    diffs = out.pop("max_abs_diff")
    assert out == {"ok": True, "embed_is_verifier": True,
                   "checked": len(load_file(str(tmp_path / "s" / "model.safetensors"))),
                   "draft_vocab_size": draft_vocab or vocab, "aux_ids": sorted(layers), "class": "Eagle3DraftModel",
                   "verifier": str(tmp_path / "verifier"), "steps": 3}
    assert max(diffs) < 1e-4, diffs


def run_speculators_load(export_dir: Path, features, tokens, logits, tmp_path: Path) -> dict:
    """Run tests/fixtures/speculators_load.py in .venv-speculators on an export and our inputs / per-step logits
    (offline, its own environment); its JSON report."""
    (tmp_path / "ref").mkdir()
    save_file({"features": features, "tokens": tokens, **{f"logits_{i}": lg for i, lg in enumerate(logits)}},
              str(tmp_path / "ref" / "inputs.safetensors"))
    return run_fixture(SPEC_PY, "speculators_load.py", export_dir, tmp_path / "ref")
