from specheads.infer.scheduling.costs import *; from specheads.infer.scheduling.profile import *  # noqa: E702,F401,F403 (shim for modules importing this path)
