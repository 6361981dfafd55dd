"""One `llama-server` process on 127.0.0.1: started, asked for completions by token ids, stopped (the bench's
llama.cpp methods run one each; bench/llamacpp/method.py).

Threads: `-t` / `-tb` default to the cores this process may run on (`os.sched_getaffinity`, else `os.cpu_count`);
`specheads bench --threads N` sets them (and torch's) explicitly.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specheads.heads.gguf import find_tools
from specheads.infer.bench.served import LocalServer
from specheads.utils import cache_root

CTX_SIZE = 4096  # tokens of KV cache per server: MT-bench prompt + 256-token answers fit with room
STARTUP_TIMEOUT_S = 180.0  # model load + warm-up; SmolLM2 bf16 takes ~2 s
REQUEST_TIMEOUT_S = 900.0  # one completion; 256 tokens at >= 1 tok/s


def default_threads() -> int:
    """llama.cpp's -t / -tb when --threads is not given: the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


class LlamaServer(LocalServer):
    """One llama-server process on 127.0.0.1 (`parallel` slots, default one: the bench's; `threads` None =
    default_threads(); `ctx_size` is shared by the slots). Use as a context manager, or `start()` / `stop()`; an
    exit handler stops it if the caller does not."""

    NAME = "llama-server"

    def __init__(self, model: Path, draft: Path | None = None, spec_args: tuple[str, ...] = (),
                 threads: int | None = None, ctx_size: int = CTX_SIZE, log_file: Path | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 parallel: int = 1):
        threads = default_threads() if threads is None else int(threads)
        binary = find_tools("llama-server").binary("llama-server")
        args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
                "-c", str(ctx_size), "-np", str(int(parallel)), "--no-webui", "--no-cache-prompt", "--cache-ram", "0"]
        if draft is not None:
            args += ["-md", str(draft)]
        args += list(spec_args)
        super().__init__(args, log_file or cache_root() / "llamacpp-logs" / f"server-{os.getpid()}-{id(self):x}.log",
                         startup_timeout_s, request_timeout_s)

    def complete(self, input_ids: list[int], n_predict: int, temperature: float = 0.0, seed: int = 0) -> dict:
        """POST /completion with token ids; returns the server's JSON reply."""
        body: dict[str, Any] = {"prompt": list(map(int, input_ids)), "n_predict": int(n_predict), "stream": False,
                                "cache_prompt": False, "return_tokens": True, "seed": int(seed)}
        if temperature <= 0:
            body.update(temperature=0.0, top_k=1)  # greedy: argmax (llama-sampler.cpp temp <= 0), one candidate
        else:  # plain temperature sampling: llama.cpp's default top-k 40 / top-p 0.95 / min-p 0.05 switched off
            body.update(temperature=float(temperature), top_k=0, top_p=1.0, min_p=0.0)
        return json.loads(self.request("/completion", body))
