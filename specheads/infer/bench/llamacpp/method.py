"""llama.cpp as a `specheads bench` engine, on the same prompts and in the same run as the other methods (the
server: bench/llamacpp/server.py; the DSpark confidence cut: bench/llamacpp/pmin.py).

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

import logging
import time
from pathlib import Path
from typing import Any

import torch

from specheads.heads.base import load_head, read_head_config
from specheads.heads.gguf import draft_gguf, find_tools, spec_type_of, target_gguf
from specheads.heads.kinds import kind_spec
from specheads.infer.bench.llamacpp.pmin import Block, calibration_blocks, choose_p_min, step_seconds, verify_curve
from specheads.infer.bench.llamacpp.server import LlamaServer, default_threads
from specheads.infer.bench.names import (LLAMACPP_NGRAM, LLAMACPP_PLAIN, LLAMACPP_PREFIX, PROMPT_LOOKUP_MAX_NGRAM,
                                         PROMPT_LOOKUP_NUM_TOKENS)
from specheads.infer.bench.records import RunRecord
from specheads.infer.bench.served import labelled_source
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

# llama.cpp's own n-gram drafting with the n-gram size and draft length of our HF prompt-lookup method
NGRAM_ARGS = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(PROMPT_LOOKUP_MAX_NGRAM),
              "--spec-ngram-simple-size-m", str(PROMPT_LOOKUP_NUM_TOKENS))
GGUF_TYPE_OF_DTYPE = {"torch.float32": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16"}


# ----------------------------------------------------------------------------------------------- the method
def record_from_reply(name: str, reply: dict, prompt_len: int, dt: float, tokenizer):
    """A bench RunRecord from one /completion reply (see the module docstring for the counting)."""
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
    """A bench `Method` (bench/records.py): `generate(input_ids, max_new_tokens) -> RunRecord` through one
    llama-server."""

    def __init__(self, name: str, server: LlamaServer, tokenizer, temperature: float, info: dict[str, Any]):
        self.name, self.server, self.tokenizer, self.temperature = name, server, tokenizer, temperature
        self.info = info
        self.drafted = self.accepted = 0  # totals over every call (the bench's warm-up included)

    def generate(self, input_ids: list[int], max_new_tokens: int) -> RunRecord:
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
def build_llamacpp_method(name: str, target, options, calib_ids: list[list[int]] | None = None) -> LlamaCppMethod:
    """`llama.cpp`, `llama.cpp:LABEL` or `llama.cpp-ngram` for `specheads bench`, its server started. `options`:
    bench.methods.MethodOptions. The target GGUF is `options.llamacpp_target` when set, else the target's folder
    converted in the run's dtype (cached); `options.llamacpp_draft_max` sets --spec-draft-n-max (default: a DSpark
    head's drafts per block, else llama.cpp's 3); `options.llamacpp_p_min` sets a DSpark head's --spec-draft-p-min
    (None: chosen on `calib_ids` by bench/llamacpp/pmin.py when the head has a confidence head)."""
    tools = find_tools("llama-server", converter=True)
    outtype = GGUF_TYPE_OF_DTYPE.get(str(target.dtype), "bf16")
    model = target_gguf(options.llamacpp_target or target.name, outtype)
    info: dict[str, Any] = {"implementation": f"llama-server ({tools.version})", "target_gguf": str(model)}
    threads = int(options.threads or default_threads())  # bench --threads sets torch's and llama.cpp's
    draft, spec_args = None, ()
    if name == LLAMACPP_NGRAM:
        spec_args = NGRAM_ARGS
    elif name != LLAMACPP_PLAIN:
        src = labelled_source(name, name[len(LLAMACPP_PREFIX):], options.heads, "folder or .gguf file",
                              Path.exists)
        draft = draft_gguf(src, target=None if src.endswith(".gguf") else target.name, outtype=outtype)
        spec_args = ("--spec-type", spec_type_of(draft))
        cfg = None if src.endswith(".gguf") else read_head_config(Path(src))
        ks = None if cfg is None else kind_spec(cfg.kind)
        n_max = options.llamacpp_draft_max
        if n_max is None and ks is not None and ks.family == "block":  # a block head runs its whole block
            n_max = cfg.head_spec.num_drafts
        if n_max is not None:
            spec_args += ("--spec-draft-n-max", str(int(n_max)))
        info.update(head=src, draft_gguf=str(draft), draft_max=int(n_max) if n_max is not None else 3)
        p_min = options.llamacpp_p_min
        if p_min is None and ks is not None and ks.confidence and cfg.head_spec.options.confidence_head:
            choice = tune_p_min(src, target, model, draft, spec_args, int(n_max), threads, calib_ids or [])
            p_min, info["p_min_choice"] = choice.p_min, choice.to_dict()
        if p_min is not None:
            spec_args += ("--spec-draft-p-min", f"{float(p_min):.6f}")
    info["server_args"] = list(spec_args)
    info["threads"] = threads
    server = LlamaServer(model, draft=draft, spec_args=spec_args, threads=threads).start()
    return LlamaCppMethod(name, server, target.tokenizer, float(options.temperature), info)


def tune_p_min(src: str, target, model: Path, draft: Path, spec_args: tuple[str, ...], n_max: int, threads: int,
               calib_ids: list[list[int]]):
    """The DSpark head's --spec-draft-p-min for this machine (bench/llamacpp/pmin.py): our blocks on the
    calibration prompts, llama-bench's verify curve for 1..n_max+1 tokens, and the draft's cost from one plain and
    one every-slot (p-min 0) completion of the first prompt."""
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
