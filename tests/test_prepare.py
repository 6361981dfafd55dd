"""`specheads prepare` end to end (tiny target with SmolLM2's tokenizer), kill + resume, regeneration, bad inputs."""
from __future__ import annotations

import hashlib
import json
import os
import re

import pytest
import torch

from specheads.utils import SpecheadsError


def _sha(p):
    return hashlib.sha256(open(p, "rb").read()).hexdigest()


@pytest.fixture
def tiny_chat(smol_tokenizer):
    """A random 4-layer Llama (hidden 64) over SmolLM2's vocabulary and chat template: fast, real tokenizer."""
    from specheads.target import tiny_target

    return tiny_target(vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer)


def _sharegpt_file(tmp_path, n=20):
    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": f"Question {i}: " + "why? " * (i % 5)},
                 {"from": "gpt", "value": f"Answer {i}. " + "Because. " * (i % 7 + 1)}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "More?"}, {"from": "gpt", "value": "Yes, more " * (i % 4 + 1)}]
        rows.append({"id": f"c{i}", "conversations": turns})
    rows.append({"id": "broken", "conversations": [{"from": "robot", "value": "beep"}]})
    p = tmp_path / "convs.json"
    p.write_text(json.dumps(rows))
    return p


def _recipe(tmp_path, source, *extra):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe

    return load_config(Recipe, None, [f"output_dir={tmp_path / 'run'}", f"data.source={source}", "data.max_length=48",
                                      "data.val_fraction=0.2", "features.shard_tokens=120", "features.batch_tokens=96",
                                      "head.kind=eagle3", *extra])


class _Killed(RuntimeError):
    pass


def test_prepare_killed_midway_resumes(tiny_chat, tmp_path):
    from specheads.heads.base import default_feature_layers
    from specheads.train.dataset import FeatureDataset
    from specheads.train.shards import verify_features
    from specheads.train.prepare import format_summary, prepare

    recipe = _recipe(tmp_path, _sharegpt_file(tmp_path))

    def kill(k):
        if k == 0:
            raise _Killed

    with pytest.raises(_Killed):
        prepare(recipe, target=tiny_chat, progress=False, after_shard=kill)
    feat = tmp_path / "run" / "features"
    first = json.loads((feat / "manifest.json").read_text())["shards"]
    assert len(first) == 1
    stamp = (os.stat(feat / first[0]["file"]).st_mtime_ns, _sha(feat / first[0]["file"]))

    written = []
    s = prepare(recipe, target=tiny_chat, progress=False, after_shard=written.append)
    assert 0 not in written and len(written) == s["shards"] - 1 > 0
    assert (os.stat(feat / first[0]["file"]).st_mtime_ns, _sha(feat / first[0]["file"])) == stamp
    assert s["features_complete"] and verify_features(feat) == []
    assert s["conversations_read"] == 21 and s["conversations_skipped"] == 1 and s["skip_reasons"] == {"unknown role": 1}
    L = tiny_chat.num_layers
    assert s["feature_layers"] == default_feature_layers("eagle3", L) + [L]  # EAGLE-3 default ([1, 2, 3]) + L
    ds = FeatureDataset(feat)
    assert len(ds) == s["samples"] and sum(len(x["input_ids"]) for x in ds) == s["tokens"]
    assert sum(int(x["loss_mask"].sum()) for x in ds) == s["masked_tokens"] > 0
    on_disk = json.loads((tmp_path / "run" / "prepare_summary.json").read_text())
    assert on_disk["tokens"] == s["tokens"] and on_disk["disk_bytes"] > 0
    table = format_summary(s)
    for label in ("conversations read", "conversations skipped", "tokens", "masked tokens", "disk used"):
        assert label in table
    import datasets

    tok = datasets.load_from_disk(str(tmp_path / "run" / "data" / "tokens"))
    assert set(tok.column_names) == {"input_ids", "loss_mask", "conversation_id"}
    again = []  # a third run over a finished folder writes nothing and reports the same
    s3 = prepare(recipe, target=tiny_chat, progress=False, after_shard=again.append)
    assert again == [] and s3["tokens"] == s["tokens"] and s3["features_complete"]


def test_prepare_online_mode_writes_no_shards(tiny_chat, tmp_path):
    from specheads.train.prepare import prepare

    s = prepare(_recipe(tmp_path, _sharegpt_file(tmp_path, 4), "features.mode=online"), target=tiny_chat,
                progress=False)
    assert s["feature_mode"] == "online" and "shards" not in s
    assert not (tmp_path / "run" / "features").exists()


def _greedy_one_by_one(target, prompt, cap):
    ids, ref = list(prompt), []
    for _ in range(cap):
        nxt = int(target.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if nxt in target.eos_token_ids:
            break
        ref.append(nxt)
        ids.append(nxt)
    return ref


def test_regenerate_resumes_by_id_and_survives_cut_line(tiny_chat, tmp_path):
    from specheads.conversations.load import load_conversations
    from specheads.train.regenerate import regenerate

    convs, _ = load_conversations(str(_sharegpt_file(tmp_path, 6)))
    out = tmp_path / "regen.jsonl"
    s1 = regenerate(tiny_chat, convs.select(range(3)), out, max_length=64, max_new_tokens=4, batch_size=2,
                    progress=False)
    assert s1["regenerated"] == 3 and s1["new_tokens"] > 0
    with open(out, "a") as f:
        f.write('{"id": "c4", "messages": [{"role": "us')  # a kill in the middle of a line
    s2 = regenerate(tiny_chat, convs, out, max_length=64, max_new_tokens=4, batch_size=4, progress=False)
    assert s2["already_done"] == 3 and s2["regenerated"] == 3
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["id"] for x in lines) == sorted(convs["conversation_id"])
    src = {c["conversation_id"]: c["messages"] for c in convs}
    for row in lines:
        orig = src[row["id"]]
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in orig]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == \
               [m["content"] for m in orig if m["role"] == "user"]
        # answers are the target's own (random weights: never the original text), at most 4 tokens each
        for m, o in zip(row["messages"], orig):
            if m["role"] == "assistant":
                assert m["content"] != o["content"]
                assert len(tiny_chat.tokenizer(m["content"], add_special_tokens=False)["input_ids"]) <= 6
    re_read, st = load_conversations(str(out))  # the output is valid input
    assert len(re_read) == 6 and st.skipped == 0


def test_regenerate_max_turns_keeps_first_exchange(tiny_chat, tmp_path):
    from specheads.conversations.load import load_conversations
    from specheads.train.regenerate import regenerate

    convs, _ = load_conversations(str(_sharegpt_file(tmp_path, 6)))  # c0 and c3 have two exchanges
    out = tmp_path / "regen1.jsonl"
    regenerate(tiny_chat, convs, out, max_length=64, max_new_tokens=3, batch_size=4, progress=False, max_turns=1)
    rows = {r["id"]: r["messages"] for r in map(json.loads, out.read_text().splitlines())}
    assert len(rows) == 6
    for cid, msgs in rows.items():
        assert [m["role"] for m in msgs] == ["user", "assistant"], cid


def test_prepare_with_regenerate(tiny_chat, tmp_path):
    from specheads.train.prepare import prepare

    s = prepare(_recipe(tmp_path, _sharegpt_file(tmp_path, 4), "data.regenerate=true", "data.regen_max_new_tokens=3",
                        "features.mode=online"), target=tiny_chat, progress=False)
    assert s["regenerated_new_tokens"] > 0 and s["samples"] == 4
    assert (tmp_path / "run" / "data" / "regenerated.jsonl").exists()


def test_prepare_regenerates_only_the_first_n(tiny_chat, tmp_path):
    from specheads.train.prepare import prepare

    s = prepare(_recipe(tmp_path, _sharegpt_file(tmp_path, 6), "data.regenerate=true", "data.regen_max_new_tokens=3",
                        "data.regen_conversations=2", "features.mode=online"), target=tiny_chat, progress=False)
    regen = [json.loads(r)["id"] for r in (tmp_path / "run" / "data" / "regenerated.jsonl").read_text().splitlines()]
    assert sorted(regen) == ["c0", "c1"]  # the first two kept conversations, no more
    assert s["regenerated_conversations"] == 2 and s["source_reply_conversations"] == 4 and s["samples"] == 6


def test_prepare_rerun_with_every_answer_done_loads_no_regeneration_copy(tiny_chat, tmp_path, monkeypatch):
    import specheads.target
    from specheads.train.prepare import prepare

    src = _sharegpt_file(tmp_path, 4)
    base = ("data.regenerate=true", "data.regen_max_new_tokens=3", "features.mode=online")
    prepare(_recipe(tmp_path, src, *base, "data.max_conversations=3"), target=tiny_chat, progress=False)

    def no_load(*a, **k):
        raise AssertionError("loaded a regeneration copy of the target")

    monkeypatch.setattr(specheads.target, "load_target", no_load)
    # data.regen_dtype differs from target.dtype, but all 3 answers are in regenerated.jsonl: no copy is loaded
    s = prepare(_recipe(tmp_path, src, *base, "data.max_conversations=3", "data.regen_dtype=float16"),
                target=tiny_chat, progress=False)
    assert s["samples"] == 3
    with pytest.raises(AssertionError, match="regeneration copy"):  # a 4th conversation still needs one
        prepare(_recipe(tmp_path, src, *base, "data.regen_dtype=float16"), target=tiny_chat, progress=False)


@pytest.mark.parametrize("override,match", [
    ("data.source=/nonexistent/convs.json", "file not found"),
    ("data.regen_conversations=0", "data.regen_conversations"),
    ("data.regen_conversations=3", "data.regenerate is false"),
    ("data.max_length=1", "data.max_length"),
    ("data.val_fraction=1.5", "data.val_fraction"),
])
def test_prepare_bad_settings_one_message(tiny_chat, tmp_path, override, match):
    """Range checks live in DataConfig (they fail when the recipe loads, naming the flag); a missing file in
    prepare. Either way one message, and nothing is written."""
    from specheads.train.prepare import prepare

    with pytest.raises(SpecheadsError, match=match):
        prepare(_recipe(tmp_path, _sharegpt_file(tmp_path, 2), override), target=tiny_chat, progress=False)
    assert not (tmp_path / "run").exists()


def test_bad_feature_mode_and_all_rows_malformed(tiny_chat, tmp_path):
    from specheads.train.prepare import prepare

    with pytest.raises(SpecheadsError, match="features.mode"):
        _recipe(tmp_path, "x.json", "features.mode=sometimes")
    p = tmp_path / "bad.jsonl"
    p.write_text('{"messages": []}\n{"messages": [{"role": "user"}]}\n')
    with pytest.raises(SpecheadsError, match="no usable conversation"):
        prepare(_recipe(tmp_path, p), target=tiny_chat, progress=False)


def test_cli_prepare_bad_source_is_one_line(tmp_path, capsys):
    from specheads.cli import main

    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"command: specheads prepare --config {cfg}\noutput_dir: {tmp_path / 'o'}\n"
                   f"data:\n  source: {tmp_path / 'nope.jsonl'}\n")
    rc = main(["prepare", "--config", str(cfg), "--no-progress", "target.dtype=float32"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [f"specheads prepare: error: data.source '{tmp_path / 'nope.jsonl'}': file not found"]


@pytest.mark.slow
def test_cli_prepare_smollm2_small(tmp_path, capsys):
    """The real command on SmolLM2 (bf16) and 6 packaged ShareGPT conversations cut to 64 tokens."""
    from specheads.cli import main

    rc = main(["prepare", "--config", "configs/prepare-smollm2-200.yaml", "--no-progress",
               f"output_dir={tmp_path / 'run'}", "data.max_conversations=6", "data.max_length=64"])
    out = capsys.readouterr().out
    assert rc == 0 and "masked tokens" in out and "disk used" in out and "max_conversations: 6" in out
    s = json.loads((tmp_path / "run" / "prepare_summary.json").read_text())
    assert s["conversations_kept"] == 6 and s["features_complete"] and s["feature_layers"] == [2, 15, 27, 30]


def test_shared_features_dir_trains_medusa_from_eagle3_extraction(tiny_chat, tmp_path):
    """features.dir: a Medusa recipe reads the EAGLE-3 recipe's shards (they hold layer L) and extracts nothing;
    its draft vocabulary is counted from the training split only."""
    from specheads.config import load_config
    from specheads.heads.base import load_head
    from specheads.train.recipe import Recipe
    from specheads.target import tiny_target
    from specheads.train.dataset import FeatureDataset
    from specheads.train.prepare import format_summary, prepare
    from specheads.train.trainer import run_training

    e3 = prepare(_recipe(tmp_path, _sharegpt_file(tmp_path)), target=tiny_chat, progress=False)
    feat = tmp_path / "run" / "features"

    def medusa(*extra):
        return load_config(Recipe, None, [f"output_dir={tmp_path / 'medusa'}", f"features.dir={feat}",
                                          "head.kind=medusa", "head.num_heads=2", "head.draft_vocab_size=4",
                                          "train.max_steps=2", "train.batch_size=2", "train.tracker=none",
                                          "eval.max_samples=2", *extra])

    s = prepare(medusa(), target=tiny_chat, progress=False)
    assert s["features_dir"] == str(feat) and s["feature_layers"] == [tiny_chat.num_layers]
    assert s["tokens"] == e3["tokens"] and not (tmp_path / "medusa" / "features").exists()
    assert "shared" in format_summary(s)
    res = run_training(medusa(), target=tiny_chat)
    assert res.steps == 2
    summ = json.loads((tmp_path / "medusa" / "train_summary.json").read_text())
    assert summ["steps"] == 2 and summ["kind"] == "medusa" and summ["tokens_this_run"] > 0 and summ["history"]
    head = load_head(tmp_path / "medusa" / "best", tiny_chat)
    train_ids = set()
    for x in FeatureDataset(feat, "train"):
        train_ids |= set(x["input_ids"][x["loss_mask"].bool()].tolist())
    assert set(head.d2t.tolist()) <= train_ids
    # an EAGLE-3 head cannot read a Medusa-only folder; another target's folder is refused
    with pytest.raises(SpecheadsError, match="features.dir .*missing"):
        prepare(load_config(Recipe, None, [f"output_dir={tmp_path / 'x'}", f"features.dir={feat}",
                                           "head.kind=eagle3", "head.feature_layers=[0,3]"]),
                target=tiny_chat, progress=False)
    other = tiny_target(vocab_size=len(tiny_chat.tokenizer), tokenizer=tiny_chat.tokenizer, seed=1)
    with pytest.raises(SpecheadsError, match="fingerprints differ"):
        prepare(medusa(), target=other, progress=False)
    with pytest.raises(SpecheadsError, match="features.dir .*no manifest"):
        prepare(medusa(f"features.dir={tmp_path / 'nothing'}"), target=tiny_chat, progress=False)


# ----------------------------------------------------------------------------- targets without a chat template

@pytest.fixture
def tiny_base(smol_tokenizer):
    """The tiny target over a copy of SmolLM2's tokenizer with its chat template removed: a base model."""
    import copy

    from specheads.target import tiny_target

    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = None
    return tiny_target(vocab_size=len(tok), tokenizer=tok)


def _text_file(tmp_path, n=6, name="code.jsonl"):
    rows = [{"id": f"t{i}", "text": f"def f{i}(x):\n    return x * {i} + " + "1 + " * (4 * i) + "0\n"}
            for i in range(n)]
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


NO_TEMPLATE = r"its tokenizer has no chat template .*data\.chat_template .*data\.mode=text"


@pytest.mark.parametrize("extra", [(), ("data.regenerate=true",)], ids=["tokenize", "regenerate"])
def test_prepare_without_template_is_one_message(tiny_base, tmp_path, extra):
    """Chat data on a template-less target: one SpecheadsError naming the target and both fixes (it was
    transformers' ValueError traceback from apply_chat_template)."""
    from specheads.train.prepare import prepare

    with pytest.raises(SpecheadsError, match=rf"target tiny-llama-0: {NO_TEMPLATE}"):
        prepare(_recipe(tmp_path, _sharegpt_file(tmp_path, 3), *extra), target=tiny_base, progress=False)


def test_cli_prepare_without_template_is_one_line(tiny_base, tmp_path, capsys, monkeypatch):
    from specheads.cli import main

    monkeypatch.setattr("specheads.target.load_target", lambda *a, **k: tiny_base)
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"command: specheads prepare --config {cfg}\noutput_dir: {tmp_path / 'o'}\n"
                   f"data:\n  source: {_sharegpt_file(tmp_path, 2)}\n")
    rc = main(["prepare", "--config", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert re.search(NO_TEMPLATE, err)


def test_prepare_with_chat_template_on_base_target(tiny_base, tiny_chat, tmp_path):
    """data.chat_template (a file holding SmolLM2's template) on the template-less copy prepares, regeneration
    included, exactly what the same weights with SmolLM2's own template prepare."""
    import datasets

    from specheads.train.prepare import prepare

    src = _sharegpt_file(tmp_path, 4)
    (tmp_path / "chatml.jinja").write_text(tiny_chat.tokenizer.chat_template)
    base = ("data.regenerate=true", "data.regen_max_new_tokens=4", "features.mode=online")
    prepare(_recipe(tmp_path / "a", src, *base), target=tiny_chat, progress=False)
    prepare(_recipe(tmp_path / "b", src, *base, f"data.chat_template={tmp_path / 'chatml.jinja'}"), target=tiny_base,
            progress=False)
    a, b = (datasets.load_from_disk(str(tmp_path / x / "run" / "data" / "tokens")) for x in "ab")
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"] and sum(map(sum, a["loss_mask"]))
    assert tiny_base.tokenizer.chat_template is None


def test_prepare_text_mode_trains_on_every_token(tiny_base, tmp_path):
    """data.mode=text: JSONL {"text"} rows or a .txt file, windows of data.max_length tokens, every token in the
    loss, features extracted as for chat data."""
    import datasets

    from specheads.train.dataset import FeatureDataset
    from specheads.train.prepare import prepare

    for src in (_text_file(tmp_path), tmp_path / "novel.txt"):
        if src.suffix == ".txt":
            src.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 12)
        out = tmp_path / src.stem
        s = prepare(_recipe(out, src, "data.mode=text"), target=tiny_base, progress=False)
        tok = datasets.load_from_disk(str(out / "run" / "data" / "tokens"))
        assert s["masked_tokens"] == s["tokens"] == sum(len(x) for x in tok["input_ids"]) > 0
        assert all(set(m) == {1} for m in tok["loss_mask"]) and max(len(x) for x in tok["input_ids"]) <= 48
        assert s["features_complete"] and len(FeatureDataset(out / "run" / "features")) == s["samples"]
    assert s["samples"] > 1 and tok["conversation_id"][:2] == ["novel", "novel#1"]  # one long text, windows


def test_prepare_text_mode_regenerates_from_prefixes(tiny_base, tmp_path):
    """Regeneration of plain text keeps each window's first data.regen_prefix_tokens tokens and appends the
    target's own greedy continuation (checked token by token); a rerun regenerates nothing; data.regen_conversations
    keeps the source for the windows after the first N."""
    import datasets

    from specheads.train.data import tokenize_texts
    from specheads.conversations.load import load_texts
    from specheads.train.prepare import prepare

    src = _text_file(tmp_path, 4)
    args = ("data.mode=text", "data.regenerate=true", "data.regen_prefix_tokens=5", "data.regen_max_new_tokens=6",
            "features.mode=online")
    s = prepare(_recipe(tmp_path, src, *args), target=tiny_base, progress=False)
    source, _ = tokenize_texts(load_texts(str(src))[0], tiny_base.tokenizer, 48)
    tok = datasets.load_from_disk(str(tmp_path / "run" / "data" / "tokens"))
    assert tok["conversation_id"] == source["conversation_id"] and s["regenerated_new_tokens"] > 0
    for ids, orig in zip(tok["input_ids"], source["input_ids"]):
        p = min(5, len(orig))  # a window shorter than the prefix is all prompt
        assert ids[:p] == orig[:p] and ids[p:] == _greedy_one_by_one(tiny_base, orig[:p], 6)
    regen = tmp_path / "run" / "data" / "regenerated-text.jsonl"
    before = regen.read_text()
    s2 = prepare(_recipe(tmp_path, src, *args), target=tiny_base, progress=False)
    assert regen.read_text() == before and s2["regenerated_new_tokens"] == 0
    s3 = prepare(_recipe(tmp_path / "n", src, *args, "data.regen_conversations=1"), target=tiny_base, progress=False)
    tok3 = datasets.load_from_disk(str(tmp_path / "n" / "run" / "data" / "tokens"))
    assert s3["regenerated_conversations"] == 1 and tok3["input_ids"][1:] == source["input_ids"][1:]


@pytest.mark.parametrize("override,match", [
    ("data.chat_template={% for m in messages %}{% endfor %}", "data.chat_template: set, but data.mode is text"),
    ("data.regen_max_turns=1", "data.regen_max_turns"),
    ("data.regen_prefix_tokens=48", "data.regen_prefix_tokens"),
    ("data.source=CHAT", "no usable text"),
])
def test_prepare_text_mode_bad_settings_one_message(tiny_base, tmp_path, override, match):
    from specheads.train.prepare import prepare

    override = override.replace("CHAT", str(_sharegpt_file(tmp_path, 2)))
    with pytest.raises(SpecheadsError, match=match):  # DataConfig's own checks refuse at load, the rest in prepare
        recipe = _recipe(tmp_path, _text_file(tmp_path), "data.mode=text", "data.regenerate=true", override)
        prepare(recipe, target=tiny_base, progress=False)
    with pytest.raises(SpecheadsError, match=r"no usable conversation .*need data\.mode=text"):
        prepare(_recipe(tmp_path, _text_file(tmp_path)), target=tiny_base, progress=False)


@pytest.mark.slow
def test_smollm2_without_template_prepares_text_and_generates_raw(smollm2, tmp_path, capsys, monkeypatch):
    """The real SmolLM2 with its chat template removed: chat data is one clear error; plain text prepares
    (features of the EAGLE-3 default layers, regeneration from prefixes equal to HF greedy generate); `generate
    --raw` runs and gives HF generate's greedy tokens, a chat prompt is one clear error."""
    import copy
    import dataclasses

    import datasets

    from specheads.cli import main
    from specheads.train.prepare import prepare

    tok = copy.deepcopy(smollm2.tokenizer)
    tok.chat_template = None
    base = dataclasses.replace(smollm2, tokenizer=tok)
    with pytest.raises(SpecheadsError, match=NO_TEMPLATE):
        prepare(_recipe(tmp_path / "c", _sharegpt_file(tmp_path, 2)), target=base, progress=False)
    args = ("data.mode=text", "data.max_length=32", "data.regenerate=true", "data.regen_prefix_tokens=8",
            "data.regen_max_new_tokens=6")
    s = prepare(_recipe(tmp_path, _text_file(tmp_path, 3), *args), target=base, progress=False)
    assert s["features_complete"] and s["feature_layers"] == [2, 15, 27, 30] and s["masked_tokens"] == s["tokens"]
    tokens = datasets.load_from_disk(str(tmp_path / "run" / "data" / "tokens"))
    for ids in tokens["input_ids"]:
        ref = smollm2.model.generate(torch.tensor([ids[:8]]), max_new_tokens=6, do_sample=False)[0].tolist()
        eos = [i for i, t in enumerate(ref[8:]) if t in smollm2.eos_token_ids]
        assert ids == ref[:8 + eos[0]] if eos else ids == ref

    monkeypatch.setattr("specheads.target.load_target", lambda *a, **k: base)
    prompt = "def fibonacci(n):"
    assert main(["generate", "--target", "x", "--prompt", prompt, "--raw", "--max-new-tokens", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    ref = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert got["ids"] == ref
    assert main(["generate", "--target", "x", "--prompt", prompt, "--max-new-tokens", "4"]) == 2
    assert "has no chat template" in capsys.readouterr().err


def _tree_state(folder):
    """{relative path: sha256} of every file under folder (what a refused run must leave unchanged)."""
    return {str(p.relative_to(folder)): _sha(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_prepare_of_other_data_into_a_run_is_refused_before_anything_changes(tiny_chat, tmp_path):
    from specheads.target import tiny_target
    from specheads.train.prepare import prepare

    prepare(_recipe(tmp_path, _sharegpt_file(tmp_path)), target=tiny_chat, progress=False)
    run = tmp_path / "run"
    before = _tree_state(run)
    assert "prepare_config.yaml" in before and any(k.startswith("data/tokens") for k in before)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(SpecheadsError, match="holds features of other data"):
        prepare(_recipe(tmp_path, _sharegpt_file(other, 9)), target=tiny_chat, progress=False)
    assert _tree_state(run) == before
    second = tiny_target(vocab_size=len(tiny_chat.tokenizer), tokenizer=tiny_chat.tokenizer, seed=1)
    with pytest.raises(SpecheadsError, match="holds features of target"):
        prepare(_recipe(tmp_path, _sharegpt_file(tmp_path), "data.regenerate=true", "data.regen_max_new_tokens=4"),
                target=second, progress=False)
    assert _tree_state(run) == before  # refused before regenerating: not even regenerated.jsonl was written
    with pytest.raises(SpecheadsError, match="file not found"):
        prepare(_recipe(tmp_path, tmp_path / "missing.json"), target=tiny_chat, progress=False)
    assert _tree_state(run) == before


def test_empty_assistant_turns_are_counted_and_skipped(tiny_chat, tmp_path):
    from specheads.conversations.load import drop_empty_answers
    from specheads.train.prepare import format_summary, prepare

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a?"},
            {"role": "assistant", "content": "  \n"}, {"role": "user", "content": "b?"},
            {"role": "assistant", "content": "B."}]
    kept, n = drop_empty_answers(msgs)
    assert n == 1 and kept == [msgs[0], msgs[3], msgs[4]]
    rows = [{"id": "ok", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello."}]},
            {"id": "empty", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]},
            {"id": "mixed", "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": " "},
                                              {"from": "human", "value": "y"}, {"from": "gpt", "value": "Y."}]}]
    src = tmp_path / "c.json"
    src.write_text(json.dumps(rows))
    s = prepare(_recipe(tmp_path, src, "data.val_fraction=0"), target=tiny_chat, progress=False)
    assert s["empty_assistant_turns"] == 2 and s["conversations_kept"] == 2 and s["samples"] == 2
    assert s["skip_reasons"] == {"empty answers": 1}
    assert "empty answers skipped" in format_summary(s)
    import datasets

    tok = datasets.load_from_disk(str(tmp_path / "run" / "data" / "tokens"))
    eot = tiny_chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for ids, mask in zip(tok["input_ids"], tok["loss_mask"]):
        trained = [i for i, m in zip(ids, mask) if m]
        assert len(trained) > 1 and trained[-1] == eot  # never a sample whose only loss token is the end of turn
