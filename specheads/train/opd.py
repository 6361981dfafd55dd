"""Draft-OPD: on-policy distillation of a trained head (`train.stage: opd`, settings `train.opd`), after
"Draft-OPD: On-Policy Distillation for Speculative Draft Models" (Lei et al., arXiv 2605.29343).

A head trained on fixed answers meets, when it serves, states its own drafts induce: the accepted prefix of each
step, then the root after the first rejection. OPD trains on those states. Per micro-batch, for train.batch_size
prompts of the training split (the tokens before the first assistant token):

1. Rollout (train/rollout.py): the head drafts with its serving drafter (its default tree, or train.opd.tree),
   the frozen target verifies in our engine (greedy, or sampled at train.opd.temperature: the continuation is the
   target's own answer either way, the target-assisted rollout). Recorded: the features the drafter was fed, and
   per step the visited states s (the root and accepted nodes that have draft children) with the target's verify
   logits there and whether the target took one of the drafts (a_s = 1) or none (a_s = 0).
2. Replay: the kind's teacher-forced forward on the rolled-out sequences gives the draft logits at those states
   with gradients (train/kinds: HeadKind.states). On the accepted path every earlier draft of a step is the
   sequence's own token, so the replay is the served draft distribution q_s (tests/test_opd.py checks it against
   the drafts the rollout made).
3. Loss, p_s the target's distribution at the draft vocabulary's V' columns (renormalised over them, as the
   ordinary losses read it), q_s = softmax of the head's logits:

       L = 1/S · Σ_s [ a_s · w_a · KL(p_s || q_s) + (1 - a_s) · w_r · KL(q_s || p_s) ]

   forward KL (mass-covering) where the draft was accepted: keep covering the target there; reverse KL
   (mode-seeking) where it was rejected: move the draft's mass off the tokens the target does not back.
   w_a, w_r = train.opd.accepted_weight / rejected_weight; S the states of the micro-batch.

Everything else is the ordinary trainer (train/trainer.py): accelerate, the optimizer and schedule, checkpoints
(the rollout RNG among the saved generators), resume, evaluation on the held-out split, best/ and final/. The
head starts from train.init_head (`specheads train --init-head DIR`); the target is frozen and never changes.
A kind whose forward cannot replay its served drafts (HeadKind.states None) is refused.
Shapes: B batch, T sequence, S states, V' draft vocab, F feature layers, D hidden.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from specheads.train.dataset import FeatureDataset
from specheads.train.kinds import head_kind
from specheads.train.kinds.base import unwrap
from specheads.train.losses import LossOutput
from specheads.train.parts import HeadOnly
from specheads.train.rollout import rollout, rollout_batch, rollout_drafter
from specheads.train.trainer import Trainer, run_training
from specheads.heads.kinds import kind_names, kind_spec, resolve
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

__all__ = ["opd_loss", "OpdTrainer", "run_opd", "opd_kinds"]


def opd_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, accepted: torch.Tensor,
             accepted_weight: float = 1.0, rejected_weight: float = 1.0) -> LossOutput:
    """The module docstring's L: draft_logits [S,V'] (with gradients), target_logits [S,V'] (the target's at the
    same V' columns), accepted [S] bool -> LossOutput (metrics: fkl over accepted states, rkl over rejected ones,
    their counts)."""
    lq = F.log_softmax(draft_logits.float(), dim=-1)
    lp = F.log_softmax(target_logits.float(), dim=-1)
    fkl = (lp.exp() * (lp - lq)).sum(-1)  # KL(p || q) per state
    rkl = (lq.exp() * (lq - lp)).sum(-1)  # KL(q || p) per state
    acc = accepted.bool()
    per = torch.where(acc, accepted_weight * fkl, rejected_weight * rkl)
    nacc, nrej = int(acc.sum()), int((~acc).sum())
    metrics = {"fkl": fkl[acc].mean().detach() if nacc else fkl.new_zeros(()),
               "rkl": rkl[~acc].mean().detach() if nrej else rkl.new_zeros(()),
               "states": torch.tensor(float(acc.numel())), "accepted": torch.tensor(float(nacc))}
    return LossOutput(per.mean(), metrics)


def opd_kinds() -> list[str]:
    """The registered kinds whose training step can replay their served drafts (HeadKind.states)."""
    return [k for k in kind_names() if resolve(kind_spec(k).train_step).states is not None]


def check_opd_kind(kind: str):
    """The kind's training step (kinds/), refused with one message when it has no on-policy replay."""
    step = head_kind(kind)
    if step.states is None:
        raise SpecheadsError(f"train.stage opd: {kind_spec(kind).label} cannot replay the drafts it serves from its "
                             f"training forward (its train step has no `states`: that forward does not unroll its "
                             f"own drafts), so it cannot be trained on-policy; kinds that can: "
                             f"{', '.join(opd_kinds())}")
    return step


# ------------------------------------------------------------------------------------------------ prompts

def prompt_of(ids: torch.Tensor, loss_mask: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """The tokens before a sample's first assistant token (its whole ids without one), the last `max_tokens`
    kept (the turn's end and the assistant header), at least 2 tokens (the first root needs a context row)."""
    first = loss_mask.nonzero()
    end = int(first[0]) if first.numel() else ids.numel()
    end = max(end, min(2, ids.numel()))
    return ids[max(0, end - max_tokens):end]


class PromptDataset(torch.utils.data.Dataset):
    """The training split's prompts: sample = {"prompt": [P] long}. Offline features are not read (ids only)."""

    def __init__(self, ds, max_tokens: int):
        self.ds, self.max_tokens = ds, max_tokens

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        if isinstance(self.ds, FeatureDataset):
            si, j, _ = self.ds.index[i]
            h = self.ds._handle(si)
            a, b = self.ds._offsets[si][j], self.ds._offsets[si][j + 1]
            ids, lm = h.get_slice("input_ids")[a:b].long(), h.get_slice("loss_mask")[a:b].long()
        else:
            s = self.ds[i]
            ids, lm = torch.as_tensor(s["input_ids"]).long(), torch.as_tensor(s["loss_mask"]).long()
        return {"prompt": prompt_of(ids, lm, self.max_tokens)}


def collate_prompts(samples: list[dict]) -> dict:
    """{"prompts": list of [P] long, "attention_mask": [B,P] (replaced by the rollouts' before the trainer counts
    the step's tokens)}."""
    prompts = [s["prompt"] for s in samples]
    mask = torch.zeros(len(prompts), max(p.numel() for p in prompts), dtype=torch.long)
    for b, p in enumerate(prompts):
        mask[b, :p.numel()] = 1
    return {"prompts": prompts, "attention_mask": mask}


# ------------------------------------------------------------------------------------------------ the stage

class OpdParts(HeadOnly):
    """The opd stage's loss: roll out, replay, L (module docstring). The rollouts' sampling seeds come from a
    generator of its own, saved in checkpoints."""

    def __init__(self, trainer, settings):
        super().__init__(trainer, settings)
        self.opd = trainer.cfg.opd
        self.step = check_opd_kind(trainer.kind)
        rollout_drafter(trainer.target, trainer.head, self.opd.tree)  # train.opd.tree checked before any step
        self.gen = torch.Generator().manual_seed(trainer.recipe.seed)

    def generators(self) -> dict[str, torch.Generator]:
        return {"opd": self.gen}

    def rollouts(self, head, prompts: list[torch.Tensor]) -> list:
        """One rollout per prompt with the head in eval mode (its mode restored after)."""
        was = head.training
        head.eval()
        try:
            out = []
            for p in prompts:
                seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=self.gen))
                out.append(rollout(self.t.target, head, p.tolist(), self.opd.tree, self.opd.max_new_tokens,
                                   self.opd.temperature, seed))
            return out
        finally:
            head.train(was)

    def loss(self, model, batch: dict) -> LossOutput:
        head = unwrap(model)
        rolls = self.rollouts(head, batch["prompts"])
        device = next(head.parameters()).device
        seqs, h_in, states, accepted, target_logits = rollout_batch(rolls, device)
        batch["attention_mask"] = seqs["attention_mask"]  # the trainer counts the rolled-out tokens
        metrics = rollout_metrics(rolls, states, accepted)
        if not len(states):  # every rollout ended before a draft: no state, a zero loss that still backpropagates
            zero = sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
            return LossOutput(zero, metrics)
        logits = self.step.states(model, seqs, h_in, states)  # [S,V'] with gradients
        out = opd_loss(logits, target_logits, accepted, self.opd.accepted_weight, self.opd.rejected_weight)
        return LossOutput(out.loss, {**out.metrics, **metrics})


def rollout_metrics(rolls: list, states, accepted: torch.Tensor) -> dict:
    """Rollout acceptance: tau (tokens per target forward), accept (accepted share of the visited states), accept_0
    (of the first drafts: the root's state of each step)."""
    forwards = sum(r.forwards for r in rolls)
    first = states.depth == 0
    return {"tau": torch.tensor(sum(r.new_tokens for r in rolls) / max(1, forwards)),
            "accept": accepted.float().mean() if accepted.numel() else torch.tensor(0.0),
            "accept_0": accepted[first].float().mean() if bool(first.any()) else torch.tensor(0.0)}


class OpdTrainer(Trainer):
    """The trainer with the opd stage's loss and prompt loader; evaluation, checkpoints and resume unchanged."""

    def _parts(self, settings):
        return OpdParts(self, settings)

    def _loaders(self):
        _, val_dl = super()._loaders()
        g = torch.Generator().manual_seed(self.recipe.seed)  # the prompt order's own stream (as the base loader's)
        train_dl = torch.utils.data.DataLoader(PromptDataset(self.train_ds, self.cfg.opd.max_prompt_tokens),
                                               batch_size=self.cfg.batch_size, shuffle=True,
                                               collate_fn=collate_prompts, num_workers=self.cfg.num_workers,
                                               generator=g)
        return train_dl, val_dl

    def _log_if_due(self, run, bar) -> None:
        """The trainer's log line, the rollout acceptance beside the loss on the bar and in the log."""
        super()._log_if_due(run, bar)
        step = run.state.step
        if not (step % self.cfg.log_every == 0 or step == run.total) or not run.acc.is_main_process:
            return
        m = {k: float(v) for k, v in run.metrics.items()}
        loss = run.state.last_loss
        bar.set_postfix(loss=f"{loss:.4f}", tau=f"{m.get('tau', 0):.2f}", accept=f"{m.get('accept', 0):.2f}")
        log.info("opd step %d/%d: loss %.4f (fkl %.4f, rkl %.4f); rollout tau %.2f, states accepted %.2f (first "
                 "drafts %.2f) of %d", step, run.total, loss, m.get("fkl", 0.0), m.get("rkl", 0.0), m.get("tau", 0.0),
                 m.get("accept", 0.0), m.get("accept_0", 0.0), int(m.get("states", 0)))


def run_opd(recipe, resume: bool = False, target=None):
    """`specheads train` with train.stage opd: trainer.run_training with the opd trainer, from train.init_head."""
    cfg = recipe.train
    if cfg.stage != "opd":
        raise SpecheadsError(f"run_opd: train.stage is {cfg.stage!r}; set train.stage=opd")
    if not cfg.init_head:
        raise SpecheadsError("train.stage opd: distils a trained head; give its folder as train.init_head (or "
                             "`specheads train --init-head DIR`)")
    check_opd_kind(recipe.head.kind)
    if cfg.grad_accum != 1:
        log.info("train.stage opd: each micro-batch rolls out with the weights of the last optimizer step")
    return run_training(recipe, resume=resume, target=target, trainer_class=OpdTrainer)
