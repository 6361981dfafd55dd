"""One vLLM OpenAI-compatible server (vLLM's CPU build, `vllm-cpu` in .venv-vllm: scripts/setup_vllm_venv.sh) on
127.0.0.1: started, asked for completions by token ids, its spec-decode counters read from /metrics, stopped.
The bench methods `vllm` / `vllm:LABEL` run one each (bench/vllm/method.py).

The server runs `python -m vllm.entrypoints.openai.api_server` from .venv-vllm (the wheel ships no `vllm` command)
in a session of its own that receives SIGTERM when this process dies (prctl PDEATHSIG), so that neither Ctrl-C nor a
killed bench leaves it running; `stop()` ends the whole group (the API server and its engine-core process).
As vLLM's CPU docs advise: tcmalloc and the wheel's Intel OpenMP preloaded (where found), OpenMP threads bound to
the cores given (VLLM_CPU_OMP_THREADS_BIND), a KV cache of VLLM_CPU_KVCACHE_SPACE GiB. Offline: the hub and usage
reporting are switched off; the torch.compile cache lives in $SPECHEADS_CACHE/vllm (later starts are faster).
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

from specheads.infer.bench.served import LocalServer
from specheads.utils import SpecheadsError, cache_root

VENV_ENV = "SPECHEADS_VLLM_VENV"  # another venv holding vllm-cpu (default: the repository's .venv-vllm)
STARTUP_TIMEOUT_S = 1200.0  # import + model load + torch.compile of both models; ~3 min on 2 idle cores
PROGRESS_EVERY_S = 30.0  # one progress line this often while the server starts
REQUEST_TIMEOUT_S = 900.0  # one completion; 256 tokens at >= 1 tok/s
KVCACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: 1 GiB holds ~22k tokens of SmolLM2-135M fp32 KV (30 layers x 3 KV heads)
MAX_MODEL_LEN = 4096  # tokens per sequence: MT-bench prompt + 256-token answers fit with room (as llama.cpp's)
SPEC_PREFIX = "vllm:spec_decode_"
# vLLM's loader lines that mean the draft did not load whole (the test fails on them; the server start refuses them)
BAD_WEIGHTS = re.compile(r"weights were not initiali[sz]ed|not initiali[sz]ed from checkpoint|Skipping loading|"
                         r"Unable to collect loaded parameters|(missing|unused|unexpected|ignored) (draft )?weights?",
                         re.IGNORECASE)  # default_loader.py / llama_eagle3.py / models/utils.py (vLLM 0.32)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def repo_root() -> Path:
    return Path(__file__).resolve().parents[4]


def vllm_python() -> Path:
    """The python of the venv holding vllm-cpu ($SPECHEADS_VLLM_VENV, else .venv-vllm); one clear line when absent."""
    venv = Path(os.environ.get(VENV_ENV) or repo_root() / ".venv-vllm")
    py = venv / "bin" / "python"
    if not py.is_file():
        raise SpecheadsError(f"vllm methods: no vLLM venv at {venv} (vLLM's CPU build in a venv of its own): run "
                             f"`make vllm-venv` (scripts/setup_vllm_venv.sh), or set {VENV_ENV} to one")
    return py


SYSTEM_LIBS = (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))


def preloads(venv: Path) -> list[str]:
    """tcmalloc (Debian's libtcmalloc-minimal4, else one in the venv) and the venv's Intel OpenMP (the wheel's
    intel-openmp), as vLLM's CPU docs preload them; those not found are left out (vLLM runs, slower)."""
    out = []
    tcmalloc = [p for d in SYSTEM_LIBS if d.is_dir() for p in sorted(d.glob("libtcmalloc_minimal.so.*"))]
    for found in (tcmalloc or sorted((venv / "lib").rglob("libtcmalloc_minimal.so*")),
                  sorted((venv / "lib").rglob("libiomp5.so"))):
        if found:
            out.append(str(found[0]))
    return out


def bind_cores(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` OpenMP threads: the first cores this process may run on."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = list(range(os.cpu_count() or 1))
    if not 1 <= threads <= len(cores):
        raise SpecheadsError(f"--threads {threads}: vLLM binds one OpenMP thread per core, and this process may run "
                             f"on {len(cores)} core(s)")
    return ",".join(str(c) for c in cores[:threads])


def _die_with_parent() -> None:  # runs in the child before exec: its own session, SIGTERM when we die
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not glibc: stop() and the exit handler still end it


def parse_spec_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus text -> {counter: value} for the spec-decode counters (`vllm:spec_decode_*_total`, the
    per-position one as `..._per_pos_total[P]`), summed over the other labels (model name, engine)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(SPEC_PREFIX):
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1).endswith("_created"):
            continue
        name = m.group(1)
        pos = re.search(r'position="(\d+)"', m.group(2) or "")
        key = f"{name}[{pos.group(1)}]" if pos else name
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


class VllmServer(LocalServer):
    """vLLM's OpenAI server on 127.0.0.1 for the HF folder `model`, with `speculative` (a --speculative-config dict)
    or none; `threads` OpenMP threads bound to as many cores; `eager`: --enforce-eager (no compilation). A context manager (or start() / stop(); an exit handler stops it too)."""

    NAME = "vLLM server"
    POLL_S = 1.0
    PROGRESS_EVERY_S = PROGRESS_EVERY_S

    def __init__(self, model: str | Path, dtype: str = "float32", speculative: dict | None = None, threads: int = 1,
                 log_file: Path | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, seed: int = 0, eager: bool = False):
        self.python = vllm_python()
        args = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", "target", "--host", "127.0.0.1", "--dtype", dtype,
                "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "1", "--seed", str(seed),
                "--generation-config", "vllm"]  # vLLM's own sampling defaults, not the folder's
        if speculative:
            args += ["--speculative-config", json.dumps(speculative)]
        if eager:  # no torch.compile: starts in ~1 min instead of ~3+ on 2 cores, decodes slower
            args.append("--enforce-eager")
        self.speculative, self.threads = speculative, int(threads)
        self.bind = bind_cores(self.threads)
        super().__init__(args, log_file or cache_root() / "vllm-logs" / f"server-{os.getpid()}-{id(self):x}.log",
                         startup_timeout_s, request_timeout_s)

    def launch_env(self) -> dict[str, str]:
        venv = self.python.parent.parent
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "LD_PRELOAD")}
        env.update(VLLM_CPU_OMP_THREADS_BIND=self.bind, VLLM_CPU_KVCACHE_SPACE=str(KVCACHE_GIB),
                   OMP_NUM_THREADS=str(self.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_CACHE_ROOT=str(cache_root() / "vllm"),
                   VLLM_LOGGING_LEVEL="INFO")
        pre = preloads(venv)
        if pre:
            env["LD_PRELOAD"] = ":".join(pre)
        return env

    def log_header(self, args: list[str], env: dict[str, str] | None) -> str:
        return f"LD_PRELOAD={(env or {}).get('LD_PRELOAD', '')} VLLM_CPU_OMP_THREADS_BIND={self.bind} " + " ".join(args)

    def popen_kwargs(self) -> dict[str, Any]:
        return {"preexec_fn": _die_with_parent}

    def after_ready(self) -> None:
        self.check_draft_weights()

    def check_draft_weights(self) -> None:
        """A draft whose load logs missing / unused / unexpected weights is refused (its acceptance would mean
        nothing): one line with vLLM's own message."""
        if not self.speculative:
            return
        bad = [ln.strip() for ln in self.log_text().splitlines() if BAD_WEIGHTS.search(ln)]
        if bad:
            raise SpecheadsError(f"vLLM loaded the draft {self.speculative.get('model')} with weights left out: "
                                 f"{bad[0][:300]} (log: {self.log_file})")

    def complete(self, input_ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0) -> dict:
        """POST /v1/completions with the prompt as token ids; -> the reply's first choice, with `token_ids`."""
        body: dict[str, Any] = {"model": "target", "prompt": [int(t) for t in input_ids], "max_tokens": int(max_tokens),
                                "temperature": float(temperature), "top_p": 1.0, "seed": int(seed),
                                "return_token_ids": True, "skip_special_tokens": False}
        reply = json.loads(self.request("/v1/completions", body))
        choice = (reply.get("choices") or [{}])[0]
        if not isinstance(choice.get("token_ids"), list):
            raise SpecheadsError(f"vLLM /v1/completions returned no token ids (return_token_ids): {str(reply)[:200]}")
        return choice

    def spec_counters(self) -> dict[str, float]:
        return parse_spec_metrics(self.request("/metrics").decode(errors="replace"))

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):  # the group: API server + engine core
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a child left behind after the server itself exited
        except ProcessLookupError:
            pass
