from specheads.infer.scheduling.batch_budget import *  # noqa: F401,F403 (shim for modules importing this path)
