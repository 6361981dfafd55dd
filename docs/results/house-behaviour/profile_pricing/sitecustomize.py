"""Issue 29's behaviour check: the before-code (commit 96c39ce) has no `--pricing profile`; this grafts the
after-code's profile pricing (infer/scheduling/step.py Scheduler.prices / fixed_cost / source_seconds; the batched BudgetScheduler's
draft_cost 0, bench/batch.py) onto it, so
that its scheduled methods choose from the cached cost profile alone, as the after run does with the flag.
Put this folder first on PYTHONPATH (bench.sh does for code without the flag); Python imports it at start-up."""
from collections import deque

from specheads.infer import batchbudget, drafters, scheduler


def _prices(self, clock=None, draft_now=0.0):
    return scheduler.Prices(self.t1_profile, 0.0, 0.0, "the profile's t(1), drafting and the loop unpriced (graft)")


class _Unpriced(deque):
    """A union source's seconds per step, recorded as 0: its pass unpriced (after-code source_seconds = 0)."""

    def append(self, seconds):
        super().append(0.0)


_init = drafters.ScheduledUnionDrafter.__init__


def _union_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.seconds = {n: _Unpriced(maxlen=scheduler.WINDOW_STEPS) for n in self.names}


_budget_init = batchbudget.BudgetScheduler.__init__


def _budget(self, *args, **kwargs):
    """Batched +sched: d = 0, the cost surface alone decides (after-code bench/batch.py under --pricing profile)."""
    _budget_init(self, *args, **{**kwargs, "draft_cost": 0.0})


scheduler.Scheduler.prices = _prices
scheduler.Scheduler.fixed_cost = lambda self, prices, draft_s=None: 0.0
drafters.ScheduledUnionDrafter.__init__ = _union_init
batchbudget.BudgetScheduler.__init__ = _budget
