"""What differs between head-only training and Medusa-2, chosen once per run: the trainable module, its parameter
groups, the schedule, the loss, the evaluated head and the export (`HeadOnly` or `Medusa2`; the opd stage's
`OpdParts` in train/opd.py); and the head a run starts from (`initial_head`, train.init_head)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import get_cosine_schedule_with_warmup

from specheads.heads.base import load_head
from specheads.heads.kinds import kind_spec, kinds_where
from specheads.heads.locate import head_folder
from specheads.train import steps
from specheads.train.lora import (LoraSettings, Medusa2Model, add_adapters, kl_to_teacher, param_groups,
                                  save_adapters, save_merged_target)
from specheads.train.losses import LossOutput, medusa_loss
from specheads.utils import SpecheadsError, read_json


class HeadOnly:
    """Head-only training (Medusa-1, EAGLE-1/2, EAGLE-3): the frozen target supplies the features, the head is the
    trainable module and is exported with its own save_pretrained. `trainer`: the trainer.Trainer served."""

    def __init__(self, trainer, settings):
        self.t = trainer
        self.settings = settings

    def module(self) -> torch.nn.Module:
        return self.t.head

    def param_groups(self, module, lr: float) -> list[dict]:
        return [{"params": [p for p in module.parameters() if p.requires_grad], "lr": lr}]

    def schedule(self, opt, warmup: int, total: int):
        return get_cosine_schedule_with_warmup(opt, warmup, total)

    def loss(self, model, batch: dict):
        t = self.t
        return steps.train_loss(t.kind, model, t._with_hidden(batch), t.target, t.layers, t.head_layers, self.settings)

    def eval_head(self, acc, model):
        return model

    def generators(self) -> dict[str, torch.Generator]:
        """The loss's own random streams beyond the trainer's (saved in checkpoints, restored on resume)."""
        return {}

    def export(self, model, path: Path) -> None:
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(path)

    def finish(self, acc, model, out: Path) -> None:
        """After the final export (main process only)."""


class Medusa2(HeadOnly):
    """Medusa-2 (train.lora.enabled): LoRA adapters on the target trained with the Medusa heads; online features
    only."""

    def __init__(self, trainer, settings):
        super().__init__(trainer, settings)
        t = trainer
        if not kind_spec(t.kind).lora:
            raise SpecheadsError(f"train.lora.enabled: Medusa-2 adapters need head.kind "
                                 f"{' or '.join(kinds_where(lora=True))}, not {t.kind!r}")
        if t.recipe.features.mode != "online" or "hidden" in t.collate_fn([t.train_ds[0]]):
            raise SpecheadsError("train.lora.enabled: the features depend on the adapters; set features.mode=online")

    def module(self) -> torch.nn.Module:
        lora = self.t.cfg.lora
        peft_model = add_adapters(self.t.target, LoraSettings(lora.r, lora.alpha, lora.dropout, list(lora.targets)))
        return Medusa2Model(peft_model, self.t.head)

    def param_groups(self, module, lr: float) -> list[dict]:
        return param_groups(module, lr, self.t.cfg.lora.lr_ratio)

    def schedule(self, opt, warmup: int, total: int):
        sched = super().schedule(opt, warmup, total)
        hold = self.t.cfg.lora.warmup_steps
        if not hold:
            return sched
        # heads-only warm-up: the adapters' group stays at lr 0, then follows the same schedule
        cos = sched.lr_lambdas[0]
        return torch.optim.lr_scheduler.LambdaLR(opt, [cos, lambda s: 0.0 if s < hold else cos(s)])

    def loss(self, model, batch: dict):
        """The heads' loss on the adapted final state + train.lora.lm_loss_weight x KL(original || adapted)."""
        acc = self.t.accelerator
        ids, amask, lmask = (batch[k].to(acc.device) for k in ("input_ids", "attention_mask", "loss_mask"))
        teacher = acc.unwrap_model(model).teacher_logits(ids, amask)  # [B,T,V], no grad
        head_logits, lm_logits = model(ids, amask)  # through the DDP wrapper: gradients sync
        out = medusa_loss(head_logits, ids, lmask, decay=self.settings.decay)
        kl = kl_to_teacher(lm_logits, teacher, lmask)
        return LossOutput(out.loss + self.t.cfg.lora.lm_loss_weight * kl, {**out.metrics, "kl": kl.detach()})

    def eval_head(self, acc, model):
        return acc.unwrap_model(model).head  # the adapted features (get_hidden), the same head

    def export(self, model, path: Path) -> None:
        model.head.save_pretrained(path)
        save_adapters(model, path / "adapter")  # serve the head with the target + these adapters (or merged)

    def finish(self, acc, model, out: Path) -> None:
        if self.t.cfg.lora.merge:
            save_merged_target(model, out / "merged-target")


def initial_head(recipe, target):
    """train.init_head: a trained head folder to start from, in fp32 (master weights), of the recipe's head.kind
    (its own config, weights and draft vocabulary; a resumed run then restores its checkpoint over them)."""
    folder = head_folder(recipe.train.init_head, "train.init_head folder")  # a folder or a hub id (heads/locate.py)
    if not (folder / "config.json").is_file():
        raise SpecheadsError(f"train.init_head {folder}: not a head folder (no config.json); give a trained head's "
                             f"folder, e.g. <run>/best")
    kind = read_json(folder / "config.json").get("kind")
    if kind != recipe.head.kind:
        raise SpecheadsError(f"train.init_head {folder}: holds a {kind} head, the recipe's head.kind is "
                             f"{recipe.head.kind}; set head.kind={kind}")
    return load_head(folder, target, dtype=torch.float32)


def training_target(recipe):
    """The target `specheads train` loads. Offline features of a head-only run: its embeddings, final norm and
    lm_head alone (target_parts.load_target_parts: the decoder layers are never read), recording the full target
    prepare wrote into the features folder (target.json). The whole target otherwise: online features, Medusa-2,
    another stage, a hub id not on disk, or eval.dev_prompts (the dev set's answers need the decoder; a folder
    without its decoder layers is then refused in one line)."""
    import logging

    from specheads.target import load_target, resolve_target_path
    from specheads.target_parts import load_target_parts, read_features_record
    from specheads.train.layout import features_dir

    rt = recipe.target
    full = lambda: load_target(rt.name, dtype=rt.dtype, trust_remote_code=rt.trust_remote_code)  # noqa: E731
    if recipe.features.mode != "offline" or recipe.train.stage != "train" or recipe.train.lora.enabled:
        return full()
    folder = Path(resolve_target_path(rt.name))
    if not folder.is_dir():
        return full()
    if recipe.eval.dev_prompts:
        if not _has_decoder(folder):
            raise SpecheadsError(f"eval.dev_prompts: the dev set's answers need the target's decoder layers, which "
                                 f"{folder} lacks; set eval.dev_prompts=0 or give the full target folder")
        logging.getLogger(__name__).info("eval.dev_prompts: the dev set is answered by the target: loading all of it")
        return full()
    target = load_target_parts(rt.name, dtype=rt.dtype, trust_remote_code=rt.trust_remote_code)
    feat = features_dir(recipe)
    record = read_features_record(feat)
    if record is not None:
        target.bind_record(record, str(feat / "target.json"))
    return target


def _has_decoder(folder: Path) -> bool:
    """True when the folder's safetensors hold decoder-layer tensors (names with `.layers.`)."""
    from specheads.target_parts import SafetensorsIndex

    return any(".layers." in n or n.startswith("layers.") for n in SafetensorsIndex(folder).where)
