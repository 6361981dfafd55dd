"""llama.cpp as a `specheads bench` engine, on the same prompts and in the same run as the other methods.

Methods (each one `llama-server` on 127.0.0.1, started once for the run, stopped at exit):
- `llama.cpp`: plain decoding of the target GGUF (the run's dtype: bf16 -> bf16 GGUF);
- `llama.cpp:LABEL`: our head as llama.cpp's draft (`-md DRAFT.gguf --spec-type draft-eagle3`, llama.cpp's chain of
  `--spec-draft-n-max` tokens, default 3). LABEL is the label of a `--head LABEL=DIR`, `head` for a single unlabeled
  `--head`, or a head folder / draft .gguf path. Head folders are converted once (heads/gguf.py, cached);
- `llama.cpp-ngram`: llama.cpp's own n-gram drafting (`ngram-simple`) with the n-gram size and draft length of
  our HF prompt-lookup method, so that the two engines run the same algorithm.

Per prompt the token ids go to /completion (`n_predict`, greedy `temperature 0` + `top_k 1`, `cache_prompt: false`
with the server's prompt cache off, so every prompt is prefilled in full as HF generate does, `return_tokens`). The
reply has the new token ids (EOS included, as HF generate returns it) and the draft counters `timings.draft_n` /
`draft_n_accepted` (tools/server/server-common.cpp:99). Target forwards that emit tokens, counted as for HF generate:
the prefill emits the first token and every later forward emits 1 + the drafts it accepted, so
forwards = new tokens - accepted drafts and τ = new tokens / forwards. The per-forward histogram is known only
when nothing was drafted (every forward emitted one token); otherwise it is None (the server reports totals).
Wall time is the request's round trip on loopback (prefill included, as for the other methods). Each method's
`info` (results.json methods_info) adds the run's drafted / accepted totals and their ratio (warm-up included).
With `llama.cpp` in the run, every other method also gets figures against it (`vs_llama.cpp`: speedup, identical).
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

from specheads.utils import SpecheadsError, cache_root

log = logging.getLogger(__name__)

PLAIN, NGRAM, PREFIX = "llama.cpp", "llama.cpp-ngram", "llama.cpp:"
THREADS = 2  # this machine's cores (-t / -tb); torch uses the same two
CTX_SIZE = 4096  # tokens of KV cache per server: MT-bench prompt + 256-token answers fit with room
STARTUP_TIMEOUT_S = 180.0  # model load + warm-up; SmolLM2 bf16 takes ~2 s
REQUEST_TIMEOUT_S = 900.0  # one completion; 256 tokens at >= 1 tok/s
NGRAM_ARGS = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",  # bench.PROMPT_LOOKUP_MAX_NGRAM
              "--spec-ngram-simple-size-m", "10")  # bench.PROMPT_LOOKUP_NUM_TOKENS
GGUF_TYPE_OF_DTYPE = {"torch.float32": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16"}


def is_llamacpp_method(name: str) -> bool:
    return name in (PLAIN, NGRAM) or (name.startswith(PREFIX) and len(name) > len(PREFIX))


# ----------------------------------------------------------------------------------------------- the server
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One llama-server process on 127.0.0.1 (one slot, `THREADS` threads). Use as a context manager, or
    `start()` / `stop()`; an exit handler stops it if the caller does not."""

    def __init__(self, model: Path, draft: Path | None = None, spec_args: tuple[str, ...] = (),
                 threads: int = THREADS, ctx_size: int = CTX_SIZE, log_file: Path | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S, request_timeout_s: float = REQUEST_TIMEOUT_S):
        from specheads.heads.gguf import find_tools

        self.binary = find_tools("llama-server").binary("llama-server")
        self.args = [str(self.binary), "-m", str(model), "--host", "127.0.0.1", "-t", str(threads),
                     "-tb", str(threads), "-c", str(ctx_size), "-np", "1", "--no-webui", "--no-cache-prompt",
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


# ----------------------------------------------------------------------------------------------- the method
def record_from_reply(name: str, reply: dict, prompt_len: int, dt: float, tokenizer):
    """A bench RunRecord from one /completion reply (see the module docstring for the counting)."""
    from specheads.infer.records import RunRecord

    ids = [int(t) for t in reply.get("tokens") or []]
    timings = reply.get("timings") or {}
    drafted, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
    if int(timings.get("predicted_n", len(ids))) != len(ids) or accepted > drafted:
        raise SpecheadsError(f"{name}: llama-server reply does not add up (tokens {len(ids)}, predicted_n "
                             f"{timings.get('predicted_n')}, drafted {drafted}, accepted {accepted})")
    forwards = len(ids) - accepted  # prefill emits the first token, each later forward 1 + its accepted drafts
    text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else reply.get("content", "")
    return RunRecord(method=name, prompt_id="", category="", turn=0, prompt_tokens=prompt_len, new_tokens=len(ids),
                     time_s=dt, target_forwards=forwards, step_tokens=[1] * len(ids) if drafted == 0 else None,
                     output_ids=ids, text=text)


class LlamaCppMethod:
    """A `bench.Method`: `generate(input_ids, max_new_tokens) -> RunRecord` through one llama-server."""

    def __init__(self, name: str, server: LlamaServer, tokenizer, temperature: float, info: dict[str, Any]):
        self.name, self.server, self.tokenizer, self.temperature = name, server, tokenizer, temperature
        self.info = info
        self.drafted = self.accepted = 0  # totals over every call (the bench's warm-up included)

    def generate(self, input_ids: list[int], max_new_tokens: int):
        import torch

        seed = torch.initial_seed() % 2**31  # bench seeds torch per prompt: the same for every method
        t0 = time.perf_counter()
        reply = self.server.complete(input_ids, max_new_tokens, self.temperature, seed)
        dt = time.perf_counter() - t0
        timings = reply.get("timings") or {}
        self.drafted += int(timings.get("draft_n", 0))
        self.accepted += int(timings.get("draft_n_accepted", 0))
        self.info.update(drafted=self.drafted, accepted=self.accepted,  # every call, warm-up included
                         acceptance=self.accepted / self.drafted if self.drafted else None)
        return record_from_reply(self.name, reply, len(input_ids), dt, self.tokenizer)


# ----------------------------------------------------------------------------------------------- bench glue
def _draft_source(label: str, heads: dict[str, str]) -> str:
    for key in (f"head:{label}", label):
        if key in heads:
            return heads[key]
    if Path(label).exists():
        return label
    raise SpecheadsError(f"--methods {PREFIX}{label}: no --head labelled {label!r} and no such folder or .gguf file "
                         f"(given: {[k.removeprefix('head:') for k in heads] or 'none'})")


def build_llamacpp_method(name: str, target, options, calib_ids: list[list[int]] | None = None) -> LlamaCppMethod:
    """`llama.cpp`, `llama.cpp:LABEL` or `llama.cpp-ngram` for `specheads bench`, its server started. `options`:
    bench.MethodOptions. The target GGUF is `options.llamacpp_target` when set, else the target's folder converted
    in the run's dtype (cached); `options.llamacpp_draft_max` sets --spec-draft-n-max (default: a DSpark head's
    drafts per block, else llama.cpp's 3); `options.llamacpp_p_min` sets a DSpark head's --spec-draft-p-min (None:
    chosen on `calib_ids` by infer/llamacpp_pmin.py when the head has a confidence head)."""
    from specheads.heads.gguf import draft_gguf, find_tools, spec_type_of, target_gguf

    tools = find_tools("llama-server", converter=True)
    outtype = GGUF_TYPE_OF_DTYPE.get(str(target.dtype), "bf16")
    model = target_gguf(options.llamacpp_target or target.name, outtype)
    info: dict[str, Any] = {"implementation": f"llama-server ({tools.version})", "target_gguf": str(model)}
    threads = int(options.threads or THREADS)  # bench --threads sets torch's and llama.cpp's
    draft, spec_args = None, ()
    if name == NGRAM:
        spec_args = NGRAM_ARGS
    elif name != PLAIN:
        src = _draft_source(name[len(PREFIX):], options.heads)
        draft = draft_gguf(src, target=None if src.endswith(".gguf") else target.name, outtype=outtype)
        spec_args = ("--spec-type", spec_type_of(draft))
        cfg = None if src.endswith(".gguf") else _head_config(src)
        n_max = options.llamacpp_draft_max
        if n_max is None and cfg is not None and cfg.kind == "dspark":  # a block head runs its whole block
            n_max = cfg.head_spec.num_drafts
        if n_max is not None:
            spec_args += ("--spec-draft-n-max", str(int(n_max)))
        info.update(head=src, draft_gguf=str(draft), draft_max=int(n_max) if n_max is not None else 3)
        p_min = options.llamacpp_p_min
        if p_min is None and cfg is not None and cfg.kind == "dspark" and cfg.head_spec.confidence_head:
            choice = tune_p_min(src, target, model, draft, spec_args, int(n_max), threads, calib_ids or [])
            p_min, info["p_min_choice"] = choice.p_min, choice.to_dict()
        if p_min is not None:
            spec_args += ("--spec-draft-p-min", f"{float(p_min):.6f}")
    info["server_args"] = list(spec_args)
    info["threads"] = threads
    server = LlamaServer(model, draft=draft, spec_args=spec_args, threads=threads).start()
    return LlamaCppMethod(name, server, target.tokenizer, float(options.temperature), info)


def _head_config(src: str):
    from specheads.heads.base import read_head_config

    return read_head_config(Path(src))


def tune_p_min(src: str, target, model: Path, draft: Path, spec_args: tuple[str, ...], n_max: int, threads: int,
               calib_ids: list[list[int]]):
    """The DSpark head's --spec-draft-p-min for this machine (infer/llamacpp_pmin.py): our blocks on the
    calibration prompts, llama-bench's verify curve for 1..n_max+1 tokens, and the draft's cost from one plain and
    one every-slot (p-min 0) completion of the first prompt."""
    from specheads.heads.base import load_head
    from specheads.heads.gguf import find_tools
    from specheads.infer.llamacpp_pmin import (Block, calibration_blocks, choose_p_min, step_seconds,
                                               verify_curve)

    if not calib_ids:
        raise SpecheadsError(f"{src}: choosing --spec-draft-p-min needs calibration prompts "
                             "(or pass --llamacpp-p-min P)")
    head = load_head(src, target)
    blocks = [Block(b.conf[:n_max], b.accepted) for b in calibration_blocks(head, target, calib_ids)]
    verify = verify_curve(find_tools("llama-bench").binary("llama-bench"), model, n_max + 1, threads)
    n_new = 64
    with LlamaServer(model, threads=threads) as plain:
        t_plain = step_seconds(plain.complete(calib_ids[0], n_new))
    with LlamaServer(model, draft, spec_args + ("--spec-draft-p-min", "0"), threads=threads) as every:
        t_every = step_seconds(every.complete(calib_ids[0], n_new))
    draft_rel = max(0.0, t_every / t_plain - verify[n_max + 1])
    choice = choose_p_min(blocks, verify, draft_rel)
    log.info("llama.cpp %s: --spec-draft-p-min %.4f (expected τ %.2f, %.2fx over plain; verify %s, draft %.3f of a "
             "token)", Path(src).name, choice.p_min, choice.expected_tau, choice.expected_speedup,
             {n: round(v, 3) for n, v in verify.items()}, draft_rel)
    return choice
