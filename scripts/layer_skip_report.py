"""The layer-skip self-draft on a target (docs/self_speculative.md), untimed: the skip-set search's record (cached, or
run), the chosen set's acceptance per depth on held-out MT-bench first turns (the search's serving walk over the
target's own continuations), and optionally each single sublayer's teacher-forced top-1 agreement with the target
(how much one skipped sublayer costs). Writes layer_skip.json and layer_skip.md into --out (not a bench run:
no results.json).

    python scripts/layer_skip_report.py --target smollm2-135m --dtype bf16 --heldout 16 --sensitivity \
        --out docs/results/layer-skip-smollm2
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specheads.infer.engine.owned import SkipSet
from specheads.infer.scheduling import skipsearch
from specheads.prompts import calibration_prompts, encode_turn, load_prompts
from specheads.target import DTYPES, load_target


def heldout_ids(target, n: int) -> list[list[int]]:
    """n MT-bench first turns after the search's calibration prompts are left out, categories interleaved."""
    prompts = load_prompts("mt-bench")
    calib = {p.id for p in calibration_prompts(prompts)}
    return [encode_turn(target.tokenizer, p, 0, []) for p in prompts if p.id not in calib][:n]


@torch.no_grad()
def sensitivity(owned, seqs, snaps) -> dict[str, float]:
    """Each sublayer skipped alone: the share of continuation tokens whose teacher-forced draft argmax (one pass
    over the continuation, reading the prompt's cached prefix) is the target's token; "none" skips nothing."""
    L = len(owned.layers)
    sets = {"none": SkipSet()}
    sets.update({f"{'a' if a else 'm'}{i}": SkipSet(frozenset([i]) if a else frozenset(),
                                                     frozenset() if a else frozenset([i]))
                 for i in range(L) for a in (True, False)})
    out = {}
    for name, skip in sets.items():
        hits = total = 0
        for snap, (plen, seq) in zip(snaps, seqs):
            owned.restore(snap, room=len(seq))
            logits = owned.draft(torch.tensor(seq[plen - 1:-1]), 0, skip, prefix=plen - 1, logit_rows="all")
            hits += int((logits.float().argmax(-1) == torch.tensor(seq[plen:])).sum())
            total += len(seq) - plen
        out[name] = round(hits / total, 4)
    return out


def markdown(res: dict) -> str:
    s, h = res["search"], res["heldout"]
    lines = [f"# layer-skip on {res['target']} ({res['dtype']})", "",
             f"Search: {s['prompts']} MT-bench calibration prompts x {s['tokens_per_prompt']} tokens, "
             f"{len(s['evaluations'])} of at most {s['budget']} sets measured, {s['search_s']} s "
             f"(verify costs: {s['verify_costs_from']}).", "",
             f"Chosen: `{s['skip']}` ({s['skipped']} of {2 * res['layers']} sublayers), a draft pass reads "
             f"{s['share']:.1%} of a forward's weights; value {s['value']:.3f} of plain decoding at chain "
             f"{s['chain']} ({'pays' if s['pays'] else 'does not pay'}).", "",
             "| sublayers skipped | share | value | alpha_1 | alpha_2 | alpha_3 | alpha_4 |", "|---|---:|---:|---:|---:|---:|---:|"]
    for e in sorted(s["evaluations"], key=lambda e: -e["value"]):
        a = e["acceptance"] + [0.0] * 4
        lines.append(f"| `{e['skip']}` | {e['share']:.3f} | {e['value']:.3f} | " + " | ".join(f"{x:.2f}" for x in a[:4])
                     + " |")
    lines += ["", f"Held out: {h['prompts']} other MT-bench first turns x {h['tokens_per_prompt']} tokens, the chosen "
              "set's acceptance per depth (the serving walk; seen = drafts measured at that depth):", "",
              "| depth | " + " | ".join(str(d + 1) for d in range(len(h["acceptance"]))) + " |",
              "|---|" + "---:|" * len(h["acceptance"]),
              "| alpha | " + " | ".join(f"{a:.3f}" for a in h["acceptance"]) + " |",
              "| seen | " + " | ".join(str(n) for n in h["seen"]) + " |",
              "", f"Expected tokens per unit cost of its best chain on them: {h['value']:.3f} (chain {h['chain']})."]
    if res.get("sensitivity"):
        sens = res["sensitivity"]
        worst = sorted((k for k in sens if k != "none"), key=lambda k: sens[k])
        lines += ["", f"One sublayer skipped alone, teacher-forced top-1 agreement with the target on the held-out "
                  f"continuations (none skipped: {sens['none']:.3f}): best {', '.join(f'{k} {sens[k]:.3f}' for k in worst[::-1][:6])}; "
                  f"worst {', '.join(f'{k} {sens[k]:.3f}' for k in worst[:6])}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--heldout", type=int, default=16, help="held-out MT-bench first turns")
    ap.add_argument("--tokens", type=int, default=skipsearch.SEARCH_TOKENS, help="target tokens per held-out turn")
    ap.add_argument("--search", action="store_true", help="search again (else the cached result when there is one)")
    ap.add_argument("--sensitivity", action="store_true", help="also each sublayer skipped alone (2L teacher passes)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    target = load_target(a.target, dtype=str(DTYPES[a.dtype]).removeprefix("torch."))
    from specheads.prompts import calibration_ids

    rec = skipsearch.load_or_search(target, lambda: calibration_ids(target.tokenizer, load_prompts("mt-bench")),
                                    refresh=a.search)
    owned = skipsearch.owned_model(target)
    t0 = time.perf_counter()
    seqs = skipsearch.continuations(target, heldout_ids(target, a.heldout), a.tokens)
    ev = skipsearch.Evaluator(owned, seqs, rec["verify_costs"] and {int(k): v for k, v in rec["verify_costs"].items()},
                               budget=1)
    skip = SkipSet.parse(rec["skip"], target.num_layers)
    ev(skip)
    held = {**ev.done[skip], "prompts": len(seqs), "tokens_per_prompt": a.tokens}
    res = {"target": a.target, "dtype": str(target.dtype).removeprefix("torch."), "layers": target.num_layers,
           "search": rec, "heldout": held, "heldout_s": round(time.perf_counter() - t0, 1)}
    if a.sensitivity:
        res["sensitivity"] = sensitivity(owned, seqs, ev.snaps)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer_skip.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "layer_skip.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
