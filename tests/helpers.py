"""Set-up shared by several test modules (imported as `helpers`: tests/ is on the path, as for `test_generate`)."""
from __future__ import annotations

from specheads.infer.drafters import Drafter


class Recording(Drafter):
    """Wraps a drafter and records every tree it proposes (tokens, parents). clear_on_reset: each generation starts
    an empty log (False: the log gathers every generation the drafter serves, e.g. a sampling loop)."""

    def __init__(self, inner, log, clear_on_reset: bool = True):
        self.inner, self.log, self.feature_layers = inner, log, inner.feature_layers
        self.clear_on_reset = clear_on_reset

    def reset(self, prompt_ids, features):
        if self.clear_on_reset:
            self.log.clear()
        self.inner.reset(prompt_ids, features)

    def propose(self, ctx):
        tree = self.inner.propose(ctx)
        self.log.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    def observe(self, tree, accepted, features):
        self.inner.observe(tree, accepted, features)
