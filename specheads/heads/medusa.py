"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
arXiv:2401.10774).

Head k reads the target's final (post-norm) hidden state h_t and predicts the token k+1 steps after the target's own
next token (paper eq. 1):

    p_t^(k) = softmax( W_2^(k) · ( SiLU(W_1^(k) · h_t + b_1^(k)) + h_t ) ),   W_1^(k) initialised to 0,

generalised to `num_layers` residual blocks x <- x + SiLU(W x + b) per head. Each block is its own module: the Medusa
repo's `nn.Sequential(*([ResBlock(D)] * n))` repeats ONE block n times (tied weights); we do not.
W_2^(k) is the shared frozen target lm_head (default, "shared") or a per-head copy initialised from it ("per_head",
Medusa-1 repo). With a reduced draft vocab the projection keeps only the rows `d2t` (logits over V').

Indexing: head k (0-based) at row t predicts token t+k+2 (the target's lm_head at row t predicts t+1).
Parameter names follow vLLM's Medusa (`blocks.{h}.layers.{l}.weight/bias`, `lm_heads.{h}.weight`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from specheads.heads.base import DraftHead, HeadConfig, final_layer
from specheads.heads.kinds import KindSpec, register_kind


@dataclass
class MedusaOptions:
    """head.medusa: Medusa's own settings (its residual blocks per head are head.num_layers)."""

    FLAT_KEYS: ClassVar[dict[str, str]] = {"medusa_lm_head": "lm_head"}  # old flat head: key -> field
    LIMITS: ClassVar[dict[str, str]] = {"num_heads": ">=1"}  # checked by headspec.check_options
    num_heads: int = 4  # K heads (Medusa paper default 4 in the repo's training script)
    lm_head: Literal["shared", "per_head"] = "shared"  # shared frozen target lm_head, or per head (Medusa-1 repo)


class ResidualStack(nn.Module):
    """num_layers distinct residual blocks x <- x + SiLU(W x + b), W zero-initialised (identity at start)."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        self.act = nn.SiLU()
        for layer in self.layers:
            # W = 0 (paper §2.1.1) and b = 0 too, so the block is exactly the identity at start (SiLU(0) = 0);
            # the Medusa repo leaves b at torch's default init, an offset of SiLU(b) per block.
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHead(DraftHead):
    kind = "medusa"

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        D, K = config.hidden_size, self.spec.options.num_heads
        self.num_heads = K
        self.blocks = nn.ModuleList(ResidualStack(D, self.spec.num_layers, self.spec.resolved_bias()) for _ in range(K))
        if self.spec.options.lm_head == "per_head":
            self.lm_heads = nn.ModuleList(nn.Linear(D, config.out_vocab, bias=False) for _ in range(K))
        else:
            self.lm_heads = None

    def init_from_target(self) -> None:
        """Per-head projections start as copies of the target lm_head rows of the draft vocab (Medusa-1 repo)."""
        if self.lm_heads is None:
            return
        w = self._get_frozen("lm_head").weight
        if self.d2t is not None:
            w = w[self.d2t]
        with torch.no_grad():
            for lm in self.lm_heads:
                lm.weight.copy_(w.to(lm.weight.dtype))

    def hidden_per_head(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """hidden [B,T,D] -> [K,B,T,D] (the states the vocab projections read); only the first `heads` if given."""
        hidden = hidden.to(self.head_dtype)
        return torch.stack([blk(hidden) for blk in self.blocks[:heads]], dim=0)

    def forward(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """hidden [B,T,D] (target's final post-norm state) -> logits [K,B,T,V'] (V' = V without a draft vocab).
        `heads`: run only heads 0..heads-1 (a tree `heads` deep needs no more; each head costs a V' projection)."""
        hs = self.hidden_per_head(hidden, heads)  # [K,B,T,D]
        if self.lm_heads is None:
            return self.target_lm_logits(hs)  # [K,B,T,V']
        return torch.stack([lm(h) for lm, h in zip(self.lm_heads, hs)], dim=0)


def _needs_target(fmt: str, cfg: HeadConfig) -> bool:
    """vLLM's Medusa wants one projection per head: a shared lm_head is written as copies of the target's rows."""
    return fmt == "medusa-vllm" and cfg.head_spec.options.lm_head == "shared"


KIND = register_kind(KindSpec(
    name="medusa", head=MedusaHead, family="tree", label="a Medusa head", feature_layers=final_layer,
    final_state_only=True, lora=True, train_step="specheads.train.kinds.medusa:KIND",
    drafter="specheads.infer.drafters.medusa:KIND", formats=("medusa-vllm",), needs_target=_needs_target,
    options=MedusaOptions, example={"medusa": {"num_heads": 3}}))
