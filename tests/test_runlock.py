"""One writer per run folder: a lock held by a live process refuses a second one with its pid and command named, a
stale lock of a dead process is taken over with a warning, and the lock goes on exit, exceptions included."""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys

import pytest

from specheads.runlock import LOCK_NAME, lock_path, run_lock
from specheads.utils import SpecheadsError


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _plant(path, pid: int, command: str = "specheads train", **extra) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "command": command, "host": socket.gethostname(),
                                "started": "2024-01-01T00:00:00+0000", **extra}))


def test_a_live_holder_refuses_a_second_process(tmp_path, sleeper):
    run = tmp_path / "run"
    _plant(run / LOCK_NAME, sleeper.pid)
    with pytest.raises(SpecheadsError, match=rf"in use by pid {sleeper.pid} \(specheads train") as e:
        with run_lock(run, "prepare"):
            pass
    assert "\n" not in str(e.value) and str(run) in str(e.value)
    assert (run / LOCK_NAME).exists(), "the holder's lock was removed"


def test_the_same_process_cannot_take_it_twice_and_release_follows(tmp_path):
    run = tmp_path / "run"
    with run_lock(run, "train") as path:
        held = json.loads(path.read_text())
        assert held["command"] == "specheads train" and held["host"] == socket.gethostname()
        with pytest.raises(SpecheadsError, match=rf"pid {held['pid']} \(specheads train"):
            with run_lock(run, "export"):
                pass
        assert path.exists()
    assert not path.exists()
    with run_lock(run, "train"):  # free again
        pass


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    run = tmp_path / "run"
    dead = _dead_pid()
    _plant(run / LOCK_NAME, dead, "specheads prepare")
    with caplog.at_level(logging.WARNING, logger="specheads.runlock"):
        with run_lock(run, "train") as path:
            assert json.loads(path.read_text())["command"] == "specheads train"
    assert any("stale lock" in r.getMessage() and str(dead) in r.getMessage() for r in caplog.records)
    assert not (run / LOCK_NAME).exists()
    assert not list(run.glob(f"{LOCK_NAME}*")), "temporary or moved-aside lock files left"


def test_a_reused_pid_and_an_unreadable_lock_are_stale(tmp_path, sleeper):
    run = tmp_path / "run"
    _plant(run / LOCK_NAME, sleeper.pid, pid_start=1)  # the pid runs, but it is another process than the holder's
    with run_lock(run, "train"):
        pass
    (run / LOCK_NAME).write_text("")  # not a lock we write (ours are linked into place whole)
    with run_lock(run, "train"):
        pass
    assert not (run / LOCK_NAME).exists()


def test_released_after_an_exception_and_created_folders_removed(tmp_path):
    run = tmp_path / "a" / "run"
    with pytest.raises(RuntimeError):
        with run_lock(run, "prepare"):
            assert (run / LOCK_NAME).exists()
            raise RuntimeError("boom")
    assert not run.exists() and not (tmp_path / "a").exists(), "folders made only for the lock were left"
    with run_lock(run, "prepare"):
        (run / "x.json").write_text("{}")
    assert (run / "x.json").exists() and not (run / LOCK_NAME).exists()


def test_ranks_other_than_0_take_no_lock(tmp_path, monkeypatch, sleeper):
    run = tmp_path / "run"
    _plant(run / LOCK_NAME, sleeper.pid)
    monkeypatch.setenv("RANK", "1")
    with run_lock(run, "train") as path:
        assert path is None
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SpecheadsError):
        with run_lock(run, "train"):
            pass


def test_export_into_a_locked_folder_is_one_line_and_exit_2(tmp_path, sleeper, capsys):
    from specheads.cli import main

    out = tmp_path / "out"
    lock = lock_path(out, beside=True)
    assert lock == tmp_path / f".out{LOCK_NAME}"
    _plant(lock, sleeper.pid, "specheads export")
    (tmp_path / "head").mkdir()
    rc = main(["export", "--head", str(tmp_path / "head"), "--format", "eagle3", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("specheads export: error: ") and "\n" not in err
    assert f"in use by pid {sleeper.pid} (specheads export" in err
    assert lock.exists() and not out.exists()


@pytest.mark.parametrize("command", ["train", "prepare"])
def test_train_and_prepare_into_a_locked_run_are_one_line_and_exit_2(tmp_path, sleeper, capsys, command):
    from pathlib import Path

    from specheads.cli import main

    recipe = Path(__file__).resolve().parents[1] / "configs" / "eagle3-smollm2.yaml"
    run = tmp_path / "run"
    _plant(run / LOCK_NAME, sleeper.pid, "specheads train")
    before = sorted(p.name for p in run.iterdir())
    argv = [command, "--config", str(recipe), f"output_dir={run}"] + (["--no-progress"] if command == "prepare" else [])
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert err == (f"specheads {command}: error: {run}: in use by pid {sleeper.pid} (specheads train, started "
                   f"2024-01-01T00:00:00+0000; lock {run / LOCK_NAME}); wait for it to finish, or use another folder")
    assert sorted(p.name for p in run.iterdir()) == before


def _trained_run(tiny, run):
    """A run folder as train leaves it (a head in final/, a checkpoint folder), for the replace tests."""
    from specheads.heads import HeadSpec, build_head

    build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), tiny).save_pretrained(run / "final")
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "checkpoints" / "step-000001" / "trainer_state.json").write_text("{}")
    return sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))


@pytest.mark.parametrize("out", ["run", "."])
def test_export_force_never_replaces_a_folder_a_live_train_holds(tiny, tmp_path, sleeper, capsys, out):
    """issue 38: `export --force --out RUN` while train runs in RUN (its lock inside RUN, the export's beside it)
    deleted the run; now the lock inside the folder, or in any folder below it, refuses the export, --force or
    not, and the run is kept file for file."""
    from specheads.cli import main
    from specheads.heads import HeadSpec, build_head

    run = tmp_path / "runs" / "run"
    before = _trained_run(tiny, run)
    _plant(run / LOCK_NAME, sleeper.pid, "specheads train")
    build_head(HeadSpec(kind="eagle3", feature_layers=[1, 2, 3]), tiny).save_pretrained(tmp_path / "head")
    dest = run if out == "run" else tmp_path / "runs"
    rc = main(["export", "--head", str(tmp_path / "head"), "--format", "eagle3", "--out", str(dest), "--force"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and f"in use by pid {sleeper.pid} (specheads train" in err
    assert ("below it" in err) == (out == ".")
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == sorted(before + [LOCK_NAME])
    assert not list(tmp_path.rglob(".*.tmp-*")) and not list(tmp_path.rglob(".*.old-*"))


def test_atomic_dir_checks_the_lock_again_at_its_rename(tmp_path, sleeper):
    """A train that starts in the folder while it is being written: the rename refuses, the folder is kept."""
    from specheads.utils import atomic_dir

    out = tmp_path / "run"
    out.mkdir()
    (out / "mine.txt").write_text("x")
    with pytest.raises(SpecheadsError, match=f"in use by pid {sleeper.pid}"):
        with atomic_dir(out) as tmp:
            (tmp / "new.txt").write_text("y")
            _plant(out / LOCK_NAME, sleeper.pid, "specheads train")
    assert (out / "mine.txt").exists() and not (out / "new.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_train_is_refused_while_an_export_replaces_its_folder(tmp_path, sleeper):
    """The other order: an export holds the lock beside RUN; a train or prepare into RUN is refused (each writer
    honours the folder's other lock place), and takes no lock of its own."""
    run = tmp_path / "run"
    run.mkdir()
    _plant(lock_path(run, beside=True), sleeper.pid, "specheads export")
    with pytest.raises(SpecheadsError, match=rf"{run}: in use by pid {sleeper.pid} \(specheads export"):
        with run_lock(run, "train"):
            pass
    assert not (run / LOCK_NAME).exists()


def test_the_first_write_on_a_full_disk_names_the_lock_file(tmp_path, monkeypatch):
    """A disk already full fails the lock, the first thing every command writes: the error names it."""
    import errno
    import os

    real = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(SpecheadsError) as e:
        with run_lock(tmp_path / "run", "prepare"):
            pass
    monkeypatch.setattr(os, "fsync", real)
    assert str(e.value) == (f"{tmp_path / 'run' / LOCK_NAME}: cannot write: No space left on device [ENOSPC]; "
                            f"the command did not start (nothing was written)")
    assert not (tmp_path / "run").exists()


def test_sigterm_unwinds_like_ctrl_c_one_line_and_the_lock_released(tmp_path, capsys, monkeypatch):
    """issue 38: SIGTERM ended a command where it stood (no message, the lock left behind). The CLI turns it into
    Interrupted, which unwinds as Ctrl-C does: the lock is released, one line, exit 128 + 15; the handler that was
    there before comes back."""
    import os
    import signal
    import time

    import specheads.commands.export as export_cmd
    from specheads.cli import main

    def run(args):
        with run_lock(tmp_path / "run", "export") as lock:
            assert lock.exists()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the signal lands here
        return 0

    monkeypatch.setattr(export_cmd, "run", run)
    before = signal.getsignal(signal.SIGTERM)
    rc = main(["export", "--head", "h", "--format", "eagle3", "--out", "o"])
    assert rc == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "specheads export: interrupted (SIGTERM)"
    assert not (tmp_path / "run").exists() and signal.getsignal(signal.SIGTERM) == before
