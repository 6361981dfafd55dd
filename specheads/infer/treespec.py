"""What `--tree` says: one spec type and one parser for `specheads generate`, `specheads bench` and library callers.

A drafter's family says how it grows its tree and therefore which forms `--tree` takes (drafters.DRAFTERS names
each drafter's family once):
- dynamic (EAGLE, EAGLE-3): the EAGLE-2 dynamic tree, `DEPTH,TOP_K,TOTAL` (e.g. 5,8,48: expand the TOP_K best
  nodes per depth for DEPTH depths, keep the TOTAL best); rank paths (`chain:K`, JSON) are read as the dynamic tree
  of their depth, widest rank and size; `auto` = the tree that pays on this machine (infer/autotree.py);
- static (Medusa): rank paths, `chain:K` = [[0], [0, 0], ...] or JSON such as [[0], [0, 0], [1]] (path of per-depth
  ranks), `default` = tree.DEFAULT_MEDUSA_CHOICES, or `auto`;
- block (DSpark / DFlash block heads): `auto` = the per-step scheduler (infer/scheduling/step.py: each step verifies the
  prefix of the block that pays on this machine), or a fixed number of draft tokens per step, `K` or `chain:K`
  (1..the head's drafts per block); `tree:N` = the best-first tree over the block's per-position top ranks
  (drafters/blocktree.py, DDTree) of N draft nodes, `tree:auto` = the per-step scheduler choosing from it;
- tokens (prompt lookup, draft model): draft tokens per step, a chain, e.g. `8`;
- none (plain decoding): drafts nothing, takes no `--tree`.
Sizes are bounded (TreeLimits): a spec the head or the machine cannot hold is one SpecheadsError naming the flag,
the bound and the accepted forms, before anything is allocated.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from specheads.infer.tree import DEFAULT_MEDUSA_CHOICES, normalize_choices
from specheads.utils import SpecheadsError

MAX_TREE_NODES = 1024  # draft nodes per step: EAGLE-2 uses 60, Sequoia up to 768 on GPUs; one verification forward
# of more rows costs as much as many plain forwards on any machine
MAX_TREE_DEPTH = 64  # draft depth (a chain's tokens per step): trained heads draft <= 10 deep, lookup chains ~10-20
MAX_TOP_K = 64  # children per node / rank: EAGLE-2 uses 10; each depth of a dynamic tree scores TOP_K x TOP_K
# candidates and runs TOP_K head rows

FAMILIES = {
    "dynamic": f"DEPTH,TOP_K,TOTAL (EAGLE-2 dynamic tree: DEPTH 1..{MAX_TREE_DEPTH}, TOP_K 1..{MAX_TOP_K} and at "
               f"most the draft vocabulary, TOTAL 1..{MAX_TREE_NODES} draft nodes; e.g. 5,8,48), chain:K, JSON rank "
               f"paths such as [[0],[0,0],[1]], or auto",
    "static": f"chain:K (K 1..{MAX_TREE_DEPTH}) or JSON rank paths such as [[0],[0,0],[1]] (Medusa static tree: "
              f"ranks 0..{MAX_TOP_K - 1} and below the draft vocabulary, at most {MAX_TREE_NODES} paths), default, "
              f"or auto",
    "block": "auto (the per-step scheduler: the prefix of each block that pays on this machine), a fixed number "
             "of draft tokens per step, K or chain:K (K 1..the head's drafts per block), or a tree over the block, "
             f"tree:N (the best-first tree of N 1..{MAX_TREE_NODES} draft nodes) or tree:auto (the scheduler "
             "chooses from it)",
    "tokens": f"a number of draft tokens per step, 1..{MAX_TREE_DEPTH} (e.g. 8)",
    "none": "no --tree (plain decoding drafts nothing)",
}
TREE_MODES = ("auto", "static", "dynamic", "tokens", "blocktree", "none")
TREE_NAMES = {"dynamic": "EAGLE-2 dynamic tree", "static": "static Medusa tree"}  # how summaries name the trees
STATIC_TREES = {"default": DEFAULT_MEDUSA_CHOICES}  # --tree words that name a static tree (rank paths); a static
# drafter's module may name its own (name_static_tree)


def name_static_tree(word: str, paths: Sequence[Sequence[int]]) -> None:
    """Make `--tree WORD` stand for the static tree `paths` (e.g. the Medusa drafter's name for its default)."""
    STATIC_TREES[word] = paths


@dataclass(frozen=True)
class TreeLimits:
    """Bounds a spec must respect. max_rank: ranks a head can draft = its draft vocabulary V' (None = unknown)."""

    max_rank: int | None = None
    max_nodes: int = MAX_TREE_NODES
    max_depth: int = MAX_TREE_DEPTH
    max_top_k: int = MAX_TOP_K


@dataclass(frozen=True)
class TreeSpec:
    """A parsed `--tree`. mode: auto | static (choices) | dynamic (depth, top_k, total_tokens) | tokens (num_tokens)
    | none. `text` keeps what was given, for the record."""

    mode: str
    choices: tuple[tuple[int, ...], ...] = ()  # static: rank paths, parents first (tree.normalize_choices)
    depth: int = 0  # dynamic: expansion steps
    top_k: int = 0  # dynamic: children per expanded node and frontier width
    total_tokens: int = 0  # dynamic: draft nodes kept (root excluded); blocktree: draft nodes (0 = scheduled)
    num_tokens: int = 0  # tokens: chain length per step
    text: str = ""

    def __post_init__(self) -> None:
        if self.mode not in TREE_MODES:
            raise ValueError(f"TreeSpec: mode {self.mode!r} is not one of {TREE_MODES}")

    @classmethod
    def auto(cls) -> "TreeSpec":
        return cls("auto", text="auto")

    @classmethod
    def static(cls, choices: Sequence[Sequence[int]], text: str = "") -> "TreeSpec":
        return cls("static", choices=tuple(normalize_choices(choices)), text=text)

    @classmethod
    def dynamic(cls, depth: int, top_k: int, total_tokens: int, text: str = "") -> "TreeSpec":
        return cls("dynamic", depth=depth, top_k=top_k, total_tokens=total_tokens,
                   text=text or f"{depth},{top_k},{total_tokens}")

    @classmethod
    def tokens(cls, num_tokens: int, text: str = "") -> "TreeSpec":
        return cls("tokens", num_tokens=num_tokens, text=text or str(num_tokens))

    @classmethod
    def block_tree(cls, total_tokens: int, text: str = "") -> "TreeSpec":
        """A tree over a block head's drafts: total_tokens draft nodes, best first; 0 = the scheduler chooses."""
        return cls("blocktree", total_tokens=total_tokens, text=text or f"tree:{total_tokens or 'auto'}")

    @property
    def scheduled(self) -> bool:
        """A block head's per-step scheduler chooses what to verify (`auto`, `tree:auto`)."""
        return self.mode == "auto" or (self.mode == "blocktree" and not self.total_tokens)

    @classmethod
    def none(cls) -> "TreeSpec":
        return cls("none")

    def summary(self) -> str:
        if self.mode == "dynamic":
            return f"{TREE_NAMES['dynamic']}, {self.total_tokens} nodes, depth {self.depth}, top-k {self.top_k}"
        if self.mode == "static":
            return f"{TREE_NAMES['static']}, {len(self.choices)} nodes"
        if self.mode == "tokens":
            return f"a chain of up to {self.num_tokens} draft tokens"
        if self.mode == "blocktree":
            size = f"{self.total_tokens} nodes" if self.total_tokens else "chosen per step (auto)"
            return f"best-first tree over the block, {size}"
        return {"auto": "chosen for this machine (auto)", "none": "no draft (plain decoding)"}[self.mode]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["choices"] = [list(c) for c in self.choices]
        return d


def parse_tree_spec(text: str, family: str, *, drafter: str = "this drafter", limits: TreeLimits | None = None,
                    flag: str = "--tree") -> TreeSpec:
    """`--tree TEXT` for a drafter of `family` (FAMILIES) -> TreeSpec, validated against `limits`. `drafter` names
    the drafter in messages (e.g. "an EAGLE-3 head", "prompt-lookup")."""
    if family not in FAMILIES:
        raise ValueError(f"parse_tree_spec: unknown drafter family {family!r} (one of {list(FAMILIES)})")
    limits = limits or TreeLimits()
    raw = str(text).strip()
    bad = _complaint(flag, raw, family, drafter)
    if family == "none":
        raise bad("plain decoding drafts nothing")
    if raw == "auto":
        if family == "tokens":
            raise bad("automatic tree choice is for heads that draft trees")
        return TreeSpec.auto()
    if family == "block" and raw.startswith("tree:"):
        n = raw.split(":", 1)[1].strip()
        nodes = 0 if n == "auto" else _whole(n, bad, "expected tree:N or tree:auto")
        if n != "auto":
            _within(nodes, 1, limits.max_nodes, "the tree's draft nodes N", bad)
        spec = TreeSpec.block_tree(nodes, text=raw)
    elif family == "tokens" or (family == "block" and not raw.startswith("chain:")):
        spec = TreeSpec.tokens(_whole(raw, bad, "expected a whole number of tokens"), text=raw)
    elif family == "block":
        spec = TreeSpec.tokens(_whole(raw.split(":", 1)[1].strip(), bad, "expected chain:K with K a whole number"),
                               text=raw)
    elif family == "dynamic" and raw.count(",") == 2 and not raw.startswith("["):
        depth, top_k, total = (_whole(x.strip(), bad, "expected three whole numbers DEPTH,TOP_K,TOTAL")
                               for x in raw.split(","))
        spec = TreeSpec.dynamic(depth, top_k, total, text=raw)
    else:
        paths = [tuple(c) for c in STATIC_TREES[raw]] if family == "static" and raw in STATIC_TREES \
            else _rank_paths(raw, limits, bad)
        _check_paths(paths, limits, bad)
        if family == "static":
            spec = TreeSpec.static(paths, text=raw)
        else:  # dynamic: rank paths as the EAGLE-2 tree of their depth, widest rank and size
            spec = TreeSpec.dynamic(max(len(c) for c in paths), max(max(c) for c in paths) + 1, len(paths), text=raw)
    return check_tree_spec(spec, family, drafter=drafter, limits=limits, flag=flag)


FAMILY_MODES = {"dynamic": ("dynamic", "auto"), "static": ("static", "auto"), "block": ("tokens", "auto", "blocktree"),
                "tokens": ("tokens",), "none": ("none",)}


def check_tree_spec(spec: TreeSpec, family: str, *, drafter: str = "this drafter", limits: TreeLimits | None = None,
                    flag: str = "--tree") -> TreeSpec:
    """`spec` held to the bounds a parsed spec meets, whether parsed or built in code (drafters.build_drafter checks
    every spec it is given)."""
    limits = limits or TreeLimits()
    bad = _complaint(flag, spec.text or spec.mode, family, drafter)
    if spec.mode not in FAMILY_MODES[family]:
        raise bad(f"a {spec.mode} tree spec does not fit this drafter")
    if spec.mode == "dynamic":
        _within(spec.depth, 1, limits.max_depth, "DEPTH", bad)
        _check_top_k(spec.top_k, "TOP_K", limits, bad)
        _within(spec.total_tokens, 1, limits.max_nodes, "TOTAL (draft nodes)", bad)
    elif spec.mode == "static":
        if not spec.choices:
            raise bad("no rank paths")
        _check_paths(list(spec.choices), limits, bad)
    elif spec.mode == "tokens":
        _within(spec.num_tokens, 1, limits.max_depth, "the number of draft tokens", bad)
    elif spec.mode == "blocktree" and spec.total_tokens:
        _within(spec.total_tokens, 1, limits.max_nodes, "the tree's draft nodes N", bad)
    return spec


def _complaint(flag: str, text: str, family: str, drafter: str):
    shown = text if len(text) <= 60 else text[:57] + "..."  # a long JSON tree is not echoed whole

    def bad(why: str) -> SpecheadsError:
        return SpecheadsError(f"{flag} {shown}: {why}; {drafter} takes {FAMILIES[family]}")

    return bad


def _whole(text: str, bad, why: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise bad(why) from None


def _within(value: int, lo: int, hi: int, what: str, bad) -> None:
    if not lo <= value <= hi:
        raise bad(f"{what} {value} is outside {lo}..{hi}")


def _check_top_k(value: int, what: str, limits: TreeLimits, bad) -> None:
    """TOP_K within 1..min(MAX_TOP_K, draft vocabulary), naming the bound that applies."""
    if value < 1:
        raise bad(f"{what} {value} must be at least 1")
    if limits.max_rank is not None and value > limits.max_rank:
        raise bad(f"{what} {value} is above the head's draft vocabulary of {limits.max_rank} tokens")
    if value > limits.max_top_k:
        raise bad(f"{what} {value} is above the limit of {limits.max_top_k} children per node")


def _rank_paths(raw: str, limits: TreeLimits, bad) -> list[tuple[int, ...]]:
    """chain:K or a JSON list of rank paths -> normalised paths (prefixes added, parents first)."""
    if raw.startswith("chain:"):
        k = _whole(raw.split(":", 1)[1].strip(), bad, "expected chain:K with K a whole number")
        _within(k, 1, limits.max_depth, "the chain length K", bad)
        return [(0,) * d for d in range(1, k + 1)]
    try:
        paths = json.loads(raw)
    except json.JSONDecodeError:
        raise bad("not a tree spec") from None
    if not isinstance(paths, list) or not paths or not all(isinstance(p, list) and p for p in paths):
        raise bad("expected a non-empty JSON list of non-empty lists of ranks")
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for p in paths for r in p):
        raise bad("ranks must be whole numbers >= 0")
    if len(paths) > limits.max_nodes:  # checked before the prefixes are added (they only grow the list)
        raise bad(f"{len(paths)} rank paths are above the limit of {limits.max_nodes} draft nodes")
    return normalize_choices(paths)


def _check_paths(paths: list[tuple[int, ...]], limits: TreeLimits, bad) -> None:
    if len(paths) > limits.max_nodes:
        raise bad(f"{len(paths)} draft nodes (with the paths' prefixes) are above the limit of {limits.max_nodes}")
    depth = max(len(p) for p in paths)
    _within(depth, 1, limits.max_depth, "the depth", bad)
    rank = max(max(p) for p in paths)
    if limits.max_rank is not None and rank >= limits.max_rank:
        raise bad(f"rank {rank} is beyond the head's draft vocabulary of {limits.max_rank} tokens")
    if rank >= limits.max_top_k:
        raise bad(f"rank {rank} is above the limit of ranks 0..{limits.max_top_k - 1}")
