"""Speculative generation: prefill -> (draft a tree -> ONE target forward over all nodes -> verify -> keep the accepted
path in the cache -> emit) until a stop condition.

N tree nodes, T sequence, D hidden, V vocab, F feature layers.
Conventions: the prefill caches every prompt token but the last; that last token is the first step's root. So each
step's root is the last emitted token, not yet in the target cache, and `target_forwards` counts tree forwards only
(plain decoding: one per token, tau = 1.00). `ids` in the result are the NEW tokens only.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from specheads.infer.engine.protocol import DraftContext, Drafter, StepClock, StepReport
from specheads.infer.engine.runner import runner_for
from specheads.infer.tree import DraftTree
from specheads.infer.verify import VERIFICATIONS, Accepted, SamplingParams, verifier
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

PHASES = ("draft", "tree", "target", "verify", "cache", "other")
INITIAL_ROOM = 4096  # new-token columns a request's cache starts with at most, beyond its prompt (it grows past)


@dataclass
class ScheduleStats:
    """A scheduler's figures over a request's scheduled steps (scheduling/step.py): what it expected, in tokens and
    in one-token target forwards t(1); for greedy unions of several sources, what each source's own proposal alone
    would have emitted and the oracle that per step takes the better source (more tokens; equal: cheaper), priced
    by the same cost model."""
    scheduled_steps: int = 0
    expected_tau_sum: float = 0.0  # Σ expected tokens per step (1 + Σ p over the verified nodes)
    expected_cost_sum: float = 0.0  # Σ expected step cost, t(n)/t(1) + draft + loop, in t(1)
    source_tokens: dict[str, int] = field(default_factory=dict)  # Σ per source of accepted + bonus, alone
    source_steps: dict[str, int] = field(default_factory=dict)  # steps each source proposed on (not resting)
    oracle_tokens: int = 0  # Σ of the better source's tokens
    oracle_cost_sum: float = 0.0  # Σ of the better source's own step cost alone, t(1)
    oracle_censored: int = 0  # steps where the better source's figure is only a lower bound

    def add(self, report: StepReport) -> None:
        """One scheduled step's expectations."""
        self.scheduled_steps += 1
        self.expected_tau_sum += report.expected_tau
        self.expected_cost_sum += report.expected_cost
        for name, n in report.sources.items():
            self.source_tokens[name] = self.source_tokens.get(name, 0) + n
            self.source_steps[name] = self.source_steps.get(name, 0) + 1
        best = ("plain", 1, report.expected_cost, False) if report.rested else report.oracle()
        if best is not None:
            self.oracle_tokens += best[1]
            self.oracle_cost_sum += best[2]
            self.oracle_censored += int(best[3])


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0  # tree forwards (prefill excluded)
    tau: float = 0.0  # tokens emitted per target forward, bonus included; plain decoding = 1.00
    tokens_per_s: float = 0.0  # new_tokens / (wall_s - prefill_s)
    wall_s: float = 0.0  # whole call, prefill included
    prefill_s: float = 0.0
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[n] = steps that emitted n tokens (n >= 1; the
    # last step counts what it emitted after a stop cut), so sum(hist) = target_forwards, sum(n * hist[n]) = new_tokens
    timings: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})  # seconds per phase
    tree_nodes: int = 0  # total tree nodes sent to the target (root included)
    stop_reason: str = ""  # eos | stop_string | max_new_tokens | context_window
    schedule: ScheduleStats | None = None  # the scheduler's figures; None when no step was scheduled

    def count_step(self, nodes: int, emitted: int, report: StepReport | None = None) -> None:
        """One target forward over `nodes` tree nodes that emitted `emitted` tokens (after a stop cut); `report`:
        the scheduler's expectations for it (None: not scheduled)."""
        self.target_forwards += 1
        self.tree_nodes += nodes
        self.accept_hist.extend([0] * (emitted + 1 - len(self.accept_hist)))
        self.accept_hist[emitted] += 1
        if report is not None:
            if self.schedule is None:
                self.schedule = ScheduleStats()
            self.schedule.add(report)

    def to_dict(self) -> dict:
        """One flat dict (`generate --json`'s "stats"): the core figures, then the schedule's (zeros when no step
        was scheduled), the keys they always had."""
        d = asdict(self)
        d.pop("schedule")
        return {**d, **asdict(self.schedule or ScheduleStats())}


@dataclass
class GenerationResult:
    ids: list[int]  # new token ids (prompt excluded)
    text: str | None  # decoded new tokens (None without a tokenizer)
    stats: GenerationStats
    prompt_ids: list[int] = field(default_factory=list)


def encode_prompt(target, input_ids=None, messages=None, prompt: str | None = None) -> list[int]:
    """input_ids (list / [T] / [1,T] tensor) | chat messages (through the target's template) | plain text."""
    given = sum(x is not None for x in (input_ids, messages, prompt))
    if given != 1:
        raise SpecheadsError("generate: give exactly one of input_ids, messages, prompt")
    if input_ids is not None:
        ids = torch.as_tensor(input_ids).reshape(-1).tolist() if not isinstance(input_ids, list) else list(input_ids)
    else:
        tok = target.tokenizer
        if tok is None:
            raise SpecheadsError(f"target {target.name}: has no tokenizer; pass input_ids")
        if messages is not None:
            from specheads.target import chat_prompt_ids

            ids = chat_prompt_ids(tok, messages)
        else:
            ids = tok(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise SpecheadsError("generate: the prompt is empty")
    return [int(i) for i in ids]


@contextlib.contextmanager
def phase_timer(timings: dict[str, float], phase: str) -> Iterator[None]:
    """Add the seconds the block takes to timings[phase]."""
    t = time.perf_counter()
    try:
        yield
    finally:
        timings[phase] += time.perf_counter() - t


@dataclass
class Request:
    """One call's settings, resolved once: when to stop, how to sample, the verification rule."""

    max_new_tokens: int
    stops: set[int]  # token ids that end generation (emitted themselves)
    stop_strings: Sequence[str]
    window: int  # the target's context window, positions
    sampling: SamplingParams
    generator: torch.Generator | None
    verify: Callable[[DraftTree, torch.Tensor], Accepted]  # verify.verifier(...)
    clock: StepClock = field(default_factory=StepClock)  # each step's seconds by phase: the scheduler's prices


def cut_at_stop(step: list[int], new: list[int], req: Request, tokenizer) -> tuple[list[int], str]:
    """The prefix of `step` to emit and why the row stops after it ("" = it does not): the token cap, a stop
    token (emitted itself) or a stop string (decoded jointly with the tokens before it)."""
    emit: list[int] = []
    for x in step:
        if len(new) + len(emit) >= req.max_new_tokens:
            return emit, "max_new_tokens"
        emit.append(x)
        if x in req.stops:
            return emit, "eos"
        if req.stop_strings and tokenizer is not None:
            tail = tokenizer.decode((new + emit)[-16:])  # multi-byte characters span tokens
            if any(s in tail for s in req.stop_strings):
                return emit, "stop_string"
    return emit, ""


class SpeculativeGenerator:
    """One target, one drafter, one verification rule. `stream(...)` yields lists of new token ids per step;
    after it ends `self.result` holds the GenerationResult. `generate(...)` wraps it."""

    def __init__(self, target, drafter: Drafter | None = None, verification: str = "auto"):
        self.target = target
        self.drafter = drafter or Drafter()  # the base drafter drafts nothing: plain decoding
        if verification not in VERIFICATIONS:
            raise SpecheadsError(f"verification {verification!r}: expected auto, greedy, sampling or typical-lossy")
        self.verification = verification  # auto = greedy at temperature 0, lossless sampling otherwise
        self.result: GenerationResult | None = None
        self.prompt_ids: list[int] = []

    @torch.no_grad()
    def stream(self, input_ids=None, *, messages=None, prompt: str | None = None, max_new_tokens: int = 128,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, eos_token_ids: Sequence[int] | None = None,
               stop_strings: Sequence[str] = (), seed: int | None = None, ignore_eos: bool = False
               ) -> Iterator[list[int]]:
        t_start = time.perf_counter()
        self.result = None
        ids = encode_prompt(self.target, input_ids, messages, prompt)
        self.prompt_ids = list(ids)
        req = self._request(len(ids), max_new_tokens, SamplingParams(float(temperature), float(top_p), int(top_k or 0)),
                            eos_token_ids, stop_strings, seed, ignore_eos)
        stats = GenerationStats()
        runner = self._prefill(ids, stats, min(req.max_new_tokens, req.window - len(ids)))
        new: list[int] = []
        t_gen = time.perf_counter()
        while not stats.stop_reason:
            if len(new) >= req.max_new_tokens:
                stats.stop_reason = "max_new_tokens"
            elif len(ids) >= req.window:
                stats.stop_reason = "context_window"
            else:
                emit = self._step(ids, new, runner, req, stats)
                if emit:
                    yield emit
        self.result = self._result(new, stats, t_start, t_gen)

    def _step(self, ids: list[int], new: list[int], runner, req: Request, stats: GenerationStats) -> list[int]:
        """One speculative step: draft a tree, one target forward over it, verify, keep the accepted path, emit.
        `runner` (engine/runner.py) holds the target's cache: every token but the root (len(ids) - 1 columns)."""
        drafter, tm = self.drafter, stats.timings
        room = req.window - len(ids)  # positions left
        before = dict(tm)  # this step's seconds by phase go to req.clock (what a scheduler's prices are measured from)
        with phase_timer(tm, "draft"):  # a tree whose depth-d nodes sit at position len(ids) - 1 + d (bonus: + 1)
            tree = drafter.propose(DraftContext(ids=ids, sampling=req.sampling, generator=req.generator,
                                                max_depth=room - 1, clock=req.clock))
            tree = tree.truncate_depth(room - 1) if tree.max_depth > room - 1 else tree
        with phase_timer(tm, "tree"):  # each node sees the cached prefix, its ancestors and itself
            plan = runner.tree_inputs(tree)  # positions len(ids) - 1 + depth, the tree's mask
        with phase_timer(tm, "target"):  # ONE forward over all N nodes
            logits, feats = runner.forward(tree.tokens, plan, drafter.feature_layers)  # [N, V], [N, F*D] | None
        with phase_timer(tm, "verify"):
            # greedy: the longest path equal to the target's argmax, plus the bonus argmax; sampling: recursive
            # rejection (accept child x w.p. min(1, p(x)/q(x)), else go on with the residual). Never sees the drafter
            acc = req.verify(tree, logits)
        with phase_timer(tm, "cache"):  # keep prefix + root + accepted nodes
            runner.keep(len(tree), acc.nodes)
        with phase_timer(tm, "draft"):  # the drafter sees the outcome and the accepted nodes' true features
            drafter.recycle(tree.tokens, logits)
            drafter.observe(tree, acc, None if feats is None else feats[acc.nodes])
        with phase_timer(tm, "other"):  # emit accepted tokens + bonus, cut at a stop (the stop token is emitted)
            step = [int(tree.tokens[i]) for i in acc.nodes[1:]] + [acc.bonus]
            emit, stats.stop_reason = cut_at_stop(step, new, req, self.target.tokenizer)
            ids.extend(emit)
            new.extend(emit)
            stats.count_step(len(tree), len(emit), drafter.step_report())
        req.clock.add_step({k: tm[k] - before[k] for k in tm}, len(tree))
        return emit

    def _request(self, prompt_len: int, max_new_tokens: int, sampling: SamplingParams, eos_token_ids,
                 stop_strings: Sequence[str], seed: int | None, ignore_eos: bool) -> Request:
        target = self.target
        window = target.max_positions or (1 << 62)
        if prompt_len >= window:
            raise SpecheadsError(f"prompt: {prompt_len} tokens do not fit the context window of {window} of target "
                                 f"{target.name} (no room for a new token); shorten the prompt")
        generator = None if seed is None else torch.Generator().manual_seed(int(seed))
        stops = set() if ignore_eos else set(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
        return Request(max_new_tokens, stops, stop_strings, window, sampling, generator,
                       verifier(self.verification, sampling, generator))

    def _prefill(self, ids: list[int], stats: GenerationStats, room: int):
        """Cache every prompt token but the last (the first root); the drafter gets the cached positions' features.
        Logits are computed only when the drafter reads the prompt's own (Token Recycling): a 262k vocabulary
        makes them prompt x V x 4 bytes. `room`: the new tokens the request may emit (its cap, within the
        window). -> the target runner (engine/runner.py) holding the cache."""
        t = time.perf_counter()
        runner = runner_for(self.target)
        # the cache grows (doubling) when it must: a huge --max-new-tokens or a 128k window is not allocated up front
        runner.reset(len(ids) + max(0, min(room, INITIAL_ROOM)) + 64)  # + room for one step's tree
        feats = logits = None
        if len(ids) > 1:
            prompt = torch.tensor(ids[:-1])
            logits, feats = runner.forward(prompt, None, self.drafter.feature_layers,
                                           "all" if self.drafter.reads_logits else "none")
            runner.keep(len(ids) - 1, range(len(ids) - 1))
        self.drafter.reset(torch.tensor(ids), feats)
        if logits is not None:  # the prompt's own candidates (Token Recycling)
            self.drafter.recycle(torch.tensor(ids[:-1]), logits)
        stats.prefill_s = time.perf_counter() - t
        return runner

    def _result(self, new: list[int], stats: GenerationStats, t_start: float, t_gen: float) -> GenerationResult:
        now = time.perf_counter()
        stats.new_tokens = len(new)
        stats.wall_s = now - t_start
        stats.tau = stats.new_tokens / max(stats.target_forwards, 1)
        stats.tokens_per_s = stats.new_tokens / (now - t_gen) if now > t_gen else 0.0
        tok = self.target.tokenizer
        text = tok.decode(new, skip_special_tokens=True) if tok is not None else None
        return GenerationResult(ids=new, text=text, stats=stats, prompt_ids=list(self.prompt_ids))


def generate(target, drafter: Drafter | None = None, input_ids=None, *, messages=None, prompt: str | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             eos_token_ids: Sequence[int] | None = None, stop_strings: Sequence[str] = (), streamer=None,
             seed: int | None = None, verification: str = "auto", ignore_eos: bool = False) -> GenerationResult:
    """Speculative generation. Exact at temperature 0 (greedy), lossless above (sampling), unless
    verification='typical-lossy'. eos_token_ids None = the target's own; streamer: any HF streamer (put/end)."""
    g = SpeculativeGenerator(target, drafter, verification=verification)
    it = g.stream(input_ids, messages=messages, prompt=prompt, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_p=top_p, top_k=top_k, eos_token_ids=eos_token_ids,
                  stop_strings=stop_strings, seed=seed, ignore_eos=ignore_eos)
    first = True
    for chunk in it:
        if streamer is not None:
            if first:  # HF streamers expect the prompt first (TextStreamer(skip_prompt=True) drops it)
                streamer.put(torch.tensor([g.prompt_ids]))
                first = False
            streamer.put(torch.tensor(chunk))
    if streamer is not None:
        if first:
            streamer.put(torch.tensor([g.prompt_ids]))
        streamer.end()
    return g.result
