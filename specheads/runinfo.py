"""What a result records about its run: the command as typed and the machine it ran on (bench results.json, cost
profiles)."""
from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any


def command_line(argv: list[str] | None = None) -> str:
    """The command as the user would type it (`specheads bench ...`, also when run as `python -m specheads`)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name in ("specheads", "__main__.py", "cli.py"):
        argv[0] = "specheads"
    return " ".join(shlex.quote(a) for a in argv)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def environment() -> dict[str, Any]:
    """Library versions, CPU, threads and GPU: what a timing depends on."""
    import torch
    import transformers

    import specheads

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "specheads": specheads.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu}
