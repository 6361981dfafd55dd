"""The reliability sweep's second table (scripts/reliability_sweep.py runs it): run locks, damaged checkpoints,
overrides, imports and exports, regenerated data, the OS refusing writes (full disk, file too large, read-only,
permission denied), targets that would run code, --head paths holding '=', and kill -9 during prepare, train and
export (reliability_kill.py: a real SIGKILL, then a rerun compared with an uninterrupted run).

`cases(h)` builds the rows; `h` is the sweep's namespace of helpers (Ctx fixtures, `head`, `trained`, `prepared`,
`kept`, `conversations`, ...), passed in so that this module imports nothing of the sweep (no import cycle). A case
may carry `during(ctx)`: a context manager active only while the CLI runs (a file size limit, writes refused under
a folder), `run(ctx, argv)`: the case runs the CLI itself (the kill cases), and `open`: why a known failing case is
not fixed yet (it stays in the table, marked).
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import resource
import signal
import socket
from pathlib import Path
from typing import Any, Callable, Iterator

import reliability_kill

# -------------------------------------------------------------------------------------- the OS refusing writes

@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """`ulimit -f`: a write past `limit` bytes fails with EFBIG (SIGXFSZ ignored, as a full disk fails a write)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


@contextlib.contextmanager
def refusing_writes(folder: Path, code: int = errno.EROFS) -> Iterator[None]:
    """Every write under `folder` fails with OSError(`code`): a read-only mount (EROFS) or a folder the user may not
    write to (EACCES), which chmod cannot show when the sweep runs as root. Patches os.open / mkdir / link / replace
    / rename and open() for writing; reads pass."""
    root = Path(folder).resolve()

    def under(p) -> bool:
        try:
            return Path(os.fsdecode(p)).resolve().is_relative_to(root)
        except TypeError:
            return False

    def guard(fn, paths: tuple[int, ...], writes=lambda a, k: True):
        def wrapped(*a, **k):
            for i in paths:
                if i < len(a) and under(a[i]) and writes(a, k):
                    raise OSError(code, os.strerror(code), os.fsdecode(a[i]))
            return fn(*a, **k)
        return wrapped

    def opens_for_writing(a, k) -> bool:
        mode = a[1] if len(a) > 1 else k.get("mode", "r")
        return isinstance(mode, str) and any(c in mode for c in "wax+")

    def os_open_writes(a, k) -> bool:
        flags = a[1] if len(a) > 1 else k.get("flags", 0)
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))

    patches = [(os, "open", (0,), os_open_writes), (os, "mkdir", (0,), None), (os, "link", (1,), None),
               (os, "replace", (0, 1), None), (os, "rename", (0, 1), None), (builtins, "open", (0,), opens_for_writing),
               (io, "open", (0,), opens_for_writing)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _, _ in patches]
    for mod, name, paths, writes in patches:
        setattr(mod, name, guard(getattr(mod, name), paths, writes or (lambda a, k: True)))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextlib.contextmanager
def failing_safetensors(code: int = errno.ENOSPC) -> Iterator[None]:
    """safetensors' writer failing as it does on a full disk: SafetensorError('... (os error 28)')."""
    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.save_file

    def save_file(*a, **k):
        raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")

    safetensors.torch.save_file = save_file
    try:
        yield
    finally:
        safetensors.torch.save_file = real


def no_temporaries(key: str = "tmp") -> Callable:
    """Check: nothing half-written under the case's folder (no `.tmp` file or folder left)."""
    def check(ctx) -> str:
        left = [str(p.relative_to(ctx.tmp)) for p in ctx.path(key).rglob("*") if ".tmp" in p.name]
        assert not left, f"temporaries left: {left}"
        return "no temporary file left"
    return check


# ------------------------------------------------------------------------------------------------- setups

def lock(folder: Path, pid: int, pid_start: int | None, host: str | None = None) -> None:
    """A run lock as runlock.py writes it, of process `pid` (pid_start None: not checked; another number than the
    process's own start time: a pid reused since, so the lock is stale)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".specheads.lock").write_text(json.dumps({"pid": pid, "command": "specheads train", "host": host or
                                                        socket.gethostname(), "started": "2026-12-01T10:00:00+0000",
                                                        "pid_start": pid_start}))


def newest_checkpoint(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step-*"))[-1]


def edit_checkpoint(h, fn: Callable[[Path], None], rehash: bool = True) -> Callable:
    """The trained run, its newest checkpoint changed by fn(folder); checksums rewritten when `rehash` (so that the
    check after the checksums is the one that fires)."""
    def setup(ctx) -> None:
        from specheads.train.checkpoint import write_checksums

        ck = newest_checkpoint(h.trained(ctx))
        fn(ck)
        if rehash:
            write_checksums(ck)
    return setup


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_json(name: str, fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        d = json.loads((folder / name).read_text())
        fn(d)
        (folder / name).write_text(json.dumps(d))
    return edit


def eagle_head_of_tied_target(ctx) -> None:
    """An EAGLE-1 head bound to a tiny target whose lm_head is its embedding (tie_word_embeddings true)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specheads.heads import HeadSpec, build_head
    from specheads.target import Target

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    t = Target(model=LlamaForCausalLM(cfg).eval().requires_grad_(False), tokenizer=None, name="tied-tiny")
    assert t.embed_tokens.weight.data_ptr() == t.lm_head.weight.data_ptr()  # tied
    build_head(HeadSpec(kind="eagle"), t).save_pretrained(ctx.path("head"))


def untied_in_export(ctx) -> str:
    cfg = json.loads((ctx.tmp / "o" / "config.json").read_text())
    assert cfg.get("tie_word_embeddings") is False, cfg.get("tie_word_embeddings")
    return "config.json: tie_word_embeddings false"


def legacy_medusa(ctx) -> None:
    """FasterDecoding/Medusa's train_legacy.py output: medusa_lm_head.safetensors of ResBlocks only."""
    import torch
    from safetensors.torch import save_file

    src = ctx.tmp / "repo"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1, "version": "2",
                                                 "base_model_name_or_path": "x"}))
    g = torch.Generator().manual_seed(0)
    save_file({f"{k}.0.linear.{n}": 0.05 * torch.randn(*shape, generator=g) for k in range(2)
               for n, shape in (("weight", (64, 64)), ("bias", (64,)))}, str(src / "medusa_lm_head.safetensors"))


def regenerated(h, ids: Any) -> Callable:
    """data/regenerated.jsonl-style rows (every answer with `token_ids` = ids; "omit": the older rows without)."""
    def setup(ctx) -> None:
        rows = []
        for c in h.conversations(6, "r"):
            turns = [{"from": t["from"], "value": t["value"]} for t in c["conversations"]]
            if ids != "omit":
                turns[1]["token_ids"] = ids
            rows.append({"id": c["id"], "conversations": turns})
        (ctx.tmp / "regen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return setup


def non_utf8(name: str) -> Callable:
    def setup(ctx) -> None:
        good = b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}'
        bad = good.replace(b'"hi"', b'"hi \xff\xfe"')
        body = good + b"\n" + bad + b"\n" if name.endswith(".jsonl") else b"[" + bad + b"]"
        (ctx.tmp / name).write_bytes(body)
    return setup


def target_copy(ctx, drop_weights: bool = False) -> Path:
    import shutil

    out = ctx.tmp / "t"
    shutil.copytree(ctx.base / "target", out, ignore=shutil.ignore_patterns("*.safetensors") if drop_weights
                    else None)
    return out


def remote_code_target(ctx) -> None:
    t = target_copy(ctx)
    cfg = json.loads((t / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (t / "config.json").write_text(json.dumps(cfg))
    (t / "modeling_x.py").write_text(f"import os\nos.system('touch {ctx.tmp / 'pwned'}')\n")


def pickled_target(ctx) -> None:
    import torch
    from safetensors.torch import load_file

    t = target_copy(ctx, drop_weights=True)
    torch.save(load_file(str(ctx.base / "target" / "model.safetensors")), t / "pytorch_model.bin")


def head_in_folder_with_eq(h) -> Callable:
    def setup(ctx) -> None:
        import shutil

        shutil.copytree(ctx.base / "trained" / "final", ctx.tmp / "a=b" / "head")
    return setup


def cwd(ctx) -> contextlib.AbstractContextManager:
    return contextlib.chdir(ctx.tmp / "here")


def _in_empty_folder(ctx) -> None:
    (ctx.tmp / "here").mkdir()


def beside_lock(ctx, out: str, content: str) -> None:
    (ctx.tmp / f".{out}.specheads.lock").write_text(content)


def lock_released(ctx) -> str:
    assert not list(ctx.tmp.glob(".*.specheads.lock*")), "a lock file was left"
    return "stale lock taken over, then released"


def quota_at_fsync(ctx) -> contextlib.AbstractContextManager:
    """fsync failing with EDQUOT on every file but the run lock (runlock's own writes are not what this case is
    about)."""
    real = os.fsync

    def fsync(fd):
        if ".specheads.lock" not in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        return real(fd)

    @contextlib.contextmanager
    def patched():
        os.fsync = fsync
        try:
            yield
        finally:
            os.fsync = real
    return patched()


def earlier_export(h) -> Callable:
    """The head and an earlier `specheads export` of it into o/ (which a re-export may replace)."""
    def setup(ctx) -> None:
        from specheads import cli

        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(["export", "--head", str(h.head(ctx)), "--format", "eagle3", "--out",
                             str(ctx.tmp / "o")]) == 0
        ctx.vars["state"] = json.dumps(h.tree(ctx.tmp / "o"))
    return setup


def only_step_best(h) -> Callable:
    """The trained run with its newest checkpoint renamed step-best (a user's copy) and the others gone."""
    def setup(ctx) -> None:
        import shutil

        cks = sorted((h.trained(ctx) / "checkpoints").glob("step-*"))
        cks[-1].rename(cks[-1].with_name("step-best"))
        for ck in cks[:-1]:
            shutil.rmtree(ck)
    return setup


def o_unchanged(h) -> Callable:
    def check(ctx) -> str:
        assert h.tree(ctx.tmp / "o") == json.loads(ctx.vars["state"]), "o changed"
        return "o unchanged"
    return check


def nothing_at_o(ctx) -> str:
    assert not (ctx.tmp / "o").exists(), "o was written"
    return no_temporaries()(ctx) + ", nothing at o"


def _all(*checks: Callable) -> Callable:
    def check(ctx) -> str:
        return "; ".join(filter(None, (c(ctx) for c in checks)))
    return check


DS = "configs/deepspeed/zero2.json"  # relative: its case runs in a process of its own in the repository root
DSPARK = ["head.kind=dspark", "head.confidence_head=true", "head.block_size=4", "head.num_layers=1"]
TOO_LARGE = "cannot write: File too large [EFBIG]"


def cases(h) -> list[dict[str, Any]]:
    """The rows; `h`: the sweep's helpers (see the module docstring)."""
    TRAIN, EXPORT = h.TRAIN, h.EXPORT
    RESUME = TRAIN + ["train.max_steps=3", "--resume"]

    def prepared_locked(pid, start, host=None):
        return lambda c: (h.prepared(c), lock(c.path("run"), pid, start, host))

    rows = [
        # one writer per run folder (runlock.py)
        {"area": "lock", "risk": "data loss", "name": "run folder locked by a live process",
         "setup": prepared_locked(os.getppid(), None), "argv": TRAIN, "rc": 2, "expect": "in use by pid",
         "check": h.kept("run/.specheads.lock")},
        {"area": "lock", "risk": "data loss", "name": "run folder locked from another host",
         "setup": prepared_locked(1, None, "elsewhere"), "argv": TRAIN, "rc": 2, "expect": "on elsewhere"},
        {"area": "lock", "risk": "unclear", "name": "stale lock of a finished process taken over",
         "setup": lambda c: (h.head(c), beside_lock(c, "o", json.dumps({
             "pid": os.getpid(), "command": "specheads export", "host": socket.gethostname(),
             "started": "2026-12-01T10:00:00+0000", "pid_start": 1}))),
         "argv": EXPORT + ["--out", "{tmp}/o"], "rc": 0, "expect": "exported", "check": lock_released},
        {"area": "lock", "risk": "traceback", "name": "unreadable lock file taken over",
         "setup": lambda c: (h.head(c), beside_lock(c, "o", "{not json")), "argv": EXPORT + ["--out", "{tmp}/o"],
         "rc": 0, "expect": "exported", "check": lock_released},
        # damaged checkpoints (train/checkpoint.py)
        {"area": "resume", "risk": "silent wrong result", "name": "flipped byte in a checkpoint's model.safetensors",
         "setup": edit_checkpoint(h, lambda ck: flip_byte(ck / "model.safetensors"), rehash=False), "argv": RESUME,
         "rc": 2, "expect": "sha256 differs from the one recorded in checksums.sha256"},
        {"area": "resume", "risk": "traceback", "name": "file listed in checksums.sha256 missing",
         "setup": edit_checkpoint(h, lambda ck: (ck / "optimizer.safetensors").unlink(), rehash=False),
         "argv": RESUME, "rc": 2, "expect": "optimizer.safetensors: missing (listed in checksums.sha256"},
        {"area": "resume", "risk": "traceback", "name": "checksums.sha256 cut short",
         "setup": edit_checkpoint(h, lambda ck: (ck / "checksums.sha256").write_text(""), rehash=False),
         "argv": RESUME, "rc": 2, "expect": "does not list trainer_state.json"},
        {"area": "resume", "risk": "silent wrong result", "name": "rng_state_0.json with wrong shapes",
         "setup": edit_checkpoint(h, edit_json("rng_state_0.json", lambda d: d.update(torch=[1, 2, 3]))),
         "argv": RESUME, "rc": 2, "expect": "not a valid RNG state"},
        {"area": "resume", "risk": "traceback", "name": "trainer_state.json missing keys",
         "setup": edit_checkpoint(h, edit_json("trainer_state.json", lambda d: d.pop("scheduler"))),
         "argv": RESUME, "rc": 2, "expect": "key(s) ['scheduler'] missing"},
        {"area": "resume", "risk": "silent wrong result", "name": "only a non-numeric step folder (step-best)",
         "setup": only_step_best(h),
         "argv": RESUME, "rc": 2, "expect": "--resume: no checkpoint", "check": h.kept("run/checkpoints/step-best")},
    ]
    return rows + _input_cases(h) + _os_cases(h) + _target_cases(h) + kill_cases()


def _input_cases(h) -> list[dict[str, Any]]:
    TRAIN, PREPARE, EXPORT = h.TRAIN, h.PREPARE, h.EXPORT
    return [
        # overrides and recipe files (config.py)
        {"area": "config", "risk": "unclear", "name": "malformed override train.betas=[0.9,",
         "argv": TRAIN + ["train.betas=[0.9,"], "rc": 2, "expect": "override 'train.betas=[0.9,': not a valid value"},
        {"area": "config", "risk": "silent wrong result", "name": "YAML tag in an override",
         "argv": TRAIN + ['train.lr=!!python/object/apply:os.system ["touch {tmp}/pwned"]'], "rc": 2,
         "expect": "YAML tags are not allowed", "check": h.not_executed},
        {"area": "config", "risk": "traceback", "name": "a folder given as --config",
         "argv": ["train", "--config", "{tmp}"], "rc": 2, "expect": "is a folder, not a config file"},
        {"area": "config", "risk": "traceback", "name": "binary file given as --config",
         "setup": lambda c: (c.tmp / "r.yaml").write_bytes(b"\xff\xfe\x00\x01"),
         "argv": ["train", "--config", "{tmp}/r.yaml"], "rc": 2, "expect": "not a text file"},
        # exports and imports (heads/export/, utils.refuse_replacing)
        {"area": "export", "risk": "silent wrong result", "name": "eagle export of a tied target's head",
         "setup": eagle_head_of_tied_target, "argv": ["export", "--head", "{head}", "--format", "eagle", "--out",
                                                      "{tmp}/o"], "rc": 0, "expect": "exported",
         "check": untied_in_export},
        {"area": "export", "risk": "silent wrong result", "name": "FasterDecoding legacy Medusa import",
         "setup": legacy_medusa, "argv": ["export", "--import", "{tmp}/repo", "--target", "{target}", "--out",
                                          "{tmp}/o"], "rc": 0, "expect": "imported"},
        {"area": "export", "risk": "data loss", "name": "export --out . (the current folder)",
         "setup": lambda c: (h.head(c), _in_empty_folder(c)), "during": cwd, "argv": EXPORT + ["--out", "."],
         "rc": 2, "expect": "is the current folder"},
        {"area": "export", "risk": "data loss", "name": "export --out . --force in a folder with files",
         "setup": lambda c: (h.head(c), _in_empty_folder(c), (c.tmp / "here" / "mine.txt").write_text("x")),
         "during": cwd, "argv": EXPORT + ["--out", ".", "--force"], "rc": 2, "expect": "is the current folder",
         "check": h.kept("here/mine.txt")},
        {"area": "export", "risk": "data loss", "name": "--out is a file",
         "setup": lambda c: (h.head(c), (c.tmp / "o").write_text("mine")), "argv": EXPORT + ["--out", "{tmp}/o"],
         "rc": 2, "expect": "is a file, not a folder", "check": h.kept("o")},
        {"area": "export", "risk": "traceback", "name": "--out below a file",
         "setup": lambda c: (h.head(c), (c.tmp / "f").write_text("mine")), "argv": EXPORT + ["--out", "{tmp}/f/o"],
         "rc": 2, "expect": "is a file, not a folder, so nothing can be written below it"},
        # regenerated data (conversations/load.py reads it, train/data.py tokenises it)
        {"area": "prepare", "risk": "silent wrong result", "name": "regenerated JSONL with bad token_ids",
         "setup": regenerated(h, ["a", 1]), "argv": PREPARE + ["data.source={tmp}/regen.jsonl"], "rc": 2,
         "expect": "bad token_ids: turn 1 token_ids is not a list of integers"},
        {"area": "prepare", "risk": "traceback", "name": "older regenerated JSONL without token ids",
         "setup": regenerated(h, "omit"), "argv": PREPARE + ["data.source={tmp}/regen.jsonl"], "rc": 0,
         "expect": "summary written to"},
        {"area": "prepare", "risk": "traceback", "name": "non-UTF-8 bytes in a JSON dataset",
         "setup": non_utf8("x.json"), "argv": PREPARE + ["data.source={tmp}/x.json"], "rc": 2,
         "expect": "x.json: not UTF-8 text: line 1 has byte 0xff", "check": h.nothing_written},
        {"area": "prepare", "risk": "traceback", "name": "non-UTF-8 bytes in row 1 of a JSONL dataset",
         "setup": non_utf8("x.jsonl"), "argv": PREPARE + ["data.source={tmp}/x.jsonl"], "rc": 2,
         "expect": "x.jsonl: not UTF-8 text: line 2 (row 1) has byte 0xff"},
        {"area": "prepare", "risk": "traceback", "name": "data.source is a folder",
         "argv": PREPARE + ["data.source={tmp}"], "rc": 2, "expect": "is a folder; expected a .json/.jsonl file"},
        {"area": "prepare", "risk": "unclear", "name": "empty JSONL dataset",
         "setup": lambda c: (c.tmp / "x.jsonl").write_text(""), "argv": PREPARE + ["data.source={tmp}/x.jsonl"],
         "rc": 2, "expect": "no usable conversation"},
    ]


def _os_cases(h) -> list[dict[str, Any]]:
    TRAIN, PREPARE, EXPORT = h.TRAIN, h.PREPARE, h.EXPORT
    return [
        {"area": "disk", "risk": "data loss", "name": "file too large (ulimit -f) during export",
         "setup": h.head, "during": lambda c: file_size_limit(100_000), "argv": EXPORT + ["--out", "{tmp}/o"],
         "rc": 2, "expect": TOO_LARGE + "; nothing was written at", "check": nothing_at_o},
        {"area": "disk", "risk": "data loss", "name": "file too large while replacing an earlier export",
         "setup": earlier_export(h), "during": lambda c: file_size_limit(100_000),
         "argv": EXPORT + ["--out", "{tmp}/o"], "rc": 2, "expect": "was left as it was (its temporary folder removed)",
         "check": _all(no_temporaries(), o_unchanged(h))},
        {"area": "disk", "risk": "data loss", "name": "file too large during a checkpoint save",
         "setup": h.prepared, "during": lambda c: file_size_limit(100_000),
         "argv": TRAIN + ["data.val_fraction=0", "features.mode=online"], "rc": 2,
         "expect": "step-000001: " + TOO_LARGE + "; the partial checkpoint was removed", "check": no_temporaries()},
        {"area": "disk", "risk": "data loss", "name": "file too large during a feature shard write",
         "during": lambda c: file_size_limit(60_000), "argv": PREPARE, "rc": 2,
         "expect": "shard-00000.safetensors: " + TOO_LARGE + "; no shard was written", "check": no_temporaries()},
        {"area": "disk", "risk": "data loss", "name": "no space left (ENOSPC) during a shard write",
         "during": lambda c: failing_safetensors(errno.ENOSPC), "argv": PREPARE, "rc": 2,
         "expect": "cannot write: No space left on device [ENOSPC]", "check": no_temporaries()},
        {"area": "disk", "risk": "data loss", "name": "quota exceeded (EDQUOT) at fsync during export",
         "setup": h.head, "during": quota_at_fsync, "argv": EXPORT + ["--out", "{tmp}/o"], "rc": 2,
         "expect": "o/config.json: cannot write: Disk quota exceeded [EDQUOT]", "check": nothing_at_o},
        {"area": "disk", "risk": "traceback", "name": "read-only folder for export --out",
         "setup": lambda c: (h.head(c), (c.tmp / "ro").mkdir()), "during": lambda c: refusing_writes(c.tmp / "ro"),
         "argv": EXPORT + ["--out", "{tmp}/ro/o"], "rc": 2, "expect": "cannot write: Read-only file system [EROFS]"},
        {"area": "disk", "risk": "traceback", "name": "read-only run folder for train",
         "setup": h.prepared, "during": lambda c: refusing_writes(c.path("run")), "argv": TRAIN, "rc": 2,
         "expect": "cannot write: Read-only file system [EROFS]"},
        {"area": "disk", "risk": "traceback", "name": "permission denied on the run folder for prepare",
         "setup": lambda c: c.path("run").mkdir(), "during": lambda c: refusing_writes(c.path("run"), errno.EACCES),
         "argv": PREPARE, "rc": 2, "expect": "cannot write: Permission denied [EACCES]"},
    ]


def _target_cases(h) -> list[dict[str, Any]]:
    TRAIN, GEN = h.TRAIN, h.GENERATE
    gen = ["generate", "--target", "{tmp}/t", "--prompt", "hi", "--max-new-tokens", "2"]
    return [
        {"area": "target", "risk": "silent wrong result", "name": "target that needs its own code (auto_map)",
         "setup": remote_code_target, "argv": gen, "rc": 2, "expect": "maps its classes to code in the folder",
         "check": h.not_executed},
        {"area": "target", "risk": "silent wrong result", "name": "target with pickled weights only",
         "setup": pickled_target, "argv": gen, "rc": 2, "expect": "holds its weights only as pickles"},
        {"area": "train", "risk": "traceback", "name": "train.deepspeed without accelerate launch",
         "setup": h.prepared, "argv": TRAIN + [f"train.deepspeed={DS}"], "rc": 2, "expect": "accelerate launch",
         "fresh_process": True},
        {"area": "train", "risk": "traceback", "name": "--calibrate-only with a DSpark recipe on an EAGLE-3 run",
         "setup": h.trained, "argv": TRAIN + DSPARK + ["--calibrate-only"], "rc": 2, "expect": "eagle3"},
        {"area": "head", "risk": "unclear", "name": "bench --head LABEL=DIR split inside a path with '='",
         "argv": ["bench", "--target", "{target}", "--head", "{tmp}/c=d/head", "--dataset", "mt-bench", "--out",
                  "{tmp}/b"], "rc": 2, "expect": "a folder whose own path holds '=' is used whole"},
        {"area": "head", "risk": "unclear", "name": "generate --head folder whose path holds '='",
         "setup": head_in_folder_with_eq(h), "argv": GEN[:4] + ["{tmp}/a=b/head"] + GEN[5:], "rc": 0,
         "expect": "target forwards"},
        {"area": "head", "risk": "unclear", "name": "generate --head LABEL=DIR (bench's form)",
         "setup": h.head, "argv": GEN[:4] + ["mine={head}"] + GEN[5:], "rc": 2,
         "expect": "generate takes one head folder, not LABEL=DIR"},
    ]


# ------------------------------------------------------------------------------------- kill -9 (issue 28)

def _killed_and_rerun(name: str, earlier: bool) -> Callable:
    """The case's CLI run: `name`'s command killed at its point in {tmp}, then run again (reliability_kill)."""
    def run(ctx, argv) -> tuple[int, str, str]:
        ctx.outcome = reliability_kill.run_kills([reliability_kill.KILLS[name]], ctx.base, ctx.tmp, earlier)
        return ctx.outcome.rc, ctx.outcome.out, ctx.outcome.err
    return run


def _as_uninterrupted(ctx) -> str:
    assert ctx.outcome.ok, ctx.outcome.note()
    return ctx.outcome.note()


def kill_cases() -> list[dict[str, Any]]:
    """A real SIGKILL at each point of reliability_kill.KILLS, then the same command again (train: --resume); its
    message, and its outputs against an uninterrupted run's (check)."""
    expect = {"prepare": "summary written to", "regen": "summary written to", "train": "trained 9 steps",
              "export": "exported"}
    risk = {"prepare killed while writing feature shard 1": "silent wrong result",
            "prepare killed while the target writes the answers": "silent wrong result",
            "prepare killed while writing its manifest": "silent wrong result",
            "prepare killed while writing the target sidecars": "silent wrong result",
            "train killed mid-step (after checkpoint 3)": "silent wrong result",
            "train killed as its checkpoint folder appears": "data loss",
            "train killed mid-save, before the checksums": "data loss",
            "train killed while writing final/": "data loss",
            "train stopped by SIGTERM mid-run (after checkpoint 3)": "unclear",
            "export killed while writing": "silent wrong result",
            "export killed while writing over an earlier export": "data loss",
            "export killed while recording its source": "unclear"}
    rows = []
    for name, k in reliability_kill.KILLS.items():
        first, _ = reliability_kill.argvs(k.command, Path("{base}"), reliability_kill.target_of(k.command,
                                                                                                Path("{tmp}")))
        rows.append({"area": "kill", "risk": risk[name], "name": name, "argv": first, "rc": 0,
                     "expect": expect[k.command], "run": _killed_and_rerun(name, "earlier export" in name),
                     "check": _as_uninterrupted, "open": reliability_kill.OPEN.get(name, "")})
    return rows
