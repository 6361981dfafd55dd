"""Medusa-2 (Cai et al. 2024, §2.2.2): LoRA adapters (peft) on the target trained jointly with the Medusa heads.

    loss = Σ_k 0.8^k CE_k(heads on the ADAPTED final state) + lm_weight · KL(p_base ‖ p_adapted)

The LM part keeps the adapted target's own next-token distribution close to the original one (so serving with the
adapted target stays close to the original model); the teacher is the same model under `disable_adapter()` and
`no_grad` (no second copy in memory; its logits equal a separate base copy exactly). A heads-only warm-up stage
(`train.lora.warmup_steps`: adapters at learning rate 0) comes first; heads train at `train.lr`, adapters at
`train.lr x train.lora.lr_ratio`.
Export: the head folder as usual plus the adapters (`<dir>/adapter`, peft safetensors) or, with
`train.lora.merge: true` at the end, the merged target (`<output_dir>/final/target`, HF folder) the head must be
served with.

Training is online only (the features depend on the adapters). Shapes: B batch, T sequence, K heads, V vocab.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specheads.utils import SpecheadsError, atomic_dir

log = logging.getLogger(__name__)


@dataclass
class LoraSettings:
    r: int = 32  # LoRA rank (Medusa-2 repo scripts: 32)
    alpha: int = 16  # LoRA scaling numerator (peft default style: alpha / r)
    dropout: float = 0.05  # LoRA dropout (peft's usual value)
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])  # module names


def add_adapters(target, s: LoraSettings):
    """Wrap target.model with peft LoRA in place (target.model becomes the PeftModel); base weights stay frozen."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=list(s.targets),
                     bias="none", task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(target.model, cfg)
    except ValueError as e:
        raise SpecheadsError(f"train.lora.targets: {e}") from None
    # LoRA weights in fp32 even on a bf16 target: they are master weights.
    for n, p in peft_model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return peft_model


class Medusa2Model(nn.Module):
    """The trainable unit: the adapted target (peft) and the Medusa head. forward -> (head logits [K,B,T,V'],
    adapted LM logits [B,T,V]); both carry gradients to the adapters."""

    def __init__(self, peft_model, head):
        super().__init__()
        self.peft = peft_model
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.peft(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        h_last = out.hidden_states[-1]  # [B,T,D] post-norm (the lm_head input)
        return self.head(h_last.float()), out.logits

    @torch.no_grad()
    def teacher_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The original target's logits [B,T,V]: the same model with its adapters disabled."""
        with self.peft.disable_adapter():
            return self.peft(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """KL(p_teacher ‖ p_student) averaged over rows predicting an assistant token. [B,T,V] x [B,T,V] x [B,T]."""
    m = torch.zeros_like(loss_mask, dtype=torch.bool)
    m[:, :-1] = loss_mask[:, 1:].bool()  # row t predicts token t+1
    if not m.any():
        return student_logits.sum() * 0.0
    s = torch.log_softmax(student_logits[m].float(), -1)
    t = torch.log_softmax(teacher_logits[m].float(), -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def param_groups(model: Medusa2Model, lr: float, lr_ratio: float) -> list[dict]:
    heads = [p for p in model.head.parameters() if p.requires_grad]
    adapters = [p for n, p in model.peft.named_parameters() if p.requires_grad and "lora_" in n]
    if not adapters:
        raise SpecheadsError("train.lora.enabled: no LoRA parameters were created (check train.lora.targets)")
    return [{"params": heads, "lr": lr, "name": "heads"},
            {"params": adapters, "lr": lr * lr_ratio, "name": "adapters"}]


def save_adapters(model: Medusa2Model, out_dir: Path) -> None:
    model.peft.save_pretrained(str(out_dir), safe_serialization=True)


def save_merged_target(model: Medusa2Model, out_dir: Path) -> None:
    """The target with adapters merged into a copy (training state untouched), as an HF folder."""
    import copy

    merged = copy.deepcopy(model.peft).merge_and_unload()
    with atomic_dir(out_dir) as tmp:
        merged.save_pretrained(str(tmp), safe_serialization=True)
