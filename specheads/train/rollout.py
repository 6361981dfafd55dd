"""Rollouts for on-policy distillation (train/opd.py): the head drafts with its own serving drafter, the frozen
target verifies in our engine (infer/engine/generate.py), and what the step saw is recorded.

A `Recorder` wraps the drafter and passes every call through. From the calls the engine makes anyway it keeps:
- the target features the drafter was given: the prompt's cached rows (`reset`) and each step's accepted nodes
  (`observe`), i.e. row t of the rolled-out sequence holds exactly the features serving fed the drafter for
  token t;
- per step, the draft states on the accepted path: every accepted node (the root included) that has draft
  children. Its children were drawn from the draft's distribution q at that state, and the target's verify pass
  gave its distribution p there (`recycle`: the target's logits after each tree node, at the draft vocabulary's
  columns). The state is accepted when the target took one of those children, rejected when it took none (the
  step's last accepted node: the target's own token follows). Nodes below a rejected node are not states: no
  served step ever continues from them.

Shapes: T sequence, N tree nodes, S states, F feature layers, D hidden, V vocab, V' draft vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.infer.drafters.build import build_drafter
from specheads.infer.drafters.registry import drafter_kind, parse_tree
from specheads.infer.engine.generate import SpeculativeGenerator
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.train.kinds.base import States
from specheads.utils import SpecheadsError


@dataclass
class Rollout:
    """One prompt rolled out: the sequence, the drafter's features along it and the draft states it visited."""

    ids: list[int]  # prompt + generated tokens
    prompt_len: int
    features: torch.Tensor  # [T, F*D] the drafter's input features of row t (rows never fed: zero)
    root: torch.Tensor  # [S] long, the state's step root position
    depth: torch.Tensor  # [S] long, its depth below the root (its drafts predict token root + 1 + depth)
    accepted: torch.Tensor  # [S] bool, the target accepted one of its drafts
    target_logits: torch.Tensor  # [S, V'] the target's verify logits there, at the draft vocabulary's columns
    proposal: torch.Tensor  # [S] long target id of its first draft child (a chain's one draft)
    forwards: int  # target tree forwards (speculative steps)
    new_tokens: int
    q: torch.Tensor | None = None  # [S, V] the distribution a sampled step drew the state's drafts from (keep_q)


class Recorder(Drafter):
    """A drafter that records what the engine shows it (module docstring) and otherwise is `inner`."""

    def __init__(self, inner: Drafter, columns: torch.Tensor | None, keep_q: bool = False):
        self.inner, self.columns, self.keep_q = inner, columns, keep_q  # columns: [V'] target ids kept
        self.name, self.feature_layers, self.reads_logits = inner.name, inner.feature_layers, inner.reads_logits
        self.features: list[torch.Tensor] = []
        self.states: list[tuple[int, int, bool, int]] = []  # (root, depth, accepted, first child token)
        self.rows: list[torch.Tensor] = []  # [V'] target logits per state
        self.q: list[torch.Tensor] = []  # [V] sampled steps' draft distributions per state (keep_q)
        self._root = 0
        self._logits: torch.Tensor | None = None

    def reset(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        self.features = [] if features is None else [features.detach().cpu()]
        self.states, self.rows, self.q = [], [], []
        self.inner.reset(prompt_ids, features)

    def propose(self, ctx: DraftContext):
        self._root = len(ctx.ids) - 1
        return self.inner.propose(ctx)

    def recycle(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        self._logits = logits  # [N, V]: the last call before observe is this step's verify pass
        self.inner.recycle(tokens, logits)

    def observe(self, tree, accepted, features) -> None:
        self._record(tree, accepted.nodes)
        if features is not None:
            self.features.append(features.detach().cpu())
        self.inner.observe(tree, accepted, features)

    def step_report(self):
        return self.inner.step_report()

    def _record(self, tree, nodes: list[int]) -> None:
        """The step's states: accepted nodes with draft children (module docstring)."""
        parents = tree.parents.tolist()
        first_child: dict[int, int] = {}
        for i in range(len(parents) - 1, 0, -1):  # the lowest-index child last written
            first_child[parents[i]] = i
        for k, n in enumerate(nodes):
            if n not in first_child:
                continue
            row = self._logits[n]
            row = row if self.columns is None else row[self.columns.to(row.device)]
            self.states.append((self._root, int(tree.depth[n]), k + 1 < len(nodes), int(tree.tokens[first_child[n]])))
            self.rows.append(row.detach().float().cpu())
            if self.keep_q and tree.q is not None:
                self.q.append(tree.q[n].detach().float().cpu())


def rollout_drafter(target, head, tree: str | None) -> Drafter:
    """The head's serving drafter for rollouts: `tree` (train.opd.tree) or the kind's default tree; a scheduled
    tree (`auto`) is refused, except a block head's default `auto`, read as its whole block as a chain."""
    kind = head.config.kind
    spec = parse_tree(tree, kind, head, flag="train.opd.tree")
    if spec.scheduled:
        if tree is not None or drafter_kind(kind, head=True).family != "block":
            raise SpecheadsError(f"train.opd.tree {tree or spec.mode!r}: a scheduled tree times this machine, and "
                                 f"rollouts must not depend on its load; give a fixed tree (e.g. chain:4)")
        spec = parse_tree(f"chain:{head.num_drafts}", kind, head, flag="train.opd.tree")
    return build_drafter(target, head, spec)


@torch.no_grad()
def rollout(target, head, prompt: list[int], tree: str | None, max_new_tokens: int, temperature: float = 0.0,
            seed: int | None = None, keep_q: bool = False) -> Rollout:
    """Generate from `prompt` with `head` drafting and the target verifying; record the visited draft states
    (keep_q: also the distributions sampled steps drew the drafts from, for checks)."""
    if len(prompt) < 2:
        raise SpecheadsError("rollout: a prompt needs at least 2 tokens (the first step's root has no context row)")
    rec = Recorder(rollout_drafter(target, head, tree), getattr(head, "d2t", None), keep_q)
    gen = SpeculativeGenerator(target, rec)
    for _ in gen.stream(input_ids=list(prompt), max_new_tokens=max_new_tokens, temperature=temperature, seed=seed):
        pass
    res = gen.result
    ids = list(prompt) + list(res.ids)
    T = len(ids)
    feats = torch.cat(rec.features)[:T] if rec.features else torch.zeros(0, 1)
    if feats.shape[0] < T:  # the last tokens (the final bonus) were never fed to the drafter
        feats = torch.cat([feats, feats.new_zeros(T - feats.shape[0], feats.shape[1])])
    keep = [i for i, (r, d, _, _) in enumerate(rec.states) if r >= 1 and r + d + 1 < T]  # inside what was emitted
    col = [torch.tensor([rec.states[i][c] for i in keep], dtype=torch.long) for c in range(4)]
    V = rec.rows[0].shape[-1] if rec.rows else 1
    rows = torch.stack([rec.rows[i] for i in keep]) if keep else torch.zeros(0, V)
    q = torch.stack([rec.q[i] for i in keep]) if keep and len(rec.q) == len(rec.states) else None
    return Rollout(ids, len(prompt), feats, col[0], col[1], col[2].bool(), rows, col[3], res.stats.target_forwards,
                   res.stats.new_tokens, q)


def rollout_batch(rollouts: list[Rollout], device) -> tuple[dict, torch.Tensor, States, torch.Tensor, torch.Tensor]:
    """Right-padded batch of the rolled-out sequences -> (batch {input_ids, attention_mask, loss_mask (the generated
    tokens)} [B,T], h_in [B,T,F*D], the visited States, their accepted flags [S], target logits [S,V'])."""
    B, T = len(rollouts), max(len(r.ids) for r in rollouts)
    W = max(r.features.shape[1] for r in rollouts)
    ids = torch.zeros(B, T, dtype=torch.long)
    amask, lmask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    h_in = torch.zeros(B, T, W, dtype=rollouts[0].features.dtype)
    for b, r in enumerate(rollouts):
        n = len(r.ids)
        ids[b, :n], amask[b, :n] = torch.tensor(r.ids), 1
        lmask[b, r.prompt_len:n] = 1
        h_in[b, :n, :r.features.shape[1]] = r.features
    states = States(torch.cat([torch.full_like(r.root, b) for b, r in enumerate(rollouts)]),
                    torch.cat([r.root for r in rollouts]), torch.cat([r.depth for r in rollouts]))
    batch = {"input_ids": ids.to(device), "attention_mask": amask.to(device), "loss_mask": lmask.to(device)}
    states = States(*(t.to(device) for t in (states.b, states.root, states.depth)))
    accepted = torch.cat([r.accepted for r in rollouts]).to(device)
    target_logits = torch.cat([r.target_logits for r in rollouts]).to(device)
    return batch, h_in.to(device), states, accepted, target_logits
