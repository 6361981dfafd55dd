"""Domino head (arXiv:2605.29707; training code sgl-project/SpecForge `specforge/modeling/draft/domino.py`
DominoDraftModel and `specforge/algorithms/common/dflash_family_model.py` OnlineDominoModel; speculators PR 773
`projector_type: domino`): the DFlash block backbone of heads/dspark.py (subclassed, not copied) plus a small GRU
over the block's previous tokens whose state adds a logit correction to the parallel base logits.

With the backbone's final-normed slot states h_j and base logits U_j = W_lm h_j of draft j (heads/dspark.py, draft j
predicts x_{p+1+j}, its previous token x_{p+j}: the anchor for j = 0), SpecForge's `apply_logits_head` with
`shift_label: true` (its shipped configs/qwen3-8b-domino.json):

    g_j = GRU(E(x_p), E(x_{p+1}), ..., E(x_{p+j}))     one layer, no bias, state size G (`prefix_gru`)
    Δ_j = W_2 · SiLU(W_1 · [h_j ; g_j])                W_1: D+G -> E', W_2: E' -> V', no bias (`embed_proj`)
    logits_j = U_j              for j < P              P = pure_draft_prefix_len (the first drafts: base only)
    logits_j = U_j + Δ_j        for j >= P

E is the frozen target embedding (SpecForge: the target's embed_tokens). In training x_{p+j} are the data's tokens
(teacher forcing, SpecForge `_build_domino_head_inputs`); at inference the GRU reads the anchor and then each
drafted token (argmax, or the token drawn by `pick` when sampling), one GRU step per draft inside the block pass
(SpecForge `_sample_draft_tokens`).

Choices where the sources leave room: (1) only `shift_label: true` is built, which is our `sample_from_anchor: true`
alignment (slot j predicts x_{p+1+j}); SpecForge's `shift_label: false` feeds the labels themselves as GRU inputs,
another alignment, and is refused in HeadSpec. (2) SpecForge's W_2 spans the full vocabulary (its drafts have none
other); with head.draft_vocab_size W_2 spans V' like the base logits. (3) The DSpark Markov head is refused
(markov_rank must be 0: the GRU is Domino's sequential stage); the confidence head may stay (reading h_j), trained
against the acceptance of the corrected logits. (4) W_1, W_2 initialised normal(0, initializer_range) like the
backbone's Linear layers; the GRU keeps torch's default uniform init (SpecForge builds nn.GRU with its defaults).
Sizes: domino_gru_hidden G, domino_emb_dim E', domino_prefix_len P (HeadSpec; SpecForge 1024, 256, 1).
Tensor names follow SpecForge's (`prefix_gru.weight_ih_l0`, `prefix_gru.weight_hh_l0`, `embed_proj.0`,
`embed_proj.2`). Shapes: B batch, A anchors (blocks), K slots, K' drafts, D hidden, V' draft vocab, G GRU state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from specheads.heads.base import HeadConfig
from specheads.heads.dspark import BLOCK_KIND, OwnStageOptions, DSparkHead, check_block
from specheads.heads.kinds import KindSpec, register_kind
from specheads.utils import SpecheadsError


class DominoHead(DSparkHead):
    kind = "domino"

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        s, D = self.spec, config.hidden_size
        G, Ep = int(s.options.gru_hidden), int(s.options.emb_dim)
        self.prefix_len = int(s.options.prefix_len)
        self.prefix_gru = nn.GRU(input_size=D, hidden_size=G, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(nn.Linear(D + G, Ep, bias=False), nn.SiLU(),
                                        nn.Linear(Ep, config.out_vocab, bias=False))
        for m in self.embed_proj:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.layer_config.initializer_range)

    def _correction(self, hd: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Δ = W_2 SiLU(W_1 [h ; g]): hd [..., D], g [..., G] -> [..., V']."""
        return self.embed_proj(torch.cat([hd, g.to(hd.dtype)], -1))

    def _gru(self, e: torch.Tensor, state: torch.Tensor | None):
        """e [B,A,N,D] embeddings -> (states g [B,A,N,G], last state [1,B*A,G]); state [1,B*A,G] or None."""
        B, A, N, D = e.shape
        out, last = self.prefix_gru(e.reshape(B * A, N, D).to(self.prefix_gru.weight_ih_l0.dtype), state)
        return out.view(B, A, N, -1), last

    def base_and_final(self, h: torch.Tensor, prev: torch.Tensor):
        """Teacher-forced: h [B,A,K,D], prev [B,A,K'] target ids (draft j's previous token) -> (base logits,
        corrected logits [B,A,K',V'], confidence logits [B,A,K'] or None)."""
        hd = h[:, :, self.slot0:]
        base = self._base_logits(hd)
        g, _ = self._gru(self.embed(prev), None)
        P = self.prefix_len
        final = torch.cat([base[:, :, :P], base[:, :, P:] + self._correction(hd[:, :, P:], g[:, :, P:])
                           .to(base.dtype)], 2)
        return base, final, self._confidence(hd, None)

    def heads(self, h: torch.Tensor, prev: torch.Tensor, greedy: bool = False, pick=None):
        """DSparkHead.heads with Domino's correction in place of the Markov bias: teacher-forced (prev [B,A,K'])
        or, with greedy, prev [B,A] the anchors and each later draft reading the argmax (or pick's token) of the
        one before, one GRU step per draft."""
        if not greedy:
            _, final, conf = self.base_and_final(h, prev)
            return final, conf
        hd = h[:, :, self.slot0:]
        base = self._base_logits(hd)
        p, state, logits = prev, None, []
        for j in range(self.num_drafts):
            g, state = self._gru(self.embed(p).unsqueeze(2), state)  # g_j: the state after x_{p+j}
            lj = base[:, :, j] if j < self.prefix_len else \
                base[:, :, j] + self._correction(hd[:, :, j], g[:, :, 0]).to(base.dtype)
            logits.append(lj)
            if pick is not None:
                p = self.to_target_ids(pick(j, lj))
            elif j + 1 < self.num_drafts:
                p = self.to_target_ids(lj.argmax(-1))
        return torch.stack(logits, 2), self._confidence(hd, None)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                attention_mask: torch.Tensor | None = None):
        """DSparkHead.forward's teacher-forced blocks -> (base logits [B,A,K',V'], corrected logits [B,A,K',V'],
        confidence logits [B,A,K'] or None): the loss blends the two (train/kinds/domino.py)."""
        return self.base_and_final(*self.block_states(features, input_ids, anchors, attention_mask))


@dataclass
class DominoOptions(OwnStageOptions):
    """head.domino: the DFlash block's settings (BlockOptions) and the GRU correction's sizes (SpecForge
    configs/qwen3-8b-domino.json)."""

    FLAT_KEYS: ClassVar[dict[str, str]] = {"domino_gru_hidden": "gru_hidden", "domino_emb_dim": "emb_dim",
                                           "domino_prefix_len": "prefix_len"}
    LIMITS: ClassVar[dict[str, str]] = {"gru_hidden": ">=1", "emb_dim": ">=1", "prefix_len": ">=0"}  # prefix_len
    # <= the drafts: check_domino
    gru_hidden: int = 1024  # G, the GRU state (SpecForge gru_hidden_dim 1024)
    emb_dim: int = 256  # E', the correction MLP's bottleneck (SpecForge emb_dim 256)
    prefix_len: int = 1  # P, the first drafts left uncorrected (SpecForge pure_draft_prefix_len 1)


def check_domino(spec) -> None:
    """The head: section of a Domino head: a DFlash block (check_block) whose GRU is the sequential stage."""
    check_block(spec)
    o = spec.options
    if not 0 <= o.prefix_len <= spec.num_drafts:
        raise SpecheadsError(f"{spec.key('prefix_len')}: must be in 0..{spec.num_drafts} (the drafts), got "
                             f"{o.prefix_len}")
    if o.markov_rank != 0:
        raise SpecheadsError(f"{spec.key('markov_rank')}: Domino's GRU is its sequential stage; set it 0 "
                             f"(got {o.markov_rank})")
    if not o.sample_from_anchor:
        raise SpecheadsError(f"{spec.key('sample_from_anchor')}: Domino is built for SpecForge's shift_label true "
                             "(slot j predicts x_{p+1+j}): set it true")
    if o.anchor_features:
        raise SpecheadsError(f"{spec.key('anchor_features')}: not built for Domino")


KIND = register_kind(KindSpec(
    name="domino", head=DominoHead, label="a Domino head", train_step="specheads.train.kinds.domino:KIND",
    drafter="specheads.infer.drafters.domino:KIND", options=DominoOptions, check=check_domino, formats=("specforge",),
    refused={"speculators": "speculators 0.9.0 has no Domino model (its DFlash reads no prefix_gru / embed_proj); "
                            "export specforge or native"},
    example={"mask_token_id": 5, "domino": {"block_size": 4, "markov_rank": 0, "confidence_head": False,
                                            "gru_hidden": 16, "emb_dim": 8}},
    example_train={"block.domino_lambda_start": 0.5},
    not_drafted="the pinned llama.cpp (0c1e570) has no Domino reader: its converter and dflash architecture know "
                "DFlash, DFlash2 and DSpark only, none with Domino's prefix_gru / embed_proj",
    **{**BLOCK_KIND, "exporter": "specheads.heads.export.domino:export_domino"}))
