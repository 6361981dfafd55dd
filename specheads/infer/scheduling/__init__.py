"""Choosing what to verify: measured cost curves, acceptance rates, the per-step scheduler and the batch budget."""
