"""The OS refusing a write (full disk, file too large, read-only, permission denied) is one line naming the path and
what was kept, temporaries are removed, nothing half-written is left where a later run reads (issue 28); and the
other inputs of that issue: non-UTF-8 datasets, `export --out .`, targets that would run code, --head with '='."""
from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.utils import SpecheadsError, WriteError, atomic_dir, atomic_write_json

ROOT = Path(__file__).resolve().parents[1]


def _cli(*argv) -> tuple[int, str]:
    from specheads import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main([str(a) for a in argv])
    return rc, err.getvalue()


def _head(tiny, folder: Path) -> Path:
    from specheads.heads import HeadSpec, build_head

    build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), tiny).save_pretrained(folder)
    return folder


def _temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if ".tmp" in p.name]


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ------------------------------------------------------------------------------------------------ a full disk

def test_export_past_the_file_size_limit_is_one_line_and_leaves_nothing(tiny, tmp_path):
    """A real EFBIG: the export runs in a child whose file size limit (`ulimit -f`, SIGXFSZ ignored) is below the
    size of the weights it writes."""
    head = _head(tiny, tmp_path / "h")
    limit = (head / "model.safetensors").stat().st_size // 2

    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    p = subprocess.run([sys.executable, "-m", "specheads", "export", "--head", str(head), "--format", "eagle3",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, preexec_fn=cap,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}, timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert last == (f"specheads export: error: {tmp_path / 'out'}: cannot write: File too large [EFBIG]; nothing "
                    f"was written at {tmp_path / 'out'} (its temporary folder removed)")
    assert not (tmp_path / "out").exists() and _temporaries(tmp_path) == []


def test_a_full_disk_keeps_the_earlier_export(tiny, tmp_path, monkeypatch):
    head = _head(tiny, tmp_path / "h")
    assert _cli("export", "--head", head, "--format", "eagle3", "--out", tmp_path / "out")[0] == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    monkeypatch.setattr("safetensors.torch.save_file", _safetensors_full)
    rc, err = _cli("export", "--head", head, "--format", "eagle3", "--out", tmp_path / "out")
    assert rc == 2 and err.strip().endswith(f"{tmp_path / 'out'}: cannot write: No space left on device [ENOSPC]; "
                                            f"{tmp_path / 'out'} was left as it was (its temporary folder removed)")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert _temporaries(tmp_path) == []


def _safetensors_full(tensors, filename, metadata=None):
    """What safetensors raises on a full disk, after writing part of the file."""
    from safetensors import SafetensorError

    Path(filename).write_bytes(b"partial")
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


class _Acc:
    """The parts of accelerate.Accelerator that save_checkpoint uses, for one process."""

    is_main_process, process_index, num_processes, step = True, 0, 1, 0

    def __init__(self):
        from accelerate.utils import DistributedType

        self.distributed_type = DistributedType.NO

    def wait_for_everyone(self):
        pass

    def unwrap_model(self, m):
        return m


def test_checkpoint_save_on_a_full_disk_removes_the_partial_one_and_keeps_the_earlier(tmp_path, monkeypatch):
    import torch

    from specheads.train import checkpoint as C

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    C.save_checkpoint(_Acc(), model, opt, sched, C.TrainState(step=1), {}, tmp_path, keep_last=3)
    earlier = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints" / "step-000001").iterdir()}
    monkeypatch.setattr("safetensors.torch.save_file", _safetensors_full)
    with pytest.raises(WriteError) as e:
        C.save_checkpoint(_Acc(), model, opt, sched, C.TrainState(step=2), {}, tmp_path, keep_last=3)
    assert str(e.value) == (f"{tmp_path}/checkpoints/step-000002: cannot write: No space left on device [ENOSPC]; "
                            f"the partial checkpoint was removed; the 1 earlier checkpoint(s) in {tmp_path}/"
                            f"checkpoints are kept (free space, then continue with --resume)")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoints" / "step-000001").iterdir()} == earlier
    assert [p.name for p in C.list_checkpoints(tmp_path)] == ["step-000001"]


@pytest.mark.parametrize("evals", ["at_start", "every_step"])
def test_a_full_disk_at_the_first_checkpoint_gives_advice_the_next_train_accepts(tiny, tmp_path, monkeypatch, evals):
    """issue 38: the first save failing on a full disk advised "free space, then train again", which train then
    refused because of the untrained step-0 best/ the run had written. That best/ holds nothing trained and goes;
    a best/ of a later step is kept and the advice names another output_dir. Either way the advice is accepted."""
    from test_train import make_head, make_recipe, token_samples

    from specheads.train import checkpoint as C
    from specheads.train.trainer import Trainer

    over = ["train.max_steps=4", "train.save_every=2"] + (
        ["eval.at_start=true", "eval.every_steps=0"] if evals == "at_start" else
        ["eval.at_start=false", "eval.every_steps=1"])
    r = make_recipe(tmp_path / "run", *over)
    monkeypatch.setattr(C, "write_model_state", _enospc)
    with pytest.raises(WriteError) as e:
        Trainer(r, tiny, make_head(r, tiny), token_samples(8), token_samples(2, seed=1)).train()
    monkeypatch.undo()
    best = tmp_path / "run" / "best"
    if evals == "at_start":
        assert str(e.value).endswith("there is no earlier one (free space, then train again)")
        assert not best.exists()
        r2 = r  # "train again": the same folder is accepted
    else:
        assert str(e.value).endswith(f"there is no earlier one (free space, then train again into another "
                                     f"output_dir: {best} keeps the head of step 1)")
        assert (best / "model.safetensors").exists()
        r2 = make_recipe(tmp_path / "other", *over)
    assert Trainer(r2, tiny, make_head(r2, tiny), token_samples(8), token_samples(2, seed=1)).train().steps == 4


def test_feature_shard_on_a_full_disk_keeps_the_listed_shards_only(tiny, tmp_path, monkeypatch):
    from test_features import _rows

    from specheads.train.features import FeatureConfig, write_features

    real, calls = __import__("safetensors.torch", fromlist=["save_file"]).save_file, []

    def second_fails(tensors, filename, metadata=None):
        calls.append(filename)
        return (_safetensors_full if len(calls) == 2 else real)(tensors, filename, metadata=metadata)

    monkeypatch.setattr("safetensors.torch.save_file", second_fails)
    with pytest.raises(WriteError, match=r"shard-00001.safetensors: cannot write: No space left on device \[ENOSPC\]"
                                         r"; the 1 shard\(s\) written before are kept \(listed in manifest.json\)"):
        write_features(tiny, _rows(9), tmp_path, [2, tiny.num_layers], FeatureConfig(shard_tokens=60),
                       progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["shard-00000.safetensors"] and not manifest["complete"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard-00000.safetensors"]


def test_atomic_write_json_on_a_full_disk_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"v": 1})
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(WriteError) as e:
        atomic_write_json(path, {"v": 2})
    assert str(e.value) == f"{path}: cannot write: No space left on device [ENOSPC]; its previous content is kept"
    assert json.loads(path.read_text()) == {"v": 1} and _temporaries(tmp_path) == []


# ------------------------------------------------------------------------------------ read-only, no permission

@pytest.mark.parametrize("code, text", [(errno.EROFS, "Read-only file system [EROFS]"),
                                        (errno.EACCES, "Permission denied [EACCES]")])
def test_a_folder_that_refuses_writes_is_one_error_naming_it(tmp_path, monkeypatch, code, text):
    """Monkeypatched (the tests run as root, where chmod does not stop writes; the chmod test below runs where it
    does): mkdtemp in the parent refuses."""
    import tempfile

    def refuse(*a, dir=None, **k):
        raise OSError(code, os.strerror(code), str(dir))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(WriteError) as e:
        with atomic_dir(tmp_path / "out"):
            pass
    assert str(e.value) == f"{tmp_path}: cannot write: {text}; nothing was written at {tmp_path / 'out'}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 folder (the monkeypatched test covers it)")
def test_a_read_only_folder_by_chmod(tiny, tmp_path):
    head = _head(tiny, tmp_path / "h")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        rc, err = _cli("export", "--head", head, "--format", "eagle3", "--out", tmp_path / "ro" / "out")
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert rc == 2 and "cannot write: Permission denied [EACCES]" in err.strip().splitlines()[-1]


def test_the_cli_turns_a_write_refusal_into_one_line_and_keeps_other_tracebacks(monkeypatch):
    from specheads import cli

    def raising(exc):
        def run(args):
            raise exc
        return run

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["eval"].set_defaults(_run=raising(OSError(errno.ENOSPC, "No space left on device", "/x/y.json")))
    assert _cli("eval", "--head", "h") == (
        2, "specheads eval: error: /x/y.json: cannot write: No space left on device [ENOSPC]\n")
    sub.choices["eval"].set_defaults(_run=raising(FileNotFoundError(errno.ENOENT, "gone", "/x")))
    with pytest.raises(FileNotFoundError):  # not the machine refusing a write: a bug, its traceback stays
        _cli("eval", "--head", "h")


# ---------------------------------------------------------------------------------------- the other inputs

def test_non_utf8_dataset_names_the_file_and_row(tmp_path):
    from specheads.cli import _not_utf8
    from specheads.conversations.load import load_conversations

    good = b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}\n'
    (tmp_path / "d.jsonl").write_bytes(good * 2 + good.replace(b"hi", b"hi \xff"))
    with pytest.raises(UnicodeDecodeError) as e:
        load_conversations(str(tmp_path / "d.jsonl"))
    assert _not_utf8(e.value) == (f"{tmp_path / 'd.jsonl'}: not UTF-8 text: line 3 (row 2) has byte 0xff "
                                  f"(invalid start byte)")


@pytest.mark.parametrize("name", ["d.jsonl", "d.json"])
def test_a_dataset_that_is_one_endless_line_is_refused_with_bounded_memory(tmp_path, monkeypatch, name):
    """issue 38: a data source that is one endless line (a device, a pipe) grew memory until it failed. Each row
    (a JSONL line, a JSON array's element) is read at most utils.MAX_TEXT_BYTES characters, then refused."""
    import specheads.utils
    from specheads.conversations.load import load_conversations

    monkeypatch.setattr(specheads.utils, "MAX_TEXT_BYTES", 1 << 20)
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")  # endless NUL characters, valid UTF-8, no newline ever
    if name == "d.json":  # an array whose first element never ends: '[{"a": "' then the endless device
        endless = tmp_path / name
        endless.write_text('[{"conversations": "' + "x" * (6 << 20))  # past the first 4 Mi chunk
        want = r"not valid JSON at line 1, column 2: an element longer than 1 Mi characters"
    else:
        (tmp_path / name).symlink_to(zero)
        want = r"line 1 is longer than 1 Mi characters \(read no further"
    with pytest.raises(SpecheadsError, match=rf"^{tmp_path / name}: {want}"):
        load_conversations(str(tmp_path / name))


def test_other_inputs_read_whole_are_bounded_too(tmp_path, monkeypatch):
    """A data.mode text .txt file (one row, read whole) past its bound, and an endless device behind a target's
    config.json: refused naming the file, not read forever."""
    import specheads.conversations.load as load
    import specheads.utils
    from specheads.target import check_target_folder

    monkeypatch.setattr(load, "MAX_CORPUS_CHARS", 1 << 20)
    monkeypatch.setattr(specheads.utils, "MAX_TEXT_BYTES", 1 << 20)
    (tmp_path / "corpus.txt").write_text("x" * (2 << 20))  # past the (lowered) bound
    with pytest.raises(SpecheadsError, match=rf"^{tmp_path / 'corpus.txt'}: more than 1 Mi characters in one .txt"):
        load.load_texts(str(tmp_path / "corpus.txt"))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").symlink_to("/dev/zero")
    with pytest.raises(SpecheadsError, match=rf"^{tmp_path / 't' / 'config.json'}: more than 1 MiB"):
        check_target_folder(tmp_path / "t", "t", False)


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_a_dataset_that_is_a_folder_is_one_line(tmp_path, capsys, command):
    """issue 38: --dataset naming a folder raised IsADirectoryError (prepare's data.source already said it)."""
    from specheads.cli import main

    (tmp_path / "d").mkdir()
    argv = {"eval": ["eval", "--head", str(tmp_path / "h")], "bench": ["bench", "--out", str(tmp_path / "b")]}
    rc = main(argv[command] + ["--dataset", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"specheads {command}: error: --dataset {tmp_path / 'd'}: is a folder; expected a "
                               f"JSONL file (one prompt per line)")


@pytest.mark.parametrize("force", [False, True])
def test_export_out_dot_is_refused_and_the_folder_kept(tiny, tmp_path, monkeypatch, force):
    head = _head(tiny, tmp_path / "h")
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "mine.txt").write_text("keep")
    monkeypatch.chdir(tmp_path / "here")
    rc, err = _cli("export", "--head", head, "--format", "eagle3", "--out", ".", *(["--force"] if force else []))
    assert rc == 2 and f"--out .: is the current folder ({tmp_path / 'here'})" in err.strip().splitlines()[-1]
    assert sorted(os.listdir(".")) == ["mine.txt"]
    rc, err = _cli("export", "--head", head, "--format", "eagle3", "--out", "..", "--force")
    assert rc == 2 and "contains the source folder" in err


def test_targets_that_would_run_code_are_refused(tmp_path):
    from specheads.target import check_target_folder

    rc = tmp_path / "rc"
    rc.mkdir()
    (rc / "config.json").write_text(json.dumps({"auto_map": {"AutoModelForCausalLM": "m.X"}}))
    with pytest.raises(SpecheadsError, match=r"maps its classes to code in the folder .*target.trust_remote_code"):
        check_target_folder(rc, "rc", trust_remote_code=False)
    check_target_folder(rc, "rc", trust_remote_code=True)  # asked for: transformers runs it
    pk = tmp_path / "pk"
    pk.mkdir()
    (pk / "config.json").write_text("{}")
    (pk / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(SpecheadsError, match=r"holds its weights only as pickles \(pytorch_model.bin\)"):
        check_target_folder(pk, "pk", trust_remote_code=False)
    (pk / "model.safetensors").write_bytes(b"")
    check_target_folder(pk, "pk", trust_remote_code=False)  # safetensors beside it: those are read


def test_head_values_holding_equals(tiny, tmp_path):
    from specheads.infer.bench.names import head_entries, split_head
    from specheads.commands.generate import drafter_source

    folder = _head(tiny, tmp_path / "a=b" / "head")
    assert split_head(str(folder)) == ("", str(folder))  # the whole text is a folder: used whole
    assert split_head(f"mine={folder}") == ("mine", str(folder))
    assert head_entries([str(folder)]) == {"head": str(folder)}
    assert head_entries([f"x={folder}", str(folder)]) == {"head:x": str(folder), "head:eagle3": str(folder)}
    with pytest.raises(SpecheadsError, match="a folder whose own path holds '=' is used whole"):
        split_head(str(tmp_path / "c=d" / "head"))
    assert drafter_source(argparse.Namespace(head=str(folder)))[0] == "eagle3"
    with pytest.raises(SpecheadsError, match=f"not LABEL=DIR \\(as bench does\\): --head {folder}"):
        drafter_source(argparse.Namespace(head=f"mine={folder}"))
