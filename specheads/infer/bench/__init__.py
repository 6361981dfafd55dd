"""`specheads bench`: every method on the same prompts in one process, alternated prompt by prompt (or chunk by chunk
with --batch-sizes), figures as ratios of totals in one run.

records.py (RunRecord and Method per turn, BatchRun and BatchMethod per chunk, BenchSettings), names.py (the
method-name grammar, --head labels), methods.py (HF, ours, the union and draft-model methods), llamacpp/ (llama.cpp
as an engine), metrics.py (τ, speedup, histograms, the scheduler's expected figures), report.py (results.json,
results.md), plots.py, runner.py (the one runner: rotation, warm-up, checkpointing, Ctrl-C), batch.py (the batched
sweep). Prompts: specheads/prompts.py (MT-bench, HumanEval, ShareGPT, JSONL). Heads and trees are resolved by
infer/resolve.py.
"""
from specheads.infer.bench.metrics import (DEFINITIONS, accept_histogram, compare, schedule_summary, step_breakdown,
                                           summarize)
from specheads.infer.bench.methods import (HFGenerate, MethodOptions, OursGenerate, build_methods,
                                           forward_token_counts, record_from_generation)
from specheads.infer.bench.names import (HEAD_LOOKUP_TOKENS, check_method_names, head_entries, is_head_method,
                                         split_lookup)
from specheads.infer.bench.records import BenchSettings, Method, RunRecord
from specheads.infer.bench.report import SCHEMA, build_results, markdown_table, write_results
from specheads.infer.bench.runner import run_bench, write_outputs

__all__ = ["DEFINITIONS", "HEAD_LOOKUP_TOKENS", "SCHEMA", "BenchSettings", "HFGenerate", "Method", "MethodOptions",
           "OursGenerate", "RunRecord", "accept_histogram", "build_methods", "build_results", "check_method_names",
           "compare", "forward_token_counts", "head_entries", "is_head_method", "markdown_table",
           "record_from_generation", "run_bench", "schedule_summary", "split_lookup", "step_breakdown", "summarize",
           "write_outputs", "write_results"]
