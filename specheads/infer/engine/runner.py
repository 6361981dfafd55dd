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
`target.compile` (--compile) says whether the owned path runs compiled code: on a CPU the C++ kernels
(engine/kernels.py: bf16 targets on AVX512-BF16), on CUDA captured graphs of the decode and verify steps
(engine/graphs.py); auto = where available, on = refused with the reason where not, off = PyTorch's eager ops.
"""
from __future__ import annotations

import logging

import torch

from specheads.kvcache import keep_accepted, prepare_cache, tree_attention_mask
from specheads.infer.engine.owned import OwnedLlama, owned_reason
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

ENGINES = ("auto", "owned", "hf")  # --engine
COMPILE = ("auto", "on", "off")  # --compile


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

    def __init__(self, target, compiled: bool = True):
        self.target = target
        cuda = next(target.model.parameters()).device.type == "cuda"
        self.model = OwnedLlama(target.model, use_kernels=compiled and not cuda)
        self.graphed = None
        if compiled and cuda:
            from specheads.infer.engine.graphs import GraphedOwned

            self.graphed = GraphedOwned(self.model)
        self.compiled = "CUDA graphs" if self.graphed else "C++ kernels" if self.model.ops is not None else ""

    @property
    def length(self) -> int:
        return self.model.length

    def reset(self, capacity: int) -> None:
        (self.graphed or self.model).reset(capacity)

    def tree_inputs(self, tree):
        return (tree.depth + self.model.length).to(self.model.device), tree.ancestors()  # positions [N], [N, N]

    def forward(self, tokens: torch.Tensor, plan=None, layers: list[int] | None = None, logit_rows: str = "all"):
        start = self.model.length
        pos, allowed = plan or (torch.arange(start, start + tokens.numel(), device=self.model.device), None)
        return (self.graphed or self.model).forward(tokens, pos, allowed, layers, logit_rows)

    def keep(self, num_nodes: int, accepted) -> None:
        self.model.keep(num_nodes, [int(i) for i in accepted])


def runner_for(target):
    """The target's runner, built once per target and engine choice (the owned path fuses weights once)."""
    mode, comp = getattr(target, "engine", "auto"), getattr(target, "compile", "auto")
    if mode not in ENGINES:
        raise SpecheadsError(f"--engine {mode!r}: expected one of {', '.join(ENGINES)}")
    if comp not in COMPILE:
        raise SpecheadsError(f"--compile {comp!r}: expected one of {', '.join(COMPILE)}")
    cached = getattr(target, "_runner", None)
    if cached is not None and cached[0] == (mode, comp):
        return cached[1]
    why = owned_reason(target.model) if mode != "hf" else "asked for (--engine hf)"
    if mode == "owned" and why:
        raise SpecheadsError(f"--engine owned: target {target.name} cannot run the owned forward: {why}; "
                             "use --engine auto or hf")
    if comp == "on" and why:
        raise SpecheadsError(f"--compile on: target {target.name} runs the HF forward ({why}); nothing of ours "
                             "to compile there: use --compile auto or off")
    runner = OwnedRunner(target, compiled=comp != "off") if not why else HFRunner(target)
    if comp == "on" and not runner.compiled:
        raise SpecheadsError(f"--compile on: no compiled path for target {target.name} here (C++ kernels need a bf16 "
                             "target on an AVX512-BF16 CPU with a compiler, SPECHEADS_KERNELS not off; CUDA graphs "
                             "a CUDA target): use --compile auto or off")
    if why:
        log.info("target forward: HF %s (%s)", type(target.model).__name__, why)
    else:
        log.info("target forward: owned %s path over a static KV cache%s", target.model.config.model_type,
                 f", {runner.compiled}" if runner.compiled else ", PyTorch ops")
    target._runner = ((mode, comp), runner)
    return runner
