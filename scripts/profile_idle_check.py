"""Issue 49.2's idle-machine check: measure the cost profile afresh N times (a private cache) and count the
attempts re-measured (info) and the warnings a user would see (only a kept noisy profile warns).

usage: python scripts/profile_idle_check.py [--target smollm2-135m] [--dtype float32] [--runs 4] [--threads 2]
                                            [--out docs/results/profile-idle/profile_idle.json]
Run it alone on the machine: a benchmark beside another job is not an idle machine.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rows: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING or "looks disturbed" in msg:
            self.rows.append((record.levelname, msg))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("docs/results/profile-idle/profile_idle.json"))
    a = p.parse_args()
    os.environ["SPECHEADS_CACHE"] = tempfile.mkdtemp(prefix="specheads-profile-idle-")
    import torch
    from specheads.infer.scheduling.profile import load_or_profile
    from specheads.target import load_target
    from specheads.utils import atomic_write_json
    torch.set_num_threads(a.threads)
    lines = _Lines()
    logger = logging.getLogger("specheads")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    target = load_target(a.target, a.dtype)
    runs = []
    for i in range(a.runs):
        t0 = time.perf_counter()
        prof = load_or_profile(target, refresh=True)
        runs.append({"run": i, "attempts": prof["attempts"], "noisy": prof["noisy"],
                     "seconds": round(time.perf_counter() - t0, 1), "relative": prof["verify"]["relative"]})
    out = {"command": f"python scripts/profile_idle_check.py --target {a.target} --dtype {a.dtype} --runs {a.runs} "
                      f"--threads {a.threads}", "threads": torch.get_num_threads(), "runs": runs,
           "retried_attempts": sum(r["attempts"] - 1 for r in runs),
           "warnings": [m for lvl, m in lines.rows if lvl != "INFO"], "retry_lines": [m for lvl, m in lines.rows if lvl == "INFO"]}
    atomic_write_json(a.out, out)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
