"""EAGLE-3 head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv:2503.01840).

The head fuses low, middle and high target layers and predicts tokens directly (no feature regression):

    g_t  = W_fc · [ h_t^(l1) ; h_t^(l2) ; h_t^(l3) ]                          W_fc: 3D -> D (no bias by default)
    a_t  = g_t + Attn( [ RMSNorm_in(E(x_{t+1})) ; RMSNorm_h(g_t) ] )        q/k/v read 2D, residual on g
    o_t  = a_t + MLP(RMSNorm_post(a_t))                                     (the "midlayer", Llama layout)
    p(x_{t+2}) = softmax( W_lm · RMSNorm_final(o_t) )                       own lm_head over the draft vocab V'

EAGLE-3.1 (speculators PR 610; speculators' Eagle3SpeculatorConfig `fc_norm` / `norm_output`), two switches, same
loss, both off = EAGLE-3 above bit for bit (same state dict keys, same outputs):
    fc_norm:     g_t = W_fc · [ RMSNorm_1(h_t^(l1)) ; RMSNorm_2(h_t^(l2)) ; RMSNorm_3(h_t^(l3)) ]
                 one RMSNorm per feature layer (weights `fc_norm.{i}.weight`, eps = the target's rms_norm_eps),
                 not one over the concatenation (speculators' separate `norm_before_fc`)
    norm_output: the state fed to the next step is RMSNorm_final(o_t) instead of o_t (its logits are unchanged:
                 p = softmax(W_lm · RMSNorm_final(o_t)) either way)

Training-time test (TTT, paper §3.2): the head is unrolled n steps (default 7). Step 0 row t reads (g_t, x_{t+1});
step i > 0 row t reads the head's own output of step i-1 (o_t, or RMSNorm_final(o_t) with norm_output) and the
ground-truth token x_{t+1+i}, at position t+i, and predicts x_{t+2+i}. Its attention sees the step-0 keys of
rows <= t plus the keys of row t at steps 1..i (its own chain), exactly what a chain of drafts below row t sees at
inference (cache = prefix rows, plus its ancestors).

Layout matches SGLang's `LlamaForCausalLMEagle3` / the EAGLE-3 repo: `fc.weight`, `midlayer.{input_layernorm,
hidden_norm,self_attn.{q,k,v,o}_proj,post_attention_layernorm,mlp.*}`, `norm.weight`, `lm_head.weight`, plus the
draft-vocab buffers; with fc_norm also `fc_norm.{i}.weight`, i in the config order of the feature layers (as
speculators names them). In those files `d2t` holds OFFSETS (target id = i + d2t[i]); in memory and in our native
folder it holds absolute target ids (heads/base.py); heads/export/ converts. The midlayer is always a Llama layer
(what SGLang / vLLM / speculators build for EAGLE-3), sized from the target's config.
Shapes: B batch, T sequence, N tree nodes, D hidden, F feature layers, V vocab, V' draft vocab, S attended length.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from specheads.heads.base import (DraftHead, HeadConfig, build_draft_vocab, causal_mask_4d,  # noqa: F401 (re-export)
                                  fused_layers, last_row)
from specheads.heads.kinds import KindSpec, register_kind
from specheads.heads.eagle import RotaryCache, build_layers
from specheads.target import full_attention_rope

LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta",
              "rope_scaling", "initializer_range")


@dataclass
class Eagle3Options:
    """head.eagle3: EAGLE-3's own settings; EAGLE-3.1's two switches (speculators' Eagle3SpeculatorConfig keys of
    the same names), both false = EAGLE-3."""

    LIMITS: ClassVar[dict[str, str]] = {"ttt_steps": ">=1"}
    ttt_steps: int = 7  # training-time-test unroll (EAGLE-3 repo default length 7)
    fc_norm: bool = False  # an RMSNorm on each captured target state before fc (one per feature layer)
    norm_output: bool = False  # the head's post-norm state feeds its next step (EAGLE-3: the pre-norm state)


EAGLE31_SWITCHES = ("fc_norm", "norm_output")  # Eagle3Options fields, named as speculators' config keys


def eagle31_switches(spec) -> list[str]:
    """The EAGLE-3.1 switches a HeadSpec turns on (empty: plain EAGLE-3, and a kind built on EAGLE-3 without its
    options, P-EAGLE)."""
    o = spec.options
    return [name for name in EAGLE31_SWITCHES if isinstance(o, Eagle3Options) and getattr(o, name)]


def eagle3_layer_config(target_config: dict, vocab_size: int, num_layers: int = 1):
    """A LlamaConfig with the target's sizes (what EAGLE-3 consumers build: one layer; P-EAGLE stacks more)."""
    from transformers import LlamaConfig

    d = {k: target_config[k] for k in LLAMA_KEYS if target_config.get(k) is not None}
    d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    if "rope_parameters" in d:  # the midlayer attends the whole context: the full-attention layers' RoPE
        d["rope_parameters"] = full_attention_rope(d["rope_parameters"])
    cfg = LlamaConfig(**d, num_hidden_layers=num_layers, vocab_size=vocab_size, tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "sdpa"
    return cfg


class Eagle3Head(DraftHead):
    kind = "eagle3"

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        D, F = config.hidden_size, len(config.feature_layers)
        self.layer_config = eagle3_layer_config(config.target_config, config.vocab_size)
        self.fc = nn.Linear(F * D, D, bias=self.spec.resolved_bias())
        layers, rotary = build_layers(self.layer_config)
        mid = layers[0]
        attn, std = mid.self_attn, self.layer_config.initializer_range
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embed ; hidden]: 2D inputs
            old = getattr(attn, name)
            new = nn.Linear(2 * D, old.out_features, bias=False)
            nn.init.normal_(new.weight, std=std)
            setattr(attn, name, new)
        mid.hidden_norm = copy.deepcopy(mid.input_layernorm)
        self.midlayer = mid
        self.norm = copy.deepcopy(mid.post_attention_layernorm)
        self._modules["lm_head"] = nn.Linear(D, config.out_vocab, bias=False)  # own projection (V', not frozen)
        self._rope = RotaryCache(rotary)
        # EAGLE-3.1: one RMSNorm per feature layer (weight 1 at init, no RNG drawn: EAGLE-3's init is unchanged)
        self.fc_norm = nn.ModuleList([LlamaRMSNorm(D, eps=self.layer_config.rms_norm_eps) for _ in range(F)]) \
            if "fc_norm" in eagle31_switches(self.spec) else None
        self.norm_output = "norm_output" in eagle31_switches(self.spec)

    @property
    def lm_head(self) -> nn.Linear:  # the head's own projection over V' (not the target's)
        return self._modules["lm_head"]

    def init_from_target(self) -> None:
        """lm_head starts as the target lm_head rows of the draft vocab (a good start; training moves it)."""
        w = self._get_frozen("lm_head").weight
        if self.d2t is not None:
            w = w[self.d2t]
        with torch.no_grad():
            self.lm_head.weight.copy_(w.to(self.lm_head.weight.dtype))

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.layer_config)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., F*D] (the feature layers concatenated in config order) -> [..., D]; with fc_norm each
        layer's [..., D] block is normalised by its own RMSNorm first."""
        x = features.to(self.head_dtype)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def _midlayer(self, hidden, tokens, pe, mask, cache) -> torch.Tensor:
        """The midlayer (decoder layer 0) over [E(x_{t+1}) ; g_t]: hidden [B,N,D], tokens [B,N], pe the rotary
        (cos, sin) of their positions -> its pre-norm output [B,N,D] (the residual stream starts at g)."""
        mid = self.midlayer
        x = torch.cat([mid.input_layernorm(self.embed(tokens)), mid.hidden_norm(hidden)], dim=-1)  # [B,N,2D]
        a, _ = mid.self_attn(hidden_states=x, attention_mask=mask, position_embeddings=pe, cache=cache)
        h = hidden + a
        return h + mid.mlp(mid.post_attention_layernorm(h))

    def _step(self, hidden, tokens, position_ids, mask, cache, last_only: bool = False):
        """One midlayer pass: hidden [B,N,D], tokens [B,N] -> (the state the next step reads [B,N,D]: pre-norm, or
        post-norm with norm_output; logits [B,N,V'] or, with last_only, [B,1,V'] of the last row only)."""
        hidden = hidden.to(self.head_dtype)
        h = self._midlayer(hidden, tokens, self._rope(hidden, position_ids), mask, cache)
        if self.norm_output:  # the post-norm state is both the next step's input and the logits' input
            h = self.norm(h)
            return h, self.lm_head(last_row(h) if last_only else h)
        return h, self.lm_head(self.norm(last_row(h) if last_only else h))

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                steps: int | None = None, pad_token_id: int = 0) -> list[torch.Tensor]:
        """Training with TTT: features [B,T,F*D], next_tokens [B,T] (x_{t+1}), attention_mask [B,T] (right padding)
        -> list of `steps` logits [B,T,V']; step i row t predicts x_{t+2+i} (rows past the end read pad tokens)."""
        n = steps or self.spec.options.ttt_steps
        B, T = next_tokens.shape
        dev, dt = next_tokens.device, self.head_dtype
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.long, device=dev)
        hidden = self.project_features(features)  # [B,T,D]
        first = causal_mask_4d(attention_mask, dt)  # [B,1,T,T]: step-0 keys, causal
        eye = torch.eye(T, dtype=torch.bool, device=dev)
        diag = torch.zeros(T, T, dtype=dt, device=dev).masked_fill(~eye, torch.finfo(dt).min).expand(B, 1, T, T)
        cache = self.new_cache()
        out = []
        for i in range(n):
            tokens = next_tokens if i == 0 else torch.cat(
                [next_tokens[:, i:], next_tokens.new_full((B, min(i, T)), pad_token_id)], dim=1)[:, :T]
            pos = (torch.arange(T, device=dev) + i).expand(B, T)
            mask = torch.cat([first] + [diag] * i, dim=-1)  # [B,1,T,(i+1)T]
            hidden, logits = self._step(hidden, tokens, pos, mask, cache)
            out.append(logits)
        return out

    def draft_forward(self, hidden, tokens, position_ids, attention_mask, cache, last_only: bool = False):
        """Inference: hidden [B,N,D] (project_features output for target rows, the head's own output below),
        tokens [B,N], position_ids [B,N], attention_mask [B,1,N,S] float, cache -> (hidden [B,N,D] for the next
        step: pre-norm, post-norm with norm_output; logits [B,N,V'], or [B,1,V'] for the last row with last_only);
        appends N entries to `cache`."""
        return self._step(hidden, tokens, position_ids, attention_mask.to(self.head_dtype), cache, last_only)


def speculators_needs_target(fmt: str, cfg: HeadConfig) -> bool:
    """speculators reads the token embedding from the checkpoint: its export carries the target's
    (export/common.py target_embedding)."""
    return fmt == "speculators"


KIND = register_kind(KindSpec(
    name="eagle3", head=Eagle3Head, family="tree", label="an EAGLE-3 head", feature_layers=fused_layers, bias=False,
    default=True,  # a head: section without `kind` builds EAGLE-3 (the field's most used drafter)
    train_step="specheads.train.kinds.eagle3:KIND", drafter="specheads.infer.drafters.eagle:EAGLE3_KIND",
    options=Eagle3Options,
    formats=("eagle3", "speculators"), needs_target=speculators_needs_target,
    gguf="specheads.heads.eagle3_gguf:EAGLE3_DRAFT",
    example={"draft_vocab_size": 100}))
