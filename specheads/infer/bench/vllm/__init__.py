"""vLLM (its CPU build, in .venv-vllm) as a bench engine: the OpenAI server (server.py) and the bench methods
`vllm` / `vllm:LABEL` over it (method.py)."""
from specheads.infer.bench.vllm.method import VllmMethod, build_vllm_method, record_from_choice
from specheads.infer.bench.vllm.server import VllmServer, parse_spec_metrics, vllm_python

__all__ = ["VllmMethod", "VllmServer", "build_vllm_method", "parse_spec_metrics",
           "record_from_choice", "vllm_python"]
