"""Training checkpoints that resume bit for bit and never unpickle.

    checkpoints/step-000200/
        trainer_state.json       format, step, best, history, last loss, micro-step counter, LR scheduler state
        model.safetensors        the trainable module's state (head; Medusa-2: adapted target + head)
        optimizer.safetensors    optimizer tensors; param groups and scalars as JSON in the file's metadata
        rng_state_<rank>.json    python / numpy / torch (CPU, CUDA) RNG states and the trainer's own generators
        pytorch_model/ + latest  DeepSpeed instead of model and optimizer: engine.save_checkpoint shards
        checksums.sha256         the sha256 of every file above (`sha256sum -c` format), verified on resume

Everything is written into `.step-NNNNNN.tmp`, then renamed: a kill mid-save leaves a temporary folder that the
next run removes, and the newest complete checkpoint is the one before. Resume checks every file against
checksums.sha256 first (a damaged file is one error naming it) and then the state files' keys and shapes. The
format in trainer_state.json says whether a checkpoint carries checksums: `specheads-checkpoint/3` always does (one
without its checksums.sha256 is refused: its files cannot be trusted); `/2`, written before checksums were recorded
in the format, loads with a log line saying so when it has none (a `/2` with checksums is verified as usual). Reading uses safetensors and `json` only;
accelerate's own files (`optimizer.bin`, `random_states_*.pkl`, `custom_checkpoint_*.pkl`) are neither written
nor read. DeepSpeed's shards are pickles written by `torch.save`: they are read with `torch.load(weights_only=True)`
and an allowlist of the few DeepSpeed classes they hold (an object of any other class is refused).
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specheads.config import changed_settings, flatten_config, upgrade_flat
from specheads.utils import (SpecheadsError, as_write_error, atomic_write_json, atomic_write_text, read_json,
                             read_text_bounded, remove_quietly, sha256_file)

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
STATE_NAME = "trainer_state.json"
FORMAT = "specheads-checkpoint/3"  # /3: checksums.sha256 is part of every checkpoint (verify_checksums needs it)
LEGACY_FORMATS = ("specheads-checkpoint/2",)  # safetensors + JSON, from before /3: checksums optional
MODEL_NAME = "model.safetensors"
OPTIMIZER_NAME = "optimizer.safetensors"
DS_TAG = "pytorch_model"  # DeepSpeed checkpoint tag (the sub-folder engine.save_checkpoint writes)
CHECKSUMS_NAME = "checksums.sha256"  # `<sha256>  <relative path>` per file, written last, before the rename
STEP_DIR = re.compile(r"step-(\d+)")
_warned: set[Path] = set()  # folders under checkpoints/ already reported as not ours


@dataclass
class TrainState:
    """What a checkpoint restores besides weights, optimizer and RNG."""

    step: int = 0  # optimizer steps done
    best_metric: float | None = None  # eval.select of the best evaluation
    best_step: int | None = None
    history: list[dict] = field(default_factory=list)  # evaluations with their step
    last_loss: float | None = None  # loss of the last optimizer step
    micro_step: int = 0  # accelerate's gradient-accumulation counter (Accelerator.step)


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (those with trainer_state.json), oldest first."""
    root = Path(output_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if not (p.is_dir() and p.name.startswith("step-") and (p / STATE_NAME).exists()):
            continue
        if STEP_DIR.fullmatch(p.name):
            found.append(p)
        elif p not in _warned:  # e.g. a copy `step-000200-old`: never resumed from, never deleted
            _warned.add(p)
            log.warning("%s: not a checkpoint name (step-<number>): ignored", p)
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def remove_partial(output_dir: str | Path) -> None:
    """Delete the temporary folders of saves that did not finish (main process, before training)."""
    root = Path(output_dir) / CKPT_DIR
    for tmp in root.glob(".step-*.tmp") if root.is_dir() else []:
        log.info("removing the unfinished checkpoint %s", tmp)
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------- what a run folder records
CONFIG_NAME = "train_config.yaml"  # the resolved recipe of the run's first segment (never rewritten on resume)
HISTORY_NAME = "train_config_history.yaml"  # one entry per resumed segment: step, time, settings changed
FINISHED = ("best", "final", "train_summary.json")  # what a trained run leaves besides its checkpoints
# Settings a resumed segment may change (recorded in HISTORY_NAME): when, how long and how the run is watched, not
# what its checkpoints mean. Everything else (seed, data.*, features.*, head.*, target.name / dtype, batch size,
# accumulation, lr and its schedule, optimizer, losses, LoRA, DeepSpeed) is refused on resume. A trailing "." names
# a whole section. launch: its address, port, timeout and backend may change (where the nodes meet), its node
# and process counts may not (they set the global batch with train.batch_size and grad_accum).
RESUMABLE = ("output_dir", "train.max_steps", "train.epochs", "train.save_every", "train.keep_last",
             "train.log_every", "train.tracker", "train.num_workers", "train.mixed_precision", "train.lora.merge",
             "target.trust_remote_code", "features.verify", "eval.", "launch.main_process_ip",
             "launch.main_process_port", "launch.timeout_s", "launch.backend")


def may_change_on_resume(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE)


def check_fresh_start(output_dir: str | Path) -> None:
    """A run without checkpoints starts from step 0 and would replace best/, final/ and train_summary.json: refused
    when a finished run left them (its checkpoints removed), so that a trained head is never lost silently."""
    out = Path(output_dir)
    found = [n for n in FINISHED if (out / n).exists()]
    if found:
        raise SpecheadsError(f"{out}: holds a trained run ({', '.join(found)}) without checkpoints to resume from; "
                             f"a new run would replace them: choose another output_dir, or remove them first")


def _recorded(path: Path, what: str):
    import yaml

    try:
        data = yaml.safe_load(read_text_bounded(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise SpecheadsError(f"{path}: unreadable {what} ({type(e).__name__}); restore it, or start a new run in "
                             f"another output_dir") from None
    return data


def read_history(output_dir: str | Path) -> list[dict]:
    """The resumed segments recorded in HISTORY_NAME (none when the run was never resumed)."""
    path = Path(output_dir) / HISTORY_NAME
    if not path.exists():
        return []
    data = _recorded(path, "resume history")
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise SpecheadsError(f"{path}: expected a list of resumed segments (the file is damaged)")
    return data


def check_resume_settings(output_dir: str | Path, recipe_dict: dict,
                          renamed: dict[str, str] | None = None) -> dict[str, list] | None:
    """Before a resume: the recipe against the run's train_config.yaml. A setting that changes what the checkpoints
    mean is one SpecheadsError naming every such key with its old -> new value. Returns the settings that changed
    since the last segment ({key: [old, new]}, allowed ones only), or None when the run has no train_config.yaml
    (nothing to compare: a warning). `renamed` ({old dotted key: new}, config.renamed_keys of the recipe class) maps
    the keys of a run written before a rename to their names now before comparing."""
    out = Path(output_dir)
    path = out / CONFIG_NAME
    if not path.exists():
        log.warning("%s: missing; the resumed settings cannot be checked against the run's (it is written anew)", path)
        return None
    recorded = _recorded(path, "recipe")
    if not isinstance(recorded, dict):
        raise SpecheadsError(f"{path}: expected the run's recipe (a mapping); restore it, or start a new run in "
                             f"another output_dir")
    renamed = renamed or {}
    first, now = upgrade_flat(flatten_config(recorded), renamed, str(path)), flatten_config(recipe_dict)
    refused = {k: v for k, v in changed_settings(first, now).items() if not may_change_on_resume(k)}
    if refused:
        shown = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in refused.items())
        raise SpecheadsError(f"--resume: {shown} differ from {path} (the run's checkpoints were trained with those "
                             f"values); resume with them, or start a new run in another output_dir")
    last = dict(first)
    for entry in read_history(out):
        changed = upgrade_flat(entry.get("changed") or {}, renamed, str(out / HISTORY_NAME))
        last.update({k: v[1] for k, v in changed.items() if isinstance(v, list) and len(v) == 2})
    return {k: [old, new] for k, (old, new) in changed_settings(last, now).items()}


def record_resume(output_dir: str | Path, step: int, checkpoint: Path, changed: dict[str, list]) -> None:
    """Append this resumed segment to HISTORY_NAME (main process): the step it resumed at, when, and what changed."""
    import datetime
    import yaml

    out = Path(output_dir)
    entry = {"resumed_at_step": step, "checkpoint": checkpoint.name,
             "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "changed": changed}
    history = read_history(out) + [entry]
    head = f"# resumed segments of this run; {CONFIG_NAME} is the recipe of its first segment\n"
    atomic_write_text(out / HISTORY_NAME, head + yaml.safe_dump(history, sort_keys=False, default_flow_style=None))
    if changed:
        log.info("resumed with %s (recorded in %s)", ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()),
                 out / HISTORY_NAME)


# ------------------------------------------------------------------------------------------------------------ save

def save_checkpoint(acc, model, opt, sched, state: TrainState, generators: dict[str, torch.Generator],
                    output_dir: Path, keep_last: int, first_advice: str = "free space, then train again") -> Path:
    """Write step `state.step` into a temporary folder, rename it, keep the newest `keep_last`. Every process calls
    this (DeepSpeed ranks write their own shards; each rank writes its RNG state). `first_advice`: what the error
    of a refused write advises when there is no earlier checkpoint (a command the folder then accepts)."""
    root = Path(output_dir) / CKPT_DIR
    final, tmp = root / f"step-{state.step:06d}", root / f".step-{state.step:06d}.tmp"
    if acc.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    acc.wait_for_everyone()
    try:
        if _is_deepspeed(acc):
            model.save_checkpoint(str(tmp), DS_TAG)
        elif acc.is_main_process:
            write_model_state(acc.unwrap_model(model), tmp)
            write_optimizer_state(opt, tmp)
        write_rng_state(tmp, acc.process_index, generators)
        acc.wait_for_everyone()
        if acc.is_main_process:
            atomic_write_json(tmp / STATE_NAME, {"format": FORMAT, **asdict(state), "micro_step": acc.step,
                                                 "num_processes": acc.num_processes,
                                                 "scheduler": _json_state(sched.state_dict())})
            write_checksums(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    except Exception as e:  # the OS refusing a write: the partial checkpoint goes, the earlier ones stay
        earlier = len(list_checkpoints(output_dir))
        kept = (f"the partial checkpoint was removed; the {earlier} earlier checkpoint(s) in {root} are kept (free "
                f"space, then continue with --resume)" if earlier else "the partial checkpoint was removed; there "
                f"is no earlier one ({first_advice})")
        err = as_write_error(e, final, kept, tmp)
        if err is None:
            raise  # anything else is left as a kill leaves it: remove_partial clears it on the next start
        if acc.is_main_process:
            remove_quietly(tmp)
        raise err from None
    if acc.is_main_process:
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s", final)
    acc.wait_for_everyone()
    return final


def write_model_state(module: torch.nn.Module, folder: Path) -> None:
    from safetensors.torch import save_model

    save_model(module, str(folder / MODEL_NAME), force_contiguous=True)  # tied weights stored once


def write_optimizer_state(opt, folder: Path) -> None:
    """opt.state_dict() as safetensors: tensors under `state.<param id>.<name>`, the rest as JSON metadata."""
    from safetensors.torch import save_file

    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, per_param in sd["state"].items():
        for name, v in per_param.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{pid}.{name}"] = v.detach().contiguous().cpu()
            else:
                scalars[f"{pid}.{name}"] = v
    meta = {"param_groups": json.dumps(_json_state(sd["param_groups"])), "scalars": json.dumps(scalars)}
    save_file(tensors, str(folder / OPTIMIZER_NAME), metadata=meta)


def write_rng_state(folder: Path, rank: int, generators: dict[str, torch.Generator]) -> None:
    import numpy as np

    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(mt), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state().tolist(),
             "generators": {k: g.get_state().tolist() for k, g in generators.items()}}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    atomic_write_json(folder / f"rng_state_{rank}.json", state)


def _json_state(obj):
    """A state dict as JSON values (tuples -> lists; callables' state, which LambdaLR keeps as None, stays None)."""
    if isinstance(obj, dict):
        return {str(k): _json_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_state(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        raise TypeError("tensor in a JSON state")  # optimizer tensors go to safetensors
    return obj


def write_checksums(folder: Path) -> None:
    """checksums.sha256 of every file under `folder` (sub-folders included), read back from disk."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS_NAME)
    lines = [f"{sha256_file(p)}  {p.relative_to(folder).as_posix()}\n" for p in files]
    atomic_write_text(folder / CHECKSUMS_NAME, "".join(lines))


def verify_checksums(folder: Path, fmt: str = FORMAT) -> None:
    """Every file listed in checksums.sha256 is there with its recorded sha256; one SpecheadsError naming the first
    that is not. Files not listed (none of ours) are never read. Without the file: a checkpoint of format `fmt`
    FORMAT is refused (it always carries one: it was removed); a LEGACY_FORMATS one loads with a log line."""
    side = folder / CHECKSUMS_NAME
    if not side.exists():
        if fmt not in LEGACY_FORMATS:
            raise SpecheadsError(f"{side}: missing; a {fmt} checkpoint always carries it, so its files cannot be "
                                 f"verified (removed or lost since the save): remove {folder} to resume from the "
                                 f"checkpoint before it")
        log.info("%s: format %s and no %s: written by a specheads that did not record checksums in the format, or "
                 "the file was removed since; its files are not verified", folder, fmt, CHECKSUMS_NAME)
        return
    try:
        lines = read_text_bounded(side).splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecheadsError(f"{side}: unreadable ({type(e).__name__}: {e})") from None
    if not any(line.endswith(f"  {STATE_NAME}") for line in lines):  # every save lists it: the file was cut short
        raise SpecheadsError(f"{side}: does not list {STATE_NAME} (the file is damaged)")
    for n, line in enumerate(lines, 1):
        digest, _, rel = line.partition("  ")
        bad_path = not rel or Path(rel).is_absolute() or ".." in Path(rel).parts
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or bad_path:
            raise SpecheadsError(f"{side}: line {n} is not '<64 hex digits>  <file>' (the file is damaged)")
        path = folder / rel
        if not path.is_file():
            raise SpecheadsError(f"{path}: missing (listed in {CHECKSUMS_NAME}; the checkpoint is incomplete); remove "
                                 f"{folder} to resume from the checkpoint before it")
        if sha256_file(path) != digest:
            raise SpecheadsError(f"{path}: sha256 differs from the one recorded in {CHECKSUMS_NAME} when the "
                                 f"checkpoint was saved (the file is damaged); remove {folder} to resume from the "
                                 f"checkpoint before it")


# ------------------------------------------------------------------------------------------------------------ load

def load_checkpoint(acc, model, opt, sched, folder: Path, generators: dict[str, torch.Generator]) -> TrainState:
    """Restore weights, optimizer, scheduler, RNG states and counters from `folder` (every process calls this)."""
    st = read_json(folder / STATE_NAME)
    fmt = st.get("format") if isinstance(st, dict) else None
    if fmt not in (FORMAT, *LEGACY_FORMATS):
        if _format_version(fmt) > _format_version(FORMAT):
            raise SpecheadsError(f"{folder / STATE_NAME}: format {fmt!r} is newer than this specheads reads "
                                 f"({FORMAT!r}): resume it with the specheads that wrote it")
        raise SpecheadsError(f"{folder}: written by an older specheads (accelerate's pickled state); resume never "
                             f"unpickles, so it cannot continue from it: start a new run in another output_dir")
    verify_checksums(folder, fmt)
    check_state(st, folder)
    if _is_deepspeed(acc):
        load_deepspeed(model, folder)
    else:
        read_model_state(acc.unwrap_model(model), folder)
        read_optimizer_state(opt, folder)
    try:
        sched.load_state_dict(st["scheduler"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SpecheadsError(f"{folder / STATE_NAME}: key 'scheduler': not this run's LR scheduler state "
                             f"({type(e).__name__}: {e})") from None
    read_rng_state(folder, acc.process_index, generators, st.get("num_processes"), acc.num_processes)
    acc.step = int(st.get("micro_step", 0))
    fields = {k: st[k] for k in ("step", "best_metric", "best_step", "history", "last_loss") if k in st}
    return TrainState(**fields, micro_step=acc.step)


def _format_version(fmt) -> int:
    """3 for "specheads-checkpoint/3"; 0 for anything else."""
    head, _, n = fmt.rpartition("/") if isinstance(fmt, str) else ("", "", "")
    return int(n) if head == "specheads-checkpoint" and n.isdigit() else 0


def check_state(st: dict, folder: Path) -> None:
    """trainer_state.json has the keys resume needs, of the right types, and the step its folder is named for."""
    path = folder / STATE_NAME

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    def is_num(v) -> bool:
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))

    missing = [k for k in ("step", "scheduler") if k not in st]
    if missing:
        raise SpecheadsError(f"{path}: key(s) {missing} missing (the state file is damaged)")
    checks = {"step": is_int, "scheduler": lambda v: isinstance(v, dict), "micro_step": is_int,
              "history": lambda v: isinstance(v, list) and all(isinstance(h, dict) for h in v),
              "best_metric": is_num, "last_loss": is_num, "best_step": lambda v: v is None or is_int(v),
              "num_processes": lambda v: v is None or (is_int(v) and v >= 1)}
    for key, ok in checks.items():
        if key in st and not ok(st[key]):
            raise SpecheadsError(f"{path}: key {key!r}: unexpected value {str(st[key])[:80]!r} (the state file is "
                                 f"damaged)")
    m = STEP_DIR.fullmatch(folder.name)
    if m and int(m.group(1)) != st["step"]:
        raise SpecheadsError(f"{path}: key 'step' is {st['step']} but the folder is {folder.name} (the state file "
                             f"is damaged or was copied from another checkpoint)")


def read_model_state(module: torch.nn.Module, folder: Path) -> None:
    from safetensors.torch import load_model

    path = folder / MODEL_NAME
    if not path.exists():
        raise SpecheadsError(f"{path}: missing (the checkpoint is incomplete)")
    try:
        load_model(module, str(path), strict=True, device=str(next(module.parameters()).device))
    except (RuntimeError, OSError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecheadsError(f"{path}: does not fit this run's model ({msg})") from None
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError: not a safetensors file (never unpickled)
        if type(e).__name__ != "SafetensorError":
            raise
        raise SpecheadsError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:200]}); the "
                             f"checkpoint is damaged: remove {folder} to resume from the checkpoint before it") from None


def read_optimizer_state(opt, folder: Path) -> None:
    from safetensors import safe_open

    path = folder / OPTIMIZER_NAME
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        groups, scalars = json.loads(meta["param_groups"]), json.loads(meta["scalars"])
    except (OSError, KeyError, ValueError, json.JSONDecodeError) as e:
        raise SpecheadsError(f"{path}: not a readable optimizer state ({type(e).__name__}: {e})") from None
    except Exception as e:  # safetensors' own SafetensorError on bad bytes
        raise SpecheadsError(f"{path}: not a readable optimizer state ({type(e).__name__}: {e})") from None
    state: dict[int, dict] = {}
    for key, t in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = t
    for key, v in scalars.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    live = opt.state_dict()["param_groups"]
    if len(groups) != len(live) or any(len(g["params"]) != len(h["params"]) for g, h in zip(groups, live)):
        raise SpecheadsError(f"{path}: parameter groups differ from this run's (another head or settings?)")
    for g, h in zip(groups, live):  # JSON has no tuples: give back the live groups' tuple types (AdamW betas)
        for k, v in h.items():
            if isinstance(v, tuple) and isinstance(g.get(k), list):
                g[k] = tuple(g[k])
    opt.load_state_dict({"state": state, "param_groups": groups})


def read_rng_state(folder: Path, rank: int, generators: dict[str, torch.Generator], saved_procs, procs: int) -> None:
    import numpy as np

    path = folder / f"rng_state_{rank}.json"
    if not path.exists() or saved_procs != procs:
        log.warning("%s: written by %s processes, resumed on %d: data order continues, random streams restart "
                    "(the result is not bit-identical to an uninterrupted run)", folder, saved_procs, procs)
        return
    st = read_json(path)
    try:
        version, mt, gauss = st["python"]
        random.setstate((version, tuple(mt), gauss))
        name, keys, pos, has_gauss, cached = st["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in st["cuda"]])
        for k, g in generators.items():
            if k in st["generators"]:
                g.set_state(torch.tensor(st["generators"][k], dtype=torch.uint8))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as e:
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        raise SpecheadsError(f"{path}: not a valid RNG state ({type(e).__name__}: {msg}); the file is "
                             f"damaged") from None


# ------------------------------------------------------------------------------------------------------- DeepSpeed

def _is_deepspeed(acc) -> bool:
    from accelerate.utils import DistributedType

    return acc.distributed_type == DistributedType.DEEPSPEED


def _deepspeed_safe_globals() -> list:
    """The classes a ZeRO-1/2 checkpoint pickles besides tensors and containers (checked on this DeepSpeed:
    ZeroStageEnum, LossScaler and fragment_address; DynamicLossScaler for fp16 runs)."""
    allowed = []
    for mod, names in (("deepspeed.runtime.zero.config", ["ZeroStageEnum"]),
                       ("deepspeed.runtime.fp16.loss_scaler", ["LossScaler", "DynamicLossScaler"]),
                       ("deepspeed.utils.tensor_fragment", ["fragment_address"])):
        try:
            m = __import__(mod, fromlist=names)
        except ImportError:
            continue
        allowed += [getattr(m, n) for n in names if hasattr(m, n)]
    return allowed


def load_deepspeed(engine, folder: Path) -> None:
    """engine.load_checkpoint with every file read by torch.load(weights_only=True) (DeepSpeed itself passes
    weights_only=False); an object outside the allowlist is one SpecheadsError naming the file."""
    ce = engine.checkpoint_engine
    allowed = _deepspeed_safe_globals()

    def safe_load(path, map_location=None):
        import pickle

        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).split("\n\n")[0].splitlines()[-1][:300]
            raise SpecheadsError(f"{path}: refused to unpickle ({first}); only tensors and DeepSpeed's own state "
                                 f"classes are loaded") from None

    ce.load = safe_load
    path, _ = engine.load_checkpoint(str(folder), DS_TAG, load_lr_scheduler_states=False)
    if path is None:
        raise SpecheadsError(f"{folder / DS_TAG}: DeepSpeed found no checkpoint to load")
