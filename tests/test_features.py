"""Hidden-state features: extraction equals a direct forward, offline shards (manifest, checksums, resume, disk
check), FeatureDataset / collate, online mode. Tiny model; one SmolLM2 check marked slow."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from specheads.train import dataset, shards, teacher
from specheads.train import features as F
from specheads.train.dataset import FeatureDataset, collate
from specheads.train.features import FeatureConfig, extract_features, length_batches, write_features
from specheads.train.layout import resolve_layers
from specheads.train.shards import verify_features
from specheads.utils import SpecheadsError


def _rows(n=9, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 40, (n,), generator=g).tolist()
    rows = []
    for i, T in enumerate(lens):
        ids = torch.randint(3, vocab, (T,), generator=g).tolist()
        mask = [0] * (T // 3) + [1] * (T - T // 3)
        rows.append({"input_ids": ids, "loss_mask": mask, "conversation_id": f"conv-{i}"})
    return rows


def _direct(target, ids, layers):
    out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.stack([out.hidden_states[i][0] for i in layers], 1), out.logits[0]  # [T,F,D], [T,V]


def test_layers_defaults_and_range():
    assert resolve_layers(30, None, "eagle3") == [2, 15, 27, 30]
    assert resolve_layers(30, None, "medusa") == [30]
    assert resolve_layers(30, [5, 3], "eagle3") == [3, 5, 30]  # explicit layers, L always added
    with pytest.raises(SpecheadsError, match="features.layers"):
        resolve_layers(4, [7], "eagle3")


def test_extract_equals_direct_forward_and_last_is_post_norm(tiny):
    L = tiny.num_layers
    rows = _rows(3)
    ids = F._pad([r["input_ids"] for r in rows])
    am = F._pad([[1] * len(r["input_ids"]) for r in rows])
    feats = extract_features(tiny, ids, am, [1, L])  # [B,T,F,D]
    assert feats.shape == (3, ids.shape[1], 2, tiny.hidden_size)
    for b, r in enumerate(rows):
        T = len(r["input_ids"])
        ref, logits = _direct(tiny, r["input_ids"], [1, L])
        torch.testing.assert_close(feats[b, :T], ref, atol=1e-5, rtol=1e-5)  # right padding changes nothing
        torch.testing.assert_close(tiny.lm_head(feats[b, :T, 1]), logits, atol=1e-5, rtol=1e-5)


def test_length_batches_bound_padded_tokens():
    lens = [5, 50, 7, 49, 6, 30, 31]
    batches = length_batches(lens, 64)
    assert sorted(i for b in batches for i in b) == list(range(len(lens)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lens[i] for i in b) <= 64


def _sha(p):
    return hashlib.sha256(open(p, "rb").read()).hexdigest()


def test_offline_shards_equal_direct_forward(tiny, tmp_path):
    rows = _rows(9)
    L = tiny.num_layers
    cfg = FeatureConfig(shard_tokens=60, batch_tokens=80)
    m = write_features(tiny, rows, tmp_path, [2, L], cfg, val_fraction=0.3, progress=False)
    assert m["complete"] and len(m["shards"]) == m["planned_shards"] > 1
    assert m["num_tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert m["num_masked_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert verify_features(tmp_path) == []
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    for s in on_disk["shards"]:
        assert _sha(tmp_path / s["file"]) == s["sha256"]
    ds = FeatureDataset(tmp_path)
    assert len(ds) == len(rows) and ds.layers == [2, L]
    by_id = {r["conversation_id"]: r for r in rows}
    for s in ds:
        r = by_id[s["conversation_id"]]
        assert s["input_ids"].tolist() == r["input_ids"] and s["loss_mask"].tolist() == r["loss_mask"]
        assert s["hidden"].dtype == torch.bfloat16
        ref, _ = _direct(tiny, r["input_ids"], [2, L])
        torch.testing.assert_close(s["hidden"].float(), ref, atol=2e-2, rtol=1e-2)  # bf16 rounding only
    train, val = FeatureDataset(tmp_path, "train"), FeatureDataset(tmp_path, "val")
    assert len(train) + len(val) == len(ds) and len(val) > 0
    assert not {x[2] for x in train.index} & {x[2] for x in val.index}
    # collate: right padding, zeros beyond each sample
    b = collate([ds[0], ds[len(ds) - 1]])
    T0 = len(ds[0]["input_ids"])
    assert b["hidden"].shape[:3] == (2, b["input_ids"].shape[1], 2)
    assert b["attention_mask"][0].sum() == T0 and b["hidden"][0, T0:].abs().sum() == 0
    assert b["loss_mask"][0, T0:].sum() == 0


def test_online_matches_offline(tiny, tmp_path):
    rows = _rows(4, seed=1)
    L = tiny.num_layers
    write_features(tiny, rows, tmp_path, [1, L], FeatureConfig(shard_tokens=1000), progress=False)
    ds = FeatureDataset(tmp_path)
    by_id = {r["conversation_id"]: r for r in rows}
    batch = collate([by_id[s["conversation_id"]] for s in ds])
    hidden = extract_features(tiny, batch["input_ids"], batch["attention_mask"], [1, L])  # the trainer's online path
    off = collate([s for s in ds])
    torch.testing.assert_close(hidden.bfloat16().float() * off["attention_mask"][..., None, None],
                               off["hidden"].float(), atol=2e-2, rtol=1e-2)


class _Killed(RuntimeError):
    pass


def test_killed_run_resumes_without_redoing_shards(tiny, tmp_path):
    rows = _rows(12, seed=2)
    L = tiny.num_layers
    cfg = FeatureConfig(shard_tokens=50, batch_tokens=64)
    ref_dir = tmp_path / "ref"
    ref = write_features(tiny, rows, ref_dir, [L], cfg, progress=False)

    run = tmp_path / "run"

    def kill_after_two(k):
        if k == 1:
            # a half-written next shard, as a kill during the write would leave it
            (run / f".{shards.shard_name(2)}.tmp-999").write_bytes(b"partial")
            raise _Killed

    with pytest.raises(_Killed):
        write_features(tiny, rows, run, [L], cfg, progress=False, after_shard=kill_after_two)
    half = json.loads((run / "manifest.json").read_text())
    assert not half["complete"] and [s["index"] for s in half["shards"]] == [0, 1]
    with pytest.raises(SpecheadsError, match="incomplete"):
        FeatureDataset(run)
    before = {s["file"]: (os.stat(run / s["file"]).st_mtime_ns, _sha(run / s["file"])) for s in half["shards"]}

    written = []
    done = write_features(tiny, rows, run, [L], cfg, progress=False, after_shard=written.append)
    assert done["complete"] and 0 not in written and 1 not in written and written  # only the rest was written
    for f, (mtime, sha) in before.items():
        assert (os.stat(run / f).st_mtime_ns, _sha(run / f)) == (mtime, sha)
    assert not list(run.glob(".shard-*"))  # the partial file is gone
    assert verify_features(run) == []
    # the same bytes as one clean run: a shard's batches are cut from its own samples, and its safetensors header
    # is written in one order (shards.save_safetensors; safetensors' own metadata order was random per write)
    assert [s["conversation_ids"] for s in done["shards"]] == [s["conversation_ids"] for s in ref["shards"]]
    assert [s["sha256"] for s in done["shards"]] == [s["sha256"] for s in ref["shards"]]


def test_damaged_listed_shard_is_rewritten(tiny, tmp_path):
    rows = _rows(6, seed=3)
    cfg = FeatureConfig(shard_tokens=40)
    m = write_features(tiny, rows, tmp_path, [4], cfg, progress=False)
    victim = tmp_path / m["shards"][0]["file"]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated by a crash of something else
    assert m["shards"][0]["file"] in verify_features(tmp_path)
    m2 = write_features(tiny, rows, tmp_path, [4], cfg, progress=False)
    assert verify_features(tmp_path) == [] and m2["complete"]


def test_refuses_when_disk_is_short(tiny, tmp_path, monkeypatch):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(SpecheadsError, match="not enough free disk"):
        write_features(tiny, _rows(3), tmp_path, [4], FeatureConfig(), progress=False)
    assert not list(tmp_path.glob("shard-*"))


def test_other_data_in_folder_is_refused(tiny, tmp_path):
    write_features(tiny, _rows(3), tmp_path, [4], FeatureConfig(), progress=False)
    with pytest.raises(SpecheadsError, match="other data, target or layers"):
        write_features(tiny, _rows(3), tmp_path, [2, 4], FeatureConfig(), progress=False)


def test_missing_manifest_message(tmp_path):
    with pytest.raises(SpecheadsError, match="no manifest.json"):
        FeatureDataset(tmp_path)


@pytest.mark.slow
def test_smollm2_cached_states_equal_direct_forward(smollm2, tmp_path):
    """Real target: stored bf16 states of layers [2, 15, 27, 30] equal a direct fp32 forward's (bf16 rounding), and
    lm_head(state L) reproduces the logits (so storing L is enough for the target distribution)."""
    tok = smollm2.tokenizer
    texts = ["The capital of France is", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)"]
    rows = [{"input_ids": tok(t)["input_ids"], "loss_mask": [1] * len(tok(t)["input_ids"]), "conversation_id": str(i)}
            for i, t in enumerate(texts)]
    layers = resolve_layers(smollm2.num_layers, None, "eagle3")
    assert layers == [2, 15, 27, 30]
    write_features(smollm2, rows, tmp_path, layers, FeatureConfig(), progress=False)
    for s in FeatureDataset(tmp_path):
        ids = rows[int(s["conversation_id"])]["input_ids"]
        ref, logits = _direct(smollm2, ids, layers)
        torch.testing.assert_close(s["hidden"], ref.bfloat16(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(smollm2.lm_head(ref[:, -1]), logits, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------- target sidecars
def _shard_mtimes(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.safetensors")}


def test_target_sidecars_hold_the_full_lm_head_greedy_and_lse(tiny, tmp_path):
    rows = _rows(9)
    L = tiny.num_layers
    write_features(tiny, rows, tmp_path, [2, L], FeatureConfig(shard_tokens=60), progress=False)
    m = teacher.write_target_sidecars(tiny, tmp_path, progress=False)
    assert m["targets"] == {"format": shards.TARGETS_FORMAT, "dtype": "float32"}
    assert all(s["targets"]["shard_sha256"] == s["sha256"] for s in m["shards"]) and verify_features(tmp_path) == []
    ds = FeatureDataset(tmp_path)
    assert ds.has_targets
    for s in ds:
        need = torch.zeros(len(s["input_ids"]), dtype=torch.bool)
        need[:-1] = s["loss_mask"][1:].bool()
        logits = tiny.lm_head(s["hidden"][:, 1].float())  # from the STORED layer-L state, as training reads it
        assert torch.equal(s["target_greedy"][need], logits.argmax(-1)[need])
        torch.testing.assert_close(s["target_lse"][need], logits.logsumexp(-1)[need], atol=1e-5, rtol=1e-6)
        assert (s["target_greedy"][~need] == -1).all() and (s["target_lse"][~need] == 0).all()
    b = collate([ds[0], ds[len(ds) - 1]])
    T0 = len(ds[0]["input_ids"])
    assert b["target_greedy"].shape == b["input_ids"].shape and (b["target_greedy"][0, T0:] == -1).all()


def test_old_folder_loads_with_one_warning_and_sidecars_are_added_without_reextraction(tiny, tmp_path, caplog):
    rows = _rows(8, seed=4)
    L = tiny.num_layers
    write_features(tiny, rows, tmp_path, [L], FeatureConfig(shard_tokens=50), progress=False)  # no sidecars
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert "targets" not in manifest and manifest["format"] == shards.FORMAT  # the format an older specheads wrote
    dataset._WARNED.clear()
    with caplog.at_level("WARNING"):
        a, b = FeatureDataset(tmp_path, "train"), FeatureDataset(tmp_path, "val")
    assert not a.has_targets and "target_greedy" not in a[0]
    assert sum("no target sidecars" in r.message for r in caplog.records) == 1  # once per folder, not per split
    before = _shard_mtimes(tmp_path)

    class Killed(RuntimeError):
        pass

    def kill(k):
        raise Killed

    with pytest.raises(Killed):  # killed after the first sidecar: it is listed, the others are not
        teacher.write_target_sidecars(tiny, tmp_path, progress=False, after_shard=kill)
    half = json.loads((tmp_path / "manifest.json").read_text())
    assert sum("targets" in s for s in half["shards"]) == 1 and not FeatureDataset(tmp_path).has_targets
    written = []
    teacher.write_target_sidecars(tiny, tmp_path, progress=False, after_shard=written.append)
    assert len(written) == len(half["shards"]) - 1 and half["shards"][0]["index"] not in written
    assert _shard_mtimes(tmp_path) == before  # the feature shards were only read
    assert FeatureDataset(tmp_path).has_targets and not list(tmp_path.glob(".targets-*"))


def test_damaged_stale_or_other_dtype_sidecars_are_not_used(tiny, tmp_path, caplog):
    from specheads.utils import atomic_write_json

    L = tiny.num_layers
    write_features(tiny, _rows(6, seed=5), tmp_path, [L], FeatureConfig(shard_tokens=40), progress=False)
    m = teacher.write_target_sidecars(tiny, tmp_path, progress=False)
    side = tmp_path / m["shards"][0]["targets"]["file"]
    side.write_bytes(side.read_bytes()[:50])  # truncated
    assert m["shards"][0]["targets"]["file"] in verify_features(tmp_path)
    with pytest.raises(SpecheadsError, match="targets-00000.safetensors.*rerun `specheads prepare`"):
        FeatureDataset(tmp_path)[0]
    m["shards"][1]["targets"]["shard_sha256"] = "0" * 64  # a sidecar of an earlier version of shard 1
    atomic_write_json(tmp_path / "manifest.json", m)
    assert shards.sidecars_usable(m) == f"1 of {len(m['shards'])} shards without their target sidecar"
    written = []
    teacher.write_target_sidecars(tiny, tmp_path, progress=False, after_shard=written.append)
    assert written == [0, 1] and verify_features(tmp_path) == [] and FeatureDataset(tmp_path).has_targets
    dataset._WARNED.clear()
    with caplog.at_level("WARNING"):  # training a bf16 target on fp32 sidecars: not used, said once
        assert not FeatureDataset(tmp_path, targets_dtype="bfloat16").has_targets
    assert any("computed in float32, the target runs in bfloat16" in r.message for r in caplog.records)
    bf16 = tiny_bf16()
    with caplog.at_level("WARNING"):  # nor replaced by a bf16 pass: they belong to the folder's first writer
        teacher.write_target_sidecars(bf16, tmp_path, progress=False)
    assert json.loads((tmp_path / "manifest.json").read_text())["targets"]["dtype"] == "float32"


def tiny_bf16():
    from specheads.target import tiny_target

    return tiny_target(dtype=torch.bfloat16)


def test_prepare_adds_sidecars_to_a_shared_features_folder(tiny, tmp_path):
    from specheads.config import load_config
    from specheads.train.recipe import Recipe
    from specheads.train.prepare import prepare

    shared = tmp_path / "shared"
    write_features(tiny, _rows(5, seed=6), shared, [tiny.num_layers], FeatureConfig(), progress=False)
    recipe = load_config(Recipe, None, [f"output_dir={tmp_path / 'run'}", "head.kind=medusa",
                                        f"features.dir={shared}"])
    summary = prepare(recipe, target=tiny, progress=False)
    assert summary["target_sidecars"] == len(json.loads((shared / "manifest.json").read_text())["shards"])
    assert FeatureDataset(shared).has_targets


def _head(kind, target, draft_vocab=64, **spec):
    from specheads.heads.base import HeadSpec, build_head

    torch.manual_seed(0)
    counts = torch.arange(target.vocab_size, 0, -1)  # a fixed draft vocab: the first `draft_vocab` ids
    return build_head(HeadSpec(kind=kind, draft_vocab_size=draft_vocab, **spec), target, token_counts=counts)


def _sidecar_batches(target, tmp_path, layers, n=10):
    write_features(target, _rows(n, seed=7), tmp_path, layers, FeatureConfig(shard_tokens=80), progress=False)
    teacher.write_target_sidecars(target, tmp_path, progress=False)
    ds = FeatureDataset(tmp_path)
    with_side = [collate([ds[i], ds[i + 1]]) for i in range(0, len(ds) - 1, 2)]
    without = [{k: v for k, v in b.items() if not k.startswith("target_")} for b in with_side]
    return with_side, without


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_losses_and_eval_with_sidecars_equal_the_full_vocabulary_computation(tmp_path, dtype, monkeypatch):
    """EAGLE-3 (and the other kinds) train on the same loss and evaluate to the same metrics whether the target's
    greedy token and logsumexp come from the sidecar (draft-vocab columns only) or from the full lm_head."""
    from specheads.target import tiny_target
    from specheads.train.evaluate import EvalConfig, evaluate
    from specheads.train.kinds import block
    from specheads.train.settings import BlockTrainConfig, MedusaTrainConfig
    from specheads.train.steps import LossSettings, train_loss

    full_calls = []
    real = teacher.lm_head_logits
    for module in (teacher, block):  # every caller of the lm_head in a training or evaluation step
        monkeypatch.setattr(module, "lm_head_logits", lambda t, h, vocab=None: (full_calls.append(vocab is None),
                                                                                 real(t, h, vocab))[1])

    target = tiny_target(dtype=dtype)
    target.final_norm.weight.data.mul_(8)  # sharper distributions: in / out of the draft vocab both occur
    L = target.num_layers
    layers = [1, 2, 3, L]
    side, full = _sidecar_batches(target, tmp_path, layers)
    tol = dict(atol=1e-5, rtol=1e-5)  # fp32 and bf16 alike: the same logits either way (see docs/training.md)
    cases = [("eagle3", {"ttt_steps": 2, "feature_layers": [1, 2, 3]}, [None, "lk_lambda", "soft_ce:0.1,tv:0.9"]),
             ("eagle", {}, [None, "lk_alpha"]), ("medusa", {"num_heads": 2}, [None, "lk_alpha"]),
             ("dspark", {"feature_layers": [1, 2, 3], "block_size": 3, "markov_rank": 8}, [None, "lk_alpha"])]
    for kind, spec, losses in cases:
        head = _head(kind, target, **spec)
        hl = head.config.feature_layers
        for loss in losses:
            st = LossSettings(noise=0.0, loss=loss, medusa=MedusaTrainConfig(soft_labels=True),
                              block=BlockTrainConfig(full_vocab=True, max_anchors=4))
            for a, b in zip(side, full):
                torch.manual_seed(1)  # DSpark's anchors
                full_calls.clear()
                la = train_loss(kind, head, a, target, layers, hl, st)
                assert not any(full_calls), f"{kind}: the sidecar path computed the full-vocabulary logits"
                torch.manual_seed(1)
                lb = train_loss(kind, head, b, target, layers, hl, st)
                assert any(full_calls) or (kind == "medusa" and loss is None)  # medusa: V' columns either way
                torch.testing.assert_close(la.loss, lb.loss, **tol, msg=f"{kind} {loss}")
                assert set(la.metrics) == set(lb.metrics)
                for k in la.metrics:
                    torch.testing.assert_close(torch.as_tensor(la.metrics[k]), torch.as_tensor(lb.metrics[k]), **tol)
        cfg = EvalConfig(tree_depth=2)
        ev = [evaluate(kind, head, bs, target, layers, hl, cfg) for bs in (side, full)]
        assert ev[0] == ev[1] and ev[0]["eval_rows"] > 0, kind
    # the masking the sidecar feeds really happens: some assistant rows have their target argmax outside V'
    greedy = torch.cat([b["target_greedy"][b["target_greedy"] >= 0] for b in side])
    assert (greedy >= 64).any() and (greedy < 64).any()
