"""EAGLE-1 / EAGLE-3 heads (Li et al. 2024, arXiv 2401.15077; 2503.01840) drafting the EAGLE-2 dynamic tree
(arXiv 2406.16858): the head runs on the target's features with its own KV cache of true rows."""
from __future__ import annotations

import torch

from specheads.heads.eagle import EagleHead
from specheads.heads.eagle3 import Eagle3Head
from specheads.infer.drafters.registry import DrafterKind, register_drafter
from specheads.kvcache import drop_tail
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.tree import DraftTree, chain_tree, dynamic_tree, tree_from_parents
from specheads.infer.treespec import TreeSpec


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
                drop_tail(self.cache, self.draft.count)
            self.draft = None


class _DraftRows:
    """The rows one EAGLE tree adds to the head cache, grown as a DraftTree whose node 0 is the root's true row:
    row r >= 1 holds a tree node, its parent is its parent node's row. hidden / logp: each row's head outputs."""

    def __init__(self, root: int, hidden: torch.Tensor, logp: torch.Tensor):
        self.tokens, self.parents = [root], [-1]  # per row
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
        return first

    def tree(self) -> DraftTree:
        return tree_from_parents(self.tokens, self.parents)


def _eagle(target, head, spec: TreeSpec) -> Drafter:
    return EagleDrafter(head, depth=spec.depth, top_k=spec.top_k, total_tokens=spec.total_tokens)


EAGLE_KIND = register_drafter(DrafterKind(EagleHead.kind, "dynamic", "an EAGLE head", _eagle, default_tree="5,8,48",
                                         head=True))
EAGLE3_KIND = register_drafter(DrafterKind(Eagle3Head.kind, "dynamic", "an EAGLE-3 head", _eagle,
                                          default_tree="5,8,48", head=True))
