"""The consumers of each non-native format (the names `--consumer` takes) and what each one's loader cannot read,
refused before anything is written with one message naming the consumer and the reason. Each format's consumers, their
loaders and what they cannot read are declared by the format's own module (export/formats.py Format: loaders,
opt_in, problems); a kind's KindSpec.unread_by adds what a consumer cannot read of that kind. The loaders (repository,
commit and path in docs/exports.md):
- SGLang: python/sglang/srt/models/llama_eagle.py (LlamaForCausalLMEagle), llama_eagle3.py
  (LlamaForCausalLMEagle3), llama.py (the aux-state capture);
- vLLM: vllm/model_executor/models/llama_eagle.py (EagleLlamaForCausalLM), llama_eagle3.py
  (Eagle3LlamaForCausalLM), medusa.py (Medusa, 0.x-0.32), vllm/transformers_utils/configs/speculators/algos.py;
- llama.cpp: convert_hf_to_gguf.py (its EAGLE-3 converter);
- the EAGLE repos: SafeAILab/EAGLE eagle/model/cnets1.py (EAGLE-1), cnets.py and modeling_llama_kv.py (EAGLE-3);
- speculators: models/eagle3 (Eagle3DraftModel), models/peagle (PEagleDraftModel).
Release ranges (docs/exports.md's table): EAGLE-3.1 heads read by SGLang >= 0.5.23 and vLLM >= 0.34, Medusa by vLLM <= 0.32,
P-EAGLE by speculators only (vLLM 0.34 refuses it).
"""
from __future__ import annotations

from specheads.heads.base import HeadConfig
from specheads.heads.export.formats import format_spec
from specheads.heads.kinds import kind_spec
from specheads.utils import SpecheadsError


def consumers_of(fmt: str, default_only: bool = False, kind: str | None = None) -> list[str]:
    """The consumers of `fmt` (default_only: without the opt-in ones; kind: only those that read that head kind,
    i.e. not in its KindSpec.unread_by)."""
    f = format_spec(fmt)
    out = [c for c in (f.loaders if f else ()) if not (default_only and c in f.opt_in)]
    unread = kind_spec(kind).unread_by if kind is not None else {}
    return [c for c in out if f"{fmt}/{c}" not in unread]


def consumer_problems(fmt: str, consumer: str, cfg: HeadConfig) -> list[str]:
    """Why `consumer` cannot read the head `cfg` exported as `fmt` (empty: it reads it exactly): the kind's
    KindSpec.unread_by, else the format's own problems."""
    f = format_spec(fmt)
    if f is None or f.problems is None:
        return []
    unread = kind_spec(cfg.kind).unread_by.get(f"{fmt}/{consumer}")
    if unread:
        return [unread]
    return f.problems(fmt, consumer, cfg)


def check_consumers(fmt: str, cfg: HeadConfig, consumers, where: str) -> list[str]:
    """The consumers an export is checked for (default: the format's engines); one SpecheadsError naming each
    consumer that cannot read the head and why."""
    known = consumers_of(fmt)
    chosen = list(consumers) if consumers else consumers_of(fmt, default_only=True, kind=cfg.kind)
    for c in chosen:
        if c not in known:
            raise SpecheadsError(f"--consumer {c!r}: --format {fmt} is read by {known}")
    bad = {c: consumer_problems(fmt, c, cfg) for c in chosen}
    bad = {c: p for c, p in bad.items() if p}
    if bad:
        readers = [c for c in known if not consumer_problems(fmt, c, cfg)]
        hint = (f"export for {readers} only with --consumer (repeatable)" if readers else
                f"no {fmt} consumer reads this head (the native format keeps it)")
        raise SpecheadsError(f"--format {fmt}: {where} cannot be exported for " + "; ".join(
            f"{format_spec(fmt).loaders[c]} ({c}): " + "; ".join(p) for c, p in bad.items()) + f"; {hint}")
    return chosen
