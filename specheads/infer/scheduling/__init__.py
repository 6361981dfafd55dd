"""Choosing what to verify: costs.py (the measured verify-cost curve and batch cost surface read at any point, the
monotone fits), profile.py (measuring them, cached per machine + target + dtype), profile_check.py (whether a cached
profile may be read), acceptance.py (candidates, rates, outcomes: what the per-step choice reads), step.py (the
per-step scheduler), batch_budget.py (a batch's per-row verify budgets), skipsearch.py (the layer-skip draft's skip
set). A layer above engine/ and below drafters/: it imports the engine, never the drafters (`--tree auto` for tree
heads, which runs the drafters, is infer/autotree.py). This face imports nothing."""
