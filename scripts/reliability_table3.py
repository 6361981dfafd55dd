"""The reliability sweep's third table (issue 38's classes; scripts/reliability_sweep.py runs it): a folder another
live process holds, checkpoints without their checksums, eval against bench's refusals, symlinked outputs, summaries
of a removed best/, inputs that ended in tracebacks (verbatim YAML tags, unknown model types, GGUF files that are
empty, not GGUF or cut, a folder as --dataset, one endless line), and advice a full disk gives.

`cases(h)` builds the rows, as reliability_cases.cases does (`h`: the sweep's helpers); the kill -9 and SIGTERM rows
of these classes are reliability_kill.KILLS entries, listed with the other kill rows.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import socket
from pathlib import Path
from typing import Any, Callable

from reliability_cases import file_size_limit, flip_byte, lock, newest_checkpoint, target_copy

EXPECT_LOCKED = "in use by pid"


# ------------------------------------------------------------------------------------------------- setups

def _live_pid() -> int:
    """A process that outlives the case: the one that started the sweep (as the lock rows use)."""
    return os.getppid()


def _snapshot(h, folder: Path) -> str:
    return json.dumps(h.tree(folder))


def run_held_by_train(h, where: str = "run") -> Callable:
    """The trained run at {tmp}/<where>, held by a live `specheads train` (its lock inside), and the head."""
    def setup(ctx) -> None:
        import shutil

        run = ctx.tmp / where
        shutil.copytree(ctx.base / "trained", run)
        lock(run, _live_pid(), None)
        h.head(ctx)
        ctx.vars["state"] = _snapshot(h, run)
        ctx.vars["held"] = str(run)
    return setup


def held_run_unchanged(h) -> Callable:
    def check(ctx) -> str:
        assert _snapshot(h, Path(ctx.vars["held"])) == ctx.vars["state"], "the held run changed"
        assert not list(ctx.tmp.rglob(".*.tmp-*")) and not list(ctx.tmp.rglob(".*.old-*")), "temporaries left"
        return "the run's files all kept"
    return check


def prepared_held_by_export(h) -> Callable:
    def setup(ctx) -> None:
        h.prepared(ctx)
        (ctx.tmp / ".run.specheads.lock").write_text(json.dumps({
            "pid": _live_pid(), "command": "specheads export", "host": socket.gethostname(),
            "started": "2026-12-01T10:00:00+0000", "pid_start": None}))
        ctx.vars["state"] = _snapshot(h, ctx.path("run"))
    return setup


def run_unchanged(h) -> Callable:
    def check(ctx) -> str:
        assert _snapshot(h, ctx.path("run")) == ctx.vars["state"], "run changed"
        return "run folder unchanged"
    return check


def checkpoint_as(h, fmt: str | None, damage: Callable[[Path], None] | None = None) -> Callable:
    """The trained run, its newest checkpoint without checksums.sha256; `fmt`: the format its trainer_state.json
    then says (None: as written); `damage(folder)` applied after."""
    def setup(ctx) -> None:
        ck = newest_checkpoint(h.trained(ctx))
        (ck / "checksums.sha256").unlink()
        if fmt is not None:
            state = json.loads((ck / "trainer_state.json").read_text())
            (ck / "trainer_state.json").write_text(json.dumps({**state, "format": fmt}))
        if damage is not None:
            damage(ck)
    return setup


def symlinked_out(h) -> Callable:
    def setup(ctx) -> None:
        h.head(ctx)
        (ctx.tmp / "disk" / "exports").mkdir(parents=True)
        (ctx.tmp / "o").symlink_to(ctx.tmp / "disk" / "exports")
    return setup


def written_through(ctx) -> str:
    link, real = ctx.tmp / "o", ctx.tmp / "disk" / "exports"
    assert link.is_symlink() and Path(os.path.realpath(link)) == real, "the link was replaced"
    assert (real / "model.safetensors").is_file(), "the link's folder is empty"
    assert not [p.name for p in ctx.tmp.iterdir() if p.name.startswith(".o.")], "a hidden .o.* was left"
    return "o still a link; the export is in the folder it names; nothing left beside it"


def best_removed(h) -> Callable:
    def setup(ctx) -> None:
        import shutil

        shutil.rmtree(h.trained(ctx) / "best")
    return setup


def summary_names_no_missing_folder(ctx) -> str:
    summary = json.loads((ctx.path("run") / "train_summary.json").read_text())
    best = summary["best_dir"]
    assert best is None or Path(best).is_dir(), f"best_dir {best} does not exist"
    return f"train_summary.json best_dir {best}"


def unknown_model_type(ctx) -> None:
    t = target_copy(ctx)
    config = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**config, "model_type": "frobnicator"}))


def gguf_file(kind: str) -> Callable:
    """{tmp}/t.gguf: empty, text, or a whole GGUF file (llama.cpp's gguf package) cut in its tensor data."""
    def setup(ctx) -> None:
        path = ctx.tmp / "t.gguf"
        if kind == "empty":
            path.write_bytes(b"")
        elif kind == "text":
            path.write_text("hello world\n")
        else:
            import gguf
            import numpy as np

            w = gguf.GGUFWriter(str(path), "llama")
            w.add_block_count(1)
            w.add_tensor("token_embd.weight", np.arange(64 * 16, dtype=np.float32).reshape(64, 16))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            path.write_bytes(path.read_bytes()[:-64])
        ctx.vars["cache"] = str(ctx.tmp / "cache")
    return setup


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def own_cache(ctx) -> contextlib.AbstractContextManager:
    """A cache of the case's own: nothing converted lands in the user's."""
    return _env(SPECHEADS_CACHE=ctx.vars.get("cache", str(ctx.tmp / "cache")))


def nothing_cached(ctx) -> str:
    assert not (ctx.tmp / "cache").exists(), "something was written to the cache"
    return "nothing written to the cache"


def endless_source(ctx) -> None:
    (ctx.tmp / "x.jsonl").symlink_to("/dev/zero")  # NUL characters forever, valid UTF-8, never a newline


def long_prompt(ctx) -> None:
    """A JSONL of two prompts, the second (id "long") past the fixture target's 512 positions."""
    rows = [{"prompt": "ok"}, {"id": "long", "prompt": "word " * 700}]
    (ctx.tmp / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_without_heldout(h) -> Callable:
    def setup(ctx) -> None:
        run = h.trained(ctx)
        text = (run / "train_config.yaml").read_text()
        (run / "train_config.yaml").write_text(text.replace("val_fraction: 0.25", "val_fraction: 0.0"))
    return setup


def train_again_accepted(h) -> Callable:
    """Check: the advice of the message, followed: the same `train` again (the disk freed) is accepted."""
    def check(ctx) -> str:
        from specheads import cli

        argv = [a.format(**ctx.vars) for a in h.TRAIN + ["features.mode=online"]]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            rc = cli.main(argv)
        assert rc == 0, f"train again: exit {rc}: {err.getvalue().strip().splitlines()[-1:]}"
        return "no untrained best/ left; train again (space freed) trained"
    return check


def _disk_full_first_checkpoint(h) -> dict[str, Any]:
    # best/ of step 0 (~0.3 MB) fits under the limit, the first checkpoint's optimizer state (~0.5 MB) does not
    return {"area": "disk", "risk": "unclear", "name": "full disk at the first checkpoint, after the step-0 best/",
            "setup": h.prepared, "during": lambda c: file_size_limit(400_000),
            "argv": h.TRAIN + ["features.mode=online"], "rc": 2,
            "expect": "there is no earlier one (free space, then train again)", "check": train_again_accepted(h)}


# ------------------------------------------------------------------------------------------------- the rows

def cases(h) -> list[dict[str, Any]]:
    TRAIN, PREPARE, EXPORT = h.TRAIN, h.PREPARE, h.EXPORT
    RESUME = TRAIN + ["train.max_steps=3", "--resume"]
    gen = ["generate", "--target", "{tmp}/t", "--prompt", "hi", "--max-new-tokens", "2"]
    gguf = ["generate", "--target", "{tmp}/t.gguf", "--prompt", "hi", "--max-new-tokens", "2"]
    return [
        # data loss: one folder, two lock places; every writer honours both (runlock.py, utils.refuse_held)
        {"area": "lock", "risk": "data loss", "name": "export --force --out RUN while train runs in RUN",
         "setup": run_held_by_train(h), "argv": EXPORT + ["--out", "{run}", "--force"], "rc": 2,
         "expect": EXPECT_LOCKED, "check": held_run_unchanged(h)},
        {"area": "lock", "risk": "data loss", "name": "export --force --out a folder with a live run below it",
         "setup": run_held_by_train(h, "runs/run"), "argv": EXPORT + ["--out", "{tmp}/runs", "--force"], "rc": 2,
         "expect": "below it, is in use by pid", "check": held_run_unchanged(h)},
        {"area": "lock", "risk": "data loss", "name": "train into a folder an export is replacing",
         "setup": prepared_held_by_export(h), "argv": TRAIN, "rc": 2, "expect": "(specheads export",
         "check": run_unchanged(h)},
        # silently wrong
        {"area": "resume", "risk": "silent wrong result", "name": "checkpoint whose checksums.sha256 was removed",
         "setup": checkpoint_as(h, None, lambda ck: flip_byte(ck / "model.safetensors")), "argv": RESUME,
         "rc": 2, "expect": "a specheads-checkpoint/3 checkpoint always carries it"},
        {"area": "resume", "risk": "silent wrong result", "name": "older checkpoint (format /2) without checksums",
         "setup": checkpoint_as(h, "specheads-checkpoint/2"), "argv": RESUME, "rc": 0, "expect": "trained 3 steps"},
        {"area": "eval", "risk": "silent wrong result", "name": "eval prompt longer than the context window",
         "setup": lambda c: (h.head(c), long_prompt(c)),
         "argv": ["eval", "--head", "{head}", "--target", "{target}", "--dataset", "{tmp}/p.jsonl", "--dtype", "fp32"],
         "rc": 2, "expect": "tokens do not fit the context window of 512"},
        {"area": "export", "risk": "silent wrong result", "name": "--out is a symlink to a folder",
         "setup": symlinked_out(h), "argv": EXPORT + ["--out", "{tmp}/o"], "rc": 0, "expect": "exported",
         "check": written_through},
        {"area": "train", "risk": "silent wrong result", "name": "--resume of a finished run whose best/ was removed",
         "setup": best_removed(h), "argv": TRAIN + ["--resume"], "rc": 0, "expect": "is gone (removed since",
         "check": summary_names_no_missing_folder},
        # tracebacks that are one line now
        {"area": "config", "risk": "traceback", "name": "verbatim YAML tag in an override",
         "argv": TRAIN + ['train.lr=!<tag:yaml.org,2002:python/object/apply:os.system> ["touch {tmp}/pwned"]'],
         "rc": 2, "expect": "YAML tags are not allowed", "check": h.not_executed},
        {"area": "target", "risk": "traceback", "name": "target whose model_type transformers does not know",
         "setup": unknown_model_type, "argv": gen, "rc": 2, "expect": "which transformers"},
        {"area": "resume", "risk": "traceback", "name": "older checkpoint whose weights are not safetensors",
         "setup": checkpoint_as(h, "specheads-checkpoint/2",
                                lambda ck: (ck / "model.safetensors").write_bytes(b"not safetensors")),
         "argv": RESUME, "rc": 2, "expect": "model.safetensors: not a readable safetensors file"},
        {"area": "eval", "risk": "traceback", "name": "eval --dataset naming a folder", "setup": h.head,
         "argv": ["eval", "--head", "{head}", "--dataset", "{tmp}"], "rc": 2,
         "expect": "is a folder; expected a JSONL file"},
        *[{"area": "target", "risk": "traceback", "name": f"GGUF target that is {what}", "setup": gguf_file(kind),
           "during": own_cache, "argv": gguf, "rc": 2, "expect": expect, "check": nothing_cached}
          for kind, what, expect in (("empty", "empty", "not a GGUF file: an empty file"),
                                     ("text", "not GGUF", "does not start with the GGUF magic bytes"),
                                     ("cut", "cut short", "not a readable GGUF file, truncated or damaged"))],
        {"area": "prepare", "risk": "traceback", "name": "data.source that is one endless line",
         "setup": endless_source, "argv": PREPARE + ["data.source={tmp}/x.jsonl"], "rc": 2,
         "expect": "line 1 is longer than 64 Mi characters", "check": h.nothing_written},
        # unclear messages
        _disk_full_first_checkpoint(h),
        {"area": "eval", "risk": "unclear", "name": "eval --dataset heldout:RUN of a run without a held-out split",
         "setup": run_without_heldout(h), "argv": ["eval", "--head", "{run}/final", "--dataset", "heldout:{run}"],
         "rc": 2, "expect": "the run has no held-out split"},
        {"area": "disk", "risk": "unclear", "name": "disk already full: the first write is refused",
         "during": lambda c: file_size_limit(0), "argv": PREPARE, "rc": 2,
         "expect": ".specheads.lock: cannot write: File too large [EFBIG]", "check": h.nothing_written},
    ]
