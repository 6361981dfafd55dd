"""EAGLE head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
arXiv:2401.15077), drafted with EAGLE-2's dynamic trees (Li et al. 2024, arXiv:2406.16858).

The head autoregresses at the feature level. Row t pairs the target's final (post-norm) feature f_t with the embedding
of the token sampled from it, x_{t+1}, and predicts the next feature and, through the frozen target lm_head, the token
after (paper §4.1):

    g_t      = W_fc · [ E(x_{t+1}) ; f_t ] (+ b_fc),      W_fc: 2D -> D   (embedding first, as in the EAGLE repo)
    f̂_{t+1} = DecoderLayer(g_{≤t})                        (one layer of the TARGET's own architecture)
    p(x_{t+2}) = softmax( LM_head(f̂_{t+1}) )

The decoder layer is built from the target's config (copied with num_hidden_layers = num_layers) by transformers'
own model class, so no modelling code is copied per architecture; its first input norm is replaced by Identity as in
EAGLE (the features are already normalised). Rotary embedding from the same config. Parameter names match the EAGLE-1
repo checkpoints (`fc.weight`, `fc.bias`, `layers.0.*`).

Positions: head row t has position id t (the index of f_t). A draft node at tree depth d below row t gets t + d.
Shapes: B batch, T sequence, N tree nodes, D hidden, V vocab, V' draft vocab, S attended length (cache + new).
"""
from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from specheads.heads.base import DraftHead, HeadConfig, causal_mask_4d, final_layer, last_row
from specheads.heads.kinds import KindSpec, register_kind


def decoder_config(target_config: dict, num_layers: int):
    """A copy of the target's text config with `num_layers` layers and a tiny vocab (the head never embeds by itself)."""
    from transformers import AutoConfig

    d = copy.deepcopy(dict(target_config))
    model_type = d.pop("model_type")
    for k in ("transformers_version", "architectures", "_name_or_path", "auto_map"):
        d.pop(k, None)
    if isinstance(d.get("layer_types"), list):  # the head attends the whole context (tree masks): full layers
        d["layer_types"] = ["full_attention"] * num_layers
    d.update(num_hidden_layers=num_layers, vocab_size=8, pad_token_id=None, tie_word_embeddings=False)
    cfg = AutoConfig.for_model(model_type, **d)
    cfg._attn_implementation = "sdpa"  # honours our 4D float masks; eager gives the same numbers, slower
    return cfg


def build_layers(cfg) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layers and rotary embedding of transformers' own model class for `cfg` (initialised its way)."""
    from transformers import AutoModel

    model = AutoModel.from_config(cfg, attn_implementation="sdpa")
    layers = getattr(model, "layers", None)
    rotary = getattr(model, "rotary_emb", None)
    if layers is None or rotary is None:
        from specheads.utils import SpecheadsError

        raise SpecheadsError(f"target model_type {cfg.model_type!r}: no `layers` / `rotary_emb` in "
                             f"{type(model).__name__}; EAGLE heads need a decoder-only rotary model")
    return layers, rotary


class RotaryCache:
    """Holds the config's rotary embedding OUTSIDE the module tree: it stays float32 when the head is cast to bf16
    (HF casts inv_freq otherwise) and follows the input's device lazily."""

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary.float()
        # RoPE per layer type (Gemma 3) takes the layer type: the head's layers are full attention
        self.args = ("full_attention",) if "layer_type" in inspect.signature(rotary.forward).parameters else ()

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor):
        buf = next(self.rotary.buffers())
        if buf.device != x.device:
            self.rotary.to(x.device)
        return self.rotary(x, position_ids, *self.args)


class EagleHead(DraftHead):
    kind = "eagle"

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        D = config.hidden_size
        self.layer_config = decoder_config(config.target_config, self.spec.num_layers)
        self.fc = nn.Linear(2 * D, D, bias=self.spec.resolved_bias())
        layers, rotary = build_layers(self.layer_config)
        self.layers = layers
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE drops the first input norm
        self._rope = RotaryCache(rotary)

    def new_cache(self):
        """An empty KV cache for the head's own decoder layers."""
        from transformers import DynamicCache

        return DynamicCache(config=self.layer_config)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., F*D] with F = 1 -> [..., D] (identity; EAGLE-1 reads the final state only)."""
        return features.to(self.head_dtype)

    def _run(self, hidden, tokens, position_ids, mask, cache, last_only: bool = False):
        x = self.fc(torch.cat([self.embed(tokens), hidden.to(self.head_dtype)], dim=-1))  # [B,T,D]
        pe = self._rope(x, position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=cache is not None,
                      position_embeddings=pe)
            if isinstance(x, tuple):
                x = x[0]
        return x, self.target_lm_logits(last_row(x) if last_only else x)

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Training: features [B,T,D] (f_t), next_tokens [B,T] (x_{t+1}), attention_mask [B,T] (right padding)
        -> (pred_hidden [B,T,D] ≈ f_{t+1}, logits [B,T,V'] for x_{t+2})."""
        B, T = next_tokens.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.long, device=next_tokens.device)
        pos = torch.arange(T, device=next_tokens.device).expand(B, T)
        mask = causal_mask_4d(attention_mask, self.head_dtype)  # [B,1,T,T]
        return self._run(self.project_features(features), next_tokens, pos, mask, None)

    def draft_forward(self, hidden, tokens, position_ids, attention_mask, cache, last_only: bool = False):
        """Inference: hidden [B,N,D], tokens [B,N], position_ids [B,N], attention_mask [B,1,N,S] float (0 attend,
        -inf not; S = cached + N), cache from new_cache() -> (hidden [B,N,D], logits [B,N,V'], or [B,1,V'] for the
        last row only with last_only: the drafter reads only that row after feeding newly accepted rows);
        appends N entries."""
        return self._run(hidden, tokens, position_ids, attention_mask.to(self.head_dtype), cache, last_only)


KIND = register_kind(KindSpec(
    name="eagle", head=EagleHead, family="tree", label="an EAGLE head", feature_layers=final_layer,
    final_state_only=True, train_step="specheads.train.kinds.eagle:KIND",
    drafter="specheads.infer.drafters.eagle:EAGLE_KIND", formats=("eagle", "eagle-vllm")))
