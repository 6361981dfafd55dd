"""What every local server the bench drives shares (llama-server: bench/llamacpp/server.py; vLLM:
bench/vllm/server.py): a free port on 127.0.0.1, a log file, a start that waits for /health and says why a server
that died while starting died, JSON requests with one-line errors, a stop, and the lookup of a method's head by its
--head label (`llama.cpp:LABEL`, `vllm:LABEL`).

A subclass sets NAME (how messages name it), the command line (`args`, less --port) and what differs: its
environment (`launch_env`), how its process starts (`popen_kwargs`), a check once it is ready (`after_ready`) and
how it is stopped (`stop`).
"""
from __future__ import annotations

import atexit
import json
import logging
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port nobody listens on at 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def labelled_source(method: str, label: str, heads: dict[str, str], what: str = "folder",
                    usable: Callable[[Path], bool] = Path.is_dir) -> str:
    """The source `method` (`vllm:LABEL`, `llama.cpp:LABEL`) names: the --head labelled LABEL (`head` for a single
    unlabelled one), else LABEL itself where that path is `usable` (a folder; llama.cpp: a .gguf file too); one
    line naming the labels given when neither."""
    for key in (f"head:{label}", label):
        if key in heads:
            return heads[key]
    if usable(Path(label)):
        return label
    raise SpecheadsError(f"--methods {method}: no --head labelled {label!r} and no such {what} (given: "
                         f"{[k.removeprefix('head:') for k in heads] or 'none'})")


class LocalServer:
    """One server process on 127.0.0.1, its output in `log_file`; a context manager (or start() / stop(); an exit
    handler stops it if the caller does not)."""

    NAME = "server"
    POLL_S = 0.2  # seconds between /health probes while it starts
    PROGRESS_EVERY_S: float | None = None  # a progress line this often while it starts (None: none)

    def __init__(self, args: list[str], log_file: Path, startup_timeout_s: float, request_timeout_s: float):
        self.args, self.log_file = args, log_file
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- what a subclass may change
    def launch_env(self) -> dict[str, str] | None:
        return None  # this process's environment

    def log_header(self, args: list[str], env: dict[str, str] | None) -> str:
        return " ".join(args)

    def popen_kwargs(self) -> dict[str, Any]:
        return {}  # same process group: a Ctrl-C in the terminal reaches the server too

    def after_ready(self) -> None:
        pass

    # ----- the shared life
    def start(self):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        args, env = self.args + ["--port", str(port)], self.launch_env()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "w") as lf:
            lf.write(self.log_header(args, env) + "\n")
            lf.flush()
            self.proc = subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, **self.popen_kwargs())
        atexit.register(self.stop)
        try:
            self._wait_ready()
            self.after_ready()
        except BaseException:  # Ctrl-C while it loads included
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        t0 = time.monotonic()
        next_line = t0 + (self.PROGRESS_EVERY_S or float("inf"))
        while time.monotonic() - t0 < self.startup_timeout_s:
            if self.proc.poll() is not None:
                raise SpecheadsError(f"{self.NAME} exited with code {self.proc.returncode} while starting: "
                                     f"{self.log_tail()} (log: {self.log_file})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        log.info("%s ready on %s after %.0f s (log: %s)", self.NAME, self.url,
                                 time.monotonic() - t0, self.log_file)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # still loading (503) or not listening yet
            if time.monotonic() >= next_line:
                next_line += self.PROGRESS_EVERY_S
                log.info("%s starting: %.0f s of at most %.0f (%s)", self.NAME, time.monotonic() - t0,
                         self.startup_timeout_s, self.log_tail(errors_first=False)[-160:])
            time.sleep(self.POLL_S)
        raise SpecheadsError(f"{self.NAME} not ready after {self.startup_timeout_s:.0f} s (log: {self.log_file})")

    def log_text(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, errors_first: bool = True) -> str:
        """The log's last error line (errors_first), else its last line. A pydantic ValidationError's reason is on
        the indented line after its header (vLLM's config checks: "1 validation error for VllmConfig" / "  Value
        error, Model Runner V1 does not support: ..."), so that line is added to it."""
        lines = [ln for ln in self.log_text().splitlines() if ln.strip()]
        errors = [i for i, ln in enumerate(lines) if "Error" in ln] if errors_first else []
        if not errors:
            return (lines or ["(empty log)"])[-1].strip()
        i = errors[-1]
        if "validation error" in lines[i] and i + 1 < len(lines) and lines[i + 1][:1].isspace():
            return f"{lines[i].strip()}: {lines[i + 1].strip()}"
        return lines[i].strip()

    def request(self, path: str, body: dict | None = None) -> bytes:
        """GET (body None) or POST JSON to `path`; one line naming the server and path on any failure."""
        if self.proc is None or self.proc.poll() is not None:
            raise SpecheadsError(f"{self.NAME} is not running ({self.log_tail()}; log: {self.log_file})")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            raise SpecheadsError(f"{self.NAME} {path}: HTTP {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, TimeoutError) as e:
            raise SpecheadsError(f"{self.NAME} {path}: {e} (log: {self.log_file})") from None

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
