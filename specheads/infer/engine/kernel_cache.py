"""Compiled C++ extensions (kernels.py's bf16 kernels; the probe module below) built once per build key under
cache_root()/kernels and checked on every load before anything of them is mapped.

    <cache>/kernels/<name>-<key16>/                      a build: <name>.so, manifest.json (the .so's sha256 and
                                                         size, torch, flags, key), src/; renamed into place whole
    <cache>/kernels/<name>-<key16>.lock                  the fcntl lock of the process building it
    <cache>/kernels/.<name>-<key16>.build-<pid>-<hex>/   a build in progress, private to its process
    <cache>/kernels/<name>-<key16>.failed.json           this key's build failed here (why, the compiler, when)

The key (`build_key`) is a sha256 of the source files' bytes, torch's version and build, Python's ABI, the compile
and link flags and the CPU flags the build targets: any change builds into a folder of its own. `load`:
1. checks the key's folder: its manifest names this key, this torch and these CPU flags, and the .so has the size
   and sha256 the manifest gives. A truncated, corrupt or foreign build is one warning line and is rebuilt; it is
   never dlopened (a truncated .so once ended the process in SIGBUS, in native code);
2. builds under the lock, which the OS releases when its process dies however it dies (a compile killed midway
   never blocks the next run); a second process waits (one line) and loads the first one's build. The sources are
   compiled (torch.utils.cpp_extension, ninja) in a fresh private folder, so no lock file of torch's is ever
   left for a later run, by a child process that also imports the result: a crash there is a failed build, not a
   crash of the caller. The manifest is written and the folder renamed into place, a damaged one moved aside first:
   whoever looks sees a whole build or none. Build folders of dead processes are removed;
3. loads the .so with importlib's ExtensionFileLoader (no ninja run, no compiler needed once built).
A cache folder that cannot be written: a build in a temporary folder for this process only, one line. No compiler,
no ninja, a failed compile: one warning naming it and what runs instead, and `load` returns None. The failure is
recorded (<name>-<key16>.failed.json, atomic; kernel_upkeep.py): later runs with that key and the same $CXX skip the
build with one info line naming the record, until SPECHEADS_KERNELS_RETRY=1, the record's deletion, a new key, or
(where tools were missing) the tools. Not recorded: a compile killed from outside, a cache that cannot be written.
Pruned, after each successful build into the cache and only then: the same name's other keys' folders (with their
.log and .failed.json) last loaded PRUNE_AGE_S (7 days) or more before it, each under its own lock and skipped while
a process holds that; never the current key, never a lock file (kernel_upkeep.prune).

    python -m specheads.infer.engine.kernel_cache --probe    # build and load the probe through the cache
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import platform
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from specheads.infer.engine.kernel_upkeep import (Lock, failed_before, first_line, mark_used, prune, record_failure,
                                                  record_path, remove)
from specheads.utils import cache_root, setup_logging

log = logging.getLogger(__name__)

LAYOUT = 1  # of the cache folder and its manifest (not of any C++): a new layout builds afresh
COMPILE_TIMEOUT_S = 900  # one build in its child process (the bf16 kernels: 20-40 s on 2 cores); then given up
WAIT_S = COMPILE_TIMEOUT_S + 60  # the longest a second process waits for another one's build
MAX_MANIFEST_BYTES = 1 << 16  # a manifest is ~1 KB; a larger file is not one of ours
MISSING = "missing"  # _problem's answer for a folder that is not there (a first build: no warning)
SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx", ".c")  # the files compiled; the others (headers) are copied beside them
_LEFTOVER = re.compile(r"^\.(?P<final>.+)\.(?:build|old)-\d+-[0-9a-f]+$")  # .<final>.build-<pid>-<hex>
_PRIVATE = "specheads-kernels-"  # prefix of a private build's folder in the system's temporary folder
_EXTERNAL = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}  # a compile ended from outside: no marker


@dataclasses.dataclass(frozen=True)
class Extension:
    """What to build: `files` (the SOURCE_SUFFIXES ones compiled, headers copied beside them; all of them in the
    key) into the module `name` (PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) or PyInit_<TORCH_EXTENSION_NAME>),
    which must have the attributes `names`."""
    name: str
    files: tuple[Path, ...]
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    cpu_flags: tuple[str, ...] = ()  # /proc/cpuinfo flags the build's instructions need (its -m flags)
    names: tuple[str, ...] = ()
    label: str = "compiled module"  # the subject of its log lines
    fallback: str = "nothing compiled is used"  # what runs instead, for the lines after which `load` returns None
    duration: str = "a few seconds"  # of one build, for the line that says it compiles


# --------------------------------------------------------------------------------------------------- the key

def _sources(ext: Extension) -> list[tuple[str, bytes]]:
    """(file name, bytes) of each file, read once: the key is computed from and the build compiles these bytes."""
    out = [(Path(f).name, Path(f).read_bytes()) for f in ext.files]
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"{ext.name}: two source files share a name: {[n for n, _ in out]}")
    return out


def _identity(ext: Extension, sources: list[tuple[str, bytes]]) -> dict:
    """Everything the built .so depends on; its sha256 is the key, and the manifest records it."""
    return {"layout": LAYOUT, "name": ext.name, "torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", None),
            "python": sys.implementation.cache_tag, "machine": platform.machine(),
            "sources": [[n, hashlib.sha256(b).hexdigest()] for n, b in sources], "cflags": list(ext.cflags),
            "ldflags": list(ext.ldflags), "cpu_flags": sorted(ext.cpu_flags)}


def build_key(ext: Extension, sources: list[tuple[str, bytes]] | None = None) -> str:
    """sha256 (hex) of the sources, torch, Python's ABI and the flags: the name of the build's folder."""
    ident = _identity(ext, _sources(ext) if sources is None else sources)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def cpu_flags() -> set[str]:
    """The flags of this CPU as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _ninja() -> str | None:
    """ninja on PATH, or beside this Python (a virtual environment's `pip install ninja` not activated)."""
    return shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))


def missing_tools() -> str:
    """'' where a build can run, else what is missing ('no C++ compiler (...)', 'no ninja (...)', or both)."""
    cxx = os.environ.get("CXX", "c++")
    missing = []
    if shutil.which((shlex.split(cxx) or ["c++"])[0]) is None:
        missing.append(f"no C++ compiler (CXX={cxx} is not found)" if "CXX" in os.environ
                       else "no C++ compiler (c++ is not on PATH; CXX names another)")
    if _ninja() is None:
        missing.append("no ninja (pip install ninja)")
    return " and ".join(missing)


# ----------------------------------------------------------------------------------------- checking a build

def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_manifest(final: Path) -> tuple[str | None, dict | None]:
    """(None, the manifest) or (what is wrong, None); MISSING where `final` is not there at all."""
    try:
        with open(final / "manifest.json", "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return (MISSING if not os.path.lexists(final) else "without its manifest.json"), None
    except OSError as e:
        return f"unreadable ({e.strerror or e})", None
    try:
        manifest = json.loads(raw) if len(raw) <= MAX_MANIFEST_BYTES else None
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict):
        return "holding a manifest.json that is not one of ours", None
    return None, manifest


def _problem(final: Path, ext: Extension, key: str) -> tuple[str | None, dict | None]:
    """(None, manifest) where `final` holds this key's build whole, else (what is wrong with it, manifest or None).
    Nothing of the .so is mapped here: it is read as bytes."""
    why, m = _read_manifest(final)
    if why:
        return why, None
    if m.get("torch") != torch.__version__:
        return f"built for torch {m.get('torch')} (this is torch {torch.__version__})", m
    if m.get("cpu_flags") != sorted(ext.cpu_flags):
        return f"built for other CPU flags ({' '.join(m.get('cpu_flags') or ['none'])})", m
    if m.get("key") != key or m.get("layout") != LAYOUT:
        return "built from other sources or flags (its manifest's key is not this one)", m
    so, want = m.get("so"), m.get("size")
    if not isinstance(so, str) or so != Path(so).name or not isinstance(want, int):
        return "holding a manifest.json that is not one of ours", None
    try:
        size = (final / so).stat().st_size
    except OSError:
        return f"missing its {so}", m
    if size != want:
        return (f"truncated ({size} of {want} bytes)" if size < want else f"corrupt ({size} bytes, {want} built)"), m
    if _sha256_file(final / so) != m.get("sha256"):
        return "corrupt (its bytes are not those built: sha256 differs)", m
    return None, m


def _import(ext: Extension, so: Path) -> ModuleType:
    """The module in `so` (dlopen through importlib's ExtensionFileLoader); ImportError where it lacks `names`."""
    loader = importlib.machinery.ExtensionFileLoader(ext.name, str(so))
    spec = importlib.util.spec_from_file_location(ext.name, str(so), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    missing = [n for n in ext.names if not hasattr(mod, n)]
    if missing:
        raise ImportError(f"{so} lacks {', '.join(missing)}")
    return mod


# ------------------------------------------------------------------------------------------------- loading

def load(ext: Extension) -> ModuleType | None:
    """The built module, from the cache or built now, or None where it cannot be had (one line says why and what
    runs instead: ext.fallback)."""
    lacking = sorted(set(ext.cpu_flags) - cpu_flags())
    if lacking:
        log.info("%s: this CPU has no %s; %s", ext.label, " ".join(lacking), ext.fallback)
        return None
    try:
        sources = _sources(ext)
    except (OSError, ValueError) as e:
        log.warning("%s: its sources cannot be read (%s); %s", ext.label, first_line(e), ext.fallback)
        return None
    key = build_key(ext, sources)
    final = cache_root() / "kernels" / f"{ext.name}-{key[:16]}"
    problem, manifest = _problem(final, ext, key)
    failed = None  # the sha256 of a build that was whole yet did not load here
    if problem is None:
        try:
            mod = _import(ext, final / manifest["so"])
            mark_used(final)
            return mod
        except ImportError as e:  # checked whole, yet not loadable here (a library it links changed): rebuilt
            problem, failed = f"not loadable here ({first_line(e)})", manifest.get("sha256")
    tools = missing_tools()
    if failed_before(ext.label, ext.fallback, final, key, tools):
        return None
    if tools:
        damaged = f"the build in {final} is {problem}, and " if problem != MISSING else ""
        log.warning("%s: %s%s, so it cannot be compiled; %s", ext.label, damaged, tools, ext.fallback)
        record_failure(final, key, tools, missing_tools=True)
        return None
    try:
        return _load_building(ext, sources, key, final, problem, failed)
    except (OSError, ImportError, subprocess.SubprocessError) as e:  # the cache failed midway (a full disk, ...)
        log.warning("%s: could not be built in %s (%s); %s", ext.label, final.parent, first_line(e), ext.fallback)
        return None


def _load_building(ext: Extension, sources, key: str, final: Path, problem: str,
                   failed: str | None) -> ModuleType | None:
    """Build into the cache under the lock and load (the build another process made meanwhile where there is one,
    other than the one of sha256 `failed` that did not load); an unwritable cache folder gets a private build."""
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = Lock(root / f"{final.name}.lock")
    except OSError as e:
        why = f"{root} cannot be written ({e.strerror or e})"
        return _private_build(ext, sources, key, f"the build in {final} is {problem}, and {why}"
                              if problem != MISSING else why)
    with lock:
        if not lock.take(ext.label, final, WAIT_S):
            log.warning("%s: another process has been compiling %s for over %d s; %s", ext.label, final, WAIT_S,
                        ext.fallback)
            return None
        now, manifest = _problem(final, ext, key)
        if now is None and manifest.get("sha256") != failed:
            return _import(ext, final / manifest["so"])  # built by the process this one waited for
        if failed_before(ext.label, ext.fallback, final, key, ""):  # by the process this one waited for
            return None
        if now == MISSING:
            log.info("%s: compiling once into %s (%s)", ext.label, final, ext.duration)
        else:
            log.warning("%s: the build in %s is %s; rebuilding it (%s)", ext.label, final, now or problem,
                        ext.duration)
        _sweep(root, final.name)
        built = _build(ext, sources, key, root / f".{final.name}.build-{os.getpid()}-{secrets.token_hex(4)}", final)
        if built is None:
            return None
        _put(built, final)
        mod = _import(ext, final / f"{ext.name}.so")
        remove(record_path(final))  # an earlier failure's, built now (SPECHEADS_KERNELS_RETRY, a compiler since)
        prune(root, ext.name, final)
        return mod


def _private_build(ext: Extension, sources, key: str, why: str) -> ModuleType | None:
    """A build in the system's temporary folder, loaded, then removed (a mapped .so outlives its file)."""
    log.warning("%s: %s; compiling into a temporary folder for this process only (%s, again each run)", ext.label,
                why, ext.duration)
    _sweep_private()
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{_PRIVATE}{os.getpid()}-"))
    except OSError as e:
        log.warning("%s: no temporary folder either (%s); %s", ext.label, e.strerror or e, ext.fallback)
        return None
    try:
        built = _build(ext, sources, key, tmp / "build")
        return None if built is None else _import(ext, built / f"{ext.name}.so")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ building

_CHILD = r"""
import ctypes, json, os, signal, sys
os.setpgid(0, 0)  # a process group of its own with ninja, so that it can end them with itself


def _end(signum, frame):  # ninja ends the compilers it runs on SIGTERM; nothing is left writing into the folder
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    os._exit(128 + signum)


signal.signal(signal.SIGTERM, _end)
try:  # PR_SET_PDEATHSIG: SIGTERM when the process that asked for the build dies (SIGKILL included)
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[2]):
    sys.exit("the process that asked for this build is gone")
a = json.loads(sys.argv[1])
from torch.utils.cpp_extension import load
m = load(name=a["name"], sources=a["sources"], extra_cflags=a["cflags"], extra_ldflags=a["ldflags"],
         build_directory=a["dir"], verbose=False)
missing = [n for n in a["names"] if not hasattr(m, n)]
if missing:
    sys.exit("the built module lacks " + ", ".join(missing))
"""


def _compile_in_child(args: dict) -> tuple[str | None, str, bool]:
    """Compile and import in a child process -> (None or what failed, the child's output, whether the failure would
    recur: False where the child was ended from outside). A timeout, Ctrl-C or SIGTERM here ends the child, which
    ends ninja and its compilers."""
    env = dict(os.environ)
    ninja = _ninja()
    if ninja:  # torch's cpp_extension runs `ninja` from PATH
        env["PATH"] = os.pathsep.join([str(Path(ninja).parent), env.get("PATH", "")])
    p = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(args), str(os.getpid())], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=COMPILE_TIMEOUT_S)
    except BaseException as e:  # noqa: BLE001 - re-raised below but for the timeout
        p.terminate()
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            return f"no result after {COMPILE_TIMEOUT_S} s", "", True  # as long again next run: recorded
        raise
    if p.returncode < 0:
        sig = signal.Signals(-p.returncode)
        return f"the process compiling and loading it died of {sig.name}", out, sig not in _EXTERNAL
    if p.returncode != 0:
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        first = next((ln for ln in lines if ": error: " in ln), lines[-1] if lines else "")  # the compiler's first
        why = first.replace(str(Path(args["dir"]) / "src") + os.sep, "")[:240] or f"exit status {p.returncode}"
        return why, out, True
    return None, out, True


def _build(ext: Extension, sources, key: str, dest: Path, final: Path | None = None) -> Path | None:
    """Compile `sources` in `dest` (created: private to this process) and check the result in a child process ->
    `dest` holding <name>.so, manifest.json and src/, or None (one line said why; `dest` is removed). For a build
    into the cache's `final`, a failure's output goes to <final>.log and a lasting failure is recorded."""
    try:
        return _build_in(ext, sources, key, dest, final)
    except BaseException:  # an OS refusal, Ctrl-C: nothing half-built is left (a killed process's is swept later)
        shutil.rmtree(dest, ignore_errors=True)
        raise


def _build_in(ext: Extension, sources, key: str, dest: Path, final: Path | None) -> Path | None:
    log_path = None if final is None else final.with_name(f"{final.name}.log")
    src = dest / "src"
    src.mkdir(parents=True)
    for n, data in sources:
        (src / n).write_bytes(data)
    compiled = [str(src / n) for n, _ in sources if n.endswith(SOURCE_SUFFIXES)]
    error, output, lasting = _compile_in_child({"name": ext.name, "sources": compiled, "dir": str(dest),
                                                "cflags": list(ext.cflags), "ldflags": list(ext.ldflags),
                                                "names": list(ext.names)})
    so = dest / f"{ext.name}.so"
    if error is None and not so.is_file():
        error = f"{so.name} was not written"
    if error is not None:
        where = ""
        if log_path is not None and output.strip():
            try:
                log_path.write_text(output)
                where = f"; its output is in {log_path}"
            except OSError:
                pass
        log.warning("%s: compiling failed (%s)%s; %s", ext.label, error, where, ext.fallback)
        shutil.rmtree(dest, ignore_errors=True)
        if final is not None and lasting:
            record_failure(final, key, error, missing_tools=False)
        return None
    if log_path is not None:
        log_path.unlink(missing_ok=True)  # an earlier failed build's output
    for p in dest.iterdir():  # the objects, build.ninja, torch's lock file: only the .so and src/ are kept
        if p not in (so, src):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    data = so.read_bytes()
    manifest = {**_identity(ext, sources), "key": key, "so": so.name, "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "compiler": os.environ.get("CXX", "c++")}
    with open(dest / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    for p in (so, dest):
        _fsync(p)
    return dest


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put(built: Path, final: Path) -> None:
    """Rename `built` to `final`, what was there moved aside first and then removed: whoever looks at `final` sees
    a whole build or none, never two half-written ones."""
    old = None
    if os.path.lexists(final):
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(final, old)
    os.rename(built, final)
    _fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() and not old.is_symlink() else old.unlink()


def _sweep(root: Path, own: str) -> None:
    """Remove the build folders of processes that died midway: `own`'s (its lock is ours, so no live process is
    building it) and another key's whose lock no one holds."""
    for p in root.iterdir():
        m = _LEFTOVER.match(p.name)
        if not m:
            continue
        if m["final"] == own:
            shutil.rmtree(p, ignore_errors=True)
            continue
        try:
            with Lock(root / f"{m['final']}.lock") as other:
                if other.try_take():
                    shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _sweep_private() -> None:
    """Remove the private build folders of dead processes (their pid is in the name) from the temporary folder."""
    for p in Path(tempfile.gettempdir()).glob(f"{_PRIVATE}*"):
        pid = p.name[len(_PRIVATE):].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass  # alive, another user's


# --------------------------------------------------------------------------------------------------- probe

PROBE = Extension(name="specheads_probe", files=(Path(__file__).with_name("csrc") / "probe.cpp",), names=("add",),
                  label="kernel cache probe", duration="a few seconds",
                  fallback="the bf16 kernels would not be built either: the owned forward would use PyTorch's ops "
                           "(about a third of the speed)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specheads.infer.engine.kernel_cache",
                                 description="Build and load the probe module through the kernel cache "
                                             "($SPECHEADS_CACHE/kernels), as the bf16 kernels are: exit 0 where "
                                             "it loads, 1 where it cannot be had (a line says why).")
    ap.add_argument("--probe", action="store_true", required=True, help="build (once) and load the probe module")
    ap.parse_args(argv)
    setup_logging()
    mod = load(PROBE)
    if mod is None:
        print("kernel cache probe: not loaded")
        return 1
    print(f"kernel cache probe: loaded, add(2, 3) = {mod.add(2, 3)}")
    return 0


if __name__ == "__main__":  # run as the module itself, so that its log lines name it as when kernels.py loads
    from specheads.infer.engine.kernel_cache import main as _main

    raise SystemExit(_main())
