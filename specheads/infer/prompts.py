from specheads.infer.bench.prompts import *  # noqa: F401,F403 (train/devset.py, infer/head_eval.py, infer/autotree.py)
