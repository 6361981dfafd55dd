"""The target's forward and KV cache behind one interface, so the decoding loop and the cost profile never ask
which path runs:
- `OwnedRunner`: the owned Llama-family forward over a static cache (engine/owned.py), the fast path;
- `HFRunner`: the HF model's own forward over a transformers DynamicCache (edited only by specheads/kvcache.py), for
  every other architecture.

  reset(capacity)                 a new request: an empty cache with room for `capacity` columns
  tree_inputs(tree) -> plan        what one tree forward needs besides its tokens (masks, positions), built apart so
                                  the loop can time it as its own phase
  forward(tokens [n], plan, layers, logit_rows) -> (logits, features)
                                  plan None: a causal run of n tokens after the cache (prefill); else one tree
                                  forward (tokens = tree.tokens at positions length + depth)
  keep(n, accepted)               after a forward of n tokens: keep the accepted ones (indices, root first)
  length                          columns kept

`runner_for(target)` picks the path once per target: `target.engine` "auto" (owned when the architecture is
supported), "owned" (refused with the reason when it is not) or "hf"; one log line says which path runs.
"""
from __future__ import annotations

import logging

import torch

from specheads.kvcache import keep_accepted, prepare_cache, tree_attention_mask
from specheads.infer.engine.owned import OwnedLlama, owned_reason
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

ENGINES = ("auto", "owned", "hf")  # --engine


class HFRunner:
    """The HF forward over a DynamicCache (any architecture transformers runs, sliding windows included)."""

    name = "hf"

    def __init__(self, target):
        self.target = target
        self.cache = None
        self.length = 0

    def reset(self, capacity: int) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.target.model.config)
        prepare_cache(self.cache)
        self.length = 0

    def tree_inputs(self, tree):
        t = self.target
        mask = tree_attention_mask(tree, self.cache, self.length, t.dtype, t.device)  # [1,1,N,S+N]
        return mask, tree.position_ids(self.length, device=t.device)  # [1, N]

    def forward(self, tokens: torch.Tensor, plan=None, layers: list[int] | None = None, logit_rows: str = "all"):
        t, n = self.target, tokens.numel()
        mask, pos = plan or (None, torch.arange(self.length, self.length + n, device=t.device)[None])
        out = t.model(input_ids=tokens[None].to(t.device), attention_mask=mask, position_ids=pos, cache=self.cache,
                      use_cache=True, output_hidden_states=layers is not None,
                      logits_to_keep=0 if logit_rows == "all" else 1)
        feats = None
        if layers is not None:
            hs = out.hidden_states  # tuple of L+1 [1, n, D]; hs[L] is post-norm (the lm_head input)
            feats = torch.cat([hs[l][0] for l in layers], dim=-1)  # [n, F*D]
        return (None if logit_rows == "none" else out.logits[0]), feats

    def keep(self, num_nodes: int, accepted) -> None:
        if tree_like_all(num_nodes, accepted):  # a causal run kept whole (prefill): nothing to edit
            self.length += num_nodes
            return
        keep_accepted(self.cache, num_nodes, accepted)
        self.length += len(accepted)


def tree_like_all(num_nodes: int, accepted) -> bool:
    return len(accepted) == num_nodes and list(accepted) == list(range(num_nodes))


class OwnedRunner:
    """The owned forward (engine/owned.py) of a supported family; its weights are the target's own tensors."""

    name = "owned"

    def __init__(self, target):
        self.target = target
        self.model = OwnedLlama(target.model)

    @property
    def length(self) -> int:
        return self.model.length

    def reset(self, capacity: int) -> None:
        self.model.reset(capacity)

    def tree_inputs(self, tree):
        return (tree.depth + self.model.length).to(self.model.device), tree.ancestors()  # positions [N], [N, N]

    def forward(self, tokens: torch.Tensor, plan=None, layers: list[int] | None = None, logit_rows: str = "all"):
        start = self.model.length
        pos, allowed = plan or (torch.arange(start, start + tokens.numel(), device=self.model.device), None)
        return self.model.forward(tokens, pos, allowed, layers, logit_rows)

    def keep(self, num_nodes: int, accepted) -> None:
        self.model.keep(num_nodes, [int(i) for i in accepted])


def runner_for(target):
    """The target's runner, built once per target and engine choice (the owned path fuses weights once)."""
    mode = getattr(target, "engine", "auto")
    if mode not in ENGINES:
        raise SpecheadsError(f"--engine {mode!r}: expected one of {', '.join(ENGINES)}")
    cached = getattr(target, "_runner", None)
    if cached is not None and cached[0] == mode:
        return cached[1]
    why = owned_reason(target.model) if mode != "hf" else "asked for (--engine hf)"
    if mode == "owned" and why:
        raise SpecheadsError(f"--engine owned: target {target.name} cannot run the owned forward: {why}; "
                             "use --engine auto or hf")
    runner = OwnedRunner(target) if not why else HFRunner(target)
    if why:
        log.info("target forward: HF %s (%s)", type(target.model).__name__, why)
    else:
        log.info("target forward: owned %s path over a static KV cache", target.model.config.model_type)
    target._runner = (mode, runner)
    return runner
