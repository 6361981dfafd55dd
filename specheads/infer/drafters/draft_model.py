"""Draft-model speculative decoding (Leviathan et al. 2023, Chen et al. 2023): an independent small causal LM
drafts a chain with its own KV cache; without a separate model, the target's first layers serve as the draft."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.kvcache import drop_tail
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.tree import DraftTree, chain_tree
from specheads.infer.treespec import TreeSpec
from specheads.infer.verify import target_probs
from specheads.target import load_target
from specheads.utils import SpecheadsError


class DraftModelDrafter(Drafter):
    """An independent small causal LM drafts a chain of k tokens with its own KV cache (seed papers' speculative
    decoding). Greedy: argmax chain, verified as point masses. Sampling: tokens drawn from the draft's own warped
    distribution q (same temperature / top-p / top-k), q recorded in the tree so verification stays lossless."""
    name = "draft-model"

    def __init__(self, model, num_tokens: int = 4):
        model = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model  # Target ok
        self.model, self.k = model, num_tokens  # k: chain length (draft forwards per step)
        self.cache = None
        self.cached: list[int] = []  # tokens whose keys/values are in self.cache

    def reset(self, prompt_ids, features=None) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.cached = []

    def _forward(self, new: list[int]) -> torch.Tensor:
        dev = next(self.model.parameters()).device
        pos = torch.arange(len(self.cached), len(self.cached) + len(new), device=dev)[None]
        # logits of the last row only, asked for by index: HF's logits_to_keep=1 slices hidden[:, -1:], a strided
        # input on which torch's CPU bf16 linear is ~15x slower (heads/base.py last_row); an index gathers a copy
        keep = torch.tensor([len(new) - 1], device=dev)
        out = self.model(input_ids=torch.tensor([new], device=dev), position_ids=pos, cache=self.cache,
                         use_cache=True, logits_to_keep=keep)
        self.cached += new
        return out.logits[0, -1].float()  # [V]

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        if self.cache is None:
            self.reset(None)
        ids, k = ctx.ids, min(self.k, ctx.max_depth)
        common = 0  # longest common prefix of what is cached and the context (rejected drafts are cropped)
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # the root's logits are needed, so at least it is fed again
        if common < len(self.cached):
            drop_tail(self.cache, len(self.cached) - common)
            self.cached = self.cached[:common]
        if k <= 0:
            return chain_tree(ids[-1], [])
        logits = self._forward(ids[common:])
        drafts, qs = [], []
        for i in range(k):
            if ctx.sampling.greedy:
                tok = int(logits.argmax())
            else:
                q = target_probs(logits[None], ctx.sampling)[0].cpu()  # [V] the draft's warped distribution
                qs.append(q)
                tok = int(torch.multinomial(q, 1, generator=ctx.generator))
            drafts.append(tok)
            if i + 1 < k:
                logits = self._forward([tok])
        q = None
        if qs:
            vocab = qs[0].numel()
            q = torch.cat([torch.stack(qs), torch.full((1, vocab), 1.0 / vocab)])  # [1+k, V]; leaf row unused
        return chain_tree(ids[-1], drafts, q)


TRUNCATED = "truncated:"  # --draft-model truncated:N = the target's first N layers as the draft


def draft_model_source(spec: str, shown: str | None = None) -> dict:
    """--draft-model NAME | truncated:N -> build_drafter's draft-model options: {"draft_target": NAME} or
    {"draft_target": None, "draft_layers": N}. N is checked here as a count (at least 1), before any model loads;
    against the target's layers by truncated_draft_model. shown: the flag and value as typed, for the error."""
    if not spec.startswith(TRUNCATED):
        return {"draft_target": spec}
    n = spec[len(TRUNCATED):].strip()
    if not n.lstrip("-").isdigit() or int(n) < 1:
        raise SpecheadsError(f"{shown or f'--draft-model {spec}'}: must be at least 1 (target layers the draft keeps)")
    return {"draft_target": None, "draft_layers": int(n)}


def truncated_draft_model(target, num_layers: int = 4):
    """A cheap 'draft model' without training: a copy of the target keeping only its first num_layers decoder
    layers (plus final norm and lm_head). Shares weights with the target (no copy of the tensors)."""
    total = len(target.model.model.layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total - 1:
        raise SpecheadsError(f"--draft-model {TRUNCATED}{num_layers}: must be 1..{total - 1} (the draft keeps the "
                             f"first N of the target's {total} layers)")

    model = copy.copy(target.model)  # shallow: submodules are shared by reference ...
    model._modules = dict(model._modules)  # ... but the module dicts are not (else the target would be cut too)
    base = copy.copy(target.model.model)
    base._modules = dict(base._modules)
    model.model = base
    model.model.layers = nn.ModuleList(list(target.model.model.layers[:num_layers]))
    model.config = copy.deepcopy(target.model.config)
    model.config.num_hidden_layers = num_layers
    if hasattr(model.config, "layer_types") and model.config.layer_types is not None:
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.model.config = model.config
    return model


def _draft_model(target, head, spec: TreeSpec, draft_target: str | None = None, draft_layers: int = 4) -> Drafter:
    """A separate small model sharing the target's vocabulary, or else the target's first draft_layers layers."""
    if draft_target:
        small = load_target(draft_target, dtype=target.dtype, device=str(target.device), role="draft model")
        if small.vocab_size != target.vocab_size:
            raise SpecheadsError(f"draft model {draft_target}: vocabulary {small.vocab_size} differs from the "
                                 f"target's {target.vocab_size}")
        model = small.model
    else:
        model = truncated_draft_model(target, draft_layers)
    return DraftModelDrafter(model, num_tokens=spec.num_tokens)


register_drafter(DrafterKind("draft-model", "tokens", "draft-model", _draft_model, default_tree="4"))
