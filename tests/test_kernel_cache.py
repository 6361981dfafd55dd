"""The compiled-kernel cache (specheads/infer/engine/kernel_cache.py), tried with its probe module: a few lines of
portable C++ that build in seconds on any CPU (the bf16 kernels need AVX512-BF16, which this CPU may lack).
One build is shared by the module (`built`); each test copies it into a cache folder of its own, damages it, and
checks that the cache rebuilds it (once, one warning line) or falls back (one line) without a crash. Processes
that must die or race run as `python -m specheads.infer.engine.kernel_cache --probe`."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from specheads.infer.engine import kernel_cache, kernel_upkeep, kernels
from specheads.infer.engine.kernel_cache import PROBE

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 300  # the most a condition polled for may take on a busy 2-core machine (never a timing assertion)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _load(cache: Path, monkeypatch, ext=PROBE):
    """kernel_cache.load(ext) with $SPECHEADS_CACHE = cache -> (module or None, [(level, line)], builds run)."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(cache))
    builds, real = [], kernel_cache._compile_in_child
    monkeypatch.setattr(kernel_cache, "_compile_in_child", lambda args: builds.append(args) or real(args))
    rec = _Records()
    logger = logging.getLogger(kernel_cache.__name__)
    logger.addHandler(rec)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        return kernel_cache.load(ext), rec.lines, len(builds)
    finally:
        logger.removeHandler(rec)
        logger.setLevel(old)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One clean build of the probe into a fresh cache -> (its build folder, the log lines, builds run)."""
    cache = tmp_path_factory.mktemp("probe-cache")
    with pytest.MonkeyPatch.context() as mp:
        mod, lines, builds = _load(cache, mp)
    assert mod is not None and mod.add(2, 3) == 5, lines
    (final,) = [p for p in (cache / "kernels").glob("specheads_probe-*") if p.is_dir()]
    return final, lines, builds


def _copy(built, tmp_path: Path) -> Path:
    """A cache under tmp_path holding the shared build -> that build's folder there."""
    final = tmp_path / "cache" / "kernels" / built[0].name
    shutil.copytree(built[0], final)
    return final


def _warnings(lines):
    return [msg for level, msg in lines if level == "WARNING"]


def test_a_clean_build_then_a_cached_load_that_compiles_nothing(built, tmp_path, monkeypatch):
    final, lines, builds = built
    assert builds == 1 and _warnings(lines) == []
    assert [m for _, m in lines] == [f"kernel cache probe: compiling once into {final} (a few seconds)"]
    manifest = json.loads((final / "manifest.json").read_text())
    so = final / manifest["so"]
    assert manifest["key"] == kernel_cache.build_key(PROBE) and final.name.endswith(manifest["key"][:16])
    assert manifest["size"] == so.stat().st_size and not list(final.glob("*.o")) and not (final / "lock").exists()
    copy = _copy(built, tmp_path)
    mtime = (copy / manifest["so"]).stat().st_mtime_ns
    mod, lines, builds = _load(tmp_path / "cache", monkeypatch)
    assert mod.add(40, 2) == 42 and builds == 0 and lines == []
    assert (copy / manifest["so"]).stat().st_mtime_ns == mtime


def _flip_a_byte(final: Path) -> None:
    so = next(final.glob("*.so"))
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))


def _foreign_torch(final: Path) -> None:
    m = json.loads((final / "manifest.json").read_text())
    (final / "manifest.json").write_text(json.dumps({**m, "torch": "2.5.0+cu121"}))


def _other_cpu_flags(final: Path) -> None:
    m = json.loads((final / "manifest.json").read_text())
    (final / "manifest.json").write_text(json.dumps({**m, "cpu_flags": ["avx512_bf16", "avx512f"]}))


def _not_elf_with_its_manifest(final: Path) -> None:
    """Other bytes of the same size, the manifest's sha256 made to match: checked whole, but dlopen refuses it."""
    so = next(final.glob("*.so"))
    so.write_bytes(b"\0" * so.stat().st_size)
    m = json.loads((final / "manifest.json").read_text())
    (final / "manifest.json").write_text(json.dumps({**m, "sha256": kernel_cache._sha256_file(so)}))


@pytest.mark.parametrize("damage, says", [
    (_flip_a_byte, "is corrupt (its bytes are not those built: sha256 differs); rebuilding it"),
    (_foreign_torch, "is built for torch 2.5.0+cu121 (this is torch "),
    (_other_cpu_flags, "is built for other CPU flags (avx512_bf16 avx512f); rebuilding it"),
    (_not_elf_with_its_manifest, "is not loadable here ("),
], ids=["corrupt bytes", "foreign torch", "other CPU flags", "whole but not loadable"])
def test_a_damaged_or_foreign_build_is_rebuilt_with_one_warning(built, tmp_path, monkeypatch, damage, says):
    final = _copy(built, tmp_path)
    damage(final)
    mod, lines, builds = _load(tmp_path / "cache", monkeypatch)
    assert mod is not None and mod.add(2, 3) == 5 and builds == 1
    (warning,) = _warnings(lines)
    assert warning.startswith(f"kernel cache probe: the build in {final} {says}"), warning
    manifest = json.loads((final / "manifest.json").read_text())
    assert kernel_cache._sha256_file(final / manifest["so"]) == manifest["sha256"]
    assert [p.name for p in final.parent.iterdir() if p.name.startswith(".")] == []  # nothing moved aside is left


def _probe(cache: Path, **env) -> subprocess.Popen:
    """`python -m specheads.infer.engine.kernel_cache --probe` on `cache`; its output goes to the file p.out."""
    out = cache.parent / f"out-{len(list(cache.parent.glob('out-*')))}.txt"
    env = {**os.environ, "SPECHEADS_CACHE": str(cache), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    with open(out, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "specheads.infer.engine.kernel_cache", "--probe"], env=env,
                             stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT, stdin=subprocess.DEVNULL)
    p.out = out
    return p


def _output(p: subprocess.Popen) -> str:
    p.wait(timeout=WAIT_S)
    return p.out.read_text()


def test_a_truncated_so_is_rebuilt_without_a_crash(built, tmp_path):
    """Truncated to half its size (dlopen of such a file once ended the process in SIGBUS): one warning, a rebuild,
    and the process loads the new build."""
    final = _copy(built, tmp_path)
    so = next(final.glob("*.so"))
    size = so.stat().st_size
    os.truncate(so, size // 2)
    p = _probe(tmp_path / "cache")
    out = _output(p)
    assert p.returncode == 0 and "kernel cache probe: loaded, add(2, 3) = 5" in out, out
    assert f"the build in {final} is truncated ({size // 2} of {size} bytes); rebuilding it" in out
    assert out.count("WARNING") == 1 and so.stat().st_size == size


def test_an_unwritable_cache_gets_a_build_for_this_process_only(tmp_path, monkeypatch):
    """$SPECHEADS_CACHE under a regular file (no folder can be made there, root or not): one line, a build in the
    system's temporary folder, loaded, and nothing of it left there."""
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "cache"
    mod, lines, builds = _load(cache, monkeypatch)
    assert mod is not None and mod.add(1, 1) == 2 and builds == 1
    (warning,) = _warnings(lines)
    assert warning.startswith(f"kernel cache probe: {cache / 'kernels'} cannot be written (Not a directory); "
                              "compiling into a temporary folder for this process only"), warning
    import tempfile

    assert list(Path(tempfile.gettempdir()).glob(f"{kernel_cache._PRIVATE}{os.getpid()}-*")) == []


def test_no_compiler_is_one_line_and_none(built, tmp_path, monkeypatch):
    """CXX naming a missing binary, PATH without c++: one line naming it and what runs instead; a build already in
    the cache still loads (no compiler is needed once built)."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("PATH", str(tmp_path))
    mod, lines, builds = _load(tmp_path / "empty", monkeypatch)
    assert mod is None and builds == 0
    assert [m for _, m in lines] == [f"kernel cache probe: no C++ compiler (CXX={tmp_path / 'no-such-c++'} is not "
                                     f"found), so it cannot be compiled; {PROBE.fallback}"]
    _copy(built, tmp_path)
    mod, lines, builds = _load(tmp_path / "cache", monkeypatch)
    assert mod.add(2, 2) == 4 and lines == [] and builds == 0


def _slow_compiler(tmp_path: Path) -> tuple[dict, Path, Path]:
    """A `g++` that counts its compile calls and holds each until a release file appears -> (env, count, release)."""
    count, release, cxx = tmp_path / "compiles.txt", tmp_path / "release", tmp_path / "bin" / "g++"
    cxx.parent.mkdir()
    cxx.write_text(f"""#!/bin/sh
case " $* " in *" -c "*) echo "$$" >> {count}; i=0
  while [ ! -e {release} ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done;; esac
exec {shutil.which('c++')} "$@"
""")
    cxx.chmod(0o755)
    return {"CXX": str(cxx)}, count, release


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.2)


def test_two_processes_on_an_empty_cache_build_once_and_both_load(tmp_path):
    env, count, release = _slow_compiler(tmp_path)
    cache = tmp_path / "cache"
    procs = [_probe(cache, **env) for _ in range(2)]
    outs = [p.out for p in procs]
    _until(lambda: any("waiting for it" in o.read_text() for o in outs), "a second process waiting")
    release.touch()
    texts = [_output(p) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], texts
    assert all("kernel cache probe: loaded, add(2, 3) = 5" in t for t in texts)
    assert len(count.read_text().split()) == 1  # one compile of probe.cpp in all
    builder, waiter = sorted(texts, key=lambda t: "waiting for it" in t)
    assert "compiling once into" in builder and "compiling" not in waiter.replace("is compiling", "")
    assert "another process (pid " in waiter


def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next_run(tmp_path):
    """SIGKILL while the compiler runs: the next run takes the lock (the OS released it), removes the dead build
    folder, builds and loads; nothing waits on a lock file left behind."""
    env, count, release = _slow_compiler(tmp_path)
    cache = tmp_path / "cache"
    first = _probe(cache, **env)
    _until(count.exists, "the first compile starting")
    (dead,) = (cache / "kernels").glob(".specheads_probe-*.build-*")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=WAIT_S)
    release.touch()
    second = _probe(cache)
    out = _output(second)
    assert second.returncode == 0 and "kernel cache probe: loaded, add(2, 3) = 5" in out, out
    assert "compiling once into" in out and "waiting" not in out
    assert not dead.exists() and [p.name for p in (cache / "kernels").iterdir() if p.name.startswith(".")] == []


def test_the_key_follows_the_sources_torch_and_flags(tmp_path):
    """Another byte of source, another flag or CPU flag: another key (a folder of its own); the same inputs: the same
    key. kernels.build_key is the bf16 kernels' (the cost profiles' machine key holds it)."""
    src = tmp_path / "a.cpp"
    src.write_text("int x;\n")
    ext = kernel_cache.Extension(name="m", files=(src,), cflags=("-O2",))
    key = kernel_cache.build_key(ext)
    assert kernel_cache.build_key(ext) == key
    others = {kernel_cache.build_key(kernel_cache.Extension(name="m", files=(src,), cflags=("-O3",))),
              kernel_cache.build_key(kernel_cache.Extension(name="m", files=(src,), cflags=("-O2",),
                                                            cpu_flags=("avx2",)))}
    src.write_text("int y;\n")
    others.add(kernel_cache.build_key(ext))
    assert key not in others and len(others) == 3
    assert kernels.build_key() == kernel_cache.build_key(kernels.EXTENSION)[:16]


def test_the_csrc_files_ship_as_package_data():
    """Every file the kernels and the probe are built from matches pyproject's package-data for the engine."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["specheads.infer.engine"]
    engine = Path(kernels.__file__).parent
    for f in (*kernels.EXTENSION.files, *PROBE.files):
        assert f.is_file() and any(fnmatch(str(f.relative_to(engine)), g) for g in globs), f


def _failing_compiler(tmp_path: Path) -> tuple[dict, Path]:
    """A `g++` that counts its compile calls and fails each with a compiler's error line -> (env, count)."""
    count, cxx = tmp_path / "failing-compiles.txt", tmp_path / "failing" / "g++"
    cxx.parent.mkdir()
    cxx.write_text(f"""#!/bin/sh
case " $* " in *" -c "*) echo "$$" >> {count}; echo "probe.cpp:1:1: error: this compiler refuses it" >&2; exit 1;; esac
exec {shutil.which('c++')} "$@"
""")
    cxx.chmod(0o755)
    return {"CXX": str(cxx)}, count


def _compiles(count: Path) -> int:
    return len(count.read_text().split()) if count.exists() else 0


def _skipped_line(record: Path) -> str:
    return f"; recorded in {record}); {PROBE.fallback}. To try again: SPECHEADS_KERNELS_RETRY=1, or delete that file"


def test_a_failed_build_is_recorded_and_not_retried_until_asked(tmp_path, monkeypatch):
    """A compiler that fails on the sources: one warning and a record beside the key's folder; the next run calls
    no compiler (one info line naming the record); SPECHEADS_KERNELS_RETRY=1 or a new key compiles again."""
    env, count = _failing_compiler(tmp_path)
    monkeypatch.setenv("CXX", env["CXX"])
    monkeypatch.delenv("SPECHEADS_KERNELS_RETRY", raising=False)
    cache = tmp_path / "cache"
    mod, lines, builds = _load(cache, monkeypatch)
    assert mod is None and builds == 1 and _compiles(count) == 1
    (warning,) = _warnings(lines)
    assert "compiling failed (probe.cpp:1:1: error: this compiler refuses it)" in warning, warning
    final = cache / "kernels" / f"specheads_probe-{kernel_cache.build_key(PROBE)[:16]}"
    record_path = final.with_name(f"{final.name}.failed.json")
    record = json.loads(record_path.read_text())
    assert record["key"] == kernel_cache.build_key(PROBE) and record["compiler"] == env["CXX"]
    assert record["reason"] == "probe.cpp:1:1: error: this compiler refuses it" and record["missing_tools"] is False
    assert not final.exists() and [p.name for p in final.parent.iterdir() if p.name.startswith(".")] == []

    mod, lines, builds = _load(cache, monkeypatch)
    assert mod is None and builds == 0 and _compiles(count) == 1
    ((level, line),) = lines
    assert level == "INFO" and line.startswith("kernel cache probe: not compiled: its build failed here before "
                                               "(probe.cpp:1:1: error: this compiler refuses it")
    assert line.endswith(_skipped_line(record_path)), line

    monkeypatch.setenv("SPECHEADS_KERNELS_RETRY", "1")
    mod, lines, builds = _load(cache, monkeypatch)
    assert mod is None and builds == 1 and _compiles(count) == 2 and len(_warnings(lines)) == 1
    monkeypatch.setenv("SPECHEADS_KERNELS_RETRY", "0")  # "0" / "off" / "no": not a retry
    assert _load(cache, monkeypatch)[2] == 0 and _compiles(count) == 2

    other = dataclasses.replace(PROBE, cflags=("-O1",))  # a new key: another folder, built once
    mod, lines, builds = _load(cache, monkeypatch, other)
    assert mod is None and builds == 1 and _compiles(count) == 3
    assert _load(cache, monkeypatch, other)[2] == 0 and _compiles(count) == 3


def test_no_compiler_is_recorded_until_one_is_there(tmp_path, monkeypatch):
    """No compiler: the warning once, then one info line; a compiler since (here one that fails) compiles again."""
    env, count = _failing_compiler(tmp_path)  # made while c++ is on PATH
    path = os.environ["PATH"]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SPECHEADS_KERNELS_RETRY", raising=False)
    cache = tmp_path / "cache"
    mod, lines, builds = _load(cache, monkeypatch)
    assert mod is None and builds == 0 and len(_warnings(lines)) == 1
    (record_path,) = (cache / "kernels").glob("specheads_probe-*.failed.json")
    assert json.loads(record_path.read_text())["missing_tools"] is True
    mod, lines, builds = _load(cache, monkeypatch)
    assert mod is None and builds == 0 and _warnings(lines) == [] and len(lines) == 1
    assert lines[0][1].endswith(_skipped_line(record_path)) and "no C++ compiler (CXX=" in lines[0][1]

    monkeypatch.setenv("CXX", env["CXX"])
    monkeypatch.setenv("PATH", path)
    mod, lines, builds = _load(cache, monkeypatch)
    assert mod is None and builds == 1 and _compiles(count) == 1, lines
    assert json.loads(record_path.read_text())["missing_tools"] is False


def test_a_cache_that_cannot_record_the_failure_falls_back_each_run(tmp_path, monkeypatch):
    """$SPECHEADS_CACHE under a regular file and no compiler: the record cannot be written; each run is the one
    warning and None, as before records, and nothing raises."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "file").write_text("")
    for _ in range(2):
        mod, lines, builds = _load(tmp_path / "file" / "cache", monkeypatch)
        assert mod is None and builds == 0 and len(_warnings(lines)) == 1 and len(lines) == 1


def test_a_build_prunes_older_keys_but_not_the_current_a_locked_or_a_recent_one(built, tmp_path, monkeypatch):
    """After a build: another key's folder, log and record last used over PRUNE_AGE_S before it are removed; one whose
    lock a process holds and one used recently stay, as do the lock files; the current key's stale record (written
    under another compiler) is removed by the build."""
    monkeypatch.delenv("CXX", raising=False)
    root = tmp_path / "cache" / "kernels"
    root.mkdir(parents=True)
    old = time.time() - kernel_upkeep.PRUNE_AGE_S - 3600
    folders = {}
    for tag, key in (("stale", "0" * 16), ("locked", "1" * 16), ("recent", "2" * 16)):
        folders[tag] = root / f"specheads_probe-{key}"
        shutil.copytree(built[0], folders[tag])
    extras = [root / f"specheads_probe-{'0' * 16}.log", root / f"specheads_probe-{'0' * 16}.failed.json"]
    for p in extras:
        p.write_text("{}")
    foreign = root / f"other_kernel-{'3' * 16}"  # another name's build: never this one's to prune
    shutil.copytree(built[0], foreign)
    for p in (folders["stale"], folders["locked"], foreign, *extras):
        os.utime(p, (old, old))
    current = root / f"specheads_probe-{kernel_cache.build_key(PROBE)[:16]}"
    stale_record = current.with_name(f"{current.name}.failed.json")
    stale_record.write_text(json.dumps({"layout": 1, "key": kernel_cache.build_key(PROBE), "reason": "x",
                                        "compiler": "another-c++", "missing_tools": False, "time": "then"}))
    with kernel_upkeep.Lock(root / f"specheads_probe-{'1' * 16}.lock") as held:
        assert held.try_take()
        mod, lines, builds = _load(tmp_path / "cache", monkeypatch)
    assert mod is not None and mod.add(2, 3) == 5 and builds == 1 and _warnings(lines) == []
    assert not folders["stale"].exists() and not any(p.exists() for p in extras)
    assert folders["locked"].is_dir() and folders["recent"].is_dir() and foreign.is_dir() and current.is_dir()
    assert not stale_record.exists() and (root / f"specheads_probe-{'0' * 16}.lock").exists()
    mod, lines, builds = _load(tmp_path / "cache", monkeypatch)  # the current key loads, nothing rebuilt
    assert mod is not None and builds == 0 and lines == []


def test_a_load_marks_its_build_used_for_pruning(built, tmp_path, monkeypatch):
    """A cached load refreshes its folder's mtime (its last use, which pruning goes by) where it is over TOUCH_S old,
    and leaves it alone within TOUCH_S (no write on every load)."""
    final = _copy(built, tmp_path)
    then = time.time() - kernel_upkeep.TOUCH_S - 3600
    os.utime(final, (then, then))
    assert _load(tmp_path / "cache", monkeypatch)[2] == 0
    refreshed = final.stat().st_mtime
    assert refreshed > then + kernel_upkeep.TOUCH_S
    recent = refreshed - 60
    os.utime(final, (recent, recent))
    assert _load(tmp_path / "cache", monkeypatch)[2] == 0 and final.stat().st_mtime == recent
