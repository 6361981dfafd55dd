"""Drafters: propose a DraftTree, then observe what the target accepted (the interface: engine/protocol.py).
One module per kind, each registering its DrafterKind (registry.py); build_drafter (build.py) is the one
constructor. A new kind is one module calling register_drafter, plus its import line below."""
from specheads.infer.drafters.registry import (DRAFTERS, DrafterKind, check_lookup, drafter_kind, parse_tree,
                                               register_drafter, tree_limits)
from specheads.infer.drafters.medusa import MedusaDrafter
from specheads.infer.drafters.eagle import EagleDrafter
from specheads.infer.drafters.dspark import DSparkDrafter
import specheads.infer.drafters.domino  # noqa: F401  (registers the domino kind)
import specheads.infer.drafters.dspine  # noqa: F401  (registers the dspine kind)
from specheads.infer.drafters.peagle import PEagleDrafter
from specheads.infer.drafters.prompt_lookup import PromptLookupDrafter
from specheads.infer.drafters.draft_model import DraftModelDrafter, draft_model_source, truncated_draft_model
from specheads.infer.drafters.recycling import TokenRecyclingDrafter
from specheads.infer.drafters.plain import NoDrafter
from specheads.infer.drafters.self_spec import LayerSkipDrafter
from specheads.infer.drafters.scored import (ScoredDrafter, ScoredLookupDrafter, ScoredTreeDrafter, emitted_tokens,
                                             scored)
from specheads.infer.drafters.union import ScheduledUnionDrafter, combine_drafters
from specheads.infer.drafters.build import build_drafter
from specheads.infer.engine.protocol import DraftContext, Drafter

__all__ = ["DRAFTERS", "DraftContext", "DraftModelDrafter", "Drafter", "DrafterKind", "DSparkDrafter", "EagleDrafter",
           "LayerSkipDrafter", "MedusaDrafter", "NoDrafter", "PEagleDrafter", "PromptLookupDrafter", "ScheduledUnionDrafter", "ScoredDrafter",
           "ScoredLookupDrafter", "ScoredTreeDrafter", "TokenRecyclingDrafter", "build_drafter", "check_lookup",
           "combine_drafters", "drafter_kind", "emitted_tokens", "parse_tree", "register_drafter", "scored",
           "tree_limits", "truncated_draft_model", "draft_model_source"]
