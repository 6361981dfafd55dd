from specheads.infer.engine.batch import generate_batch  # noqa: F401  (re-export for scripts/gpu_check.py)
