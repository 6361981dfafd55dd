"""LiLiCorr head (NVIDIA, "LiLiCorr: Lightweight Likelihood Correlation of Parallel Drafts for Speculative
Decoding", arXiv:2608.20530; training code NVIDIA Model-Optimizer `modelopt/torch/speculative/plugins/
modeling_lilicorr.py` + `hf_lilicorr.py`; served by TensorRT-LLM `_torch/models/modeling_lilicorr.py`, vLLM and SGLang
as a DFlash checkpoint with `dflash_config.lilicorr_*` keys): the DFlash block drafter of heads/dspark.py (subclassed:
context, attention, slots and alignment unchanged) plus a small transformer that rescores the lattice of the block's
per-slot top-k candidates, so that the drafted chain is jointly coherent and not only per-slot plausible.

Backbone. heads/dspark.py with `sample_from_anchor: false` (slot 0 holds the anchor x_p, draft j = slot j+1 predicts
x_{p+1+j}, K' = K-1 drafts); h_j the final-normed state of draft j, U_j = W_lm h_j its logits over the full vocabulary
(the frozen target lm_head), c_{p-1} the fused target row before the anchor (the last context row; 0 when p = 0).

Lattice. C_j = top-k_v U_j(v) in rank order (k = lilicorr_candidate_topk), for candidate r of draft j (v = C_j[r]):

    ℓ_jr  = U_j(v) - logsumexp_v' U_j(v')                                            its log-probability
    φ_jr  = [ℓ_jr, exp ℓ_jr, ℓ_jr - ℓ_j0, r / (k-1), 1{r = 0}]                        5 features
    e^0_jr = P_tok E[v] + P_h h_j + MLP_φ(LayerNorm(φ_jr)) + σ_j + ρ_r               [K', k, H]
    e^i   = e^{i-1} + Attn(RMSNorm(e^{i-1}); bias β) ,  e^i += MLP(RMSNorm(e^i))    L layers over all K'·k nodes
    β_h[(j,r),(j',r')] = b^rel_h[j - j'] + 1{j = j'} b^same_h                        (bidirectional, no mask)
    g_jr  = RMSNorm_out(e^L_jr),   a = RMSNorm_a(W_c c_{p-1})   (a = 0 when p = 0)
    f_jr  = SiLU(W_f [g_jr ; a ; g_jr ⊙ a])
    o_jr  = n(W_out f_jr),  i_jr = n(W_in f_jr),  o_a = n(W_ao a)                   n(x) = x / max(||x||, ε)
    start(r)       = λ <o_a, i_0r>                                                   draft 0 given the anchor
    pair_j(r, r')  = λ <o_jr, i_{j+1,r'}>                                            draft j+1 given draft j = C_j[r]

P_tok is the identity when H = D; E the frozen target embedding (no gradient); σ, ρ learned slot / rank embeddings;
λ = lilicorr_logit_scale fixed, ε = lilicorr_vector_eps. Walk (ModelOpt / TensorRT-LLM `lilicorr_proposal_logits`):

    S_0 = start,   r_j = the pick of draft j among C_j,   S_{j+1} = pair_j(r_j, ·),   x_j = C_j[argmax S_j]

Serving walks the chain left to right once the one parallel pass is done: r_j is the argmax of S_j, or when
sampling the rank of the token drawn from softmax(S_j) over C_j. The draft logits this head returns are S_j on C_j
and -inf elsewhere, so their argmax is the walk's token and, when sampling, the distribution a draft was drawn from
is exactly the q the verifier reads (lossless). Teacher-forced (training, evaluation), r_j is the rank of the data's
token x_{p+1+j} in C_j, or the argmax of S_j where C_j misses it. Training (train/kinds/lilicorr.py) adds to the
DFlash loss a CE, a hinge and a distractor penalty over S_j along the data's chain while it stays in the lattice.

Not built (refused by `check_lilicorr`): a draft vocabulary (the lattice reads the full vocabulary, as every
engine's LiLiCorr loader requires), the DSpark Markov and confidence heads, `sample_from_anchor: true`, the
anchor-features variant, and ModelOpt's optional DFlash2 convolutions around the backbone's sublayers.
Tensor names follow ModelOpt's LiLiCorrHead under `lilicorr.` (`token_proj`, `pass_hidden_proj`, `feature_mlp.{0,1,3}`,
`slot_embedding`, `rank_embedding`, `relative_slot_bias`, `same_slot_bias`, `context_proj`,
`layers.{i}.{attn_norm, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj, mlp_norm, mlp.{0,2}}`, `output_norm`,
`anchor_norm`, `factor_input_proj`, `out_head`, `in_head`, `anchor_out_head`).
Shapes: B batch, T sequence, A anchors (blocks), K slots, K' drafts, D hidden, V vocab, k candidates, H lattice
width, F factor width, N = K'·k lattice nodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from specheads.heads.base import HeadConfig
from specheads.heads.dspark import (BLOCK_KIND, BlockContext, OwnStageOptions, DSparkHead, check_block,
                                    refuse_block_extras)
from specheads.heads.kinds import KindSpec, register_kind
from specheads.utils import SpecheadsError

NUM_FEATURES = 5  # φ: [ℓ, exp ℓ, ℓ - ℓ_0, rank fraction, is top-1]


def _rms_norm(width: int, eps: float) -> nn.Module:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return Qwen3RMSNorm(width, eps=eps)


class LatticeAttention(nn.Module):
    """Full attention over the N lattice nodes with an additive per-head bias (nn.MultiheadAttention's tensor
    names: in_proj_weight / in_proj_bias / out_proj, as ModelOpt's checkpoints hold them)."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [M,N,H] (M = B·A blocks), bias [h,N,N] -> [M,N,H]."""
        M, N, H = x.shape
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # [M,h,N,H/h]
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, -1))
        s = torch.einsum("mhnd,mhod->mhno", q, k) * q.shape[-1] ** -0.5 + bias.to(q.dtype)
        out = torch.einsum("mhno,mhod->mhnd", torch.softmax(s.float(), -1).to(v.dtype), v)
        return self.out_proj(out.transpose(1, 2).flatten(-2))


class LatticeLayer(nn.Module):
    """Pre-norm residual layer: e + Attn(RMSNorm(e); β), then + MLP(RMSNorm(.)) (Linear, SiLU, Linear)."""

    def __init__(self, width: int, num_heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        inner = int(width * mlp_ratio)
        self.attn_norm, self.mlp_norm = _rms_norm(width, eps), _rms_norm(width, eps)
        self.attn = LatticeAttention(width, num_heads)
        self.mlp = nn.Sequential(nn.Linear(width, inner), nn.SiLU(), nn.Linear(inner, width))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LatticeScorer(nn.Module):
    """The reranker: the block's candidate lattice -> start [.., k] and pair [.., K'-1, k, k] scores (module
    docstring: e^0, the L layers, the factors)."""

    def __init__(self, hidden: int, num_drafts: int, s, eps: float, std: float):
        super().__init__()
        H = s.options.hidden_size or hidden
        k, nh, Fd = s.options.candidate_topk, s.options.num_heads, s.options.factor_dim
        self.top_k, self.num_heads, self.num_drafts = k, nh, num_drafts
        self.logit_scale, self.vector_eps = float(s.options.logit_scale), float(s.options.vector_eps)
        self.token_proj = nn.Identity() if H == hidden else nn.Linear(hidden, H)  # P_tok
        self.pass_hidden_proj = nn.Linear(hidden, H)  # P_h
        self.feature_mlp = nn.Sequential(nn.LayerNorm(NUM_FEATURES), nn.Linear(NUM_FEATURES, H), nn.SiLU(),
                                         nn.Linear(H, H))  # MLP_φ(LayerNorm(φ))
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, num_drafts, 1, H))  # σ_j
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, k, H))  # ρ_r
        self.relative_slot_bias = nn.Parameter(torch.zeros(nh, 2 * (num_drafts + 1) - 1))  # b^rel over j - j'
        self.same_slot_bias = nn.Parameter(torch.zeros(nh))  # b^same
        self.context_proj = nn.Linear(hidden, H)  # W_c
        self.layers = nn.ModuleList(LatticeLayer(H, nh, s.options.mlp_ratio, eps)
                                    for _ in range(s.options.num_layers))
        self.output_norm, self.anchor_norm = _rms_norm(H, eps), _rms_norm(H, eps)
        self.factor_input_proj = nn.Linear(3 * H, H)  # W_f
        self.out_head, self.in_head, self.anchor_out_head = (nn.Linear(H, Fd) for _ in range(3))
        for m in self.modules():  # ModelOpt: the draft's normal(0, initializer_range), zero biases ...
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
        for layer in self.layers:
            nn.init.normal_(layer.attn.in_proj_weight, std=std)
        for m in (self.out_head, self.in_head, self.anchor_out_head):  # ... then the factor heads at std 0.02
            nn.init.normal_(m.weight, std=0.02)  # (zero on both sides of a product would be a dead saddle)

    def bias(self, device) -> torch.Tensor:
        """β [h,N,N]: the relative-slot bias plus the same-slot bias (lattice geometry only)."""
        K, k = self.num_drafts, self.top_k
        slot = torch.arange(K, device=device).repeat_interleave(k)  # [N]: node -> its draft slot
        rel = slot[:, None] - slot[None, :]  # [N,N] in -(K-1)..K-1
        b = self.relative_slot_bias[:, rel + K]  # the table is centred on distance 0 at column K (= block_size - 1)
        return b + (rel == 0).to(b.dtype) * self.same_slot_bias[:, None, None]

    def forward(self, emb: torch.Tensor, logp: torch.Tensor, h: torch.Tensor, anchor: torch.Tensor,
                anchor_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """emb [B,A,K',k,D] E of the candidates, logp [B,A,K',k] their ℓ (fp32), h [B,A,K',D] the drafts' states,
        anchor [B,A,D] c_{p-1}, anchor_valid [B,A] bool -> (start [B,A,k], pair [B,A,K'-1,k,k]), fp32, λ-scaled."""
        B, A, K, k, _ = emb.shape
        dt = h.dtype
        rank = torch.arange(k, device=logp.device, dtype=logp.dtype)
        frac = (rank / max(k - 1, 1)).expand_as(logp)
        top1 = (rank == 0).to(logp.dtype).expand_as(logp)
        phi = torch.stack([logp, logp.exp(), logp - logp[..., :1], frac, top1], -1)  # [B,A,K',k,5]
        e = self.token_proj(emb.detach().to(dt)) + self.pass_hidden_proj(h).unsqueeze(-2)
        e = e + self.feature_mlp(phi.to(dt)) + self.slot_embedding.to(dt) + self.rank_embedding.to(dt)
        e = e.reshape(B * A, K * k, -1)  # [M,N,H]
        bias = self.bias(e.device)
        for layer in self.layers:
            e = layer(e, bias)
        g = self.output_norm(e).view(B, A, K, k, -1)  # [B,A,K',k,H]
        a = self.context_proj(anchor.to(dt)) * anchor_valid.unsqueeze(-1).to(dt)  # 0 where there is no c_{p-1}
        a = self.anchor_norm(a)  # [B,A,H]
        a_n = a[:, :, None, None].expand_as(g)
        f = F.silu(self.factor_input_proj(torch.cat([g, a_n, g * a_n], -1)))
        o = F.normalize(self.out_head(f).float(), dim=-1, eps=self.vector_eps)  # [B,A,K',k,F]
        i = F.normalize(self.in_head(f).float(), dim=-1, eps=self.vector_eps)
        oa = F.normalize(self.anchor_out_head(a).float(), dim=-1, eps=self.vector_eps)  # [B,A,F]
        start = torch.einsum("baf,barf->bar", oa, i[:, :, 0])
        pair = torch.einsum("bajrf,bajsf->bajrs", o[:, :, :-1], i[:, :, 1:])
        return self.logit_scale * start, self.logit_scale * pair


class LiLiCorrHead(DSparkHead):
    """The DFlash backbone with the lattice reranker. Its `blocks` appends c_{p-1} (zero when p = 0) to the slots'
    states as one extra row [B,A,K+1,D], which `heads` reads as the anchor: the blocks' and heads' callers
    (training, evaluation, the drafter's batched pass) carry it through unchanged."""

    kind = "lilicorr"

    def __init__(self, config: HeadConfig):
        check_head_config(config)
        super().__init__(config)
        self.lilicorr = LatticeScorer(config.hidden_size, self.num_drafts, self.spec, self.layer_config.rms_norm_eps,
                                      self.layer_config.initializer_range)

    def context_kv(self, features: torch.Tensor, start: int = 0) -> BlockContext:
        """DSparkHead.context_kv that always keeps the fused rows c [B,N,D] (the lattice's anchor reads c_{p-1})."""
        c = self.project_features(features)
        pos = torch.arange(start, start + c.shape[1], device=c.device).expand(c.shape[0], -1)
        cos, sin = self._rope(c, pos)
        return BlockContext([layer.self_attn.kv(c, cos.to(c.dtype), sin.to(c.dtype)) for layer in self.layers], c)

    def _empty_context(self, dev) -> BlockContext:
        ctx = super()._empty_context(dev)
        return BlockContext(ctx.layers, torch.zeros(1, 0, self.config.hidden_size, device=dev, dtype=self.head_dtype))

    def blocks(self, ctx: BlockContext, allowed: torch.Tensor, anchor_tokens: torch.Tensor, anchors: torch.Tensor):
        """DSparkHead.blocks -> [B,A,K+1,D]: the K slots' final-normed states, then c_{p-1} (0 where p = 0)."""
        h = super().blocks(ctx, allowed, anchor_tokens, anchors)
        c = ctx.fused
        if c is None or c.shape[1] == 0:
            row = h.new_zeros(*anchors.shape, h.shape[-1])
        else:
            g = c.gather(1, (anchors - 1).clamp(min=0).unsqueeze(-1).expand(-1, -1, c.shape[-1]))  # [B,A,D]
            row = g * (anchors >= 1).unsqueeze(-1).to(g.dtype)
        return torch.cat([h, row.unsqueeze(2).to(h.dtype)], 2)

    def lattice(self, h: torch.Tensor):
        """blocks' output [B,A,K+1,D] -> (unary logits U [B,A,K',V], candidates C [B,A,K',k], start [B,A,k],
        pair [B,A,K'-1,k,k]). ℓ reads the live U (the lattice terms reach the backbone through it and h)."""
        K = self.spec.options.block_size
        hd, anchor = h[:, :, self.slot0:K], h[:, :, K]
        unary = self._base_logits(hd)  # [B,A,K',V]
        cand = unary.detach().topk(self.lilicorr.top_k, dim=-1).indices  # rank order
        logp = unary.gather(-1, cand).float() - unary.float().logsumexp(-1, keepdim=True)
        valid = anchor.abs().sum(-1) > 0  # blocks' zero row: no c_{p-1}
        start, pair = self.lilicorr(self.embed(cand), logp, hd, anchor, valid)
        return unary, cand, start, pair

    def heads(self, h: torch.Tensor, prev: torch.Tensor, greedy: bool = False, pick=None):
        """h [B,A,K+1,D] (blocks') -> (draft logits [B,A,K',V]: S_j on C_j, -inf elsewhere; None).

        prev [B,A,K'] the data's x_{p+j} (teacher forcing: draft j+1 reads the rank of x_{p+1+j} = prev[..., j+1]
        in C_j, the argmax of S_j where C_j misses it); with greedy, [B,A] the anchors and draft j+1 reads the
        argmax of draft j, or with pick(j, logits_j [B,A,V]) -> ids [B,A] the token pick chose (called for every
        draft)."""
        unary, cand, start, pair = self.lattice(h)
        row, out = start, []
        for j in range(self.num_drafts):
            lj = torch.full_like(unary[:, :, j], float("-inf")).scatter(-1, cand[:, :, j], row.to(unary.dtype))
            out.append(lj)
            if greedy and pick is not None:
                tok = pick(j, lj)
            elif greedy:
                tok = lj.argmax(-1)
            else:
                tok = prev[:, :, j + 1] if j + 1 < prev.shape[-1] else lj.argmax(-1)
            if j + 1 < self.num_drafts:
                match = cand[:, :, j] == tok.unsqueeze(-1)  # [B,A,k]
                r = torch.where(match.any(-1), match.long().argmax(-1), lj.gather(-1, cand[:, :, j]).argmax(-1))
                row = pair[:, :, j].gather(2, r[..., None, None].expand(-1, -1, 1, pair.shape[-1])).squeeze(2)
        return torch.stack(out, 2), None

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                attention_mask: torch.Tensor | None = None):
        """Teacher-forced blocks (DSparkHead.block_states) -> lattice(): (U [B,A,K',V], C [B,A,K',k],
        start [B,A,k], pair [B,A,K'-1,k,k]); train/kinds/lilicorr.py walks the data's chain through them."""
        h, _ = self.block_states(features, input_ids, anchors, attention_mask)
        return self.lattice(h)


@dataclass
class LiLiCorrOptions(OwnStageOptions):
    """head.lilicorr: the DFlash block's settings (BlockOptions) and the small transformer that rescores the
    block's top-k candidate lattice (ModelOpt's dflash_architecture_config lilicorr_* keys)."""

    FLAT_KEYS: ClassVar[dict[str, str]] = {f"lilicorr_{k}": k for k in (
        "candidate_topk", "hidden_size", "num_layers", "num_heads", "mlp_ratio", "factor_dim", "vector_eps",
        "logit_scale")}
    LIMITS: ClassVar[dict[str, str]] = {"candidate_topk": ">=1", "hidden_size": ">=0", "num_layers": ">=1",
                                        "num_heads": ">=1", "mlp_ratio": ">0", "factor_dim": ">=1",
                                        "vector_eps": "(0,0.5)", "logit_scale": ">0"}
    candidate_topk: int = 8  # k candidates per draft slot (vLLM / SGLang serve powers of two <= 16)
    hidden_size: int = 0  # H, the lattice transformer's width; 0 = the target's hidden size D
    num_layers: int = 2  # lattice transformer layers
    num_heads: int = 8  # its attention heads (H divisible by them)
    mlp_ratio: float = 2.0  # its MLP width / H
    factor_dim: int = 128  # F, the width of the out / in factor vectors
    vector_eps: float = 1e-6  # L2-normalisation epsilon of the factor vectors, in (0, 0.5)
    logit_scale: float = 10.0  # λ, fixed: scores are λ · cosine
    sample_from_anchor: bool = False  # K-1 drafts from the slots after the anchor (DFlash's alignment; check_lilicorr)


def check_lilicorr(spec) -> None:
    """The head: section of a LiLiCorr head: a DFlash block (check_block) with its lattice, nothing of DSpark's."""
    check_block(spec)
    o = spec.options
    if o.sample_from_anchor:
        raise SpecheadsError(f"{spec.key('sample_from_anchor')}: LiLiCorr's lattice covers the K-1 slots after the "
                             "anchor (DFlash's layout); set it false")
    refuse_block_extras(spec, "LiLiCorr", "lattice", "ranks candidates over the full vocabulary (every engine's "
                        "LiLiCorr loader needs the target's)")


def check_head_config(cfg: HeadConfig) -> None:
    """What needs the target's sizes: the lattice width splits into its heads, the candidates fit the vocabulary."""
    spec = cfg.head_spec
    s = spec.options
    width = s.hidden_size or cfg.hidden_size
    if width % s.num_heads:
        raise SpecheadsError(f"{spec.key('num_heads')}: {s.num_heads} does not divide the lattice width {width} "
                             f"({spec.key('hidden_size')}, 0 = the target's hidden size)")
    if s.candidate_topk > cfg.vocab_size:
        raise SpecheadsError(f"{spec.key('candidate_topk')}: {s.candidate_topk} exceeds the vocabulary "
                             f"{cfg.vocab_size}")


KIND = register_kind(KindSpec(
    name="lilicorr", head=LiLiCorrHead, label="a LiLiCorr head", train_step="specheads.train.kinds.lilicorr:KIND",
    drafter="specheads.infer.drafters.lilicorr:KIND", options=LiLiCorrOptions, check=check_lilicorr,
    formats=("modelopt",), writers={"modelopt": "specheads.heads.export.lilicorr:write_modelopt"},
    refused={"speculators": "speculators 0.9.0 has no LiLiCorr model (its dflash / dflash2 / dspark read no "
                            "lilicorr.* tensors); vLLM, SGLang and TensorRT-LLM load LiLiCorr from ModelOpt's DFlash "
                            "checkpoint: export modelopt (or native)",
             "specforge": "SpecForge 0.2.0 has no LiLiCorr draft model; export modelopt (vLLM, SGLang, "
                          "TensorRT-LLM) or native"},
    not_drafted="the pinned llama.cpp has no LiLiCorr reader (its converter and dflash architecture know DFlash, "
                "DFlash2 and DSpark only; LiLiCorr came to llama.cpp's dflash architecture later); export native",
    # candidate_topk 16: the most vLLM / SGLang serve (the modelopt export round-trips for them); on the contract's
    # tiny greedy data the lattice is supervised in one step only where the data's token is a candidate, which
    # this mask token gives at seed 0 (mask 5 does not: its untrained candidates miss the data)
    example={"mask_token_id": 2, "lilicorr": {"block_size": 4, "markov_rank": 0, "confidence_head": False,
                                              "sample_from_anchor": False, "candidate_topk": 16, "hidden_size": 32,
                                              "num_layers": 2, "num_heads": 2, "factor_dim": 8}},
    **{**BLOCK_KIND, "confidence": False, "exporter": None}))
