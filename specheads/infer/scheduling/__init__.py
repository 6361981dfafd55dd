"""Choosing what to verify: costs.py (the measured verify-cost curve and batch cost surface read at any point, the
monotone fits), profile.py (measuring them, cached per machine + target + dtype), acceptance.py (candidates, rates,
outcomes: what the per-step choice reads), step.py (the per-step scheduler), batch_budget.py (a batch's per-row
verify budgets) and autotree.py (`--tree auto` for tree heads). This face imports nothing: the drafters import
step.py and autotree.py imports the drafters."""
