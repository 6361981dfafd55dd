"""Training on accelerate: the frozen target supplies features, the head learns; nothing home-made where accelerate
already does it (device placement, DDP, DeepSpeed ZeRO, mixed precision, gradient accumulation, state saving,
trackers).

    run_training(recipe)        # builds target, head and data from the recipe (what `specheads train` calls)
    Trainer(recipe, target, head, train_ds, val_ds).train()   # the engine, with everything injected (tests)

Layout under `<output_dir>`:
    train_config.yaml            the resolved recipe (written before the first step)
    checkpoints/step-000200/     accelerator.save_state (model, optimizer, scheduler, RNG) + trainer_state.json;
                                 written to a temporary folder then renamed; the last `keep_last` kept
    best/                        the head with the best simulated τ (native head folder, `load_head` reads it)
    final/                       the head at the end of training
    wandb/ or logs/              tracker output

Resume (`resume=True`) restores model, optimizer, scheduler, RNG and data position from the newest checkpoint: the
sampler is seeded (shuffle order = f(seed, epoch)) and the batches already used in the epoch are skipped with
`skip_first_batches`; a run killed after checkpoint k and resumed ends with the same weights as an uninterrupted one.
Shapes: B batch, T sequence, F feature layers, D hidden.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specheads.utils import SpecheadsError, atomic_write_json

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
STATE_NAME = "trainer_state.json"


@dataclass
class TrainConfig:
    lr: float = 3e-4  # AdamW peak learning rate (EAGLE-3 repo: 1e-4 at batch 16 x 2048 tokens on GPUs)
    weight_decay: float = 0.0  # AdamW decoupled weight decay (EAGLE/Medusa repos: 0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW (EAGLE repo)
    epochs: int = 1  # passes over the training split (ignored when max_steps is set)
    max_steps: int | None = None  # optimizer steps; None = epochs x ceil(batches / grad_accum)
    batch_size: int = 4  # samples per process per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step (effective batch = batch_size x grad_accum x processes)
    warmup_steps: int = 50  # linear warm-up steps, then cosine decay to 0 (transformers schedule)
    max_grad_norm: float = 0.5  # clip by global norm (EAGLE repo: 0.5); 0 = off
    save_every: int = 500  # optimizer steps between checkpoints (0 = only at the end)
    keep_last: int = 2  # checkpoints kept (older ones deleted after a new one is written)
    log_every: int = 10  # optimizer steps between tracker/log lines
    mixed_precision: str = "no"  # no | bf16 (head forward under bf16 autocast; master weights fp32)
    tracker: str = "wandb"  # wandb | tensorboard | none (wandb offline under <output_dir> without an API key)
    deepspeed: str | None = None  # DeepSpeed JSON (configs/deepspeed/zero2.json); None = plain DDP / one process
    soft_labels: bool = False  # Medusa: soft CE against the target distribution instead of the data's tokens
    loss_decay: float = 0.8  # weight 0.8^k per Medusa head / EAGLE-3 TTT step (papers)
    noise: float = 0.2  # EAGLE(-3): width of uniform noise on input features (EAGLE repo: U(-0.1, 0.1))
    eagle_w_reg: float = 1.0  # EAGLE-1 SmoothL1 feature regression weight (paper)
    eagle_w_ce: float = 0.1  # EAGLE-1 soft CE weight (paper)
    block_gamma: float = 4.0  # DSpark / DFlash: draft j weighted exp(-j / gamma) (DeepSpec loss_decay_gamma 4)
    block_w_ce: float = 0.1  # DSpark / DFlash: soft CE against the target (DeepSpec ce_loss_alpha 0.1)
    block_w_l1: float = 0.9  # DSpark / DFlash: ||q - p||_1 = 2 TV (DeepSpec l1_loss_alpha 0.9)
    confidence_alpha: float = 1.0  # DSpark: confidence BCE weight (DeepSpec / speculators confidence_head_alpha)
    max_anchors: int = 512  # DSpark / DFlash: blocks per sequence and step (DeepSpec num_anchors 512 at 4k tokens)
    block_full_vocab: bool = False  # DSpark / DFlash: target over the full vocab (exact acceptance; ~2x the step)
    num_workers: int = 0  # DataLoader workers (0: features are already tensors; workers cost RAM per process)
    # Medusa-2 (head.kind medusa, features.mode online): LoRA on the target trained jointly with the heads
    lora: bool = False  # off = Medusa-1 (frozen target)
    lora_r: int = 32  # LoRA rank (Medusa-2 repo scripts)
    lora_alpha: int = 16  # LoRA scale numerator
    lora_dropout: float = 0.05  # LoRA dropout
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    lora_lr_ratio: float = 0.25  # adapters' lr = lr x this (Medusa-2: heads at a higher lr than the backbone)
    lora_warmup_steps: int = 0  # heads-only first stage: adapters at lr 0 for this many steps
    lm_loss_weight: float = 1.0  # weight of KL(original target || adapted target) on assistant tokens
    lora_merge: bool = False  # at the end also write the merged target to <output_dir>/merged-target

    def __post_init__(self) -> None:
        checks = {"batch_size": self.batch_size >= 1, "grad_accum": self.grad_accum >= 1,
                  "epochs": self.epochs >= 1, "warmup_steps": self.warmup_steps >= 0,
                  "save_every": self.save_every >= 0, "keep_last": self.keep_last >= 1,
                  "log_every": self.log_every >= 1, "lr": self.lr > 0,
                  "max_steps": self.max_steps is None or self.max_steps >= 1, "max_anchors": self.max_anchors >= 1,
                  "block_gamma": self.block_gamma > 0}
        for k, ok in checks.items():
            if not ok:
                raise SpecheadsError(f"train.{k}: invalid value {getattr(self, k)!r}")
        if self.mixed_precision not in ("no", "bf16"):
            raise SpecheadsError(f"train.mixed_precision: {self.mixed_precision!r} is not one of ['no', 'bf16']")
        if self.tracker not in ("wandb", "tensorboard", "none"):
            raise SpecheadsError(f"train.tracker: {self.tracker!r} is not one of ['wandb', 'tensorboard', 'none']")
        if len(self.betas) != 2:
            raise SpecheadsError(f"train.betas: expected two numbers, got {self.betas!r}")


# ------------------------------------------------------------------------------------------------------ data plumbing

def pad_collate(samples: list[dict], pad_id: int = 0) -> dict:
    """Right-pad a list of {"input_ids" [T], "loss_mask" [T], optional "hidden" [T,F,D]} into a batch dict."""
    B = len(samples)
    T = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    lm = torch.zeros(B, T, dtype=torch.long)
    am = torch.zeros(B, T, dtype=torch.long)
    hidden = None
    if "hidden" in samples[0]:
        h0 = samples[0]["hidden"]
        hidden = torch.zeros((B, T) + tuple(h0.shape[1:]), dtype=h0.dtype)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n] = torch.as_tensor(s["input_ids"], dtype=torch.long)
        lm[i, :n] = torch.as_tensor(s["loss_mask"], dtype=torch.long)
        am[i, :n] = 1
        if hidden is not None:
            hidden[i, :n] = s["hidden"]
    out = {"input_ids": ids, "loss_mask": lm, "attention_mask": am}
    if hidden is not None:
        out["hidden"] = hidden
    return out


class TokenDataset(torch.utils.data.Dataset):
    """A datasets.Dataset (input_ids, loss_mask) as torch samples (online mode: features computed per batch)."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        row = self.ds[int(i)]
        return {"input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long),
                "loss_mask": torch.as_tensor(row["loss_mask"], dtype=torch.long)}


# ------------------------------------------------------------------------------------------------------- checkpoints

def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (those with trainer_state.json), oldest first."""
    root = Path(output_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / STATE_NAME).exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


@dataclass
class TrainResult:
    steps: int  # optimizer steps done
    best_metric: float | None  # simulated τ of the best evaluation
    best_step: int | None
    history: list[dict]  # evaluation metrics with their step
    output_dir: Path
    last_loss: float | None = None


class Trainer:
    """The engine. `head` is a DraftHead (or a stand-in with the same forward); train_ds/val_ds yield samples that
    `collate_fn` batches (with `hidden` for offline features; without, features are extracted online)."""

    def __init__(self, recipe, target, head, train_ds, val_ds=None, collate_fn: Callable | None = None,
                 layers: list[int] | None = None, head_layers: list[int] | None = None,
                 extract_fn: Callable | None = None):
        self.recipe = recipe
        self.cfg: TrainConfig = recipe.train
        self.target = target
        self.head = head
        self.train_ds = train_ds
        self.val_ds = val_ds
        self.collate_fn = collate_fn or pad_collate
        self.kind = recipe.head.kind
        cfg_layers = getattr(getattr(head, "config", None), "feature_layers", None)
        self.head_layers = list(head_layers or cfg_layers or [target.num_layers])
        L = target.num_layers
        self.layers = list(layers or sorted(set(self.head_layers) | {L}))
        self.extract_fn = extract_fn
        self.output_dir = Path(recipe.output_dir)

    # -- accelerate ------------------------------------------------------------------------------------------------
    def _accelerator(self):
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration

        cfg = self.cfg
        kwargs: dict[str, Any] = {}
        handlers = []
        if cfg.deepspeed:
            from accelerate.utils import DeepSpeedPlugin

            ds_path = Path(cfg.deepspeed)
            if not ds_path.exists():
                raise SpecheadsError(f"train.deepspeed: {ds_path} not found")
            kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=str(ds_path),
                                                         gradient_accumulation_steps=cfg.grad_accum,
                                                         gradient_clipping=cfg.max_grad_norm or None)
        use_ds = bool(cfg.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if use_ds and not torch.cuda.is_available():
            # DeepSpeed on CPU falls back to gloo, but accelerate then counts one process unless told the backend
            # (only under DeepSpeed: the same handler breaks plain CPU runs).
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
        log_with = None
        if cfg.tracker == "wandb":
            _wandb_defaults(self.output_dir)
            log_with = "wandb"
        elif cfg.tracker == "tensorboard":
            import importlib.util

            if not (importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")):
                raise SpecheadsError("train.tracker: tensorboard is not installed (pip install tensorboard), "
                                     "or use wandb / none")
            log_with = "tensorboard"
        # With our plugin (train.deepspeed) accelerate fills the JSON's "bf16": "auto" from mixed_precision; with a
        # launcher config naming a DeepSpeed file, precision comes from that file alone.
        mp = None if (use_ds and not cfg.deepspeed) else cfg.mixed_precision
        acc = Accelerator(
            gradient_accumulation_steps=cfg.grad_accum, mixed_precision=mp, log_with=log_with,
            project_config=ProjectConfiguration(project_dir=str(self.output_dir),
                                                logging_dir=str(self.output_dir / "logs")),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=self.recipe.seed),
            kwargs_handlers=handlers or None, **kwargs)
        return acc

    def _dataloader(self, ds, batch_size, shuffle):
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, collate_fn=self.collate_fn,
                                           num_workers=self.cfg.num_workers, drop_last=False)

    def _with_hidden(self, batch: dict) -> dict:
        """Offline batches carry `hidden`; online ones get it from the frozen target now (no grad, target dtype)."""
        if "hidden" in batch:
            return batch
        if self.extract_fn is not None:
            hidden = self.extract_fn(self.target, batch["input_ids"], batch["attention_mask"], self.layers)
        else:
            hidden = default_extract(self.target, batch["input_ids"], batch["attention_mask"], self.layers)
        return {**batch, "hidden": hidden}

    # -- the loop --------------------------------------------------------------------------------------------------
    def train(self, resume: bool = False, stop_after: int | None = None) -> TrainResult:
        """Train to the end (or, for tests and preemption drills, return right after step `stop_after`'s checkpoint)."""
        from accelerate import skip_first_batches
        from accelerate.utils import set_seed
        from transformers import get_cosine_schedule_with_warmup

        from specheads.config import config_to_dict, format_config, save_config
        from specheads.train.evaluate import evaluate
        from specheads.train.steps import LossSettings, train_loss

        cfg, out = self.cfg, self.output_dir
        acc = self._accelerator()
        self.accelerator = acc
        set_seed(self.recipe.seed)
        self.target.model.to(acc.device)
        if any(p.requires_grad for p in self.target.model.parameters()):
            raise SpecheadsError("target: parameters require grad; the target must be frozen (load_target does this)")
        module = self.head
        if cfg.lora:
            from specheads.train.lora import LoraSettings, Medusa2Model, add_adapters

            if self.kind != "medusa":
                raise SpecheadsError(f"train.lora: Medusa-2 adapters need head.kind medusa, not {self.kind!r}")
            if self.recipe.features.mode != "online" or "hidden" in self.collate_fn([self.train_ds[0]]):
                raise SpecheadsError("train.lora: the features depend on the adapters; set features.mode=online")
            peft_model = add_adapters(self.target, LoraSettings(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                                                                list(cfg.lora_targets)))
            module = Medusa2Model(peft_model, self.head)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise SpecheadsError("head: no trainable parameters")
        if acc.is_main_process:
            log.info("resolved config:\n%s", format_config(self.recipe))
            out.mkdir(parents=True, exist_ok=True)
            save_config(self.recipe, out / "train_config.yaml")
            log.info("head %s: %.2fM trainable parameters; %d processes; %s", self.kind,
                     sum(p.numel() for p in params) / 1e6, acc.num_processes, acc.device)

        if cfg.lora:
            from specheads.train.lora import param_groups

            groups = param_groups(module, cfg.lr, cfg.lora_lr_ratio)
        else:
            groups = [{"params": params, "lr": cfg.lr}]
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        train_dl = self._dataloader(self.train_ds, cfg.batch_size, shuffle=True)
        val_dl = None
        if self.val_ds is not None and len(self.val_ds) > 0:
            n_val = min(len(self.val_ds), self.recipe.eval.max_samples)
            val_dl = self._dataloader(torch.utils.data.Subset(self.val_ds, range(n_val)),
                                      self.recipe.eval.batch_size, shuffle=False)
        head, opt, train_dl = acc.prepare(module, opt, train_dl)
        if val_dl is not None:
            val_dl = acc.prepare(val_dl)
        self.wrapped = head
        micro_per_epoch = len(train_dl)  # micro-batches per process per epoch
        if micro_per_epoch == 0:
            raise SpecheadsError("data: the training split is empty")
        steps_per_epoch = math.ceil(micro_per_epoch / cfg.grad_accum)
        total = cfg.max_steps or cfg.epochs * steps_per_epoch
        # The schedule counts optimizer steps (stepped by hand, not prepared: accelerate would step it once per
        # process, which makes N processes and grad-accum N disagree); saved with the state all the same.
        sched = get_cosine_schedule_with_warmup(opt, min(cfg.warmup_steps, total), total)
        if cfg.lora and cfg.lora_warmup_steps:
            # heads-only warm-up: the adapters' group stays at lr 0, then follows the same schedule
            cos, hold = sched.lr_lambdas[0], cfg.lora_warmup_steps
            sched = torch.optim.lr_scheduler.LambdaLR(opt, [cos, lambda s: 0.0 if s < hold else cos(s)])
        acc.register_for_checkpointing(sched)

        step, best, best_step, history = 0, None, None, []
        if not resume and list_checkpoints(out):
            raise SpecheadsError(f"{out / CKPT_DIR}: checkpoints of an earlier run are there; pass --resume to "
                                 f"continue it, or choose another output_dir")
        if resume:
            ckpts = list_checkpoints(out)
            if not ckpts:
                raise SpecheadsError(f"--resume: no checkpoint under {out / CKPT_DIR}")
            acc.load_state(str(ckpts[-1]))
            st = json.loads((ckpts[-1] / STATE_NAME).read_text())
            step, best, best_step, history = st["step"], st["best_metric"], st["best_step"], st["history"]
            log.info("resumed from %s (step %d)", ckpts[-1], step)

        if cfg.tracker != "none":
            acc.init_trackers("specheads", config=_flat(config_to_dict(self.recipe)),
                              init_kwargs={"wandb": {"dir": str(out), "name": out.name}})
        settings = LossSettings(soft_labels=cfg.soft_labels, decay=cfg.loss_decay, noise=cfg.noise,
                                w_reg=cfg.eagle_w_reg, w_ce=cfg.eagle_w_ce, block_gamma=cfg.block_gamma,
                                block_w_ce=cfg.block_w_ce, block_w_l1=cfg.block_w_l1,
                                confidence_alpha=cfg.confidence_alpha, max_anchors=cfg.max_anchors,
                                block_full_vocab=cfg.block_full_vocab)
        ecfg = self.recipe.eval
        reduce = lambda t: acc.reduce(t.to(acc.device), "sum")  # noqa: E731

        eval_s = 0.0  # time spent evaluating, left out of the training tokens/s

        def run_eval() -> dict:
            nonlocal eval_s
            if val_dl is None:
                return {}
            t_eval = time.perf_counter()
            eval_head = acc.unwrap_model(head).head if cfg.lora else head  # Medusa-2: adapted features, same head
            metrics = evaluate(self.kind, eval_head, val_dl, self.target, self.layers, self.head_layers, ecfg,
                               reduce=reduce, get_hidden=self._with_hidden)
            eval_s += time.perf_counter() - t_eval
            return metrics

        def record_eval(metrics: dict) -> None:
            nonlocal best, best_step
            if not metrics:
                return
            history.append({"step": step, **metrics})
            acc.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
            score = metrics[ecfg.select]
            msg = " ".join(f"{k}={v:.3f}" for k, v in metrics.items() if not k.startswith("top") or k.endswith("_0"))
            if best is None or score > best:
                best, best_step = score, step
                self._export(out / "best")
                msg += " (best)"
            if acc.is_main_process:
                log.info("eval step %d: %s", step, msg)

        if step == 0 and ecfg.at_start:
            record_eval(run_eval())

        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=step, disable=not acc.is_local_main_process, desc=f"train {self.kind}",
                   dynamic_ncols=True)
        head.train()
        last_loss = None
        t0, tokens, eval_s = time.perf_counter(), 0, 0.0
        done = step >= total
        while not done:
            epoch, in_epoch = divmod(step, steps_per_epoch)
            skip = in_epoch * cfg.grad_accum  # micro-batches of this epoch already used (the last step may be short)
            train_dl.set_epoch(epoch)
            dl = skip_first_batches(train_dl, skip) if skip else train_dl
            if skip:
                dl.set_epoch(epoch)
            for batch in dl:
                with acc.accumulate(head):
                    if cfg.lora:
                        out_loss = self._medusa2_loss(head, batch, settings)
                    else:
                        batch = self._with_hidden(batch)
                        out_loss = train_loss(self.kind, head, batch, self.target, self.layers, self.head_layers,
                                              settings)
                    loss = out_loss.loss
                    bad = acc.gather(torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=acc.device))
                    if bad.sum() > 0:
                        ck = list_checkpoints(out)
                        raise SpecheadsError(
                            f"train: loss is {loss.item()} at step {step + 1} (epoch {epoch}); stopped. "
                            f"Last good checkpoint: {ck[-1] if ck else 'none'} (lower train.lr or check the data)")
                    acc.backward(loss)
                    if acc.sync_gradients and cfg.max_grad_norm > 0:
                        acc.clip_grad_norm_(head.parameters(), cfg.max_grad_norm)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                tokens += int(batch["attention_mask"].sum()) * acc.num_processes
                part_metrics = out_loss.metrics
                del batch, out_loss  # features live only for the step that used them
                if not acc.sync_gradients:
                    continue
                if not acc.optimizer_step_was_skipped:
                    sched.step()
                step += 1
                last_loss = float(loss.detach())
                bar.update(1)
                if step % cfg.log_every == 0 or step == total:
                    tps = tokens / max(1e-9, time.perf_counter() - t0 - eval_s)
                    bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{tps:.0f}", lr=f"{sched.get_last_lr()[0]:.2e}")
                    acc.log({"train/loss": last_loss, "train/lr": sched.get_last_lr()[0], "train/tokens_per_s": tps,
                             **{f"train/{k}": v for k, v in part_metrics.items()}}, step=step)
                if ecfg.every_steps and step % ecfg.every_steps == 0 and step < total:
                    record_eval(run_eval())
                    head.train()
                if cfg.save_every and step % cfg.save_every == 0 and step < total:
                    self._save(step, best, best_step, history)
                if stop_after is not None and step >= stop_after:
                    bar.close()
                    acc.wait_for_everyone()
                    return TrainResult(step, best, best_step, history, out, last_loss)
                if step >= total:
                    done = True
                    break
        bar.close()
        train_s = time.perf_counter() - t0 - eval_s
        record_eval(run_eval())
        self._save(step, best, best_step, history)
        self._export(out / "final")
        if acc.is_main_process:  # what this run did (a resumed run counts its own part), for reports
            atomic_write_json(out / "train_summary.json", {
                "kind": self.kind, "steps": step, "epochs": cfg.epochs, "train_seconds": round(train_s, 1),
                "eval_seconds": round(eval_s, 1), "tokens_this_run": tokens,
                "tokens_per_s": round(tokens / max(1e-9, train_s), 1), "last_loss": last_loss,
                "best_metric": best, "best_step": best_step, "select": ecfg.select, "history": history})
        if cfg.lora and cfg.lora_merge and acc.is_main_process:
            from specheads.train.lora import save_merged_target

            save_merged_target(acc.unwrap_model(head), out / "merged-target")
        acc.wait_for_everyone()
        acc.end_training()
        return TrainResult(step, best, best_step, history, out, last_loss)

    # -- saving ----------------------------------------------------------------------------------------------------
    def _save(self, step: int, best, best_step, history) -> Path:
        """accelerator.save_state into a temporary folder, then rename; keep the last `keep_last`."""
        acc, root = self.accelerator, self.output_dir / CKPT_DIR
        final = root / f"step-{step:06d}"
        tmp = root / f".step-{step:06d}.tmp"  # same name on every process (DeepSpeed ranks write their own shards)
        if acc.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        acc.wait_for_everyone()
        acc.save_state(str(tmp), safe_serialization=True)
        acc.wait_for_everyone()
        if acc.is_main_process:
            atomic_write_json(tmp / STATE_NAME, {"step": step, "best_metric": best, "best_step": best_step,
                                                 "history": history, "num_processes": acc.num_processes})
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in list_checkpoints(self.output_dir)[: -self.cfg.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint %s", final)
        acc.wait_for_everyone()
        return final

    def _export(self, path: Path) -> None:
        """The head as a native folder (head.save_pretrained), written by the main process."""
        acc = self.accelerator
        acc.wait_for_everyone()
        model = acc.unwrap_model(self.wrapped)
        ds = getattr(acc.state, "deepspeed_plugin", None)
        if ds is not None and ds.zero_stage == 3:
            # ZeRO-3 shards the parameters: gather them (every process takes part), rebuild the head on the main one.
            # (Not exercised on CPU here; ZeRO-1/2 keep full parameters on every process and take the path below.)
            state = acc.get_state_dict(self.wrapped)
            if acc.is_main_process:
                fresh = type(model)(model.config)
                fresh.load_state_dict(state)
                fresh.save_pretrained(path)
        elif acc.is_main_process and self.cfg.lora:
            from specheads.train.lora import save_adapters

            model.head.save_pretrained(path)
            save_adapters(model, path / "adapter")  # serve the head with the target + these adapters (or merged)
        elif acc.is_main_process and hasattr(model, "save_pretrained"):
            model.save_pretrained(path)
        acc.wait_for_everyone()

    def _medusa2_loss(self, model, batch: dict, settings):
        """Medusa-2: heads' loss on the adapted final state + lm_loss_weight x KL(original || adapted)."""
        from specheads.train.losses import LossOutput, medusa_loss
        from specheads.train.lora import kl_to_teacher

        dev = self.accelerator.device
        ids, amask, lmask = (batch[k].to(dev) for k in ("input_ids", "attention_mask", "loss_mask"))
        teacher = self.accelerator.unwrap_model(model).teacher_logits(ids, amask)  # [B,T,V], no grad
        head_logits, lm_logits = model(ids, amask)  # through the DDP wrapper: gradients sync
        out = medusa_loss(head_logits, ids, lmask, decay=settings.decay)
        kl = kl_to_teacher(lm_logits, teacher, lmask)
        return LossOutput(out.loss + self.cfg.lm_loss_weight * kl, {**out.metrics, "kl": float(kl.detach())})


def default_extract(target, input_ids, attention_mask, layers):
    """Online features: the same extraction the offline shards use (features.extract_features) -> [B,T,F,D]."""
    from specheads.train.features import extract_features

    return extract_features(target, input_ids, attention_mask, layers)


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


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = str(v)
        else:
            out[key] = v
    return out


# ------------------------------------------------------------------------------------------- from a recipe on disk

def assistant_token_counts(tokens, vocab_size: int) -> torch.Tensor:
    """[V] counts of loss-masked (assistant) tokens in a tokenised dataset: what the draft vocab is chosen from."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for batch in tokens.iter(batch_size=1024):
        for ids, lm in zip(batch["input_ids"], batch["loss_mask"]):
            ids_t = torch.as_tensor(ids, dtype=torch.long)
            counts += torch.bincount(ids_t[torch.as_tensor(lm, dtype=torch.bool)], minlength=vocab_size)
    return counts


def load_training_data(recipe, target):
    """(train_ds, val_ds, collate, layers, extract_fn) from `specheads prepare`'s output under recipe.output_dir."""
    from specheads.train.data import is_val
    from specheads.train.features import FeatureDataset, collate, extract_features
    from specheads.train.prepare import feature_layers_for

    from specheads.train.prepare import features_dir

    out = Path(recipe.output_dir)
    if recipe.features.mode == "offline":
        folder = features_dir(recipe)
        if not (folder / "manifest.json").exists():
            raise SpecheadsError(f"{folder}: no offline features; run `specheads prepare --config <recipe>` first "
                                 f"(or set features.mode=online)")
        train_ds, val_ds = FeatureDataset(folder, "train"), FeatureDataset(folder, "val")
        return train_ds, val_ds, collate, list(train_ds.layers), None
    import datasets

    tok_dir = out / "data" / "tokens"
    if not tok_dir.exists():
        raise SpecheadsError(f"{tok_dir}: no tokenised data; run `specheads prepare --config <recipe>` first")
    tokens = datasets.load_from_disk(str(tok_dir))
    vf = recipe.data.val_fraction
    flags = [is_val(c, vf) for c in tokens["conversation_id"]]
    train_idx = [i for i, v in enumerate(flags) if not v]
    val_idx = [i for i, v in enumerate(flags) if v]
    layers = feature_layers_for(recipe, target.num_layers)
    return (TokenDataset(tokens.select(train_idx)), TokenDataset(tokens.select(val_idx)), collate, layers,
            extract_features)


def run_training(recipe, resume: bool = False, target=None) -> TrainResult:
    """What `specheads train` runs: load the target (frozen, recipe dtype), the prepared data, build (or resume) the
    head, train. Every process calls this (accelerate launch)."""
    from accelerate.utils import set_seed

    from specheads.heads.base import build_head
    from specheads.target import load_target

    if target is None:
        target = load_target(recipe.target.name, dtype=recipe.target.dtype,
                             trust_remote_code=recipe.target.trust_remote_code)
    train_ds, val_ds, collate_fn, layers, extract_fn = load_training_data(recipe, target)
    counts = None
    if recipe.head.draft_vocab_size:  # chosen from the training split's assistant tokens (held-out rows excluded)
        from specheads.train.features import FeatureDataset, masked_token_counts

        if isinstance(train_ds, FeatureDataset):
            counts = masked_token_counts(train_ds, target.vocab_size)
        else:
            counts = assistant_token_counts(train_ds.ds, target.vocab_size)
    set_seed(recipe.seed)  # the same initial head on every process
    head = build_head(recipe.head, target, token_counts=counts)
    trainer = Trainer(recipe, target, head, train_ds, val_ds, collate_fn=collate_fn, layers=layers,
                      extract_fn=extract_fn)
    result = trainer.train(resume=resume)
    from specheads.train.evaluate import calibrate_run  # DSpark: confidence temperatures on the held-out split

    calibrate_run(recipe, target, val_ds, collate_fn, layers, extract_fn)
    return result
