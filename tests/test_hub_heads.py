"""Heads by hub id and sharded heads (heads/locate.py), offline: a hub cache laid out as huggingface_hub lays it
(tests/hubcache.py: blobs, refs/main, snapshots/<commit>/ symlinks) under a temporary HF_HUB_CACHE, with
HF_HUB_OFFLINE=1. Held there: a native head saved by specheads, and a published-layout head (our own `specheads
export --format speculators` of an EAGLE-3 head) in two safetensors shards with an index; both loaded by hub id
through load_head / import_head and the CLI (generate --head ID, export --import ID, bench's LABEL=ID,
train.init_head ID), their weights equal to the originals. Every snapshot_download call is spied on: always
local_files_only, never a pickle pattern."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import make_head
from hubcache import hub_repo, repo_folder, shard
from specheads.heads import load_head
from specheads.heads.base import read_head_config
from specheads.heads.export import export_head, import_head
from specheads.heads.kinds import kinds
from specheads.heads.locate import HUB_PATTERNS, INDEX_NAME, parse_hub_id
from specheads.utils import SpecheadsError

NATIVE_ID, PUBLISHED_ID = "specheads-test/eagle3-native", "specheads-test/eagle3-speculators"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty offline hub cache at tmp/hf/hub (HF_HOME, HF_HUB_CACHE) and the snapshot_download calls made."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls, real = [], huggingface_hub.snapshot_download

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    yield SimpleNamespace(cache=cache, calls=calls)
    assert all(c["local_files_only"] is True for c in calls), calls  # offline: never a download
    assert all(not any(p.endswith((".bin", ".pt", ".pth")) for p in c["allow_patterns"]) for c in calls)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _saved(tiny, folder: Path, seed: int = 3):
    head = make_head(tiny, "eagle3", seed=seed)
    head.save_pretrained(folder)
    return head


def test_fixture_is_the_layout_huggingface_hub_reads(tmp_path, hub):
    snap, commit = hub_repo(hub.cache, "org/x", {"config.json": b"{}", "model.safetensors": b"w"})
    assert (repo_folder(hub.cache, "org/x") / "refs" / "main").read_text() == commit
    assert (snap / "model.safetensors").is_symlink() and (snap / "model.safetensors").read_bytes() == b"w"
    got = huggingface_hub.try_to_load_from_cache("org/x", "config.json", cache_dir=str(hub.cache))
    assert Path(got) == snap / "config.json"
    assert Path(huggingface_hub.snapshot_download("org/x", cache_dir=str(hub.cache), local_files_only=True,
                                                  allow_patterns=list(HUB_PATTERNS))) == snap
    assert parse_hub_id("org/x@" + commit) == ("org/x", commit) and parse_hub_id("org/x") == ("org/x", None)
    assert parse_hub_id("/abs/path") is None and parse_hub_id("a/b/c") is None and parse_hub_id("a--b/c") is None
    assert "*.json" in HUB_PATTERNS and not any("bin" in p for p in HUB_PATTERNS)


def test_native_head_by_hub_id_and_revision(tiny, tmp_path, hub):
    head = _saved(tiny, tmp_path / "h")
    snap, commit = hub_repo(hub.cache, NATIVE_ID, tmp_path / "h")
    assert (snap / "model.safetensors.sha256").exists()  # the sidecar travels (HUB_PATTERNS) and is checked
    _same(load_head(NATIVE_ID, tiny).state_dict(), head.state_dict())
    assert read_head_config(NATIVE_ID).kind == "eagle3"
    other = _saved(tiny, tmp_path / "h2", seed=9)  # a second commit no ref points at: reachable by its hash only
    _, commit2 = hub_repo(hub.cache, NATIVE_ID, tmp_path / "h2", ref=None)
    assert commit2 != commit
    _same(load_head(f"{NATIVE_ID}@{commit2}", tiny).state_dict(), other.state_dict())
    _same(load_head(f"{NATIVE_ID}@{commit}", tiny).state_dict(), head.state_dict())
    _same(load_head(NATIVE_ID, tiny).state_dict(), head.state_dict())  # main still the first
    for missing in ("specheads-test/nope", f"{NATIVE_ID}@{'0' * 40}", f"{NATIVE_ID}@v9"):
        with pytest.raises(SpecheadsError) as e:
            load_head(missing, tiny)
        msg = str(e.value)
        assert msg.startswith(f"{missing}: head folder not found, and the hub id") and "\n" not in msg
        assert "HF_HUB_OFFLINE=1: nothing is downloaded" in msg and str(hub.cache) in msg
    assert hub.calls and all(c["cache_dir"] == str(hub.cache) for c in hub.calls)


def test_sharded_native_head(tiny, tmp_path, hub):
    head = _saved(tiny, tmp_path / "h")
    names = shard(tmp_path / "h")
    assert not (tmp_path / "h" / "model.safetensors").exists() and len(names) == 2
    _same(load_head(tmp_path / "h", tiny).state_dict(), head.state_dict())
    hub_repo(hub.cache, "org/sharded", tmp_path / "h")
    _same(load_head("org/sharded", tiny).state_dict(), head.state_dict())
    d = tmp_path / "h"
    first, second = (load_file(str(d / n)) for n in names)
    key = next(iter(second))
    save_file({**first, key: second[key]}, str(d / names[0]))  # a tensor in two shards: read once, from its own
    with pytest.raises(SpecheadsError, match=rf"{names[0]}: holds tensor '{key}', which {INDEX_NAME} maps to "
                                             rf"'{names[1]}'"):
        load_head(d, tiny)
    save_file(first, str(d / names[0]))
    save_file({k: v for k, v in second.items() if k != key}, str(d / names[1]))
    with pytest.raises(SpecheadsError, match=rf"maps tensor '{key}' to '{names[1]}', which does not hold it"):
        load_head(d, tiny)
    (d / names[1]).unlink()
    with pytest.raises(SpecheadsError, match=rf"{INDEX_NAME}: names the shard '{names[1]}', which is not in"):
        load_head(d, tiny)
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": {key: "../elsewhere.safetensors"}}))
    with pytest.raises(SpecheadsError, match="not a .safetensors file name beside the index"):
        load_head(d, tiny)


def _written_pairs() -> list[tuple[str, str]]:
    return [(k, f) for k, s in sorted(kinds().items()) for f in s.formats]


@pytest.mark.parametrize("kind,fmt", _written_pairs(), ids=[f"{k}-{f}" for k, f in _written_pairs()])
def test_every_import_format_reads_sharded_weights(tiny, tmp_path, kind, fmt):
    """Each layout we write, its weights split in two shards: imported to the same head as the single file."""
    make_head(tiny, kind).save_pretrained(tmp_path / "h")
    export_head(tmp_path / "h", fmt, tmp_path / "x", target=tiny)
    whole = import_head(tmp_path / "x", tiny).state_dict()
    weights = [p.name for p in (tmp_path / "x").glob("*.safetensors")]
    assert len(weights) == 1, weights
    shard(tmp_path / "x", weights[0])
    _same(import_head(tmp_path / "x", tiny).state_dict(), whole)


def _published(tiny, tmp_path, monkeypatch, hub):
    """An EAGLE-3 head exported by `specheads export --format speculators`, sharded in two with an index and laid
    into the hub cache as PUBLISHED_ID; its native folder also laid as NATIVE_ID -> the head."""
    from specheads import cli

    monkeypatch.setattr("specheads.target.load_target", lambda *a, **k: tiny)
    head = _saved(tiny, tmp_path / "h")
    assert cli.main(["export", "--head", str(tmp_path / "h"), "--format", "speculators", "--out",
                     str(tmp_path / "sp"), "--target", "tiny"]) == 0
    from specheads.heads.export_guards import TARGET_SIDECAR

    for ours in ("export_info.json", TARGET_SIDECAR):  # ours, not a published repo's
        (tmp_path / "sp" / ours).unlink()
    shard(tmp_path / "sp")
    assert sorted(p.name for p in (tmp_path / "sp").iterdir()) == sorted(
        ["config.json", INDEX_NAME, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    hub_repo(hub.cache, PUBLISHED_ID, tmp_path / "sp")
    hub_repo(hub.cache, NATIVE_ID, tmp_path / "h")
    return head


def test_published_layout_head_by_hub_id(tiny, tmp_path, monkeypatch, hub, capsys):
    from specheads import cli

    head = _published(tiny, tmp_path, monkeypatch, hub)
    assert "speculators_config" in json.loads((tmp_path / "sp" / "config.json").read_text())
    _same(import_head(PUBLISHED_ID, tiny).state_dict(), head.state_dict())
    assert cli.main(["export", "--import", PUBLISHED_ID, "--target", "tiny", "--out", str(tmp_path / "n")]) == 0
    assert "as a eagle3 head" in capsys.readouterr().out
    _same(load_head(tmp_path / "n", tiny).state_dict(), head.state_dict())
    # a native head by hub id re-exported: the same files as from its folder
    assert cli.main(["export", "--head", NATIVE_ID, "--format", "eagle3", "--out", str(tmp_path / "e1")]) == 0
    assert cli.main(["export", "--head", str(tmp_path / "h"), "--format", "eagle3", "--out", str(tmp_path / "e2")]) == 0
    _same(load_file(str(tmp_path / "e1" / "model.safetensors")), load_file(str(tmp_path / "e2" / "model.safetensors")))
    capsys.readouterr()
    assert cli.main(["export", "--import", "specheads-test/absent", "--target", "tiny", "--out",
                     str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "specheads-test/absent: folder not found, and the hub id" in err[0], err
    assert "HF_HUB_OFFLINE=1" in err[0] and not (tmp_path / "m").exists()


def test_generate_bench_and_init_head_by_hub_id(tiny, tmp_path, monkeypatch, hub, capsys):
    from specheads import cli
    from specheads.infer.bench.names import head_entries
    from specheads.train.parts import initial_head
    from test_bench import ByteTok

    head = _published(tiny, tmp_path, monkeypatch, hub)
    tiny.tokenizer = ByteTok()
    argv = ["generate", "--prompt", "abc abc abc", "--raw", "--json", "--tree", "2,2,4", "--max-new-tokens", "8"]
    runs = []
    for source in (NATIVE_ID, str(tmp_path / "h")):
        capsys.readouterr()
        assert cli.main([*argv, "--head", source]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["ids"] == runs[1]["ids"] and len(runs[0]["ids"]) == 8
    assert runs[0]["stats"]["accept_hist"] == runs[1]["stats"]["accept_hist"]  # the same drafts accepted
    assert cli.main([*argv, "--head", "specheads-test/absent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "specheads-test/absent: head folder not found, and the hub id" in err[0], err
    snap = Path(huggingface_hub.try_to_load_from_cache(NATIVE_ID, "config.json", cache_dir=str(hub.cache))).parent
    assert head_entries([f"mine={NATIVE_ID}"]) == {"head:mine": str(snap)}
    assert head_entries([NATIVE_ID]) == {"head": str(snap)}
    recipe = SimpleNamespace(train=SimpleNamespace(init_head=NATIVE_ID), head=SimpleNamespace(kind="eagle3"))
    _same(initial_head(recipe, tiny).state_dict(), {k: v.float() for k, v in head.state_dict().items()})


def test_pickled_hub_head_refused_by_name(tiny, tmp_path, hub):
    """A hub head holding only pytorch_model.bin: refused naming the file, never unpickled (the bytes would run
    code if they were)."""
    _saved(tiny, tmp_path / "h")
    config = (tmp_path / "h" / "config.json").read_bytes()
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"w": Payload()}, tmp_path / "pytorch_model.bin")
    hub_repo(hub.cache, "org/pickled", {"config.json": config,
                                        "pytorch_model.bin": (tmp_path / "pytorch_model.bin").read_bytes()})
    for load in (load_head, import_head):
        with pytest.raises(SpecheadsError, match=r"only pickles \(pytorch_model.bin\).*pickles are never loaded"):
            load("org/pickled", tiny)
    assert not marker.exists()
