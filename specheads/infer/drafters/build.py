"""build_drafter, the one drafter constructor: a registered kind's drafter for a head or a training-free name, its
`--tree` checked against the kind's family and limits, optionally scheduled with a prompt-lookup chain."""
from __future__ import annotations

from specheads.infer.drafters.registry import check_lookup, drafter_kind, parse_tree, tree_limits
from specheads.infer.drafters.union import combine_drafters
from specheads.infer.engine.protocol import Drafter
from specheads.infer.scheduling.step import Scheduler
from specheads.infer.treespec import TreeSpec, check_tree_spec


def build_drafter(target, head_or_name, spec: TreeSpec | str | None = None, *, lookup: int = 0,
                  lookup_ngram: int = 3, acceptance: dict | None = None, scheduler: Scheduler | None = None,
                  pricing: str = "measured", **options) -> Drafter:
    """The one drafter constructor. head_or_name: a loaded DraftHead (its kind picks the drafter) or a training-free
    drafter name (plain, prompt-lookup, draft-model, recycling). spec: a TreeSpec, `--tree` text, or None (the
    drafter's default); a tree head's `auto` is resolved first by autotree.choose_tree_for_head, a block head's
    `auto` is its per-step scheduler. lookup > 0 puts the drafter and a prompt-lookup chain of up to that many
    tokens under one per-step scheduler (greedy only; combine_drafters; acceptance: the `--tree auto` probe's
    {"acc", "counts"} as the tree head's prior). scheduler: the per-step scheduler (None = priced by the target's
    cached cost profile, made when needed, with `pricing`: step.PRICINGS). options go to the drafter's builder
    (prompt-lookup: max_ngram; draft-model: draft_target, draft_layers; layer-skip: skip, calib_ids)."""
    head = None if isinstance(head_or_name, str) else head_or_name
    name = head.config.kind if head is not None else head_or_name
    kind = drafter_kind(name, head=head is not None)
    if isinstance(spec, TreeSpec):
        spec = check_tree_spec(spec, kind.family, drafter=kind.label, limits=tree_limits(head))
    else:
        spec = parse_tree(spec, name, head)
    if spec.scheduled and kind.family != "block":
        raise ValueError("build_drafter: resolve --tree auto with autotree.choose_tree_for_head first")
    check_lookup(lookup)
    if kind.check is not None:
        kind.check(target)
    if scheduler is None and (lookup or (kind.family == "block" and spec.scheduled)):
        scheduler = Scheduler.for_target(target, pricing=pricing)  # one for the head and any lookup merged in
    if kind.family == "block":  # scheduled per step (its `auto`, `tree:auto`)
        options["scheduler"] = scheduler
    drafter = kind.build(target, head, spec, **options)
    if lookup:
        drafter = combine_drafters(target, [drafter], lookup=lookup, lookup_ngram=lookup_ngram,
                                   acceptances=[acceptance], scheduler=scheduler)
    return drafter
