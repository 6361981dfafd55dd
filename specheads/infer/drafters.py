"""Drafters: propose a DraftTree, then observe what the target accepted. Verification never asks which one it is.

Interface (one small seam):
  feature_layers: list[int] | None   target hidden-state layers the drafter needs (docs/architecture.md
                                     "Feature layers"); None = none, the target then skips output_hidden_states
  reset(prompt_ids [T], features [T-1, F*D] | None)   features of the cached prompt positions (all but the root)
  propose(ctx) -> DraftTree                          ctx: DraftContext (ids so far, root last; sampling; room left)
  observe(tree, accepted, features [A, F*D] | None)  features of the accepted nodes (root first), now cached
  step_report() -> StepReport | None                 a scheduled step's expected figures (generator -> stats)
A drafter whose proposals carry per-node acceptance estimates (ScoredDrafter: `candidates(ctx)`) can be put under
the per-step scheduler (infer/scheduler.py) alone or with others (ScheduledUnionDrafter: one verify budget).
B batch, T sequence, N tree nodes, K heads/depth, D hidden, V vocab (V' draft vocab), F feature layers.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from specheads.infer.scheduler import (MATCH_CAP, PRIOR_STRENGTH, WINDOW_STEPS, Candidates, LookupRates, Rates,
                                       Scheduler, StepClock, StepReport, accepted_along, merge_candidates, outcomes,
                                       path_products, rank_rates, survival)
from specheads.infer.tree import (DEFAULT_MEDUSA_CHOICES, DraftTree, chain_tree, dynamic_tree, normalize_choices,
                                  tree_from_choices)
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
    clock: StepClock | None = None  # the request's measured seconds per step (the scheduler's prices)


class Drafter:
    feature_layers: list[int] | None = None
    name = "none"

    def reset(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftTree:
        return chain_tree(ctx.ids[-1], [])  # the root alone: plain decoding

    def observe(self, tree: DraftTree, accepted: Accepted, features: torch.Tensor | None) -> None:
        pass

    def recycle(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """The target's logits [N, V] after each of tokens [N] (the prompt's prefill, every verified tree, rejected
        nodes included), given before observe; only Token Recycling reads them."""

    def step_report(self) -> StepReport | None:
        """What a scheduled step expected (read by the generator after observe); None = not scheduled."""
        return None


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
        return chain_tree(ctx.ids[-1], self.find(ctx.ids, min(self.k, ctx.max_depth))[0])

    def find(self, ids: list[int], k: int) -> tuple[list[int], int]:
        """(up to k continuation tokens, match length: context tokens before the continuation equal to the
        context's last ones, counted up to scheduler.MATCH_CAP); ([], 0) without a match."""
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
                    match = n
                    while match < MATCH_CAP and start - 1 - match >= 0 and ids[start - 1 - match] == ids[-1 - match]:
                        match += 1
                    return cont, match
        return [], 0


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


# ---------------------------------------------------------------------------------------------------------------
# Scored drafters: proposals with per-node acceptance estimates, for the per-step scheduler (infer/scheduler.py).
# ---------------------------------------------------------------------------------------------------------------

class TokenRecyclingDrafter(Drafter):
    """Token Recycling (Luo et al., ACL 2025, arXiv 2408.08696): a training-free drafter built from the candidates
    each target forward computes and plain decoding throws away.

    An adjacency table M [V, k] holds, for every token x, the target's top-k next tokens the last time x was fed to
    it, at any node of a verified tree (accepted or not) or of the prompt:
        after each forward over tokens x_1..x_N with logits l_1..l_N:   M[x_i] = topk(l_i, k)
    Each step the draft tree is read off M from the root by breadth-first search over a static template of rank paths
    (Medusa's default tree here, 25 nodes, depth 4): path c + [r] gets token M[token(c), r]; a path whose parent is
    missing or whose entry is still empty is left out. The table outlives `reset` (the paper's hot start: what one
    request taught serves the next); SmolLM2's 49,152 x 8 int32 entries take 1.5 MB.
    Verification never depends on it: the tree's tokens are deterministic guesses checked exactly (greedy) or as
    one-hot drafts (sampling). Shapes: N tree nodes, V vocab."""
    name = "recycling"

    def __init__(self, vocab_size: int, choices: list[list[int]] | None = None, k: int = 8):
        choices = [list(c) for c in (choices or DEFAULT_MEDUSA_CHOICES)]
        self.choices = sorted(choices, key=len)  # breadth first: every parent before its children
        self.k = max(int(k), 1 + max(max(c) for c in self.choices))  # candidates kept per token (the paper: 8)
        self.table = torch.full((int(vocab_size), self.k), -1, dtype=torch.int32)  # -1: not seen yet

    def recycle(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """tokens [N], logits [N, V]: the target's output after each token; later rows win for repeated tokens."""
        if tokens.numel():
            top = logits.topk(self.k, dim=-1).indices.to("cpu", torch.int32)  # [N, k]
            self.table[tokens.to("cpu", torch.long)] = top

    def propose(self, ctx: DraftContext) -> DraftTree:
        root = int(ctx.ids[-1])
        node_of: dict[tuple[int, ...], int] = {(): 0}
        tokens, parents, depth = [root], [-1], [0]
        for c in self.choices:
            p = node_of.get(tuple(c[:-1]))
            if p is None or len(c) > ctx.max_depth:
                continue
            t = int(self.table[tokens[p], c[-1]])
            if t < 0:
                continue
            node_of[tuple(c)] = len(tokens)
            tokens.append(t)
            parents.append(p)
            depth.append(len(c))
        return DraftTree(tokens, parents, depth)


class ScoredDrafter(Drafter):
    """A drafter whose proposal carries per-node acceptance estimates (scheduler.Candidates), so a scheduler can
    choose what of it to verify, alone or merged with other sources (ScheduledUnionDrafter)."""

    report: StepReport | None = None

    def candidates(self, ctx: DraftContext) -> Candidates:  # pragma: no cover - interface
        raise NotImplementedError

    def learn(self, cand: Candidates, truth: list[int | None]) -> None:
        """The step's outcome for the estimates: `truth` = the emitted tokens (greedy: the target's own argmax
        continuation, bonus included, which decides every candidate whose parent was on it)."""

    def alone(self, cand: Candidates, scheduler: Scheduler, prices, draft_s: float) -> DraftTree:
        """What this source would verify on its own (the oracle's figure): its whole proposal unless overridden."""
        return cand.tree

    def step_report(self) -> StepReport | None:
        return self.report


def emitted_tokens(tree: DraftTree, accepted: Accepted) -> list[int]:
    """The tokens a step emits before any stop cut: the accepted draft nodes' tokens, then the bonus."""
    return [int(tree.tokens[i]) for i in accepted.nodes[1:]] + [accepted.bonus]


class DSparkDrafter(ScoredDrafter):
    """DSpark / DFlash block heads (heads/dspark.py): ONE head pass per step drafts the block anchored at the root,
    as a chain. The head's context cache holds TRUE rows only: reset feeds the prompt's features (every cached
    position), observe appends the accepted rows' target features (root first), so nothing is rolled back.
    Greedy: the Markov chain's argmax tokens. Sampling: draft j is drawn from its warped distribution and draft
    j+1's Markov bias reads the drawn token; those distributions are the tree's q rows, so verify_sampling stays
    lossless. Estimates: survival a_i = c_1 ... c_i of the calibrated confidences (a head without a confidence
    head: per-depth rates learned per request). scheduler: the per-step prefix choice (`--tree auto`); None =
    num_tokens drafts every step. The verified rows' features wait in `unseen` until the next block is drafted
    (one context pass for all of them), so steps that draft nothing (a batch budget resting the row) cost no head
    pass. With a scheduler and greedy decoding the first draft also gets `siblings` alternatives (ranks 1.. of its
    logits) as children of the root, a small tree the scheduler verifies only where they pay: sibling j's estimate
    is (1 - a_1) * prod_{i<j} (1 - r_i) * r_j with r_j = P(rank j is the target's token | ranks < j were not),
    learned per request (prior SIBLING_PRIOR)."""
    name = "dspark"
    SIBLING_PRIOR = 0.15  # P(the first draft's rank-1 token is right | its rank-0 token is not), before outcomes

    def __init__(self, head, scheduler: Scheduler | None = None, num_tokens: int | None = None, siblings: int = 2):
        self.head, self.scheduler = head, scheduler
        self.k = head.num_drafts if num_tokens is None else min(int(num_tokens), head.num_drafts)  # drafts per step
        self.siblings = int(siblings) if scheduler is not None else 0  # alternatives to the first draft
        self.sibling_rates = Rates(lambda j: (self.SIBLING_PRIOR, PRIOR_STRENGTH))
        self.feature_layers = list(head.config.feature_layers)
        self.cache = None
        self.unseen: list[torch.Tensor] = []  # [n, F*D] verified rows' features not yet in the context cache
        self.depth_rates = Rates()  # P(draft j accepted | drafts < j were), only without a confidence head
        self.pending: tuple[Candidates, bool] | None = None  # own proposal to learn from (candidates, greedy)

    def reset(self, prompt_ids, features) -> None:
        self.cache = self.head.new_cache()
        self.depth_rates.clear()
        self.sibling_rates.clear()
        self.unseen = [] if features is None or not features.shape[0] else [features]

    def observe(self, tree, accepted, features) -> None:
        if features is not None and features.shape[0]:
            self.unseen.append(features)  # root + accepted nodes: true rows only
        if self.pending is not None:  # alone: the chain's outcome (sampling: only what was verified)
            cand, greedy = self.pending
            truth = emitted_tokens(tree, accepted)
            self.learn(cand if greedy else Candidates(tree, []), truth if greedy else truth[:-1] + [None])
            self.pending = None

    def catch_up(self) -> None:
        """One context pass over every verified row not yet cached."""
        if self.unseen:
            self.head.extend_context(self.cache, torch.cat(self.unseen) if len(self.unseen) > 1 else self.unseen[0])
            self.unseen = []

    @torch.no_grad()
    def candidates(self, ctx: DraftContext) -> Candidates:
        root, k = ctx.ids[-1], min(self.k, ctx.max_depth)
        if self.cache is None or k <= 0:
            return Candidates(chain_tree(root, []), [1.0], self.name)
        self.catch_up()
        assert self.cache.length == len(ctx.ids) - 1, (self.cache.length, len(ctx.ids))
        return self._candidates(ctx, *self._block(ctx, k))

    def _candidates(self, ctx: DraftContext, drafts: list[int], conf: list[float] | None,
                    q: torch.Tensor | None, sibs: list[int] = ()) -> Candidates:
        """The chain of drafts after the root with its survival estimates (confidences or learned rates), then the
        first draft's siblings (children of the root) with theirs."""
        k = len(drafts)
        if conf is None:
            conf = [self.depth_rates.rate(d) for d in range(1, k + 1)]
        p = [1.0] + survival(conf[:k])
        if not sibs:
            return Candidates(chain_tree(ctx.ids[-1], drafts, q), p, self.name)
        miss = 1.0 - p[1]  # the first draft is not the target's token
        for j in range(len(sibs)):
            r = self.sibling_rates.rate(j + 1)
            p.append(miss * r)
            miss *= 1.0 - r
        tree = DraftTree([ctx.ids[-1]] + drafts + list(sibs), [-1] + list(range(k)) + [0] * len(sibs),
                         list(range(k + 1)) + [1] * len(sibs))
        return Candidates(tree, p, self.name)

    def _block(self, ctx: DraftContext, k: int
               ) -> tuple[list[int], list[float] | None, torch.Tensor | None, list[int]]:
        """One head pass: (k draft target ids, confidences or None, q [k+1, V] or None (greedy), the first draft's
        sibling target ids (greedy with self.siblings, else none))."""
        head, root = self.head, ctx.ids[-1]
        if ctx.sampling.greedy:
            logits, conf = head.draft_block(self.cache, root)  # [K', V'], [K'] | None
            drafts = head.to_target_ids(logits[:k].argmax(-1)).tolist()
            s = min(self.siblings, logits.shape[-1] - 1)
            sibs = head.to_target_ids(logits[0].topk(1 + s).indices[1:]).tolist() if s > 0 else []
            return drafts, None if conf is None else conf.tolist(), None, sibs
        drawn: dict[int, torch.Tensor] = {}

        def pick(j: int, lg: torch.Tensor) -> torch.Tensor:  # lg [1, 1, V']: draft j drawn from its warped q
            drawn[j] = torch.multinomial(target_probs(lg[0, 0:1], ctx.sampling)[0].cpu(), 1, generator=ctx.generator)
            return drawn[j].to(lg.device).view(1, 1)

        logits, conf = head.draft_block(self.cache, root, pick=pick)  # Markov bias of draft j reads drawn j-1
        qs = target_probs(logits[:k], ctx.sampling).cpu()  # [k, V'] the distributions the drafts came from
        ids = [drawn[j] if j in drawn else torch.multinomial(qs[j], 1, generator=ctx.generator) for j in range(k)]
        drafts = head.to_target_ids(torch.cat(ids).to(logits.device)).tolist()
        vocab = head.config.vocab_size
        q = torch.zeros(k + 1, vocab)
        cols = torch.arange(vocab) if getattr(head, "d2t", None) is None else head.d2t.cpu()
        q[:k, cols] = qs
        q[k] = 1.0 / vocab  # the leaf's row is never read
        return drafts, None if conf is None else conf.tolist(), q, []

    def learn(self, cand, truth) -> None:
        parents = cand.tree.parents.tolist()
        sibs = [i for i in range(2, len(parents)) if parents[i] == 0]  # the first draft's siblings, rank order
        if self.head.confidence_head is None:
            for node, ok in outcomes(cand.tree, truth):
                if node not in sibs:
                    self.depth_rates.add(int(cand.tree.depth[node]), ok)
        tokens = cand.tree.tokens.tolist()
        if sibs and truth and truth[0] is not None and tokens[1] != truth[0]:  # the first draft missed
            for j, i in enumerate(sibs, start=1):
                self.sibling_rates.add(j, tokens[i] == truth[0])
                if tokens[i] == truth[0]:
                    break

    def alone(self, cand, scheduler, prices, draft_s) -> DraftTree:
        if self.scheduler is None:
            return cand.tree
        return cand.tree.select(scheduler.choose(cand, prices, draft_s).keep)

    @staticmethod
    @torch.no_grad()
    def propose_many(drafters: list["DSparkDrafter"], ctxs: list[DraftContext]) -> list[DraftTree]:
        """propose for many rows (batch.py): the greedy rows of one head without a per-row scheduler draft their
        blocks in ONE head pass (head.draft_blocks); any other row proposes alone. Same trees as propose."""
        trees: list[DraftTree | None] = [None] * len(drafters)
        groups: dict[int, list[int]] = {}
        for i, (d, c) in enumerate(zip(drafters, ctxs)):
            if d.scheduler is None and c.sampling.greedy and d.cache is not None and min(d.k, c.max_depth) > 0:
                groups.setdefault(id(d.head), []).append(i)
        for rows in groups.values():
            if len(rows) < 2:
                continue
            for i in rows:
                drafters[i].catch_up()
                assert drafters[i].cache.length == len(ctxs[i].ids) - 1, (drafters[i].cache.length, len(ctxs[i].ids))
            head = drafters[rows[0]].head
            logits, conf = head.draft_blocks([drafters[i].cache for i in rows], [ctxs[i].ids[-1] for i in rows])
            for r, i in enumerate(rows):
                d, k = drafters[i], min(drafters[i].k, ctxs[i].max_depth)
                drafts = head.to_target_ids(logits[r, :k].argmax(-1)).tolist()
                cand = d._candidates(ctxs[i], drafts, None if conf is None else conf[r].tolist(), None)
                d.pending, d.report = (cand, True), None
                trees[i] = cand.tree
        return [t if t is not None else d.propose(c) for t, d, c in zip(trees, drafters, ctxs)]

    def propose(self, ctx: DraftContext) -> DraftTree:
        t0 = time.perf_counter()
        cand = self.candidates(ctx)
        self.pending, self.report = (cand, ctx.sampling.greedy), None
        if self.scheduler is None:
            return cand.tree
        prices = self.scheduler.prices(ctx.clock, draft_now=time.perf_counter() - t0)
        choice = self.scheduler.choose(cand, prices)
        self.report = StepReport(choice.expected_tau, choice.cost)
        return cand.tree.select(choice.keep)


class ScoredTreeDrafter(ScoredDrafter):
    """An EAGLE / Medusa drafter's tree with per-node estimates p = the product along the path of P(accepted |
    parent accepted) by (depth, rank) (scheduler.rank_rates: the `--tree auto` probe's matrix as prior, learned per
    request from every step's greedy outcome). Rates by depth and rank are what autotree measured for this head and
    are calibrated by construction; a small head's draft probabilities would need a calibration map of their own."""

    def __init__(self, inner: Drafter, acceptance: dict | None = None):
        self.inner, self.name, self.feature_layers = inner, inner.name, inner.feature_layers
        acceptance = acceptance or {}
        self.rates = rank_rates(acceptance.get("acc"), acceptance.get("counts"))

    def reset(self, prompt_ids, features) -> None:
        self.inner.reset(prompt_ids, features)
        self.rates.clear()

    def propose(self, ctx):
        return self.inner.propose(ctx)

    def observe(self, tree, accepted, features) -> None:
        self.inner.observe(tree, accepted, features)

    def recycle(self, tokens, logits) -> None:
        self.inner.recycle(tokens, logits)

    def candidates(self, ctx) -> Candidates:
        tree = self.inner.propose(ctx)
        return Candidates(tree, path_products(tree, lambda d, r: self.rates.rate((d, r))), self.name)

    def learn(self, cand, truth) -> None:
        rank = [0] * len(cand.tree)
        for ch in cand.tree.children_lists():
            for r, c in enumerate(ch):
                rank[c] = r
        for node, ok in outcomes(cand.tree, truth):
            self.rates.add((int(cand.tree.depth[node]), rank[node]), ok)


class ScoredLookupDrafter(ScoredDrafter):
    """Prompt lookup's chain with per-token estimates: P(accepted | parent accepted) by match length and depth
    (scheduler.LookupRates), learned per request from each step's greedy outcome."""
    name = "lookup"

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3):
        self.lookup = PromptLookupDrafter(num_tokens=num_tokens, max_ngram=max_ngram)
        self.rates = LookupRates()
        self.match = 0  # this step's match length

    def reset(self, prompt_ids, features) -> None:
        self.rates.clear()

    def propose(self, ctx):
        return self.lookup.propose(ctx)

    def candidates(self, ctx) -> Candidates:
        cont, self.match = self.lookup.find(ctx.ids, min(self.lookup.k, ctx.max_depth))
        conf = [self.rates.rate(self.match, d) for d in range(1, len(cont) + 1)]
        return Candidates(chain_tree(ctx.ids[-1], cont), [1.0] + survival(conf), self.name)

    def learn(self, cand, truth) -> None:
        for node, ok in outcomes(cand.tree, truth):
            self.rates.add(self.match, int(cand.tree.depth[node]), ok)


class ScheduledUnionDrafter(Drafter):
    """Several scored drafters under one scheduler: each step every source proposes its candidates, their trie union
    is scored (scheduler.merge_candidates) and the scheduler verifies its best ancestor-closed part, so one verify
    budget is spent across the sources; every source's draft pass is paid (the measured drafter seconds price it).
    Greedy only: with sampling the first source drafts alone. Every source observes every step (their caches hold
    true rows only). The report also says what each source alone would have emitted (greedy: the target's argmax is
    known along the emitted path), for the oracle figure.
    A source whose pass does not pay rests: when the mean expected tokens its own nodes added to the verified set
    over its last REST_WINDOW steps, g_s, is below d_s * E / C (its measured pass d_s in t(1) units times the step's
    expected tokens per unit of cost), it proposes nothing for `explore_every` - 1 steps, then drafts again (lazy
    caches make a rested head's catch-up one pass); explore_every=1: no source ever rests."""
    REST_WINDOW = 8  # steps of a source's gains behind a decision to rest it (at least half of them seen)

    def __init__(self, sources: list[ScoredDrafter], scheduler: Scheduler, explore_every: int = 16):
        self.sources, self.scheduler, self.explore_every = list(sources), scheduler, explore_every
        names = [s.name for s in self.sources]
        self.names = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
        self.name = "+".join(self.names)
        layers = sorted({l for s in self.sources for l in (s.feature_layers or [])})
        self.feature_layers = layers or None
        self.seconds = {n: deque(maxlen=WINDOW_STEPS) for n in self.names}  # per source: seconds per step
        self.step: dict | None = None  # this step's candidates, prices and seconds (greedy)
        self.report: StepReport | None = None
        self.gains = {n: deque(maxlen=self.REST_WINDOW) for n in self.names}  # per source: its nodes' expected tokens
        self.resting: dict[str, int] = {}  # source -> steps since it last proposed

    def _features(self, source: Drafter, features: torch.Tensor | None) -> torch.Tensor | None:
        """The columns of `features` [n, F*D] (this drafter's layers) that `source` reads, in its order."""
        if features is None or not source.feature_layers:
            return None
        if source.feature_layers == self.feature_layers:
            return features
        d = features.shape[-1] // len(self.feature_layers)
        idx = [self.feature_layers.index(l) for l in source.feature_layers]
        return torch.cat([features[..., i * d:(i + 1) * d] for i in idx], dim=-1)

    def reset(self, prompt_ids, features) -> None:
        for s in self.sources:
            s.reset(prompt_ids, self._features(s, features))

    def propose(self, ctx: DraftContext) -> DraftTree:
        self.step, self.report = None, None
        if not ctx.sampling.greedy:
            return self.sources[0].propose(ctx)
        t0 = time.perf_counter()
        cands, secs = {}, {}
        for name, s in zip(self.names, self.sources):
            if 0 < self.resting.get(name, 0) < self.explore_every:
                self.resting[name] += 1
                continue
            t = time.perf_counter()
            cands[name] = s.candidates(ctx)
            secs[name] = time.perf_counter() - t
        if not cands:  # every source resting: plain decoding (the oracle's step too: one token at this cost)
            self.report = StepReport(1.0, self.scheduler.cost_of(1, self.scheduler.prices(ctx.clock)), rested=True)
            self.step = {"cands": {}, "prices": None, "seconds": {}}
            return chain_tree(ctx.ids[-1], [])
        merged, maps = merge_candidates(list(cands.values()))
        prices = self.scheduler.prices(ctx.clock, draft_now=time.perf_counter() - t0)
        choice = self.scheduler.choose(merged, prices)
        self.step = {"cands": cands, "prices": prices, "seconds": secs}
        self.report = StepReport(choice.expected_tau, choice.cost)
        self._rest(cands, maps, merged.p, set(choice.keep), prices, choice.expected_tau / choice.cost)
        return merged.tree.select(choice.keep)

    def _rest(self, cands: dict, maps: list[list[int]], p: list[float], kept: set[int], prices, rate: float) -> None:
        """Each proposing source's gain this step (Σ p over the kept union nodes it alone proposed); a source whose
        mean gain is below its own pass's price at this step's rate rests (class docstring)."""
        owners: dict[int, int] = {}
        for where in maps:
            for i in set(where):
                owners[i] = owners.get(i, 0) + 1
        for name, where in zip(cands, maps):
            gain = sum(p[i] for i in set(where) if i in kept and i and owners[i] == 1)
            self.gains[name].append(gain)
            seen = self.seconds[name]
            d = sorted(seen)[len(seen) // 2] / prices.t1 if seen else 0.0  # its pass, in t(1) units
            g = self.gains[name]
            if len(g) * 2 >= self.REST_WINDOW and sum(g) / len(g) < d * rate:
                self.resting[name], self.gains[name] = 1, deque(maxlen=self.REST_WINDOW)
            else:
                self.resting.pop(name, None)

    def recycle(self, tokens, logits) -> None:
        for s in self.sources:
            s.recycle(tokens, logits)

    def observe(self, tree, accepted, features) -> None:
        secs = self.step["seconds"] if self.step else {}
        for name, s in zip(self.names, self.sources):
            t = time.perf_counter()
            s.observe(tree, accepted, self._features(s, features))
            if name in secs:  # a resting source's seconds are not its pass's
                self.seconds[name].append(secs[name] + time.perf_counter() - t)
        if self.step is not None and self.step["cands"]:
            self._learn_and_replay(emitted_tokens(tree, accepted))

    def _learn_and_replay(self, truth: list[int]) -> None:
        """Each proposing source learns from the outcome and is replayed alone: its own proposal's accepted length
        and the cost of its own step (its draft seconds, the loop's, the verification of its own tree)."""
        prices = self.step["prices"]
        for name, s in zip(self.names, self.sources):
            cand = self.step["cands"].get(name)
            if cand is None:
                continue
            s.learn(cand, truth)
            own = sorted(self.seconds[name])[len(self.seconds[name]) // 2]
            tree = s.alone(cand, self.scheduler, prices, own)
            n, censored = accepted_along(tree, truth)
            self.report.sources[name] = n + 1
            self.report.source_cost[name] = self.scheduler.cost_of(len(tree), prices, own)
            self.report.censored[name] = censored

    def step_report(self) -> StepReport | None:
        return self.report if self.step is not None else self.sources[0].step_report()


def scored(drafter: Drafter, acceptance: dict | None = None) -> ScoredDrafter:
    """A drafter as a scheduler source: scored drafters as they are, tree drafters with (depth, rank) rates."""
    return drafter if isinstance(drafter, ScoredDrafter) else ScoredTreeDrafter(drafter, acceptance)


def combine_drafters(target, drafters: list[Drafter], *, lookup: int = 0, lookup_ngram: int = 3,
                     acceptances: list[dict | None] | None = None, scheduler: Scheduler | None = None,
                     explore_every: int = 16) -> ScheduledUnionDrafter:
    """Drafters (and, lookup > 0, prompt lookup's chain of up to that many tokens) under one per-step scheduler.
    acceptances: per drafter, the `--tree auto` probe's {"acc", "counts"} (the prior of a tree head's rates).
    scheduler: None = a drafter's own, else one priced by the target's cached cost profile. explore_every: steps a
    source whose pass does not pay rests (1 = never)."""
    sources = [scored(d, a) for d, a in zip(drafters, acceptances or [None] * len(drafters))]
    if lookup:
        sources.append(ScoredLookupDrafter(num_tokens=lookup, max_ngram=lookup_ngram))
    if scheduler is None:
        scheduler = next((d.scheduler for d in drafters if getattr(d, "scheduler", None) is not None), None)
    return ScheduledUnionDrafter(sources, scheduler or Scheduler.for_target(target), explore_every=explore_every)


# ---------------------------------------------------------------------------------------------------------------
# The drafter registry: one entry per head kind (config.kind) or training-free drafter (--drafter), naming its
# family once (treespec.FAMILIES: which --tree forms it takes, whether --tree auto applies) and how to build it.
# A new head kind plugs in with register_drafter(DrafterKind(...)); build_drafter is the one constructor.
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DrafterKind:
    name: str  # head kind (config.kind) or training-free drafter name
    family: str  # treespec.FAMILIES key: dynamic | static | block | tokens | none
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
    """Bounds of a tree spec for a head (a DraftHead or its HeadConfig): ranks within its draft vocabulary; a block
    head's draft tokens within its block's drafts."""
    cfg = getattr(head, "config", head)
    if cfg is None:
        return TreeLimits()
    kind = DRAFTERS.get(getattr(cfg, "kind", None))
    if kind is not None and kind.family == "block":
        return TreeLimits(max_rank=int(cfg.draft_vocab_size or cfg.vocab_size), max_depth=int(cfg.head_spec.num_drafts))
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
                  lookup_ngram: int = 3, acceptance: dict | None = None, scheduler: Scheduler | None = None,
                  **options) -> Drafter:
    """The one drafter constructor. head_or_name: a loaded DraftHead (its kind picks the drafter) or a training-free
    drafter name (plain, prompt-lookup, draft-model). spec: a TreeSpec, `--tree` text, or None (the drafter's
    default); a tree head's `auto` is resolved first by autotree.choose_tree_for_head, a block head's `auto` is its
    per-step scheduler. lookup > 0 puts the drafter and a prompt-lookup chain of up to that many tokens under one
    per-step scheduler (greedy only; combine_drafters; acceptance: the `--tree auto` probe's {"acc", "counts"} as
    the tree head's prior). scheduler: the per-step scheduler (None = priced by the target's cached cost profile,
    made when needed). options go to the drafter's builder (prompt-lookup: max_ngram; draft-model: draft_target,
    draft_layers)."""
    head = None if isinstance(head_or_name, str) else head_or_name
    name = head.config.kind if head is not None else head_or_name
    kind = drafter_kind(name, head=head is not None)
    if isinstance(spec, TreeSpec):
        spec = check_tree_spec(spec, kind.family, drafter=kind.label, limits=tree_limits(head))
    else:
        spec = parse_tree(spec, name, head)
    if spec.mode == "auto" and kind.family != "block":
        raise ValueError("build_drafter: resolve --tree auto with autotree.choose_tree_for_head first")
    check_lookup(lookup)
    if kind.family == "block":  # scheduled per step: one scheduler for the head and any lookup merged in
        scheduler = scheduler or (Scheduler.for_target(target) if spec.mode == "auto" or lookup else None)
        options["scheduler"] = scheduler
    drafter = kind.build(target, head, spec, **options)
    if lookup:
        drafter = combine_drafters(target, [drafter], lookup=lookup, lookup_ngram=lookup_ngram,
                                   acceptances=[acceptance], scheduler=scheduler)
    return drafter


def check_lookup(lookup: int) -> None:
    """The prompt-lookup chain scheduled with a head: 0 (off) .. MAX_TREE_DEPTH tokens."""
    if isinstance(lookup, bool) or not isinstance(lookup, int) or not 0 <= lookup <= MAX_TREE_DEPTH:
        raise SpecheadsError(f"--lookup {lookup}: must be 0 (off) .. {MAX_TREE_DEPTH} prompt-lookup tokens")


def _medusa(target, head, spec: TreeSpec) -> Drafter:
    return MedusaDrafter(head, choices=[list(c) for c in spec.choices])


def _eagle(target, head, spec: TreeSpec) -> Drafter:
    return EagleDrafter(head, depth=spec.depth, top_k=spec.top_k, total_tokens=spec.total_tokens)


def _dspark(target, head, spec: TreeSpec, scheduler: Scheduler | None = None) -> Drafter:
    """`auto`: the per-step scheduler chooses the prefix; K: the first K drafts of every block."""
    if spec.mode == "auto":
        return DSparkDrafter(head, scheduler=scheduler)
    return DSparkDrafter(head, num_tokens=spec.num_tokens)


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


def _recycling(target, head, spec: TreeSpec) -> Drafter:
    """Token Recycling over the given static tree's rank paths."""
    return TokenRecyclingDrafter(target.vocab_size, choices=[list(c) for c in spec.choices])


for _kind in (DrafterKind("medusa", "static", "a Medusa head", _medusa, default_tree="default", head=True),
              DrafterKind("eagle", "dynamic", "an EAGLE head", _eagle, default_tree="5,8,48", head=True),
              DrafterKind("eagle3", "dynamic", "an EAGLE-3 head", _eagle, default_tree="5,8,48", head=True),
              DrafterKind("dspark", "block", "a DSpark head", _dspark, default_tree="auto", head=True),
              DrafterKind("prompt-lookup", "tokens", "prompt-lookup", _prompt_lookup, default_tree="8"),
              DrafterKind("draft-model", "tokens", "draft-model", _draft_model, default_tree="4"),
              DrafterKind("recycling", "static", "token recycling", _recycling, default_tree="default"),
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
