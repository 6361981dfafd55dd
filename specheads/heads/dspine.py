"""DSpine head (Tencent 2026, "Draft in Parallel, Condition Through Depth: Adjacent Causal Injection for Speculative
Decoding"; training code sgl-project/SpecForge specforge/modeling/draft/dspine.py DSpineDraftModel and
specforge/algorithms/dspine/model.py OnlineDSpineModel): the DFlash block backbone of heads/dspark.py (subclassed,
not copied) with causal attention inside the block and, after every layer, each slot's predicted feature written
into the next slot ("adjacent causal injection"), so that token dependencies travel one slot per layer in ONE pass.

With the context x_0..x_{p-1} verified and x_p the anchor, slots k = 0..K-1 at positions p+k hold [x_p, m, ..., m]
(heads/dspark.py: z^0 = E(...), context keys / values from the fused target features), slot k >= 1 predicts
x_{p+k} (the DFlash alignment: K-1 drafts). Layer i = 0..n-1 of the backbone, then its injection:

    u^i   = Layer_i(z^{i-1})           attention: context rows t < p and the slots j <= k of its own block (causal)
    f^i_k = √r · normalize(R_i u^i_k)                     the slot's predicted feature, R_i: D -> r (readouts.i)
    π^i_1 = √r · C[x_p],   π^i_k = f^i_{k-1}  (k >= 2)    predecessor: the anchor's code, else the slot before
    g^i_k = σ(G_r f^i_k + G_p π^i_k + b)                  gate (receiver_gate, predecessor_gate, bias; shared)
    z^i_k = u^i_k + rms(u^i_k) · W_i (g^i_k ⊙ M π^i_k)    k >= 1, M: r -> m (message), W_i: m -> D (writes.i)
    z^i_0 = u^i_0                                         the anchor slot is never written
    h     = RMSNorm(z^{n-1}),   U_k = W_lm h_k            base logits (the target's lm_head rows of the draft vocab)

rms(u) = ||u|| / √D. C [V, r] are fixed token codes (the buffer `transfer_codes`), computed once from the target's
lm_head W [V, D] (SpecForge initialize_transfer_space): ŵ_v = W_v / ||W_v||, μ = mean_v ŵ_v, P [D, r] and λ the top
r eigenvectors / eigenvalues of Σ_v (ŵ_v - μ)(ŵ_v - μ)ᵀ, C_v = normalize((ŵ_v - μ) P / √λ); every R_i starts as Pᵀ
(learned after), W_i and G_p start at 0 (the head starts as the causal DFlash backbone; head.dspine.write_std > 0
draws W_i from N(0, std²) instead).

Predecessor refinement (SpecForge `refine` / `transition_scores`, the drafts served): draft k re-scores its top-k
candidates b (k = head.dspine.top_k, from U_k) with the LAST layer's injection redone on the token a chosen before
it (the anchor for the first draft) in place of the predicted feature:

    ĥ_k(a)  = RMSNorm(u_k + rms(u_k) · W_{n-1}(σ(G_r f_k + G_p √r C[a] + b) ⊙ M √r C[a]))   u = u^{n-1}, f = f^{n-1}
    s_k(a, b) = W_lm[b] · ĥ_k(a),   b ∈ top-k(U_k);   q_k(b | a) = softmax over those k candidates (0 elsewhere)

Greedy, the chain takes a = the previous draft's argmax (SpecForge select_cached); sampling, a = the token drawn for
the previous draft (`pick`), and q_k is the distribution it is drawn from, so verification stays lossless. In
training the predecessors are the data's tokens (teacher forcing, as SpecForge's refinement loss reads them).
The loss (backbone distillation, refinement over the candidates, alignment of every layer's feature to C of the
slot's token, scheduled replacement of the shallow layers' predecessors) is train/kinds/dspine.py's.

Where the sources leave room: (1) head.draft_vocab_size works (U_k and s_k over the draft vocab's rows, codes over
the full target vocabulary, as predecessors are target ids); SpecForge has no draft vocabulary. (2) No confidence
head and no Markov head (SpecForge's DSpine has neither). (3) SpecForge's sliding-window layers are not built.
(4) Tensor names are SpecForge's (`injection.readouts.i`, `injection.writes.i`, `injection.message`,
`injection.receiver_gate`, `injection.predecessor_gate`, `injection.bias`, `transfer_codes`). No engine reads the
head from here yet (KindSpec.refused; docs/dspine.md). vLLM and SGLang serving of DSpine are announced by the
DSpine README; their loaders were not found, so nothing here is checked against them.
Shapes: B batch, A anchors (blocks), K slots, K' = K-1 drafts, D hidden, V vocab, V' draft vocab, r code width,
m message width, n layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specheads.heads.base import HeadConfig
from specheads.heads.dspark import BLOCK_KIND, OwnStageOptions, DSparkHead, check_block
from specheads.heads.kinds import KindSpec, register_kind
from specheads.utils import SpecheadsError


class AdjacentInjection(nn.Module):
    """The per-layer readouts R_i and writes W_i and the shared message M, gates G_r, G_p and bias b (module
    docstring), under SpecForge's AdjacentInjection names."""

    def __init__(self, hidden: int, num_layers: int, rank: int, message: int, write_std: float):
        super().__init__()
        self.rank = rank
        self.readouts = nn.ModuleList(nn.Linear(hidden, rank, bias=False) for _ in range(num_layers))
        self.writes = nn.ModuleList(nn.Linear(message, hidden, bias=False) for _ in range(num_layers))
        self.message = nn.Linear(rank, message, bias=False)
        self.receiver_gate = nn.Linear(rank, message, bias=False)
        self.predecessor_gate = nn.Linear(rank, message, bias=False)
        self.bias = nn.Parameter(torch.zeros(message))
        for w in self.writes:  # 0: every write starts as the identity (SpecForge)
            nn.init.normal_(w.weight, std=write_std) if write_std > 0 else nn.init.zeros_(w.weight)
        nn.init.zeros_(self.predecessor_gate.weight)

    def feature(self, u: torch.Tensor, layer: int) -> torch.Tensor:
        """f = √r · normalize(R_i u): u [..., D] -> [..., r] (normalised in fp32)."""
        f = F.normalize(self.readouts[layer](u).float(), dim=-1)
        return (math.sqrt(self.rank) * f).to(u.dtype)

    def write(self, u: torch.Tensor, receiver: torch.Tensor, pred: torch.Tensor, layer: int) -> torch.Tensor:
        """u + rms(u) · W_i(σ(G_r f + G_p π + b) ⊙ M π): u [..., D], receiver f and predecessor π [..., r]."""
        pred = pred.to(receiver.dtype)
        gate = torch.sigmoid(self.receiver_gate(receiver) + self.predecessor_gate(pred) + self.bias)
        delta = self.writes[layer](gate * self.message(pred))
        scale = (torch.linalg.vector_norm(u.float(), dim=-1, keepdim=True) / math.sqrt(u.shape[-1])).to(u.dtype)
        return u + scale * delta

    def forward(self, u: torch.Tensor, layer: int, anchor_code: torch.Tensor, forced=None) -> torch.Tensor:
        """One layer's injection: u [B,A,K,D], anchor_code √r C[x_p] [B,A,r] -> z [B,A,K,D]. forced: (codes
        [B,A,K-1,r] of the data's predecessors, mask [B,A], layers): blocks in mask read those codes at the
        layers < `layers` (scheduled replacement in training)."""
        f = self.feature(u, layer)
        pred = torch.cat([anchor_code.unsqueeze(2).to(f.dtype), f[:, :, 1:-1]], dim=2)  # [B,A,K-1,r]
        if forced is not None and layer < forced[2]:
            pred = torch.where(forced[1][..., None, None], forced[0].to(pred.dtype), pred)
        return torch.cat([u[:, :, :1], self.write(u[:, :, 1:], f[:, :, 1:], pred, layer)], dim=2)


@dataclass
class SpineStates:
    """What DSpineHead.blocks gives its heads: the final-normed slots h [B,A,K,D], the last layer's pre-injection
    states u [B,A,K,D] (the refinement reads them) and, in training, every layer's post-injection features
    [n,B,A,K,r] (the alignment loss)."""

    h: torch.Tensor
    pre: torch.Tensor
    features: torch.Tensor | None = None


class SpineOutput(NamedTuple):
    """DSpineHead.forward, teacher-forced: base logits U [B,A,K',V'], the candidates [B,A,K',k] (draft ids, top-k of
    U), their refined scores s(x_{p+j}, ·) [B,A,K',k] and the features [n,B,A,K',r] of the drafting slots."""

    base: torch.Tensor
    candidates: torch.Tensor
    scores: torch.Tensor
    features: torch.Tensor


class DSpineHead(DSparkHead):
    kind = "dspine"

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        s, D, V = self.spec, config.hidden_size, config.vocab_size
        r = int(s.options.transfer_rank)
        if not 1 <= r <= min(D, V - 1):
            raise SpecheadsError(f"{s.key('transfer_rank')}: {r} must be within 1..{min(D, V - 1)} (the target's "
                                 f"hidden size {D} and vocab {V} - 1 bound the codes' principal directions)")
        for layer in self.layers:
            layer.self_attn.causal = True  # slot k reads slots <= k (SpecForge causal_block)
        self.injection = AdjacentInjection(D, s.num_layers, r, int(s.options.message_size), float(s.options.write_std))
        self.register_buffer("transfer_codes", torch.zeros(V, r))  # C, fixed: init_from_target fills it
        if s.options.top_k > config.out_vocab:
            raise SpecheadsError(f"{s.key('top_k')}: {s.options.top_k} exceeds the draft vocabulary {config.out_vocab}")
        self.top_k = int(s.options.top_k)

    @torch.no_grad()
    def init_from_target(self, chunk: int = 4096) -> None:
        """The draft vocab's lm_head rows (DSparkHead), then the token codes C and the readouts R_i = Pᵀ from the
        target's full lm_head (module docstring; SpecForge initialize_transfer_space)."""
        super().init_from_target()
        w = self._get_frozen("lm_head").weight
        r, D = self.injection.rank, w.shape[1]
        cov, total = torch.zeros(D, D, device=w.device), torch.zeros(D, device=w.device)
        for rows in w.split(chunk):
            n = F.normalize(rows.float(), dim=-1)
            total += n.sum(0)
            cov += n.T @ n
        mean = total / w.shape[0]
        cov -= w.shape[0] * torch.outer(mean, mean)
        vals, vecs = torch.linalg.eigh(cov)
        vals, vecs = vals[-r:], vecs[:, -r:]  # [r], [D,r]: the top r principal directions
        if not bool(torch.isfinite(vals).all()) or bool((vals <= 0).any()):
            raise SpecheadsError(f"head.dspine.transfer_rank: the target's lm_head has fewer than {r} positive "
                                 "principal directions; lower it")
        for start in range(0, w.shape[0], chunk):
            n = F.normalize(w[start:start + chunk].float(), dim=-1)
            codes = F.normalize((n - mean) @ vecs / vals.sqrt(), dim=-1)
            self.transfer_codes[start:start + codes.shape[0]] = codes.to(self.transfer_codes.device,
                                                                         self.transfer_codes.dtype)
        for readout in self.injection.readouts:
            readout.weight.copy_(vecs.T.to(readout.weight.device, readout.weight.dtype))

    def code(self, ids: torch.Tensor) -> torch.Tensor:
        """√r · C[ids]: target ids [...] -> [..., r]."""
        return math.sqrt(self.injection.rank) * self.transfer_codes[ids]

    # ----- the backbone with its injections (training and inference) -----
    def blocks(self, ctx, allowed: torch.Tensor, anchor_tokens: torch.Tensor, anchors: torch.Tensor,
               forced=None, features: bool = False) -> SpineStates:
        """DSparkHead.blocks with each layer's injection: ctx, allowed [B,A,S], anchor_tokens / anchors [B,A] ->
        SpineStates. forced: AdjacentInjection's (training); features: keep every layer's post-injection
        features f(z^i) [n,B,A,K,r] (the alignment loss)."""
        B, A = anchors.shape
        K = self.spec.options.block_size
        ids = torch.full((B, A, K), self.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchor_tokens
        x = self.embed(ids)  # [B,A,K,D]
        pos = anchors[..., None] + torch.arange(K, device=anchors.device)  # [B,A,K]: slot k at position p+k
        cos, sin = self._rope(x, pos.flatten(1))
        cos, sin = (t.view(B, A, K, -1).to(x.dtype) for t in (cos, sin))
        anchor_code, feats, u = self.code(anchor_tokens), [], x
        for i, (layer, (ck, cv)) in enumerate(zip(self.layers, ctx)):
            u = layer(x, cos, sin, ck, cv, allowed)
            x = self.injection(u, i, anchor_code, forced)
            if features:
                feats.append(self.injection.feature(x, i))
        return SpineStates(self.norm(x), u, torch.stack(feats) if features else None)

    def refine(self, u: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """ĥ(a): the last layer's injection redone with the token a: u [..., D], pred [...] target ids -> [..., D]."""
        last = len(self.layers) - 1
        return self.norm(self.injection.write(u, self.injection.feature(u, last), self.code(pred), last))

    def scores(self, u: torch.Tensor, pred: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """s(a, b) = W_lm[b] · ĥ(a): u [..., D], pred [...] target ids, cand [..., k] draft ids -> [..., k]."""
        w = self.lm_head.weight  # [V', D]: the draft vocab's frozen rows, else the target's lm_head
        h = self.refine(u, pred)
        return torch.einsum("...d,...kd->...k", h.to(w.dtype), w[cand]).float()

    def heads(self, states: SpineStates, prev: torch.Tensor, greedy: bool = False, pick=None):
        """states -> (logits [B,A,K',V']: the refined scores at each draft's top-k candidates, -inf elsewhere; no
        confidence). prev: [B,A,K'] the data's x_{p+j} (teacher forcing), or with greedy [B,A] the anchors, each
        later draft reading the argmax of the one before (or pick(j, logits_j [B,A,V']) -> draft ids [B,A])."""
        hd, ud = states.h[:, :, 1:], states.pre[:, :, 1:]
        base = self._base_logits(hd)  # [B,A,K',V']
        cand = base.topk(self.top_k, dim=-1).indices  # [B,A,K',k]
        blank = torch.full_like(base, float("-inf"))
        if not greedy:
            return blank.scatter(-1, cand, self.scores(ud, prev, cand).to(base.dtype)), None
        p, logits = prev, []
        for j in range(self.num_drafts):
            lj = blank[:, :, j].scatter(-1, cand[:, :, j], self.scores(ud[:, :, j], p, cand[:, :, j]).to(base.dtype))
            logits.append(lj)
            if pick is not None:
                p = self.to_target_ids(pick(j, lj))
            elif j + 1 < self.num_drafts:
                p = self.to_target_ids(lj.argmax(-1))
        return torch.stack(logits, 2), None

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                attention_mask: torch.Tensor | None = None, replace: tuple | None = None) -> SpineOutput:
        """Teacher-forced blocks: features [B,T,F*D], input_ids [B,T], anchors [B,A] (1 <= p <= T-2), attention_mask
        [B,T] -> SpineOutput; draft j predicts input_ids[p+1+j], its predecessor input_ids[p+j]. replace: (mask
        [B,A], layers): those blocks' layers < `layers` read the data's predecessor codes (training's schedule)."""
        B, T = input_ids.shape
        ctx = self.context_kv(features)
        allowed = torch.arange(T, device=anchors.device) < anchors[..., None]  # [B,A,T]: rows before the anchor
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
        idx = (anchors[..., None] + torch.arange(self.spec.options.block_size, device=anchors.device)).clamp(max=T - 1)
        toks = input_ids.gather(1, idx.flatten(1)).view(idx.shape)  # [B,A,K]: x_{p+k}
        forced = None if replace is None else (self.code(toks[..., :-1]), replace[0], int(replace[1]))
        states = self.blocks(ctx, allowed, toks[..., 0], anchors, forced=forced, features=True)
        ud = states.pre[:, :, 1:]
        base = self._base_logits(states.h[:, :, 1:])
        cand = base.detach().topk(self.top_k, dim=-1).indices
        return SpineOutput(base, cand, self.scores(ud, toks[..., :-1], cand), states.features[:, :, :, 1:])


@dataclass
class DSpineOptions(OwnStageOptions):
    """head.dspine: the DFlash block's settings (BlockOptions) and the adjacent causal injection's (SpecForge
    dspine_config)."""

    FLAT_KEYS: ClassVar[dict[str, str]] = {"dspine_transfer_rank": "transfer_rank",
                                           "dspine_message_size": "message_size", "dspine_top_k": "top_k",
                                           "dspine_write_std": "write_std"}
    LIMITS: ClassVar[dict[str, str]] = {"transfer_rank": ">=1", "message_size": ">=1", "top_k": ">=1",
                                        "write_std": ">=0"}  # transfer_rank <= min(D, V-1), top_k <= V': the head's
    transfer_rank: int = 1024  # r, width of the token codes and per-layer readouts (SpecForge transfer_rank)
    message_size: int = 512  # m, width of the gated message (SpecForge message_size 512)
    top_k: int = 16  # candidates per draft that the predecessor refinement re-scores (SpecForge top_k 16)
    write_std: float = 0.0  # init std of the per-layer writes (SpecForge: 0, the causal DFlash at start)
    sample_from_anchor: bool = False  # K-1 drafts from the slots after the anchor (DFlash's alignment; check_dspine)


def check_dspine(spec) -> None:
    """The head: section of a DSpine head: a DFlash block (check_block) with the slot alignment, heads and sizes
    DSpine is built with."""
    check_block(spec)
    o = spec.options
    if o.sample_from_anchor:
        raise SpecheadsError(f"{spec.key('sample_from_anchor')}: DSpine drafts from slots 1..K-1 (slot k predicts "
                             "x_{p+k}, SpecForge's DFlash alignment): set it false")
    for name, why in (("markov_rank", "its adjacent injection is the sequential stage: set it 0"),
                      ("confidence_head", "DSpine has no confidence head: set it false"),
                      ("anchor_features", "not built for DSpine")):
        if getattr(o, name):
            raise SpecheadsError(f"{spec.key(name)}: {why} (got {getattr(o, name)})")


KIND = register_kind(KindSpec(
    name="dspine", head=DSpineHead, label="a DSpine head", train_step="specheads.train.kinds.dspine:KIND",
    drafter="specheads.infer.drafters.dspine:KIND", options=DSpineOptions, check=check_dspine, formats=(),
    refused={"speculators": "speculators 0.9.0 has no DSpine model (its models are dflash, dflash2, dspark, eagle3, "
                            "mtp, peagle, xpress; none reads injection.* or transfer_codes); keep the native folder",
             "specforge": "SpecForge's DSpineDraftModel (specforge/modeling/draft/dspine.py) is on SpecForge main "
                          "only, not in specforge 0.2.0, the newest release, with which specheads loads its SpecForge "
                          "exports to check them; keep the native folder (docs/dspine.md gives the layout)"},
    not_drafted="llama.cpp's converter (llama.cpp 0c1e570) has no DSpine architecture",
    example={"mask_token_id": 5, "dspine": {"block_size": 4, "markov_rank": 0, "confidence_head": False,
                                            "sample_from_anchor": False, "transfer_rank": 16, "message_size": 8,
                                            "top_k": 6, "write_std": 0.02}},
    example_train={"block.dspine_alignment_warmup": 0},
    **{**BLOCK_KIND, "confidence": False, "exporter": None}))
