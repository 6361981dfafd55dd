"""Tree-based speculative inference: tree.py (DraftTree), verify.py (greedy | sampling | typical-lossy), cache.py,
drafters.py (Drafter: propose / observe), generate.py (the loop). Import the submodules directly; this package does
not re-export `generate` so that `from specheads.infer import generate` keeps naming the module."""
