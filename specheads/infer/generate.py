"""Speculative generation: prefill -> (draft a tree -> ONE target forward over all nodes -> verify -> keep the accepted
path in the cache -> emit) until a stop condition.

N tree nodes, T sequence, D hidden, V vocab, F feature layers.
Conventions: the prefill caches every prompt token but the last; that last token is the first step's root. So each
step's root is the last emitted token, not yet in the target cache, and `target_forwards` counts tree forwards only
(plain decoding: one per token, tau = 1.00). `ids` in the result are the NEW tokens only.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import torch

from specheads.infer.cache import keep_accepted, prepare_cache, tree_attention_mask
from specheads.infer.drafters import DraftContext, Drafter, NoDrafter
from specheads.infer.verify import (SamplingParams, verify_greedy, verify_sampling,
                                    verify_typical_lossy)
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

PHASES = ("draft", "tree", "target", "verify", "cache", "other")


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
    stop_reason: str = ""  # eos | stop_token | stop_string | max_new_tokens | context_window

    def to_dict(self) -> dict:
        return asdict(self)


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


class SpeculativeGenerator:
    """One target, one drafter, one verification rule. `stream(...)` yields lists of new token ids per step;
    after it ends `self.result` holds the GenerationResult. `generate(...)` wraps it."""

    def __init__(self, target, drafter: Drafter | None = None, verification: str = "auto"):
        self.target = target
        self.drafter = drafter or NoDrafter()
        if verification not in ("auto", "greedy", "sampling", "typical-lossy"):
            raise SpecheadsError(f"verification {verification!r}: expected auto, greedy, sampling or typical-lossy")
        self.verification = verification  # auto = greedy at temperature 0, lossless sampling otherwise
        self.result: GenerationResult | None = None
        self.prompt_ids: list[int] = []

    # -- one target forward over the whole tree ------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, mask, pos, cache, want_features: bool):
        model = self.target.model
        dev = self.target.device
        out = model(input_ids=tokens[None].to(dev), attention_mask=mask, position_ids=pos, cache=cache,
                    use_cache=True, output_hidden_states=want_features)
        feats = None
        if want_features:
            hs = out.hidden_states  # tuple of L+1 [1, n, D]; hs[L] is post-norm (the lm_head input)
            feats = torch.cat([hs[l][0] for l in self.drafter.feature_layers], dim=-1)  # [n, F*D]
        return out.logits[0], feats  # [n, V], [n, F*D] | None

    def _cut(self, step: list[int], new: list[int], max_new_tokens: int, stops: set[int],
             stop_strings: Sequence[str]) -> tuple[list[int], str]:
        """The prefix of `step` to emit and why generation stops after it ("" = it does not)."""
        tok = self.target.tokenizer
        emit: list[int] = []
        for x in step:
            if len(new) + len(emit) >= max_new_tokens:
                return emit, "max_new_tokens"
            emit.append(x)
            if x in stops:
                return emit, "eos"
            if stop_strings and tok is not None:
                tail = tok.decode((new + emit)[-16:])  # joint decode: multi-byte characters span tokens
                if any(s in tail for s in stop_strings):
                    return emit, "stop_string"
        return emit, ""

    @torch.no_grad()
    def stream(self, input_ids=None, *, messages=None, prompt: str | None = None, max_new_tokens: int = 128,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, eos_token_ids: Sequence[int] | None = None,
               stop_strings: Sequence[str] = (), seed: int | None = None, ignore_eos: bool = False
               ) -> Iterator[list[int]]:
        t_start = time.perf_counter()
        self.result = None
        target, drafter = self.target, self.drafter
        ids = encode_prompt(target, input_ids, messages, prompt)
        prompt_len = len(ids)
        self.prompt_ids = list(ids)
        window = target.max_positions or (1 << 62)
        if prompt_len >= window:
            raise SpecheadsError(f"prompt: {prompt_len} tokens do not fit the context window of {window} of target "
                                 f"{target.name} (no room for a new token); shorten the prompt")
        sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k or 0))
        mode = self.verification if self.verification != "auto" else ("greedy" if sampling.greedy else "sampling")
        if mode == "sampling" and sampling.greedy:
            raise SpecheadsError("temperature 0 is greedy: verification='sampling' needs temperature > 0")
        gen = None
        if seed is not None:
            gen = torch.Generator().manual_seed(int(seed))
        stops = set() if ignore_eos else set(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
        stats = GenerationStats()
        tm = stats.timings
        want = drafter.feature_layers is not None
        from transformers import DynamicCache

        # prefill every prompt token but the last (the first root)
        t0 = time.perf_counter()
        cache = DynamicCache(config=target.model.config)
        prepare_cache(cache)
        feats = None
        if prompt_len > 1:
            p_ids = torch.tensor(ids[:-1])
            _, feats = self._forward(p_ids, None, torch.arange(prompt_len - 1, device=target.device)[None], cache, want)
        drafter.reset(torch.tensor(ids), feats)
        stats.prefill_s = time.perf_counter() - t0
        new: list[int] = []
        verify = {"greedy": lambda tr, lg: verify_greedy(tr, lg),
                  "sampling": lambda tr, lg: verify_sampling(tr, lg, sampling, gen),
                  "typical-lossy": lambda tr, lg: verify_typical_lossy(tr, lg, sampling, gen)}[mode]
        t_gen = time.perf_counter()
        while not stats.stop_reason:
            cache_len, room = len(ids) - 1, window - len(ids)  # all but the root is cached; room = positions left
            if len(new) >= max_new_tokens or room <= 0:
                stats.stop_reason = "max_new_tokens" if len(new) >= max_new_tokens else "context_window"
                break
            t0 = time.perf_counter()
            # 1. draft: a tree whose depth-d nodes sit at position cache_len + d (their bonus at cache_len + d + 1)
            tree = drafter.propose(DraftContext(ids=ids, sampling=sampling, generator=gen, max_depth=room - 1))
            tree = tree.truncate_depth(room - 1) if tree.max_depth > room - 1 else tree
            t1 = time.perf_counter()
            # 2. one target forward over all N nodes: each sees the cached prefix, its ancestors and itself
            mask = tree_attention_mask(tree, cache, cache_len, target.dtype, target.device)  # [1,1,N,cache_len+N]
            pos = tree.position_ids(cache_len, device=target.device)  # [1, N]
            t2 = time.perf_counter()
            logits, feats = self._forward(tree.tokens, mask, pos, cache, want)  # [N, V], [N, F*D] | None
            t3 = time.perf_counter()
            # 3. verify: greedy = longest path equal to the target's argmax + bonus; sampling = recursive rejection
            #    (accept child x w.p. min(1, p(x)/q(x)), else continue on the residual); both never see the drafter
            acc = verify(tree, logits)
            t4 = time.perf_counter()
            # 4. keep prefix + root + accepted nodes in the cache; the drafter sees the outcome (and true features)
            keep_accepted(cache, len(tree), acc.nodes)
            t5 = time.perf_counter()
            drafter.observe(tree, acc, None if feats is None else feats[acc.nodes])
            t6 = time.perf_counter()
            # 5. emit accepted tokens + bonus, cut at a stop (the stop token itself is emitted, as HF does)
            step = [int(tree.tokens[i]) for i in acc.nodes[1:]] + [acc.bonus]
            emit, stats.stop_reason = self._cut(step, new, max_new_tokens, stops, stop_strings)
            ids.extend(emit)
            new.extend(emit)
            stats.target_forwards += 1
            stats.tree_nodes += len(tree)
            stats.accept_hist.extend([0] * (len(emit) + 1 - len(stats.accept_hist)))
            stats.accept_hist[len(emit)] += 1  # emitted (after a stop cut): sum(n * hist[n]) = new_tokens, mean = tau
            for phase, dt in (("draft", t1 - t0 + t6 - t5), ("tree", t2 - t1), ("target", t3 - t2),
                              ("verify", t4 - t3), ("cache", t5 - t4), ("other", time.perf_counter() - t6)):
                tm[phase] += dt
            if emit:
                yield emit
        now = time.perf_counter()
        stats.new_tokens = len(new)
        stats.wall_s = now - t_start
        gen_s = now - t_gen
        stats.tau = stats.new_tokens / max(stats.target_forwards, 1)
        stats.tokens_per_s = stats.new_tokens / gen_s if gen_s > 0 else 0.0
        tok = target.tokenizer
        text = tok.decode(new, skip_special_tokens=True) if tok is not None else None
        self.result = GenerationResult(ids=new, text=text, stats=stats, prompt_ids=ids[:prompt_len])


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
