"""DFlash2 head (z-lab, "DFlash2", https://github.com/z-lab/dflash model.py; speculators 0.9
`speculators/models/dflash2`, docs/user_guide/algorithms/dflash2.md): the DFlash block drafter of heads/dspark.py
(subclassed: its context, attention, slots and alignment unchanged) plus a local dynamic convolution around each
layer's attention and MLP, and a top-k candidate selector on the block's output.

Backbone. With c_t the fused target rows and z^0 = E([x_p, m, ..., m]) as in heads/dspark.py, each layer i runs

    u      = RMSNorm_in(z)                                         [K, D]
    κ      = W_κ u                                                 [K, 2, k, G]   (one projection, both sides)
    a      = Attn( Conv(u; κ[:, 0], b_0) ; context c )             queries, keys and values of the block read
    z      = z + Conv(a; κ[:, 1], b_1)                             the convolved input; context keys are unchanged
    u'     = RMSNorm_post(z),   κ' = W_κ' u'
    z      = z + Conv(MLP(Conv(u'; κ'[:, 0], b'_0)); κ'[:, 1], b'_1)

with the grouped causal convolution over the block's slots (never across blocks; slot 0 reads zero padding):

    Conv(x; δ, b)_i = Σ_{t=0}^{min(k-1, i)} x_{i-t} ⊙ ( b_t + δ_{i,t}[g(c)] )      channel c in group g(c) = c // S

b: [2, k, D] base kernels (`base_kernel`, both sides), δ_{i,t} the dynamic part predicted from slot i's own normed
input (`kernel_projection`, D -> 2·k·G, G = D / S groups of S = conv_group_size channels). At initialisation b_0 = 1,
b_{t>0} = 0 and W_κ = 0: every Conv is the identity and the head is DFlash (speculators `reset_parameters`).

Selector. h_j the final-normed state of draft j, U_j = W_lm h_j its unary logits over the full vocabulary (the
frozen target lm_head; DFlash2 has no draft vocabulary), x_{j-1} its predecessor (the anchor for draft 0):

    C_j     = top-k_v U_j(v)                                                     k = selector_top_k candidates
    S_j(v)  = U_j(v) + < P[x_{j-1}] ⊙ (W_h h_j) , Q[v] >        v ∈ C_j          P, Q: [V, r] codebooks, W_h: D -> r
    x_j     = argmax_{v ∈ C_j} S_j(v)                                            the greedy walk along the block

Serving walks the block once the one parallel pass is done: draft j's predecessor is the token chosen for draft j-1
(its argmax, or when sampling the token drawn from softmax(S_j) over C_j). The draft logits this head returns are
S_j on C_j and -inf elsewhere, so that their argmax is the walk's token and, when sampling, the distribution a draft
was drawn from is exactly the q the verifier reads (lossless). In training the predecessors are the data's tokens
(teacher forcing, speculators `_predecessor_ids`) and the loss (train/kinds/dflash2.py) adds a K-way CE over the
candidates, the target's greedy token injected at rank k when the unary top-k misses it (speculators
`selector_training_candidates`).

Alignment, context and slots are heads/dspark.py's (`sample_from_anchor` false is DFlash2's default and the one
llama.cpp runs). Not built for DFlash2 (refused by `check_dflash2`): a draft vocabulary (speculators requires the full
verifier vocabulary), the DSpark Markov and confidence heads, the anchor-features variant.
Tensor names follow speculators' DFlash2DraftModel (`layers.{i}.attention_conv.base_kernel`,
`layers.{i}.attention_conv.kernel_projection.weight`, `layers.{i}.mlp_conv.*`,
`candidate_selector.predecessor_codebook`, `candidate_selector.successor_codebook`,
`candidate_selector.hidden_projection.weight`); llama.cpp runs it as written from them (heads/dflash2_gguf.py).
Shapes: B batch, A anchors (blocks), K slots, K' drafts, D hidden, V vocab, G groups, k taps / candidates (said
where), r selector rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from specheads.heads.base import HeadConfig
from specheads.heads.dspark import (BLOCK_KIND, BlockLayer, OwnStageOptions, DSparkHead, check_block,
                                    refuse_block_extras)
from specheads.heads.kinds import KindSpec, register_kind
from specheads.utils import SpecheadsError


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """Conv(x; δ, b) of the module docstring: x [..., K, D] (the block's slots on dim -2), δ [..., K, k, G], b [k, D]
    -> [..., K, D]. Tap t of slot i reads slot i - t of the same block, none before slot 0."""
    K = x.shape[-2]
    out = torch.zeros_like(x)
    for t in range(min(base.shape[0], K)):
        shifted = x if t == 0 else torch.cat([x.new_zeros(*x.shape[:-2], t, x.shape[-1]), x[..., :K - t, :]], -2)
        coef = base[t].to(x.dtype) + delta[..., t, :].repeat_interleave(group_size, -1)  # [..., K, D]
        out = out + shifted * coef
    return out


class LocalConv(nn.Module):
    """The input-side and output-side convolutions of one sublayer, both driven by one projection of its normed
    input (speculators' GroupedDynamicCausalConv)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))  # b: [side, tap, D]
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Both convolutions the identity: b_0 = 1, b_{t>0} = 0, W_κ = 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u [..., K, D] normed sublayer input -> (Conv(u; κ[.., 0], b_0), the output side's δ [..., K, k, G])."""
        kappa = self.kernel_projection(u).unflatten(-1, (2, self.kernel_size, self.groups))  # [..., K, 2, k, G]
        return block_conv(u, kappa[..., 0, :, :], self.base_kernel[0], self.group_size), kappa[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """y [..., K, D] sublayer output -> Conv(y; δ, b_1)."""
        return block_conv(y, delta, self.base_kernel[1], self.group_size)


class DFlash2Layer(BlockLayer):
    """heads/dspark.py's block layer with a LocalConv around its attention and around its MLP."""

    def __init__(self, cfg, kernel_size: int, group_size: int):
        super().__init__(cfg)
        self.attention_conv = LocalConv(cfg.hidden_size, kernel_size, group_size)
        self.mlp_conv = LocalConv(cfg.hidden_size, kernel_size, group_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, allowed):
        """x [B,A,K,D] -> [B,A,K,D] (BlockLayer.forward's arguments)."""
        u, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(u, cos, sin, ctx_k, ctx_v, allowed), delta)
        u, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), delta)


class CandidateSelector(nn.Module):
    """S(v) = U(v) + < P[x_prev] ⊙ W_h h , Q[v] > over the unary top-k (speculators' CandidateSelector)."""

    def __init__(self, vocab_size: int, hidden: int, rank: int, top_k: int, std: float):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # P: [V, r]
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # Q: [V, r]
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)  # W_h
        for w in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(w, std=std)

    def score(self, unary: torch.Tensor, h: torch.Tensor, prev: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """unary [..., V], h [..., D], prev [...] token ids, cand [..., k] token ids -> S at cand [..., k]."""
        ctx = self.predecessor_codebook[prev] * self.hidden_projection(h.to(self.predecessor_codebook.dtype))
        trans = (ctx.unsqueeze(-2) * self.successor_codebook[cand]).sum(-1)  # [..., k]
        return unary.gather(-1, cand) + trans.to(unary.dtype)

    def logits(self, unary: torch.Tensor, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The draft logits [..., V]: S on the unary top-k C, -inf elsewhere (argmax = the selector's choice)."""
        cand = unary.topk(self.top_k, dim=-1).indices  # [..., k]
        out = torch.full_like(unary, float("-inf"))
        return out.scatter(-1, cand, self.score(unary, h, prev, cand))


def training_candidates(unary: torch.Tensor, want: torch.Tensor, top_k: int):
    """The selector's training set (speculators `selector_training_candidates`): unary [..., V], want [...] the
    target's greedy token -> (candidates [..., k]: the unary top-k with `want` put at rank k-1 where it is missing,
    want's rank among them [...], whether the unary top-k held it [...] bool)."""
    with torch.no_grad():
        cand = unary.topk(top_k, dim=-1).indices
        match = cand == want.unsqueeze(-1)
        hit = match.any(-1)
        pos = torch.where(hit, match.long().argmax(-1), torch.full_like(want, top_k - 1))
        cand = cand.clone()
        cand[..., -1] = torch.where(hit, cand[..., -1], want)
    return cand, pos, hit


class DFlash2Head(DSparkHead):
    kind = "dflash2"

    def __init__(self, config: HeadConfig):
        check_head_config(config)
        super().__init__(config)
        s, cfg = self.spec, self.layer_config
        self.layers = nn.ModuleList(DFlash2Layer(cfg, s.options.conv_kernel_size, s.options.conv_group_size)
                                    for _ in range(s.num_layers))
        for m in self.layers.modules():  # as DSparkHead's backbone: normal(0, initializer_range)
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.initializer_range)
        for m in self.layers.modules():  # then every convolution the identity (its projection zero)
            if isinstance(m, LocalConv):
                m.reset_parameters()
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, s.options.selector_rank,
                                                    s.options.selector_top_k, cfg.initializer_range)

    def heads(self, h: torch.Tensor, prev: torch.Tensor, greedy: bool = False, pick=None):
        """h [B,A,K,D] -> (draft logits [B,A,K',V]: the selector's S on the unary top-k, -inf elsewhere; None).

        prev [B,A,K'] the data's predecessors (teacher forcing); with greedy, [B,A] the anchors and draft j >= 1
        reads the argmax of draft j-1, or with pick(j, logits_j [B,A,V]) -> ids [B,A] the token pick chose (pick is
        called for every draft: its token is the next draft's predecessor)."""
        hd = h[:, :, self.slot0:]
        unary = self._base_logits(hd)  # [B,A,K',V]
        sel = self.candidate_selector
        if not greedy:
            return sel.logits(unary, hd, prev), None
        p, out = prev, []
        for j in range(self.num_drafts):
            lj = sel.logits(unary[:, :, j], hd[:, :, j], p)  # [B,A,V]
            out.append(lj)
            if pick is not None:
                p = pick(j, lj)
            elif j + 1 < self.num_drafts:
                p = lj.argmax(-1)
        return torch.stack(out, 2), None

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                attention_mask: torch.Tensor | None = None, want: torch.Tensor | None = None):
        """Teacher-forced blocks (DSparkHead.block_states) -> (unary logits [B,A,K',V], candidates [B,A,K',k],
        their selector scores [B,A,K',k], whether the unary top-k held `want` [B,A,K']). want [B,A,K']: the
        target's greedy token per draft, injected as in `training_candidates` (None: the plain unary top-k)."""
        h, prev = self.block_states(features, input_ids, anchors, attention_mask)
        hd = h[:, :, self.slot0:]
        unary = self._base_logits(hd)
        k = self.candidate_selector.top_k
        if want is None:
            cand = unary.detach().topk(k, dim=-1).indices
            hit = torch.ones(cand.shape[:-1], dtype=torch.bool, device=cand.device)
        else:
            cand, _, hit = training_candidates(unary.detach(), want, k)
        return unary, cand, self.candidate_selector.score(unary, hd, prev, cand), hit


@dataclass
class DFlash2Options(OwnStageOptions):
    """head.dflash2: the DFlash block's settings (BlockOptions), a local dynamic convolution over the block and a
    top-k candidate selector; speculators' DFlash2SpeculatorConfig keys of the same names and defaults."""

    LIMITS: ClassVar[dict[str, str]] = {"conv_kernel_size": ">=1", "conv_group_size": ">=1", "selector_rank": ">=1",
                                        "selector_top_k": ">=1"}  # upper bounds: check_dflash2, check_head_config
    conv_kernel_size: int = 2  # taps of each causal in-block convolution (speculators 2)
    conv_group_size: int = 16  # hidden channels sharing one dynamic coefficient (speculators 16)
    selector_rank: int = 256  # r of the selector's codebooks (speculators 256)
    selector_top_k: int = 16  # unary candidates the selector reranks per draft (speculators 16)


def check_dflash2(spec) -> None:
    """The head: section of a DFlash2 head: a DFlash block (check_block) with its convolution and selector, and
    nothing of DSpark's."""
    check_block(spec)
    o = spec.options
    if o.conv_kernel_size > o.block_size:
        raise SpecheadsError(f"{spec.key('conv_kernel_size')}: {o.conv_kernel_size} taps exceed the block's "
                             f"{o.block_size} slots ({spec.key('block_size')})")
    refuse_block_extras(spec, "DFlash2", "selector", "drafts over the full vocabulary (its selector's codebooks and "
                        "speculators' DFlash2DraftModel need it)")


def check_head_config(cfg: HeadConfig) -> None:
    """What needs the target's sizes: the groups divide the hidden size, the candidates fit the vocabulary."""
    spec = cfg.head_spec
    s = spec.options
    if cfg.hidden_size % s.conv_group_size:
        raise SpecheadsError(f"{spec.key('conv_group_size')}: {s.conv_group_size} does not divide the target's "
                             f"hidden size {cfg.hidden_size}")
    if s.selector_top_k > cfg.vocab_size:
        raise SpecheadsError(f"{spec.key('selector_top_k')}: {s.selector_top_k} exceeds the vocabulary "
                             f"{cfg.vocab_size}")


KIND = register_kind(KindSpec(
    name="dflash2", head=DFlash2Head, label="a DFlash2 head", train_step="specheads.train.kinds.dflash2:KIND",
    drafter="specheads.infer.drafters.dflash2:KIND", options=DFlash2Options, check=check_dflash2,
    formats=("speculators",),
    refused={"specforge": "SpecForge 0.2.0 has no DFlash2 draft model (its DFlash reads no attention_conv / "
                          "candidate_selector tensors); export speculators or native"},
    gguf="specheads.heads.dflash2_gguf:DFLASH2_DRAFT",  # llama.cpp's dflash architecture, --spec-type draft-dflash
    example={"mask_token_id": 5, "dflash2": {"block_size": 4, "markov_rank": 0, "confidence_head": False,
                                             "sample_from_anchor": False, "conv_kernel_size": 2,
                                             "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}},
    **{**BLOCK_KIND, "confidence": False, "exporter": "specheads.heads.export.dflash2:export_dflash2"}))
