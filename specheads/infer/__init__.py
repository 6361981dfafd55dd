"""Tree-based speculative inference: tree.py (DraftTree), treespec.py (--tree: TreeSpec and its parser), verify.py
(greedy | sampling | typical-lossy), cache.py, drafters.py (Drafter: propose / observe; the registry and
build_drafter), generate.py (the loop), profile.py (verification cost) and autotree.py (--tree auto), bench.py,
prompts.py, head_eval.py. Import the submodules directly; this package does not re-export `generate` so that
`from specheads.infer import generate` keeps naming the module."""
