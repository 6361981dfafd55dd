"""The drafter interface the generation loop speaks: a drafter proposes a DraftTree, then observes what the target
accepted. Verification never asks which drafter proposed.

  reads_logits: bool                 recycle() wants the prompt's logits (else the prefill computes none)
  feature_layers: list[int] | None   target hidden-state layers the drafter needs (docs/architecture.md
                                     "Feature layers"); None = none, the target then skips output_hidden_states
  reset(prompt_ids [T], features [T-1, F*D] | None)   features of the cached prompt positions (all but the root)
  propose(ctx) -> DraftTree                          ctx: DraftContext (ids so far, root last; sampling; room left)
  recycle(tokens [N], logits [N, V])                 the target's logits after each token it was fed
  observe(tree, accepted, features [A, F*D] | None)  features of the accepted nodes (root first), now cached
  step_report() -> StepReport | None                 a scheduled step's expected figures (generator -> stats)
T sequence, N tree nodes, A accepted nodes, D hidden, V vocab, F feature layers.
`StepClock` (the request's recent phase seconds, fed by the generator, read by a drafter's scheduler) and
`StepReport` live here beside the protocol that carries them, so the engine imports nothing from scheduling/.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from specheads.infer.tree import DraftTree, chain_tree
from specheads.infer.verify import Accepted, SamplingParams

__all__ = ["DraftContext", "Drafter", "StepClock", "StepReport", "WINDOW_STEPS"]

WINDOW_STEPS = 32  # steps the running medians look back over: recent enough to follow a machine whose load changes,
# long enough that one slow step (a collection, another job's burst) does not move them


class StepClock:
    """Each recent step's seconds by phase (the generator adds one entry per target forward): what the scheduler's
    t(1) and per-step costs are measured from."""

    def __init__(self, window: int = WINDOW_STEPS):
        self.steps: deque[tuple[float, float, float, int]] = deque(maxlen=window)  # (draft, target, other, nodes)

    def add_step(self, seconds: dict[str, float], nodes: int) -> None:
        other = sum(v for k, v in seconds.items() if k not in ("draft", "target"))
        self.steps.append((seconds.get("draft", 0.0), seconds.get("target", 0.0), other, int(nodes)))

    def __len__(self) -> int:
        return len(self.steps)


@dataclass
class StepReport:
    """What one scheduled step expected, and (greedy unions) what each source alone would have emitted: the
    generator adds these into GenerationStats."""

    expected_tau: float  # 1 + Σ p over the verified draft nodes
    expected_cost: float  # t(n)/t(1) + draft + loop, in one-token target forwards
    sources: dict[str, int] = field(default_factory=dict)  # tokens each source's own proposal alone would emit
    source_cost: dict[str, float] = field(default_factory=dict)  # its own step's cost alone, t(1) units
    censored: dict[str, bool] = field(default_factory=dict)  # its figure is a lower bound (its path was cut correct)
    rested: bool = False  # a union's step where every source rested: plain decoding

    def oracle(self) -> tuple[str, int, float, bool] | None:
        """The better source this step (more tokens; equal: the cheaper): (name, tokens, cost, censored)."""
        if not self.sources:
            return None
        name = max(self.sources, key=lambda s: (self.sources[s], -self.source_cost.get(s, 0.0)))
        return name, self.sources[name], self.source_cost.get(name, 0.0), self.censored.get(name, False)


@dataclass
class DraftContext:
    ids: list[int]  # every token so far (prompt + emitted); ids[-1] is the root, not yet in the target cache
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    max_depth: int = 1 << 30  # deepest node the context window still allows
    clock: StepClock | None = None  # the request's measured seconds per step (the scheduler's prices)


class Drafter:
    """The base drafter drafts nothing: the root alone, i.e. plain decoding."""
    feature_layers: list[int] | None = None
    name = "none"
    reads_logits = False  # True: `recycle` reads the prompt's logits too (the prefill then computes all V columns)

    def reset(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftTree:
        return chain_tree(ctx.ids[-1], [])  # the root alone: plain decoding

    def observe(self, tree: DraftTree, accepted: Accepted, features: torch.Tensor | None) -> None:
        pass

    def recycle(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """The target's logits [N, V] after each of tokens [N] (the prompt's prefill, every verified tree, rejected
        nodes included), given before observe; only Token Recycling reads them."""

    def step_report(self) -> StepReport | None:
        """What a scheduled step expected (read by the generator after observe); None = not scheduled."""
        return None
