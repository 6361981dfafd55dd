"""Speculative inference. Leaves: tree.py (DraftTree and its builders), treespec.py (--tree: TreeSpec and its
parser), verify.py (greedy | sampling | typical-lossy). Then layers, each importing only those below it: engine/ (the
drafter protocol with the step clock, kvcache: the target's cache, generate: one row, batch: many), scheduling/ (cost
curves, acceptance rates, the per-step scheduler, the batch budget, the skip-set search), drafters/ (one module per
kind, the registry, build_drafter, --plugin), autotree.py (--tree auto for tree heads) and resolve.py (a head folder
and --tree -> what build_drafter takes), bench/ (`specheads bench`). Import the submodules directly;
`specheads.infer.generate` stays the README's path to the loop."""
