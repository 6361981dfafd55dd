"""Reliability sweep, round four (issue 49): the compiled kernel cache: corrupt, truncated, foreign or half-built kernels, a read-only cache, no compiler, a recorded failed build, pruned older builds.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format (area, name, argv, rc, expect, risk from
reliability_doc.RISKS, optional setup / check / run / during); `h` is the sweep's HELPERS namespace.
The bf16 kernels need AVX512-BF16, which the sweep's machine may lack, and the CLI cannot reach the cache
otherwise: each case runs `python -m specheads.infer.engine.kernel_cache --probe` in fresh processes, which builds
and loads the cache's probe module (portable C++, seconds to build) exactly as kernels.py builds and loads the bf16
kernels, on a cache ({tmp}/cache) holding a copy of one build made once per sweep, damaged as the case says.
The message is the line the user sees (its clock time dropped).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ["python", "-m", "specheads.infer.engine.kernel_cache", "--probe"]
WAIT_S = 300  # the most a polled condition may take on a busy machine


def _probe(cache: Path, out: Path, **env) -> subprocess.Popen:
    """The probe on `cache` in a process of its own, its output (stdout and stderr) into `out`."""
    env = {**os.environ, "SPECHEADS_CACHE": str(cache), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    with open(out, "w") as f:
        p = subprocess.Popen([sys.executable, *PROBE[1:]], env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=f,
                             stderr=subprocess.STDOUT, text=True)
    p.out = out
    return p


def _result(p: subprocess.Popen) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a finished probe: the probe's result line is stdout, the log lines stderr."""
    p.wait(timeout=WAIT_S)
    lines = [re.sub(r"^\d\d:\d\d:\d\d ", "", ln) for ln in p.out.read_text().splitlines()]
    out = [ln for ln in lines if ln.startswith(("kernel cache probe: loaded", "kernel cache probe: not loaded"))]
    err = [ln for ln in lines if ln not in out]
    return p.returncode, "".join(f"{ln}\n" for ln in out), "".join(f"{ln}\n" for ln in err)


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.2)


def _cached(ctx) -> Path:
    """{tmp}/cache holding the probe's build (made once per sweep under {base}) -> that build's folder."""
    shared = ctx.base / "kernel-probe-cache"
    if not shared.exists():
        rc, out, err = _result(_probe(shared, ctx.base / "kernel-probe.txt"))
        if rc != 0:
            raise SystemExit(f"the kernel cache's probe does not build here: {out}{err}")
    (final,) = [p for p in (shared / "kernels").iterdir() if p.is_dir() and not p.name.startswith(".")]
    shutil.copytree(final, ctx.tmp / "cache" / "kernels" / final.name)
    return ctx.tmp / "cache" / "kernels" / final.name


def _manifest(final: Path, **changes) -> None:
    m = json.loads((final / "manifest.json").read_text())
    (final / "manifest.json").write_text(json.dumps({**m, **changes}))


def _damaged(how: str):
    def setup(ctx) -> None:
        final = _cached(ctx)
        so = next(final.glob("*.so"))
        if how == "flip":
            data = bytearray(so.read_bytes())
            data[len(data) // 2] ^= 0xFF
            so.write_bytes(bytes(data))
        elif how == "truncate":
            os.truncate(so, so.stat().st_size // 2)
        elif how == "torch":
            _manifest(final, torch="2.5.0+cu121")
        else:
            _manifest(final, cpu_flags=["avx512_bf16", "avx512f"])
        ctx.final = final
    return setup


def _run_probe(env_of=lambda ctx: {}):
    def run(ctx, argv) -> tuple[int, str, str]:
        return _result(_probe(ctx.tmp / "cache", ctx.tmp / "out.txt", **env_of(ctx)))
    return run


def _rebuilt(ctx) -> str:
    """The build in place again is whole (its .so's sha256 is its manifest's) and nothing is left beside it."""
    from specheads.infer.engine.kernel_cache import _sha256_file

    m = json.loads((ctx.final / "manifest.json").read_text())
    assert _sha256_file(ctx.final / m["so"]) == m["sha256"] and m["size"] == (ctx.final / m["so"]).stat().st_size
    left = [p.name for p in ctx.final.parent.iterdir() if p.name.startswith(".")]
    assert not left, f"left beside it: {left}"
    assert "kernel cache probe: loaded, add(2, 3) = 5" in ctx.out_text(), "the probe did not load"
    return "rebuilt whole (sha256 as its manifest says), loaded, nothing left beside it"


def _slow_compiler(ctx) -> dict:
    """A `g++` that records its compile calls and holds each until {tmp}/release appears."""
    ctx.count, ctx.release, cxx = ctx.tmp / "compiles.txt", ctx.tmp / "release", ctx.tmp / "bin" / "g++"
    cxx.parent.mkdir()
    cxx.write_text(f"""#!/bin/sh
case " $* " in *" -c "*) echo "$$" >> {ctx.count}; i=0
  while [ ! -e {ctx.release} ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done;; esac
exec {shutil.which('c++')} "$@"
""")
    cxx.chmod(0o755)
    return {"CXX": str(cxx)}


def _concurrent(ctx, argv) -> tuple[int, str, str]:
    env = _slow_compiler(ctx)
    procs = [_probe(ctx.tmp / "cache", ctx.tmp / f"out-{i}.txt", **env) for i in range(2)]
    try:
        _until(lambda: any("waiting for it" in p.out.read_text() for p in procs), "a second process waiting")
    finally:
        ctx.release.touch()
    results = [_result(p) for p in procs]
    ctx.results = results
    return (max(r[0] for r in results), "".join(r[1] for r in results),
            "".join(r[2] for r in sorted(results, key=lambda r: "waiting for it" in r[2])))


def _built_once(ctx) -> str:
    compiles = len(ctx.count.read_text().split())
    assert compiles == 1, f"{compiles} compiles"
    assert all("loaded, add(2, 3) = 5" in r[1] for r in ctx.results), "a process did not load"
    return "one compile; both processes loaded the build"


def _killed(ctx, argv) -> tuple[int, str, str]:
    env = _slow_compiler(ctx)
    first = _probe(ctx.tmp / "cache", ctx.tmp / "first.txt", **env)
    try:
        _until(ctx.count.exists, "the first compile starting")
        ctx.dead = list((ctx.tmp / "cache" / "kernels").glob(".specheads_probe-*.build-*"))
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=WAIT_S)
    finally:
        ctx.release.touch()
    second = _probe(ctx.tmp / "cache", ctx.tmp / "out.txt")
    return _result(second)


def _after_the_kill(ctx) -> str:
    assert len(ctx.dead) == 1, f"build folders of the killed run: {ctx.dead}"
    assert not ctx.dead[0].exists(), "the killed run's build folder is still there"
    assert "loaded, add(2, 3) = 5" in ctx.out_text(), "the second run did not load"
    return "the killed run's half-built folder removed; the next run built and loaded"


def _no_compiler_env(ctx) -> dict:
    return {"CXX": str(ctx.tmp / "no-such-c++"), "PATH": str(ctx.tmp)}


def _unwritable(ctx) -> None:
    (ctx.tmp / "file").write_text("")


def _private_left(ctx) -> str:
    assert "loaded, add(2, 3) = 5" in ctx.out_text(), "the probe did not load"
    return "built in a temporary folder for that process, loaded"


def _failing_compiler(ctx) -> dict:
    """A `g++` that records its compile calls and fails each with a compiler's error line."""
    ctx.count, cxx = ctx.tmp / "compiles.txt", ctx.tmp / "bin" / "g++"
    cxx.parent.mkdir()
    cxx.write_text(f"""#!/bin/sh
case " $* " in *" -c "*) echo "$$" >> {ctx.count}; echo "probe.cpp:1:1: error: this compiler refuses it" >&2; exit 1;; esac
exec {shutil.which('c++')} "$@"
""")
    cxx.chmod(0o755)
    return {"CXX": str(cxx)}


def _failed_then(retry: bool):
    """A run whose compile fails (recorded), then the probe again (with SPECHEADS_KERNELS_RETRY=1 where `retry`)."""
    def run(ctx, argv) -> tuple[int, str, str]:
        env = {**_failing_compiler(ctx), "SPECHEADS_KERNELS_RETRY": "0"}
        ctx.first = _result(_probe(ctx.tmp / "cache", ctx.tmp / "first.txt", **env))
        env["SPECHEADS_KERNELS_RETRY"] = "1" if retry else "0"
        return _result(_probe(ctx.tmp / "cache", ctx.tmp / "out.txt", **env))
    return run


def _compiles(ctx) -> int:
    return len(ctx.count.read_text().split()) if ctx.count.exists() else 0


def _recorded_once(ctx) -> str:
    (record,) = (ctx.tmp / "cache" / "kernels").glob("specheads_probe-*.failed.json")
    assert "compiling failed (probe.cpp:1:1: error: this compiler refuses it)" in ctx.first[2], "no first warning"
    assert _compiles(ctx) == 1, f"{_compiles(ctx)} compiles"
    assert json.loads(record.read_text())["reason"] == "probe.cpp:1:1: error: this compiler refuses it"
    return "the first run warned and recorded it (.failed.json); the second called no compiler"


def _retried(ctx) -> str:
    assert _compiles(ctx) == 2, f"{_compiles(ctx)} compiles"
    assert "kernel cache probe: not loaded" in ctx.out_text(), "the probe loaded with a failing compiler"
    return "compiled again (2 compiles in all), the failure recorded anew"


OLD_KEY, HELD_KEY = "0" * 16, "1" * 16  # two other keys' builds of the probe (older sources or torch)


def _older_builds(ctx) -> None:
    """Two copies of the build under other keys, last used 8 days ago; the current key's folder absent."""
    final = _cached(ctx)
    old = time.time() - 8 * 86400
    ctx.old = [final.with_name(f"specheads_probe-{k}") for k in (OLD_KEY, HELD_KEY)]
    shutil.copytree(final, ctx.old[1])
    final.rename(ctx.old[0])
    for p in ctx.old:
        os.utime(p, (old, old))
    ctx.final = final


def _pruning(ctx, argv) -> tuple[int, str, str]:
    from specheads.infer.engine.kernel_upkeep import Lock

    with Lock(ctx.old[1].with_name(f"{ctx.old[1].name}.lock")) as held:  # as a process building that key holds it
        assert held.try_take()
        return _result(_probe(ctx.tmp / "cache", ctx.tmp / "out.txt"))


def _pruned(ctx) -> str:
    assert "kernel cache probe: loaded, add(2, 3) = 5" in ctx.out_text(), "the probe did not load"
    assert ctx.final.is_dir(), "the current build is not there"
    assert not ctx.old[0].exists(), "the unused older build is still there"
    assert ctx.old[1].is_dir(), "the older build whose lock was held was removed"
    return "the unused older key's build removed; the held one and the new one kept"


def _with_output(case: dict) -> dict:
    """The case's run, keeping its output for the check (ctx.out_text())."""
    run = case["run"]

    def keep(ctx, argv):
        rc, out, err = run(ctx, argv)
        ctx.out_text = lambda: out + err
        return rc, out, err
    return {**case, "run": keep}


def cases(h) -> list[dict]:
    cmd = " ".join(PROBE)
    rebuilt = [("corrupt compiled kernel (a flipped byte)", "flip", "unclear",
                "is corrupt (its bytes are not those built: sha256 differs); rebuilding it"),
               ("truncated compiled kernel (half its bytes)", "truncate", "traceback", "is truncated ("),
               ("compiled kernel built for another torch", "torch", "unclear",
                "is built for torch 2.5.0+cu121 (this is torch "),
               ("compiled kernel built for other CPU flags", "cpu", "traceback",
                "is built for other CPU flags (avx512_bf16 avx512f); rebuilding it")]
    rows = [{"area": "kernels", "name": name, "risk": risk, "argv": ["--probe"], "setup": _damaged(how),
             "command": f"{cmd}  # on a cache whose build is damaged so", "run": _run_probe(), "rc": 0,
             "expect": expect, "check": _rebuilt} for name, how, risk, expect in rebuilt]
    rows += [
        {"area": "kernels", "name": "kernel cache folder cannot be written", "risk": "unclear", "argv": ["--probe"],
         "setup": _unwritable, "command": f"SPECHEADS_CACHE={{tmp}}/file/cache {cmd}  # under a regular file",
         "run": _run_probe(lambda ctx: {"SPECHEADS_CACHE": str(ctx.tmp / "file" / "cache")}), "rc": 0,
         "expect": "cannot be written (Not a directory); compiling into a temporary folder for this process only",
         "check": _private_left},
        {"area": "kernels", "name": "two processes compiling the kernels at once on an empty cache",
         "risk": "traceback", "argv": ["--probe"], "command": f"{cmd} & {cmd}  # both at once, no build yet",
         "run": _concurrent, "rc": 0, "expect": "is compiling", "check": _built_once},
        {"area": "kernels", "name": "first compile of the kernels killed midway (SIGKILL)", "risk": "unclear",
         "argv": ["--probe"], "command": f"{cmd}  # after one killed while its compiler ran", "run": _killed,
         "rc": 0, "expect": "compiling once into", "check": _after_the_kill},
        {"area": "kernels", "name": "no C++ compiler (CXX missing, no c++ on PATH)", "risk": "unclear",
         "argv": ["--probe"], "command": f"CXX={{tmp}}/no-such-c++ PATH={{tmp}} {cmd}",
         "run": _run_probe(_no_compiler_env), "rc": 1,
         "expect": "no-such-c++ is not found), so it cannot be compiled; the bf16 kernels would not be built "
                   "either"},
        {"area": "kernels", "name": "kernel compile failed on an earlier run (recorded, not retried)",
         "risk": "unclear", "argv": ["--probe"], "command": f"CXX={{tmp}}/bin/g++ {cmd}  # twice, that g++ failing",
         "run": _failed_then(retry=False), "rc": 1, "expect": "not compiled: its build failed here before (",
         "check": _recorded_once},
        {"area": "kernels", "name": "kernel compile retried (SPECHEADS_KERNELS_RETRY=1) after a recorded failure",
         "risk": "unclear", "argv": ["--probe"],
         "command": f"SPECHEADS_KERNELS_RETRY=1 CXX={{tmp}}/bin/g++ {cmd}  # after a recorded failure",
         "run": _failed_then(retry=True), "rc": 1, "expect": "compiling failed (", "check": _retried},
        {"area": "kernels", "name": "older kernel builds (other keys) beside a new build, one of them locked",
         "risk": "data loss", "argv": ["--probe"], "setup": _older_builds,
         "command": f"{cmd}  # two other keys' builds unused for 8 days, one's lock held", "run": _pruning,
         "rc": 0, "expect": "compiling once into", "check": _pruned},
    ]
    return [_with_output(r) for r in rows]
