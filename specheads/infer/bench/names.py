"""The method-name grammar of `specheads bench`, in one place: which names exist, what a suffix adds, and how --head
values become method names. Pure functions of strings (and a head folder's config for a default label, a hub id's
snapshot folder in the hub cache), checked before any model loads.

- single runs: `vanilla`, `prompt-lookup` (HF), `plain`, `prompt-lookup-ours`, `recycling`, `draft-model` (ours),
  `head` / `head:LABEL` (one per --head), either with `+lookup` (the head and a prompt-lookup chain under one
  per-step scheduler), the unions `combo`, `combo+recycling`, `lookup+recycling`, the self-speculative `layer-skip`
  (the target with a skip set of its sublayers as its own draft), `layer-skip+lookup` and `combo+layer-skip`, and the
  llama.cpp engines
  `llama.cpp`, `llama.cpp:LABEL`, `llama.cpp-ngram`, vLLM's `vllm` and `vllm:LABEL` (bench/vllm/), and `drafter:NAME` (our loop with any registered
  training-free drafter kind, a --plugin's own included, at its default tree);
- the batched sweep (`--batch-sizes`): `vanilla`, `plain`, `prompt-lookup`, `recycling`, `head` / `head:LABEL`, every
  drafting one also with `+sched` (the batch verify budget).
"""
from __future__ import annotations

from pathlib import Path

from specheads.heads.base import read_head_config
from specheads.heads.locate import head_folder, parse_hub_id
from specheads.infer.drafters.registry import DRAFTERS
from specheads.utils import SpecheadsError

KNOWN_METHODS = ("vanilla", "prompt-lookup", "head", "draft-model", "plain", "prompt-lookup-ours", "combo",
                 "recycling", "lookup+recycling", "combo+recycling", "layer-skip", "layer-skip+lookup",
                 "combo+layer-skip")
# plain: our loop with no drafter (its gap to vanilla is our loop's overhead); prompt-lookup-ours: our loop with our
# PromptLookupDrafter (compare with HF's prompt-lookup); combo: every --head and prompt lookup under one scheduler;
# recycling: our loop with Token Recycling (training-free, drafters.TokenRecyclingDrafter); lookup+recycling: both
# training-free sources under one scheduler; combo+recycling: combo with Token Recycling as one more source
OURS_TRAINING_FREE = ("plain", "prompt-lookup-ours", "recycling")  # our loop with a drafter that needs no head
UNION_METHODS = ("combo", "combo+recycling", "lookup+recycling", "combo+layer-skip")  # several sources under one
# scheduler
HEADED_UNIONS = ("combo", "combo+recycling", "combo+layer-skip")  # unions over every --head
SELF_SPEC_METHODS = ("layer-skip", "layer-skip+lookup")  # the target's own layer-skip draft, alone or with lookup
# (drafters/self_spec.py; its skip set: --skip-layers)
LOOKUP_SUFFIX = "+lookup"  # head:LABEL+lookup = that head and a prompt-lookup chain under one per-step scheduler
PROMPT_LOOKUP_NUM_TOKENS = 10  # HF docs' example value for prompt_lookup_num_tokens (candidate tokens per step)
PROMPT_LOOKUP_MAX_NGRAM = 2  # HF default max_matching_ngram_size
HEAD_LOOKUP_TOKENS = PROMPT_LOOKUP_NUM_TOKENS  # +lookup chain length by default: the same chain as HF prompt lookup

LLAMACPP_PLAIN, LLAMACPP_NGRAM, LLAMACPP_PREFIX = "llama.cpp", "llama.cpp-ngram", "llama.cpp:"
VLLM_PLAIN, VLLM_PREFIX = "vllm", "vllm:"  # vLLM's CPU build (bench/vllm/): plain, our head LABEL as its speculator
DRAFTER_PREFIX = "drafter:"  # drafter:NAME = our loop with the registered training-free drafter NAME

BATCH_METHODS = ("vanilla", "plain", "prompt-lookup", "recycling")  # the sweep's methods besides the heads
SCHED_SUFFIX = "+sched"  # a drafting method under the batch verify budget (scheduling/batch_budget.py BudgetScheduler)


def split_lookup(name: str) -> tuple[str, bool]:
    """'head:eagle3+lookup' -> ('head:eagle3', True); names without the suffix -> (name, False)."""
    return (name[:-len(LOOKUP_SUFFIX)], True) if name.endswith(LOOKUP_SUFFIX) else (name, False)


def split_sched(name: str) -> tuple[str, bool]:
    """'head:eagle3+sched' -> ('head:eagle3', True)."""
    return (name[:-len(SCHED_SUFFIX)], True) if name.endswith(SCHED_SUFFIX) else (name, False)


def is_head_method(name: str) -> bool:
    """head, head:LABEL, and either with +lookup."""
    base, _ = split_lookup(name)
    return base == "head" or (base.startswith("head:") and len(base) > len("head:"))


def is_llamacpp_method(name: str) -> bool:
    """llama.cpp, llama.cpp-ngram, llama.cpp:LABEL."""
    return name in (LLAMACPP_PLAIN, LLAMACPP_NGRAM) or (name.startswith(LLAMACPP_PREFIX)
                                                         and len(name) > len(LLAMACPP_PREFIX))


def is_vllm_method(name: str) -> bool:
    """vllm, vllm:LABEL."""
    return name == VLLM_PLAIN or (name.startswith(VLLM_PREFIX) and len(name) > len(VLLM_PREFIX))


def is_drafter_method(name: str) -> bool:
    """drafter:NAME with NAME a registered training-free drafter kind (drafters/registry.py)."""
    kind = DRAFTERS.get(name[len(DRAFTER_PREFIX):]) if name.startswith(DRAFTER_PREFIX) else None
    return kind is not None and not kind.head


def needs_heads(names: list[str]) -> bool:
    """Whether a single run's methods need --head."""
    return any(is_head_method(n) or n in HEADED_UNIONS for n in names)


def check_method_names(names: list[str]) -> None:
    """One clear error for unknown --methods names (checked before the target loads)."""
    unknown = [n for n in names if n not in KNOWN_METHODS and not is_head_method(n) and not is_llamacpp_method(n)
               and not is_vllm_method(n) and not is_drafter_method(n)]
    if unknown:
        free = [k for k, v in DRAFTERS.items() if not v.head]
        raise SpecheadsError(f"--methods: unknown method(s) {unknown}; choose from {list(KNOWN_METHODS)} "
                             f"or head:LABEL, with {LOOKUP_SUFFIX} after a head method to schedule a prompt-lookup "
                             "chain with it, "
                             "or llama.cpp, llama.cpp:LABEL, llama.cpp-ngram, vllm, vllm:LABEL, "
                             f"or {DRAFTER_PREFIX}NAME for a registered drafter ({', '.join(free)}; --plugin adds "
                             "your own)")


def check_batch_methods(names: list[str]) -> None:
    """One clear error for names the batch sweep does not know (before the target loads)."""
    self_spec = [n for n in names if split_sched(n)[0] in SELF_SPEC_METHODS + ("combo+layer-skip",)]
    if self_spec:
        raise SpecheadsError(f"--methods {','.join(self_spec)} with --batch-sizes: a layer-skip draft shares the "
                             "owned forward's single-request cache, and the batched loop runs the HF forward over a "
                             "padded batch cache; bench it without --batch-sizes")
    bad = []
    for n in names:
        base, sched = split_sched(n)
        known = base in BATCH_METHODS or is_head_method(base)
        if not known or (sched and base in ("vanilla", "plain")):
            bad.append(n)
    if bad:
        raise SpecheadsError(f"--methods {','.join(names)} with --batch-sizes: unknown {bad}; choose from "
                             f"{list(BATCH_METHODS)}, head or head:LABEL, and drafting methods with "
                             f"{SCHED_SUFFIX} (the batch verify budget)")


def default_methods(heads: bool, draft_model: bool) -> list[str]:
    """A single run's methods without --methods: HF's two, plus head / draft-model when given."""
    return ["vanilla", "prompt-lookup"] + (["head"] if heads else []) + (["draft-model"] if draft_model else [])


def default_batch_methods(heads: dict[str, str]) -> list[str]:
    """The sweep's methods without --methods: vanilla, plain, and every drafting method with and without +sched."""
    drafting = ["prompt-lookup"] + list(heads)
    return ["vanilla", "plain"] + [m + s for m in drafting for s in ("", SCHED_SUFFIX)]


def expand_heads(names: list[str], heads: dict[str, str], split) -> list[str]:
    """`head` (with its suffix, split off by `split`) stands for every --head given: head+lookup with heads
    head:a, head:b -> head:a+lookup, head:b+lookup."""
    out: list[str] = []
    for n in names:
        base, suffixed = split(n)
        suffix = n[len(base):] if suffixed else ""
        out += [h + suffix for h in heads] if base == "head" and heads else [n]
    return out


def split_head(value: str) -> tuple[str, str]:
    """One --head value as (label, folder): a value that is itself a folder is taken whole, even when its path holds
    '='; else LABEL=DIR at the first '=' whose DIR is a folder or, after a label without '/', a hub id
    (org/name[@revision]). Neither: one error with the hint."""
    if "=" not in value or Path(value).is_dir():
        return "", value
    for i, ch in enumerate(value):
        hub = "/" not in value[:i] and parse_hub_id(value[i + 1:]) is not None  # a label never holds a '/'
        if ch == "=" and (Path(value[i + 1:]).is_dir() or hub):
            return value[:i], value[i + 1:]
    label, _, folder = value.partition("=")
    raise SpecheadsError(f"--head {value}: no such folder, and read as LABEL=DIR (label {label!r}) {folder!r} is not "
                         f"one either; a folder whose own path holds '=' is used whole when it exists")


def head_entries(spec) -> dict[str, str]:
    """--head values -> {method name: head folder}. One unlabelled head is the method `head`; otherwise each is
    `head:LABEL`, with LABEL given as LABEL=DIR (split_head) or else the folder's head kind (eagle3, medusa, ...)."""
    if not spec:
        return {}
    items = [spec] if isinstance(spec, str) else list(spec)
    pairs = [(label, _local(folder)) for label, folder in map(split_head, items)]
    if len(pairs) == 1 and not pairs[0][0]:
        return {"head": pairs[0][1]}
    out: dict[str, str] = {}
    for value, (label, folder) in zip(items, pairs):
        name = f"head:{label or _kind_from_folder(folder)}"
        if name in out:
            raise SpecheadsError(f"--head {value}: label {name[5:]!r} used twice; name them as LABEL=DIR")
        out[name] = folder
    return out


def head_trees(values, heads: dict[str, str]) -> dict[str, str]:
    """--tree values -> {head folder: tree text}. `SPEC` applies to every head; `LABEL=SPEC` to the head of method
    head:LABEL only (an unlabelled --head is `head`), so one run can serve an EAGLE head a tree and a block head its
    block. At most one unlabelled value (default auto) and one value per label."""
    items = [values] if isinstance(values, str) else list(values or ["auto"])
    labels = {name.split(":", 1)[1] if ":" in name else name: folder for name, folder in heads.items()}
    default, per_label = None, {}
    for value in items:
        label, sep, spec = str(value).partition("=")
        if not sep:
            if default is not None:
                raise SpecheadsError(f"--tree {value}: a second tree for every head (the first: {default}); give "
                                     f"per-head trees as LABEL=SPEC")
            default = value
        elif label not in labels:
            raise SpecheadsError(f"--tree {value}: {label!r} is not a --head label (labels: {sorted(labels)})")
        elif label in per_label:
            raise SpecheadsError(f"--tree {value}: head {label!r} has a tree already ({per_label[label]})")
        else:
            per_label[label] = spec.strip()
    out = {folder: per_label.get(label, default or "auto") for label, folder in labels.items()}
    for label, folder in labels.items():
        if out[folder] != per_label.get(label, default or "auto"):
            raise SpecheadsError(f"--tree: heads sharing the folder {folder} were given different trees")
    return out


def _local(folder: str) -> str:
    """A hub id that is no local path as its snapshot folder in the hub cache (heads/locate.py); paths as given."""
    if Path(folder).exists() or parse_hub_id(folder) is None:
        return folder
    return str(head_folder(folder))


def _kind_from_folder(path: str) -> str:
    try:
        return str(read_head_config(Path(path)).kind)
    except SpecheadsError as e:
        raise SpecheadsError(f"--head {path}: no readable head config ({e}); give it as LABEL=DIR") from None
