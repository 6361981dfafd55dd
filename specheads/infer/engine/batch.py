"""Batched speculative generation: many prompts, ONE target forward per step over every row's tree.

B rows, N tree nodes (the batch's largest tree; smaller ones are padded), S cache columns, V vocab, D hidden,
F feature layers.
Cache layout: row r holds its `length_r` cached entries in columns [0, length_r) (left-aligned); columns
[length_r, S) are padding its mask hides, S = the longest row. Positions are per row (length_r + depth), so a
row's entries never move for another row's sake. One step:
  1. each row's own drafter proposes a tree (one Drafter per row: drafters keep per-request state); an optional
     scheduler trims the trees to per-row verify budgets (scheduling.batch_budget.BudgetScheduler);
  2. the trees are packed (`pack_trees`): tokens [B,N], positions [B,N], ONE 4D float mask [B,1,N,S+N]
     (a node sees its row's cached columns, its ancestors and itself; a padding node sees only itself);
  3. ONE target forward appends N columns to every row;
  4. each row is verified by the same rules as `generate` (never the drafter; verify.verify_rows): greedy rows
     with the logits on an accelerator all at once (greedy_batch_on_device: one host transfer per step), on the
     host or sampling each row alone (verify_greedy / verify_sampling);
  5. `kvcache.keep_accepted_rows`: each row's accepted nodes move down to columns [length_r, length_r + A_r) (one
     gather per layer for the whole batch), then the cache is cut to its longest row;
  6. drafters observe, tokens are emitted and cut at stops; finished rows leave the batch (one copy of the cache)
     and waiting prompts join (prefilled together, right-padded, then appended as rows).
Greedy output of every row equals that row decoded alone (fp32; tests/test_batch.py). Sampling draws each row from
its own generator (seed + row index). Sliding-window caches are refused (their rows cannot be re-aligned).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from specheads.infer.engine.generate import (PHASES, GenerationResult, GenerationStats, Request, cut_at_stop,
                                             encode_prompt, phase_timer)
from specheads.kvcache import (cache_columns, keep_accepted_rows, merge_caches, new_batch_cache,
                                            select_rows)
from specheads.infer.engine.protocol import DraftContext, Drafter
from specheads.infer.tree import DraftTree
from specheads.infer.verify import VERIFICATIONS, Accepted, SamplingParams, verifier, verify_rows
from specheads.utils import SpecheadsError


@dataclass
class BatchStats:
    rows: int = 0  # prompts decoded
    new_tokens: int = 0
    target_forwards: int = 0  # batched tree forwards (prefills excluded)
    row_forwards: int = 0  # forwards summed over rows (a forward of b rows counts b)
    tau: float = 0.0  # new_tokens / row_forwards: tokens per row per forward, bonus included; plain = 1.00
    tokens_per_s: float = 0.0  # new_tokens / wall_s (prefills included: rows join while others decode)
    wall_s: float = 0.0
    prefill_s: float = 0.0  # every prefill forward (the first rows' and each join's)
    prefills: int = 0
    max_rows: int = 0  # most rows in one forward
    mean_rows: float = 0.0  # rows per tree forward, averaged
    tree_nodes: int = 0  # nodes sent, padding excluded
    padded_nodes: int = 0  # rows x N summed over forwards (padding included)
    timings: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})  # seconds per phase

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BatchResult:
    rows: list[GenerationResult]  # in prompt order; each row's stats count the forwards it took part in
    stats: BatchStats


@dataclass
class _Row:
    index: int  # position in the prompt list
    ids: list[int]  # prompt + emitted; ids[-1] is the root, not yet cached
    drafter: Drafter
    req: Request
    prompt_len: int
    new: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    t_join: float = 0.0

    @property
    def length(self) -> int:
        """Cached entries of this row: every token but the root."""
        return len(self.ids) - 1


# ------------------------------------------------------------------------------------------------ pure helpers
def pack_trees(trees: Sequence[DraftTree], lengths: Sequence[int], cols: int, dtype: torch.dtype, device=None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's trees as one forward: tokens [B,N], position ids [B,N] (length_r + depth) and the 4D float mask
    [B,1,N,cols+N] (0 = attend). Row r's node i attends the row's cached columns [0, length_r), its ancestors and
    itself; columns [length_r, cols) are another row's length, hidden. A padding node (i >= len(tree_r)) repeats
    the root at position length_r and attends only itself (a fully masked row would give NaN)."""
    B, N = len(trees), max(len(t) for t in trees)
    tokens = torch.zeros(B, N, dtype=torch.long)
    pos = torch.zeros(B, N, dtype=torch.long)
    allowed = torch.zeros(B, N, cols + N, dtype=torch.bool)
    allowed[:, :, cols:] = torch.eye(N, dtype=torch.bool)  # every node sees itself (padding ones only that)
    for r, (tree, length) in enumerate(zip(trees, lengths)):
        n = len(tree)
        tokens[r, :n], tokens[r, n:] = tree.tokens, tree.tokens[0]
        pos[r, :n], pos[r, n:] = length + tree.depth, length
        allowed[r, :n, :length] = True
        allowed[r, :n, cols:cols + n] = tree.ancestors()
    mask = torch.zeros(B, 1, N, cols + N, dtype=dtype).masked_fill_(~allowed[:, None], float("-inf"))
    if device is not None:
        tokens, pos, mask = tokens.to(device), pos.to(device), mask.to(device)
    return tokens, pos, mask


# ------------------------------------------------------------------------------------------------ the loop
class BatchGenerator:
    """One target, a drafter per row (`make_drafter()` builds one), one verification rule, an optional scheduler
    (`depth_limits(rows) -> [max depth or None] | None` before drafting, `select(trees, rows) -> trees` before the
    forward, `observe(rows, trees, accepted, draft_s=, target_s=)` after it with the step's measured drafting and
    forward seconds; rows are the rows' prompt indices; scheduling.batch_budget.BudgetScheduler).
    `run(...)` decodes every prompt with at most `batch_size` rows together."""

    def __init__(self, target, make_drafter: Callable[[], Drafter], verification: str = "auto", scheduler=None):
        if verification not in VERIFICATIONS:
            raise SpecheadsError(f"verification {verification!r}: expected auto, greedy, sampling or typical-lossy")
        self.target, self.make_drafter, self.verification = target, make_drafter, verification
        self.scheduler = scheduler
        self.cache = None
        self.layers: list[int] | None = None  # hidden-state ids the rows' drafters read
        self.rows: list[_Row] = []  # the live rows, in batch order
        self.stats = BatchStats()

    @torch.no_grad()
    def run(self, prompts: Sequence, max_new_tokens: int | Sequence[int] = 128, *, batch_size: int | None = None,
            temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, eos_token_ids: Sequence[int] | None = None,
            stop_strings: Sequence[str] = (), seed: int | Sequence[int] | None = None, ignore_eos: bool = False
            ) -> BatchResult:
        t0 = time.perf_counter()
        sampling = SamplingParams(float(temperature), float(top_p), int(top_k or 0))
        caps = _per_row(max_new_tokens, len(prompts), "max_new_tokens")
        seeds = _seeds(seed, len(prompts))
        ids = [encode_prompt(self.target, input_ids=p) for p in prompts]
        work = deque(_Row(i, p, None, self._request(i, len(p), caps[i], sampling, eos_token_ids, stop_strings,
                                                     seeds[i], ignore_eos), len(p)) for i, p in enumerate(ids))
        size = len(prompts) if batch_size is None else int(batch_size)
        if size < 1:
            raise SpecheadsError(f"batch_size {batch_size}: must be at least 1")
        self.cache, self.rows, self.stats = None, [], BatchStats(rows=len(prompts))
        done: dict[int, GenerationResult] = {}
        while self.rows or work:
            if work and len(self.rows) < size:
                self._join([work.popleft() for _ in range(min(size - len(self.rows), len(work)))])
            finished = [r for r in self.rows if r.stats.stop_reason]  # a prompt may fill its cap at 0 tokens
            if len(finished) < len(self.rows):
                finished += self._step()
            for row in finished:
                done[row.index] = self._row_result(row)
            self._drop(finished)
        results = [done[i] for i in range(len(prompts))]
        self.stats.new_tokens = sum(len(r.ids) for r in results)
        return BatchResult(results, self._finish(t0))

    def _request(self, i: int, prompt_len: int, cap: int, sampling: SamplingParams, eos, stop_strings, seed,
                 ignore_eos: bool) -> Request:
        window = self.target.max_positions or (1 << 62)
        if prompt_len >= window:
            raise SpecheadsError(f"prompt {i}: {prompt_len} tokens do not fit the context window of {window} of "
                                 f"target {self.target.name} (no room for a new token); shorten it")
        generator = None if seed is None else torch.Generator().manual_seed(int(seed))
        stops = set() if ignore_eos else set(self.target.eos_token_ids if eos is None else eos)
        return Request(int(cap), stops, stop_strings, window, sampling, generator,
                       verifier(self.verification, sampling, generator))

    def _join(self, new: list[_Row]) -> None:
        """Prefill the newcomers together (every prompt token but the root, right-padded: causal attention keeps
        the padding out of every real position), reset their drafters with their features, and append them below
        the live rows."""
        t = time.perf_counter()
        for row in new:
            row.drafter = self.make_drafter()
        layers = self.layers = self._feature_layers(new)
        lens = [row.length for row in new]
        fresh = new_batch_cache(self.target.model)
        feats = logits = None
        if max(lens) > 0:
            ids = torch.zeros(len(new), max(lens), dtype=torch.long)
            for r, row in enumerate(new):
                ids[r, :lens[r]] = torch.tensor(row.ids[:-1])
            pos = torch.arange(max(lens)).repeat(len(new), 1)
            reads = any(row.drafter.reads_logits for row in new)  # else no prompt logits: B x T x V floats
            logits, feats = self._forward(ids, pos, None, fresh, layers, all_logits=reads)
        for r, row in enumerate(new):
            row.drafter.reset(torch.tensor(row.ids), None if feats is None else feats[r, :lens[r]])
            if logits is not None and lens[r]:  # the prompt's own candidates (Token Recycling)
                row.drafter.recycle(torch.tensor(row.ids[:-1]), logits[r, :lens[r]])
            row.t_join = time.perf_counter()
        if self.cache is None:
            self.cache = fresh
        else:
            merge_caches(self.cache, fresh, len(self.rows), len(new))
        self.rows += new
        dt = time.perf_counter() - t
        for row in new:
            row.stats.prefill_s = dt
            _check_room(row)
        self.stats.prefill_s += dt
        self.stats.prefills += 1

    def _feature_layers(self, new: list[_Row]) -> list[int] | None:
        """The hidden-state ids the drafters read (one list for the batch: the rows' drafters are of one kind)."""
        layers = {tuple(r.drafter.feature_layers) if r.drafter.feature_layers is not None else None
                  for r in new + self.rows}
        if len(layers) > 1:
            raise SpecheadsError(f"generate_batch: the drafters read different feature layers "
                                 f"{sorted(map(str, layers))}; make_drafter must build drafters of one kind")
        (one,) = layers
        return None if one is None else list(one)

    def _forward(self, tokens: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache, layers,
                 all_logits: bool = True):
        """One target forward over [B, n] tokens -> (logits [B, n, V] | None when not all_logits, features
        [B, n, F*D] | None)."""
        dev = self.target.device
        out = self.target.model(input_ids=tokens.to(dev), attention_mask=None if mask is None else mask.to(dev),
                                position_ids=pos.to(dev), logits_to_keep=0 if all_logits else 1,
                                cache=cache, use_cache=True, output_hidden_states=layers is not None)
        feats = None
        if layers is not None:
            feats = torch.cat([out.hidden_states[i] for i in layers], dim=-1)  # [B, n, F*D]
        return (out.logits if all_logits else None), feats

    def _step(self) -> list[_Row]:
        """One speculative step of every live row in ONE target forward; returns the rows that finished."""
        tm, rows, cols = self.stats.timings, self.rows, cache_columns(self.cache)
        lengths = [row.length for row in rows]
        before = dict(tm)  # this step's drafting and forward seconds go to the scheduler
        with phase_timer(tm, "draft"):  # each row's own drafter; a depth-d node sits at length + d (bonus: + 1)
            limits = self.scheduler.depth_limits([row.index for row in rows]) if self.scheduler is not None else None
            trees = self._propose(rows, [None] * len(rows) if limits is None else limits)
            if self.scheduler is not None:  # per-row verify budgets: the trees cut to their most likely nodes
                trees = self.scheduler.select(trees, [row.index for row in rows])
        with phase_timer(tm, "tree"):  # padded to the largest tree; each node sees its row's cache, ancestors, self
            tokens, pos, mask = pack_trees(trees, lengths, cols, self.target.dtype)  # [B,N], [B,N], [B,1,N,cols+N]
        with phase_timer(tm, "target"):  # ONE forward over every row's nodes
            logits, feats = self._forward(tokens, pos, mask, self.cache, self.layers)  # [B,N,V], [B,N,F*D] | None
        with phase_timer(tm, "verify"):
            # by the same rules as `generate`: greedy = the longest path equal to the target's argmax plus the bonus
            # argmax (logits off the host: every row in one call, one host transfer); sampling = recursive rejection
            # with the row's own generator, each row alone. Never sees the drafter
            accs = verify_rows([row.req.verify for row in rows], trees, logits)
        with phase_timer(tm, "cache"):  # each row keeps its prefix + root + accepted nodes, left-aligned
            keep_accepted_rows(self.cache, cols, lengths, [acc.nodes for acc in accs])
        with phase_timer(tm, "draft"):  # each drafter sees its outcome and its accepted nodes' true features
            for r, (row, tree, acc) in enumerate(zip(rows, trees, accs)):
                row.drafter.recycle(tree.tokens, logits[r, :len(tree)])
                row.drafter.observe(tree, acc, None if feats is None else feats[r, acc.nodes])
        if self.scheduler is not None:  # outcomes and this step's measured costs (drafting: propose + observe)
            self.scheduler.observe([row.index for row in rows], trees, accs, draft_s=tm["draft"] - before["draft"],
                                   target_s=tm["target"] - before["target"])
        with phase_timer(tm, "other"):  # emit accepted tokens + bonus, cut at a stop (the stop token is emitted)
            finished = [row for row, tree, acc in zip(rows, trees, accs) if self._emit(row, tree, acc)]
        s = self.stats
        s.target_forwards += 1
        s.row_forwards += len(rows)
        s.tree_nodes += sum(len(t) for t in trees)
        s.padded_nodes += len(rows) * tokens.shape[1]
        s.max_rows = max(s.max_rows, len(rows))
        return finished

    def _propose(self, rows: list[_Row], limits: list[int | None]) -> list[DraftTree]:
        """Each row's tree, no deeper than the positions left (room - 1 below the root) and the scheduler's limit
        (0 = no drafting this step: drafters return the root alone and keep their state for the next step).
        Drafters of a class with `propose_many(drafters, contexts)` (DSparkDrafter) propose together: one head
        pass for the rows it can batch."""
        depths = [row.req.window - len(row.ids) - 1 for row in rows]
        depths = [d if lim is None else min(d, lim) for d, lim in zip(depths, limits)]
        ctxs = [DraftContext(ids=row.ids, sampling=row.req.sampling, generator=row.req.generator, max_depth=d)
                for row, d in zip(rows, depths)]
        trees: list[DraftTree | None] = [None] * len(rows)
        kinds: dict[type, list[int]] = {}
        for i, row in enumerate(rows):
            kinds.setdefault(type(row.drafter), []).append(i)
        for kind, idx in kinds.items():
            many = getattr(kind, "propose_many", None)
            out = many([rows[i].drafter for i in idx], [ctxs[i] for i in idx]) if many and len(idx) > 1 else \
                [rows[i].drafter.propose(ctxs[i]) for i in idx]
            for i, tree in zip(idx, out):
                trees[i] = tree.truncate_depth(depths[i]) if tree.max_depth > depths[i] else tree
        return trees

    def _emit(self, row: _Row, tree: DraftTree, acc: Accepted) -> bool:
        """Emit the row's accepted tokens + bonus (cut at a stop); True when the row is done."""
        step = [int(tree.tokens[i]) for i in acc.nodes[1:]] + [acc.bonus]
        emit, row.stats.stop_reason = cut_at_stop(step, row.new, row.req, self.target.tokenizer)
        row.ids.extend(emit)
        row.new.extend(emit)
        row.stats.count_step(len(tree), len(emit))
        _check_room(row)
        return bool(row.stats.stop_reason)

    def _drop(self, finished: list[_Row]) -> None:
        """Finished rows leave the batch: one copy of the cache, cut to the longest remaining row."""
        if not finished:
            return
        gone = {id(r) for r in finished}
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
            return
        select_rows(self.cache, keep, max(r.length for r in self.rows))

    def _row_result(self, row: _Row) -> GenerationResult:
        st, now = row.stats, time.perf_counter()
        st.new_tokens = len(row.new)
        st.tau = st.new_tokens / max(st.target_forwards, 1)
        st.wall_s = now - row.t_join + st.prefill_s
        st.tokens_per_s = st.new_tokens / (now - row.t_join) if now > row.t_join else 0.0
        tok = self.target.tokenizer
        text = tok.decode(row.new, skip_special_tokens=True) if tok is not None else None
        return GenerationResult(ids=list(row.new), text=text, stats=st, prompt_ids=row.ids[:row.prompt_len])

    def _finish(self, t0: float) -> BatchStats:
        s = self.stats
        s.wall_s = time.perf_counter() - t0
        s.tau = s.new_tokens / max(s.row_forwards, 1)
        s.tokens_per_s = s.new_tokens / s.wall_s if s.wall_s > 0 else 0.0
        s.mean_rows = s.row_forwards / max(s.target_forwards, 1)
        return s


def _check_room(row: _Row) -> None:
    """A row stops at its token cap or when its next token would have no position left."""
    if row.stats.stop_reason:
        return
    if len(row.new) >= row.req.max_new_tokens:
        row.stats.stop_reason = "max_new_tokens"
    elif len(row.ids) >= row.req.window:
        row.stats.stop_reason = "context_window"


def _per_row(value, n: int, name: str) -> list[int]:
    """One value for every row, or one per row."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * n
    values = [int(v) for v in value]
    if len(values) != n:
        raise SpecheadsError(f"generate_batch: {name} has {len(values)} values for {n} prompts")
    return values


def _seeds(seed, n: int) -> list[int | None]:
    """seed None = the global generator; an int = row i draws from seed + i; a list = one seed per row."""
    if seed is None:
        return [None] * n
    if isinstance(seed, int) and not isinstance(seed, bool):
        return [seed + i for i in range(n)]
    return _per_row(seed, n, "seed")


def generate_batch(target, make_drafter: Callable[[], Drafter] | None, prompts: Sequence,
                   max_new_tokens: int | Sequence[int] = 128, *, batch_size: int | None = None,
                   temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                   eos_token_ids: Sequence[int] | None = None, stop_strings: Sequence[str] = (),
                   seed: int | Sequence[int] | None = None, verification: str = "auto", ignore_eos: bool = False,
                   scheduler=None) -> BatchResult:
    """Speculative generation of many prompts (token id lists), at most `batch_size` rows per target forward
    (None = all): a finished row leaves the batch and the next waiting prompt joins. `make_drafter()` builds one
    drafter per row (None = plain decoding). Exact per row at temperature 0; lossless sampling above (row i draws
    from its own generator, seeded seed + i). `scheduler`: scheduling.batch_budget.BudgetScheduler (per-row verify
    budgets)."""
    if not prompts:
        raise SpecheadsError("generate_batch: no prompts")
    g = BatchGenerator(target, make_drafter or Drafter, verification=verification, scheduler=scheduler)
    return g.run(prompts, max_new_tokens, batch_size=batch_size, temperature=temperature, top_p=top_p, top_k=top_k,
                 eos_token_ids=eos_token_ids, stop_strings=stop_strings, seed=seed, ignore_eos=ignore_eos)
