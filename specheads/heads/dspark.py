"""DSpark head (Cheng et al. 2026, "DSpark: Confidence-Scheduled Speculative Decoding with Semi-Autoregressive
Generation", arXiv:2607.05147; training code deepseek-ai/DeepSpec) on the DFlash block drafter. `markov_rank: 0`
with `confidence_head: false` is plain DFlash (docs/training.md, "DSpark and DFlash").

A block of K slots drafts the tokens after an anchor in ONE forward. With the context x_0..x_{p-1} verified and
x_p the anchor (the last emitted token: the bonus token at serving), the slots sit at positions p..p+K-1 and hold
[x_p, m, ..., m] (m = mask token, embedded by the frozen target embedding E):

    c_t  = RMSNorm_h( W_fc · [ h_t^(l1) ; ... ; h_t^(lF) ] )            t < p     fused target features (as EAGLE-3)
    z^0  = E([x_p, m, ..., m])                                          [K, D]
    z^i  = Layer_i(z^{i-1}; keys/values = [ k_i(c_{<p}) ; k_i(z^{i-1}) ])   each layer injects the target context
    h    = RMSNorm(z^n)                                                  [K, D]
    U_k  = W_lm · h_k                                                    base logits over the draft vocab V'

Attention (DFlash / speculators `create_anchor_block_mask_mod`): a slot attends to the context rows t < p (keys and
values projected from c_t by each layer's own k/v projections, RoPE at position t) and to ALL K slots of its own
block (bidirectional), never to another block. Qwen3-style layers (q/k RMSNorm per head), sized from the target.

Markov head (sequential stage): draft k's logits add a low-rank bias of the previous token in the block,

    vanilla: B_k = W2 · W1[x_{k-1}]                W1: [V, r] (target ids), W2: r -> V'
    gated:   B_k = W2 · (σ(G [h_k ; W1[x_{k-1}]] + g) ⊙ W1[x_{k-1}])
    rnn:     s_k = a ⊙ s_{k-1} + (1-a) ⊙ tanh(u),  B_k = W2 · tanh(o),
             [a; u; o] = J [s_{k-1} ; W1[x_{k-1}] ; h_k] + j      (s_0 = 0)

    p_k(v) = softmax(U_k + B_k)(v),   x_{k-1} = the anchor for the first draft, else the previous draft (greedy
    argmax at inference, the data's token in training: teacher forcing)

Confidence head: c_k = σ( z_k / T_k + β_k ), z_k = w · [h_k ; W1[x_{k-1}]] + b, the probability that draft k is
accepted given drafts < k were; T_k = 1 and β_k = 0 in training, fitted per position on held-out data afterwards
(Platt scaling on the rows where drafts < k were accepted: train/evaluate.py, `fit_platt`) and stored as the
buffers `conf_temperature` and `conf_bias` (folders saved without `conf_bias` load with β = 0).

Slots and drafts. `sample_from_anchor: true` (DSpark, DeepSpec): slot k predicts x_{p+k+1}, K drafts.
`false` (DFlash, speculators' dflash): slot 0 is only the anchor, slot k >= 1 predicts x_{p+k}, K-1 drafts. Either
way draft j predicts x_{p+1+j}, its Markov input is x_{p+j}, and the target's distribution for it is the target's
next-token distribution at row p+j. In the training alignment (docs/architecture.md) a block anchored at p is
"row t = p-1": draft j at row t predicts token t+2+j, like EAGLE-3's step j.

What the anchor row sees, and why: the anchor x_p was emitted by the target from row p-1 and has not been run
through the target yet, so its own target feature h_p does not exist at draft time. The block therefore reads the
target's features of rows 0..p-1 only (keys/values), and x_p only through its embedding in slot 0. After
verification the target has computed the features of x_p and of the accepted drafts: they are appended to the
context cache as true rows, and the bonus token becomes the next anchor.

Anchor-reads-features variant (`head.dspark.anchor_features: true`; not the reference design, no engine runs it).
In the reference the last target state c_{p-1} reaches the block only as one key/value among the p context rows, while
EAGLE-3's row reads [E(x_{t+1}) ; g_t] directly (and P-EAGLE's depth-0 row likewise, its later depths a learned
mask vector). The variant puts c_{p-1} into the anchor slot's input, the slots after it unchanged:

    z^0_0 = E(x_p) + W_a · c_{p-1}        W_a: D -> D, no bias, zero at init (the head starts as the reference)
    z^0_k = E(m)                           k >= 1: the mask slots, which read the anchor slot by attention

c_{p-1} is the same fused row the context keys are projected from (shared W_fc, RMSNorm_h). Only the anchor
slot: the first draft is where the reference trails EAGLE-3 most (issue 19's calibration run: top-1 0.22 vs 0.30),
EAGLE-3 and P-EAGLE give target features to their first position only, and bidirectional attention hands every
mask slot the enriched anchor row as one key/value in the first layer. With no context row (p = 0, inference
only: training anchors start at 1) c_{-1} = 0, the reference input.

The lm_head over a draft vocabulary holds the target's lm_head rows of `d2t`, frozen (speculators and DeepSpec keep
it frozen), saved so exports need no target; without a draft vocabulary the target's lm_head is used by reference.
Tensor names follow speculators' DFlashDraftModel / DSparkDraftModel (`fc`, `hidden_norm`, `layers.i.*`, `norm`,
`lm_head`, `markov_head.markov_w1/w2`, `confidence_head.proj`), so heads/export.py renames nothing; the variant's
`anchor_proj` has no counterpart there, and its exports are refused.
Shapes: B batch, T sequence, A anchors (blocks), K slots, K' drafts, D hidden, V vocab, V' draft vocab, S context.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from torch import nn

from specheads.heads.base import DraftHead, HeadConfig, fused_layers
from specheads.heads.kinds import KindSpec, register_kind
from specheads.utils import SpecheadsError
from specheads.heads.eagle import RotaryCache
from specheads.target import full_attention_rope

@dataclass
class BlockOptions:
    """head.dspark: the DSpark / DFlash block drafter's own settings (docs/training.md "DSpark"), which the block
    kinds built on it extend (Domino, DSpine, DFlash2, LiLiCorr). DFlash = markov_rank 0 and confidence_head false:
    the same head without its two small heads."""

    FLAT_KEYS: ClassVar[dict[str, str]] = {}  # old flat head: key -> field, where one was renamed (heads/headspec.py)
    # field -> its range (utils.check_values rules), checked by headspec.check_options for every block kind; a
    # kind's class adds its own. block_size >= 2 without sample_from_anchor: check_block
    LIMITS: ClassVar[dict[str, str]] = {"block_size": ">=1", "markov_rank": ">=0"}
    block_size: int = 7  # K slots per block incl. the anchor (DeepSpec dspark_qwen3_4b: 7; speculators' default 8)
    markov_rank: int = 256  # r of the Markov logit bias W2·W1[x_prev] (DeepSpec / speculators: 256); 0 = none
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"  # DeepSpec default vanilla
    confidence_head: bool = True  # per-draft acceptance predictor c_k (DeepSpec / speculators: on)
    confidence_with_markov: bool = True  # c_k reads [h_k ; W1[x_{k-1}]] (needs markov_rank > 0), else h_k only
    sample_from_anchor: bool = True  # slot 0 (the anchor) drafts too: K drafts (DSpark); false: K-1 (DFlash)
    # The anchor slot also reads the fused target features of the last context row, E(x_p) + W_a c_{p-1} (as
    # EAGLE-3's row reads [E(x_{t+1}); g_t]); false = the reference DSpark / DFlash design, which every engine runs.
    anchor_features: bool = False


DSparkOptions = BlockOptions  # the dspark kind's own section is the block family's


@dataclass
class OwnStageOptions(BlockOptions):
    """BlockOptions as the DFlash-lineage kinds with a sequential stage of their own are built (DFlash2's selector,
    Domino's GRU, DSpine's injection, LiLiCorr's lattice): none of DSpark's Markov and confidence heads, so
    `head.kind=<kind>` alone is a valid head (each kind's check refuses them: refuse_block_extras and its own)."""

    markov_rank: int = 0  # the kind's own stage is the sequential one: no Markov bias
    confidence_head: bool = False  # none (Domino may train one reading h_j: set confidence_with_markov false)
    confidence_with_markov: bool = False  # no Markov head to read


LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta",
              "rope_scaling", "initializer_range")


def block_layer_config(target_config: dict, num_layers: int, vocab_size: int):
    """A Qwen3Config with the target's sizes and `num_layers` layers: what speculators builds for DFlash / DSpark
    (its transformer_layer_config) and what our layers are sized from."""
    from transformers import Qwen3Config

    d = {k: target_config[k] for k in LAYER_KEYS if target_config.get(k) is not None}
    d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    if "rope_parameters" in d:  # the block attends the whole context: the full-attention layers' RoPE
        d["rope_parameters"] = full_attention_rope(d["rope_parameters"])
    cfg = Qwen3Config(**d, num_hidden_layers=num_layers, vocab_size=vocab_size, tie_word_embeddings=False,
                      attention_bias=False, use_sliding_window=False, layer_types=["full_attention"] * num_layers)
    return cfg


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., hd] rotated by cos/sin broadcast to it (the rotate-half convention of Llama / Qwen3)."""
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    return x * cos + rotate_half(x) * sin


class BlockAttention(nn.Module):
    """Queries from the block; keys/values = the target context (projected here) then the block itself."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        D, self.H, self.Hkv, self.hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(D, self.H * self.hd, bias=False)
        self.k_proj = nn.Linear(D, self.Hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(D, self.Hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.H * self.hd, D, bias=False)
        self.q_norm = Qwen3RMSNorm(self.hd, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, eps=cfg.rms_norm_eps)
        self.causal = False  # slots read every slot of their block (DFlash); True: slot k reads slots <= k (DSpine)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., N, D] -> keys (normed, rotated) and values [..., Hkv, N, hd]; cos/sin [..., N, hd]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.Hkv, self.hd))).transpose(-2, -3)
        v = self.v_proj(x).unflatten(-1, (self.Hkv, self.hd)).transpose(-2, -3)
        return _rope(k, cos.unsqueeze(-3), sin.unsqueeze(-3)), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, allowed):
        """x [B,A,K,D] (input-normed), cos/sin [B,A,K,hd], ctx_k/ctx_v [B,Hkv,S,hd], allowed [B,A,S] bool (the
        context rows each block may read) -> [B,A,K,D]."""
        B, A, K, _ = x.shape
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.H, self.hd))).transpose(-2, -3)  # [B,A,H,K,hd]
        q = _rope(q, cos.unsqueeze(-3), sin.unsqueeze(-3)).permute(0, 2, 1, 3, 4)  # [B,H,A,K,hd]
        kb, vb = (t.permute(0, 2, 1, 3, 4) for t in self.kv(x, cos, sin))  # [B,Hkv,A,K,hd]
        g = self.H // self.Hkv  # GQA: query head h reads kv head h // g (HF repeat_kv order)
        ck, cv = ctx_k.repeat_interleave(g, 1), ctx_v.repeat_interleave(g, 1)
        kb, vb = kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)
        scale, dt = self.hd ** -0.5, q.dtype
        if dt == torch.bfloat16 and q.device.type == "cpu":  # PyTorch's CPU bf16 batched products are ~10x slower
            q, ck, cv, kb, vb = (t.float() for t in (q, ck, cv, kb, vb))  # than fp32's at these sizes (a served head)
        s_ctx = torch.einsum("bhakd,bhsd->bhaks", q, ck) * scale  # [B,H,A,K,S]
        s_ctx = s_ctx.masked_fill(~allowed[:, None, :, None, :], float("-inf"))
        s_blk = torch.einsum("bhakd,bhajd->bhakj", q, kb) * scale  # [B,H,A,K,K]: bidirectional in the block
        if self.causal:  # ... or causal: slot k reads slots j <= k only
            s_blk = s_blk.masked_fill(torch.ones(K, K, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        p = torch.softmax(torch.cat([s_ctx, s_blk], -1).float(), dim=-1).to(q.dtype)
        S = ck.shape[-2]
        out = torch.einsum("bhaks,bhsd->bhakd", p[..., :S], cv) + torch.einsum("bhakj,bhajd->bhakd", p[..., S:], vb)
        return self.o_proj(out.to(dt).permute(0, 2, 3, 1, 4).flatten(-2))  # [B,A,K,H*hd] -> [B,A,K,D]


class BlockLayer(nn.Module):
    """Pre-norm residual layer: x + Attn(norm(x)), then + MLP(norm(.)) (Qwen3 layout, speculators' names)."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        self.self_attn = BlockAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, allowed):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """The sequential stage: a low-rank logit bias from the previous token (equations in the module docstring)."""

    def __init__(self, vocab_size: int, draft_vocab: int, rank: int, hidden: int, kind: str):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # indexed by TARGET ids (the previous token)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # speculators' MarkovHead init: the bias starts near 0
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] target ids -> W1[prev] [..., r] (one lookup for a whole block: one W1 gradient)."""
        return self.markov_w1(prev).to(self.markov_w2.weight.dtype)

    def step(self, e: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None):
        """e = W1[x_prev] [..., r], h [..., D] -> (bias [..., V'], state [..., r] or None). vanilla / gated are
        position-wise (any leading shape, e.g. all drafts at once); rnn carries `state` from draft to draft."""
        if self.kind == "vanilla":
            return self.markov_w2(e), None
        h = h.to(e.dtype)
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e), None
        if state is None:
            state = torch.zeros_like(e)
        a, u, o = self.joint_proj(torch.cat([state, e, h], -1)).chunk(3, dim=-1)
        a = torch.sigmoid(a)
        return self.markov_w2(torch.tanh(o)), a * state + (1.0 - a) * torch.tanh(u)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).squeeze(-1)


@dataclass
class BlockContext:
    """The target context the blocks read: per layer (keys normed and rotated, values) [B,Hkv,S,hd], and with
    head.dspark.anchor_features the fused rows c [B,S,D] (the anchor slot reads c_{p-1}). Reads as the list of
    layers."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    fused: torch.Tensor | None = None

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]


@dataclass
class BlockCache:
    """The head's context at inference: per layer, keys (normed, rotated) and values of the TRUE context rows
    [B,Hkv,S,hd]; row i has position i. Only verified rows are appended, so nothing is ever rolled back."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    fused: torch.Tensor | None = None  # [B,S,D] fused rows c, kept only for head.dspark.anchor_features
    ids: list[int] | None = None  # the sequence so far, set by the drafter (BlockHead caches carry it; unread here)

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0


class DSparkHead(DraftHead):
    kind = "dspark"
    defaulted_keys = ("conf_bias",)  # buffers older folders lack: loaded as initialised (β = 0)

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        s, D, F = self.spec, config.hidden_size, len(config.feature_layers)
        self.layer_config = cfg = block_layer_config(config.target_config, s.num_layers, config.vocab_size)
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        self.fc = nn.Linear(F * D, D, bias=False)
        self.hidden_norm = Qwen3RMSNorm(D, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(s.num_layers))
        self.norm = Qwen3RMSNorm(D, eps=cfg.rms_norm_eps)
        for m in self.modules():  # HF's _init_weights for the backbone: normal(0, initializer_range)
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.initializer_range)
        if config.draft_vocab_size:  # the target's rows of d2t, frozen (init_from_target fills them)
            self._modules["lm_head"] = nn.Linear(D, config.out_vocab, bias=False).requires_grad_(False)
        o = s.options
        self.markov_head = MarkovHead(config.vocab_size, config.out_vocab, o.markov_rank, D, o.markov_head_type) \
            if s.options.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(D + (s.options.markov_rank if s.options.confidence_with_markov else 0)) \
            if s.options.confidence_head else None
        self.register_buffer("conf_temperature", torch.ones(s.num_drafts))  # T_k, fitted after training
        self.register_buffer("conf_bias", torch.zeros(s.num_drafts))  # β_k, fitted with T_k
        self._rope = RotaryCache(Qwen3RotaryEmbedding(cfg))
        self.mask_token_id = int(s.mask_token_id)
        self.slot0 = 0 if s.options.sample_from_anchor else 1  # the slot of draft 0
        self.anchor_proj = None
        if s.options.anchor_features:  # built last: the other modules draw the same initial weights as the reference's
            self.anchor_proj = nn.Linear(D, D, bias=False)
            nn.init.zeros_(self.anchor_proj.weight)  # W_a = 0: the reference design at init

    @property
    def lm_head(self) -> nn.Module:
        return self._modules["lm_head"] if self.config.draft_vocab_size else self._get_frozen("lm_head")

    @property
    def num_drafts(self) -> int:
        return self.spec.num_drafts

    def init_from_target(self) -> None:
        """The frozen lm_head over the draft vocab = the target lm_head's rows of d2t."""
        if self.config.draft_vocab_size:
            with torch.no_grad():
                w = self._get_frozen("lm_head").weight[self.d2t.to(self._get_frozen("lm_head").weight.device)]
                self.lm_head.weight.copy_(w.to(self.lm_head.weight.dtype))

    def _base_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h) if self.config.draft_vocab_size else self.target_lm_logits(h)

    # ----- the backbone (shared by training and inference) -----
    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., F*D] (feature layers concatenated in config order) -> c [..., D]."""
        return self.hidden_norm(self.fc(features.to(self.head_dtype)))

    def context_kv(self, features: torch.Tensor, start: int = 0) -> BlockContext:
        """features [B,N,F*D] of context rows start..start+N-1 -> per layer (keys, values) [B,Hkv,N,hd] (+ the
        fused rows [B,N,D] with head.dspark.anchor_features)."""
        c = self.project_features(features)
        pos = torch.arange(start, start + c.shape[1], device=c.device).expand(c.shape[0], -1)
        cos, sin = self._rope(c, pos)
        return BlockContext([layer.self_attn.kv(c, cos.to(c.dtype), sin.to(c.dtype)) for layer in self.layers],
                            c if self.anchor_proj is not None else None)

    def _anchor_input(self, ctx: BlockContext, anchors: torch.Tensor) -> torch.Tensor:
        """W_a c_{p-1} [B,A,D] for blocks anchored at anchors [B,A] (0 where p = 0: no context row)."""
        c = ctx.fused
        if c is None:
            raise RuntimeError("DSparkHead: head.dspark.anchor_features needs the fused rows (context_kv's "
                               "BlockContext)")
        if c.shape[1] == 0:
            return c.new_zeros(*anchors.shape, c.shape[-1])
        rows = (anchors - 1).clamp(min=0)
        g = c.gather(1, rows.unsqueeze(-1).expand(-1, -1, c.shape[-1]))  # [B,A,D]: c_{p-1}
        return self.anchor_proj(g * (anchors >= 1).unsqueeze(-1).to(g.dtype))

    def blocks(self, ctx: BlockContext, allowed: torch.Tensor, anchor_tokens: torch.Tensor, anchors: torch.Tensor):
        """ctx: context_kv(...) of S rows; allowed [B,A,S] bool; anchor_tokens [B,A] target ids at positions
        anchors [B,A] -> h [B,A,K,D] (final-normed hidden of every slot)."""
        B, A = anchors.shape
        K = self.spec.options.block_size
        ids = torch.full((B, A, K), self.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchor_tokens
        x = self.embed(ids)  # [B,A,K,D]
        if self.anchor_proj is not None:  # z^0_0 = E(x_p) + W_a c_{p-1}; the mask slots keep E(m)
            x = torch.cat([x[:, :, :1] + self._anchor_input(ctx, anchors).unsqueeze(2), x[:, :, 1:]], dim=2)
        pos = anchors[..., None] + torch.arange(K, device=anchors.device)  # [B,A,K]: slot k at position p+k
        cos, sin = self._rope(x, pos.flatten(1))
        cos, sin = (t.view(B, A, K, -1).to(x.dtype) for t in (cos, sin))
        for layer, (ck, cv) in zip(self.layers, ctx):
            x = layer(x, cos, sin, ck, cv, allowed)
        return self.norm(x)

    def heads(self, h: torch.Tensor, prev: torch.Tensor, greedy: bool = False, pick=None):
        """h [B,A,K,D] -> (logits [B,A,K',V'] incl. the Markov bias, confidence logits [B,A,K'] or None).

        prev: [B,A,K'] target ids, draft j's previous token (teacher forcing: the data's x_{p+j}); with greedy,
        [B,A] anchors only, and draft j >= 1 reads the argmax of draft j-1 (what the drafter proposes), or with
        pick(j, logits_j [B,A,V']) -> draft ids [B,A] the token pick chose for draft j (a sampling drafter)."""
        hd = h[:, :, self.slot0:]  # [B,A,K',D]: the drafting slots
        base = self._base_logits(hd)
        mk = self.markov_head
        if mk is None:
            return base, self._confidence(hd, None)
        if not greedy and mk.kind != "rnn":  # teacher-forced and position-wise: every draft at once
            e = mk.embed(prev)
            return base + mk.step(e, hd, None)[0].to(base.dtype), self._confidence(hd, e)
        e_all = None if greedy else mk.embed(prev)
        p, state = (prev if greedy else prev[..., 0]), None
        if self.slot0 and mk.kind == "rnn":  # speculators runs the rnn state over the anchor slot too
            state = mk.step(mk.embed(p), h[:, :, 0], None)[1]
        logits, embs = [], []
        for j in range(self.num_drafts):
            e = mk.embed(p) if greedy else e_all[:, :, j]
            bias, state = mk.step(e, hd[:, :, j], state)
            logits.append(base[:, :, j] + bias.to(base.dtype))
            embs.append(e)
            if greedy and pick is not None:
                p = self.to_target_ids(pick(j, logits[-1]))
            elif greedy and j + 1 < self.num_drafts:
                p = self.to_target_ids(logits[-1].argmax(-1))
        return torch.stack(logits, 2), self._confidence(hd, torch.stack(embs, 2))

    def _confidence(self, hd: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor | None:
        """c_k logits [B,A,K'] from [h_k ; W1[x_{k-1}]] (or h_k alone), before the temperatures."""
        if self.confidence_head is None:
            return None
        x = torch.cat([hd, e.to(hd.dtype)], -1) if self.spec.options.confidence_with_markov else hd
        return self.confidence_head(x)

    # ----- training -----
    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                attention_mask: torch.Tensor | None = None):
        """Teacher-forced blocks: features [B,T,F*D] (row t = target features of token t), input_ids [B,T],
        anchors [B,A] positions p (1 <= p <= T-2; padding anchors are the caller's to mask), attention_mask [B,T]
        -> (logits [B,A,K',V'], confidence logits [B,A,K'] or None); draft j of the block at p predicts
        input_ids[p+1+j] and reads input_ids[p+j] as its previous token."""
        return self.heads(*self.block_states(features, input_ids, anchors, attention_mask))

    def block_states(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                     attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's teacher-forced blocks before the output heads -> (h [B,A,K,D], prev [B,A,K'] x_{p+j})."""
        B, T = input_ids.shape
        ctx = self.context_kv(features)
        allowed = torch.arange(T, device=anchors.device) < anchors[..., None]  # [B,A,T]: rows before the anchor
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
        h = self.blocks(ctx, allowed, input_ids.gather(1, anchors), anchors)
        idx = (anchors[..., None] + torch.arange(self.num_drafts, device=anchors.device)).clamp(max=T - 1)
        prev = input_ids.gather(1, idx.flatten(1)).view(idx.shape)  # [B,A,K']: x_{p+j}
        return h, prev

    # ----- inference -----
    def new_cache(self) -> BlockCache:
        return BlockCache()

    @torch.no_grad()
    def extend_context(self, cache: BlockCache, features: torch.Tensor) -> None:
        """Append the target features [N,F*D] or [1,N,F*D] of newly verified rows (positions cache.length ...)."""
        f = features if features.dim() == 3 else features.unsqueeze(0)
        new = self.context_kv(f, start=cache.length)
        if new.fused is not None:
            cache.fused = new.fused if cache.fused is None else torch.cat([cache.fused, new.fused], 1)
        if not cache.keys:
            cache.keys, cache.values = [k for k, _ in new], [v for _, v in new]
            return
        cache.keys = [torch.cat([a, k], -2) for a, (k, _) in zip(cache.keys, new)]
        cache.values = [torch.cat([a, v], -2) for a, (_, v) in zip(cache.values, new)]

    @torch.no_grad()
    def draft_block(self, cache: BlockCache, anchor_token, pick=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block after the cached context (S rows): anchor_token (target id) at position S ->
        (logits [K',V'] with the Markov bias of the greedy chain: draft j's bias reads the argmax of draft j-1,
        the anchor for j = 0; calibrated confidences [K'] (σ(z_j / T_j + β_j)) or None). The drafted tokens are
        head.to_target_ids(logits.argmax(-1)). pick(j, logits_j [1,1,V']) -> draft ids [1,1]: the token chosen
        for draft j instead of its argmax (sampling), read by draft j+1's Markov bias (called for every draft
        when the head has a Markov head)."""
        logits, conf = self.draft_blocks([cache], [int(anchor_token)], pick=pick)
        return logits[0], None if conf is None else conf[0]

    @torch.no_grad()
    def draft_blocks(self, caches: list[BlockCache], anchor_tokens: list[int], pick=None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """draft_block for B rows in ONE pass: row r's block anchored after its own S_r cached rows (the contexts
        right-padded to the longest, the padding masked) -> (logits [B,K',V'], confidences [B,K'] or None); row r
        is draft_block(caches[r], anchor_tokens[r]) up to float summation order. pick as draft_block's, over
        [B,1,V'] -> [B,1]."""
        dev = self.conf_temperature.device
        lengths = torch.tensor([c.length for c in caches], device=dev)
        S, empty = int(lengths.max()), self._empty_context(dev)

        def padded(parts: list[torch.Tensor | None], blank: torch.Tensor, dim: int) -> torch.Tensor:
            out = []
            for t in parts:  # t [1, ..., S_r, ...] along dim
                t = blank if t is None else t
                if t.shape[dim] < S:
                    shape = list(t.shape)
                    shape[dim] = S - t.shape[dim]
                    t = torch.cat([t, t.new_zeros(shape)], dim)
                out.append(t)
            return out[0] if len(out) == 1 else torch.cat(out, 0)  # one row: the cache itself, no copy

        layers = [tuple(padded([(c.keys, c.values)[j][i] if c.keys else None for c in caches], empty.layers[i][j],
                               -2) for j in (0, 1)) for i in range(len(self.layers))]  # (keys, values) [B,Hkv,S,hd]
        fused = None if empty.fused is None else padded([c.fused for c in caches], empty.fused, 1)
        allowed = (torch.arange(S, device=dev) < lengths[:, None]).unsqueeze(1)  # [B,1,S]
        anchor = torch.as_tensor(anchor_tokens, device=dev, dtype=torch.long).view(-1, 1)  # [B,1]
        h = self.blocks(BlockContext(layers, fused), allowed, anchor, lengths.view(-1, 1))
        logits, conf = self.heads(h, anchor, greedy=True, pick=pick)
        if conf is not None:
            conf = self.calibrated(conf[:, 0])
        return logits[:, 0], conf

    def calibrated(self, z: torch.Tensor) -> torch.Tensor:
        """Raw confidence logits [..., K'] (draft positions last) -> calibrated probabilities σ(z / T + β)."""
        return torch.sigmoid(z.float() / self.conf_temperature.float() + self.conf_bias.float())

    def _empty_context(self, dev) -> BlockContext:
        cfg = self.layer_config
        z = torch.zeros(1, cfg.num_key_value_heads, 0, cfg.head_dim, device=dev, dtype=self.head_dtype)
        fused = torch.zeros(1, 0, self.config.hidden_size, device=dev, dtype=self.head_dtype)
        return BlockContext([(z, z) for _ in self.layers], fused if self.anchor_proj is not None else None)


def check_block(spec) -> None:
    """The head: section of a DSpark / DFlash block head (HeadSpec): the block drafts something, the Markov and
    confidence heads fit together."""
    o = spec.options
    if o.block_size < (1 if o.sample_from_anchor else 2):
        raise SpecheadsError(f"{spec.key('block_size')}: {o.block_size} drafts nothing with sample_from_anchor "
                             f"false: must be >= 2 (the anchor slot only drafts when true)")
    if o.confidence_head and o.confidence_with_markov and o.markov_rank == 0:
        raise SpecheadsError(f"{spec.key('confidence_with_markov')}: needs {spec.key('markov_rank')} > 0 (set it "
                             f"false, or confidence_head false for plain DFlash)")


# The DSpark / DFlash block kinds' shared declaration (Domino's KindSpec replaces what differs, heads/domino.py).
BLOCK_KIND = dict(
    family="block", feature_layers=fused_layers, default_loss="soft_ce:{w_ce},l1:{w_l1}", confidence=True,
    mask_token=True, block_positions=True, exporter="specheads.heads.export.dspark:export_block_head")
KIND = register_kind(KindSpec(
    name="dspark", head=DSparkHead, label="a DSpark head", train_step="specheads.train.kinds.block:KIND",
    drafter="specheads.infer.drafters.dspark:KIND",
    options=BlockOptions, check=check_block, formats=("speculators", "specforge"),
    gguf="specheads.heads.gguf:DSPARK_DRAFT",
    example={"mask_token_id": 5, "dspark": {"block_size": 4, "markov_rank": 16}}, **BLOCK_KIND))


def refuse_block_extras(spec, label: str, stage: str, vocab_why: str) -> None:
    """What a DFlash-lineage kind with its own sequential stage (DFlash2's selector, LiLiCorr's lattice) does not
    build: DSpark's Markov and confidence heads, a draft vocabulary (vocab_why: why it needs the full one), the
    anchor-features variant."""
    o, rank, conf = spec.options, spec.key("markov_rank"), spec.key("confidence_head")
    if o.markov_rank != 0 or o.confidence_head:
        raise SpecheadsError(f"{rank} / {conf}: {label}'s {stage} is its sequential stage and it has no confidence "
                             f"head; set {rank} 0 and {conf} false")
    if spec.draft_vocab_size is not None:
        raise SpecheadsError(f"head.draft_vocab_size: {label} {vocab_why}; set it null")
    if o.anchor_features:
        raise SpecheadsError(f"{spec.key('anchor_features')}: not built for {label}")
