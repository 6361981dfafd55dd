"""Hidden-state features: extraction equals a direct forward, offline shards (manifest, checksums, resume, disk
check), FeatureDataset / collate, online mode. Tiny model; one SmolLM2 check marked slow."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from specheads.train import features as F
from specheads.train.features import (FeatureConfig, FeatureDataset, OnlineFeatures, collate, extract_features,
                                      length_batches, resolve_layers, verify_features, write_features)
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
    batch = OnlineFeatures(tiny, [1, L])(collate([by_id[s["conversation_id"]] for s in ds]))
    off = collate([s for s in ds])
    torch.testing.assert_close(batch["hidden"].bfloat16().float() * off["attention_mask"][..., None, None],
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
            (run / f".{F._shard_name(2)}.tmp-999").write_bytes(b"partial")
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
    # same content as one clean run (CPU kernels are not bitwise reproducible run to run: compare with tolerance)
    assert [s["conversation_ids"] for s in done["shards"]] == [s["conversation_ids"] for s in ref["shards"]]
    for a, b in zip(FeatureDataset(run), FeatureDataset(ref_dir)):
        assert a["input_ids"].tolist() == b["input_ids"].tolist()
        torch.testing.assert_close(a["hidden"].float(), b["hidden"].float(), atol=2e-2, rtol=1e-2)


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
