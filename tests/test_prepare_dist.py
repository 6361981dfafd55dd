"""`specheads prepare` across processes (issue 50 point 2) on this CPU: 2 torchrun processes on gloo write a features
folder byte-identical to a 1-process prepare (every shard's and sidecar's sha256, the manifest, the tokens and the
regenerated answers); a rank killed mid-prepare, then a rerun with another number of processes, ends identical too;
ranks that do not see one folder fail with one line. Each launch starts real processes (~15-30 s)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
WORKER = str(HERE / "prepare_dist_worker.py")

RECIPE = """output_dir: {out}
target: {{name: {target}, dtype: float32}}
data: {{source: {convs}, max_length: 48, val_fraction: 0.25, regenerate: true, regen_max_new_tokens: 6,
        regen_batch_size: {regen_batch}}}
features: {{shard_tokens: 60, batch_tokens: 128}}
head: {{kind: eagle3, draft_vocab_size: 64}}
"""


def _env(threads: int = 1) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    """A tiny Llama target with SmolLM2's tokenizer (saved as a folder) and 14 conversations."""
    from transformers import AutoTokenizer

    from specheads.target import resolve_target_path, tiny_target

    base = tmp_path_factory.mktemp("prepdist")
    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))
    t = tiny_target(vocab_size=len(tok), tokenizer=tok)
    t.model.config.eos_token_id = tok.eos_token_id
    t.model.save_pretrained(base / "target")
    tok.save_pretrained(base / "target")
    convs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: " + "why? " * (i % 4)},
        {"from": "gpt", "value": f"Answer {i}. " + "Because. " * (i % 5 + 1)}]} for i in range(14)]
    (base / "convs.json").write_text(json.dumps(convs))
    return base


def _recipe(base: Path, name: str, regen_batch: int = 4) -> Path:
    p = base / f"{name}.yaml"
    p.write_text(RECIPE.format(out=base / name, target=base / "target", convs=base / "convs.json",
                               regen_batch=regen_batch))
    return p


def _one_process(recipe: Path):
    return subprocess.run([sys.executable, "-m", "specheads", "prepare", "--config", str(recipe), "--no-progress"],
                          env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)


def _torchrun(args: list[str], n: int = 2, env: dict | None = None):
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(n)] + args
    return subprocess.run(cmd, env=env or _env(), cwd=ROOT, capture_output=True, text=True, timeout=300)


def _cli(recipe: Path) -> list[str]:
    return ["-m", "specheads", "prepare", "--config", str(recipe), "--no-progress"]


def _digest(out: Path) -> dict:
    """What must be identical: every file's sha256 under features/ and data/ (tokens: the arrow data), the
    manifest's content, the regenerated answers file."""
    files = {}
    for p in sorted((out / "features").iterdir()):
        files[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    for p in sorted((out / "data" / "tokens").glob("*.arrow")):
        files["tokens/" + p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    files["regenerated.jsonl"] = hashlib.sha256((out / "data" / "regenerated.jsonl").read_bytes()).hexdigest()
    return {"files": files, "manifest": json.loads((out / "features" / "manifest.json").read_text())}


def _ok(r) -> None:
    assert r.returncode == 0, (r.stdout[-3000:] + r.stderr[-4000:])


@pytest.mark.slow
def test_two_processes_write_what_one_process_writes(fixture_dir):
    one = _one_process(_recipe(fixture_dir, "one"))
    _ok(one)
    two = _torchrun(_cli(_recipe(fixture_dir, "two")))
    _ok(two)
    a, b = _digest(fixture_dir / "one"), _digest(fixture_dir / "two")
    m = a["manifest"]
    assert m["complete"] and len(m["shards"]) >= 4, "too few shards for both ranks to write some"
    assert all(s.get("targets") for s in m["shards"]), "sidecars missing"
    assert a == b  # byte-identical: shards, sidecars, manifest, tokens, regenerated answers
    assert not (fixture_dir / "two" / "features" / ".parts").exists()
    assert not list((fixture_dir / "two" / "data").glob("regenerated.jsonl.part-*"))
    summary = json.loads((fixture_dir / "two" / "prepare_summary.json").read_text())
    assert summary["processes"] == 2 and summary["features_complete"]
    assert summary["regenerated_new_tokens"] == json.loads(
        (fixture_dir / "one" / "prepare_summary.json").read_text())["regenerated_new_tokens"]
    print(f"wall: 1 process {json.loads((fixture_dir / 'one' / 'prepare_summary.json').read_text())['timings']}"
          f"; 2 processes {summary['timings']}")


@pytest.mark.slow
def test_rank_killed_mid_prepare_then_rerun_completes_identical(fixture_dir):
    ref = fixture_dir / "ref"
    if not ref.exists():
        _ok(_one_process(_recipe(fixture_dir, "ref")))
    recipe = _recipe(fixture_dir, "killed")
    r = _torchrun([WORKER, "--config", str(recipe), "--kill-rank", "1", "--kill-after", "1"])
    assert r.returncode != 0, "rank 1 was to be killed"
    feats = fixture_dir / "killed" / "features"
    m = json.loads((feats / "manifest.json").read_text())
    assert not m["complete"] and len(m["shards"]) < m["planned_shards"]
    # a rerun with one process finishes it: only the missing shards are extracted, the kill's parts are merged
    before = {p.name: p.stat().st_mtime_ns for p in feats.glob("shard-*.safetensors")}
    _ok(_one_process(recipe))
    after = {p.name: p.stat().st_mtime_ns for p in feats.glob("shard-*.safetensors")}
    assert before and all(after[n] == t for n, t in before.items()), "a whole shard was written again"
    assert _digest(fixture_dir / "killed") == _digest(ref)
    assert not (feats / ".parts").exists()


@pytest.mark.slow
def test_ranks_that_do_not_share_the_folder_fail_in_one_line(fixture_dir, tmp_path):
    """Rank 1 gets another output_dir (as another node's local disk would be): every rank stops at the check."""
    recipe = _recipe(fixture_dir, "apart")
    other = tmp_path / "elsewhere"
    wrapper = tmp_path / "apart.py"
    wrapper.write_text(
        "import os, sys\n"
        f"sys.argv = ['specheads', 'prepare', '--config', {str(recipe)!r}, '--no-progress']\n"
        f"if os.environ['RANK'] == '1': sys.argv.append('output_dir={other}')\n"
        "from specheads import cli\nraise SystemExit(cli.main(sys.argv[1:]))\n")
    r = _torchrun([str(wrapper)])
    assert r.returncode != 0
    text = r.stdout + r.stderr
    assert "rank 1 does not see" in text and "one shared filesystem" in text, text[-3000:]
    frames = [ln for ln in text.splitlines() if ln.strip().startswith("File ") and "/specheads/" in ln]
    assert not frames, frames  # our one line; the only traceback is torchrun's own report of the failed ranks
    assert not (fixture_dir / "apart" / "features").exists()  # stopped before anything was written


def test_shard_bytes_depend_only_on_contents(tmp_path):
    """safetensors writes its __metadata__ map in a random key order per call; save_safetensors sorts it, so two
    writes of the same tensors are the same bytes (the cause of the 'not bitwise reproducible' shards)."""
    import torch

    from specheads.train.shards import save_safetensors

    t = {"hidden": torch.arange(12, dtype=torch.bfloat16).view(3, 4), "ids": torch.arange(3, dtype=torch.int32)}
    meta = {"format": "x", "layers": "[4]", "shard_sha256": "ab" * 32, "dtype": "float32"}
    digests = set()
    for n in range(8):
        save_safetensors(t, str(tmp_path / f"{n}.safetensors"), dict(reversed(meta.items()) if n % 2 else meta))
        digests.add(hashlib.sha256((tmp_path / f"{n}.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1
    from safetensors import safe_open

    with safe_open(str(tmp_path / "0.safetensors"), framework="pt") as f:
        assert f.metadata() == meta and torch.equal(f.get_tensor("hidden"), t["hidden"])


def test_checksums_verified_by_rank_zero_only(tiny, tmp_path, monkeypatch):
    """verify_once: the main process hashes every shard; the others only wait, then open the shards by size."""
    from specheads.train import shards
    from specheads.train.dataset import FeatureDataset
    from specheads.train.features import FeatureConfig, write_features

    rows = [{"input_ids": list(range(3, 3 + n)), "loss_mask": [1] * n, "conversation_id": f"c{n}"} for n in
            range(5, 15)]
    m = write_features(tiny, rows, tmp_path, [4], FeatureConfig(shard_tokens=30), progress=False)
    assert len(m["shards"]) >= 2
    hashed, waits = [], []
    real = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda p: hashed.append(p) or real(p))
    shards._VERIFIED.clear()
    ds = FeatureDataset(tmp_path, targets=False)
    ds.verify_once(False, lambda: waits.append(1))  # a rank other than 0
    _ = [ds[i] for i in range(len(ds))]
    assert waits == [1] and hashed == []  # trusted rank 0's check: no re-hash
    shards._VERIFIED.clear()
    victim = tmp_path / m["shards"][0]["file"]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1  # same size, other content
    victim.write_bytes(bytes(data))
    with pytest.raises(shards.SpecheadsError, match="sha256 differs"):
        FeatureDataset(tmp_path, targets=False).verify_once(True, lambda: None)  # rank 0 finds it
