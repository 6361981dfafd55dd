"""Training on accelerate: the frozen target supplies features, the head learns; nothing home-made where accelerate
already does it (device placement, DDP, DeepSpeed ZeRO, mixed precision, gradient accumulation, trackers).

    run_training(recipe)        # builds target, head and data from the recipe (what `specheads train` calls)
    Trainer(recipe, target, head, train_ds, val_ds).train()   # the engine, with everything injected (tests)

`Trainer.train` reads top-down: setup (checks first, then accelerator, module, optimizer, data, schedule, resume),
then per optimizer step `_train_step`, `_evaluate_if_due`, `_save_if_due`, and `_finish`. What differs between
head-only training and Medusa-2 (module, parameter groups, schedule, loss, evaluated head, export) is chosen once,
as a `HeadOnly` or `Medusa2` object (parts.py); each head kind's step is its file in kinds/.

Layout under `<output_dir>`:
    train_config.yaml            the resolved recipe (written once the run's checks have passed; a resume keeps it)
    train_config_history.yaml    one entry per resumed segment: its step, time and the settings it changed
    checkpoints/step-000200/     train/checkpoint.py: safetensors + JSON (never pickles); temporary folder then
                                 rename; the last `keep_last` kept
    best/                        the head with the best simulated τ (native head folder, `load_head` reads it);
                                 not written without a held-out split (no evaluation then: the head is final/)
    final/                       the head at the end of training
    train_summary.json           steps, timings, last loss, best, evaluation history
    wandb/ or logs/              tracker output

Resume (`resume=True`) restores model, optimizer, scheduler, RNG states (global and the noise generator), counters
and the data position from the newest checkpoint: the sampler is seeded (shuffle order = f(seed, epoch)), the
batches already used in the epoch are skipped with `skip_first_batches`, and the loaders and the feature noise draw
from generators of their own, so a run stopped or killed any number of times ends with the same weights as an
uninterrupted one. A resume refuses settings that change what the checkpoints mean (checkpoint.RESUMABLE lists
those that may change), and a fresh run refuses a folder holding a trained run's best/, final/ or summary.
Shapes: B batch, T sequence, F feature layers, D hidden.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import datasets
import torch
from accelerate import skip_first_batches
from accelerate.utils import set_seed
from tqdm.auto import tqdm

import specheads.target
from specheads.config import config_to_dict, format_changes, renamed_keys, save_config
from specheads.heads.base import build_head
from specheads.heads.kinds import kinds_where
from specheads.train import checkpoint
from specheads.train.accel import build_accelerator, flat_config
from specheads.train.calibrate import calibrate_run, has_confidence_head
from specheads.train.checkpoint import CKPT_DIR, TrainState, list_checkpoints
from specheads.train.data import chat_tokenizer, is_val
from specheads.train.dataset import (FeatureDataset, TokenDataset, assistant_token_counts, collate, eval_indices,
                                     masked_token_counts)
from specheads.train.devset import dev_answers, dev_batches
from specheads.train.evaluate import eval_summary, evaluate
from specheads.train.features import extract_features
from specheads.train.kinds import head_kind
from specheads.train.layout import check_split, feature_layers_for, features_dir, tokens_dir
from specheads.train.parts import HeadOnly, Medusa2, initial_head, training_target
from specheads.train.settings import TrainConfig
from specheads.train.steps import LossSettings
from specheads.train.stopping import stop_requests, stopped
from specheads.train.teacher import target_dtype_name
from specheads.utils import SpecheadsError, atomic_write_json, read_json

log = logging.getLogger(__name__)

__all__ = ["TrainResult", "Trainer", "run_training", "load_training_data"]


@dataclass
class TrainResult:
    steps: int  # optimizer steps done
    best_metric: float | None  # eval.select of the best evaluation (None: no held-out split, no evaluation)
    best_step: int | None
    history: list[dict]  # evaluation metrics with their step
    output_dir: Path
    last_loss: float | None = None
    best_dir: Path | None = None  # <output_dir>/best; None when no evaluation ran (no held-out split) or it is gone


@dataclass
class _Run:
    """The live objects of one `train` call."""

    acc: Any
    model: Any  # the prepared (DDP / DeepSpeed-wrapped) trainable module
    opt: Any
    sched: Any
    train_dl: Any
    val_dl: Any
    total: int  # optimizer steps of the whole run
    steps_per_epoch: int
    state: TrainState
    generators: dict  # the trainer's own RNGs, saved in checkpoints (noise)
    tokens: int = 0  # tokens trained on by this call (all processes)
    t0: float = 0.0
    eval_s: float = 0.0  # time spent evaluating, left out of the training tokens/s
    loss: Any = None  # loss tensor of the last micro-batch (a float only when logged or saved)
    metrics: dict = field(default_factory=dict)  # its metrics, tensors until logged
    stop: bool = False  # a process received SIGINT / SIGTERM: save after this optimizer step and stop


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
        self.collate_fn = collate_fn or collate
        self.kind = recipe.head.kind
        cfg_layers = getattr(getattr(head, "config", None), "feature_layers", None)
        self.head_layers = list(head_layers or cfg_layers or [target.num_layers])
        L = target.num_layers
        self.layers = list(layers or sorted(set(self.head_layers) | {L}))
        self.extract_fn = extract_fn
        self.output_dir = Path(recipe.output_dir)
        self._dev_cache: list[dict] | None = None  # the dev set's batches (eval.dev_prompts), made at first use

    # -- the loop --------------------------------------------------------------------------------------------------
    def train(self, resume: bool = False, stop_after: int | None = None) -> TrainResult:
        """Train to the end (or, for tests and preemption drills, return right after step `stop_after`). SIGINT /
        SIGTERM: the step in progress ends, a checkpoint of it is saved, then `Interrupted` (train/stopping.py)."""
        run = self._setup(resume)
        try:
            with stop_requests() as self._stop:
                return self._loop(run, stop_after)
        except BaseException:
            self._drop_untrained_best(run, resume)
            raise

    def _loop(self, run: _Run, stop_after: int | None) -> TrainResult:
        run.t0 = time.perf_counter()
        if run.state.step == 0 and self.recipe.eval.at_start:
            self._evaluate(run)
        bar = tqdm(total=run.total, initial=run.state.step, disable=not run.acc.is_local_main_process,
                   desc=f"{self.cfg.stage} {self.kind}", dynamic_ncols=True)
        run.model.train()
        while run.state.step < run.total:
            for batch in self._epoch_batches(run):
                if not self._train_step(run, batch):
                    continue  # gradients accumulate until the optimizer steps
                bar.update(1)
                self._log_if_due(run, bar)
                self._evaluate_if_due(run)
                self._save_if_due(run)
                if stop_after is not None and run.state.step >= stop_after:
                    bar.close()
                    run.acc.wait_for_everyone()
                    return self._result(run)
                if run.state.step >= run.total:
                    break
                if run.stop:  # a signal: this step is done; save it and leave (every process agreed on it)
                    bar.close()
                    self._stop_here(run)
        bar.close()
        return self._finish(run)

    def _stop_here(self, run: _Run):
        """After SIGINT / SIGTERM: a checkpoint of this step (unless the save just made it), then Interrupted."""
        step = run.state.step
        saved = [p for p in list_checkpoints(self.output_dir) if p.name == f"step-{step:06d}"]
        ck = saved[0] if saved else self._save(run)
        raise stopped(self._stop.signum, step, ck, f"continue with `specheads train --config "
                                                   f"{self.output_dir / checkpoint.CONFIG_NAME} --resume`")

    def _drop_untrained_best(self, run: _Run, resume: bool) -> None:
        """A fresh run that fails before its first checkpoint (a full disk at the first save, a NaN loss, a kill
        signal sent twice) leaves nothing to resume; a best/ it wrote from the untrained head (the step-0
        evaluation) would make `train` refuse the folder next time (check_fresh_start), though it holds nothing
        trained. It is removed, so that the advice "train again" holds; a best/ of a later step is kept."""
        if resume or run.state.best_step != 0 or list_checkpoints(self.output_dir) or not run.acc.is_main_process:
            return
        best = self.output_dir / "best"
        if best.is_dir():
            log.info("removing %s: the untrained head of step 0, written by this run, which stopped before its "
                     "first checkpoint", best)
            shutil.rmtree(best, ignore_errors=True)

    def _train_step(self, run: _Run, batch: dict) -> bool:
        """One micro-batch: forward, backward, optimizer step when the accumulation is full. True after a step."""
        acc, cfg = run.acc, self.cfg
        self.parts.settings.step, self.parts.settings.total_steps = run.state.step, run.total  # Domino's λ schedule
        with acc.accumulate(run.model):
            out = self.parts.loss(run.model, batch)
            self._check_finite(run, out.loss)
            acc.backward(out.loss)
            if acc.sync_gradients and cfg.max_grad_norm > 0:
                acc.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm)
            run.opt.step()
            run.opt.zero_grad(set_to_none=True)
        run.tokens += int(batch["attention_mask"].sum()) * acc.num_processes
        run.loss, run.metrics = out.loss.detach(), out.metrics
        del batch, out  # features live only for the step that used them
        if not acc.sync_gradients:
            return False
        if not acc.optimizer_step_was_skipped:
            run.sched.step()
        run.state.step += 1
        return True

    def _check_finite(self, run: _Run, loss: torch.Tensor) -> None:
        """Every process stops at the same micro-batch when any of them sees a NaN / inf loss; the same gather
        carries each process's stop request (a signal), so all of them stop after the same step."""
        acc = run.acc
        asked = getattr(self, "_stop", None) is not None and self._stop.signum is not None
        flags = torch.stack([(~torch.isfinite(loss.detach())).float().reshape(()), loss.new_tensor(float(asked))])
        gathered = acc.gather(flags.float().to(acc.device)).reshape(-1, 2)
        bad = gathered[:, 0]
        run.stop = bool(gathered[:, 1].sum() > 0)
        if bad.sum() > 0:
            ck = list_checkpoints(self.output_dir)
            epoch = run.state.step // run.steps_per_epoch
            raise SpecheadsError(f"train: loss is {loss.item()} at step {run.state.step + 1} (epoch {epoch}); "
                                 f"stopped. Last good checkpoint: {ck[-1] if ck else 'none'} (lower train.lr or "
                                 f"check the data)")

    def _epoch_batches(self, run: _Run):
        """The micro-batches of the current epoch not used yet (after a resume: `skip_first_batches`)."""
        epoch, in_epoch = divmod(run.state.step, run.steps_per_epoch)
        skip = in_epoch * self.cfg.grad_accum  # micro-batches of this epoch already used (the last step may be short)
        run.train_dl.set_epoch(epoch)
        if not skip:
            return run.train_dl
        dl = skip_first_batches(run.train_dl, skip)
        dl.set_epoch(epoch)
        return dl

    def _log_if_due(self, run: _Run, bar) -> None:
        step = run.state.step
        if not (step % self.cfg.log_every == 0 or step == run.total):
            return
        loss = self._last_loss(run)
        lr = run.sched.get_last_lr()[0]
        tps = run.tokens / max(1e-9, time.perf_counter() - run.t0 - run.eval_s)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:.0f}", lr=f"{lr:.2e}")
        metrics = {f"train/{k}": float(v) for k, v in run.metrics.items()}  # host syncs here, once per log line
        run.acc.log({"train/loss": loss, "train/lr": lr, "train/tokens_per_s": tps, **metrics}, step=step)

    def _last_loss(self, run: _Run) -> float | None:
        if run.loss is not None:
            run.state.last_loss = float(run.loss)
        return run.state.last_loss

    # -- evaluation ------------------------------------------------------------------------------------------------
    def _evaluate_if_due(self, run: _Run) -> None:
        every = self.recipe.eval.every_steps
        if every and run.state.step % every == 0 and run.state.step < run.total:
            self._evaluate(run)
            run.model.train()

    def _evaluate(self, run: _Run) -> None:
        """Held-out metrics, and the dev set's (prefixed dev_) when eval.dev_prompts is set; the best one by
        eval.select is exported to <output_dir>/best."""
        acc, st, ecfg = run.acc, run.state, self.recipe.eval
        t = time.perf_counter()
        reduce = lambda x: acc.reduce(x.to(acc.device), "sum")  # noqa: E731
        head = self.parts.eval_head(acc, run.model)
        metrics = {}
        if run.val_dl is not None:
            metrics = evaluate(self.kind, head, run.val_dl, self.target, self.layers, self.head_layers, ecfg,
                               reduce=reduce, get_hidden=self._with_hidden)
        if ecfg.dev_prompts:
            dev = evaluate(self.kind, head, self._dev(acc), self.target, self.layers, self.head_layers, ecfg,
                           reduce=reduce)
            metrics.update({f"dev_{k}": v for k, v in dev.items()})
        run.eval_s += time.perf_counter() - t
        if not metrics:
            return
        st.history.append({"step": st.step, **metrics})
        acc.log({f"eval/{k}": v for k, v in metrics.items()}, step=st.step)
        msg = eval_summary(metrics)
        if ecfg.select in metrics and (st.best_metric is None or metrics[ecfg.select] > st.best_metric):
            st.best_metric, st.best_step = metrics[ecfg.select], st.step
            self._export(run, self.output_dir / "best")
            msg += f" (best by {ecfg.select})"
        if acc.is_main_process:
            log.info("eval step %d: %s", st.step, msg)

    def _dev(self, acc) -> list[dict]:
        """This process's dev batches (train/devset.py): answers written once by the main process, features
        computed once per process."""
        if self._dev_cache is None:
            rows = dev_answers(self.recipe, self.target) if acc.is_main_process else None
            acc.wait_for_everyone()
            if rows is None:  # the main process has written them
                rows = dev_answers(self.recipe, self.target)
            self._dev_cache = dev_batches(rows, self.target, self.layers, acc.process_index, acc.num_processes)
        return self._dev_cache

    # -- saving ----------------------------------------------------------------------------------------------------
    def _save_if_due(self, run: _Run) -> None:
        every = self.cfg.save_every
        if every and run.state.step % every == 0 and run.state.step < run.total:
            self._save(run)

    def _save(self, run: _Run) -> Path:
        self._last_loss(run)
        best = run.state.best_step
        # a failed first save leaves nothing to resume: "train again" holds once best/ is gone (_drop_untrained_best
        # removes a step-0 one); a trained best/ is kept, and a new run into the folder would replace it
        again = "free space, then train again" if not best else (
            f"free space, then train again into another output_dir: {self.output_dir / 'best'} keeps the head of "
            f"step {best}")
        return checkpoint.save_checkpoint(run.acc, run.model, run.opt, run.sched, run.state, run.generators,
                                          self.output_dir, self.cfg.keep_last, first_advice=again)

    def _export(self, run: _Run, path: Path) -> None:
        """The head as a native folder (Medusa-2: plus adapter/), written by the main process."""
        acc = run.acc
        acc.wait_for_everyone()
        model = acc.unwrap_model(run.model)
        ds = getattr(acc.state, "deepspeed_plugin", None)
        if ds is not None and ds.zero_stage == 3:
            # ZeRO-3 shards the parameters: gather them (every process takes part), rebuild the head on the main one.
            # (Not exercised on CPU here; ZeRO-1/2 keep full parameters on every process and take the path below.)
            state = acc.get_state_dict(run.model)
            if acc.is_main_process:
                fresh = type(model)(model.config)
                fresh.load_state_dict(state)
                fresh.save_pretrained(path)
        elif acc.is_main_process:
            self.parts.export(model, path)
        acc.wait_for_everyone()

    def _finish(self, run: _Run) -> TrainResult:
        """Final evaluation, checkpoint and export; train_summary.json. A resumed run that had already reached the
        end (killed after its last checkpoint) neither evaluates nor saves again."""
        acc, st = run.acc, run.state
        train_s = time.perf_counter() - run.t0 - run.eval_s
        if not (st.history and st.history[-1]["step"] == st.step):
            self._evaluate(run)
        if not any(p.name == f"step-{st.step:06d}" for p in list_checkpoints(self.output_dir)):
            self._save(run)
        self._export(run, self.output_dir / "final")
        self._best_still_there(run)
        res = self._result(run)
        if acc.is_main_process:  # what this run did (a resumed run counts its own part), for reports
            self.parts.finish(acc, acc.unwrap_model(run.model), self.output_dir)
            atomic_write_json(self.output_dir / "train_summary.json", {
                "kind": self.kind, "steps": st.step, "epochs": self.cfg.epochs, "train_seconds": round(train_s, 1),
                "eval_seconds": round(run.eval_s, 1), "tokens_this_run": run.tokens,
                "tokens_per_s": round(run.tokens / max(1e-9, train_s), 1), "last_loss": res.last_loss,
                "best_metric": st.best_metric, "best_step": st.best_step, "select": self.recipe.eval.select,
                "best_dir": None if res.best_dir is None else str(res.best_dir), "history": st.history})
        acc.wait_for_everyone()
        acc.end_training()
        return res

    def _best_still_there(self, run: _Run) -> None:
        """A resumed run whose best/ was removed since: written again when the weights in hand are the best ones
        (best at the last step), else said (the summary then names no best_dir: only folders that exist)."""
        best, st = self.output_dir / "best", run.state
        if st.best_step is None or best.is_dir():
            return
        if st.best_step == st.step:
            self._export(run, best)
        elif run.acc.is_main_process:
            log.warning("%s: missing (removed after step %d wrote it); its weights are not kept anywhere: the head "
                        "is %s", best, st.best_step, self.output_dir / "final")

    def _result(self, run: _Run) -> TrainResult:
        st = run.state
        best_dir = self.output_dir / "best" if st.best_step is not None else None
        best_dir = best_dir if best_dir is not None and best_dir.is_dir() else None  # only a folder that exists
        return TrainResult(st.step, st.best_metric, st.best_step, list(st.history), self.output_dir,
                           self._last_loss(run), best_dir)

    # -- setup -----------------------------------------------------------------------------------------------------
    def _setup(self, resume: bool) -> _Run:
        """Everything before the first step: checks first (nothing is written before they pass), then the
        accelerator, the trainable module, optimizer, data, schedule and (resume) the newest checkpoint."""
        cfg, out = self.cfg, self.output_dir
        ckpts = list_checkpoints(out)
        if ckpts and not resume:
            raise SpecheadsError(f"{out / CKPT_DIR}: checkpoints of an earlier run are there; pass --resume to "
                                 f"continue it, or choose another output_dir")
        if resume and not ckpts:
            raise SpecheadsError(f"--resume: no checkpoint under {out / CKPT_DIR}")
        self._resume_changes = self._check_run_folder(resume)
        step = head_kind(self.kind)
        if step.check is not None:
            step.check(cfg)  # the kind's own checks of train: (Medusa's hard labels and train.loss)
        acc = self.accelerator = build_accelerator(cfg, out, self.recipe.seed)
        for ds in (self.train_ds, self.val_ds):  # checksums once per folder, by rank 0, not once per rank
            if acc.num_processes > 1 and isinstance(ds, FeatureDataset):
                ds.verify_once(acc.is_main_process, acc.wait_for_everyone)
        set_seed(self.recipe.seed)
        if getattr(self.target.model, "hf_device_map", None) is None:  # a device-mapped target stays where it is
            self.target.model.to(acc.device)
        if any(p.requires_grad for p in self.target.model.parameters()):
            raise SpecheadsError("target: parameters require grad; the target must be frozen (load_target does this)")
        # the noise has its own generator (one stream per process), so that no other draw shifts it
        noise = torch.Generator(device=acc.device).manual_seed(self.recipe.seed + acc.process_index)
        settings = LossSettings.from_config(cfg, generator=noise)
        self.parts = self._parts(settings)
        module = self.parts.module()
        opt = self._optimizer(acc, module)
        train_dl, val_dl = self._loaders()
        model, opt, train_dl = acc.prepare(module, opt, train_dl)
        val_dl = acc.prepare(val_dl) if val_dl is not None else None
        micro_per_epoch = len(train_dl)  # micro-batches per process per epoch
        if micro_per_epoch == 0:
            raise SpecheadsError("data: the training split is empty")
        steps_per_epoch = math.ceil(micro_per_epoch / cfg.grad_accum)
        total = cfg.max_steps or cfg.epochs * steps_per_epoch
        # The schedule counts optimizer steps (stepped by hand, not prepared: accelerate would step it once per
        # process, which makes N processes and grad-accum N disagree).
        sched = self.parts.schedule(opt, min(cfg.warmup_steps, total), total)
        generators = {"noise": noise, **self.parts.generators()}  # saved in checkpoints, restored on resume
        run = _Run(acc, model, opt, sched, train_dl, val_dl, total, steps_per_epoch, TrainState(), generators)
        if resume:
            run.state = checkpoint.load_checkpoint(acc, model, opt, sched, ckpts[-1], run.generators)
            log.info("resumed from %s (step %d)", ckpts[-1], run.state.step)
            self._resumed_from = ckpts[-1]
        self._start_logging(run, module, resume)
        return run

    def _parts(self, settings):
        """What differs between runs (parts.py): head-only training, or Medusa-2 with train.lora.enabled."""
        return Medusa2(self, settings) if self.cfg.lora.enabled else HeadOnly(self, settings)

    def _check_run_folder(self, resume: bool) -> dict | None:
        """Resume: the recipe against the run's recorded one (settings that change what the checkpoints mean are
        refused); returns the allowed changes, None without a record. A fresh run: no trained run's outputs here."""
        if resume:
            return checkpoint.check_resume_settings(self.output_dir, config_to_dict(self.recipe),
                                                    renamed_keys(type(self.recipe),
                                                                 data=config_to_dict(self.recipe)))
        checkpoint.check_fresh_start(self.output_dir)
        return None

    def _optimizer(self, acc, module):
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise SpecheadsError("head: no trainable parameters")
        if acc.is_main_process:
            log.info("head %s: %.2fM trainable parameters; %d processes; %s", self.kind,
                     sum(p.numel() for p in params) / 1e6, acc.num_processes, acc.device)
        cfg = self.cfg
        return torch.optim.AdamW(self.parts.param_groups(module, cfg.lr), lr=cfg.lr, betas=tuple(cfg.betas),
                                 weight_decay=cfg.weight_decay)

    def _loaders(self):
        """(train, val or None). Each loader has its own generator: an iterator's base seed is drawn from it, not
        from the global RNG (whose draws would otherwise depend on how many iterators a resumed run built)."""
        def loader(ds, batch_size, shuffle):
            g = torch.Generator().manual_seed(self.recipe.seed)
            return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, collate_fn=self.collate_fn,
                                               num_workers=self.cfg.num_workers, drop_last=False, generator=g)

        train_dl = loader(self.train_ds, self.cfg.batch_size, True)
        if self.val_ds is None or len(self.val_ds) == 0:
            return train_dl, None
        ecfg = self.recipe.eval
        picked = eval_indices(len(self.val_ds), ecfg.max_samples, self.recipe.seed)
        return train_dl, loader(torch.utils.data.Subset(self.val_ds, picked), ecfg.batch_size, False)

    def _start_logging(self, run: _Run, module, resume: bool) -> None:
        """Resolved config (train_config.yaml), stale temporary folders removed, trackers started."""
        acc, out = run.acc, self.output_dir
        if acc.is_main_process:
            log.info("%s", format_changes(self.recipe, out / checkpoint.CONFIG_NAME, out / "prepare_config.yaml"))
            out.mkdir(parents=True, exist_ok=True)
            self._record_config(run, resume)
            checkpoint.remove_partial(out)
            if run.val_dl is None:
                log.warning("no held-out split (data.val_fraction 0, or no held-out sample): no evaluation; "
                            "best/ is not written, the head is %s", out / "final")
        acc.wait_for_everyone()
        if self.cfg.tracker != "none":
            acc.init_trackers("specheads", config=flat_config(config_to_dict(self.recipe)),
                              init_kwargs={"wandb": {"dir": str(out), "name": out.name}})

    def _record_config(self, run: _Run, resume: bool) -> None:
        """train_config.yaml: the first segment's recipe, written by a fresh run (an old resume history removed);
        a resumed segment keeps it and appends itself to train_config_history.yaml."""
        out, changes = self.output_dir, getattr(self, "_resume_changes", None)
        if resume and changes is not None:
            checkpoint.record_resume(out, run.state.step, self._resumed_from, changes)
            return
        save_config(self.recipe, out / checkpoint.CONFIG_NAME)
        stale = out / checkpoint.HISTORY_NAME
        if not resume and stale.exists():
            log.info("removing %s (the resume history of an earlier run here)", stale)
            stale.unlink()


    def _with_hidden(self, batch: dict) -> dict:
        """Offline batches carry `hidden`; online ones get it from the frozen target now (no grad, target dtype)."""
        if "hidden" in batch:
            return batch
        extract = self.extract_fn or default_extract
        return {**batch, "hidden": extract(self.target, batch["input_ids"], batch["attention_mask"], self.layers)}


def default_extract(target, input_ids, attention_mask, layers):
    """Online features: the same extraction the offline shards use (features.extract_features) -> [B,T,F,D]."""
    return extract_features(target, input_ids, attention_mask, layers)


# ------------------------------------------------------------------------------------------- from a recipe on disk

def load_training_data(recipe, target):
    """(train_ds, val_ds, collate, layers, extract_fn) from `specheads prepare`'s output under recipe.output_dir."""
    if recipe.features.mode == "offline":
        folder = features_dir(recipe)
        if not (folder / "manifest.json").exists():
            raise SpecheadsError(f"{folder}: no offline features; run `specheads prepare --config <recipe>` first "
                                 f"(or set features.mode=online)")
        if not recipe.features.dir:  # its own features: their split is the one the recipe says (shared ones
            check_split(folder, recipe.data.val_fraction)  # carry the split of the recipe that extracted them)
        verify, dtype = recipe.features.verify, target_dtype_name(target)  # sidecars only of this lm_head dtype
        train_ds = FeatureDataset(folder, "train", verify, targets_dtype=dtype)
        val_ds = FeatureDataset(folder, "val", verify, targets_dtype=dtype)
        return train_ds, val_ds, collate, list(train_ds.layers), None
    tok_dir = tokens_dir(recipe)
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


def run_training(recipe, resume: bool = False, target=None, trainer_class: type | None = None) -> TrainResult:
    """What `specheads train` runs: load the target (frozen, recipe dtype), the prepared data, build the head (or
    load train.init_head; a resume restores its checkpoint over it), train. Every process calls this (accelerate
    launch). trainer_class: a Trainer subclass for another stage (train.stage opd: train/opd.run_opd passes its)."""
    if recipe.train.stage != "train" and trainer_class is None:
        raise SpecheadsError(f"train.stage {recipe.train.stage}: run it with `specheads train` (or "
                             f"specheads.train.opd.run_opd), not run_training")
    if target is None:  # offline features: embeddings, final norm and lm_head only (parts.training_target)
        target = training_target(recipe)
    if recipe.data.mode == "chat" and recipe.data.chat_template_kwargs and target.tokenizer is not None:
        import dataclasses  # the dev set's prompts render as the data did (data.chat_template_kwargs)

        target = dataclasses.replace(target, tokenizer=chat_tokenizer(target.tokenizer, None, target.name,
                                                                       recipe.data.chat_template_kwargs))
    train_ds, val_ds, collate_fn, layers, extract_fn = load_training_data(recipe, target)
    counts = None
    if recipe.head.draft_vocab_size and not recipe.train.init_head:  # chosen from the training split's assistant
        if isinstance(train_ds, FeatureDataset):  # tokens (held-out rows excluded)
            counts = masked_token_counts(train_ds, target.vocab_size)
        else:
            counts = assistant_token_counts(train_ds.ds, target.vocab_size)
    set_seed(recipe.seed)  # the same initial head on every process
    head = initial_head(recipe, target) if recipe.train.init_head else build_head(recipe.head, target,
                                                                                 token_counts=counts)
    trainer = (trainer_class or Trainer)(recipe, target, head, train_ds, val_ds, collate_fn=collate_fn,
                                         layers=layers, extract_fn=extract_fn)
    result = trainer.train(resume=resume)
    # DSpark: confidence temperatures on the held-out split
    calibrate_run(recipe, target, val_ds, collate_fn, layers, extract_fn)
    return result


def recalibrate_run(recipe, target=None) -> dict:
    """`specheads train --calibrate-only`: the confidence calibration of a trained DSpark run fitted again on its
    held-out split (best/ and final/ rewritten atomically, calibration.json); checkpoints and summary untouched."""
    if not has_confidence_head(recipe.head):
        raise SpecheadsError(f"--calibrate-only: the recipe's head has no confidence head (head.kind "
                             f"{' or '.join(kinds_where(confidence=True))} with head.<kind>.confidence_head true)")
    out = Path(recipe.output_dir)
    if not any((out / n / "model.safetensors").exists() for n in ("best", "final")):
        raise SpecheadsError(f"--calibrate-only: {out} has no trained head (best/ or final/); train it first")
    for n in ("best", "final"):
        cfg = out / n / "config.json"
        kind = read_json(cfg).get("kind") if cfg.exists() else None
        if kind is not None and kind != recipe.head.kind:
            raise SpecheadsError(f"--calibrate-only: {cfg} holds a {kind} head, not the recipe's "
                                 f"{recipe.head.kind} head; "
                                 f"give the recipe this run was trained with")
    if target is None:
        target = specheads.target.load_target(recipe.target.name, dtype=recipe.target.dtype,
                             trust_remote_code=recipe.target.trust_remote_code)
    _, val_ds, collate_fn, layers, extract_fn = load_training_data(recipe, target)
    report = calibrate_run(recipe, target, val_ds, collate_fn, layers, extract_fn)
    if report is None:
        raise SpecheadsError(f"--calibrate-only: {out}: no held-out samples (data.val_fraction) to calibrate on")
    return report
