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
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specheads.infer.scheduling.step import StepClock, StepReport
from specheads.infer.tree import DraftTree, chain_tree
from specheads.infer.verify import Accepted, SamplingParams

__all__ = ["DraftContext", "Drafter", "StepClock", "StepReport"]


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
