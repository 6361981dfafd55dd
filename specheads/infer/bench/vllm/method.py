"""vLLM (its CPU build, in .venv-vllm) as a `specheads bench` engine, on the same prompts and in the same run as the
other methods (the server: bench/vllm/server.py).

Methods (each one vLLM OpenAI server on 127.0.0.1, started once for the run, stopped at exit):
- `vllm`: plain decoding of the target's HF folder (a GGUF / alias target: the folder it was converted into in the
  cache, target.resolve_target_path) in the run's dtype;
- `vllm:LABEL`: our head LABEL (a `--head LABEL=DIR`, `head` for a single unlabelled --head, or a head folder) as
  vLLM's speculator: the head exported as `speculators` once (cached in $SPECHEADS_CACHE/vllm/heads/), drafting a
  chain of K tokens per step, K the head's `--tree chain:K` (the same draft length as head:LABEL; default 3,
  vLLM's usual num_speculative_tokens). vLLM drafts chains only: a tree --tree is refused.

Per prompt the token ids rendered by our chat template go to /v1/completions (temperature 0 = greedy,
`max_tokens`, `return_token_ids`), so both engines see the same tokens; vLLM's spec-decode counters are read from
/metrics before and after (one request at a time). Target forwards that emit tokens are counted as for HF
generate and llama.cpp: the prefill emits the first token, every later forward 1 + its accepted drafts, so
forwards = new tokens - accepted and the report's τ = new tokens / forwards. vLLM's own acceptance length,
1 + accepted / drafting steps (its metrics' definition, the figure our engine's τ compares with: our prefill emits
no token), its per-position acceptance and the totals go to the method's `info` (results.json methods_info;
warm-up included, as llama.cpp's).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from specheads.heads.base import read_head_config
from specheads.heads.export.speculators import SPECULATORS
from specheads.heads.kinds import kind_spec, kinds
from specheads.heads.locate import head_folder
from specheads.infer.bench.names import VLLM_PLAIN, VLLM_PREFIX
from specheads.infer.bench.records import RunRecord
from specheads.infer.bench.served import labelled_source
from specheads.infer.bench.vllm.server import SPEC_PREFIX, VllmServer
from specheads.infer.drafters.registry import parse_tree
from specheads.utils import SpecheadsError, cache_root

log = logging.getLogger(__name__)

DEFAULT_DRAFT_TOKENS = 3  # vLLM's examples' num_speculative_tokens for EAGLE-3 (and llama.cpp's default chain)
DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}
DRAFTS, DRAFT_TOKENS, ACCEPTED = (SPEC_PREFIX + n for n in ("num_drafts_total", "num_draft_tokens_total",
                                                             "num_accepted_tokens_total"))


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """after - before for every counter (a counter absent before counts from 0)."""
    return {k: int(round(v - before.get(k, 0.0))) for k, v in after.items()}


def acceptance_figures(drafts: int, drafted: int, accepted: int, per_pos: list[int]) -> dict[str, Any]:
    """vLLM's own figures from its counters: acceptance length 1 + accepted / drafting steps, acceptance rate
    accepted / drafted tokens, per-position acceptance (accepted at position i / drafting steps)."""
    return {"num_drafts": drafts, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "per_position": [a / drafts for a in per_pos] if drafts else None}


def record_from_choice(name: str, choice: dict, delta: dict[str, int], prompt_len: int, dt: float, tokenizer
                       ) -> RunRecord:
    """A bench RunRecord from one /v1/completions choice and the counters it moved (module docstring)."""
    ids = [int(t) for t in choice["token_ids"]]
    drafted, accepted = delta.get(DRAFT_TOKENS, 0), delta.get(ACCEPTED, 0)
    if accepted > drafted or (ids and accepted >= len(ids)):
        raise SpecheadsError(f"{name}: vLLM's counters do not add up (tokens {len(ids)}, drafted {drafted}, "
                             f"accepted {accepted})")
    stop = {"length": "max_new_tokens", "stop": "eos"}.get(str(choice.get("finish_reason")), "")
    text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else choice.get("text", "")
    return RunRecord(method=name, prompt_id="", category="", turn=0, prompt_tokens=prompt_len, new_tokens=len(ids),
                     time_s=dt, target_forwards=len(ids) - accepted,
                     step_tokens=[1] * len(ids) if drafted == 0 else None, output_ids=ids, text=text,
                     stop_reason=stop)


class VllmMethod:
    """A bench `Method` (bench/records.py): `generate(input_ids, max_new_tokens) -> RunRecord` through one vLLM
    server."""

    def __init__(self, name: str, server: VllmServer, tokenizer, temperature: float, info: dict[str, Any]):
        self.name, self.server, self.tokenizer, self.temperature = name, server, tokenizer, temperature
        self.info = info
        self.totals: dict[str, int] = {}  # counter deltas over every call (the bench's warm-up included)

    def generate(self, input_ids: list[int], max_new_tokens: int) -> RunRecord:
        seed = torch.initial_seed() % 2**31  # bench seeds torch per prompt: the same for every method
        before = self.server.spec_counters()
        t0 = time.perf_counter()
        choice = self.server.complete(input_ids, max_new_tokens, self.temperature, seed)
        dt = time.perf_counter() - t0
        delta = counter_delta(before, self.server.spec_counters())
        for k, v in delta.items():
            self.totals[k] = self.totals.get(k, 0) + v
        t = self.totals
        per_pos = [t[k] for k in sorted((k for k in t if k.startswith(SPEC_PREFIX + "num_accepted_tokens_per_pos")),
                                        key=lambda k: int(k.rsplit("[", 1)[1].rstrip("]")))]
        if self.server.speculative:
            self.info.update(acceptance_figures(t.get(DRAFTS, 0), t.get(DRAFT_TOKENS, 0), t.get(ACCEPTED, 0),
                                                per_pos))
        return record_from_choice(self.name, choice, delta, len(input_ids), dt, self.tokenizer)

    def close(self) -> None:
        self.server.stop()


# ----------------------------------------------------------------------------------------------- bench glue
def speculators_kinds() -> list[str]:
    return [k for k, ks in kinds().items() if SPECULATORS.name in ks.formats]


def draft_tokens(src: str, tree, kind: str, cfg) -> int:
    """K for vLLM's num_speculative_tokens: the head's --tree chain:K (auto: DEFAULT_DRAFT_TOKENS)."""
    text = tree.get(src, "auto") if isinstance(tree, dict) else (tree or "auto")
    spec = parse_tree(str(text), kind, cfg)
    if spec.mode == "auto":
        return DEFAULT_DRAFT_TOKENS
    if spec.mode == "dynamic" and spec.top_k == 1 and spec.total_tokens == spec.depth:
        return spec.depth
    if spec.mode == "tokens" and spec.num_tokens:  # a block head's chain:K (P-EAGLE, DFlash): its first K drafts
        return spec.num_tokens
    if spec.mode == "static" and all(len(c) == i + 1 and not any(c) for i, c in enumerate(spec.choices)):
        return len(spec.choices)
    raise SpecheadsError(f"--tree {text} for {src}: vLLM drafts a chain; give that head --tree chain:K (K draft "
                         "tokens per step, the same chain for head:LABEL and vllm:LABEL)")


# The speculative-config fields vLLM's own speculators reader derives from an export's speculators_model_type
# (vllm/transformers_utils/configs/speculators/base.py, 0.32: peagle -> eagle3 with parallel drafting, dflash2 ->
# dflash, the rest as named). They are passed explicitly: vLLM 0.32 first guesses the method from the draft folder's
# *name* ("eagle" in "peagle-..." made it plain EAGLE and it skipped P-EAGLE's mask_hidden; a hash-named EAGLE-3
# folder ran as a plain "draft_model" and failed: forward() missing 'hidden_states')
VLLM_SPECULATIVE = {"eagle": {"method": "eagle"}, "eagle3": {"method": "eagle3"}, "dflash": {"method": "dflash"},
                    "dspark": {"method": "dspark"}, "dflash2": {"method": "dflash"},
                    "peagle": {"method": "eagle3", "parallel_drafting": True}}


def speculators_export(src: str, target, k: int, verifier: str) -> Path:
    """The head as a `speculators` folder (vLLM's draft format) naming `verifier` (the folder vLLM serves), exported
    once into $SPECHEADS_CACHE/vllm/heads/ (keyed by the head's config and weights, K and the verifier)."""
    from specheads.heads.export import export_head

    folder = head_folder(src)
    h = hashlib.sha256(f"k={k}|{verifier}".encode())
    for p in sorted(folder.iterdir()):
        if p.name == "config.json" or p.name.endswith(".safetensors") or p.name.endswith(".index.json"):
            h.update(p.name.encode() + p.read_bytes())
    out = cache_root() / "vllm" / "heads" / f"{folder.name}-{h.hexdigest()[:12]}"
    if not (out / "config.json").is_file():
        log.info("exporting %s for vLLM (speculators, %d speculative tokens) into %s", folder, k, out)
        export_head(folder, SPECULATORS.name, out, target=target, speculative_tokens=k,
                    verifier_name_or_path=verifier)
    return out


def build_vllm_method(name: str, target, options) -> VllmMethod:
    """`vllm` or `vllm:LABEL` for `specheads bench`, its server started (`options`: bench.methods.MethodOptions;
    --threads sets the server's OpenMP threads, default 1: the fewest that serve, on a machine shared with others;
    options.vllm_eager: --enforce-eager, no torch.compile)."""
    from specheads.target import resolve_target_path

    dtype = DTYPES.get(str(target.dtype))
    if dtype is None:
        raise SpecheadsError(f"--methods {name}: vLLM serves float32, bfloat16 or float16, not {target.dtype}")
    model = resolve_target_path(target.name)
    threads = int(options.threads or 1)
    info: dict[str, Any] = {"implementation": "vLLM OpenAI server (.venv-vllm)", "model": str(model),
                            "dtype": dtype, "threads": threads}
    speculative = None
    if name != VLLM_PLAIN:
        src = labelled_source(name, name[len(VLLM_PREFIX):], options.heads)
        cfg = read_head_config(head_folder(src))
        if SPECULATORS.name not in kind_spec(cfg.kind).formats:
            raise SpecheadsError(f"--methods {name}: {src} holds a {cfg.kind} head, which has no speculators export "
                                 f"(vLLM's draft format; kinds that have one: {', '.join(speculators_kinds())})")
        k = draft_tokens(src, options.tree, str(cfg.kind), cfg)
        export = speculators_export(src, target, k, str(model))
        speculative = {"model": str(export), "num_speculative_tokens": k}
        method = json.loads((export / "config.json").read_text()).get("speculators_model_type")
        speculative.update(VLLM_SPECULATIVE.get(method, {}))  # vLLM's own reading of that type, said explicitly
        info.update(head=str(src), export=str(export), draft_tokens=k)
    info["speculative_config"] = speculative
    info["eager"] = bool(options.vllm_eager)
    server = VllmServer(model, dtype=dtype, speculative=speculative, threads=threads,
                        eager=bool(options.vllm_eager)).start()
    info["server_args"] = server.args[3:]
    info["log"] = str(server.log_file)
    return VllmMethod(name, server, target.tokenizer, float(options.temperature), info)
