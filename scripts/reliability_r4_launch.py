"""Reliability sweep, round four (issue 50 point 4): `specheads launch` with bad launch: settings or node flags.

`cases(h)` returns rows in scripts/reliability_sweep.py's case format; each case writes its own recipe at
{tmp}/r.yaml (two nodes, gloo, node 0 at 127.0.0.1 on a port nobody listens on) and never starts training.
"""
from __future__ import annotations

import socket

import yaml


def recipe(**launch):
    def write(ctx) -> None:
        with socket.socket() as s:  # a port that was free a moment ago: nobody answers there
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = {"num_machines": 2, "main_process_ip": "127.0.0.1", "main_process_port": port, "backend": "gloo",
               "timeout_s": 2, **launch}
        (ctx.tmp / "r.yaml").write_text(yaml.safe_dump({"output_dir": str(ctx.tmp / "run"), "launch": cfg}))
    return write


def cases(h) -> list[dict]:
    launch = ["launch", "--config", "{tmp}/r.yaml"]
    return [
        {"area": "launch", "risk": "unclear", "name": "launch launch.backend mpi", "setup": recipe(backend="mpi"),
         "argv": launch + ["--node-rank", "0", "--dry-run"], "rc": 2,
         "expect": "launch.backend: 'mpi' is not one of ['nccl', 'gloo']"},
        {"area": "launch", "risk": "unclear", "name": "launch --node-rank 2 of 2 nodes", "setup": recipe(),
         "argv": launch + ["--node-rank", "2", "--dry-run"], "rc": 2,
         "expect": "--node-rank 2: out of range for launch.num_machines 2"},
        {"area": "launch", "risk": "unclear", "name": "launch 2 nodes without --node-rank", "setup": recipe(),
         "argv": launch + ["--dry-run"], "rc": 2, "expect": "--node-rank: needed"},
        {"area": "launch", "risk": "traceback", "name": "launch node 1 cannot reach node 0", "setup": recipe(),
         "argv": launch + ["--node-rank", "1"], "rc": 2, "expect": "cannot reach the main node at 127.0.0.1:"},
        {"area": "launch", "risk": "unclear", "name": "launch --main-ip with a port", "setup": recipe(),
         "argv": launch + ["--node-rank", "1", "--main-ip", "10.0.0.1:29500", "--dry-run"], "rc": 2,
         "expect": "--main-ip: '10.0.0.1:29500' is not an address"},
    ]
