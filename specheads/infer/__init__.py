"""Speculative inference. Leaves: tree.py (DraftTree and its builders), treespec.py (--tree: TreeSpec and its
parser), verify.py (greedy | sampling | typical-lossy). engine/ (the drafter protocol, kvcache: every KV-cache edit,
generate: one row, batch: many), drafters/ (one module per kind, the registry, build_drafter, --plugin), scheduling/
(cost curves, acceptance rates, the per-step scheduler, the batch budget, --tree auto), resolve.py (a head folder and
--tree -> what build_drafter takes), bench/ (`specheads bench`), head_eval.py (`specheads eval`). Import the
submodules directly; `specheads.infer.generate` stays the README's path to the loop."""
