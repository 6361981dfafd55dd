"""The flags `specheads generate`, `bench` (single and batched), `eval` and `export` share: one spelling per idea,
one help text, one dtype table (utils.DTYPE_NAMES). Old spellings stay accepted for one release as hidden aliases
that print a one-line notice naming the new flag:

    --head-lookup N                    -> --lookup N
    --draft-layers N                   -> --draft-model truncated:N
    --draft-target M                   -> --draft-model M
    bench --draft-tokens N             -> --tree draft-model=N   (a draft model's chain: generate --tree N)
    eval --tree-depth D --tree-width K -> --tree D,K             (a tree's depth and top-k: generate --tree D,K,TOTAL)
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from specheads.infer.drafters.draft_model import TRUNCATED, draft_model_source
from specheads.infer.scheduling.step import PRICINGS
from specheads.utils import DTYPE_NAMES, SpecheadsError

DEFAULT_DTYPE = "float32"  # exact: greedy speculative output equals plain decoding token for token
DEFAULT_DRAFT_LAYERS = 4  # generate --drafter draft-model without --draft-model
DRAFT_MODEL_LABEL = "draft-model"  # bench --tree draft-model=N: the draft-model method's chain length
EVAL_TREE = (4, 2)  # eval's simulated tree (depth, top-k) without --tree


class _Renamed(argparse.Action):
    """A flag's old spelling: hidden from --help, prints one line naming the new flag, stores into the new flag's
    dest (through `convert`) and remembers how the value was spelled (`spelled`) for error messages."""

    def __init__(self, option_strings, dest, new: str, convert=None, append: bool = False, **kw):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kw)
        self.new, self.convert, self.append = new, convert, append  # append: the new flag is a repeatable one

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.convert(values) if self.convert else values
        print(f"specheads: {option_string} is now {self.new}"
              f"{'' if self.convert is None else f' {value}'} (the old spelling goes in the next release)",
              file=sys.stderr)
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), value] if self.append else value)
        typed = dict(getattr(namespace, "_spelled", None) or {})
        typed[self.dest] = (option_string, values)
        namespace._spelled = typed


def spelled(args: argparse.Namespace, dest: str, flag: str) -> tuple[str, Any]:
    """(flag, value) as the user typed them (an old spelling included), for one-line errors."""
    return (getattr(args, "_spelled", None) or {}).get(dest) or (flag, getattr(args, dest))


def add_target(p: argparse.ArgumentParser, default: str | None = "smollm2-135m", what: str = "") -> None:
    p.add_argument("--target", default=default,
                   help=f"target: alias, hub id, local folder or .gguf file (default: smollm2-135m{what})")


DTYPE_WHY = (f"default {DEFAULT_DTYPE}: greedy output equals plain decoding token for token; bf16 is faster on most "
             "CPUs, its batched verification rounds otherwise")


def add_dtype(p: argparse.ArgumentParser, default: str | None = DEFAULT_DTYPE, why: str = DTYPE_WHY) -> None:
    """--dtype, one of utils.DTYPE_NAMES' spellings; `why` says the command's default (dtype_name: the full name)."""
    p.add_argument("--dtype", default=default, choices=sorted(DTYPE_NAMES), help=f"target dtype ({why})")


def add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="auto", choices=("auto", "owned", "hf"),
                   help="the target's decoding forward: owned = our Llama-family forward over a static KV cache "
                        "(bf16 on AVX512-BF16 CPUs: compiled kernels), hf = transformers' forward; auto (default) = "
                        "owned where the architecture is supported (infer/engine/runner.py); a log line says which")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                   help="compiled steps of the owned forward: C++ kernels for bf16 targets on AVX512-BF16 CPUs "
                        "(compiled once into the cache, ~30 s), captured CUDA graphs on a GPU; auto (default) = "
                        "where available, on = refused where not, off = PyTorch's eager ops (a log line says which)")


def add_plugin(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=None, metavar="MODULE|FILE.py",
                   help="import this Python module first (repeatable): its register_drafter calls add drafter kinds "
                        "(generate --drafter NAME, bench method drafter:NAME); drafters/plugins.py")


def add_allow_other_target(p: argparse.ArgumentParser) -> None:
    """--allow-other-target: generate, bench, eval and export use a head on a target of its family whose weights,
    quantization or tokenizer differ from those it was trained on (heads/base.py check_target), with one warning."""
    p.add_argument("--allow-other-target", action="store_true",
                   help="use a head on a target of the same family (shapes, vocabulary) whose weights, GGUF "
                        "quantization or tokenizer differ from the ones it was trained on (refused by default: "
                        "acceptance may collapse); one warning names what differs. Another family is always refused")


def allow_other_target(target, args: argparse.Namespace):
    """The loaded target, told whether --allow-other-target was given -> the target."""
    target.allow_other_target = bool(getattr(args, "allow_other_target", False))
    return target


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu | cuda (default: where the target loads)")


def add_pricing(p: argparse.ArgumentParser) -> None:
    """--pricing measured|profile: how the schedulers price a step (scheduling/step.py, batch_budget.py)."""
    p.add_argument("--pricing", default="measured", choices=PRICINGS,
                   help="scheduled methods (a block head's auto, +lookup, combo, +sched): measured (default) prices "
                        "each step by this run's drafting and loop seconds; profile prices it by the cached cost "
                        "profile alone (drafting unpriced), so two runs on one profile make the same choices")


def add_lookup(p: argparse.ArgumentParser, default: int, what: str) -> None:
    """--lookup N: the prompt-lookup chain scheduled with a head (old spelling --head-lookup)."""
    p.add_argument("--lookup", type=int, default=default, metavar="N", help=what)
    p.add_argument("--head-lookup", dest="lookup", type=int, action=_Renamed, new="--lookup")


def add_draft_model(p: argparse.ArgumentParser, what: str) -> None:
    """--draft-model NAME | truncated:N (old spellings --draft-target NAME, --draft-layers N)."""
    p.add_argument("--draft-model", default=None, metavar="NAME|truncated:N", help=what)
    p.add_argument("--draft-target", dest="draft_model", action=_Renamed, new="--draft-model")
    p.add_argument("--draft-layers", dest="draft_model", action=_Renamed, new="--draft-model",
                   convert=lambda n: f"{TRUNCATED}{n}")


def add_draft_tokens_alias(p: argparse.ArgumentParser) -> None:
    """bench's old --draft-tokens N: the draft-model method's chain, now `--tree draft-model=N` (bench) as
    `generate --drafter draft-model --tree N`."""
    p.add_argument("--draft-tokens", dest="tree", action=_Renamed, new="--tree", append=True,
                   convert=lambda n: f"{DRAFT_MODEL_LABEL}={n}")


def add_eval_tree(p: argparse.ArgumentParser) -> None:
    """eval's simulated full tree: --tree DEPTH,TOP_K (old spellings --tree-depth D, --tree-width K)."""
    p.add_argument("--tree", default=None, metavar="DEPTH,TOP_K",
                   help=f"simulated full tree: depth and branching per depth, as generate's DEPTH,TOP_K,TOTAL with "
                        f"every node kept (default {EVAL_TREE[0]},{EVAL_TREE[1]})")
    p.add_argument("--tree-depth", dest="tree_depth", type=int, default=None, action=_Renamed, new="--tree DEPTH,TOP_K")
    p.add_argument("--tree-width", dest="tree_width", type=int, default=None, action=_Renamed, new="--tree DEPTH,TOP_K")


def eval_tree(args: argparse.Namespace) -> tuple[int, int]:
    """eval's (depth, top-k) from --tree DEPTH,TOP_K, or the old --tree-depth / --tree-width (not both spellings)."""
    old = (args.tree_depth, args.tree_width)
    if args.tree is None:
        depth, width = (o if o is not None else d for o, d in zip(old, EVAL_TREE))
        for flag, value in (("--tree-depth", depth), ("--tree-width", width)):
            if value < 1:
                raise SpecheadsError(f"{flag} {value}: must be at least 1")
        return depth, width
    if old != (None, None):
        raise SpecheadsError(f"--tree {args.tree}: give the tree once (--tree DEPTH,TOP_K; not with --tree-depth / "
                             "--tree-width)")
    parts = [x.strip() for x in args.tree.split(",")]
    if len(parts) != 2 or not all(x.isdigit() and int(x) >= 1 for x in parts):
        raise SpecheadsError(f"--tree {args.tree}: expected DEPTH,TOP_K, two whole numbers of at least 1 (e.g. 4,2)")
    return int(parts[0]), int(parts[1])


def add_skip_layers(p: argparse.ArgumentParser) -> None:
    """--skip-layers auto|search|SPEC: the sublayers a layer-skip draft leaves out (drafters/self_spec.py)."""
    p.add_argument("--skip-layers", default="auto", metavar="auto|search|SPEC",
                   help="layer-skip draft (the target drafting for itself): the sublayers its draft pass leaves out; "
                        "auto (default) = the set searched on this target by measured acceptance per cost on a few "
                        "MT-bench questions, cached per target + machine; search = search again; SPEC = e.g. "
                        "m4-12,a9,20 (I: layer I, aI: its attention, mI: its MLP, ranges I-J)")


def dtype_name(text: str) -> str:
    """--dtype by its full name (float32, bfloat16, float16), as results.json records it."""
    return DTYPE_NAMES[text]


def draft_model_options(args: argparse.Namespace) -> dict:
    """generate's --draft-model as build_drafter's draft-model options: {"draft_target": NAME} or {"draft_layers":
    N} (default the target's first 4 layers); N is checked here before any model loads (at least 1) and against the
    target's layers by build_drafter."""
    spec = args.draft_model or f"{TRUNCATED}{DEFAULT_DRAFT_LAYERS}"
    if not spec.startswith(TRUNCATED):
        return {"draft_target": spec, "draft_layers": DEFAULT_DRAFT_LAYERS}
    flag, value = spelled(args, "draft_model", "--draft-model")
    return draft_model_source(spec, shown=f"{flag} {value or spec}")


def set_threads(threads: int | None) -> None:
    """--threads: torch's CPU threads (and llama.cpp's, through the bench's method options)."""
    if threads is None:
        return
    if threads < 1:
        raise SpecheadsError(f"--threads {threads}: must be at least 1")
    torch.set_num_threads(threads)


def check_max_new_tokens(n: int) -> None:
    """--max-new-tokens: at least 1."""
    if n < 1:
        raise SpecheadsError(f"--max-new-tokens {n}: must be at least 1")
