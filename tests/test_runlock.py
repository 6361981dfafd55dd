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
