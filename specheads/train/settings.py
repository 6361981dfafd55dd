"""The recipe's `train:` section (`TrainConfig`): optimizer, schedule and the shared loss settings at its top level,
one sub-section per head kind's own settings (`train.eagle`, `train.medusa`, `train.block`, `train.peagle`),
Medusa-2's LoRA (`train.lora`) and the on-policy distillation stage (`train.stage: opd`, `train.opd`; train/opd.py).
Old flat spellings (`train.block_gamma`) are still read (`TrainConfig.RENAMED_KEYS`, config.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from specheads.train.losses import BLOCK_W_CE, BLOCK_W_L1, BLOCK_WEIGHTINGS, DPACE_ALPHA, LOSS_SYNTAX, parse_loss
from specheads.utils import SpecheadsError, check_values


@dataclass
class EagleTrainConfig:
    """train.eagle: EAGLE-1's loss weights."""
    w_reg: float = 1.0  # EAGLE-1 SmoothL1 feature regression weight (paper)
    w_ce: float = 0.1  # EAGLE-1 soft CE weight (paper)

    def __post_init__(self) -> None:
        check_values("train.eagle", self, {"w_reg": ">=0", "w_ce": ">=0"})


@dataclass
class MedusaTrainConfig:
    """train.medusa: Medusa's labels."""
    soft_labels: bool = False  # Medusa: soft CE against the target distribution instead of the data's tokens


@dataclass
class BlockTrainConfig:
    """train.block: the block drafters' (DSpark / DFlash, head.kind dspark; Domino; DFlash2; P-EAGLE reads
    weighting and dpace_alpha) loss and sampling."""
    gamma: float = 4.0  # DSpark / DFlash: draft j weighted exp(-j / gamma) (DeepSpec loss_decay_gamma 4)
    w_ce: float = 0.1  # DSpark / DFlash: soft CE against the target (DeepSpec ce_loss_alpha 0.1)
    w_l1: float = 0.9  # DSpark / DFlash: ||q - p||_1 = 2 TV (DeepSpec l1_loss_alpha 0.9)
    confidence_alpha: float = 1.0  # DSpark: confidence BCE weight (DeepSpec / speculators confidence_head_alpha)
    max_anchors: int = 512  # DSpark / DFlash: blocks per sequence and step (DeepSpec num_anchors 512 at 4k tokens)
    full_vocab: bool = False  # DSpark / DFlash: target over the full vocab (exact acceptance; ~2x the step
    # without target sidecars, the V' columns' cost with them)
    weighting: str = "exp"  # position weights: exp = exp(-j / gamma) (DeepSpec; P-EAGLE: its pooled mean, no
    # decay); dpace = the drafter's own confidence (speculators' D-PACE, its DFlash default;
    # losses.dpace_position_weights; P-EAGLE: over each anchor's chain, kinds/peagle.chain_dpace_weights)
    dpace_alpha: float = DPACE_ALPHA  # D-PACE smoothing α in (0, 1] (speculators dpace_alpha 0.5)
    # Domino: loss = (1 - λ) final + λ base, λ = lambda_start (1 - step / (ratio x steps)), then 0 (SpecForge)
    domino_lambda_start: float = 1.0  # λ at step 0 (SpecForge lambda_base_start 1.0)
    domino_lambda_decay_ratio: float = 0.5  # fraction of the run over which λ reaches 0 (SpecForge 0.5)
    # DSpine (train/kinds/dspine.py; SpecForge DSpineConfig): alignment weight β ramped over the first steps, and
    # the shallow layers' predecessors replaced by the data's tokens for a share of blocks early in the run
    dspine_alignment_weight: float = 0.5  # β after the warm-up (SpecForge alignment_weight 0.5)
    dspine_alignment_warmup: int = 146  # optimizer steps of β's linear ramp (SpecForge alignment_warmup_steps)
    dspine_replace_layers: int = 3  # layers < this read the data's predecessor codes (SpecForge replacement_layers)
    dspine_replace_prob: float = 0.5  # share of blocks replaced at the start (SpecForge replacement_probability)
    dspine_replace_hold: float = 1 / 6  # run fraction kept at that share (SpecForge replacement_hold_ratio)
    dspine_replace_end: float = 1 / 3  # run fraction where it reaches 0 (SpecForge replacement_end_ratio)
    dspine_mass_threshold: float = 1e-4  # refinement L1 only where the target's candidate mass exceeds this
    # DFlash2: loss = unary block loss + selector_alpha · the selector's K-way CE (speculators selector_loss_alpha)
    selector_alpha: float = 1.0
    # LiLiCorr: loss = block loss + w_ce · lattice CE + w_margin · hinge(margin) + w_pen · distractor penalty
    # (ModelOpt dflash_lilicorr_w_ce / _w_margin / _w_pen / _margin; its "base" variant 0.25 / 0 / 0.25)
    lilicorr_w_ce: float = 0.25
    lilicorr_w_margin: float = 0.0
    lilicorr_w_pen: float = 0.25
    lilicorr_margin: float = 2.0
    # field -> its range (utils.check_values rules; tests/test_kind_limits.py tries a value outside each)
    LIMITS: ClassVar[dict[str, str]] = {
        "gamma": ">0", "w_ce": ">=0", "w_l1": ">=0", "confidence_alpha": ">=0", "max_anchors": ">=1",
        "dpace_alpha": "(0,1]", "domino_lambda_start": "[0,1]", "domino_lambda_decay_ratio": "(0,1]",
        "dspine_alignment_weight": ">=0", "dspine_alignment_warmup": ">=0", "dspine_replace_layers": ">=0",
        "dspine_replace_prob": "[0,1]", "dspine_replace_hold": "[0,1)", "dspine_replace_end": "(0,1]",
        "dspine_mass_threshold": "[0,1)", "selector_alpha": ">=0", "lilicorr_w_ce": ">=0",
        "lilicorr_w_margin": ">=0", "lilicorr_w_pen": ">=0", "lilicorr_margin": ">0"}

    def __post_init__(self) -> None:
        check_values("train.block", self, self.LIMITS)
        if self.dspine_replace_hold >= self.dspine_replace_end:
            raise SpecheadsError(f"train.block.dspine_replace_hold: {self.dspine_replace_hold} must be below "
                                 f"train.block.dspine_replace_end {self.dspine_replace_end}")
        if self.weighting not in BLOCK_WEIGHTINGS:
            raise SpecheadsError(f"train.block.weighting: must be one of {', '.join(BLOCK_WEIGHTINGS)}, "
                                 f"got {self.weighting!r}")


@dataclass
class PEagleTrainConfig:
    """train.peagle: P-EAGLE's COD sampling (train/kinds/peagle.py): depth d keeps about max(r^d, r_min) of the
    valid rows."""
    cod_ratio: float = 0.7  # r (speculators PEagleArgs down_sample_ratio 0.7)
    cod_ratio_min: float = 0.2  # r_min, the floor (speculators down_sample_ratio_min 0.2)
    LIMITS: ClassVar[dict[str, str]] = {"cod_ratio": "(0,1]", "cod_ratio_min": "[0,1)"}

    def __post_init__(self) -> None:
        check_values("train.peagle", self, self.LIMITS)
        if self.cod_ratio_min > self.cod_ratio:
            raise SpecheadsError(f"train.peagle.cod_ratio_min: {self.cod_ratio_min} is above train.peagle.cod_ratio "
                                 f"{self.cod_ratio} (the floor of r^d must not exceed r)")


@dataclass
class LoraTrainConfig:
    """train.lora: Medusa-2 (head.kind medusa, features.mode online): LoRA on the target trained jointly with the
    heads."""
    enabled: bool = False  # off = Medusa-1 (frozen target)
    r: int = 32  # LoRA rank (Medusa-2 repo scripts)
    alpha: int = 16  # LoRA scale numerator
    dropout: float = 0.05  # LoRA dropout
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])  # attention
    lr_ratio: float = 0.25  # adapters' lr = lr x this (Medusa-2: heads at a higher lr than the backbone)
    warmup_steps: int = 0  # heads-only first stage: adapters at lr 0 for this many steps
    lm_loss_weight: float = 1.0  # weight of KL(original target || adapted target) on assistant tokens
    merge: bool = False  # at the end also write the merged target to <output_dir>/merged-target

    def __post_init__(self) -> None:
        check_values("train.lora", self, {"r": ">=1", "alpha": ">0", "dropout": "[0,1)", "lr_ratio": ">=0",
                                          "warmup_steps": ">=0", "lm_loss_weight": ">=0"})
        if not self.targets:
            raise SpecheadsError("train.lora.targets: needs at least one module name")


STAGES = ("train", "opd")  # train.stage: ordinary training | on-policy distillation of a trained head (train/opd.py)


@dataclass
class OpdTrainConfig:
    """train.opd: Draft-OPD rollouts (train.stage opd, train/opd.py). Each micro-batch takes train.batch_size
    prompts of the training split; the head being trained drafts, the frozen target verifies (our engine), and the
    loss supervises the draft states the rollout visited."""
    max_new_tokens: int = 128  # tokens each rollout generates (the target's own answer, drafted by the head)
    max_prompt_tokens: int = 384  # longer prompts keep their last tokens (the turn's end and the assistant header)
    temperature: float = 0.0  # 0: greedy rollouts (exact target answers); > 0: sampled, lossless verification
    tree: str | None = None  # the drafter's --tree during rollouts; None = the kind's default, a block head's
    # `auto` read as its whole block (chain:K): a scheduled tree would time this machine, which no run should read
    accepted_weight: float = 1.0  # forward KL(p || q) on states whose draft the target accepted
    rejected_weight: float = 1.0  # reverse KL(q || p) on states whose drafts it rejected

    def __post_init__(self) -> None:
        check_values("train.opd", self, {"max_new_tokens": ">=1", "max_prompt_tokens": ">=2", "temperature": ">=0",
                                         "accepted_weight": ">=0", "rejected_weight": ">=0"})
        if self.accepted_weight + self.rejected_weight <= 0:
            raise SpecheadsError("train.opd: accepted_weight and rejected_weight are both 0 (nothing to learn)")


@dataclass
class TrainConfig:
    # old flat key -> its key now (relative to train:); config.load_config reads the old ones with a warning and
    # checkpoint.check_resume_settings maps a run's saved train_config.yaml through it
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "eagle_w_reg": "eagle.w_reg", "eagle_w_ce": "eagle.w_ce", "soft_labels": "medusa.soft_labels",
        "block_gamma": "block.gamma", "block_w_ce": "block.w_ce", "block_w_l1": "block.w_l1",
        "confidence_alpha": "block.confidence_alpha", "max_anchors": "block.max_anchors",
        "block_full_vocab": "block.full_vocab", "lora": "lora.enabled", "lora_r": "lora.r",
        "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "lora_targets": "lora.targets",
        "lora_lr_ratio": "lora.lr_ratio", "lora_warmup_steps": "lora.warmup_steps",
        "lm_loss_weight": "lora.lm_loss_weight", "lora_merge": "lora.merge"}

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
    loss_decay: float = 0.8  # weight 0.8^k per Medusa head / EAGLE-3 TTT step (papers)
    # EAGLE(-3): width w of the uniform noise U(-w/2, w/2) on input features. The EAGLE repo scales its 0.2 by
    # 512 / sequence length (AddUniformNoise); a fixed width here, equal to the repo's at 512 tokens.
    noise: float = 0.2
    # The distillation objective (losses.py, docs/training.md "The loss family"): NAME or NAME:WEIGHT,... over
    # soft_ce | kl | tv | l1 | lk_alpha | lk_lambda, e.g. "tv" or "soft_ce:0.1,tv:0.9". None = the kind's own
    # (its KindSpec.default_loss: soft CE; DSpark / DFlash block.w_ce x CE + block.w_l1 x L1)
    loss: str | None = None
    lk_eta: float = 3.0  # LK^λ: λ = exp(-lk_eta x mean acceptance) (arXiv 2602.23881's best; SpecForge --kl-decay)
    num_workers: int = 0  # DataLoader workers (0: features are already tensors; workers cost RAM per process)
    stage: str = "train"  # train | opd (on-policy distillation of init_head: train/opd.py, train.opd)
    init_head: str | None = None  # a head folder to start from (its weights and draft vocabulary; head.kind must
    # be its kind); the opd stage needs one. `specheads train --init-head DIR` sets it
    # each head kind's own settings (sections validated on their own; train.loss is checked against block below)
    eagle: EagleTrainConfig = field(default_factory=EagleTrainConfig)
    medusa: MedusaTrainConfig = field(default_factory=MedusaTrainConfig)
    block: BlockTrainConfig = field(default_factory=BlockTrainConfig)
    peagle: PEagleTrainConfig = field(default_factory=PEagleTrainConfig)
    lora: LoraTrainConfig = field(default_factory=LoraTrainConfig)
    opd: OpdTrainConfig = field(default_factory=OpdTrainConfig)

    def __post_init__(self) -> None:
        check_values("train", self, {
            "batch_size": ">=1", "grad_accum": ">=1", "epochs": ">=1", "warmup_steps": ">=0", "save_every": ">=0",
            "keep_last": ">=1", "log_every": ">=1", "lr": ">0", "max_steps": ">=1|None", "weight_decay": ">=0",
            "max_grad_norm": ">=0", "loss_decay": ">0", "noise": ">=0", "num_workers": ">=0", "lk_eta": ">=0"})
        self._check_loss()
        if self.stage not in STAGES:
            raise SpecheadsError(f"train.stage: {self.stage!r} is not one of {list(STAGES)}")
        if self.stage == "opd" and self.lora.enabled:
            raise SpecheadsError("train.stage opd: trains a head on a frozen target; set train.lora.enabled=false")
        if self.mixed_precision not in ("no", "bf16"):
            raise SpecheadsError(f"train.mixed_precision: {self.mixed_precision!r} is not one of ['no', 'bf16']")
        if self.tracker not in ("wandb", "tensorboard", "none"):
            raise SpecheadsError(f"train.tracker: {self.tracker!r} is not one of ['wandb', 'tensorboard', 'none']")
        if len(self.betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in self.betas):
            raise SpecheadsError(f"train.betas: expected two numbers in [0, 1), got {self.betas!r}")

    def _check_loss(self) -> None:
        """train.loss parses, and does not meet DSpark's own CE / L1 weights (train.block) changed beside it."""
        if self.loss is None:
            return
        try:
            parse_loss(self.loss)
        except ValueError as e:
            raise SpecheadsError(f"train.loss: {self.loss!r}: {e}; write {LOSS_SYNTAX}") from None
        w_ce, w_l1 = self.block.w_ce, self.block.w_l1
        if (w_ce, w_l1) != (BLOCK_W_CE, BLOCK_W_L1):
            raise SpecheadsError(f"train.loss: replaces DSpark's CE / L1 weights, and train.block.w_ce / "
                                 f"train.block.w_l1 are {w_ce} / {w_l1} beside it; set them back to "
                                 f"{BLOCK_W_CE} / {BLOCK_W_L1} or write the mixture into train.loss "
                                 f"(e.g. soft_ce:{w_ce},l1:{w_l1})")
