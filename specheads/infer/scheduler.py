from specheads.infer.scheduling.acceptance import *; from specheads.infer.scheduling.step import *  # noqa: E702,F401,F403 (shim for modules importing this path)
