"""P-EAGLE head (parallel EAGLE; speculators 0.9 `models/peagle` PEagleDraftModel over Eagle3DraftModel, served by
vLLM PR 32887): an EAGLE-3 drafter of n decoder layers that drafts all K tokens of a step in ONE pass.

Depth 0 is an EAGLE-3 row (heads/eagle3.py): row t reads the fused target features and the next token,

    g_t = W_fc · [ h_t^(l1) ; ... ; h_t^(lF) ]                          W_fc: F·D -> D, no bias
    u_t = [ RMSNorm_in(E(x_{t+1})) ; RMSNorm_h(g_t) ]                    layer 0's q/k/v read 2D, residual g_t
    o_t = Layer_{n-1} ∘ ... ∘ Layer_1 ( g_t + Attn_0(u_t) (+ MLP) )      Llama layers 1..n-1 read D
    p(x_{t+2}) = softmax( W_lm · RMSNorm_final(o_t) )                    own lm_head over V'

Depth d >= 1 of the chain anchored at row a sits at position a + d and predicts x_{a+2+d}. Its token and its
features are unknown at drafting time, so it reads two placeholders instead (speculators' `mask_token_id` and its
learned `mask_hidden` [1, 1, F·D]):

    g_{a,d} = W_fc · m_h                  m_h: the learned mask hidden state, shared by every depth >= 1
    u_{a,d} = [ RMSNorm_in(E(mask_token_id)) ; RMSNorm_h(g_{a,d}) ]

and attends the depth-0 rows s <= a plus the rows of its own chain at depths 1..d (speculators'
create_peagle_mask_mod: kv_depth0 & anchor causal | same rollout & depth order). At inference the K drafts after
the root (anchor = the root's row, the last true row) are therefore ONE forward over the new true rows followed by
K - 1 mask rows: the last true row gives draft 1, mask row d gives draft d + 1; no draft reads an earlier draft.
Training samples the chains with COD (conditional drop, train/kinds/peagle.py) and runs every depth over one cache.

Choices where the sources leave room: (1) the token embedding is the target's, frozen and shared (as our EAGLE-3);
speculators' P-EAGLE trains its own copy (`embed_requires_grad` true). The mask token's embedding is therefore the
target's row of `mask_token_id`, so an export needs no embedding (engines load the verifier's, which is ours).
(2) `mask_hidden` starts as randn, as speculators' does; it is the learned placeholder. (3) layers 1..n-1 are Llama
layers (speculators' decoder_layer_class for a Llama transformer_layer_config) sized from the target.
Tensor names: Eagle3Head's (`fc`, `midlayer.*` = speculators' `layers.0.*`, `norm`, `lm_head`, d2t / t2d), plus
`layers.{i}.*` for i = 1..n-1 and `mask_hidden`, as speculators names them.
Shapes: B batch, T sequence, M chain rows of one depth, N rows of one pass, K depths (drafts), D hidden,
F feature layers, V' draft vocab, S attended length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from specheads.heads.base import HeadConfig, causal_mask_4d, fused_layers
from specheads.kvcache import select_columns
from specheads.heads.eagle import build_layers
from specheads.heads.eagle3 import Eagle3Head, eagle3_layer_config, speculators_needs_target
from specheads.heads.kinds import KindSpec, register_kind
from specheads.utils import SpecheadsError


@dataclass
class PEagleOptions:
    """head.peagle: P-EAGLE's own setting (its decoder layers are head.num_layers)."""

    LIMITS: ClassVar[dict[str, str]] = {"num_depths": ">=1"}  # below the target's positions: check_head_config
    num_depths: int = 8  # K parallel depths = drafts per head pass (speculators PEagleArgs num_depths 8)


def check_head_config(cfg: HeadConfig) -> None:
    """What needs the target's sizes: the K depths after the root fit the target's positions (as a block kind's
    slots do, HeadConfig.from_target)."""
    spec, P = cfg.head_spec, cfg.target_config.get("max_position_embeddings")
    if P is not None and spec.options.num_depths + 1 >= int(P):
        raise SpecheadsError(f"{spec.key('num_depths')}: {spec.options.num_depths} does not fit the {P} positions of "
                             f"{cfg.target_name}")


class PEagleCache:
    """One request's head cache: `kv` holds the layers' keys / values of the true rows 0 .. rows-1; `pending` the
    target features [n, F·D] of the positions cached since (run at the next draft, paired with `ids`: the
    sequence so far, root last, which the drafter sets before drafting); `last` the logits [V'] of the last true
    row (draft 1 when no new row arrives)."""

    def __init__(self, kv):
        self.kv, self.rows = kv, 0
        self.pending: list[torch.Tensor] = []
        self.ids: list[int] | None = None
        self.last: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Positions with target features: true rows run plus pending ones."""
        return self.rows + sum(int(p.shape[0]) for p in self.pending)


class PEagleHead(Eagle3Head):
    kind = "peagle"

    def __init__(self, config: HeadConfig):
        check_head_config(config)
        super().__init__(config)  # fc, midlayer (layer 0), norm, lm_head, rotary
        n, F, D = self.spec.num_layers, len(config.feature_layers), config.hidden_size
        self.layer_config = eagle3_layer_config(config.target_config, config.vocab_size, num_layers=n)
        self.layers = nn.ModuleDict()
        if n > 1:
            built, _ = build_layers(self.layer_config)  # layer i keeps layer_idx i: its own slot in the cache
            self.layers.update({str(i): built[i] for i in range(1, n)})
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, F * D))
        self.mask_token_id = int(self.spec.mask_token_id or 0)
        self.confidence_head = None  # served by the block drafter, which then learns per-depth rates

    @property
    def num_drafts(self) -> int:
        return int(self.spec.options.num_depths)

    def _rows(self, feats, tokens, position_ids, mask, kv) -> torch.Tensor:
        """One pass of N rows: feats [B,N,F·D] (mask_hidden at mask rows), tokens [B,N] target ids (the mask token
        at mask rows), position_ids [B,N], mask [B,1,N,S] float, kv (gets N entries per layer) -> logits [B,N,V']."""
        g = self.project_features(feats)  # [B,N,D]
        mask, pe = mask.to(self.head_dtype), self._rope(g, position_ids)
        h = self._midlayer(g, tokens, pe, mask, kv)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=pe, cache=kv)
        return self.lm_head(self.norm(h))

    def _mask_inputs(self, B: int, M: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The placeholders of M mask rows: (features [B,M,F·D], tokens [B,M])."""
        return (self.mask_hidden.expand(B, M, -1),
                torch.full((B, M), self.mask_token_id, dtype=torch.long, device=device))

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                chains: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> list[torch.Tensor]:
        """Teacher-forced: features [B,T,F·D], next_tokens [B,T] (x_{t+1}), attention_mask [B,T] (right padding),
        chains: per depth d = 1, 2, ... (anchors [B,M_d] long, valid [B,M_d] bool), each valid chain's depth d-1
        row present (COD keeps chains nested); None = every row t anchors a chain of all K-1 depths.
        -> [logits of depth 0 [B,T,V'], then per depth d [B,M_d,V'] (with chains None: [B,T,V'], row t = anchor t,
        predicting x_{t+2+d})]."""
        B, T = next_tokens.shape
        dev = next_tokens.device
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.long, device=dev)
        if chains is None:
            every = torch.arange(T, device=dev).expand(B, T)
            chains = [(every, torch.ones(B, T, dtype=torch.bool, device=dev))] * (self.num_drafts - 1)
        kv = self.new_cache().kv
        dt = self.head_dtype
        out = [self._rows(features, next_tokens, torch.arange(T, device=dev).expand(B, T),
                          causal_mask_4d(attention_mask, dt), kv)]
        keys = [(torch.arange(T, device=dev).expand(B, T), attention_mask.bool())]  # per cached block: anchor, valid
        for d, (anchors, valid) in enumerate(chains, start=1):
            M = anchors.shape[1]
            parts = [(keys[0][0][:, None, :] <= anchors[:, :, None]) & keys[0][1][:, None, :]]  # depth 0, s <= a
            parts += [(ka[:, None, :] == anchors[:, :, None]) & kv_ok[:, None, :] for ka, kv_ok in keys[1:]]
            parts.append(torch.eye(M, dtype=torch.bool, device=dev).expand(B, M, M))  # itself (anchors distinct)
            allowed = torch.cat(parts, dim=-1)[:, None]  # [B,1,M,T+M_1+...+M_d]
            mask = torch.zeros(allowed.shape, dtype=dt, device=dev).masked_fill(~allowed, torch.finfo(dt).min)
            feats, toks = self._mask_inputs(B, M, dev)
            out.append(self._rows(feats, toks, anchors + d, mask, kv))
            keys.append((anchors, valid))
        return out

    # ----- inference: the block drafter's head interface (infer/drafters/peagle.py) -----
    def new_cache(self) -> PEagleCache:
        from transformers import DynamicCache

        return PEagleCache(DynamicCache(config=self.layer_config))

    def extend_context(self, cache: PEagleCache, features: torch.Tensor) -> None:
        """features [n, F·D] of the next cached positions; run with the next draft (their tokens come with it)."""
        cache.pending.append(features)

    @torch.no_grad()
    def draft_block(self, cache: PEagleCache, anchor_token, pick=None) -> tuple[torch.Tensor, None]:
        """The K drafts after the root `anchor_token` (= cache.ids[-1]) in ONE pass -> (logits [K,V'], None: no
        confidence head). The pass holds the pending true rows t (f_t, x_{t+1}) and K-1 mask rows at the positions
        after them, causally; the true rows stay cached, the mask rows are dropped. No draft reads an earlier one,
        so `pick` (a sampler's drawn token) changes nothing: each draft is drawn from its own row."""
        ids, c, K = cache.ids, cache.length, self.num_drafts
        assert ids is not None and len(ids) == c + 1 and ids[-1] == int(anchor_token), (c, ids and len(ids))
        p = next(self.parameters())
        if c == 0:  # no target row yet: nothing to draft from (uniform rows; verification decides)
            return torch.zeros(K, self.config.out_vocab, dtype=p.dtype, device=p.device), None
        feats = torch.cat(cache.pending) if cache.pending else torch.zeros(0, self.mask_hidden.shape[-1])
        n, r = int(feats.shape[0]), cache.rows
        mf, mt = self._mask_inputs(1, K - 1, p.device)
        feats = torch.cat([feats.to(p.device, p.dtype)[None], mf.to(p.dtype)], dim=1)  # [1,N,F·D]
        toks = torch.cat([torch.tensor(ids[r + 1:c + 1], dtype=torch.long, device=p.device)[None], mt], dim=1)  # [1,N]
        N = n + K - 1
        allowed = torch.cat([torch.ones(N, r, dtype=torch.bool), torch.ones(N, N, dtype=torch.bool).tril()], 1)
        mask = torch.zeros(allowed.shape, dtype=p.dtype).masked_fill_(~allowed, torch.finfo(p.dtype).min)
        pos = torch.arange(r, c + K - 1, device=p.device)[None]
        logits = self._rows(feats, toks, pos, mask[None, None].to(p.device), cache.kv)[0]  # [N,V']
        select_columns(cache.kv, torch.arange(c))  # keep the true rows only
        if n:
            cache.last = logits[n - 1]
        cache.rows, cache.pending = c, []
        return torch.cat([cache.last[None], logits[n:]]), None

    def draft_blocks(self, caches: list[PEagleCache], anchor_tokens: list[int], pick=None):
        """draft_block per row -> (logits [R,K,V'], None); rows differ in their pending rows, one pass each."""
        return torch.stack([self.draft_block(c, a)[0] for c, a in zip(caches, anchor_tokens)]), None


KIND = register_kind(KindSpec(
    name="peagle", head=PEagleHead, family="block", label="a P-EAGLE head", feature_layers=fused_layers, bias=False,
    default_loss="kl",  # speculators' P-EAGLE compute_metrics: kl_div over every sampled row
    num_drafts=lambda spec: spec.options.num_depths, mask_token=True, train_step="specheads.train.kinds.peagle:KIND",
    drafter="specheads.infer.drafters.peagle:KIND", formats=("speculators",), options=PEagleOptions,
    writers={"speculators": "specheads.heads.export.peagle:write_peagle"},
    unread_by={"speculators/vllm": "vLLM 0.34 refuses P-EAGLE (speculators/algos.py update_peagle: 'P-EAGLE "
                                   "(parallel drafting EAGLE-3) is not supported'); 0.32-0.33 served it through "
                                   "PeagleLlamaForCausalLM, which is not checked here"},
    needs_target=speculators_needs_target,
    example={"num_layers": 2, "mask_token_id": 5, "peagle": {"num_depths": 4}},
    not_drafted="the pinned converter (llama.cpp 0c1e570) maps no P-EAGLE model: its EAGLE-3 graph drafts one token "
                "per pass and has no mask_hidden / mask-token rows"))
