"""DSpark / DFlash block drafters: one parallel block of K drafts per anchor, read off the target's context.

Training samples at most `train.block.max_anchors` blocks per sequence (`sample_anchors`), teacher-forced (the
previous tokens are the data's), against the target's distributions at rows p+j (`block_targets`); evaluation
computes the block at every start row (`block_draft_outputs`) with the confidence head's logits beside it.
Shapes: B batch, T sequence, A anchors, K drafts per block, D hidden, V vocab, V' draft vocab, R rows.
"""
from __future__ import annotations

import torch

from specheads.heads.dspark import DSparkHead
from specheads.train.kinds.base import Drafts, HeadKind, States, draft_vocab, split_features, unwrap
from specheads.train.losses import LossOutput, dspark_loss
from specheads.train.teacher import has_sidecar, in_draft_vocab, lm_head_logits, target_greedy

def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None):
    """Block anchors per sequence, uniformly without replacement among the positions p whose first drafted token
    x_{p+1} is an assistant token (DeepSpec sample_anchor_positions; it also asks loss_mask[p], which differs
    only at the turn's first answer token), at most max_anchors each, ascending.

    loss_mask [B,T] -> (anchors [B,A] long, valid [B,A] bool) on loss_mask's device, A = min(max_anchors, the
    most candidates of a row); padding anchors are 0 and invalid. The draws come from `generator` (on its own
    device) or torch's global RNG: a trainer that checkpoints its generator resumes with the same anchors.
    """
    B, T = loss_mask.shape
    dev = generator.device if generator is not None else torch.device("cpu")
    cand = torch.zeros(B, T, dtype=torch.bool, device=dev)
    cand[:, 1:T - 1] = loss_mask[:, 2:].bool().to(dev)  # p >= 1 (a context row exists) and x_{p+1} assistant
    A = max(1, min(int(max_anchors), int(cand.sum(1).max())))
    score = torch.rand(B, T, generator=generator, device=dev).masked_fill(~cand, 2.0)  # candidates first, shuffled
    pick = score.argsort(dim=1)[:, :A]
    valid = cand.gather(1, pick)
    anchors = torch.where(valid, pick, torch.full_like(pick, T + 1)).sort(dim=1).values  # valid ones first
    valid = anchors <= T
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def block_valid(loss_mask: torch.Tensor, anchors: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """[B,A,K'] bool: draft j of the block at p predicts x_{p+1+j} inside the sequence and an assistant token, and
    so do drafts < j (DeepSpec build_eval_mask: a contiguous prefix)."""
    T = loss_mask.shape[1]
    idx = anchors[..., None] + 1 + torch.arange(num_drafts, device=anchors.device)  # [B,A,K']
    ok = (idx < T) & loss_mask.bool().gather(1, idx.clamp(max=T - 1).flatten(1)).view(idx.shape)
    return ok.long().cumprod(-1).bool()


@torch.no_grad()
def block_targets(head, target, h_last: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                  full_vocab: bool = False, sidecar: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The target's distribution for draft j of the block at p is its next-token distribution at row p+j: the
    frozen lm_head on h_L[p+j], computed once per distinct row the valid drafts read. h_last [B,T,D], anchors
    [B,A], valid [B,A,K'] -> (logits at the draft-vocab columns [B,A,K',V'], their logsumexp [B,A,K'], target
    argmax in the draft vocab [B,A,K'] bool); entries of invalid drafts are those of a valid one (masked).

    With a draft vocabulary, by default only its V' columns are computed and the target is renormalised over them
    (speculators' verifier_lm_head holds exactly those rows): the lm_head over the full vocabulary is the largest
    matmul of a step (49,152 columns for SmolLM2 against 4-8k). full_vocab: the logsumexp is the full one (the
    confidence target becomes the exact acceptance of a V'-draft, and drafts whose target argmax lies outside V'
    leave the CE / L1, as in eagle3_loss): from the batch's `sidecar` (target_greedy, target_lse [B,T]) at the V'
    columns' cost, else from every column."""
    B, T = h_last.shape[:2]
    rows = (anchors[..., None] + torch.arange(valid.shape[-1], device=anchors.device)).clamp(max=T - 1)  # [B,A,K']
    need = torch.zeros(B, T, dtype=torch.bool, device=h_last.device)
    need[torch.arange(B, device=rows.device)[:, None, None].expand_as(rows)[valid], rows[valid]] = True
    where = need.flatten().cumsum(0).view(B, T) - 1  # row -> its index among the computed ones
    d2t = draft_vocab(head)
    if d2t is None or (full_vocab and sidecar is None):
        logits = lm_head_logits(target, h_last[need]).float()  # [R,V]
    else:
        logits = head.target_lm_logits(h_last[need]).float()  # [R,V'] (the head caches these lm_head rows)
    lse = logits.logsumexp(-1)
    ok = torch.ones_like(lse, dtype=torch.bool)
    if d2t is not None and full_vocab:
        d2t = d2t.to(logits.device)
        if sidecar is None:
            greedy = logits.argmax(-1)
            logits = logits[:, d2t]
        else:
            greedy, lse = sidecar[0].to(need.device)[need].long(), sidecar[1].to(need.device)[need].float()
        ok = in_draft_vocab(d2t, target.lm_head.weight.shape[0])[greedy.clamp(min=0)] & (greedy >= 0)
    if logits.shape[0] == 0:  # no valid draft in the batch
        logits, lse, ok = logits.new_zeros(1, logits.shape[1]), lse.new_zeros(1), ok.new_ones(1)
    idx = where.gather(1, rows.flatten(1)).view(rows.shape).clamp(min=0) * valid
    return logits[idx], lse[idx], ok[idx]


def loss(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, settings) -> LossOutput:
    """Sampled blocks, teacher-forced (previous tokens = the data's), against the target's distributions."""
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    inner = unwrap(head)
    K = inner.num_drafts
    anchors, avalid = sample_anchors(lmask, settings.block.max_anchors, settings.generator)
    logits, conf = head(h_in.float(), ids, anchors, batch["attention_mask"])  # [B,A,K',V'], [B,A,K']
    valid = block_valid(lmask, anchors, K) & avalid[..., None]
    side = (batch["target_greedy"], batch["target_lse"]) if has_sidecar(batch) else None
    tgt, lse, ok = block_targets(inner, target, h_last, anchors, valid, settings.block.full_vocab, side)
    keep = avalid  # [B,A]: padding blocks leave the loss entirely
    return dspark_loss(logits[keep], None if conf is None else conf[keep], tgt[keep], lse[keep], ok[keep],
                       valid[keep], gamma=settings.block.gamma, alpha=settings.block.confidence_alpha,
                       loss=settings.distill(DSparkHead.kind), weighting=settings.block.weighting,
                       dpace_alpha=settings.block.dpace_alpha)


@torch.no_grad()
def block_draft_outputs(head, batch: dict, target, layers: list[int], head_layers: list[int],
                        targ: torch.Tensor | None = None, chunk: int = 64):
    """Teacher-forced blocks at EVERY start row for evaluation -> (list of K' [B,T,V'] logits, confidence logits
    [K',B,T] (raw, before the head's temperatures) or None, target argmax [B,T]).

    Row t holds the block anchored at p = t+1 (context rows 0..t, anchor x_{t+1}): draft j predicts token t+2+j,
    the alignment every kind's evaluation uses. Only rows whose first draft is an assistant token are computed
    (the rest stay 0, as evaluation never starts there); blocks go `chunk` anchors at a time per sequence.
    """
    h_in, h_last = split_features(batch["hidden"], layers, head_layers, target.num_layers)
    return _block_drafts(head, batch, h_in, h_last, target, targ, chunk)


@torch.no_grad()
def _block_drafts(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, targ=None, chunk: int = 64):
    """block_draft_outputs on the batch's split features."""
    inner = unwrap(head)
    ids, lmask, amask = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    if targ is None:
        targ = target_greedy(target, h_last, batch)
    B, T = ids.shape
    K, V = inner.num_drafts, inner.config.out_vocab
    anchors, avalid = _all_anchors(lmask)
    ctx = inner.context_kv(h_in.float())
    steps = [torch.zeros(B, T, V, dtype=inner.head_dtype, device=ids.device) for _ in range(K)]
    conf = torch.zeros(K, B, T, device=ids.device) if inner.confidence_head is not None else None
    pos = torch.arange(T, device=ids.device)
    for c in range(0, anchors.shape[1], chunk):
        a, v = anchors[:, c:c + chunk], avalid[:, c:c + chunk]
        allowed = (pos < a[..., None]) & amask.bool()[:, None, :]
        h = inner.blocks(ctx, allowed, ids.gather(1, a), a)
        prev = ids.gather(1, (a[..., None] + torch.arange(K, device=a.device)).clamp(max=T - 1).flatten(1))
        lg, cf = inner.heads(h, prev.view(*a.shape, K))
        bi, ai = v.nonzero(as_tuple=True)
        rows = a[bi, ai] - 1  # the block at p sits on row p-1
        for j in range(K):
            steps[j][bi, rows] = lg[bi, ai, j].to(steps[j].dtype)  # a bf16 target's full-vocabulary logits
            if conf is not None:
                conf[j, bi, rows] = cf[bi, ai, j].float()
    return steps, conf, targ


def _all_anchors(loss_mask: torch.Tensor):
    """Every anchor p whose first draft x_{p+1} is an assistant token -> (anchors [B,A], valid [B,A])."""
    cand = torch.zeros_like(loss_mask, dtype=torch.bool)
    cand[:, 1:-1] = loss_mask[:, 2:].bool()
    A = max(1, int(cand.sum(1).max()))
    order = torch.where(cand, torch.arange(cand.shape[1], device=cand.device), cand.shape[1]).sort(1).values[:, :A]
    valid = order < cand.shape[1]
    return torch.where(valid, order, torch.zeros_like(order)), valid


@torch.no_grad()
def drafts(head, batch: dict, h_in: torch.Tensor, h_last: torch.Tensor, target, eagle_steps: int) -> Drafts:
    """Every start row's block, with the confidences calibrated as the head serves them (positions last:
    [K,B,T] -> [B,T,K] for the head's rule, then back)."""
    steps, conf, targ = _block_drafts(head, batch, h_in, h_last, target)
    inner = unwrap(head)
    if conf is not None:
        conf = inner.calibrated(conf.movedim(0, -1)).movedim(-1, 0)
    return Drafts(steps, draft_vocab(inner), targ, conf)


def state_anchors(visited: States, batch_size: int):
    """The visited states' roots as block anchors: (anchors [B,A] long, each row's distinct roots ascending, padded
    with its first (valid: never read); slot [S], the state's anchor column)."""
    rows = [visited.root[visited.b == b].unique() for b in range(batch_size)]  # sorted
    A = max(1, max(int(r.numel()) for r in rows))
    anchors = torch.ones(batch_size, A, dtype=torch.long, device=visited.root.device)
    for b, r in enumerate(rows):
        if r.numel():
            anchors[b] = r[0]
            anchors[b, :r.numel()] = r
    slot = torch.zeros_like(visited.root)
    for b, r in enumerate(rows):
        m = visited.b == b
        slot[m] = torch.searchsorted(r, visited.root[m])
    return anchors, slot


def states(head, batch: dict, h_in: torch.Tensor, visited: States) -> torch.Tensor:
    """On-policy replay: the block anchored at each visited root, teacher-forced (draft j reads the sequence's
    token p+j as its previous one, the drafted token wherever the target accepted the drafts before it) ->
    [S,V'] at the visited states."""
    anchors, slot = state_anchors(visited, batch["input_ids"].shape[0])
    logits, _ = head(h_in.float(), batch["input_ids"], anchors, batch["attention_mask"])  # [B,A,K',V']
    return logits[visited.b, slot, visited.depth]


KIND = HeadKind(DSparkHead.kind, loss, drafts, states)  # the dspark kind's step (its KindSpec.train_step)
