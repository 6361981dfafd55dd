"""llama.cpp as a bench engine: `llama-server` (server.py), the bench methods over it (method.py) and a DSpark head's
`--spec-draft-p-min` (pmin.py)."""
from specheads.infer.bench.llamacpp.method import LlamaCppMethod, build_llamacpp_method, record_from_reply
from specheads.infer.bench.llamacpp.server import LlamaServer, default_threads

__all__ = ["LlamaCppMethod", "LlamaServer", "build_llamacpp_method", "default_threads", "record_from_reply"]
