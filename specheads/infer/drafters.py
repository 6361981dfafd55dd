"""Drafters: propose a DraftTree, then observe what the target accepted. Verification never asks which one it is.

Interface (one small seam):
  feature_layers: list[int] | None   target hidden-state layers the drafter needs (docs/architecture.md
                                     "Feature layers"); None = none, the target then skips output_hidden_states
  reset(prompt_ids [T], features [T-1, F*D] | None)   features of the cached prompt positions (all but the root)
  propose(ctx) -> DraftTree                          ctx: DraftContext (ids so far, root last; sampling; room left)
  observe(tree, accepted, features [A, F*D] | None)  features of the accepted nodes (root first), now cached
B batch, T sequence, N tree nodes, K heads/depth, D hidden, V vocab (V' draft vocab), F feature layers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from specheads.infer.tree import (DEFAULT_MEDUSA_CHOICES, DraftTree, chain_tree, dynamic_tree, merge_trees,
                                  normalize_choices, tree_from_choices)
from specheads.infer.treespec import (FAMILIES, MAX_TREE_DEPTH, TreeLimits, TreeSpec, check_tree_spec,
                                      parse_tree_spec)
from specheads.infer.verify import Accepted, SamplingParams, target_probs
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)


@dataclass
class DraftContext:
    ids: list[int]  # every token so far (prompt + emitted); ids[-1] is the root, not yet in the target cache
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    max_depth: int = 1 << 30  # deepest node the context window still allows


class Drafter:
    feature_layers: list[int] | None = None
    name = "none"

    def reset(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftTree:
        return chain_tree(ctx.ids[-1], [])  # the root alone: plain decoding

    def observe(self, tree: DraftTree, accepted: Accepted, features: torch.Tensor | None) -> None:
        pass


class NoDrafter(Drafter):
    """Plain decoding through the same loop (τ = 1.00): the baseline every drafter is compared with."""
    name = "plain"


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: find the latest earlier occurrence of the context's last n-gram (n from max_ngram
    down to min_ngram) and propose the k tokens that followed it, as a chain. No model, no training."""
    name = "prompt-lookup"

    def __init__(self, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        self.k, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram  # k: draft tokens per step

    def propose(self, ctx: DraftContext) -> DraftTree:
        ids, k = ctx.ids, min(self.k, ctx.max_depth)
        t = torch.tensor(ids)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            if n <= 0 or k <= 0:
                break
            windows = t.unfold(0, n, 1)[:-1]  # [T-n, n] every earlier n-gram (the last one is the query itself)
            hits = (windows == t[-n:]).all(-1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # latest match
                cont = ids[start:start + k]
                if cont:
                    return chain_tree(ids[-1], cont)
        return chain_tree(ids[-1], [])


class DraftModelDrafter(Drafter):
    """An independent small causal LM drafts a chain of k tokens with its own KV cache (seed papers' speculative
    decoding). Greedy: argmax chain, verified as point masses. Sampling: tokens drawn from the draft's own warped
    distribution q (same temperature / top-p / top-k), q recorded in the tree so verification stays lossless."""
    name = "draft-model"

    def __init__(self, model, num_tokens: int = 4):
        model = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model  # Target ok
        self.model, self.k = model, num_tokens  # k: chain length (draft forwards per step)
        self.cache = None
        self.cached: list[int] = []  # tokens whose keys/values are in self.cache

    def reset(self, prompt_ids, features=None) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.cached = []

    def _forward(self, new: list[int]) -> torch.Tensor:
        dev = next(self.model.parameters()).device
        pos = torch.arange(len(self.cached), len(self.cached) + len(new), device=dev)[None]
        # logits of the last row only, asked for by index: HF's logits_to_keep=1 slices hidden[:, -1:], a strided
        # input on which torch's CPU bf16 linear is ~15x slower (heads/base.py last_row); an index gathers a copy
        keep = torch.tensor([len(new) - 1], device=dev)
        out = self.model(input_ids=torch.tensor([new], device=dev), position_ids=pos, cache=self.cache,
                         use_cache=True, logits_to_keep=keep)
        self.cached += new
        return out.logits[0, -1].float()  # [V]

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        if self.cache is None:
            self.reset(None)
        ids, k = ctx.ids, min(self.k, ctx.max_depth)
        common = 0  # longest common prefix of what is cached and the context (rejected drafts are cropped)
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # the root's logits are needed, so at least it is fed again
        if common < len(self.cached):
            self.cache.crop(common - len(self.cached))
            self.cached = self.cached[:common]
        if k <= 0:
            return chain_tree(ids[-1], [])
        logits = self._forward(ids[common:])
        drafts, qs = [], []
        for i in range(k):
            if ctx.sampling.greedy:
                tok = int(logits.argmax())
            else:
                q = target_probs(logits[None], ctx.sampling)[0].cpu()  # [V] the draft's warped distribution
                qs.append(q)
                tok = int(torch.multinomial(q, 1, generator=ctx.generator))
            drafts.append(tok)
            if i + 1 < k:
                logits = self._forward([tok])
        q = None
        if qs:
            vocab = qs[0].numel()
            q = torch.cat([torch.stack(qs), torch.full((1, vocab), 1.0 / vocab)])  # [1+k, V]; leaf row unused
        return chain_tree(ids[-1], drafts, q)


def truncated_draft_model(target, num_layers: int = 4):
    """A cheap 'draft model' without training: a copy of the target keeping only its first num_layers decoder
    layers (plus final norm and lm_head). Shares weights with the target (no copy of the tensors)."""
    import copy

    import torch.nn as nn

    total = len(target.model.model.layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total - 1:
        raise SpecheadsError(f"--draft-layers {num_layers}: must be 1..{total - 1} (the draft keeps the first N of "
                             f"the target's {total} layers)")

    model = copy.copy(target.model)  # shallow: submodules are shared by reference ...
    model._modules = dict(model._modules)  # ... but the module dicts are not (else the target would be cut too)
    base = copy.copy(target.model.model)
    base._modules = dict(base._modules)
    model.model = base
    model.model.layers = nn.ModuleList(list(target.model.model.layers[:num_layers]))
    model.config = copy.deepcopy(target.model.config)
    model.config.num_hidden_layers = num_layers
    if hasattr(model.config, "layer_types") and model.config.layer_types is not None:
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.model.config = model.config
    return model


class MedusaDrafter(Drafter):
    """Medusa heads over the target's last (post-norm) hidden state at the last cached position. head k predicts
    the token k+2 after that position, i.e. depth k+1 below the root. Static tree from rank `choices`."""
    name = "medusa"

    def __init__(self, head, choices=None):
        self.head = head
        self.num_heads = int(head.num_heads)  # K
        choices = normalize_choices(choices or DEFAULT_MEDUSA_CHOICES)
        self.choices = [c for c in choices if len(c) <= self.num_heads]  # never deeper than the heads
        self.ranks = 1 + max(max(c) for c in self.choices)  # top-k per head: only as many ranks as the tree uses
        self.depth = max(len(c) for c in self.choices)  # heads the tree reaches
        self.feature_layers = list(head.config.feature_layers)
        self.last: torch.Tensor | None = None  # [D] target feature at the last cached position

    def reset(self, prompt_ids, features) -> None:
        self.last = None if features is None or features.shape[0] == 0 else features[-1]

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        if self.last is None or ctx.max_depth <= 0:
            return chain_tree(ctx.ids[-1], [])
        p = next(self.head.parameters())
        depth = min(self.depth, ctx.max_depth)  # run only the heads the tree reaches (e.g. 1 of 3 for one node)
        logits = self.head(self.last[None, None].to(p.device, p.dtype), heads=depth)[:, 0, 0]  # [depth, V']
        topk = self.head.to_target_ids(logits.topk(self.ranks, dim=-1).indices).cpu()  # [depth, R] target ids
        return tree_from_choices(ctx.ids[-1], topk, self.choices)  # choices deeper than `depth` are left out

    def observe(self, tree, accepted, features) -> None:
        self.last = features[-1]


@torch.no_grad()
def medusa_rank_accuracies(target, head, sequences: list[list[int]], ranks: int = 10) -> torch.Tensor:
    """Measure acc [K, R]: how often head k's rank-r token is the true token k+2 positions ahead, over calibration
    token sequences (ideally the target's own answers). Feed to tree.choices_from_accuracies."""
    k_heads = int(head.num_heads)
    hits = torch.zeros(k_heads, ranks, dtype=torch.float64)
    total = torch.zeros(k_heads, dtype=torch.float64)
    p = next(head.parameters())
    for seq in sequences:
        ids = torch.tensor([seq], device=target.device)
        hs = target.model(ids, output_hidden_states=True).hidden_states
        feat = hs[head.config.feature_layers[0]]  # [1, T, D] the final post-norm state
        logits = head(feat.to(p.dtype))[:, 0]  # [K, T, V']
        top = head.to_target_ids(logits.topk(ranks, dim=-1).indices)  # [K, T, R] target ids
        for k in range(k_heads):
            n = ids.shape[1] - (k + 2)  # rows t with a true token at t + k + 2
            if n <= 0:
                continue
            truth = ids[0, k + 2:]  # [n]
            match = top[k, :n] == truth[:, None]  # [n, R]
            hits[k] += match.double().sum(0).cpu()
            total[k] += n
    return hits / total.clamp(min=1)[:, None]


class EagleDrafter(Drafter):
    """EAGLE-1 / EAGLE-3 heads with the EAGLE-2 dynamic tree. The head keeps its own KV cache of TRUE rows: row t
    pairs the target feature f_t with token x_{t+1} at position t. Each step `feed_accepted` runs the newly accepted
    rows through the head (with their true target features); `expand` then grows the tree's draft rows, which are
    cropped away afterwards. Draft-vocab ids map back with head.to_target_ids. Defaults depth 5 / top_k 8 /
    total_tokens 48: a little smaller than EAGLE-2's 6 / 10 / 60, sized for CPU targets."""
    name = "eagle"

    def __init__(self, head, depth: int = 5, top_k: int = 8, total_tokens: int = 48):
        self.head, self.depth, self.top_k, self.total_tokens = head, depth, top_k, total_tokens
        self.feature_layers = list(head.config.feature_layers)
        self.cache = None
        self.rows = 0  # true rows in the head cache (positions 0 .. rows-1)
        self.pending: torch.Tensor | None = None  # [P, F*D] features of cached positions not yet run through the head
        self.root_hidden: torch.Tensor | None = None  # [D] hidden out of the last true row (input of depth 1)
        self.root_logp: torch.Tensor | None = None  # [V'] log-probs of the last true row: the root's children
        self.draft: _DraftRows | None = None  # the draft rows of the tree being grown (None between proposals)

    def reset(self, prompt_ids, features) -> None:
        self.cache = self.head.new_cache()
        self.rows = 0
        self.pending = features
        self.root_hidden = self.root_logp = None

    def observe(self, tree, accepted, features) -> None:
        self.pending = features if self.pending is None else torch.cat([self.pending, features])

    def _run(self, hidden, tokens, positions, draft_mask, last_only: bool = False):
        """Run n rows through the head: hidden [n, D], tokens [n] target ids, positions [n], draft_mask [n, R+n] bool
        over the draft rows already cached plus these rows (True = attend); every true row is attended.
        Returns (hidden out [n, D], log-probs [n, V'] or, with last_only, [1, V'] of the last row)."""
        p = next(self.head.parameters())
        n = tokens.numel()
        allowed = torch.cat([torch.ones(n, self.rows, dtype=torch.bool), draft_mask], dim=1)  # [n, S]
        mask = torch.zeros(allowed.shape, dtype=p.dtype).masked_fill_(~allowed, float("-inf"))[None, None]
        h, logits = self.head.draft_forward(hidden[None].to(p.device, p.dtype), tokens[None].to(p.device),
                                           positions[None].to(p.device), mask.to(p.device), self.cache,
                                           last_only=last_only)
        return h[0], torch.log_softmax(logits[0].float(), dim=-1)

    def feed_accepted(self, ids: list[int]) -> None:
        """True rows (f_t, x_{t+1}) for the positions cached since the last step, run causally; only the last row
        (f_{cached-1} with the root) drafts: it gives the root's children."""
        p = 0 if self.pending is None else self.pending.shape[0]
        if not p:
            return
        param = next(self.head.parameters())
        t0, cached = self.rows, len(ids) - 1
        feats = self.head.project_features(self.pending.to(param.device, param.dtype))  # [p, D]
        h, lp = self._run(feats, torch.tensor(ids[t0 + 1:cached + 1]), torch.arange(t0, cached),
                          torch.ones(p, p, dtype=torch.bool).tril(), last_only=True)
        self.rows, self.pending = cached, None
        self.root_hidden, self.root_logp = h[-1], lp[-1]

    def expand(self, frontier: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        """tree.dynamic_tree's expand step: the children log-probs [F, V'] of the frontier nodes. A node not run yet
        becomes a draft row (hidden out of its parent's row, its token) at position cached - 1 + depth, attending
        the true rows, its ancestors' draft rows and itself (the mask comes from the rows' DraftTree)."""
        draft = self.draft
        todo = [i for i in frontier if draft.row_of(i) < 0]
        if todo:
            first = draft.add(todo, tokens, parents)
            rows = draft.tree()
            allowed = rows.ancestors()[first:, 1:]  # [n, R] the new rows over every draft row (row 0 is a true row)
            hidden = torch.stack([draft.hidden[draft.row_of(parents[i])] for i in todo])
            h, lp = self._run(hidden, rows.tokens[first:], self.rows - 1 + rows.depth[first:], allowed)
            draft.hidden += list(h)
            draft.logp += list(lp)
        return torch.stack([draft.logp[draft.row_of(i)] for i in frontier])  # [F, V']

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        ids, root = ctx.ids, ctx.ids[-1]
        cached = len(ids) - 1  # target positions 0 .. cached-1 have true features
        p = 0 if self.pending is None else self.pending.shape[0]
        if self.cache is None or cached == 0 or ctx.max_depth <= 0 or self.rows + p == 0:
            return chain_tree(root, [])
        assert self.rows + p == cached, (self.rows, p, cached)
        self.feed_accepted(ids)
        self.draft = _DraftRows(root, self.root_hidden, self.root_logp)
        to_target = self.head.to_target_ids if getattr(self.head, "d2t", None) is not None else None
        try:
            return dynamic_tree(root, self.expand, min(self.depth, ctx.max_depth), self.top_k, self.total_tokens,
                                to_target=to_target)
        finally:
            if self.draft.count:  # keep only the true rows in the head cache
                self.cache.crop(-self.draft.count)
            self.draft = None


class _DraftRows:
    """The rows one EAGLE tree adds to the head cache, grown as a DraftTree whose node 0 is the root's true row:
    row r >= 1 holds a tree node, its parent is its parent node's row. hidden / logp: each row's head outputs."""

    def __init__(self, root: int, hidden: torch.Tensor, logp: torch.Tensor):
        self.tokens, self.parents, self.depth = [root], [-1], [0]  # per row
        self.hidden, self.logp = [hidden], [logp]  # per row: [D] hidden out, [V'] children log-probs
        self.rows_of_nodes = [0]  # tree node -> its row (-1: not run yet); node 0 (the root) is row 0

    @property
    def count(self) -> int:
        """Draft rows in the head cache (the root's row is a true row)."""
        return len(self.tokens) - 1

    def row_of(self, node: int) -> int:
        return self.rows_of_nodes[node] if node < len(self.rows_of_nodes) else -1

    def add(self, nodes: list[int], tokens: list[int], parents: list[int]) -> int:
        """New rows for `nodes` (their parents' rows exist); returns the first new row."""
        first = len(self.tokens)
        self.rows_of_nodes += [-1] * (len(tokens) - len(self.rows_of_nodes))
        for i in nodes:
            parent_row = self.rows_of_nodes[parents[i]]
            self.rows_of_nodes[i] = len(self.tokens)
            self.tokens.append(tokens[i])
            self.parents.append(parent_row)
            self.depth.append(self.depth[parent_row] + 1)
        return first

    def tree(self) -> DraftTree:
        return DraftTree(torch.tensor(self.tokens), torch.tensor(self.parents), torch.tensor(self.depth))


class LookupMergedDrafter(Drafter):
    """A drafter's tree plus prompt lookup's chain, merged as a trie (tree.merge_trees): the head covers what is
    predictable from meaning, lookup covers spans copied from the context (code, quotes, lists) that heads rarely
    draft deep. Greedy only: with sampling (or a tree carrying its own q) the inner tree goes out alone.
    Only the inner drafter observes the outcome (prompt lookup keeps no state: it reads the context each step); it
    gets the merged tree and the true features of the accepted path, whichever drafter proposed its nodes."""

    def __init__(self, inner: Drafter, num_tokens: int = 4, max_ngram: int = 3):
        self.inner = inner
        self.lookup = PromptLookupDrafter(num_tokens=num_tokens, max_ngram=max_ngram)
        self.feature_layers = inner.feature_layers
        self.name = f"{inner.name}+lookup"

    def reset(self, prompt_ids, features) -> None:
        self.inner.reset(prompt_ids, features)

    def propose(self, ctx: DraftContext) -> DraftTree:
        tree = self.inner.propose(ctx)
        if ctx.sampling.temperature > 0 or tree.q is not None:
            return tree
        extra = self.lookup.propose(ctx)
        return merge_trees(tree, extra) if len(extra) > 1 else tree

    def observe(self, tree, accepted, features) -> None:
        self.inner.observe(tree, accepted, features)


# ---------------------------------------------------------------------------------------------------------------
# The drafter registry: one entry per head kind (config.kind) or training-free drafter (--drafter), naming its
# family once (treespec.FAMILIES: which --tree forms it takes, whether --tree auto applies) and how to build it.
# A new head kind plugs in with register_drafter(DrafterKind(...)); build_drafter is the one constructor.
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DrafterKind:
    name: str  # head kind (config.kind) or training-free drafter name
    family: str  # treespec.FAMILIES key: dynamic | static | tokens | none
    label: str  # how messages name it ("an EAGLE-3 head", "prompt-lookup")
    build: Callable[..., Drafter]  # build(target, head | None, spec: TreeSpec, **options) -> Drafter
    default_tree: str | None = None  # --tree when none is given (None: the family takes none)
    head: bool = False  # built from a trained head, else training-free


DRAFTERS: dict[str, DrafterKind] = {}


def register_drafter(kind: DrafterKind) -> DrafterKind:
    if kind.family not in FAMILIES:
        raise ValueError(f"register_drafter {kind.name}: family {kind.family!r} is not one of {list(FAMILIES)}")
    DRAFTERS[kind.name] = kind
    return kind


def drafter_kind(name: str, head: bool = False) -> DrafterKind:
    """The registry entry of a head kind (head=True) or a training-free drafter (--drafter NAME)."""
    kind = DRAFTERS.get(name)
    if kind is None or kind.head != head:
        if head:
            raise SpecheadsError(f"head kind {name!r} has no drafter (drafters with heads: "
                                 f"{', '.join(k for k, v in DRAFTERS.items() if v.head)})")
        free = [k for k, v in DRAFTERS.items() if not v.head]
        raise SpecheadsError(f"--drafter {name}: expected {', '.join(free)} (or --head DIR for a trained head)")
    return kind


def tree_limits(head=None) -> TreeLimits:
    """Bounds of a tree spec for a head (a DraftHead or its HeadConfig): ranks within its draft vocabulary."""
    cfg = getattr(head, "config", head)
    if cfg is None:
        return TreeLimits()
    return TreeLimits(max_rank=int(cfg.draft_vocab_size or cfg.vocab_size))


def parse_tree(text: str | None, name: str, head=None, flag: str = "--tree") -> TreeSpec:
    """`--tree TEXT` for the drafter `name` (a head kind when `head`, a DraftHead or HeadConfig, is given):
    treespec.parse_tree_spec with the drafter's family, label and limits; None = the drafter's default tree."""
    kind = drafter_kind(name, head=head is not None)
    text = kind.default_tree if text is None else text
    if text is None:
        return TreeSpec.none()
    return parse_tree_spec(text, kind.family, drafter=kind.label, limits=tree_limits(head), flag=flag)


def build_drafter(target, head_or_name, spec: TreeSpec | str | None = None, *, lookup: int = 0,
                  lookup_ngram: int = 3, **options) -> Drafter:
    """The one drafter constructor. head_or_name: a loaded DraftHead (its kind picks the drafter) or a training-free
    drafter name (plain, prompt-lookup, draft-model). spec: a TreeSpec, `--tree` text, or None (the drafter's
    default); `auto` is resolved first by autotree.choose_tree_for_head. lookup > 0 merges a prompt-lookup chain of
    up to that many tokens into the tree (greedy only; LookupMergedDrafter). options go to the drafter's builder
    (prompt-lookup: max_ngram; draft-model: draft_target, draft_layers)."""
    head = None if isinstance(head_or_name, str) else head_or_name
    name = head.config.kind if head is not None else head_or_name
    kind = drafter_kind(name, head=head is not None)
    if isinstance(spec, TreeSpec):
        spec = check_tree_spec(spec, kind.family, drafter=kind.label, limits=tree_limits(head))
    else:
        spec = parse_tree(spec, name, head)
    if spec.mode == "auto":
        raise ValueError("build_drafter: resolve --tree auto with autotree.choose_tree_for_head first")
    check_lookup(lookup)
    drafter = kind.build(target, head, spec, **options)
    if lookup:
        drafter = LookupMergedDrafter(drafter, num_tokens=lookup, max_ngram=lookup_ngram)
    return drafter


def check_lookup(lookup: int) -> None:
    """The prompt-lookup chain merged into a head's tree: 0 (off) .. MAX_TREE_DEPTH tokens."""
    if isinstance(lookup, bool) or not isinstance(lookup, int) or not 0 <= lookup <= MAX_TREE_DEPTH:
        raise SpecheadsError(f"--lookup {lookup}: must be 0 (off) .. {MAX_TREE_DEPTH} prompt-lookup tokens")


def _medusa(target, head, spec: TreeSpec) -> Drafter:
    return MedusaDrafter(head, choices=[list(c) for c in spec.choices])


def _eagle(target, head, spec: TreeSpec) -> Drafter:
    return EagleDrafter(head, depth=spec.depth, top_k=spec.top_k, total_tokens=spec.total_tokens)


def _prompt_lookup(target, head, spec: TreeSpec, max_ngram: int = 3) -> Drafter:
    return PromptLookupDrafter(num_tokens=spec.num_tokens, max_ngram=max_ngram)


def _draft_model(target, head, spec: TreeSpec, draft_target: str | None = None, draft_layers: int = 4) -> Drafter:
    """A separate small model sharing the target's vocabulary, or else the target's first draft_layers layers."""
    if draft_target:
        from specheads.target import load_target

        small = load_target(draft_target, dtype=target.dtype, device=str(target.device))
        if small.vocab_size != target.vocab_size:
            raise SpecheadsError(f"draft model {draft_target}: vocabulary {small.vocab_size} differs from the "
                                 f"target's {target.vocab_size}")
        model = small.model
    else:
        model = truncated_draft_model(target, draft_layers)
    return DraftModelDrafter(model, num_tokens=spec.num_tokens)


def _plain(target, head, spec: TreeSpec) -> Drafter:
    return NoDrafter()


for _kind in (DrafterKind("medusa", "static", "a Medusa head", _medusa, default_tree="default", head=True),
              DrafterKind("eagle", "dynamic", "an EAGLE head", _eagle, default_tree="5,8,48", head=True),
              DrafterKind("eagle3", "dynamic", "an EAGLE-3 head", _eagle, default_tree="5,8,48", head=True),
              DrafterKind("prompt-lookup", "tokens", "prompt-lookup", _prompt_lookup, default_tree="8"),
              DrafterKind("draft-model", "tokens", "draft-model", _draft_model, default_tree="4"),
              DrafterKind("plain", "none", "plain decoding", _plain)):
    register_drafter(_kind)


def load_drafter(name: str, target, head_dir: str | None = None, tree: TreeSpec | str | None = None,
                 **options) -> Drafter:
    """build_drafter from a CLI-style description: a head folder, else the drafter `name` (plain, prompt-lookup,
    draft-model)."""
    if head_dir:
        from specheads.heads.base import load_head

        head = load_head(head_dir, target)
        head.eval()
        return build_drafter(target, head, tree, **options)
    return build_drafter(target, name, tree, **options)
