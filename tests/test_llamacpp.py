"""GGUF export through llama.cpp's pinned converter and llama.cpp as a bench engine.

The converter and server tests need the tools `make llamacpp` builds (skipped with that reason otherwise). They use a
tiny random Llama with the bundled SmolLM2's tokenizer (the converter reads the target's tokenizer and vocab) and a
tiny random EAGLE-3 head, converted in fp32 so that llama.cpp's batched verification and its one-token decoding
cannot disagree on a near tie: speculative greedy output must equal plain greedy output token for token.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from specheads.heads import HeadSpec, build_head
from specheads.heads.base import read_head_config, read_safetensors
from specheads.heads.eagle3_gguf import converter_config as _eagle3_converter_config
from specheads.heads.gguf import DRAFT_KINDS, _dspark_converter_config, find_tools, gguf_metadata, llamacpp_root
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


def test_dspark_converter_config_sets_every_key_the_converter_reads(tiny):
    head = build_head(HeadSpec(kind="dspark", feature_layers=[3, 1, 2], block_size=5, markov_rank=8,
                               draft_vocab_size=100, sample_from_anchor=False), tiny, token_counts=torch.arange(256))
    config = _dspark_converter_config(head.config, {"architectures": ["DSparkSpeculator"], "block_size": 16})
    # conversion/qwen.py: DSparkModel registers DSparkSpeculator; block_size defaults to 16 and sample_from_anchor to
    # true without transformer_layer_config; aux ids are hidden_states ids (stored - 1, written + 1)
    assert config["architectures"] == ["DSparkSpeculator"] and config["block_size"] == 5
    assert config["sample_from_anchor"] is False and config["mask_token_id"] == head.spec.mask_token_id
    assert config["aux_hidden_state_layer_ids"] == [3, 1, 2] and config["draft_vocab_size"] == 100
    assert config["dflash_config"] == {"block_size": 5, "mask_token_id": head.spec.mask_token_id,
                                       "target_layer_ids": [2, 0, 1], "causal": False}
    dflash = build_head(HeadSpec(kind="dspark", feature_layers=[1, 2, 3], markov_rank=0, confidence_head=False,
                                 sample_from_anchor=False), tiny)
    assert _dspark_converter_config(dflash.config, {"architectures": ["DFlashSpeculator"]})["architectures"] == \
        ["DSparkSpeculator"]  # the converter registers no DFlashSpeculator; without Markov tensors it is DFlash


@pytest.mark.parametrize("spec,msg", [
    (dict(markov_head_type="gated"), "vanilla one only"),
    (dict(markov_head_type="rnn"), "vanilla one only"),
    (dict(confidence_with_markov=False), r"reads \[h_k ; W1\[x_prev\]\]"),
    (dict(feature_layers=[1, 2, 4]), "pre-norm"),  # layer L: llama.cpp's is pre-norm
    (dict(anchor_features=True), "head.dspark.anchor_features"),
])
def test_dspark_heads_llamacpp_cannot_run_are_refused(tiny, tmp_path, spec, msg):
    spec = {"kind": "dspark", "feature_layers": [1, 2, 3], "block_size": 3, "markov_rank": 8, **spec}
    build_head(HeadSpec(**spec), tiny).save_pretrained(tmp_path / "h")
    with pytest.raises(SpecheadsError, match=rf"--format gguf: .*llama.cpp's DSpark draft.* cannot run this head"
                                             rf".*{msg}"):
        DRAFT_KINDS["dspark"].check_head(read_head_config(tmp_path / "h"), tmp_path / "h")


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
    from specheads.infer.bench.llamacpp import record_from_reply

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
    from specheads.infer.bench.llamacpp import build_llamacpp_method

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


# ----------------------------------------------------------------------------------------------- DSpark drafts
K_BLOCK = 4  # slots per block of the DSpark test heads
TIE = 0.02  # a top-2 logit margin below this is a near tie: fp32 llama.cpp and torch may pick either token


def _dspark_head(root: Path, target, name: str, counts=None, **kw):
    """A random DSpark head (block of 4) reading layers 1, 2, 3, perturbed away from its init, saved at root/name."""
    torch.manual_seed(1)
    head = build_head(HeadSpec(kind="dspark", feature_layers=FEATURES, block_size=K_BLOCK, **kw), target,
                      token_counts=counts)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    head.save_pretrained(root / name)
    return head, root / name


def _logged_blocks(log: str) -> list[list[int]]:
    """Each drafted block's tokens as llama-server logs them at -lv 5 (common/speculative.cpp:1283-1287: candidate 0
    of every slot read, slot index `pos`); a block starts where the slot index stops rising."""
    blocks, last = [], None
    for m in re.finditer(r"draft candidate +0, pos +(\d+): +(\d+)", log):
        i, tok = int(m[1]), int(m[2])
        if last is None or i <= last:
            blocks.append([])
        blocks[-1].append(tok)
        last = i
    return blocks


def _our_blocks(head, target, seq: list[int], start: int, third=None) -> dict:
    """Our draft_block at every anchor a >= start of seq (context seq[:a], the target's own features) ->
    {a: (draft tokens, top-2 logit margins, confidences or None)}; third(logits, confidences) replaces the last."""
    with torch.no_grad():
        hs = target.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    f = torch.cat([hs[i] for i in FEATURES], -1)[0]
    out = {}
    for a in range(start, len(seq)):
        cache = head.new_cache()
        head.extend_context(cache, f[:a])
        logits, conf = head.draft_block(cache, seq[a])
        top = logits.topk(2, -1).values
        out[a] = (head.to_target_ids(logits.argmax(-1)).tolist(), (top[:, 0] - top[:, 1]).tolist(),
                  third(logits, conf) if third else None if conf is None else conf.tolist())
    return out


def _walk(ours: dict, seq: list[int], start: int, n_predict: int, p_min: float, blocks=None):
    """llama-server's steps replayed: the prefill emits seq[start]; each step drafts a block at the last token
    (cut at the first confidence below p_min, then truncated to the n_predict budget: n_remaining - 1,
    tools/server/server-context.cpp:463-466), the target accepts the drafts that match and adds one token.
    blocks: the logged blocks (None: our own tokens stand in) -> yields (anchor, our cut, the block drafted, drafts
    sent to the target, drafts accepted)."""
    a, n_out = start, 1
    while n_out < n_predict:
        toks, _, conf = ours[a]
        cut = next((j for j, c in enumerate(conf) if c < p_min), len(toks)) if p_min else len(toks)
        got = []
        if n_predict - n_out - 1 > 0 and cut > 0:
            got = blocks.pop(0) if blocks is not None else toks[:cut]
        d = got[:n_predict - n_out - 1]
        acc = 0
        while acc < len(d) and d[acc] == seq[a + 1 + acc]:
            acc += 1
        if got:
            yield a, cut, got, len(d), acc
        a, n_out = a + acc + 1, n_out + acc + 1


def _tie(margins: list[float]) -> int:
    """The first slot whose top-2 logit margin is a near tie (len(margins): none)."""
    return next((j for j, m in enumerate(margins) if m < TIE), len(margins))


def _cut_threshold(ours: dict, seq: list[int], start: int, n_predict: int) -> float:
    """A p-min in the widest gap between confidences (none lies within half of it) for which the steps the server
    will take draft at least 12 tokens before a near tie and at least one block that the confidence cuts after one
    or more slots: the comparison has material and the cut is exercised."""
    v = sorted({c for _, _, cs in ours.values() for c in cs})
    for j in sorted(range(len(v) - 1), key=lambda j: v[j] - v[j + 1]):
        p_min, compared, cut_short = (v[j] + v[j + 1]) / 2, 0, 0
        for a, cut, *_ in _walk(ours, seq, start, n_predict, p_min):
            tie = _tie(ours[a][1])
            compared, cut_short = compared + min(tie, cut), cut_short + (cut < len(ours[a][0]) and cut <= tie)
        if compared >= 12 and cut_short:
            return p_min
    raise AssertionError("no p-min both drafts and cuts a drafted block short")


def _replay(ours: dict, blocks: list, seq: list[int], start: int, n_predict: int, p_min: float):
    """Every logged block checked against ours along the server's steps (tokens up to the first near tie; its
    length = our cut) -> (drafted, accepted, tokens compared, blocks cut short by the confidence)."""
    drafted = accepted = compared = cut_short = 0
    blocks = list(blocks)
    for a, cut, got, n_d, n_acc in _walk(ours, seq, start, n_predict, p_min, blocks):
        drafted, accepted = drafted + n_d, accepted + n_acc
        toks, margins, conf = ours[a]
        tie = _tie(margins)
        assert got[:min(tie, cut)] == toks[:min(tie, cut)], (a, got, toks)
        assert cut > tie or len(got) == cut, (a, got, conf)  # confidences past a tie read another token
        compared += min(tie, cut)
        cut_short += cut < len(toks) and cut <= tie
    assert not blocks, f"{len(blocks)} logged blocks left over"
    return drafted, accepted, compared, cut_short


@pytest.fixture(scope="module")
def dspark_heads(tiny_smol):
    """On the peaked random target: a DSpark head (vanilla Markov, confidence, 2,048-token draft vocab, 2 layers)
    and a DFlash one (no Markov / confidence head, the anchor slot not drafting, the target's full vocabulary)."""
    folder, target, _ = tiny_smol
    return {"dspark": _dspark_head(folder.parent, target, "dspark", counts=torch.randint(0, 1000, (V,)),
                                   markov_rank=16, draft_vocab_size=DRAFT_V, num_layers=2),
            "dflash": _dspark_head(folder.parent, target, "dflash", markov_rank=0, confidence_head=False,
                                   sample_from_anchor=False)}


@needs_tools
def test_dspark_export_gguf_cli_reads_back_every_convention(tiny_smol, dspark_heads, tmp_path):
    import json

    from specheads.cli import main

    head, head_dir = dspark_heads["dspark"]
    out = tmp_path / "gguf"
    assert main(["export", "--head", str(head_dir), "--format", "gguf", "--out", str(out), "--gguf-type", "f32"]) == 0
    meta, tensors = gguf_metadata(out / "draft.gguf")
    assert meta["general.architecture"] == "dflash" and meta["dflash.target_layers"] == FEATURES
    assert meta["dflash.block_size"] == K_BLOCK and meta["dflash.sample_from_anchor"] is True
    assert meta["dflash.has_confidence_head"] is True and meta["dflash.block_count"] == 2
    assert meta["tokenizer.ggml.mask_token_id"] == head.spec.mask_token_id
    assert tuple(tensors["markov_w1.weight"].shape) == (16, V)  # ggml order: [rank, vocab] = torch [V, r]
    d2t = torch.as_tensor(tensors["d2t"].data.copy()).long()
    assert torch.equal(d2t, head.d2t)  # absolute ids: the converter added arange to our offsets
    manifest = json.loads((out / "gguf_export.json").read_text())
    assert manifest["llama_server"].endswith("--spec-type draft-dspark --spec-draft-n-max 4")
    assert manifest["conf_temperature_not_in_gguf"] == [1.0] * K_BLOCK


def _ggufs_and_plain_reply(folder, target, head_dir, n_predict: int = 20):
    """The target folder and the head converted to GGUF (f32), the prompt's ids and llama.cpp's plain greedy reply of
    n_predict tokens -> (target gguf, draft gguf, ids, reply tokens): what a block drafter's comparison starts from."""
    from specheads.heads.gguf import draft_gguf, target_gguf
    from specheads.infer.bench.llamacpp import LlamaServer

    model = target_gguf(str(folder), "f32")
    draft = draft_gguf(head_dir, target=str(folder), outtype="f32")
    ids = target.tokenizer("The capital of France is")["input_ids"]
    with LlamaServer(model) as plain:
        want = plain.complete(ids, n_predict)["tokens"]
    return model, draft, ids, want


@needs_tools
@pytest.mark.parametrize("which", ["dspark", "dflash"])
def test_dspark_llamacpp_drafts_are_our_drafts_and_greedy_equals_plain(tiny_smol, dspark_heads, which):
    """llama.cpp's draft-dspark with our converted head: greedy output equals llama.cpp plain, and every block it
    drafted (read from its debug log) holds our draft_block's tokens for the same context and anchor (up to a near
    tie), cut where our confidence first falls below --spec-draft-p-min; its draft counters add up."""
    from specheads.infer.bench.llamacpp import LlamaServer

    folder, target, _ = tiny_smol
    head, head_dir = dspark_heads[which]
    n_predict = 20
    model, draft, ids, want = _ggufs_and_plain_reply(folder, target, head_dir, n_predict)
    seq = ids + want
    ours = _our_blocks(head, target, seq, len(ids))
    p_min = _cut_threshold(ours, seq, len(ids), n_predict) if head.spec.options.confidence_head else 0.0
    log_file = folder.parent / f"{which}-server.log"
    args = ("--spec-type", "draft-dspark", "--spec-draft-n-max", str(head.num_drafts),
            "--spec-draft-p-min", f"{p_min:.6f}", "-lv", "5")
    with LlamaServer(model, draft, args, log_file=log_file) as spec:
        reply = spec.complete(ids, n_predict)
    assert reply["tokens"] == want  # lossless: greedy speculative = greedy plain
    blocks = _logged_blocks(log_file.read_text(errors="replace"))
    drafted, accepted, compared, cut_short = _replay(ours, blocks, seq, len(ids), n_predict, p_min)
    assert (drafted, accepted) == (reply["timings"]["draft_n"], reply["timings"]["draft_n_accepted"])
    assert compared >= 0.8 * sum(len(b) for b in blocks) and compared >= 10
    if p_min:  # the confidence cut was exercised: a block the server drafted was cut where ours is
        assert cut_short > 0


def test_p_min_choice_obvious_answers():
    """The --spec-draft-p-min chooser on hand-made blocks: everything accepted on a flat verify curve -> send every
    slot (p 0, τ 1 + K); nothing accepted on a rising curve -> send nothing; confident blocks accepted and
    unconfident ones rejected -> a cut between the two confidences (here 0.5: 4 tokens for cost 3 = 1.33x)."""
    from specheads.infer.bench.llamacpp.pmin import Block, choose_p_min, cut, expected

    flat, rising = {1: 1.0, 2: 1.0, 3: 1.0}, {1: 1.0, 2: 1.5, 3: 2.0}
    assert cut([0.9, 0.4, 0.8], 0.5) == 1 and cut([0.9, 0.8], 0.5) == 2 and cut([0.3], 0.5) == 0
    c = choose_p_min([Block([0.6, 0.7], 2), Block([0.8, 0.2], 2)], flat, 0.0)
    assert c.p_min == 0.0 and c.expected_tau == 3.0 and c.expected_speedup == 3.0
    c = choose_p_min([Block([0.6, 0.7], 0), Block([0.8, 0.2], 0)], rising, 0.0)
    assert c.p_min > 0.8 and c.expected_tau == 1.0 and c.expected_speedup == 1.0
    blocks = [Block([0.9, 0.9], 2), Block([0.1, 0.1], 0)]
    c = choose_p_min(blocks, rising, 0.0)
    assert c.p_min == pytest.approx(0.5) and c.expected_speedup == pytest.approx(4 / 3)
    assert expected(blocks, 0.0, rising, 0.0) == (2.0, 1.0)  # every slot: 4 tokens for cost 2 + 2
    assert expected(blocks, 0.5, rising, 0.25)[1] == pytest.approx(4 / 3.5)  # the draft's cost paid every step
    with pytest.raises(SpecheadsError, match="no calibration blocks"):
        choose_p_min([], flat, 0.0)


def test_verify_curve_takes_each_size_at_its_fastest_repetition(tmp_path):
    """llama-bench's mean lets one disturbed repetition price a size: the curve takes each size's fastest sample
    (a stand-in llama-bench printing llama-bench's JSON rows, one of them with a 150x outlier)."""
    import json
    import stat

    from specheads.infer.bench.llamacpp.pmin import verify_curve

    rows = [{"n_prompt": 0, "avg_ns": 1}, {"n_prompt": 1, "avg_ns": 1000, "samples_ns": [1000, 1000, 1000]},
            {"n_prompt": 2, "avg_ns": 1100, "samples_ns": [1100, 1100, 1100]},
            {"n_prompt": 3, "avg_ns": 51000, "samples_ns": [1200, 150000, 1800]},
            {"n_prompt": 4, "avg_ns": 1300}]  # an older llama-bench without samples: its mean
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(rows)}\nEOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert verify_curve(fake, tmp_path / "m.gguf", 4, 1) == pytest.approx({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3})


@needs_tools
def test_dspark_every_draft_accepted_gives_the_obvious_counts(repeat_smol):
    """The repeat target and a DSpark head whose one-token draft vocabulary is REPEAT: 25 tokens = the prefill's 1
    + 4 steps of 4 accepted drafts + 1 bonus + a last step of 3 (the budget leaves n_remaining - 1), so 6 target
    forwards, 19 drafted, 19 accepted: every slot of the block drafts (sample_from_anchor)."""
    from specheads.infer.bench import MethodOptions, head_entries
    from specheads.infer.bench.llamacpp import build_llamacpp_method

    folder, target, _ = repeat_smol
    _, head_dir = _dspark_head(folder.parent, target, "repeat-dspark", markov_rank=8, draft_vocab_size=1,
                               counts=torch.nn.functional.one_hot(torch.tensor(REPEAT), V))
    options = MethodOptions(heads=head_entries([f"r={head_dir}"]), llamacpp_draft_max=K_BLOCK)
    calib = [target.tokenizer("Hi, who are you?")["input_ids"]]
    plain, spec = (build_llamacpp_method(n, target, options, calib) for n in ("llama.cpp", "llama.cpp:r"))
    try:
        ids = target.tokenizer("Hello there, how are you?")["input_ids"]
        a, b = plain.generate(ids, 25), spec.generate(ids, 25)
        assert a.output_ids == [REPEAT] * 25 and b.output_ids == a.output_ids
        assert (a.target_forwards, b.target_forwards) == (25, 6)
        assert (spec.drafted, spec.accepted) == (19, 19)
        assert spec.info["server_args"][:2] == ["--spec-type", "draft-dspark"]
        # p-min chosen on the calibration prompt: every draft is accepted there, so every slot is sent
        choice = spec.info["p_min_choice"]
        assert choice["expected_tau"] == 1 + K_BLOCK and choice["blocks"] > 0
        assert choice["p_min"] == 0.0
        assert set(choice["verify_relative"]) == set(range(1, K_BLOCK + 2))
    finally:
        plain.server.stop()
        spec.server.stop()
