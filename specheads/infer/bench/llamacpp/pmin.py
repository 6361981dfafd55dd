"""The DSpark confidence cut for llama.cpp: `--spec-draft-p-min` chosen from our head's confidences and llama.cpp's
measured verify-cost curve, in the same run.

llama.cpp's draft-dspark decodes the whole block of K slots in one draft forward and sends the slots before the
first whose confidence is below p_min (common/speculative.cpp, draft-dspark; the GGUF carries no temperature, so it
reads the raw σ(z_j)). For a threshold p, a block with raw confidences c_1..c_K whose first A drafts match the
target's greedy continuation sends L(p) = min{j : c_{j+1} < p} drafts and emits 1 + min(A, L(p)) tokens, at a cost

    t(1 + L(p)) + d        t(n): the target verifying n tokens (llama-bench pp n), d: the draft forward (every step)

The chosen p maximises the expected speedup over plain decoding, Σ_b (1 + min(A_b, L_b)) · t(1) / Σ_b (t(1 + L_b) + d),
over the blocks b our head drafts at every position of its greedy continuations of the calibration prompts (torch,
untimed). Candidates: 0 (send every slot) and the midpoints between the observed confidences; a p above them all
sends nothing. The expectation is an estimate: the blocks replayed are every position's, llama.cpp's run visits
only the positions after each accepted prefix, and llama-bench measures t(n) on an empty context.
"""
from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 96  # greedy tokens generated per calibration prompt (its blocks are replayed)
BENCH_REPETITIONS = 3  # llama-bench -r


@dataclass
class Block:
    conf: list[float]  # raw σ(z_j) per slot, as llama.cpp reads them
    accepted: int  # leading drafts equal to the target's greedy continuation


@dataclass
class PMinChoice:
    p_min: float
    expected_speedup: float
    expected_tau: float
    verify_relative: dict[int, float]
    draft_relative: float
    blocks: int
    candidates: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"p_min": self.p_min, "expected_speedup": self.expected_speedup, "expected_tau": self.expected_tau,
                "verify_relative": self.verify_relative, "draft_relative": self.draft_relative,
                "blocks": self.blocks, "candidates": self.candidates, "rule": __doc__.split("\n\n")[1].strip()}


def cut(conf: list[float], p_min: float) -> int:
    """Drafts llama.cpp sends: the slots before the first confidence below p_min."""
    return next((j for j, c in enumerate(conf) if c < p_min), len(conf))


def expected(blocks: list[Block], p_min: float, verify_rel: dict[int, float], draft_rel: float) -> tuple[float, float]:
    """(expected τ, expected speedup over plain decoding) of threshold p_min over the replayed blocks."""
    tokens = cost = 0.0
    for b in blocks:
        n = cut(b.conf, p_min)
        tokens += 1 + min(b.accepted, n)
        cost += verify_rel[1 + n] + draft_rel
    return tokens / len(blocks), tokens / cost


def choose_p_min(blocks: list[Block], verify_rel: dict[int, float], draft_rel: float) -> PMinChoice:
    """The threshold with the best expected speedup (ties: the lower one, more drafts verified)."""
    if not blocks:
        raise SpecheadsError("llama.cpp p-min: no calibration blocks (the calibration prompts produced no tokens)")
    values = sorted({c for b in blocks for c in b.conf})
    grid = [0.0] + [(a + b) / 2 for a, b in zip(values, values[1:])] + [values[-1] + 1e-6]
    rows = []
    for p in grid:
        tau, speedup = expected(blocks, p, verify_rel, draft_rel)
        rows.append({"p_min": p, "expected_tau": tau, "expected_speedup": speedup})
    best = max(rows, key=lambda r: (round(r["expected_speedup"], 9), -r["p_min"]))
    shown = sorted({0, len(rows) - 1, rows.index(best), *range(0, len(rows), max(1, len(rows) // 12))})
    return PMinChoice(best["p_min"], best["expected_speedup"], best["expected_tau"], verify_rel, draft_rel,
                      len(blocks), [rows[i] for i in shown])


@torch.no_grad()
def calibration_blocks(head, target, prompt_ids: list[list[int]], new_tokens: int = CALIBRATION_TOKENS
                       ) -> list[Block]:
    """Every position a of the target's greedy continuation of each prompt whose whole block has known truth: our
    block at a (context = the target's features of rows < a, anchor = token a), its raw confidences and how many
    drafts match tokens a+1...."""
    layers = list(head.config.feature_layers)
    temp, bias = head.conf_temperature.float(), head.conf_bias.float()
    out: list[Block] = []
    for ids in prompt_ids:
        x = torch.tensor([ids], device=target.device)
        seq = target.model.generate(x, max_new_tokens=new_tokens, do_sample=False)[0].tolist()
        hs = target.model(torch.tensor([seq], device=target.device), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i] for i in layers], -1)[0].to(head.head_dtype)  # [T, F*D]
        cache = head.new_cache()
        head.extend_context(cache, feats[:len(ids)])  # the first block is anchored at the prefill's token
        for a in range(len(ids), len(seq) - 1 - head.num_drafts):
            logits, conf = head.draft_block(cache, seq[a])
            toks = head.to_target_ids(logits.argmax(-1)).tolist()
            acc = 0
            while acc < len(toks) and a + 1 + acc < len(seq) and toks[acc] == seq[a + 1 + acc]:
                acc += 1
            raw = torch.sigmoid((torch.logit(conf.float().clamp(1e-7, 1 - 1e-7)) - bias) * temp)  # undo calibration
            out.append(Block(raw.tolist(), acc))
            head.extend_context(cache, feats[a:a + 1])
    return out


def verify_curve(bench_binary: Path, model: Path, n_max: int, threads: int) -> dict[int, float]:
    """llama-bench pp n for n = 1..n_max on the target GGUF: seconds per n-token batch relative to one token, each
    the fastest of its repetitions (llama-bench's samples_ns; its mean when absent): a mean lets one disturbed
    repetition decide, and beside other jobs it priced a 4-token batch at 150x one token and the chosen p-min
    stopped drafting a head whose every draft was accepted."""
    cmd = [str(bench_binary), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, range(1, n_max + 1))),
           "-n", "0", "-r", str(BENCH_REPETITIONS), "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SpecheadsError(f"llama-bench failed ({res.returncode}): {res.stderr.strip()[-300:]}")
    seconds = {int(r["n_prompt"]): min(r.get("samples_ns") or [r["avg_ns"]]) * 1e-9
               for r in json.loads(res.stdout) if r["n_prompt"]}
    missing = [n for n in range(1, n_max + 1) if n not in seconds]
    if missing:
        raise SpecheadsError(f"llama-bench gave no figure for pp {missing}")
    return {n: seconds[n] / seconds[1] for n in range(1, n_max + 1)}


def step_seconds(reply: dict) -> float:
    """Seconds per target forward of one /completion reply (the prefill's token excluded)."""
    t = reply.get("timings") or {}
    steps = int(t.get("predicted_n", 0)) - int(t.get("draft_n_accepted", 0)) - 1
    if steps < 1:
        raise SpecheadsError("llama.cpp p-min: the calibration reply took fewer than two steps")
    return float(t["predicted_ms"]) / 1000.0 / steps
