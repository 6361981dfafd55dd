"""The consumers of each non-native format (the names `--consumer` takes) and what each one's loader cannot read,
refused before anything is written with one message naming the consumer and the reason. The loaders (repository,
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
from specheads.heads.export.eagle3 import eagle31_problems
from specheads.heads.kinds import kind_spec
from specheads.utils import SpecheadsError

# (format, consumer) -> the loader, as error messages name it.
LOADERS = {
    ("eagle", "sglang"): "SGLang's LlamaForCausalLMEagle",
    ("eagle", "eagle-repo"): "the EAGLE repo's EAGLE-1 model",
    ("eagle-vllm", "vllm"): "vLLM's EagleLlamaForCausalLM",
    ("eagle3", "sglang"): "SGLang's LlamaForCausalLMEagle3",
    ("eagle3", "vllm"): "vLLM's Eagle3LlamaForCausalLM",
    ("eagle3", "llama.cpp"): "llama.cpp's EAGLE-3 converter",
    ("eagle3", "eagle-repo"): "the EAGLE-3 repo's model",
    ("speculators", "speculators"): "speculators' Eagle3DraftModel",
    ("speculators", "vllm"): "vLLM's speculators path (Eagle3LlamaForCausalLM)",
    ("medusa-vllm", "vllm"): "vLLM's Medusa",
}
OPT_IN = {("eagle3", "eagle-repo")}  # checked only when named: the repo captures hardcoded layers, no config ids


def consumers_of(fmt: str, default_only: bool = False, kind: str | None = None) -> list[str]:
    """The consumers of `fmt` (default_only: without the opt-in ones; kind: only those that read that head kind,
    i.e. not in its KindSpec.unread_by)."""
    out = [c for f, c in LOADERS if f == fmt and not (default_only and (f, c) in OPT_IN)]
    unread = kind_spec(kind).unread_by if kind is not None else {}
    return [c for c in out if f"{fmt}/{c}" not in unread]


def consumer_problems(fmt: str, consumer: str, cfg: HeadConfig) -> list[str]:
    """Why `consumer` cannot read the head `cfg` exported as `fmt` (empty: it reads it exactly)."""
    spec, L = cfg.head_spec, int(cfg.target_config["num_hidden_layers"])
    if fmt in ("eagle", "eagle-vllm") and cfg.target_config.get("model_type") != "llama":
        return [f"it builds Llama decoder layers and this head's layer is the target's "
                f"{cfg.target_config.get('model_type')!r} layer"]
    if fmt == "medusa-vllm":
        return _medusa_problems(cfg)
    if fmt not in ("eagle3", "speculators"):
        return []
    unread = kind_spec(cfg.kind).unread_by.get(f"{fmt}/{consumer}")
    if unread:
        return [unread]
    out = eagle31_problems(fmt, consumer, cfg)  # llama.cpp and the EAGLE-3 repo build no EAGLE-3.1 switch
    if spec.resolved_bias() and consumer != "sglang":
        out.append("its fc has no bias and this head was trained with one (head.bias true)")
    return out + _layer_problems(consumer, list(cfg.feature_layers), L)


def _medusa_problems(cfg: HeadConfig) -> list[str]:
    """vLLM 0.12-0.32 (0.33 removed Medusa) build each head's lm_head over the full vocabulary and read a draft
    vocabulary only as one lm_head shared by every head (original_lm_head, export/medusa.py)."""
    spec = cfg.head_spec
    if not cfg.draft_vocab_size or spec.options.lm_head != "per_head":
        return []
    return [f"vLLM 0.12-0.32 build each head's lm_heads.{{h}} over the full vocabulary (ParallelLMHead(vocab_size), "
            f"its weight_loader asserts the rows) and read a draft vocabulary only as one lm_head shared by every "
            f"head (original_lm_head), and this head has its own projection per head (head.medusa.lm_head per_head) "
            f"over a {cfg.draft_vocab_size}-token draft vocabulary, which no full-vocabulary rows reproduce "
            f"(vLLM <= 0.11 read it; 0.33 removed Medusa)"]


def _layer_problems(consumer: str, ids: list[int], L: int) -> list[str]:
    """EAGLE-3 feature layers a consumer cannot feed. Engines capture the input of decoder layer i (residual
    included) for each configured i, in layer order: ascending, once per layer. Unsorted ids are fine (export
    reorders fc's blocks to the ascending order); the rest is not."""
    out = []
    if len(set(ids)) < len(ids):
        out.append(f"it captures each target layer once, so the repeated feature layers {ids} cannot be fed")
    if consumer != "speculators" and len(ids) != 3:
        out.append(f"it builds fc for exactly 3 feature layers and this head reads {len(ids)} ({ids})")
    if L in ids:
        out.append(f"layer id {L} is our final post-norm state, which "
                   + ("speculators reads as the last layer's pre-norm output" if consumer == "speculators"
                      else "it never captures (it captures the inputs of layers 0..L-1)"))
    if consumer in ("sglang", "vllm") and 0 in ids:
        out.append("layer id 0 (the embeddings) is not captured: it adds the residual, which layer 0 has not got")
    if consumer == "eagle-repo" and sorted(set(ids)) != sorted({2, L // 2, L - 3}):
        out.append(f"it captures the hardcoded layers 2, L // 2, L - 3 = {sorted({2, L // 2, L - 3})} of the "
                   f"target, not {ids}")
    return out


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
            f"{LOADERS[fmt, c]} ({c}): " + "; ".join(p) for c, p in bad.items()) + f"; {hint}")
    return chosen
