"""One `llama-server` process on 127.0.0.1: started, asked for completions by token ids, stopped (the bench's
llama.cpp methods run one each; bench/llamacpp/method.py).

Threads: `-t` / `-tb` default to the cores this process may run on (`os.sched_getaffinity`, else `os.cpu_count`);
`specheads bench --threads N` sets them (and torch's) explicitly.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from specheads.heads.gguf import find_tools
from specheads.utils import SpecheadsError, cache_root

log = logging.getLogger(__name__)

CTX_SIZE = 4096  # tokens of KV cache per server: MT-bench prompt + 256-token answers fit with room
STARTUP_TIMEOUT_S = 180.0  # model load + warm-up; SmolLM2 bf16 takes ~2 s
REQUEST_TIMEOUT_S = 900.0  # one completion; 256 tokens at >= 1 tok/s


def default_threads() -> int:
    """llama.cpp's -t / -tb when --threads is not given: the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One llama-server process on 127.0.0.1 (`parallel` slots, default one: the bench's; `threads` None =
    default_threads(); `ctx_size` is shared by the slots). Use as a context manager, or `start()` / `stop()`; an
    exit handler stops it if the caller does not."""

    def __init__(self, model: Path, draft: Path | None = None, spec_args: tuple[str, ...] = (),
                 threads: int | None = None, ctx_size: int = CTX_SIZE, log_file: Path | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 parallel: int = 1):
        threads = default_threads() if threads is None else int(threads)
        self.binary = find_tools("llama-server").binary("llama-server")
        self.args = [str(self.binary), "-m", str(model), "--host", "127.0.0.1", "-t", str(threads),
                     "-tb", str(threads), "-c", str(ctx_size), "-np", str(int(parallel)), "--no-webui", "--no-cache-prompt",
                     "--cache-ram", "0"]
        if draft is not None:
            self.args += ["-md", str(draft)]
        self.args += list(spec_args)
        self.log_file = log_file or cache_root() / "llamacpp-logs" / f"server-{os.getpid()}-{id(self):x}.log"
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "LlamaServer":
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "w") as lf:
            lf.write(" ".join(self.args + ["--port", str(port)]) + "\n")
            lf.flush()
            # same process group: a Ctrl-C in the terminal reaches the server too
            self.proc = subprocess.Popen(self.args + ["--port", str(port)], stdout=lf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SpecheadsError(f"llama-server exited with code {self.proc.returncode} while loading: "
                                     f"{self._log_tail()} (log: {self.log_file})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        log.info("llama-server ready on %s (%s)", self.url, " ".join(self.args[1:]))
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # still loading (503) or not listening yet
            time.sleep(0.2)
        self.stop()
        raise SpecheadsError(f"llama-server not ready after {self.startup_timeout_s:.0f} s (log: {self.log_file})")

    def _log_tail(self) -> str:
        try:
            lines = [ln for ln in self.log_file.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return lines[-1] if lines else "(empty log)"

    def complete(self, input_ids: list[int], n_predict: int, temperature: float = 0.0, seed: int = 0) -> dict:
        """POST /completion with token ids; returns the server's JSON reply."""
        if self.proc is None or self.proc.poll() is not None:
            raise SpecheadsError(f"llama-server is not running ({self._log_tail()}; log: {self.log_file})")
        body: dict[str, Any] = {"prompt": list(map(int, input_ids)), "n_predict": int(n_predict), "stream": False,
                                "cache_prompt": False, "return_tokens": True, "seed": int(seed)}
        if temperature <= 0:
            body.update(temperature=0.0, top_k=1)  # greedy: argmax (llama-sampler.cpp temp <= 0), one candidate
        else:  # plain temperature sampling: llama.cpp's default top-k 40 / top-p 0.95 / min-p 0.05 switched off
            body.update(temperature=float(temperature), top_k=0, top_p=1.0, min_p=0.0)
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SpecheadsError(f"llama-server /completion: HTTP {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, TimeoutError) as e:
            raise SpecheadsError(f"llama-server /completion: {e} (log: {self.log_file})") from None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
