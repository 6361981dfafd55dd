"""specheads: train draft heads on a frozen target LLM and decode faster with lossless tree speculation."""

__version__ = "0.1.0"

from specheads.target import Target, load_target  # noqa: E402,F401
