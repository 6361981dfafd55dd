"""The accelerate side of a training run: the Accelerator a recipe's `train:` section asks for (plain DDP or one
process, DeepSpeed, mixed precision, gradient accumulation, seedable sampler) and its tracker (wandb offline
without an API key, tensorboard, none)."""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DeepSpeedPlugin, InitProcessGroupKwargs, ProjectConfiguration

from specheads.utils import SpecheadsError

log = logging.getLogger("specheads.train.trainer")  # the training run's lines under one name


def build_accelerator(cfg, output_dir: Path, seed: int) -> Accelerator:
    """The Accelerator of one run (`cfg`: the recipe's train: section), projects and logs under output_dir."""
    kwargs: dict[str, Any] = {}
    handlers = []
    if cfg.deepspeed:
        ds_path = Path(cfg.deepspeed)
        if not ds_path.exists():
            raise SpecheadsError(f"train.deepspeed: {ds_path} not found")
        if "LOCAL_RANK" not in os.environ and "RANK" not in os.environ:  # DeepSpeed needs a process group
            raise SpecheadsError(f"train.deepspeed: DeepSpeed runs under `accelerate launch` (e.g. `accelerate "
                                 f"launch --config_file configs/accelerate/deepspeed-zero2.yaml -m specheads "
                                 f"train --config ...`); this process was started without it")
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=str(ds_path),
                                                     gradient_accumulation_steps=cfg.grad_accum,
                                                     gradient_clipping=cfg.max_grad_norm or None)
    use_ds = bool(cfg.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if use_ds and not torch.cuda.is_available():
        # DeepSpeed on CPU falls back to gloo, but accelerate then counts one process unless told the backend
        # (only under DeepSpeed: the same handler breaks plain CPU runs).
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    # With our plugin (train.deepspeed) accelerate fills the JSON's "bf16": "auto" from mixed_precision; with a
    # launcher config naming a DeepSpeed file, precision comes from that file alone.
    mp = None if (use_ds and not cfg.deepspeed) else cfg.mixed_precision
    return Accelerator(
        gradient_accumulation_steps=cfg.grad_accum, mixed_precision=mp, log_with=tracker_name(cfg, output_dir),
        project_config=ProjectConfiguration(project_dir=str(output_dir),
                                            logging_dir=str(output_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        kwargs_handlers=handlers or None, **kwargs)


def tracker_name(cfg, output_dir: Path) -> str | None:
    """accelerate's log_with for train.tracker (wandb defaults to offline runs under output_dir)."""
    if cfg.tracker == "wandb":
        _wandb_defaults(output_dir)
        return "wandb"
    if cfg.tracker == "tensorboard":
        if not (importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")):
            raise SpecheadsError("train.tracker: tensorboard is not installed (pip install tensorboard), "
                                 "or use wandb / none")
        return "tensorboard"
    return None


def _wandb_defaults(output_dir: Path) -> None:
    """wandb without an API key fails; default to offline runs under the output folder (WANDB_MODE honoured)."""
    os.environ.setdefault("WANDB_DIR", str(output_dir))
    if "WANDB_MODE" not in os.environ and not os.environ.get("WANDB_API_KEY") and not _netrc_has_wandb():
        os.environ["WANDB_MODE"] = "offline"
        log.info("wandb: no API key, logging offline under %s/wandb (sync later with `wandb sync`)", output_dir)
    Path(output_dir).mkdir(parents=True, exist_ok=True)


def _netrc_has_wandb() -> bool:
    p = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in p.read_text()
    except OSError:
        return False


def flat_config(d: dict, prefix: str = "") -> dict:
    """A nested config dict as one level of dotted keys, lists as text (what trackers take)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = str(v)
        else:
            out[key] = v
    return out
