"""GGUF export through llama.cpp's pinned converter and llama.cpp as a bench engine.

The converter and server tests need the tools `make llamacpp` builds (skipped with that reason otherwise). They use a
tiny random Llama with the bundled SmolLM2's tokenizer (the converter reads the target's tokenizer and vocab) and a
tiny random EAGLE-3 head, converted in fp32 so that llama.cpp's batched verification and its one-token decoding
cannot disagree on a near tie: speculative greedy output must equal plain greedy output token for token.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from specheads.heads import HeadSpec, build_head
from specheads.heads.base import read_head_config, read_safetensors
from specheads.heads.gguf import (DRAFT_KINDS, _eagle3_converter_config, find_tools, gguf_metadata, llamacpp_root)
from specheads.utils import SpecheadsError

V, D, L = 49152, 64, 4  # SmolLM2's vocabulary (its tokenizer), a tiny body
DRAFT_V = 2048
FEATURES = [1, 2, 3]


def _tools_built() -> bool:
    try:
        find_tools("llama-server", converter=True)
        return True
    except SpecheadsError:
        return False


needs_tools = pytest.mark.skipif(not _tools_built(), reason=f"llama.cpp tools not built in {llamacpp_root()}: "
                                                            "run `make llamacpp`")


REPEAT = 1000  # the token the "repeat" target always emits (an ordinary SmolLM2 token, not end-of-generation)


def _smol_tokenizer_folder(folder: Path) -> None:
    from specheads.target import resolve_target_path

    smol = Path(resolve_target_path("smollm2-135m"))
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smol / name).exists():
            shutil.copy(smol / name, folder / name)


def _tiny_llama(repeat: bool):
    """A 4-layer random Llama (hidden 64) over SmolLM2's vocabulary. repeat=False: peaked logits (std ~3), greedy
    choices far from ties. repeat=True: layers silenced (o_proj, down_proj zero), every embedding row carries 5.0 in
    dimension 0 and lm_head row REPEAT reads only that dimension, so the greedy answer is REPEAT after any prompt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_theta=50000.0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        if not repeat:
            model.lm_head.weight.mul_(20.0)
        else:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.model.embed_tokens.weight[:, 0] = 5.0
            model.lm_head.weight[REPEAT] = 0.0
            model.lm_head.weight[REPEAT, 0] = 10.0  # logit ~80 against ~0.2 for every other token
    return model


@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory):
    """One $SPECHEADS_CACHE for the module's tests (each target is converted once)."""
    root = tmp_path_factory.mktemp("llamacpp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECHEADS_CACHE", str(root / "cache"))
        yield root


def _target_and_head(root: Path, repeat: bool, draft_vocab: int, counts: torch.Tensor):
    from specheads.target import load_target

    folder = root / ("repeat-target" if repeat else "target")
    _smol_tokenizer_folder(folder)
    _tiny_llama(repeat).save_pretrained(folder)
    target = load_target(str(folder), dtype="float32")
    head = build_head(HeadSpec(kind="eagle3", feature_layers=FEATURES, draft_vocab_size=draft_vocab), target,
                      token_counts=counts)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    head_dir = root / ("repeat-head" if repeat else "head")
    head.save_pretrained(head_dir)
    return folder, target, head_dir


@pytest.fixture(scope="module")
def tiny_smol(smol_cache):
    """(target folder, Target, head folder): the peaked random target and a random EAGLE-3 head with a 2,048-token
    draft vocabulary reading layers 1, 2, 3 (its drafts are almost always rejected)."""
    return _target_and_head(smol_cache, False, DRAFT_V, torch.randint(0, 1000, (V,)))


@pytest.fixture(scope="module")
def repeat_smol(smol_cache):
    """The repeat target and a head whose one-token draft vocabulary is REPEAT: every draft is accepted."""
    return _target_and_head(smol_cache, True, 1, torch.nn.functional.one_hot(torch.tensor(REPEAT), V))


# ----------------------------------------------------------------------------------------------- no tools needed
def test_converter_config_sets_every_key_the_converter_reads(tiny):
    head = build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3], draft_vocab_size=100), tiny,
                      token_counts=torch.arange(256))
    config = _eagle3_converter_config(head.config, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
                                                    "num_hidden_layers": 1})
    # conversion/llama.py reads the TOP-LEVEL key in the hidden-states convention (ours), not SGLang's minus-one ids
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["draft_vocab_size"] == 100 and config["num_hidden_layers"] == 1
    assert config["target_hidden_size"] == 64
    assert config["norm_before_residual"] is False and config["norm_before_fc"] is False
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]


@pytest.mark.parametrize("spec,msg", [
    (HeadSpec(kind="eagle3", feature_layers=[1, 2, 4]), "pre-norm"),  # layer L: llama.cpp's is pre-norm
    (HeadSpec(kind="eagle3", feature_layers=[1, 3]), "exactly 3"),
    (HeadSpec(kind="eagle3", feature_layers=[1, 2, 3], bias=True), "fc bias"),
])
def test_heads_llamacpp_cannot_run_are_refused(tiny, tmp_path, spec, msg):
    build_head(spec, tiny).save_pretrained(tmp_path / "h")
    with pytest.raises(SpecheadsError, match=msg):
        DRAFT_KINDS["eagle3"].check_head(read_head_config(tmp_path / "h"), tmp_path / "h")


def test_missing_tools_is_one_clear_error(tiny, tmp_path, monkeypatch):
    from specheads.heads.gguf import export_gguf

    build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), tiny).save_pretrained(tmp_path / "h")
    monkeypatch.setenv("SPECHEADS_LLAMACPP", str(tmp_path / "nowhere"))
    with pytest.raises(SpecheadsError, match="make llamacpp"):
        find_tools("llama-server", converter=True)
    with pytest.raises(SpecheadsError, match="make llamacpp"):
        export_gguf(tmp_path / "h", tmp_path / "out", target=str(tmp_path))
    assert not (tmp_path / "out").exists()


def test_non_eagle3_head_is_refused(tiny, tmp_path):
    from specheads.heads.gguf import export_gguf

    build_head(HeadSpec(kind="medusa", num_heads=2), tiny).save_pretrained(tmp_path / "m")
    with pytest.raises(SpecheadsError, match="medusa head"):
        export_gguf(tmp_path / "m", tmp_path / "out")


def test_reply_counting():
    """Target forwards = new tokens - accepted drafts (the prefill emits the first token)."""
    from specheads.infer.llamacpp import record_from_reply

    r = record_from_reply("llama.cpp:x", {"tokens": [5, 6, 7, 8, 9], "timings": {
        "predicted_n": 5, "draft_n": 6, "draft_n_accepted": 2}}, 10, 0.5, None)
    assert (r.new_tokens, r.target_forwards, r.step_tokens) == (5, 3, None)
    r = record_from_reply("llama.cpp", {"tokens": [5, 6, 7], "timings": {"predicted_n": 3}}, 10, 0.5, None)
    assert (r.target_forwards, r.step_tokens) == (3, [1, 1, 1])
    with pytest.raises(SpecheadsError, match="does not add up"):
        record_from_reply("llama.cpp", {"tokens": [5], "timings": {"predicted_n": 2}}, 10, 0.5, None)


# ----------------------------------------------------------------------------------------------- with the tools
@needs_tools
def test_export_gguf_cli_reads_back_every_convention(tiny_smol, tmp_path):
    from specheads.cli import main

    folder, target, head_dir = tiny_smol
    out = tmp_path / "gguf"
    assert main(["export", "--head", str(head_dir), "--format", "gguf", "--out", str(out), "--target-gguf",
                 "--gguf-type", "f32"]) == 0
    meta, tensors = gguf_metadata(out / "draft.gguf")  # export_gguf already checked; assert the facts here too
    assert meta["general.architecture"] == "eagle3"
    assert meta["eagle3.target_layers"] == FEATURES
    assert meta["eagle3.rope.freq_base"] == pytest.approx(50000.0)
    d2t = torch.as_tensor(tensors["d2t"].data.copy()).long()  # absolute ids: the converter added arange
    assert torch.equal(d2t, read_safetensors(head_dir / "model.safetensors")["d2t"].long())
    assert d2t.numel() == DRAFT_V
    tmeta, _ = gguf_metadata(out / "target.gguf")
    assert tmeta["general.architecture"] == "llama" and tmeta["llama.block_count"] == L
    assert tmeta["tokenizer.ggml.tokens"] == V


@needs_tools
def test_speculative_greedy_equals_plain_and_counters_add_up(tiny_smol):
    from specheads.infer.bench import MethodOptions, build_methods, head_entries

    folder, target, head_dir = tiny_smol
    options = MethodOptions(heads=head_entries([f"h={head_dir}"]), llamacpp_draft_max=3)
    methods, extra = build_methods(["llama.cpp", "llama.cpp:h", "llama.cpp-ngram"], target, options)
    procs = [m.server.proc for m in methods if hasattr(m, "server")]
    try:
        by_name = {m.name: m for m in methods}
        assert set(by_name) == {"vanilla", "llama.cpp", "llama.cpp:h", "llama.cpp-ngram"}
        tok = target.tokenizer
        for text in ("The capital of France is", "Write a haiku about the sea. The sea the sea the sea"):
            ids = tok(text)["input_ids"]
            plain = by_name["llama.cpp"].generate(ids, 24)
            spec = by_name["llama.cpp:h"].generate(ids, 24)
            ngram = by_name["llama.cpp-ngram"].generate(ids, 24)
            assert plain.new_tokens > 0 and plain.target_forwards == plain.new_tokens
            assert spec.output_ids == plain.output_ids  # lossless: greedy speculative = greedy plain
            assert ngram.output_ids == plain.output_ids
            assert 1 <= spec.target_forwards <= spec.new_tokens
        info = extra["methods_info"]["llama.cpp:h"]
        assert by_name["llama.cpp:h"].drafted > 0  # the draft was used (3 per step)
        assert info["draft_gguf"].endswith(".gguf") and info["server_args"][:2] == ["--spec-type", "draft-eagle3"]
    finally:
        for m in methods:
            if hasattr(m, "server"):
                m.server.stop()
    assert len(procs) == 3 and all(p.poll() is not None for p in procs)  # the servers exited


@needs_tools
def test_every_draft_accepted_gives_the_obvious_counts(repeat_smol):
    """The repeat target emits REPEAT forever and the head drafts only REPEAT: 25 tokens = the prefill's 1 + 6 steps
    of 3 accepted drafts + 1 bonus, so 7 target forwards, 18 drafted, 18 accepted, τ 25/7."""
    from specheads.infer.bench import MethodOptions, head_entries
    from specheads.infer.llamacpp import build_llamacpp_method

    folder, target, head_dir = repeat_smol
    options = MethodOptions(heads=head_entries([f"r={head_dir}"]), llamacpp_draft_max=3)
    plain, spec = (build_llamacpp_method(n, target, options) for n in ("llama.cpp", "llama.cpp:r"))
    try:
        ids = target.tokenizer("Hello there, how are you?")["input_ids"]
        a, b = plain.generate(ids, 25), spec.generate(ids, 25)
        assert a.output_ids == [REPEAT] * 25 and b.output_ids == a.output_ids
        assert (a.target_forwards, b.target_forwards) == (25, 7)
        assert (spec.drafted, spec.accepted) == (18, 18)
    finally:
        plain.server.stop()
        spec.server.stop()
