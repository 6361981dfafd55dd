from specheads.infer.bench.batch import BatchBenchSettings, BatchRun, build_batch_methods, compare_runs, paired_chunk_ratio, run_batch_bench  # noqa: F401,E501 (tests/test_batch.py)
