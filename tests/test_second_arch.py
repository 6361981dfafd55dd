"""Every head kind on a second architecture: a tiny random Gemma 3 target (sliding-window layers of window 8 and a
full-attention last layer, RoPE given per layer type). Each kind is built, trained a few steps through the real
trainer (its trainable parameters move, the target does not), generates in fp32 through our loop exactly what
plain greedy decoding writes (alone and beside a prompt-lookup chain, so accepted runs cross the window), and
each of its export formats is written and imported back bit-exact or refused with one clear message."""
from __future__ import annotations

import json

import pytest
import torch

from specheads.config import load_config
from specheads.heads.base import build_head, load_head
from specheads.heads.export import export_head, import_head
from specheads.infer.drafters import DSparkDrafter, EagleDrafter, MedusaDrafter, PEagleDrafter, combine_drafters
from specheads.infer.engine.generate import generate
from specheads.infer.scheduling.step import Scheduler
from specheads.target import full_attention_rope
from specheads.train.recipe import Recipe
from specheads.train.trainer import Trainer
from specheads.utils import SpecheadsError

pytestmark = pytest.mark.usefixtures("one_thread")  # small sequential forwards: one thread is faster

# kind -> the recipe's head.* overrides (tiny sizes; feature layers are each kind's default)
KINDS = {
    "medusa": ["head.kind=medusa", "head.num_heads=2"],
    "eagle": ["head.kind=eagle", "eval.eagle_steps=2"],
    "eagle3": ["head.kind=eagle3", "head.draft_vocab_size=64", "head.ttt_steps=2"],
    "dspark": ["head.kind=dspark", "head.block_size=4", "head.num_layers=1", "head.markov_rank=16",
               "train.block.max_anchors=8"],
    "dflash": ["head.kind=dspark", "head.block_size=4", "head.num_layers=1", "head.markov_rank=0",
               "head.confidence_head=false", "head.sample_from_anchor=false", "train.block.max_anchors=8"],
    "domino": ["head.kind=domino", "head.block_size=4", "head.num_layers=1", "head.markov_rank=0",
               "head.confidence_head=false", "head.domino_gru_hidden=16", "head.domino_emb_dim=8",
               "train.block.max_anchors=8", "train.block.weighting=dpace"],
    "peagle": ["head.kind=peagle", "head.num_layers=2", "head.num_depths=3", "head.draft_vocab_size=64"],
}
# kind -> (format, None = written and read back | a pattern of the refusal)
EXPORTS = {
    "medusa": [("native", None), ("medusa-vllm", None)],
    "eagle": [("native", None), ("eagle", "builds Llama decoder layers .*'gemma3_text' layer"),
              ("eagle-vllm", "builds Llama decoder layers .*'gemma3_text' layer")],
    "eagle3": [("native", None), ("eagle3", None), ("speculators", None)],
    "dspark": [("native", None), ("speculators", None), ("specforge", None)],
    "dflash": [("native", None), ("speculators", None), ("specforge", None)],
    "domino": [("native", None), ("speculators", "speculators 0.9.0 has no Domino"), ("specforge", None)],
    "peagle": [("native", None), ("speculators", None), ("eagle3", "needs a eagle3 head")],
}
FLAT = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4}  # a hand-made cost profile: nothing measured


def greedy_samples(target, n: int, T: int = 28, prompt: int = 6, seed: int = 0) -> list[dict]:
    """Sequences the target wrote itself (greedy), longer than the window, the answer part loss-masked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.vocab_size, (n, prompt), generator=g)
    with torch.no_grad():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=T - prompt,
                                    min_new_tokens=T - prompt, do_sample=False, pad_token_id=0)
    lm = torch.zeros(T, dtype=torch.long)
    lm[prompt:] = 1
    return [{"input_ids": row[:T], "loss_mask": lm.clone()} for row in out]


def plain_greedy(target, prompt: list[int], n: int) -> list[int]:
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def drafter_of(target, head):
    if head.kind == "medusa":
        return MedusaDrafter(head)
    if head.kind in ("dspark", "domino"):
        return DSparkDrafter(head, scheduler=Scheduler(FLAT, 1e-3))
    if head.kind == "peagle":
        return PEagleDrafter(head, scheduler=Scheduler(FLAT, 1e-3))
    return EagleDrafter(head, depth=3, top_k=2, total_tokens=6)


def train_kind(kind: str, run) -> dict:
    """One kind trained 3 steps on the target's own greedy text: target, head, its final/ folder, the result and
    the state before training."""
    from specheads.target import tiny_gemma3_target

    target = tiny_gemma3_target()
    data, val = greedy_samples(target, 8), greedy_samples(target, 4, seed=1)
    counts = sum(torch.bincount(d["input_ids"][d["loss_mask"].bool()], minlength=target.vocab_size) for d in data)
    recipe = load_config(Recipe, None, [
        f"output_dir={run}", "seed=0", "train.tracker=none", "train.batch_size=2", "train.lr=1e-2",
        "train.warmup_steps=1", "train.max_steps=3", "eval.every_steps=0", "eval.at_start=false",
        "eval.max_samples=4", "eval.batch_size=2", *KINDS[kind]])
    torch.manual_seed(0)
    head = build_head(recipe.head, target, token_counts=counts)
    before = {n: p.detach().clone() for n, p in head.named_parameters() if p.requires_grad}
    target_before = {k: v.clone() for k, v in target.model.state_dict().items()}
    res = Trainer(recipe, target, head, data, val).train()
    return dict(target=target, head=head, folder=run / "final", res=res, before=before, target_before=target_before)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """kind -> train_kind(kind), every kind trained once for the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module scope: set up before the one_thread fixture applies
    try:
        return {kind: train_kind(kind, tmp_path_factory.mktemp(kind)) for kind in KINDS}
    finally:
        torch.set_num_threads(threads)


def test_target_is_sliding_window_with_rope_per_layer_type(sliding):
    tc = sliding.text_config
    assert set(tc.layer_types) == {"sliding_attention", "full_attention"} and tc.sliding_window == 8
    assert set(tc.rope_parameters) == {"sliding_attention", "full_attention"}
    assert full_attention_rope(tc.rope_parameters) == {"rope_type": "default", "rope_theta": 1e6}
    flat = {"rope_type": "default", "rope_theta": 1e4}
    assert full_attention_rope(flat) == flat and full_attention_rope(None) is None


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_builds_with_the_full_attention_rope(sliding, kind):
    spec = load_config(Recipe, None, ["output_dir=/tmp/unused", *KINDS[kind]]).head
    head = build_head(spec, sliding, token_counts=torch.arange(256.0))
    cfg = getattr(head, "layer_config", None)
    if cfg is None:  # Medusa has no attention layer
        return
    theta = full_attention_rope(cfg.rope_parameters)["rope_theta"]
    assert theta == 1e6, (kind, cfg.rope_parameters)  # the draft attends the whole context: full-attention RoPE
    assert set(getattr(cfg, "layer_types", None) or ["full_attention"]) == {"full_attention"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_training_moves_the_head_not_the_target(trained, kind):
    t = trained[kind]
    head, target = t["head"], t["target"]
    assert t["res"].steps == 3 and t["res"].history
    after = dict(head.named_parameters())
    changed = [n for n, p in t["before"].items() if not torch.equal(p, after[n].detach())]
    assert changed, "trainable parameters did not change"
    assert all(torch.equal(v, target.model.state_dict()[k]) for k, v in t["target_before"].items()), "target changed"
    back = load_head(t["folder"], target)
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in back.state_dict().items())


@pytest.mark.parametrize("kind", list(KINDS))
def test_fp32_greedy_equals_plain_decoding(trained, kind):
    t = trained[kind]
    target, head = t["target"], t["head"]
    g = torch.Generator().manual_seed(7)
    base = torch.randint(3, target.vocab_size, (6,), generator=g).tolist()
    for prompt in (base * 3, base + torch.randint(3, target.vocab_size, (14,), generator=g).tolist()):
        ref = plain_greedy(target, prompt, 32)
        for name, d in (("head", drafter_of(target, head)),
                        ("head+lookup", combine_drafters(target, [drafter_of(target, head)], lookup=4,
                                                         lookup_ngram=2, scheduler=Scheduler(FLAT, 1e-3)))):
            r = generate(target, d, prompt, max_new_tokens=32)
            assert r.ids == ref, (kind, name)
            assert r.stats.new_tokens == len(ref) and sum(r.stats.accept_hist) == r.stats.target_forwards


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_export_round_trips_or_is_refused(trained, tmp_path, kind):
    t = trained[kind]
    target, folder = t["target"], t["folder"]
    native = load_head(folder, target).state_dict()
    for fmt, refusal in EXPORTS[kind]:
        out = tmp_path / fmt
        if refusal is not None:
            with pytest.raises(SpecheadsError, match=rf"--format {fmt}: .*{refusal}"):
                export_head(folder, fmt, out, target=target)
            assert not out.exists()
            continue
        export_head(folder, fmt, out, target=target)  # medusa-vllm writes the shared lm_head's rows per head
        back = import_head(out, target).state_dict()
        skip = ("conf_temperature", "conf_bias") if fmt != "native" else ()  # calibration stays native
        extra = set(back) - set(native)  # vLLM's Medusa has a projection per head: the shared lm_head's rows
        assert set(native) <= set(back) and all(k.startswith("lm_heads.") for k in extra), (fmt, extra)
        for k in extra:
            assert torch.equal(back[k], target.lm_head.weight), (fmt, k)
        for k in native:
            if k not in skip:
                assert torch.equal(back[k], native[k]), (fmt, k)


@pytest.mark.parametrize("kind", list(KINDS))
def test_exported_layer_configs_carry_the_full_attention_rope(trained, tmp_path, kind):
    """What a consumer builds the draft layer from: one flat RoPE (the full-attention layers'), not the target's
    per-layer-type dict."""
    from specheads.utils import read_json

    for fmt, refusal in EXPORTS[kind]:
        if fmt == "native" or refusal is not None or kind == "medusa":
            continue
        export_head(trained[kind]["folder"], fmt, tmp_path / fmt, target=trained[kind]["target"])
        config = read_json(tmp_path / fmt / "config.json")
        layer = config.get("transformer_layer_config", config)
        rope = layer.get("rope_parameters") or {}
        assert rope.get("rope_theta", layer.get("rope_theta")) == 1e6, (fmt, rope)
        if fmt == "speculators":  # the verifier vLLM loads is the target's architecture
            assert config["speculators_config"]["verifier"]["architectures"] == ["Gemma3ForCausalLM"]


@pytest.mark.parametrize("kind", ["medusa", "eagle", "peagle"])
def test_gguf_refuses_the_kinds_llamacpp_cannot_draft_with(trained, tmp_path, kind):
    from specheads.heads.gguf import export_gguf

    with pytest.raises(SpecheadsError, match=rf"--format gguf: .*holds a {kind} head; llama.cpp drafts with"):
        export_gguf(trained[kind]["folder"], tmp_path / "g")


# ------------------------------------------------------------------------ as a new user runs it: the CLI
@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    """The tiny Gemma 3 over SmolLM2's tokenizer (its chat template), saved as a Hugging Face folder, and a small
    ShareGPT file: what `specheads prepare` / `train` read from a recipe."""
    from transformers import AutoTokenizer

    from specheads.target import resolve_target_path, tiny_gemma3_target

    try:
        tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))
    except SpecheadsError as e:  # the bundled asset is not installed
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("gemma3")
    tiny_gemma3_target(vocab_size=len(tok)).model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question {i}: " + "why? " * (i % 5)},
                                             {"from": "gpt", "value": f"Answer {i}. " + "Because. " * (i % 7 + 1)}]}
            for i in range(16)]
    (root / "convs.json").write_text(json.dumps(rows))
    return root


CLI_KINDS = {**KINDS, "dspark": [*KINDS["dspark"], "head.draft_vocab_size=512"],
             "dflash": [*KINDS["dflash"], "head.draft_vocab_size=512"]}


@pytest.mark.parametrize("kind", [*CLI_KINDS, "dspark-full-vocab"])
def test_prepare_and_train_from_a_recipe(target_folder, tmp_path, capsys, kind):
    """`specheads prepare` then `specheads train` on the saved folder, the target in bf16 (the recipe default):
    the issue's case, a DSpark head on a sliding-window target with RoPE per layer type, and every other kind."""
    from specheads import cli

    extra = KINDS["dspark"] if kind == "dspark-full-vocab" else CLI_KINDS[kind]
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text("seed: 0\n")
    args = [f"output_dir={tmp_path / 'run'}", f"target.name={target_folder / 'target'}",
            f"data.source={target_folder / 'convs.json'}", "data.max_length=48", "data.val_fraction=0.25",
            "train.max_steps=2", "train.batch_size=2", "train.tracker=none", "eval.every_steps=0",
            "eval.batch_size=2", *extra]
    assert cli.main(["prepare", "--config", str(cfg), *args]) == 0, capsys.readouterr().err
    assert cli.main(["train", "--config", str(cfg), *args]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["history"] and (tmp_path / "run" / "best" / "config.json").exists()
